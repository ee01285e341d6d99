"""Settings every test process needs before anything imports torch or triton."""

import os

# Triton kernels run on the CPU through Triton's interpreter; it must be chosen before any kernel is
# launched (otherwise Triton finds "0 active drivers"). Only Triton reads this variable.
os.environ.setdefault("TRITON_INTERPRET", "1")
