"""A CPU stand-in for torch's built-in varlen flash kernel, so the torch backend's flash path
(``ubatch.attention.varlen``) runs in CI: the real kernel needs CUDA and fp16/bf16, and the GPU
tests (``-m cuda``) check it against the SDPA runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch


def fake_builtin_flash(
    q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale, seqused_k
):
    """What ``aten::_flash_attention_forward`` computes, per request: queries
    ``cum_seq_q[i]:cum_seq_q[i+1]`` over the first ``seqused_k[i]`` keys from ``cum_seq_k[i]``,
    causal aligned to the bottom right."""
    for t in (cum_seq_q, cum_seq_k, seqused_k):
        assert t.dtype == torch.int32 and t.device == q.device
    assert dropout_p == 0.0 and not return_debug_mask
    assert len(cum_seq_q) == len(cum_seq_k) == len(seqused_k) + 1 and int(cum_seq_q[-1]) == q.shape[0]
    if max_q == 1 and q.shape[1] != k.shape[1]:  # the kernel folds query heads: one query per request
        assert q.shape[0] == len(seqused_k), "max_seqlen_q == 1 needs exactly one query per request"
    outs = []
    for i, used in enumerate(seqused_k.tolist()):
        qs, qe, ks = int(cum_seq_q[i]), int(cum_seq_q[i + 1]), int(cum_seq_k[i])
        assert qe - qs <= max_q and used <= max_k and ks + used <= int(cum_seq_k[i + 1]) <= k.shape[0]
        n = qe - qs
        mask = torch.arange(used)[None] <= torch.arange(n)[:, None] + used - n if is_causal else None
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks : ks + used].transpose(0, 1),
            v[ks : ks + used].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs), None, None, None, None


@contextlib.contextmanager
def fake_builtin_flash_enabled() -> Iterator[list]:
    """Inside the block the torch backend takes its flash path on any device, through the fake;
    yields the list of calls, each as (query rows, ``max_seqlen_q``)."""
    from ubatch.attention import backends, varlen

    calls: list = []

    def recording(*args, **kwargs):
        calls.append((args[0].shape[0], args[5]))
        return fake_builtin_flash(*args, **kwargs)

    with (
        mock.patch.object(varlen, "_FLASH_FORWARD", recording),
        mock.patch.object(backends, "builtin_flash_supports", lambda q: True),
    ):
        yield calls
