"""The throwaway requests a runner serves before real traffic: prompts from one token up to a
full batch and outputs of different lengths, so its steps mix prefills, continuations and
decodes, and whatever the attention path builds on first use (flash-attn 4 kernel variants,
cuDNN plans per shape) is ready before the first real request."""

from __future__ import annotations

import torch

from ubatch.runner.checks import check_count


def warmup_requests(
    num_requests: int,
    max_new_tokens: int,
    *,
    seed: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    kv_capacity: int,
) -> tuple[list[list[int]], list[int]]:
    """The prompts and their ``max_new_tokens``, each request fitting one step's token budget,
    ``max_model_len`` and the cache's ``kv_capacity`` tokens; ValueError where none can."""
    check_count("num_requests", num_requests)
    check_count("max_new_tokens", max_new_tokens)
    longest = min(max_num_batched_tokens, max_model_len - max_new_tokens, kv_capacity - max_new_tokens)
    if longest < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt (max_model_len={max_model_len})")
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [max(1, longest * (i + 1) // num_requests) for i in range(num_requests)]
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    return prompts, [1 + i % max_new_tokens for i in range(num_requests)]
