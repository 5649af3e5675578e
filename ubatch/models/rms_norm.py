"""RMSNorm, alone and after a residual add, computed in float32 and returned in the input dtype.

Why a kernel: eagerly each is 5 kernels (the copy to float32, the square and mean, the scale, the
weight, the copy back), twice per layer: 0.036 ms each per layer of a 1024-token decode step on an
H100 (run 16's trace, benchmarks/RESULTS.md run 17). One Triton program per row reads the row
(and the residual) once and writes the norm (and the sum) once.

On CUDA with Triton the kernel runs; elsewhere the eager functions (which ``fused_glue`` compiles
where asked). Both round the residual sum to the input dtype before normalising it, as the
eager ``x + delta`` does, and compute ``x * rsqrt(mean(x^2) + eps) * weight`` in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ubatch._triton import tl, triton, triton_available
from ubatch.models.fusion import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [..., hidden] scaled by ``weight`` [hidden]."""
    _check(x, weight)
    if _kernel_runs(x, weight):
        return _norm_triton(x, None, weight, eps)[1]
    return rms_norm_eager(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm): a residual add and the next block's norm in one pass."""
    _check(x, weight)
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(delta.shape)}, {delta.dtype}")
    if _kernel_runs(x, weight) and delta.stride(-1) == 1:
        return _norm_triton(x, delta, weight, eps)
    return add_rms_norm_eager(x, delta, weight, eps)


@fused
def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


@fused
def add_rms_norm_eager(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, F.rms_norm(total.float(), weight.shape, weight.float(), eps).to(total.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        shapes = f"weight {tuple(weight.shape)}, x {tuple(x.shape)}"
        raise ValueError(f"weight must be [hidden] for x [..., hidden], got {shapes}")


def _kernel_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x 2-D with contiguous rows (the kernel steps from row to row by one stride), weight dense."""
    return triton_available(x.device) and x.dim() == 2 and x.stride(-1) == 1 and weight.stride(0) == 1


def _norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    normed = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    total = torch.empty_like(normed) if delta is not None else x
    if normed.numel() == 0:
        return total, normed
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x,
        x if delta is None else delta,
        total,
        normed,
        weight,
        hidden,
        x.stride(0),
        0 if delta is None else delta.stride(0),
        eps,
        ADD=delta is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return total, normed


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        delta_ptr,
        total_ptr,
        out_ptr,
        weight_ptr,
        hidden,
        stride_x,
        stride_delta,
        eps,
        ADD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if ADD:
            delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(total_ptr + row * hidden + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, (xf * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)
