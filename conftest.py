"""Test-suite wide pytest hooks (every test directory of the repository sits below this file).

EXTENDED TESTS RULE: a test marked ``@pytest.mark.extended`` is skipped, with its reason in the
summary (``-ra``), unless ``TPUSYNC_EXTENDED_TESTS=1``. The mark is for live variants that
repeat a path CI already crosses with another size or model family; CI runs on 2 vCPUs within
90 minutes and cannot hold them all. docs/design-decisions.md (the decision "CI runs one live
variant of each path") lists them and what CI runs instead; run them with
``TPUSYNC_EXTENDED_TESTS=1 bash ci/nox.sh -s integration-vllm integration-sglang``.
"""

from __future__ import annotations

import os

import pytest

EXTENDED = os.environ.get("TPUSYNC_EXTENDED_TESTS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if EXTENDED:
        return
    skip = pytest.mark.skip(reason="extended test: set TPUSYNC_EXTENDED_TESTS=1 to run it")
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)
