"""Make this suite's helper modules (store_blocks) importable from its test modules.

The suite runs with ``--import-mode=importlib``, which keeps test directories off ``sys.path``.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
