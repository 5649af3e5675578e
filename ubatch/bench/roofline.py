"""The roofline of one reference-model step on one rank: the fewest bytes it must move through device memory and
the FLOPs it must do, each over its ceiling, the larger being the floor no implementation runs much below.

What is counted, per rank, for ``Decoder.forward`` (embedding to final norm; the lm_head is not part of the step):

- weights, each read once: attention (QKV and output projections, this rank's 1/tp of the heads), the norms, the
  embedding rows the tokens look up (at most one per token), and the FFN. Dense: the whole MLP (1/tp). MoE: the
  float32 router, the shared experts (1/tp), and only the routed experts that receive at least one token, in
  expectation (below).
- KV cache: each request's cached context read once per layer, and the new tokens' K and V written once.
- activations: each layer's hidden state read in and written out; everything inside a layer is taken to stay on
  chip (a lower bound: the kernels of today do write their intermediates).
- FLOPs: the GEMMs (2 per multiply-add) and attention's QK^T and PV over each query's keys: its request's cached
  context plus the new tokens up to and including itself (causal). Norms, rotary and activations are left out.

Routed experts: every expert-parallel rank runs ``num_tokens`` tokens (as ``MoEFFN`` requires), and each token picks
``top_k`` distinct experts uniformly at random, so a given expert is missed by one token with probability
1 - k/E and by all ``ep_world * num_tokens`` tokens of the group with probability (1 - k/E)^(ep * T): a rank's
E/ep experts touch E/ep * (1 - (1 - k/E)^(ep * T)) weight sets in expectation, and the rank computes T * k expert
rows. Real routers are not uniform (skew touches fewer experts), so this is an expectation, not a bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubatch.models.config import ModelConfig
from ubatch.models.layers import check_divisible, group_rank_world

# Datasheet figures (H200 SXM; device docs H200.md): leads, not ceilings.
H200_HBM_GBPS_DATASHEET = 4800.0
H200_BF16_DENSE_TFLOPS_DATASHEET = 990.0
# Measured on one-GPU H200 machines of this workplace (device docs KINDS.md, 2026-10-28 and 2026-11-04): a
# device-to-device copy moved about 4.3 TB/s counting bytes read plus written; an 8192^3 bf16 matrix product ran at
# 769-798 TFLOP/s on random data (about 790, the device README's figure). The defaults below.
H200_COPY_GBPS_MEASURED = 4300.0
H200_BF16_MATMUL_TFLOPS_MEASURED = 790.0
# One-GPU H100 (80 GB HBM3) machines of this workplace (KINDS.md, 2026-11-13): the same copy moved about 3.0 TB/s and
# the product ran at 798 TFLOP/s; the datasheet gives 3.35 TB/s.
H100_HBM_GBPS_DATASHEET = 3350.0
H100_COPY_GBPS_MEASURED = 3000.0
H100_BF16_MATMUL_TFLOPS_MEASURED = 790.0

_ROUTER_BYTES = 4  # MoEFFN keeps its router weight in float32


@dataclass(frozen=True)
class Ceilings:
    """One GPU's rates: the measured copy (bytes read plus written per second, GB/s) and matrix
    product (TFLOP/s) a step's roofline is timed at, and the datasheet's memory bandwidth, which no
    kernel's reads beat (``ubatch.bench.ceiling``)."""

    copy_gbps: float
    matmul_tflops: float
    hbm_gbps_datasheet: float


GPU_CEILINGS = {
    "H200": Ceilings(H200_COPY_GBPS_MEASURED, H200_BF16_MATMUL_TFLOPS_MEASURED, H200_HBM_GBPS_DATASHEET),
    "H100": Ceilings(H100_COPY_GBPS_MEASURED, H100_BF16_MATMUL_TFLOPS_MEASURED, H100_HBM_GBPS_DATASHEET),
}


