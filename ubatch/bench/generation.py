"""Generation throughput with and without speculative decoding (``--workload generate``).

Random weights make a drafter's acceptance arbitrary, so the drafters here have a controlled
rate: ``self`` (the target drafts for itself: acceptance 1.0 up to rounding, at the target's
own cost per draft) and ``truncated`` (the target's first layer, same seed: low acceptance,
cheap drafts). Every row reports its acceptance rate beside tokens/s, the speedup over plain
decoding in the same graph mode, and how many requests' tokens differ from plain greedy
decoding's: none in float32; in bf16 a verification batch of k + 1 tokens per request rounds
differently from a one-token decode, so a near-tie may flip (the float32 tests prove equality).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.attention import PagedKVCache
from ubatch.models import Decoder, ModelConfig, build_model
from ubatch.runner import ModelRunner

DRAFTERS = ("self", "truncated")


@dataclass(frozen=True)
class GenerationShape:
    """What one timed ``generate`` call serves."""

    num_requests: int
    prompt_len: int
    max_new_tokens: int

    def prompts(self, vocab_size: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(0)
        return [
            torch.randint(0, vocab_size, (self.prompt_len,), generator=g).tolist() for _ in range(self.num_requests)
        ]


def capture_sizes_for(shape: GenerationShape, max_k: int) -> list[int]:
    """Powers of two from 8 up to a step that holds every request's k + 1 tokens (and a prompt):
    also the token budget of a step."""
    needed = max(shape.num_requests * (1 + max_k), shape.prompt_len, 8)
    return [2**i for i in range(3, (needed - 1).bit_length() + 1)]


def format_generation_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a fixed-width table, acceptance beside every speculative figure."""
    heads = ["graphs", "drafter", "k", "tokens/s", "speedup", "accept", "differ"]
    cells = [
        [
            str(r["graphs"]),
            r["drafter"] or "-",
            str(r["spec_k"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.3f}",
            "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}",
            str(r["requests_differing"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in [heads, *cells])


def make_drafter(kind: str, model: Decoder, config: ModelConfig) -> Decoder:
    """A drafter of known acceptance for ``model`` (see the module docstring)."""
    if kind == "self":
        return model
    if kind == "truncated":
        return build_model(config.replace(num_layers=1), device=model.device)
    raise ValueError(f"unknown drafter {kind!r}; known: {', '.join(DRAFTERS)}")


def generation_runner(
    model: Decoder,
    config: ModelConfig,
    shape: GenerationShape,
    *,
    graphs: bool,
    capture_sizes: Sequence[int],
    num_ubatches: int,
    drafter: Decoder | None,
    k: int,
) -> ModelRunner:
    """The runner one timed generation of ``shape`` uses: KV room for every request at once, a
    step budget of the largest capture size."""
    block_size = PagedKVCache.preferred_block_size(model)
    max_model_len = shape.prompt_len + shape.max_new_tokens + k
    blocks_per_req = -(-max_model_len // block_size)
    spec = dict(draft_model=drafter, num_speculative_tokens=k) if drafter is not None else {}
    graph_args = dict(cudagraph_capture_sizes=capture_sizes, max_model_len=max_model_len) if graphs else {}
    return ModelRunner(
        model,
        config,
        device=model.device,
        num_kv_blocks=shape.num_requests * blocks_per_req + 8,
        block_size=block_size,
        max_num_batched_tokens=max(capture_sizes),
        max_num_seqs=shape.num_requests,
        num_ubatches=num_ubatches,
        **spec,
        **graph_args,
    )


def time_generation(
    model: Decoder,
    config: ModelConfig,
    shape: GenerationShape,
    *,
    graphs: bool,
    capture_sizes: Sequence[int],
    num_ubatches: int = 1,
    drafter: Decoder | None = None,
    k: int = 0,
) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed ``generate`` of ``shape`` after any graph capture and an untimed identical one:
    its row of the report and its output tokens.

    The warm-up meets every shape the timed run will: cuDNN's SDPA (what the torch backend gets
    on an H200) builds a plan per new shape, 34-55 ms each, so an eager row timed cold measured
    plan building and depended on which rows ran before it."""
    runner = generation_runner(
        model,
        config,
        shape,
        graphs=graphs,
        capture_sizes=capture_sizes,
        num_ubatches=num_ubatches,
        drafter=drafter,
        k=k,
    )
    if graphs:
        runner.capture_graphs()
    prompts = shape.prompts(config.vocab_size)
    runner.generate(prompts, shape.max_new_tokens)
    before = (runner.spec_stats.num_draft_tokens, runner.spec_stats.num_accepted_tokens)
    _sync(model.device)
    start = time.perf_counter()
    outputs = runner.generate(prompts, shape.max_new_tokens)
    _sync(model.device)
    seconds = time.perf_counter() - start
    runner.close()
    drafts = runner.spec_stats.num_draft_tokens - before[0]
    accepted = runner.spec_stats.num_accepted_tokens - before[1]
    tokens = sum(len(o) for o in outputs)
    row = {
        "graphs": graphs,
        "num_ubatches": num_ubatches,
        "spec_k": k,
        "generated_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
    }
    return row, outputs


def generation_sweep(
    model: Decoder,
    config: ModelConfig,
    shape: GenerationShape,
    *,
    graph_modes: Sequence[bool],
    spec_ks: Sequence[int],
    drafters: Sequence[str],
    capture_sizes: Sequence[int],
    num_ubatches: int = 1,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Plain decoding, then every (drafter, k), in each graph mode; speedups are against plain
    decoding in the same mode, correctness against its tokens."""
    rows = []
    for graphs in graph_modes:
        plain, expected = time_generation(
            model, config, shape, graphs=graphs, capture_sizes=capture_sizes, num_ubatches=num_ubatches
        )
        rows.append({**plain, "drafter": None, "speedup": 1.0, "requests_differing": 0})
        for kind in drafters:
            drafter = make_drafter(kind, model, config)
            for k in spec_ks:
                row, outputs = time_generation(
                    model,
                    config,
                    shape,
                    graphs=graphs,
                    capture_sizes=capture_sizes,
                    num_ubatches=num_ubatches,
                    drafter=drafter,
                    k=k,
                )
                rows.append(
                    {
                        **row,
                        "drafter": kind,
                        "speedup": round(row["tokens_per_s"] / plain["tokens_per_s"], 4),
                        "requests_differing": sum(o != e for o, e in zip(outputs, expected)),
                    }
                )
                if progress is not None:
                    progress.update()
        if progress is not None:
            progress.update()
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
