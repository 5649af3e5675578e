"""What an eager runner pays the first time it meets each batch shape, per attention path.

cuDNN's SDPA (torch's pick on an H200) builds a plan per new shape: 34 ms to 1.1 s, then
0.1-0.2 ms per call (benchmarks/h200x2/explore/sdpa_cudnn_fresh_shapes.log,
first_use_sdpa_shapes.log), and the math path is 3-51x slower warm (sdpa_masked_decode_paths.log);
the torch backend's built-in varlen flash path builds no plans (ubatch.attention.varlen). To show
what a serving runner pays for new shapes, this serves staggered requests (prompt and output
lengths drawn at random, so batches change shape as requests finish) twice in one process: the
first pass meets every shape cold, the second replays the same shapes warm. Run one process per
choice:

    python scripts/first_use_cost.py --attention builtin_flash  # the torch backend's default
    python scripts/first_use_cost.py --attention sdpa           # SDPA runs, torch's pick (cuDNN)
    python scripts/first_use_cost.py --attention math           # SDPA runs on the math path
    python scripts/first_use_cost.py --attention flash          # flash-attn (FA4 compiles per variant)

The row's "path" says what ran: "builtin_flash" only where the kernel can (CUDA, fp16/bf16);
"flash_attn_fa4" (or fa3 / fa2) for flash-attn. ``--warmup-requests N`` first serves N throwaway
requests of other lengths (``ModelRunner.warmup``), so "cold" then shows what a warm-up leaves.

Prints one JSON line: tokens, seconds and tokens/s of both passes. Identical processes spread
widely, so repeat them; ``--summarize rows.jsonl`` prints the median and range of each path and
ubatch count, and the medians' ratio to the SDPA path's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ubatch.attention import FlashAttentionBackend, TorchBackend, get_backend
from ubatch.attention.backends import AttentionBackend, describe_backend
from ubatch.attention.varlen import builtin_flash_supports
from ubatch.models import ModelConfig, build_model
from ubatch.runner import ModelRunner


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--attention",
        choices=["builtin_flash", "sdpa", "math", "flash"],
        default="builtin_flash",
        help="builtin_flash: the torch backend's default (varlen flash calls where the kernel can "
        "run); sdpa: its SDPA runs, torch's pick (cuDNN on an H200); math: SDPA runs on math; "
        "flash: the flash-attn backend (an error where none is importable)",
    )
    p.add_argument("--preset", default=None, help="model preset (default: dense-bench on CUDA, tiny on CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256, help="longest prompt (prompts draw from half of it up)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest output (outputs draw from 1 up)")
    p.add_argument("--num-ubatches", type=int, default=1, help="ubatches per step (each meets shapes of its own)")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="first serve this many throwaway requests of other lengths (ModelRunner.warmup)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--summarize",
        type=Path,
        default=None,
        metavar="ROWS_JSONL",
        help="instead of serving, summarize rows this script printed",
    )
    return p.parse_args(argv)


@contextlib.contextmanager
def sdpa_choice(name: str) -> Iterator[None]:
    """The SDPA backends every SDPA call may use inside the block (the built-in flash kernel is
    called directly and ignores it)."""
    if name == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    else:
        yield


def make_backend(choice: str, device: torch.device) -> AttentionBackend:
    if choice == "flash":
        return get_backend("flash", device)
    return TorchBackend(builtin_flash=choice == "builtin_flash")


def attention_path(backend: AttentionBackend, config: ModelConfig, device: torch.device, choice: str) -> str:
    """What the backend runs for this model: the built-in flash kernel only where it can."""
    if isinstance(backend, FlashAttentionBackend):
        return describe_backend(backend)
    query = torch.empty(1, config.num_heads, config.head_dim, device=device, dtype=config.dtype)
    if backend.builtin_flash and builtin_flash_supports(query):
        return "builtin_flash"
    return "sdpa_math" if choice == "math" else "sdpa"


def staggered_requests(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths drawn at random, so requests finish at different steps."""
    g = torch.Generator().manual_seed(args.seed)
    prompt_lens = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.requests,), generator=g)
    limits = torch.randint(1, args.max_new_tokens + 1, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(0, vocab_size, (int(n),), generator=g).tolist() for n in prompt_lens]
    return prompts, limits


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (path, ubatch count, warm-up requests): the runs, (median, lowest, highest) cold and
    warm tokens/s, and each median over the SDPA path's alike (None without such an SDPA row)."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["path"], row["num_ubatches"], row.get("warmup_requests", 0)].append(row)
    summary = []
    for (path, n, warmup), group in groups.items():
        entry: dict[str, Any] = {"path": path, "num_ubatches": n, "warmup_requests": warmup, "runs": len(group)}
        for name in ("cold", "warm"):
            values = sorted(row[f"{name}_tokens_per_s"] for row in group)
            entry[name] = (statistics.median(values), values[0], values[-1])
        summary.append(entry)
    medians = {(e["path"], e["num_ubatches"], e["warmup_requests"]): e for e in summary}
    for entry in summary:
        sdpa = medians.get(("sdpa", entry["num_ubatches"], entry["warmup_requests"]))
        for name in ("cold", "warm"):
            entry[f"{name}_vs_sdpa"] = entry[name][0] / sdpa[name][0] if sdpa else None
    return summary


