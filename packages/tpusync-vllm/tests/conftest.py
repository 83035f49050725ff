import sys
from pathlib import Path

# The scenario helpers and the tiny-model generator sit beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
