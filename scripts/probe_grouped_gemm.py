"""Probe: does a grouped GEMM with smaller row tiles beat ``torch._grouped_mm`` at a split's rows?

A split's expert GEMMs took 1.25x the unsplit step's in run 25's deepseek-bench prefill, where equal
rows per expert cost 1.08x: each expert's last tile of rows runs part empty, and at 512 rows per
expert that weighs about four times what it does at 2048 (``bench_expert_gemm.py``'s
``ubatch.bench.skew.tile_fill``). This times ``torch._grouped_mm`` (what ``MoEFFN`` runs) against a plain Triton
grouped GEMM whose row tile is a parameter (64 or 128), over rows per expert as a skewed router
deals them, and checks each Triton result against torch's. The Triton kernel is persistent: each
program walks the tiles of every expert (``cdiv(rows, BLOCK_M) * cdiv(N, BLOCK_N)`` each) in turn,
so an expert with few rows costs few tiles and the grid needs no host-side tile list. It comes in
two variants: masked pointer loads (``triton_*``), and loads through tensor descriptors (``tma_*``,
TMA on Hopper, what Triton's fast persistent matmuls use), since a plain tile loop fell behind
cuBLAS before (the ready-flag probe in the history of the overlap-mode runs).

``python scripts/probe_grouped_gemm.py --experts 16 --hidden 4096 --inter 2048 --rows 512,2048
--skew 0.35`` (one GPU; the kernel also runs under Triton's CPU interpreter, as its test does).
One JSON line per (rows per expert, projection, op) with the median time, TFLOP/s and, for the
Triton ops, the largest difference from torch's result relative to its largest value.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ubatch._triton import tl, triton
from ubatch.bench.measure import event_times_ms
from ubatch.bench.skew import expert_counts, spread_fields

CONFIGS = {  # BLOCK_M, BLOCK_N, BLOCK_K; "tma": operands loaded through tensor descriptors
    "triton_m64_n128": (64, 128, 64),
    "triton_m64_n256": (64, 256, 64),
    "triton_m128_n128": (128, 128, 64),
    "triton_m128_n256": (128, 256, 64),
    "tma_m64_n256": (64, 256, 64),
    "tma_m128_n128": (128, 128, 64),
    "tma_m128_n256": (128, 256, 64),
}


if triton is not None:

    @triton.jit
    def _expert_tiles(ends_ptr, num_experts, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXPERTS: tl.constexpr):
        """(each expert's first row, end row and tile count, the tile counts' running sum, their
        total) for rows sorted by expert with ``ends_ptr`` each expert's end offset (int32)."""
        experts = tl.arange(0, EXPERTS)
        live = experts < num_experts
        ends = tl.load(ends_ptr + experts, mask=live, other=0)
        starts = tl.load(ends_ptr + experts - 1, mask=live & (experts > 0), other=0)
        tiles = tl.cdiv(ends - starts, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        return starts, ends, tiles, tl.cumsum(tiles, 0), tl.sum(tiles, 0)

    @triton.jit
    def _tile_at(
        tile, starts, ends, tiles, tile_ends, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXPERTS: tl.constexpr
    ):
        """(expert, first row, the expert's end row, first column) of tile number ``tile``."""
        experts = tl.arange(0, EXPERTS)
        expert = tl.sum((tile_ends <= tile).to(tl.int32), 0)
        local = tile - tl.sum(tl.where(experts < expert, tiles, 0), 0)
        row_start = tl.sum(tl.where(experts == expert, starts, 0), 0)
        row_end = tl.sum(tl.where(experts == expert, ends, 0), 0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        return expert, row_start + (local // n_tiles) * BLOCK_M, row_end, (local % n_tiles) * BLOCK_N

    @triton.jit
    def _store_tile(out_ptr, acc, row, col, row_end, N, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The tile's rows of its expert (below ``row_end``) and columns below N."""
        rows = row + tl.arange(0, BLOCK_M)
        cols = col + tl.arange(0, BLOCK_N)
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(rows < row_end)[:, None] & (cols < N)[None, :],
        )

    @triton.jit
    def _grouped_gemm(
        x_ptr,
        w_ptr,
        out_ptr,
        ends_ptr,
        num_experts,
        N,
        K,
        stride_x,
        stride_we,
        stride_wn,
        stride_wk,
        stride_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EXPERTS: tl.constexpr,
    ):
        """out[rows of e] = x[rows of e] @ w[e].T for every expert e, the rows sorted by expert and
        ``ends_ptr`` each expert's end offset (int32); each program takes every num_programs-th tile."""
        starts, ends, tiles, tile_ends, total = _expert_tiles(ends_ptr, num_experts, N, BLOCK_M, BLOCK_N, EXPERTS)
        ks = tl.arange(0, BLOCK_K)
        for tile in range(tl.program_id(0), total, tl.num_programs(0)):
            expert, row, row_end, col = _tile_at(tile, starts, ends, tiles, tile_ends, N, BLOCK_M, BLOCK_N, EXPERTS)
            rows = row + tl.arange(0, BLOCK_M)
            cols = col + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_expert = w_ptr + expert.to(tl.int64) * stride_we
            for k in range(0, K, BLOCK_K):
                a = tl.load(
                    x_ptr + rows.to(tl.int64)[:, None] * stride_x + (k + ks)[None, :],
                    mask=(rows < row_end)[:, None] & ((k + ks) < K)[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_expert + cols[None, :] * stride_wn + (k + ks)[:, None] * stride_wk,
                    mask=(cols < N)[None, :] & ((k + ks) < K)[:, None],
                    other=0.0,
                )
                acc = tl.dot(a, b, acc)
            _store_tile(out_ptr, acc, row, col, row_end, N, stride_out, BLOCK_M, BLOCK_N)

    @triton.jit
    def _grouped_gemm_tma(
        x_ptr,
        w_ptr,
        out_ptr,
        ends_ptr,
        num_experts,
        rows_total,
        N,
        K,
        stride_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EXPERTS: tl.constexpr,
    ):
        """``_grouped_gemm`` with both operands loaded by tensor descriptors (TMA on Hopper): x as one
        [rows, K] tensor and w as one [experts * N, K] tensor, created once per program, so a tile
        may read past its expert's rows or columns (zeros past the tensor's end, another expert's
        values inside it) and only its store is masked to the expert's rows and N."""
        x_desc = tl.make_tensor_descriptor(x_ptr, [rows_total, K], [K, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, [num_experts * N, K], [K, 1], [BLOCK_N, BLOCK_K])
        starts, ends, tiles, tile_ends, total = _expert_tiles(ends_ptr, num_experts, N, BLOCK_M, BLOCK_N, EXPERTS)
        for tile in range(tl.program_id(0), total, tl.num_programs(0)):
            expert, row, row_end, col = _tile_at(tile, starts, ends, tiles, tile_ends, N, BLOCK_M, BLOCK_N, EXPERTS)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                a = x_desc.load([row, k])
                b = w_desc.load([expert * N + col, k])
                acc = tl.dot(a, b.T, acc)
            _store_tile(out_ptr, acc, row, col, row_end, N, stride_out, BLOCK_M, BLOCK_N)


def grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, config: tuple[int, int, int], *, tma: bool = False
) -> torch.Tensor:
    """``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)`` by the Triton kernel: x [rows, K] sorted
    by expert, w [experts, N, K], ends the experts' int32 end offsets; tiles of ``config`` (BLOCK_M,
    BLOCK_N, BLOCK_K), one persistent program per SM (four on the CPU interpreter); ``tma``: the
    operands through tensor descriptors (``_grouped_gemm_tma``)."""
    if triton is None:
        raise RuntimeError("the Triton grouped GEMM needs triton")
    experts, n, k = w.shape
    if x.shape[1] != k or x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must share K with rows contiguous")
    if ends.dtype != torch.int32 or ends.shape != (experts,):
        raise ValueError(f"ends must be int32 [{experts}], got {ends.dtype} {tuple(ends.shape)}")
    out = x.new_empty(x.shape[0], n)
    block_m, block_n, block_k = config
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    launch = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EXPERTS=max(2, triton.next_power_of_2(experts)),
        num_warps=8 if block_m * block_n >= 128 * 128 else 4,
        num_stages=3 if block_m * block_n <= 128 * 128 else 2,
    )
    if tma:
        if not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError("the descriptor variant needs x and w contiguous")
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=x.device))
        _grouped_gemm_tma[(programs,)](
            x,
            w,
            out,
            ends,
            experts,
            x.shape[0],
            n,
            k,
            out.stride(0),
            **launch,
        )
        return out
    _grouped_gemm[(programs,)](
        x,
        w,
        out,
        ends,
        experts,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        **launch,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--rows", default="512,2048", help="mean rows per expert, comma-separated")
    p.add_argument("--skew", type=float, default=0.35, help="log-normal sigma of the experts' shares (0: equal)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.skew < 0 or args.experts < 1:
        p.error(f"--skew must be >= 0 and --experts >= 1, got {args.skew} and {args.experts}")
    if not torch.cuda.is_available() or triton is None:
        p.error("this probe needs a CUDA GPU with Triton")
    generator = torch.Generator().manual_seed(args.seed)
    dev, dt = torch.device("cuda"), torch.bfloat16
    e, h, i = args.experts, args.hidden, args.inter
    weights = {"gate_up": torch.randn(e, 2 * i, h, device=dev, dtype=dt) * 0.02}
    weights["down"] = torch.randn(e, h, i, device=dev, dtype=dt) * 0.02
    for rows in (int(r) for r in args.rows.split(",")):
        counts = expert_counts(e, rows, args.skew, generator)
        ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(dev, torch.int32)
        spread = spread_fields(counts, rows)
        for name, w in weights.items():
            x = torch.randn(e * rows, w.shape[2], device=dev, dtype=dt)
            ops = {"grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=ends)}
            ops |= {
                op: (lambda op=op, cfg=cfg: grouped_gemm(x, w, ends, cfg, tma=op.startswith("tma")))
                for op, cfg in CONFIGS.items()
            }
            reference = ops["grouped_mm"]()
            tflop = 2 * e * rows * w.shape[1] * w.shape[2] / 1e12
            for op, run in ops.items():
                row = {"op": op, "proj": name, "experts": e, "rows_per_expert": rows, "skew": args.skew}
                try:
                    ms = statistics.median(event_times_ms(run, repeats=30))
                except Exception as exc:  # a variant this Triton cannot build must not end the probe
                    print(json.dumps(row | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
                    continue
                row |= {"ms": round(ms, 4), "TFLOPs": round(tflop / (ms / 1e3), 1), **spread}
                if op != "grouped_mm":
                    error = (run().float() - reference.float()).abs().max() / reference.float().abs().max()
                    row["max_rel_diff"] = float(f"{error.item():.2e}")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
