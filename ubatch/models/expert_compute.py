"""The routed experts' SwiGLU over received dispatch rows, for one expert group, by one of three
paths:

- padded: one batched GEMM per projection over [experts, capacity] padded rows, where a capacity
  factor bounds each expert's rows and they are few (``PADDED_MAX_ROWS``): at those sizes the GEMM
  is a weight read, and the padding rows ride along;
- grouped: ``torch._grouped_mm`` over the rows sorted by expert (on CUDA by a counting sort in
  four Triton kernels, ``expert_rows.sort_by_expert_kernel``), where no row may be dropped or an
  expert has many rows; with one expert (a rank of an expert-parallel world as wide as the
  experts) and few rows (``ONE_EXPERT_PLAIN_MAX_ROWS``), its down projection is a plain GEMM
  over every received row instead;
- masked: every expert over every row, a static-shape loop where grouped GEMM is unsupported.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ubatch.models import expert_rows
from ubatch.models.fusion import fused
from ubatch.models.swiglu import swiglu

PADDED_ROWS_STEP = 64
PADDED_MAX_ROWS = 128
"""Up to this many rows per expert, a batched GEMM over every expert's rows padded to one
capacity reads the weights at ~3.8-4.0 TB/s on an H200, where the grouped GEMM reaches 2.6-3.0
(16-64 rows; scripts/bench_expert_gemm.py): at these sizes the GEMM is a weight read, and the
padding rows ride along for free. Capacities are rounded up to ``PADDED_ROWS_STEP``."""
ONE_EXPERT_PLAIN_MAX_ROWS = 1024
"""Up to this many received rows, one expert's down projection is a plain GEMM over all of them,
padding rows included: its output is only hidden-wide, so at a few hundred rows
``torch._grouped_mm``'s large tiles leave most SMs idle (0.16 ms at 128-256 rows where
``torch.bmm`` takes 0.074-0.076, 0.18 against 0.11 at 512; one H100, scripts/bench_expert_gemm.py
at e31f938, benchmarks/h100/expert_gemm_run15). Past about a thousand rows the grouped GEMM has tiles
for every SM, and the padding rows would cost the plain one FLOPs (prefill)."""
PADDED_MAX_ROWS_PIPELINED = 256
"""The same limit where the experts run in groups (``expert_chunks`` > 1): one grouped GEMM per
group costs ~0.17 ms more per layer above 128 rows per expert, one batched GEMM per group only
0.02-0.04 ms (scripts/probe_flag_gemm.py, 128-256 rows on an H200), so the padding pays up to
256 rows there (the pipelined 256-token decode modes over 10 GB/s ran 8-20% faster:
benchmarks/h200/padded_groups_ab)."""


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs here: CPU, or bf16 on a Hopper-or-newer GPU, with
    every row 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(d * torch.finfo(dtype).bits // 8 % 16 for d in dims):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def padded_capacity(balanced_rows: float, num_rows: int, factor: float, *, pipelined: bool) -> int | None:
    """Rows per expert of the padded GEMM: ``factor`` times an expert's ``balanced_rows``,
    rounded up to ``PADDED_ROWS_STEP``, never more than the ``num_rows`` received; None (the
    grouped GEMM) above ``PADDED_MAX_ROWS`` (``PADDED_MAX_ROWS_PIPELINED`` where the experts run
    in groups)."""
    wanted = math.ceil(factor * balanced_rows / PADDED_ROWS_STEP) * PADDED_ROWS_STEP
    capacity = min(num_rows, max(PADDED_ROWS_STEP, wanted))
    limit = PADDED_MAX_ROWS_PIPELINED if pipelined else PADDED_MAX_ROWS
    return capacity if capacity <= limit else None


def group_outputs(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    first: int,
    capacity: int | None,
    use_grouped_mm: bool,
    dropped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What each row's weighted sum over the experts ``first`` .. ``first + len(w13) - 1`` gathers:
    (outputs, each row's rows among them [rows, top_k] (-1: none), their weights or None).
    ``ids`` [rows, top_k] holds each row's local expert ids, negative where none (padding rows
    have none); other experts are skipped. With a ``capacity`` the padded GEMM runs, the (row,
    expert) pairs past it added to ``dropped`` (an int64 device scalar), else the grouped GEMM or
    the masked loop."""
    size = w13.shape[0]
    if capacity is not None:
        out, slot = padded_experts(x, ids.flatten(), w13, w2, capacity, first, dropped)
        return out, slot.view_as(ids), weights
    if use_grouped_mm:
        out, position = grouped_experts(x, ids, w13, w2, first)
        return out, position, weights
    ids = torch.where((ids >= first) & (ids < first + size), ids - first, -1)
    summed = masked_experts(x, ids, weights, w13, w2)
    return summed, torch.arange(len(x), device=x.device)[:, None], None


