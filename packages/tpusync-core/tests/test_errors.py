import builtins

import tpusync.core as tc
from tpusync.core import errors


def test_every_native_code_has_a_class_deriving_from_the_base():
    for code in [
        "InvalidArgument",
        "PoolExhausted",
        "NotFound",
        "AlreadyExists",
        "FailedPrecondition",
        "Timeout",
        "Cancelled",
        "IOError",
        "NoSpace",
        "Corrupted",
        "Unavailable",
        "PermissionDenied",
        "VersionMismatch",
        "Internal",
    ]:
        cls = errors.error_class(code)
        assert issubclass(cls, tc.TpusyncError)
    assert len({errors.error_class(c) for c in errors._BY_CODE}) == len(errors._BY_CODE)


def test_builtin_compatibility():
    assert issubclass(tc.TimeoutError, builtins.TimeoutError)
    assert issubclass(tc.PoolExhaustedError, MemoryError)
    assert issubclass(tc.InvalidArgumentError, ValueError)
    assert issubclass(tc.NoSpaceError, OSError)
    assert issubclass(tc.UnavailableError, ConnectionError)
    assert errors.error_class("NoSuchCode") is tc.InternalError


def test_require_api_gate():
    tc.require_api(tc.API_VERSION, "tpusync-test")
    try:
        tc.require_api(tc.API_VERSION + 1, "tpusync-future")
    except ImportError as e:
        assert "tpusync-future needs tpusync-core with API version" in str(e)
    else:
        raise AssertionError("require_api accepted a newer API than the core offers")


def test_checksum64_bytes_and_arrays_agree():
    import numpy as np

    a = np.arange(1000, dtype=np.float32)
    assert tc.checksum64(a) == tc.checksum64(a.tobytes())
    b = a.copy()
    b[500] = -1
    assert tc.checksum64(a) != tc.checksum64(b)
    assert tc.checksum64(a, seed=1) != tc.checksum64(a)
