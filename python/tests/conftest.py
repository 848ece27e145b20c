import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# In-tree runs: let `pytest python/tests` find the package without installing it.
_pkg_root = HERE.parent
if str(_pkg_root) not in sys.path:
    try:
        import kvattn  # noqa: F401  (availability probe)
    except ImportError:
        sys.path.insert(0, str(_pkg_root))


@pytest.fixture
def rng(request):
    # Seeded per test (stable across runs) so a failure replays exactly.
    seed = abs(hash(request.node.nodeid)) % (2 ** 31) if os.environ.get("KVATTN_TEST_RANDOM") else \
        sum(map(ord, request.node.nodeid)) % (2 ** 31)
    return np.random.default_rng(seed)


def workspace(nbytes=16 << 20):
    return np.zeros(nbytes, dtype=np.uint8)
