"""TEST-ONLY CPU stand-ins that let SGLang's CUDA-first modules import on a CPU-only machine.

NOTHING HERE IS PART OF tpusync-sglang. These stand-ins exist only so the integration's test
suite can import real SGLang objects on CI machines without a GPU:

- ``torchvision``: SGLang imports it at module level (multimodal processors reached from its
  config package), but the only torchvision wheels that match the CPU torch build we pin are CUDA
  builds whose native ops fail to register against a CPU torch. The stand-in makes the import
  succeed; any *use* raises :class:`ShimUsedError`, so a test that really needed torchvision fails
  loudly instead of passing on a fake.

Rejected alternative: installing PyPI's torchvision. Its wheel is built against the CUDA torch of
the same release and raises ``operator torchvision::nms does not exist`` on the CPU build.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUBBED_PACKAGES = ("torchvision",)


class ShimUsedError(RuntimeError):
    """Code under test used a test-only stand-in; the test needs the real package."""


class _Placeholder:
    """Any attribute of a stubbed module: importable, raises on use."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ShimUsedError(
            f"{self._qualname} was called, but it is a test-only CPU stand-in (tpusync-sglang "
            "tests/support/cpu_shim.py); install the real package for this code path"
        )

    def __repr__(self) -> str:
        return f"<test-only shim {self._qualname}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib API
        if fullname.split(".")[0] not in STUBBED_PACKAGES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001 - importlib API
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__tpusync_test_shim__ = True
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001 - importlib API
        return None


_FINDER = _StubFinder()


def install() -> None:
    """Register the stand-ins for packages that are not really installed (idempotent)."""
    import importlib.util

    for name in STUBBED_PACKAGES:
        if name in sys.modules or _FINDER in sys.meta_path:
            continue
        if importlib.util.find_spec(name) is not None:
            continue  # the real package is present: use it
        _pin_transformers_availability()
        sys.meta_path.append(_FINDER)


def _pin_transformers_availability() -> None:
    """Make transformers decide "torchvision is absent" BEFORE the stand-in becomes findable.

    transformers caches its availability probes (lru_cache), so asking once now pins the honest
    answer; otherwise it would see the stand-in, think torchvision is installed and try to use it.
    """
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    for probe in ("is_torchvision_available", "is_torchvision_v2_available"):
        fn = getattr(import_utils, probe, None)
        if fn is not None:
            fn()
