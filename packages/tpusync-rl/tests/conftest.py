"""Make the process helpers (rl_netutil) importable here and in spawned children.

The suite runs with ``--import-mode=importlib``, which keeps test directories off ``sys.path``;
the network tests' child processes (spawn start method) import their entry points by module
name, and inherit ``sys.path`` from this process.
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
