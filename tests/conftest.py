"""Settings every test process needs before anything imports torch or triton."""

import os

# Triton kernels run on the CPU through Triton's interpreter; it must be chosen before any kernel is
# launched (otherwise Triton finds "0 active drivers"). Only Triton reads this variable.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--seeds",
        type=int,
        default=1,
        help="conformance matrix: model shapes drawn from seeds 0..N-1 for every cell (CI runs 1)",
    )
