"""Attention backends over the paged KV cache: a torch reference, flash-attn (FA3/FA4/FA2), and
ubatch's Triton decode kernel in front of either.

A backend computes ``out [num_actual_tokens, H, D]`` from ``q [>= num_actual_tokens, H, D]``,
the layer's cache tensor ``[2, num_blocks, block_size, kv_heads, D]`` (already holding this
step's K/V) and the metadata; the layer zero-pads the rows after ``num_actual_tokens``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ubatch._triton import triton_available
from ubatch.attention.decode_kernel import decode_attention, decode_kernel_takes
from ubatch.attention.metadata import AttentionMetadata
from ubatch.attention.varlen import builtin_flash_supports, varlen_flash_attention

BACKEND_NAMES = ("torch", "flash", "triton")
DEFAULT_BLOCK_SIZE = 16  # KV tokens per page where the backend reads any page size
FA4_KEY_TILE = 128  # flash-attn 4's key tile for head sizes up to 128 (Hopper and Blackwell)
_INSTALL_HINT = "install it with `pip install ubatch[flash]` (flash-attn 4, CUDA 13)"


class AttentionBackend(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...


class TorchBackend:
    """Reference backend, any device. Where torch's built-in flash kernel cannot run (see the
    end), it gathers K/V from the block table and runs SDPA with a bottom-right-aligned causal
    mask, grouped-query heads shared in place (``enable_gqa``, no repeated KV copy).

    Requests are attended a run at a time: consecutive requests with equal query lengths (equal
    prompts, a run of decodes) take one batched SDPA, each masked by its own key length, so host
    launches grow with the number of runs rather than of requests (64 decodes beside two
    prompts take 77 aten ops, where one SDPA per request takes 2727). A run gathers every request's keys up to the run's
    longest context, trading padded reads for launches. Run boundaries come from the CPU copies
    of the lengths, so there is no device sync.

    A uniform batch (every request has the same query length: decode, speculative
    verification) is one run over the whole block table, masked by the device-side
    ``seq_lens``: its kernels depend only on shapes, so a FULL CUDA graph captured on it stays
    right when the lengths and block ids change between replays.

    Where torch's built-in flash kernel runs (CUDA, fp16/bf16: ``builtin_flash_supports``) the
    batch instead takes varlen flash calls (``ubatch.attention.varlen``: one, or one more for
    each end run of decodes): on an H200 torch would pick cuDNN for the SDPA calls, which
    builds a plan per new shape (34 ms to 1.1 s, then 0.06-0.5 ms a call), and a serving
    runner's batches keep changing shape.
    ``builtin_flash=False`` keeps the SDPA runs everywhere (to compare them, or to rule the
    kernel out)."""

    name = "torch"

    def __init__(self, *, builtin_flash: bool = True) -> None:
        if not isinstance(builtin_flash, bool):
            raise TypeError(f"builtin_flash must be a bool, got {builtin_flash!r}")
        self.builtin_flash = builtin_flash

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if self.builtin_flash and builtin_flash_supports(q):
            return varlen_flash_attention(q, kv_cache, metadata, scale)
        num_reqs, query_len = metadata.num_reqs, metadata.max_query_len
        if query_len * num_reqs == metadata.num_actual_tokens:
            return _attend_run(
                q[: num_reqs * query_len],
                kv_cache,
                metadata.block_table,
                metadata.seq_lens,
                query_len,
                metadata.causal,
                scale,
            )
        return self._by_runs(q, kv_cache, metadata, scale)

    def _by_runs(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        out = q.new_empty(starts[-1], q.shape[1], q.shape[2])
        for first, last in _equal_query_runs(starts):
            q_start, q_end = starts[first], starts[last]
            if q_start == q_end:
                continue
            num_blocks = -(-max(seq_lens[first:last]) // block_size)
            out[q_start:q_end] = _attend_run(
                q[q_start:q_end],
                kv_cache,
                metadata.block_table[first:last, :num_blocks],
                metadata.seq_lens[first:last],
                (q_end - q_start) // (last - first),
                metadata.causal,
                scale,
            )
        return out


def _equal_query_runs(query_start_loc: list[int]) -> list[tuple[int, int]]:
    """``[first, last)`` request ranges whose requests all have the same query length."""
    lengths = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
    runs: list[tuple[int, int]] = []
    first = 0
    for r in range(1, len(lengths) + 1):
        if r == len(lengths) or lengths[r] != lengths[first]:
            runs.append((first, r))
            first = r
    return runs


def _attend_run(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """One SDPA over ``R`` requests of ``query_len`` tokens each (``q [R * query_len, H, D]``),
    keys gathered through ``block_table [R, blocks]`` and masked past each request's
    ``seq_lens`` entry (and causally, bottom-right aligned)."""
    num_reqs = block_table.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    k, v = (
        kv_cache[i].index_select(0, block_table.flatten()).unflatten(0, block_table.shape).flatten(1, 2) for i in (0, 1)
    )  # [R, L, KVH, D]; a row gather, 20% faster than advanced indexing on CPU
    key_pos = torch.arange(k.shape[1], device=q.device).view(1, 1, -1)
    if causal:
        offsets = torch.arange(query_len, device=q.device) - query_len
        mask = key_pos <= (seq_lens.view(-1, 1) + offsets).unsqueeze(-1)  # [R, u, L]
    else:
        mask = (key_pos < seq_lens.view(-1, 1, 1)).expand(-1, query_len, -1)
    qr = q.view(num_reqs, query_len, num_heads, head_dim)
    o = F.scaled_dot_product_attention(
        qr.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),
        scale=scale,
        enable_gqa=num_heads != k.shape[2],
    )
    return o.transpose(1, 2).reshape(num_reqs * query_len, num_heads, head_dim)


def _call_fa3(fn: Callable, q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> Any:
    # Upstream FA3's flash_attn_varlen_func has no paged KV; its paged entry point is
    # flash_attn_with_kvcache, which takes varlen queries through cu_seqlens_q.
    return fn(
        q,
        k_cache,
        v_cache,
        cache_seqlens=md.seq_lens,
        page_table=md.block_table,
        cu_seqlens_q=md.query_start_loc,
        max_seqlen_q=md.max_query_len,
        softmax_scale=scale,
        causal=md.causal,
    )


def _call_fa4(fn: Callable, q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> Any:
    # No max_seqlen_k: FA4 bounds it by the page-table row, a shape, where the host-side
    # max_seq_len would be frozen at its capture-time value in a FULL graph.
    return fn(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=md.query_start_loc,
        max_seqlen_q=md.max_query_len,
        seqused_k=md.seq_lens,
        page_table=md.block_table,
        softmax_scale=scale,
        causal=md.causal,
    )


def _call_fa2(fn: Callable, q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> Any:
    block_size = k_cache.shape[1]
    if block_size % 256 != 0:
        raise ValueError(
            f"flash-attn 2 reads a paged KV cache only with block_size % 256 == 0, got "
            f"block_size={block_size}: use a block size of 256 (or a multiple), flash-attn 3/4, "
            f"or backend='torch'"
        )
    # FA2 takes per-request key lengths as cumulative offsets, even for a paged cache.
    cu_seqlens_k = F.pad(md.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return fn(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=md.query_start_loc,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=md.max_query_len,
        max_seqlen_k=md.max_seq_len,
        softmax_scale=scale,
        causal=md.causal,
        block_table=md.block_table,
    )


# (version, module, function, caller), in order of preference.
_FLASH_IMPLS = (
    ("fa3", "flash_attn_interface", "flash_attn_with_kvcache", _call_fa3),
    ("fa4", "flash_attn.cute.interface", "flash_attn_varlen_func", _call_fa4),
    ("fa2", "flash_attn", "flash_attn_varlen_func", _call_fa2),
)


class FlashAttentionBackend:
    """flash-attn reading the paged cache in place (one kernel for the whole batch).

    flash-attn runs fp16 / bf16 with head sizes that are multiples of 8 up to 256. Chosen
    automatically (``fallback`` set), it hands other queries to the fallback, so a float32
    model keeps working where flash-attn is installed; asked for by name, it refuses them."""

    name = "flash"

    def __init__(self, version: str, fn: Callable, *, fallback: AttentionBackend | None = None) -> None:
        callers = {v: caller for v, _, _, caller in _FLASH_IMPLS}
        if version not in callers:
            raise ValueError(f"unknown flash-attn version {version!r}; valid: {sorted(callers)}")
        self.version = version
        self._fn = fn
        self._call = callers[version]
        self.fallback = fallback

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
            if self.fallback is not None:
                return self.fallback.forward(q, kv_cache, metadata, scale)
            raise TypeError(
                f"flash-attn runs float16 / bfloat16 with a head size that is a multiple of 8 up to 256, "
                f"got {q.dtype} with head size {q.shape[-1]}; use backend='torch' (or None to choose per call)"
            )
        q = q[: metadata.num_actual_tokens]
        out = self._call(self._fn, q, kv_cache[0], kv_cache[1], metadata, scale)
        return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)


class DecodeKernelBackend:
    """Decode steps (one query token per request, or a few each alike: verifying drafted tokens)
    through ubatch's Triton flash-decoding kernel (``ubatch.attention.decode_kernel``), every
    other step, and inputs the kernel does not take, through ``inner``.

    Why: flash-attn 4's paged forward tiles 128 query rows, and a decode step fills only the few
    query heads that share a KV head (2.3 TB/s of K and V inside a 1024-request step on an H100,
    where a copy reaches 3.0); the kernel here tiles just those heads. Whether a step is a decode
    step comes from the host-side lengths, so a FULL graph captured on decode steps holds the
    kernel and stays right when the lengths and block ids change between replays."""

    name = "triton"

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        query_len = metadata.max_query_len
        num_tokens = metadata.num_reqs * query_len
        # every request has the longest query length (their sum says so); several tokens need causal
        if query_len and metadata.num_actual_tokens == num_tokens and (query_len == 1 or metadata.causal):
            table, lens = metadata.block_table, metadata.seq_lens
            if decode_kernel_takes(q[:num_tokens], kv_cache, table, lens, query_len=query_len):
                return decode_attention(q[:num_tokens], kv_cache, table, lens, scale, query_len=query_len)
        return self.inner.forward(q, kv_cache, metadata, scale)


def load_flash_attn(
    fallback: AttentionBackend | None = None,
) -> tuple[FlashAttentionBackend | None, list[str]]:
    """The most preferred importable flash-attn (handing ``fallback`` what it cannot run), or
    None and why each one failed."""
    failures = []
    for version, module, attr, _ in _FLASH_IMPLS:
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, OSError, AttributeError) as exc:
            failures.append(f"{module}.{attr} ({version}): {type(exc).__name__}: {exc}")
            continue
        return FlashAttentionBackend(version, fn, fallback=fallback), failures
    return None, failures


def preferred_block_size(backend: AttentionBackend, head_dim: int, dtype: torch.dtype) -> int:
    """The KV page size (tokens per block) ``backend`` reads fastest for ``head_dim`` / ``dtype``.

    flash-attn 4 loads a paged cache with TMA only when a page is exactly its key tile (128 keys
    for head sizes up to 128); any other page size takes a gather of rows. flash-attn 2 needs
    pages of a multiple of 256. torch and flash-attn 3 read any size: the small default wastes
    little of each request's last page. Where flash-attn cannot run the dtype, its torch
    fallback does (see ``FlashAttentionBackend``), so the default holds."""
    if isinstance(backend, DecodeKernelBackend):
        return preferred_block_size(backend.inner, head_dim, dtype)
    if isinstance(backend, FlashAttentionBackend) and dtype in (torch.float16, torch.bfloat16):
        if backend.version == "fa4" and head_dim <= FA4_KEY_TILE:
            return FA4_KEY_TILE
        if backend.version == "fa2":
            return 256
    return DEFAULT_BLOCK_SIZE


def describe_backend(backend: AttentionBackend) -> str:
    """A backend's name in reports: "torch", the flash-attn version ("flash_attn_fa4"), or the
    decode kernel in front of one ("triton_decode+flash_attn_fa4")."""
    if isinstance(backend, DecodeKernelBackend):
        return f"triton_decode+{describe_backend(backend.inner)}"
    if isinstance(backend, FlashAttentionBackend):
        return f"flash_attn_{backend.version}"
    return backend.name


def get_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """Resolve a backend for ``device``. None on CUDA: decode steps through the Triton decode
    kernel where Triton runs (``DecodeKernelBackend``), every other step through flash-attn where
    importable (torch for the queries it cannot run), else torch; None elsewhere: torch. "triton"
    is that choice with Triton required, "flash" flash-attn alone for every step. Naming "flash"
    or "triton" where it cannot run is an error rather than a silent fallback."""
    device = torch.device(device)
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; valid: {list(BACKEND_NAMES)}")
    if name == "torch" or (name is None and device.type != "cuda"):
        return TorchBackend()
    if device.type != "cuda":
        raise RuntimeError(
            f"attention backend {name!r} needs a CUDA device, got {device}; "
            f"use backend='torch' (or None to choose automatically)"
        )
    if name == "triton" and not triton_available(device):
        raise RuntimeError("attention backend 'triton' needs Triton (pip install triton); or use backend=None")
    if name in (None, "triton"):
        flash, _ = load_flash_attn(fallback=TorchBackend())
        inner = flash if flash is not None else TorchBackend()
        return DecodeKernelBackend(inner) if triton_available(device) else inner
    flash, failures = load_flash_attn()
    if flash is not None:
        return flash
    raise RuntimeError(
        "attention backend 'flash' needs flash-attn, but none is importable ("
        + "; ".join(failures)
        + f"); {_INSTALL_HINT}, or use backend='torch'"
    )


def available_backends(device: torch.device | str) -> list[str]:
    """Backend names that can run on ``device``."""
    device = torch.device(device)
    names = ["torch"]
    if device.type == "cuda" and load_flash_attn()[0] is not None:
        names.append("flash")
    if triton_available(device):
        names.append("triton")
    return names
