"""Top-k routing: each token's expert logits in float32, their softmax, the k largest and those
renormalised to sum to 1.

A token's experts must not depend on how its batch was cut (a ubatch must route as the whole
step does), so the logits stay in float32 (bf16 logits flip near-ties) and the reduction order
must not change with the row count. Eagerly the logits are a cuBLAS GEMM, which may pick another
algorithm (and so another order) for another M, and the rest is five small kernels per layer and
ubatch. On CUDA with Triton one program per block of rows does all of it, each row's dot products
in one fixed order whatever the other rows: batch-invariant by construction. Elsewhere the torch
path runs (CPU GEMMs do not change their order with M).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ubatch._triton import tl, triton, triton_available

_BLOCK_ROWS = 16
_BLOCK_HIDDEN = 64
_MAX_EXPERTS = 256
_MAX_TOP_K = 16


def route_top_k(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32 summing to 1 per row, expert ids [T, k] int64, in descending
    weight) for ``x`` [T, hidden] and the float32 ``router`` [experts, hidden]."""
    if router.dim() != 2 or x.dim() != 2 or x.shape[1] != router.shape[1]:
        raise ValueError(
            f"route_top_k takes x [tokens, hidden] and router [experts, hidden], got x {tuple(x.shape)}, "
            f"router {tuple(router.shape)}"
        )
    if not 1 <= top_k <= router.shape[0]:
        raise ValueError(f"top_k must be in [1, experts={router.shape[0]}], got {top_k}")
    if kernel_takes(x, router, top_k):
        return route_top_k_kernel(x, router, top_k)
    return route_top_k_eager(x, router, top_k)


def route_top_k_eager(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = F.linear(x.float(), router).softmax(dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def kernel_takes(x: torch.Tensor, router: torch.Tensor, top_k: int) -> bool:
    """CUDA with Triton, a float32 router and rows whose elements are dense, at most
    ``_MAX_EXPERTS`` experts and ``_MAX_TOP_K`` picks."""
    return (
        triton_available(x.device)
        and router.device == x.device
        and router.dtype == torch.float32
        and x.stride(1) == 1
        and router.stride(1) == 1
        and router.shape[0] <= _MAX_EXPERTS
        and top_k <= _MAX_TOP_K
    )


def route_top_k_kernel(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_top_k`` in one launch (no input checks: ``route_top_k`` makes them)."""
    tokens, hidden = x.shape
    experts = router.shape[0]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    if tokens:
        _route[(triton.cdiv(tokens, _BLOCK_ROWS),)](
            x,
            router,
            weights,
            ids,
            tokens,
            hidden,
            x.stride(0),
            router.stride(0),
            experts,
            EXPERTS_POW2=max(16, triton.next_power_of_2(experts)),
            TOP_K=top_k,
            BLOCK_ROWS=_BLOCK_ROWS,
            BLOCK_HIDDEN=_BLOCK_HIDDEN,
            num_warps=4,
        )
    return weights, ids


if triton is not None:

    @triton.jit
    def _route(
        x_ptr,
        router_ptr,
        weights_ptr,
        ids_ptr,
        tokens,
        hidden,
        stride_x,
        stride_router,
        experts,
        EXPERTS_POW2: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_HIDDEN: tl.constexpr,
    ):
        """Rows ``program_id(0) * BLOCK_ROWS`` on: the logits [rows, experts] as float32 dot
        products over the hidden size in blocks (IEEE float32, not TF32), then ``TOP_K`` times
        the largest (the lowest expert id among equal ones) taken out. The softmax followed by the
        renormalisation over the picks is the softmax over the picked logits alone, so only those
        are exponentiated."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < tokens
        keys = tl.arange(0, EXPERTS_POW2)
        key_ok = keys < experts
        logits = tl.zeros((BLOCK_ROWS, EXPERTS_POW2), dtype=tl.float32)
        for start in tl.range(0, hidden, BLOCK_HIDDEN):
            cols = start + tl.arange(0, BLOCK_HIDDEN)
            col_ok = cols < hidden
            a = tl.load(
                x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            b = tl.load(
                router_ptr + keys[None, :] * stride_router + cols[:, None],
                mask=col_ok[:, None] & key_ok[None, :],
                other=0.0,
            )
            logits = tl.dot(a, b, logits, input_precision="ieee")
        logits = tl.where(key_ok[None, :], logits, float("-inf"))
        top = tl.max(logits, axis=1)
        total = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)  # the picks' exponentials, summed
        left = logits
        for _ in tl.static_range(TOP_K):
            best = tl.max(left, axis=1)
            best_id = tl.min(tl.where(left == best[:, None], keys[None, :], EXPERTS_POW2), axis=1)
            total += tl.exp(best - top)
            left = tl.where(keys[None, :] == best_id[:, None], float("-inf"), left)
        for j in tl.static_range(TOP_K):
            best = tl.max(logits, axis=1)
            best_id = tl.min(tl.where(logits == best[:, None], keys[None, :], EXPERTS_POW2), axis=1)
            tl.store(weights_ptr + rows * TOP_K + j, tl.exp(best - top) / total, mask=row_ok)
            tl.store(ids_ptr + rows * TOP_K + j, best_id.to(tl.int64), mask=row_ok)
            logits = tl.where(keys[None, :] == best_id[:, None], float("-inf"), logits)
