"""Print which backend each kernel runs here, what its check against the torch reference found, and why the
faster ones were skipped."""

import logging
import sys

import torch

from megascale.core.kernels import describe

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
device = "cuda" if torch.cuda.is_available() else "cpu"
for name, backend in describe(device, checks=True).items():
    print(f"{name:>14}: {backend}")