def ceilings_for(device_name: str) -> Ceilings | None:
    """The ceilings of a GPU by its name (``torch.cuda.get_device_name``); None for one whose rates
    were never measured here, whose report rows then carry no roofline rather than another GPU's."""
    return next((c for key, c in GPU_CEILINGS.items() if key in device_name), None)


def device_ceilings(device: Any) -> Ceilings | None:
    """``ceilings_for`` the CUDA device ``device``; None on a CPU."""
    if getattr(device, "type", device) != "cuda":
        return None
    return ceilings_for(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class Roofline:
    """One step's fewest bytes (split by kind), FLOPs, and their times at the given ceilings."""

    weight_bytes: float
    kv_bytes: float
    activation_bytes: float
    flops: float
    bytes_ms: float
    flops_ms: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def floor_ms(self) -> float:
        """The larger of the byte time and the FLOP time: no version of the step runs much faster."""
        return max(self.bytes_ms, self.flops_ms)

    @property
    def bound(self) -> str:
        """ "memory" or "compute": which of the two times is the floor."""
        return "memory" if self.bytes_ms >= self.flops_ms else "compute"

    def fraction(self, measured_ms: float) -> float:
        """floor / measured: 1.0 is a step at its roofline."""
        if (
            isinstance(measured_ms, bool)
            or not isinstance(measured_ms, (int, float))
            or not measured_ms > 0
            or not math.isfinite(measured_ms)
        ):
            raise ValueError(f"measured_ms must be a finite time > 0, got {measured_ms!r}")
        return self.floor_ms / measured_ms

    def as_dict(self) -> dict[str, Any]:
        """The fields and the derived floor, for a result file."""
        return {**dataclasses.asdict(self), "floor_ms": self.floor_ms, "bound": self.bound}


def format_roofline(roofline: Roofline, measured_ms: float) -> str:
    """A table cell: the share of its roofline a step measured at ``measured_ms`` reached, the floor and what
    bounds it, e.g. "31% of 4.2 ms (memory)"."""
    return f"{100 * roofline.fraction(measured_ms):.0f}% of {roofline.floor_ms:.3g} ms ({roofline.bound})"


def step_roofline(
    config: ModelConfig,
    *,
    num_tokens: int,
    num_reqs: int,
    context_len_per_req: int | Sequence[int],
    query_len_per_req: Sequence[int] | None = None,
    ep_world: int = 1,
    tp_world: int = 1,
    hbm_gbps: float = H200_COPY_GBPS_MEASURED,
    peak_tflops: float = H200_BF16_MATMUL_TFLOPS_MEASURED,
) -> Roofline:
    """The roofline of one step of ``config``'s model on one rank (see the module docstring for what counts).

    ``num_tokens``: this rank's real tokens (padding is not work the step must do), split over ``num_reqs``
    requests as ``query_len_per_req`` says, or as evenly as possible (decode: one each; prefill: the prompts).
    ``context_len_per_req``: tokens already cached per request, one for all or one per request. ``ep_world``:
    the expert-parallel group (MoE only); ``tp_world``: the tensor-parallel group. ``hbm_gbps``: bytes moved per
    second (read plus written), in GB/s; ``peak_tflops``: the matrix rate, in TFLOP/s.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    _check_int("num_tokens", num_tokens, 1)
    _check_int("num_reqs", num_reqs, 1)
    _check_int("ep_world", ep_world, 1)
    _check_int("tp_world", tp_world, 1)
    _check_rate("hbm_gbps", hbm_gbps)
    _check_rate("peak_tflops", peak_tflops)
    if num_reqs > num_tokens:
        raise ValueError(f"num_reqs ({num_reqs}) > num_tokens ({num_tokens}): every request has a new token")
    queries = _query_lens(num_tokens, num_reqs, query_len_per_req)
    contexts = _context_lens(num_reqs, context_len_per_req)
    check_divisible("num_heads", config.num_heads, tp_world, "tensor-parallel")
    check_divisible("num_kv_heads", config.num_kv_heads, tp_world, "tensor-parallel")
    if config.kind == "moe":
        check_divisible("num_experts", config.num_experts, ep_world, "expert-parallel")
        check_divisible(
            "shared expert intermediate size",
            config.num_shared_experts * config.moe_intermediate_size,
            tp_world,
            "tensor-parallel",
        )
    else:
        if ep_world != 1:
            raise ValueError(f"ep_world must be 1 for a dense model, got {ep_world}")
        check_divisible("intermediate_size", config.intermediate_size, tp_world, "tensor-parallel")

    elt = config.dtype.itemsize
    hidden, layers, tokens = config.hidden_size, config.num_layers, num_tokens
    q_dim = config.num_heads * config.head_dim // tp_world
    kv_dim = config.num_kv_heads * config.head_dim // tp_world
    weights = layer_weights(config, tp_world)
    query_key_pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(queries, contexts))
    layer_flops = 2 * tokens * weights.attention // elt + 4 * query_key_pairs * q_dim
    layer_weight_bytes = weights.attention + weights.norms
    ffn_weight_bytes, ffn_flops = _ffn(config, weights, tokens, ep_world)
    layer_weight_bytes += ffn_weight_bytes
    layer_flops += ffn_flops

    weight_bytes = layers * layer_weight_bytes + hidden * elt + min(tokens, config.vocab_size) * hidden * elt
    kv_bytes = layers * sum(c + q for q, c in zip(queries, contexts)) * 2 * kv_dim * elt
    activation_bytes = layers * 2 * tokens * hidden * elt
    flops = layers * layer_flops
    total_bytes = weight_bytes + kv_bytes + activation_bytes
    return Roofline(
        weight_bytes=float(weight_bytes),
        kv_bytes=float(kv_bytes),
        activation_bytes=float(activation_bytes),
        flops=float(flops),
        bytes_ms=total_bytes / (hbm_gbps * 1e9) * 1e3,
        flops_ms=flops / (peak_tflops * 1e12) * 1e3,
    )


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weight bytes on one rank of ``tp_world``, by what reads them: the attention's
    projections (QKV and output) and, of them, the row-parallel output projection; the two norms;
    a dense model's MLP and its row-parallel down projection; a MoE's float32 router, shared
    experts and one routed expert (zero where the model has none)."""

    attention: int
    attention_out: int
    norms: int
    mlp: int
    mlp_down: int
    router: int
    shared: int
    expert: int


def layer_weights(config: ModelConfig, tp_world: int = 1) -> LayerWeights:
    """``LayerWeights`` of ``config`` on one rank of ``tp_world``."""
    elt, hidden = config.dtype.itemsize, config.hidden_size
    q_dim = config.num_heads * config.head_dim // tp_world
    kv_dim = config.num_kv_heads * config.head_dim // tp_world
    attention_out = q_dim * hidden * elt
    moe = config.kind == "moe"
    down = 0 if moe else hidden * config.intermediate_size // tp_world * elt
    shared_inter = config.num_shared_experts * config.moe_intermediate_size // tp_world
    return LayerWeights(
        attention=hidden * (q_dim + 2 * kv_dim) * elt + attention_out,
        attention_out=attention_out,
        norms=2 * hidden * elt,
        mlp=3 * down,
        mlp_down=down,
        router=config.num_experts * hidden * _ROUTER_BYTES if moe else 0,
        shared=3 * hidden * shared_inter * elt,
        expert=3 * hidden * config.moe_intermediate_size * elt,
    )


def _ffn(config: ModelConfig, weights: LayerWeights, tokens: int, ep_world: int) -> tuple[float, float]:
    """(weight bytes, FLOPs) of one layer's feed-forward block on one rank: two FLOPs per weight
    element and token for each weight a token goes through."""
    elt = config.dtype.itemsize
    if config.kind == "dense":
        return weights.mlp, 2 * tokens * weights.mlp // elt
    routed = config.top_k * weights.expert + weights.shared
    weight_bytes = weights.router + touched_experts(config, tokens, ep_world) * weights.expert + weights.shared
    flops = 2 * tokens * (weights.router // _ROUTER_BYTES + routed // elt)
    return weight_bytes, flops


def touched_experts(config: ModelConfig, tokens: int, ep_world: int) -> float:
    """How many of a rank's local experts receive at least one of the rows ``tokens`` tokens on each
    of ``ep_world`` ranks route, in expectation under a uniform router (the module docstring)."""
    experts, k = config.num_experts, config.top_k
    return experts / ep_world * (1.0 - (1.0 - k / experts) ** (ep_world * tokens))


def even_parts(total: int, parts: int) -> list[int]:
    """``total`` cut into ``parts`` sizes as even as possible, the larger first."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def _query_lens(num_tokens: int, num_reqs: int, query_len_per_req: Sequence[int] | None) -> list[int]:
    if query_len_per_req is None:
        return even_parts(num_tokens, num_reqs)
    queries = _int_list("query_len_per_req", query_len_per_req, num_reqs, minimum=1)
    if sum(queries) != num_tokens:
        raise ValueError(f"query_len_per_req sums to {sum(queries)}, not num_tokens ({num_tokens})")
    return queries


def _context_lens(num_reqs: int, context_len_per_req: int | Sequence[int]) -> list[int]:
    if isinstance(context_len_per_req, int) and not isinstance(context_len_per_req, bool):
        _check_int("context_len_per_req", context_len_per_req, 0)
        return [context_len_per_req] * num_reqs
    return _int_list("context_len_per_req", context_len_per_req, num_reqs, minimum=0)


def _int_list(name: str, values: Any, length: int, *, minimum: int) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    if len(values) != length:
        raise ValueError(f"{name} has {len(values)} entries for {length} requests")
    for value in values:
        _check_int(f"{name} entry", value, minimum)
    return list(values)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_rate(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def roofline_fields(
    config: ModelConfig,
    metadata: Any,
    measured_ms: float,
    *,
    ceilings: Ceilings | None,
    ep_world: int = 1,
    tp_world: int = 1,
    queued_ms: float | None = None,
) -> dict[str, Any]:
    """A bench row's roofline columns for a step measured at ``measured_ms`` on a GPU of
    ``ceilings`` (``device_ceilings``), from its attention metadata, and the fraction at
    ``queued_ms`` (the step timed with launches queued, ``ubatch.bench.modes``) where given; None
    without ceilings (a CPU, a GPU not measured here)."""
    if ceilings is None:
        return {
            "roofline_ms": None,
            "roofline_bound": None,
            "roofline_fraction": None,
            "queued_roofline_fraction": None,
        }
    query_lens = metadata.query_lens()
    contexts = [s - q for s, q in zip(metadata.seq_lens_cpu.tolist(), query_lens)]
    roofline = step_roofline(
        config,
        num_tokens=sum(query_lens),
        num_reqs=len(query_lens),
        context_len_per_req=contexts,
        query_len_per_req=query_lens,
        ep_world=ep_world,
        tp_world=tp_world,
        hbm_gbps=ceilings.copy_gbps,
        peak_tflops=ceilings.matmul_tflops,
    )
    return {
        "roofline_ms": round(roofline.floor_ms, 4),
        "roofline_bound": roofline.bound,
        "roofline_fraction": round(roofline.fraction(measured_ms), 4),
        "queued_roofline_fraction": None if queued_ms is None else round(roofline.fraction(queued_ms), 4),
    }


def shard_worlds(model: Any) -> tuple[int, int]:
    """(expert-parallel, tensor-parallel) world sizes ``model`` is sharded for, from the groups its
    layers hold: a step's roofline is one rank's share of the work."""

    def world(attr: str) -> int:
        group = next((getattr(m, attr) for m in model.modules() if getattr(m, attr, None) is not None), None)
        return group_rank_world(group)[1]

    return world("ep_group"), world("tp_group")
