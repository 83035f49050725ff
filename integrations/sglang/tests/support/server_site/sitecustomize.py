"""TEST-ONLY: installs the CPU server shim in every process of a spawned SGLang test server.

On PYTHONPATH only for the server processes the HiCache server test starts, and only acts when
``TPUSYNC_SGLANG_CPU_SHIM=1``; see ``support/cpu_server_shim.py`` for what is replaced and why.
"""

import os
import sys

if os.environ.get("TPUSYNC_SGLANG_CPU_SHIM") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cpu_server_shim

    cpu_server_shim.install()
