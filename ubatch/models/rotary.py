"""Neox-style rotary embedding (each head's halves rotated) of a layer's query and key heads.

Why a kernel: eagerly the rotation is 13 kernels per layer (the heads copied to float32, four
multiplies and two adds over halves, a concatenation and a copy back, the angles' cosine and sine
again in every layer): 0.107 ms per layer of a 1024-token decode step on an H100, 6% of the time
its roofline allows the whole layer (run 16's trace, benchmarks/RESULTS.md run 17). One
Triton program per token and group of heads reads each head once, computes in float32 and writes
the result once.

On CUDA with Triton the kernel runs; elsewhere ``rotate_neox_eager`` (which ``fused_glue``
compiles where asked). Both compute the angles as ``float32(position) * inv_freq`` and each half
as a float32 product difference (sum), rounded once to the output dtype.
"""

from __future__ import annotations

import torch

from ubatch._triton import tl, triton, triton_available
from ubatch.models.fusion import fused

_HEADS_PER_PROGRAM = 8


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x`` [T, heads * head_dim] (rows may be strided, as a slice of a fused QKV projection's
    output), every head of token t rotated by ``positions[t]``: the first half of each head
    becomes ``x1 * cos - x2 * sin``, the second ``x2 * cos + x1 * sin``, with angles
    ``positions[t] * inv_freq`` ([head_dim / 2], float32). Returns a new contiguous tensor of x's
    dtype."""
    if x.dim() != 2 or head_dim % 2 or x.shape[1] % head_dim:
        raise ValueError(f"x must be [tokens, heads * head_dim] with an even head_dim {head_dim}, got {tuple(x.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must be [{head_dim // 2}], got {tuple(inv_freq.shape)}")
    if triton_available(x.device) and x.stride(1) == 1:
        return _rotate_triton(x, positions, inv_freq, head_dim)
    return rotate_neox_eager(x, positions, inv_freq, head_dim)


@fused
def rotate_neox_eager(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.view(x.shape[0], x.shape[1] // head_dim, head_dim).float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.flatten(1).to(x.dtype)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    tokens, heads = x.shape[0], x.shape[1] // head_dim
    out = torch.empty(tokens, heads * head_dim, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_h = min(_HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    _rotate_kernel[(tokens, triton.cdiv(heads, block_h))](
        x,
        out,
        positions,
        inv_freq,
        heads,
        x.stride(0),
        positions.stride(0),
        HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_H=block_h,
    )
    return out


if triton is not None:

    @triton.jit
    def _rotate_kernel(
        x_ptr,
        out_ptr,
        positions_ptr,
        inv_freq_ptr,
        num_heads,
        stride_token,
        stride_position,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_HALF)
        col_ok = cols < HALF
        angle = tl.load(positions_ptr + token * stride_position).to(tl.float32) * tl.load(
            inv_freq_ptr + cols, mask=col_ok, other=0.0
        )
        cos = tl.cos(angle)[None, :]
        sin = tl.sin(angle)[None, :]
        first = heads[:, None] * (2 * HALF) + cols[None, :]  # each head's first half, then + HALF
        mask = (heads[:, None] < num_heads) & col_ok[None, :]
        src = x_ptr + token * stride_token + first
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + token * num_heads * (2 * HALF) + first
        tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
