"""What the runner refuses: before it serves, bad counts and policy options, a model whose
vocabulary disagrees with its config, prompts and limits of the wrong type, requests too long to
serve, DP groups that leave expert-parallel peers out, and drafters that would run collectives;
after each step, MoE layers that dropped assignments."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ubatch.models import Decoder, ModelConfig
from ubatch.policy import ModePolicy, SplitPolicy
from ubatch.runner.scheduling import RequestScheduler


def check_count(name: str, value: Any) -> None:
    """ValueError unless ``value`` is an int >= 1 (a bool or a float is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_options(
    split_policy: SplitPolicy | None, mode_policy: ModePolicy | None, num_ubatches: int, timeout_s: float
) -> None:
    """ValueError / TypeError for a split policy beside a mode policy, a timeout that is not
    positive, or a split policy without ``decide(num_tokens)`` or without ubatches to split into."""
    if mode_policy is not None and split_policy is not None:
        raise ValueError("give a split_policy or a mode policy (overlap_mode=ModePolicy), not both")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if split_policy is not None and not callable(getattr(split_policy, "decide", None)):
        raise TypeError(f"split_policy must have a decide(num_tokens) method, got {split_policy!r}")
    if split_policy is not None and num_ubatches < 2:
        raise ValueError(f"split_policy needs num_ubatches >= 2, got {num_ubatches}")


def per_prompt_limits(prompts: Any, max_new_tokens: Any) -> list[Any]:
    """``max_new_tokens`` as one limit per prompt; TypeError for anything but a list of prompts
    and an int or a sequence of them (a float is not silently truncated)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise TypeError(
                f"prompts must be a list of token-id lists, but prompt {i} is {prompt!r} ({type(prompt).__name__})"
            )
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * len(prompts)
    if isinstance(max_new_tokens, (str, bytes)) or not isinstance(max_new_tokens, Sequence):
        raise TypeError(
            f"max_new_tokens must be an int or a list of ints (one per prompt), got "
            f"{max_new_tokens!r} ({type(max_new_tokens).__name__})"
        )
    limits = list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts")
    return limits


def checked_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt as a list of ints, each in ``[0, vocab_size)``. Token ids must be integers
    (ints, numpy or 0-d torch integers; not bools, not floats, which would be truncated)."""
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
        raise TypeError(f"prompt_token_ids must be a sequence of token ids, got {type(prompt_token_ids).__name__}")
    prompt = []
    for i, token in enumerate(prompt_token_ids):
        if isinstance(token, bool):
            raise TypeError(f"prompt token at index {i} is a bool ({token}), not a token id")
        try:
            prompt.append(operator.index(token))
        except TypeError:
            raise TypeError(
                f"prompt token at index {i} must be an integer, got {token!r} ({type(token).__name__})"
            ) from None
    if not prompt:
        raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab_size:
            raise ValueError(f"prompt token {token} at index {i} is out of range [0, {vocab_size})")
    return prompt


def checked_request(
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    vocab_size: int,
    max_model_len: int,
    scheduler: RequestScheduler,
) -> list[int]:
    """The prompt as ``checked_prompt`` gives it, once the request is known to fit both
    ``max_model_len`` and the KV cache on its own."""
    prompt = checked_prompt(prompt_token_ids, vocab_size)
    check_count("max_new_tokens", max_new_tokens)
    scheduler.check_fits(len(prompt), max_new_tokens)
    if len(prompt) + max_new_tokens > max_model_len:
        raise ValueError(
            f"request too long for max_model_len={max_model_len}: prompt of {len(prompt)} tokens + "
            f"max_new_tokens={max_new_tokens}"
        )
    return prompt


def check_vocab(model: Decoder, config: ModelConfig) -> None:
    """The runner checks token ids against ``config.vocab_size`` and samples from the model's
    logits: both must agree with the model's embedding and output rows, or a token id past the
    embedding fails deep inside the model (or a sampled id lies outside the vocabulary)."""
    sizes = {"config.vocab_size": config.vocab_size}
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "vocab_size"):
        sizes["model.config.vocab_size"] = model_config.vocab_size
    for name in ("embed", "lm_head"):
        weight = getattr(model, name, None)
        if isinstance(weight, torch.Tensor):
            sizes[f"the model's {name} rows"] = weight.shape[0]
    if len(set(sizes.values())) > 1:
        found = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise ValueError(
            f"the model's vocabulary does not match its config: {found}; build the model from "
            f"the config passed to the runner"
        )


