"""Building blocks shared by the reference models: deterministic weights, sharding, RMSNorm,
rotary embedding, the SwiGLU MLP and the self-attention block.

Every weight is generated in full from ``(config.seed, weight name)`` and then sliced to the
rank's shard, so a tensor-parallel model holds exactly the pieces of the unsharded one and its
output is comparable with single-process output.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ubatch import comm
from ubatch.attention import Attention
from ubatch.link import is_link
from ubatch.models.config import ModelConfig
from ubatch.models.rms_norm import rms_norm
from ubatch.models.rotary import rotate_neox
from ubatch.models.swiglu import swiglu


def group_rank_world(group: Any) -> tuple[int, int]:
    """(rank, world size) within ``group``; (0, 1) when there is no group. A link stand-in
    (``ubatch.link``) is rank 0 of its world size: the model shards as one rank of that world."""
    if group is None:
        return 0, 1
    if is_link(group):
        return group.rank(), group.size()
    return dist.get_rank(group), dist.get_world_size(group)


def init_weight(
    shape: tuple[int, ...], *, seed: int, name: str, std: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A normal(0, std) weight that depends only on (seed, name, shape, device type).

    It is generated on ``device`` (fast for the GPU-sized presets); every rank of one device type
    draws the same full tensor and keeps its own slice.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    weight = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return weight.mul_(std).to(dtype)


def shard(weight: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """The ``rank``-th of ``world`` equal slices of ``weight`` along ``dim``."""
    return weight.chunk(world, dim)[rank].contiguous()


def frozen(weight: torch.Tensor) -> nn.Parameter:
    """An inference-only parameter."""
    return nn.Parameter(weight, requires_grad=False)


def check_divisible(what: str, value: int, world: int, group_name: str) -> None:
    """ValueError when ``value`` cannot be split evenly over ``world`` ranks."""
    if value % world:
        raise ValueError(f"{what} ({value}) must be divisible by the {group_name} world size ({world})")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (bf16 accumulation drifts), returned in the input dtype."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (halves rotated, ``ubatch.models.rotary``), angles computed
    from the positions given, so there is no maximum length and no per-step table. ``rotate``
    turns any number of heads at once, so a layer rotates its query and key heads in one pass."""

    def __init__(self, head_dim: int, theta: float, *, device: torch.device) -> None:
        super().__init__()
        self.head_dim = head_dim
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [T, heads * head_dim]``, every head of token t rotated by position ``positions[t]``."""
        return rotate_neox(x, positions, self.inv_freq, self.head_dim)


def row_parallel(x: torch.Tensor, weight: torch.Tensor, tp_group: Any, chunks: int = 1) -> torch.Tensor:
    """``x @ weight.T`` summed over ``tp_group`` (a row-parallel projection; ``x`` is [..., in]).
    With ``chunks`` > 1 the rows go in that many chunks and each chunk's all-reduce starts as
    soon as its GEMM is done, so it is in flight while the next chunk's GEMM runs (inside a
    ubatch: on the comm stream); only the last chunk's all-reduce is left with nothing beside it."""
    if tp_group is None:
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    if chunks == 1 or len(rows) < chunks:
        out = F.linear(x, weight)
        comm.all_reduce(out, group=tp_group)
        return out
    out = rows.new_empty(len(rows), weight.shape[0])
    bounds = [len(rows) * c // chunks for c in range(chunks + 1)]
    handles = []
    for start, stop in zip(bounds, bounds[1:]):
        torch.mm(rows[start:stop], weight.t(), out=out[start:stop])
        handles.append(comm.all_reduce(out[start:stop], group=tp_group, async_op=True))
    for handle in handles:
        handle.wait()
    return out.view(*x.shape[:-1], weight.shape[0])


class SwiGLUMLP(nn.Module):
    """silu(x W_gate) * (x W_up) W_down; with ``tp_group``, gate/up are split by columns and
    down by rows, and the partial outputs are summed with an all-reduce."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        prefix: str,
        seed: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        rank, world = group_rank_world(tp_group)
        check_divisible(f"{prefix} intermediate size", intermediate_size, world, "tensor-parallel")
        self.tp_group = tp_group

        def weight(name: str, shape: tuple[int, int], fan_in: int) -> torch.Tensor:
            return init_weight(shape, seed=seed, name=f"{prefix}.{name}", std=fan_in**-0.5, dtype=dtype, device=device)

        gate = weight("gate", (intermediate_size, hidden_size), hidden_size)
        up = weight("up", (intermediate_size, hidden_size), hidden_size)
        down = weight("down", (hidden_size, intermediate_size), intermediate_size)
        self.gate_up = frozen(torch.cat([shard(gate, 0, rank, world), shard(up, 0, rank, world)]))
        self.down = frozen(shard(down, 1, rank, world))
        self.all_reduce_chunks = 1  # the down projection's rows per all-reduce (``row_parallel``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel(swiglu(F.linear(x, self.gate_up)), self.down, self.tp_group, self.all_reduce_chunks)


class SelfAttention(nn.Module):
    """Fused QKV projection, rotary, paged attention and output projection of one layer.

    With ``tp_group`` the heads are split across ranks (QKV column-parallel, o_proj
    row-parallel followed by an all-reduce); each rank's KV cache holds its own KV heads.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        *,
        registry: dict[str, Attention],
        device: torch.device,
        tp_group: Any = None,
        attn_backend: Any = None,
    ) -> None:
        super().__init__()
        rank, world = group_rank_world(tp_group)
        check_divisible("num_heads", config.num_heads, world, "tensor-parallel")
        check_divisible("num_kv_heads", config.num_kv_heads, world, "tensor-parallel")
        self.tp_group = tp_group
        d, hidden = config.head_dim, config.hidden_size
        self.num_heads = config.num_heads // world
        self.num_kv_heads = config.num_kv_heads // world
        prefix = f"layers.{layer_idx}.attn"

        def weight(name: str, shape: tuple[int, int], fan_in: int) -> torch.Tensor:
            return init_weight(
                shape, seed=config.seed, name=f"{prefix}.{name}", std=fan_in**-0.5, dtype=config.dtype, device=device
            )

        q = weight("q", (config.num_heads * d, hidden), hidden)
        k = weight("k", (config.num_kv_heads * d, hidden), hidden)
        v = weight("v", (config.num_kv_heads * d, hidden), hidden)
        o = weight("o", (hidden, config.num_heads * d), config.num_heads * d)
        self.qkv = frozen(torch.cat([shard(w, 0, rank, world) for w in (q, k, v)]))
        self.o_proj = frozen(shard(o, 1, rank, world))
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.all_reduce_chunks = 1  # the output projection's rows per all-reduce (``row_parallel``)
        self.rotary = RotaryEmbedding(d, config.rope_theta, device=device)
        self.attn = Attention(
            self.num_heads,
            d,
            self.num_kv_heads,
            layer_name=prefix,
            scale=1.0 / math.sqrt(d),
            backend=attn_backend,
            registry=registry,
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        qk, v = F.linear(x, self.qkv).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary.rotate(positions, qk).split([self.q_size, self.kv_size], dim=-1)
        return row_parallel(self.attn(q, k, v), self.o_proj, self.tp_group, self.all_reduce_chunks)
