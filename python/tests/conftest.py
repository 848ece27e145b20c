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


def _test_seed(nodeid):
    # Per test and stable across runs (KVATTN_TEST_RANDOM=1: per process), so a failure replays exactly.
    return abs(hash(nodeid)) % (2 ** 31) if os.environ.get("KVATTN_TEST_RANDOM") else \
        sum(map(ord, nodeid)) % (2 ** 31)


@pytest.fixture
def rng(request):
    seed = _test_seed(request.node.nodeid)
    print("numpy seed %d (%s)" % (seed, request.node.nodeid))  # shown with a failure's captured output
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _torch_seed(request):
    # Tests that draw from torch's global generators (torch.randn, CPU and CUDA) get the same per-test seed; torch is
    # only seeded where a test module already imported it (this file never imports torch).
    torch = sys.modules.get("torch")
    if torch is not None:
        seed = _test_seed(request.node.nodeid)
        torch.manual_seed(seed)
        print("torch seed %d (%s)" % (seed, request.node.nodeid))
    yield


def workspace(nbytes=16 << 20):
    return np.zeros(nbytes, dtype=np.uint8)
