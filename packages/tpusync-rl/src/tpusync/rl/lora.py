"""LoRA adapter versions from a trainer into a running inference engine (engine-agnostic part).

An RL loop that trains a LoRA adapter (PEFT) moves only the adapter instead of the model
(84 MB for Llama-3-8B at rank 16). vLLM and SGLang both serve adapters they load from a PEFT
directory (``adapter_config.json`` plus ``adapter_model.safetensors``) under a name, while they
run. :class:`AdapterSync` is the sampler side: one :class:`~tpusync.rl.sampler.SamplerSync` in
the process that holds the engine (or a client on the host of a server), which pulls each
version the trainer publishes, checks every digest, writes it as a PEFT directory and has the
engine load it through an :class:`AdapterLoader` before the version counts as served. The
loaders are the engines' own: :class:`tpusync.rl.vllm.lora.LoraSync` (an offline ``vllm.LLM``
or a vLLM server) and ``tpusync.sglang.lora.LoraSync`` (an SGLang server).

The trainer publishes the adapter's tensors under PEFT's names (``get_peft_model_state_dict``:
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) with a
:class:`~tpusync.rl.trainer.TrainerSync` built with ``dst_layouts=None`` (this sampler reports
the whole of each tensor) or with :func:`lora_layouts`. Each engine is one sampler replica of
one rank (its tensor-parallel ranks read the directory themselves); several engines fan out by
the trainer's chain or tree like any samplers.

ADAPTER VERSION CONTRACT: version ``v`` is served as its own adapter, named ``<name>-v<v>`` with
integer id ``id_offset + v``, in its own directory under ``root``. A request carries one adapter,
so it runs on one version whole; requests made with the previous version keep it, with no pause
of the engine. The directory is written only after every digest verified (to a temporary name,
then renamed), and the loader has the engine load it before the version is committed. An adapter
the engine refuses (a rank above its maximum, a target module the model lacks, a shape that does
not fit, a server without runtime LoRA loading) rejects the version: the trainer's report says
why, the directory is removed and the previous version stays the one served (GROUP COMMIT
CONTRACT of the sampler). What the loader can tell before anything moves (LoRA off, a rank above
the engine's maximum) refuses the construction instead. The newest ``keep`` versions stay; older
directories are deleted and unloaded from the engine, so a request must not name a version more
than ``keep - 1`` behind.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from tpusync.rl.chunks import UpdateRejectedError, WeightSubscriber, _torch_dtype
from tpusync.rl.layout import ShardLayout
from tpusync.rl.reports import listed
from tpusync.rl.sampler import SamplerSync

log = logging.getLogger("tpusync.rl")

_LORA = re.compile(r"\.lora_(A|B)\.weight$")
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class AdapterVersion(NamedTuple):
    """One served adapter version (ADAPTER VERSION CONTRACT)."""

    version: int
    name: str  # the engine's adapter name (vLLM's lora_name, SGLang's lora_name / lora_path)
    lora_int_id: int
    path: str  # the PEFT directory the engine loads


class AdapterLoader(Protocol):
    """How one engine takes adapter versions (implemented per engine)."""

    engine: str  # the engine's name in messages ("vLLM", "SGLang")

    def check(self, rank: int) -> None:
        """ValueError when the engine could never serve this sampler's versions (LoRA off, a
        ``rank`` above its maximum); called before the sampler contacts any trainer."""

    def load(self, adapter: AdapterVersion) -> None:
        """Have the engine load ``adapter``; raise (with the engine's reason) when it refuses."""

    def unload(self, adapter: AdapterVersion) -> None:
        """Drop an old version from the engine; raise RuntimeError / ConnectionError on failure
        (logged by the caller, not fatal)."""


def lora_layouts(params: Mapping[str, Any]) -> dict[str, ShardLayout]:
    """The trainer's ``dst_layouts`` for LoRA samplers: each tensor whole to sampler rank 0
    (``params``: ``{name: [shape, dtype]}``)."""
    return {n: ShardLayout.replicated(shape, [0]) for n, (shape, _dtype) in params.items()}


# Config features the engines' LoRA loaders refuse (vLLM's and SGLang's): refused at
# construction, before any version moves, instead of rejecting every version at load.
_UNSERVED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias vectors (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
}


def _module_rank(stem: str, config: Mapping[str, Any]) -> int:
    """The rank PEFT gives module ``stem``: the first ``rank_pattern`` key that matches the
    end of its dotted name (PEFT's pattern rule), else ``r``."""
    for key, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", stem):
            return rank
    return config.get("r")


def _targeted(stem: str, targets: Any) -> bool:
    """Whether a list of ``target_modules`` names module ``stem`` (PEFT: the whole name or its
    dotted tail); a regex string or "all-linear" is not judged here (True)."""
    if not isinstance(targets, list | tuple | set):
        return True
    return any(stem == t or stem.endswith(f".{t}") for t in targets)


def check_adapter(config: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    """The adapter's largest rank, or ValueError naming what does not make a PEFT LoRA adapter
    of ``params`` (``{name: [shape, dtype]}``) with ``config`` (its ``adapter_config.json``).
    Each module's lora_A / lora_B pair has the rank PEFT gives that module: the first matching
    ``rank_pattern`` key's, else ``r`` (RANK RULE: any of the config's ranks was accepted for
    any module before, and vLLM then served a pair of rank 8 where the pattern said 4, with the
    scaling of rank 4). A module not in a list of ``target_modules`` and the config features no
    engine serves (DoRA, LoRA bias, ``modules_to_save``, a ``bias`` other than "none") are
    refused too."""
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"adapter config has peft_type {config.get('peft_type')!r}: tpusync's LoRA sync "
            "serves PEFT 'LORA' adapters only"
        )
    for key, what in _UNSERVED.items():
        if config.get(key):
            raise ValueError(f"adapter config asks for {what}, which vLLM and SGLang do not serve")
    if config.get("bias", "none") not in (None, "none"):
        raise ValueError(
            f"adapter config has bias={config.get('bias')!r}: vLLM and SGLang serve LoRA "
            "adapters without bias only ('none')"
        )
    ranks = {config.get("r"), *(config.get("rank_pattern") or {}).values()}
    if not all(isinstance(r, int) and r >= 1 for r in ranks):
        raise ValueError(
            f"adapter config has r={config.get('r')!r}, rank_pattern="
            f"{config.get('rank_pattern')!r}: every LoRA rank must be an integer >= 1"
        )
    if not params:
        raise ValueError("the adapter has no tensors")
    pairs: dict[str, dict[str, int]] = {}
    for name, (shape, _dtype) in params.items():
        found = _LORA.search(name)
        if found is None:
            raise ValueError(
                f"{name}: not a LoRA tensor (PEFT names end in .lora_A.weight or .lora_B.weight)"
            )
        side, stem = found[1], name[: found.start()]
        held = None if len(shape) != 2 else shape[0] if side == "A" else shape[1]
        want = _module_rank(stem, config)
        if held != want:
            raise ValueError(
                f"{name}: shape {list(shape)} does not hold this module's rank {want} (r, or "
                "the first rank_pattern key matching its name; lora_A is [r, in], lora_B is "
                "[out, r])"
            )
        if not _targeted(stem, config.get("target_modules")):
            raise ValueError(
                f"{name}: module {stem} is not one of the config's target_modules "
                f"{sorted(config.get('target_modules'))}"
            )
        pairs.setdefault(stem, {})[side] = held
    lone = sorted(f"{stem}.lora_{'B' if 'A' in sides else 'A'}.weight"
                  for stem, sides in pairs.items() if len(sides) == 1)  # fmt: skip
    if lone:
        raise ValueError(f"the adapter lacks {len(lone)} tensors of its A/B pairs: {listed(lone)}")
    for stem, sides in pairs.items():
        if sides["A"] != sides["B"]:
            raise ValueError(
                f"{stem}: lora_A has rank {sides['A']} but lora_B has rank {sides['B']}"
            )
    return max(ranks)


class AdapterSync:
    """An engine's sampler of LoRA adapter versions (ADAPTER VERSION CONTRACT).

    ``config``: the adapter's PEFT config (``adapter_config.json`` as a dict), the same for every
    version; ``params``: ``{name: [shape, dtype]}`` of its tensors under PEFT names (e.g.
    :func:`tpusync.rl.vllm.checkpoint_params` of a saved adapter directory). ``loader``: the
    engine's :class:`AdapterLoader` (``None``: the directories are only written). ``root``:
    where the version directories go (default a new directory in /dev/shm, or the temp dir;
    removed by :meth:`close` only when made here); a server must see it (same host or a shared
    filesystem). Other keyword arguments go to :class:`~tpusync.rl.sampler.SamplerSync`
    (``control`` and ``replica`` are required).
    """

    version_type: ClassVar[type[AdapterVersion]] = AdapterVersion

    def __init__(
        self,
        config: Mapping[str, Any],
        params: Mapping[str, Any],
        *,
        loader: AdapterLoader | None = None,
        root: str | Path | None = None,
        name: str = "tpusync-lora",
        id_offset: int = 0,
        keep: int = 2,
        **sampler: Any,
    ) -> None:
        self.rank = check_adapter(config, params)
        if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}", name):
            raise ValueError(
                f"adapter name {name!r}: 1-100 of letters, digits, '_', '-' and '.', not starting "
                "with '.' (it names each version's directory and the engine's adapter)"
            )
        try:  # every version is written with it: missing, no version could be served
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            raise ImportError(f"LoRA adapter sync writes safetensors files: {e}") from None
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        if id_offset < 0:
            raise ValueError(f"id_offset must be >= 0, not {id_offset}")
        if loader is not None:
            loader.check(self.rank)
        self._config = dict(config)
        self._loader = loader
        self._name, self._offset, self._keep = name, id_offset, keep
        weights = {
            n: torch.zeros(shape, dtype=_torch_dtype(str(dt))) for n, (shape, dt) in params.items()
        }
        # WHOLE VERSION RULE (chunks.py): each version's directory is written whole, so a full
        # version must carry every tensor (one left out was served as zeros or its old value).
        sub = WeightSubscriber(
            0, weights, lora_layouts(params), mode="shadow", recycle=True, whole=True
        )
        self.sampler = SamplerSync(sub, **sampler)
        self._made_root = root is None
        if root is None:
            shm = Path("/dev/shm")
            root = tempfile.mkdtemp(prefix="tpusync-lora-", dir=shm if shm.is_dir() else None)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # OWN DIRECTORY RULE: this sampler's versions go into a directory of its own under
        # ``root``; two samplers sharing a root (the default name) replaced and deleted each
        # other's version directories, so an engine reloading one served the other's adapter.
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))
        self.current: AdapterVersion | None = None
        self._served: list[AdapterVersion] = []  # oldest first, at most ``keep``

    @property
    def version(self) -> int:
        """The version served (0: none yet)."""
        return self.sampler.version

    def update(self, timeout: float, version: int | None = None) -> AdapterVersion:
        """Wait up to ``timeout`` s for a newer adapter version, write it, load it, commit it.

        Raises TimeoutError when none was announced in time and UpdateRejectedError when it was
        rejected (a digest, the engine's load); either way :attr:`current` is still served.
        ``version``: the one expected (a warning when another arrives; refused when already
        served).
        """
        if version is not None and self.version >= version:
            raise UpdateRejectedError(
                f"adapter version {version} requested but this sampler already serves "
                f"{self.version}"
            )
        staged: list[AdapterVersion] = []

        def confirm(v: int) -> str | None:
            adapter = self._write(v, self.sampler.sub.staged())
            if self._loader is not None:
                try:
                    self._loader.load(adapter)
                except Exception as e:  # noqa: BLE001 - the version is rejected, with the reason
                    shutil.rmtree(adapter.path, ignore_errors=True)
                    return (
                        f"{self._loader.engine} did not load adapter version {v}: "
                        f"{type(e).__name__}: {e}"
                    )
            staged.append(adapter)
            return None

        result = self.sampler.update(timeout, confirm=confirm)
        if result is None:
            raise TimeoutError(
                f"no adapter version newer than {self.version} was announced within {timeout} s"
            )
        if not result.ok:
            for adapter in staged:  # verified and loaded, but the commit failed
                self._unload(adapter)
                shutil.rmtree(adapter.path, ignore_errors=True)
            raise UpdateRejectedError(
                f"adapter version {result.version} rejected: {result.reason}; still serving "
                f"version {self.version}"
            )
        if version is not None and result.version != version:
            log.warning("asked for adapter version %d, version %d arrived", version, result.version)
        self.current = staged[0]
        self._served.append(self.current)
        for old in self._served[: -self._keep]:
            self._unload(old)
            shutil.rmtree(old.path, ignore_errors=True)
        self._served = self._served[-self._keep :]
        log.info("LoRA adapter version %d served from %s", result.version, self.current.path)
        return self.current

    def _unload(self, adapter: AdapterVersion) -> None:
        """Drop an old version from the engine (logged, not raised, when that fails)."""
        if self._loader is None:
            return
        try:
            self._loader.unload(adapter)
        except (RuntimeError, ConnectionError) as e:
            log.warning("LoRA adapter version %d not unloaded: %s", adapter.version, e)

    def _write(self, version: int, tensors: Mapping[str, torch.Tensor]) -> AdapterVersion:
        """Version ``version``'s PEFT directory, written under a temporary name, then renamed."""
        from safetensors.torch import save_file

        name = f"{self._name}-v{version}"
        final = self.dir / name
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.dir))
        try:
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / ADAPTER_FILE))
            (tmp / CONFIG_FILE).write_text(json.dumps(self._config, indent=1))
            tmp.rename(final)  # never there: versions only rise, in a directory of our own
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.version_type(version, name, self._offset + version, str(final))

    def close(self, timeout: float = 30.0) -> None:
        """Leave the trainer's group. The engine keeps serving the versions it loaded, from
        their directories; ``root`` (with them) is removed only when it was made here."""
        self.sampler.close(timeout)
        if self._made_root:
            shutil.rmtree(self.root, ignore_errors=True)
