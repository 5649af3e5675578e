"""Triton where it is installed: the one optional import the kernel modules share, and the check
their dispatch makes (the kernels need a CUDA tensor; Triton's CPU interpreter is for tests)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def triton_available(device: torch.device) -> bool:
    """Whether a Triton kernel can run for tensors on ``device``."""
    return triton is not None and device.type == "cuda"