def check_dp_group(dp_group: Any, model: Decoder, ep_world: int) -> None:
    """A ``dp_group`` needs torch.distributed up and must cover the expert-parallel peers; an
    expert-parallel model needs one, so every rank runs every step with the same token count."""
    if dp_group is not None and not dist.is_initialized():
        raise ValueError("dp_group was given but torch.distributed is not initialized")
    if dp_group is None and ep_world > 1:
        raise ValueError(
            f"the model is expert-parallel over {ep_world} ranks: pass dp_group so that every "
            f"rank runs every step with the same token count"
        )
    if dp_group is not None:
        check_dp_covers_ep(dp_group, getattr(model, "moe_layers", {}).values())


def check_dp_covers_ep(dp_group: Any, moe_layers: Any) -> None:
    """Every expert-parallel peer must vote in the DP group: the vote is what pads all of them
    to one token count, and all-to-alls between ranks with different counts do not match."""
    dp_ranks = set(dist.get_process_group_ranks(dp_group))
    for layer in moe_layers:
        if layer.ep_group is None:
            continue
        outside = sorted(set(dist.get_process_group_ranks(layer.ep_group)) - dp_ranks)
        if outside:
            raise ValueError(
                f"the model's expert-parallel group includes ranks {outside} outside dp_group "
                f"(ranks {sorted(dp_ranks)}): they would not join the per-step vote, so their "
                f"all-to-alls could not be padded to match; use a dp_group that covers the EP group"
            )


def check_drafter(
    draft_model: Decoder | None, k: int | None, config: ModelConfig, device: torch.device, dp_group: Any
) -> bool:
    """Whether speculative decoding is asked for (both ``draft_model`` and ``k``, or neither);
    ValueError for one without the other, a bad ``k``, a drafter of another vocabulary or device,
    or one that would run collectives under ``dp_group`` (ranks draft different numbers of
    steps, so its collectives would not match)."""
    if draft_model is None and k is None:
        return False
    if draft_model is None or k is None:
        raise ValueError(
            f"speculative decoding needs both draft_model and num_speculative_tokens, got "
            f"draft_model={'None' if draft_model is None else type(draft_model).__name__}, "
            f"num_speculative_tokens={k!r}"
        )
    check_count("num_speculative_tokens", k)
    if draft_model.config.vocab_size != config.vocab_size:
        raise ValueError(
            f"the draft model's vocab_size={draft_model.config.vocab_size} differs from the "
            f"target's vocab_size={config.vocab_size}: they must share a vocabulary"
        )
    if draft_model.device != device:
        raise ValueError(f"the draft model is on {draft_model.device}, the runner on {device}")
    if dp_group is not None and not is_local(draft_model):
        raise ValueError(
            "with dp_group the draft model must run locally on each rank (no tp_group or "
            "ep_group): ranks draft different numbers of steps, so its collectives would not match"
        )
    return True


def is_local(model: Decoder) -> bool:
    """Whether ``model`` runs without collectives (no tensor- or expert-parallel group)."""
    return all(getattr(m, "tp_group", None) is None and getattr(m, "ep_group", None) is None for m in model.modules())


def check_moe_overflow(model: Decoder, capacity_factor: float | None) -> None:
    """RuntimeError naming every MoE layer that dropped assignments this step (counters are
    reset first, so the runner stays usable)."""
    counters = model.overflow_counters()
    if not counters:
        return
    counts = torch.stack(list(counters.values())).tolist()
    for counter in counters.values():
        counter.zero_()
    overflowed = [f"{name}: {count}" for name, count in zip(counters, counts) if count]
    if overflowed:
        raise RuntimeError(
            f"MoE capacity overflow (capacity_factor={capacity_factor}): dropped "
            f"(token, expert) assignments per layer: {', '.join(overflowed)}; raise "
            f"capacity_factor or set it to None"
        )
