"""SwiGLU over an MoE expert buffer: eager ``F.silu(g) * u`` against the one-pass ``ubatch.models.swiglu``.

Shapes are moe-bench's (I = 14336, bf16, top-2) on one rank of a two-rank expert-parallel group: the expert buffer
has 2 * tokens * top_k rows, half of them padding (the rows past the grouped GEMM's last offset, NaN here as
garbage would be). Each variant's time is the median of ``triton.testing.do_bench`` (L2 flushed before each run);
its bandwidth counts the bytes that variant moves, against a device-to-device copy measured in the same run; "of
floor" is the fewest bytes the useful work needs (the valid rows read and written once) over that copy rate.

    python scripts/bench_swiglu.py --out swiglu.json     # one H200, ~10 s
    python scripts/bench_swiglu.py --dry-run             # tiny, CPU (the eager fallback): code paths only

Variants: eager silu*mul over all rows; the same plus a ``torch.where`` zeroing the padding rows (what eager masking
costs); the kernel over all rows; with padding rows zeroed (read-free); with them skipped (``zero_padding=False``,
for a consumer such as the second grouped GEMM that never reads them). ``moe.py``'s ``torch.where`` over the down
projection's [R, hidden] output is timed too: what dropping it would save.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ubatch.bench.outputs import check_outputs  # noqa: E402
from ubatch.bench.roofline import H200_COPY_GBPS_MEASURED  # noqa: E402
from ubatch.models.swiglu import swiglu, triton_available  # noqa: E402

TOP_K = 2
HIDDEN = 4096


@dataclass
class Row:
    variant: str
    tokens: int
    rows: int
    valid_rows: int
    ms: float
    gbytes: float
    gbps: float
    of_copy: float
    of_floor: float


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of ``fn``: device events with the L2 flushed (do_bench) on CUDA, the host clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def copy_gbps(device: torch.device, nbytes: int) -> float:
    """A device-to-device copy's rate, bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), device) * 1e-3) / 1e9


def variants(
    gate_up: torch.Tensor, count: torch.Tensor, down_out: torch.Tensor
) -> list[tuple[str, Callable[[], object], int]]:
    """(name, call, bytes it moves) for each variant over one expert buffer."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    elt = gate_up.element_size()
    valid = int(count.item())
    mask = (torch.arange(rows, device=gate_up.device) < count)[:, None]
    gate, up = gate_up.chunk(2, dim=-1)
    row_bytes = inter * elt
    eager_bytes = 5 * rows * row_bytes  # silu: read + write; mul: two reads + a write

    return [
        ("eager silu*mul", lambda: F.silu(gate) * up, eager_bytes),
        ("eager silu*mul + where", lambda: torch.where(mask, F.silu(gate) * up, 0), eager_bytes + 2 * rows * row_bytes),
        ("kernel, all rows", lambda: swiglu(gate_up), 3 * rows * row_bytes),
        ("kernel, padding zeroed", lambda: swiglu(gate_up, count), (3 * valid + rows - valid) * row_bytes),
        ("kernel, padding skipped", lambda: swiglu(gate_up, count, zero_padding=False), 3 * valid * row_bytes),
        ("moe.py where [R, hidden]", lambda: torch.where(mask, down_out, 0), 2 * down_out.numel() * elt),
    ]


def bench_shape(tokens: int, inter: int, hidden: int, device: torch.device, copy_rate: float) -> list[Row]:
    rows, valid = 2 * tokens * TOP_K, tokens * TOP_K
    gen = torch.Generator(device=device).manual_seed(tokens)
    gate_up = torch.randn(rows, 2 * inter, generator=gen, device=device).to(torch.bfloat16)
    gate_up[valid:] = float("nan")
    down_out = torch.randn(rows, hidden, generator=gen, device=device).to(torch.bfloat16)
    count = torch.tensor([valid], dtype=torch.int32, device=device)
    gate, up = gate_up[:valid].chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(gate_up, count)[:valid], F.silu(gate) * up, rtol=2**-6, atol=1e-5)
    floor_ms = 3 * valid * inter * gate_up.element_size() / (copy_rate * 1e9) * 1e3
    out = []
    for name, fn, nbytes in variants(gate_up, count, down_out):
        ms = median_ms(fn, device)
        gbps = nbytes / (ms * 1e-3) / 1e9
        out.append(
            Row(
                name,
                tokens,
                rows,
                valid,
                ms,
                nbytes / 1e9,
                gbps,
                gbps / copy_rate,
                float("nan") if name.startswith("moe.py") else floor_ms / ms,
            )
        )
    return out


def format_table(rows: Sequence[Row], copy_rate: float) -> str:
    lines = [
        f"copy bandwidth measured here {copy_rate:.0f} GB/s (KINDS.md: {H200_COPY_GBPS_MEASURED:.0f})",
        f"{'variant':<26}{'tokens':>7}{'rows':>7}{'valid':>7}{'ms':>9}{'GB':>8}{'GB/s':>8}{'of copy':>9}"
        f"{'of floor':>10}",
    ]
    for r in rows:
        floor = "" if math.isnan(r.of_floor) else f"{r.of_floor:.0%}"
        lines.append(
            f"{r.variant:<26}{r.tokens:>7}{r.rows:>7}{r.valid_rows:>7}{r.ms:>9.4f}{r.gbytes:>8.3f}"
            f"{r.gbps:>8.0f}{r.of_copy:>9.0%}{floor:>10}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,1024,4096", help="comma list of tokens per rank")
    parser.add_argument("--intermediate", type=int, default=14336, help="expert intermediate size I")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: code paths only")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    return args


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    inter, hidden = args.intermediate, HIDDEN
    if args.dry_run:
        device, tokens, inter, hidden = torch.device("cpu"), [4, 8], 64, 32
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    else:
        device = torch.device("cuda")
        if not triton_available(device):
            raise SystemExit("Triton is not importable: swiglu would time its eager fallback")
    copy_rate = copy_gbps(device, 1 << 31 if device.type == "cuda" else 1 << 20)
    rows = [row for t in tokens for row in bench_shape(t, inter, hidden, device, copy_rate)]
    print(format_table(rows, copy_rate))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "copy_gbps": copy_rate,
                    "rows": [asdict(r) for r in rows],
                },
                indent=1,
            )
        )
    return rows


if __name__ == "__main__":
    main()