def padded_experts(
    x: torch.Tensor,
    expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    capacity: int,
    first: int,
    dropped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched GEMM per projection over [experts, capacity] padded rows, for ``expert``
    [rows * top_k], each row's local experts in turn, of which those from ``first`` on (as many
    as ``w13`` holds) run here and the others count as padding: each (row, expert) pair's slot is
    its expert's block plus its rank among that expert's pairs (one Triton kernel on CUDA,
    ``expert_rows``, which reads each row where it lies and counts the pairs past their expert's
    capacity into ``dropped`` itself; elsewhere a fast inner-dimension scan, as in the dispatch).
    Returns the [experts * capacity, hidden] outputs and each pair's slot among them (-1: dropped
    or padding)."""
    n = w13.shape[0]
    if expert_rows.kernel_takes(x, expert):
        padded, slot, _ = expert_rows.pad_expert_rows_kernel(x, expert, n, capacity, first, counter=dropped)
    else:
        padded, slot, past = pad_expert_rows(x, expert, n, capacity, first)
        # An atomic add: two expert stages may run at once on two streams (gemm_lanes).
        dropped.view(1).index_add_(0, torch.zeros(1, dtype=torch.int64, device=x.device), past.view(1))
    gate_up = torch.bmm(padded, w13.transpose(1, 2))
    act = swiglu(gate_up.view(n * capacity, -1)).view(n, capacity, -1)
    return torch.bmm(act, w2.transpose(1, 2)).view(n * capacity, -1), slot


def grouped_experts(
    x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (row, column) of ``ids`` [rows, top_k] whose expert lies in ``first`` .. ``first +
    len(w13) - 1`` through it, the rows gathered sorted by expert straight from ``x`` (never
    expanded first; on CUDA by ``expert_rows.sort_by_expert_kernel``); returns the sorted outputs
    and where among them each (row, column) landed [rows, top_k], -1 for the other columns."""
    n = w13.shape[0]
    if expert_rows.sort_kernel_takes(x, ids, n):
        rows, position, offsets = expert_rows.sort_by_expert_kernel(x, ids, n, first)
    else:
        ids = torch.where((ids >= first) & (ids < first + n), ids - first, -1)
        rows, order, offsets = sort_by_expert(x, ids, n)
        landed = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        position = torch.where(ids >= 0, landed.view_as(ids), -1)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    # Rows past the last offset are padding: neither grouped GEMM reads them, nor does swiglu.
    hidden = swiglu(gate_up, offsets[-1:], zero_padding=False)
    if n == 1 and len(x) <= ONE_EXPERT_PLAIN_MAX_ROWS:
        # A row holds at most one pair of the one expert, so its rows are among the first len(x);
        # the padding rows' outputs are never read.
        return F.linear(hidden[: len(x)], w2[0]), position
    return torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets), position


def masked_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Each row's weighted sum over its experts [rows, hidden] (float32), every expert run over
    every row: static shapes, no sort, no grouped GEMM."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        weight = torch.where(ids == e, weights, 0).sum(dim=1, keepdim=True)
        out += torch.where(weight != 0, F.linear(F.silu(gate) * up, w2[e]).float() * weight, 0)
    return out


@fused
def sort_by_expert(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the rows of ``x`` [rows, hidden] for the (row, column) pairs of ``ids`` [rows, top_k]
    sorted by expert, the columns that have none (ids < 0) last, as many of them as can hold an
    expert here: rows * min(top_k, num_experts), since a row names each expert once; the order
    that sorts all rows * top_k pairs; each expert's end offset among them as int32): what the
    grouped GEMM takes. The bound keeps a group of few experts from copying every pair's row
    (an expert group of one expert under top-8 would copy eight rows per row, seven of them
    never read)."""
    key = torch.where(ids < 0, num_experts, ids).flatten()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    held = len(x) * min(ids.shape[1], num_experts)
    return x[order[:held] // ids.shape[1]], order, counts[:num_experts].cumsum(0).to(torch.int32)


@fused
def pad_expert_rows(
    x: torch.Tensor, expert: torch.Tensor, num_experts: int, capacity: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows in [experts, capacity, hidden] blocks, each (row, expert) pair's slot there or -1,
    pairs dropped) for ``expert`` [rows * k], the experts of each row of ``x`` in turn, of which
    ``first`` .. ``first + num_experts - 1`` are placed: a pair's slot is its expert's block plus
    its rank among that expert's pairs (the dispatch's inner-dimension scan). Padding (expert <
    0), other experts and pairs past their expert's capacity get -1."""
    expert = torch.where((expert >= first) & (expert < first + num_experts), expert - first, -1)
    if len(x) and len(expert) != len(x):
        x = x.repeat_interleave(len(expert) // len(x), dim=0)
    trash = num_experts * capacity
    ids = torch.arange(num_experts, device=x.device)[:, None]
    rank = (expert == ids).cumsum(1).gather(0, expert.clamp(min=0)[None])[0] - 1
    kept = (expert >= 0) & (rank < capacity)
    slot = torch.where(kept, expert * capacity + rank, trash)
    padded = x.new_empty(trash + 1, x.shape[1]).index_copy_(0, slot, x)[:trash]
    dropped = ((expert >= 0) & ~kept).sum()
    return padded.view(num_experts, capacity, x.shape[1]), torch.where(kept, slot, -1), dropped
