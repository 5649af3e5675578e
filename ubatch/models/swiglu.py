"""SwiGLU activation, silu(gate) * up, in one pass over a fused gate/up projection.

``gate_up`` is what ``torch._grouped_mm(x, w13)`` or ``F.linear(x, gate_up_weight)`` gives: [R, 2I], the gate
half first. Eagerly, ``F.silu(gate) * up`` costs two kernels and an [R, I] intermediate (5 x [R, I] moved against
3 in one pass), and runs over every row, including the padding rows past a grouped GEMM's last offset, which hold
whatever the allocator left there.

``num_valid_rows`` (a device tensor, read on the device: no host sync, so CUDA-graph capturable with a count that
changes between replays) marks rows at and past it as padding: the kernel never reads them. What it writes there is
the caller's choice. ``zero_padding=True`` (the default) writes zeros, so the output is fully defined, at a third of
a valid row's traffic per padding row. ``zero_padding=False`` leaves them unwritten: right for a caller whose next
op never reads them, such as the second grouped GEMM of an MoE expert, which reads only rows below its last offset;
with half the rows padding, that skips a quarter of the kernel's bytes.

On CUDA with Triton the kernel runs; elsewhere an eager fallback computes the same values (float32 math, output in
the input dtype) with padding rows zero whatever ``zero_padding`` says (unspecified contents include zeros). The
fallback reads every row and masks afterwards: without a host sync it cannot skip rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ubatch._triton import tl, triton, triton_available

_MAX_BLOCK = 1024  # columns per program: 8 bf16 (16 bytes) per thread with 4 warps


def swiglu(
    gate_up: torch.Tensor,
    num_valid_rows: torch.Tensor | None = None,
    *,
    row_scale: torch.Tensor | None = None,
    zero_padding: bool = True,
) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] (times ``row_scale[r]`` per row when given) as a new [R, I] tensor
    of ``gate_up``'s dtype, computed in float32.

    ``num_valid_rows``: an integer tensor of one element on ``gate_up``'s device; rows at index >= its value are
    padding (never read; zero, or unwritten with ``zero_padding=False``). A value above R means no padding, a
    negative one all padding. None: every row is valid. ``row_scale``: a float [R] tensor on the same device, for
    folding a per-row weight into the activation (the down projection is linear in its input rows).
    """
    _check_inputs(gate_up, num_valid_rows, row_scale)
    if triton_available(gate_up.device):
        return _swiglu_triton(gate_up, num_valid_rows, row_scale, zero_padding)
    return _swiglu_eager(gate_up, num_valid_rows, row_scale)


def _check_inputs(gate_up: torch.Tensor, num_valid_rows: torch.Tensor | None, row_scale: torch.Tensor | None) -> None:
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"gate_up must be a torch.Tensor, got {type(gate_up).__name__}")
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be 2-D [rows, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up halves), got {gate_up.shape[1]}")
    if not gate_up.dtype.is_floating_point:
        raise TypeError(f"gate_up must be a floating-point tensor, got {gate_up.dtype}")
    if num_valid_rows is not None:
        if not isinstance(num_valid_rows, torch.Tensor):
            raise TypeError(
                f"num_valid_rows must be a one-element integer tensor on the device (a host value "
                f"would be baked into a captured graph), got {type(num_valid_rows).__name__}"
            )
        if (
            num_valid_rows.dtype.is_floating_point
            or num_valid_rows.dtype.is_complex
            or num_valid_rows.dtype == torch.bool
        ):
            raise TypeError(f"num_valid_rows must be an integer tensor, got {num_valid_rows.dtype}")
        if num_valid_rows.numel() != 1:
            raise ValueError(f"num_valid_rows must hold one element, got shape {tuple(num_valid_rows.shape)}")
        if num_valid_rows.device != gate_up.device:
            raise ValueError(
                f"num_valid_rows is on {num_valid_rows.device}, gate_up on {gate_up.device}: "
                f"the count is read on gate_up's device"
            )
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor):
            raise TypeError(f"row_scale must be a torch.Tensor, got {type(row_scale).__name__}")
        if tuple(row_scale.shape) != (gate_up.shape[0],):
            raise ValueError(
                f"row_scale must have shape ({gate_up.shape[0]},) (one per row of gate_up), "
                f"got {tuple(row_scale.shape)}"
            )
        if not row_scale.dtype.is_floating_point:
            raise TypeError(f"row_scale must be a floating-point tensor, got {row_scale.dtype}")
        if row_scale.device != gate_up.device:
            raise ValueError(f"row_scale is on {row_scale.device}, gate_up on {gate_up.device}")


def _swiglu_eager(
    gate_up: torch.Tensor, num_valid_rows: torch.Tensor | None, row_scale: torch.Tensor | None
) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = F.silu(gate) * up
    if row_scale is not None:
        out = out * row_scale.float()[:, None]
    if num_valid_rows is not None:
        valid = torch.arange(gate_up.shape[0], device=gate_up.device) < num_valid_rows.reshape(())
        out = torch.where(valid[:, None], out, 0.0)
    return out.to(gate_up.dtype)


def _swiglu_triton(
    gate_up: torch.Tensor, num_valid_rows: torch.Tensor | None, row_scale: torch.Tensor | None, zero_padding: bool
) -> torch.Tensor:
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(cols))
    grid = (rows, triton.cdiv(cols, block))
    _swiglu_kernel[grid](
        gate_up,
        out,
        gate_up if num_valid_rows is None else num_valid_rows,  # any pointer: unread without HAS_LIMIT
        gate_up if row_scale is None else row_scale,
        cols,
        gate_up.stride(0),
        gate_up.stride(1),
        0 if row_scale is None else row_scale.stride(0),
        HAS_LIMIT=num_valid_rows is not None,
        HAS_SCALE=row_scale is not None,
        ZERO_PADDING=zero_padding,
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
    )
    return out


if triton is not None:

    @triton.jit
    def _swiglu_kernel(
        gate_up_ptr,
        out_ptr,
        num_valid_ptr,
        scale_ptr,
        num_cols,
        stride_row,
        stride_col,
        stride_scale,
        HAS_LIMIT: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        ZERO_PADDING: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One program per (row, block of columns). A padding row's programs read only the row count, so the
        padding's input bytes are never touched."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < num_cols
        out_ptrs = out_ptr + row * num_cols + cols
        if HAS_LIMIT:
            is_valid = row < tl.load(num_valid_ptr)
        else:
            is_valid = row >= 0
        if is_valid:
            gate_ptrs = gate_up_ptr + row * stride_row + cols * stride_col
            gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
            up = tl.load(gate_ptrs + num_cols * stride_col, mask=mask).to(tl.float32)
            out = gate * tl.sigmoid(gate) * up
            if HAS_SCALE:
                out = out * tl.load(scale_ptr + row * stride_scale).to(tl.float32)
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
        elif ZERO_PADDING:
            tl.store(out_ptrs, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=mask)
