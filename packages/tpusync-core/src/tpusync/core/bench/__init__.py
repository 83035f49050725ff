"""Benchmarks behind ``tpusync bench <suite> --json``.

CONVENTION (every suite): JSON on stdout; for each measured path an object with its figure
(``gbps`` or a latency), the reference measured in the same run (``limit_gbps`` plus a ``limit``
string saying what it was), ``ratio`` = figure / reference and ``better`` ("higher" or "lower").
Progress goes to stderr so stdout stays parseable.
"""

from tpusync.core.bench.common import measure, progress, result_entry

__all__ = ["measure", "progress", "result_entry"]
