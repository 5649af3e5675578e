"""The varlen flash path's per-step plan: built once per forward pass, never kept past it.

The kernel is the CPU fake of ``tests/builtin_flash_fake.py`` (or a null kernel where only the
host-side work matters); the reference is the torch backend's SDPA path on the same cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.builtin_flash_fake import fake_builtin_flash_enabled
from ubatch.attention import AttentionMetadata, TorchBackend, build_attention_metadata, varlen
from ubatch.context import ForwardContext, derive_context, override_forward_context, set_forward_context
from ubatch.slicing import split_batch
from ubatch.wrapper import make_ubatch_contexts

LAYER = "model.layers.0.attn"
BLOCK_SIZE = 4
NUM_BLOCKS, WIDTH = 24, 4
SCALE = 0.25
MIXED = ([1, 1, 6, 3, 1], [9, 5, 6, 11, 7])  # decodes at both ends, a prompt and a continuation


def _table(seq_lens: list[int], seed: int) -> torch.Tensor:
    """Each request's own blocks, shuffled, rows padded with block 0 to ``WIDTH``."""
    per_request = [-(-s // BLOCK_SIZE) for s in seq_lens]
    ids = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    rows, at = [], 0
    for n in per_request:
        rows.append(ids[at : at + n] + [0] * (WIDTH - n))
        at += n
    return torch.tensor(rows, dtype=torch.int32)


def _batch(
    query_lens: list[int], seq_lens: list[int], *, num_layers: int = 1, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Queries ``[T, 8, 16]``, one random cache per layer (2 KV heads) and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    md = build_attention_metadata(
        query_lens, seq_lens, _table(seq_lens, seed), torch.full((sum(query_lens),), -1, dtype=torch.int64)
    )
    q = torch.randn(sum(query_lens), 8, 16, generator=gen)
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen) for _ in range(num_layers)]
    return q, caches, md


def _reference(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    return TorchBackend(builtin_flash=False).forward(q, kv_cache, md, SCALE)


@pytest.fixture
def plans(monkeypatch) -> list:
    """The fake kernel in place, and the metadata of every ``varlen_plan`` call."""
    built: list = []
    plan = varlen.varlen_plan

    def spy(metadata, block_size):
        built.append(metadata)
        return plan(metadata, block_size)

    monkeypatch.setattr(varlen, "varlen_plan", spy)
    with fake_builtin_flash_enabled():
        yield built


def test_the_plan_is_built_once_per_step_and_again_the_next(plans):
    q, caches, md = _batch(*MIXED, num_layers=3)
    for step in (1, 2):
        with set_forward_context({LAYER: md}):
            for kv_cache in caches:  # each layer still gathers its own cache's K/V
                torch.testing.assert_close(
                    varlen.varlen_flash_attention(q, kv_cache, md, SCALE), _reference(q, kv_cache, md)
                )
        assert len(plans) == step
    varlen.varlen_flash_attention(q, caches[0], md, SCALE)
    varlen.varlen_flash_attention(q, caches[0], md, SCALE)
    assert len(plans) == 4, "outside a forward context every call builds its own plan"


def test_a_uniform_or_captured_batch_takes_no_plan(plans, monkeypatch):
    q, caches, md = _batch([1, 1, 1], [9, 5, 6])
    with set_forward_context({LAYER: md}):
        torch.testing.assert_close(varlen.varlen_flash_attention(q, caches[0], md, SCALE), _reference(q, caches[0], md))
    monkeypatch.setattr(varlen, "_capturing", lambda device: True)
    q, caches, md = _batch(*MIXED)
    with set_forward_context({LAYER: md}):
        torch.testing.assert_close(varlen.varlen_flash_attention(q, caches[0], md, SCALE), _reference(q, caches[0], md))
    assert plans == []


def test_a_derived_context_starts_with_an_empty_memo_of_its_own():
    parent = ForwardContext(ubatch_id=None)
    parent.step_memo["layout"] = object()
    for child in (dataclasses.replace(parent, ubatch_id=0), derive_context(parent, ubatch_id=1)):
        assert child.step_memo == {} and child.step_memo is not parent.step_memo
    assert ForwardContext() == parent, "the memo takes no part in comparisons"
    assert "step_memo" not in repr(parent)
    with pytest.raises(TypeError):
        ForwardContext(step_memo={})


def test_each_ubatch_builds_its_own_plan(plans):
    q, caches, md = _batch(*MIXED, num_layers=2)
    slices = split_batch(md.query_lens(), 2)
    with set_forward_context({LAYER: md}) as parent:
        children = make_ubatch_contexts(parent, slices)
        assert len({id(c.step_memo) for c in children}) == len(children)
        outs = []
        for child, s in zip(children, slices):
            child_md = child.attn_metadata[LAYER]
            with override_forward_context(child):
                outs.append(
                    [varlen.varlen_flash_attention(q[s.token_slice], kv_cache, child_md, SCALE) for kv_cache in caches]
                )
        assert parent.step_memo == {}
    assert plans == [c.attn_metadata[LAYER] for c in children]
    for layer, kv_cache in enumerate(caches):
        torch.testing.assert_close(torch.cat([o[layer] for o in outs]), _reference(q, kv_cache, md))


def _refill(md: AttentionMetadata, query_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> None:
    """What a runner with persistent metadata does between steps: new values, same tensors."""
    fresh = build_attention_metadata(query_lens, seq_lens, table, md.slot_mapping)
    for name in ("query_start_loc", "seq_lens", "block_table", "query_start_loc_cpu", "seq_lens_cpu"):
        getattr(md, name).copy_(getattr(fresh, name))
    md.max_query_len, md.max_seq_len = fresh.max_query_len, fresh.max_seq_len


@torch.inference_mode()  # inference tensors: no version counter could tell a refill apart
def test_metadata_refilled_in_place_between_steps_gets_a_fresh_plan(plans):
    query_lens, seq_lens = MIXED
    q, (kv_cache,), md = _batch(query_lens, seq_lens)
    with set_forward_context({LAYER: md}):
        torch.testing.assert_close(varlen.varlen_flash_attention(q, kv_cache, md, SCALE), _reference(q, kv_cache, md))
        # Same shapes and block counts, other blocks and lengths: the memo now holds a stale plan,
        # which is why it must not outlive the step.
        seq_lens = [10, 7, 8, 12, 8]
        _refill(md, query_lens, seq_lens, _table(seq_lens, seed=1))
        stale = varlen.varlen_flash_attention(q, kv_cache, md, SCALE)
    expected = _reference(q, kv_cache, md)
    assert not torch.allclose(stale, expected)
    with set_forward_context({LAYER: md}):
        torch.testing.assert_close(varlen.varlen_flash_attention(q, kv_cache, md, SCALE), expected)
    query_lens, seq_lens = [1, 4, 2, 1, 1], [10, 4, 9, 13, 9]  # other query lengths too, same total
    _refill(md, query_lens, seq_lens, _table(seq_lens, seed=2))
    with set_forward_context({LAYER: md}):
        torch.testing.assert_close(varlen.varlen_flash_attention(q, kv_cache, md, SCALE), _reference(q, kv_cache, md))
    assert len(plans) == 3


class _AtenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_later_layers_of_a_step_issue_no_plan_ops(monkeypatch):
    """With a null kernel, the first layer builds the layout; the next only gathers its K/V."""
    monkeypatch.setattr(varlen, "_FLASH_FORWARD", lambda q, *args, **kwargs: (q,))
    q, caches, md = _batch(*MIXED, num_layers=2)
    layers = []
    with set_forward_context({LAYER: md}):
        for kv_cache in caches:
            with _AtenOps() as ops:
                varlen.varlen_flash_attention(q, kv_cache, md, SCALE)
            layers.append(ops.names)
    plan_ops = {"repeat_interleave", "cumsum", "arange", "sub"}
    assert plan_ops <= set(layers[0])
    assert not plan_ops & set(layers[1])
    assert layers[1].count("index_select") == 2 * 3, "K and V of each of the three calls"
