"""Run one test suite as CTest registers it (see CMakeLists.txt).

    python test/python/run_suite.py cpu [pytest args]   every non-GPU test, L0 and L1
    python test/python/run_suite.py gpu [pytest args]   the GPU tests; exit 77 (CTest: skipped)
                                                         when no CUDA device is present
"""
import sys
from pathlib import Path

import pytest

SKIPPED = 77
MARKERS = {"cpu": "(L0 or L1) and not gpu", "gpu": "(L0 or L1) and gpu"}


def main(argv):
    if not argv or argv[0] not in MARKERS:
        print(__doc__)
        return 2
    suite, extra = argv[0], argv[1:]
    if suite == "gpu":
        import torch

        if not torch.cuda.is_available():
            print("run_suite: no CUDA device, GPU suite skipped")
            return SKIPPED
    here = Path(__file__).resolve().parent
    return int(pytest.main(["-m", MARKERS[suite], "-p", "no:cacheprovider", str(here), *extra]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