def _print_summary(summary: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'path':>14} {'N':>2} {'warm-up':>7} {'runs':>4}  {'cold tokens/s (range)':>24} {'vs sdpa':>7}  "
        f"{'warm tokens/s (range)':>24} {'vs sdpa':>7}"
    )
    for e in summary:
        cells = []
        for name in ("cold", "warm"):
            median, low, high = e[name]
            ratio = e[f"{name}_vs_sdpa"]
            shown_ratio = f"{ratio:6.2f}x" if ratio is not None else "      -"
            cells.append(f"{median:8.1f} ({low:.1f}-{high:.1f})".rjust(24) + " " + shown_ratio)
        print(
            f"{e['path']:>14} {e['num_ubatches']:>2} {e['warmup_requests']:>7} {e['runs']:>4}  {cells[0]}  {cells[1]}"
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    args = parse_args(argv)
    if args.summarize is not None:
        summary = summarize([json.loads(line) for line in args.summarize.read_text().splitlines() if line.strip()])
        _print_summary(summary)
        return summary
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    preset = args.preset or ("dense-bench" if cuda else "tiny")
    config = ModelConfig.preset(preset)
    backend = make_backend(args.attention, device)
    model = build_model(config, device=device, attn_backend=backend)
    blocks = args.requests * math.ceil((args.prompt_len + args.max_new_tokens) / 16)
    runner = ModelRunner(
        model,
        config,
        device=device,
        num_kv_blocks=blocks,
        block_size=16,
        max_num_seqs=args.requests,
        num_ubatches=args.num_ubatches,
    )
    prompts, limits = staggered_requests(args, config.vocab_size)
    row: dict[str, float | int | str] = {
        "preset": preset,
        "device": str(device),
        "attention": args.attention,
        "path": attention_path(backend, config, device, args.attention),
        "num_ubatches": args.num_ubatches,
    }
    with sdpa_choice(args.attention):
        if args.warmup_requests:
            start = time.perf_counter()
            runner.warmup(args.warmup_requests, seed=args.seed + 1)
            row.update(warmup_requests=args.warmup_requests, warmup_s=round(time.perf_counter() - start, 4))
        for name in ("cold", "warm"):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            outputs = runner.generate(prompts, limits)
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            tokens = sum(len(o) for o in outputs)
            row.update(
                {
                    f"{name}_tokens": tokens,
                    f"{name}_s": round(seconds, 4),
                    f"{name}_tokens_per_s": round(tokens / seconds, 1),
                }
            )
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
