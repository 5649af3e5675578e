"""Triton where it can run: the one optional import the kernel modules share, and the check their
dispatch makes (the kernels need a CUDA tensor; Triton's CPU interpreter is for tests).

A torch built without CUDA (or ROCm) never holds a CUDA tensor, so there Triton is imported only
for its interpreter (``TRITON_INTERPRET=1``): every process of a CPU run (the test suite starts
hundreds of ranks) would otherwise pay Triton's import for kernels it cannot launch.
"""

from __future__ import annotations

import os

import torch

triton = tl = None
if torch.version.cuda or torch.version.hip or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:
        triton = tl = None


def triton_available(device: torch.device) -> bool:
    """Whether a Triton kernel can run for tensors on ``device``."""
    return triton is not None and device.type == "cuda"
