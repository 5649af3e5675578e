"""ModelConfig: the shape of a reference model, validated once, with named presets.

A config with ``num_experts > 0`` describes a MoE model; otherwise a dense one. Presets give
tests and benchmarks the same vocabulary ("tiny" on CPU, "moe-bench" on the H200).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    """Sizes of a Llama-style decoder, plus the MoE fields (unused when ``num_experts == 0``).

    ``capacity_factor`` None gives every expert-parallel destination worst-case capacity (a row
    per token), so no token is ever dropped; a finite factor f bounds it to f times the rows a
    uniform router sends there (``MoEFFN.capacity``) and the MoE layers count what overflows.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    capacity_factor: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.dtype = _parse_dtype(self.dtype)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            _require_positive_int(name, getattr(self, name))
        for name in ("num_experts", "top_k", "moe_intermediate_size", "num_shared_experts", "seed"):
            _require_int(name, getattr(self, name), minimum=0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_eps > 0:
            raise ValueError(f"rms_eps must be > 0, got {self.rms_eps}")
        if self.num_experts:
            self._validate_moe()

    def _validate_moe(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        _require_positive_int("moe_intermediate_size", self.moe_intermediate_size)
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")

    @property
    def kind(self) -> str:
        """ "moe" when the config has experts, else "dense"."""
        return "moe" if self.num_experts else "dense"

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``PRESETS``) with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _parse_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {value}")
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"dtype must be a torch float dtype or one of {sorted(_DTYPES)}, got {value!r}")


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_positive_int(name: str, value: Any) -> None:
    _require_int(name, value, minimum=1)


_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    dtype=torch.float32,
)
_TINY_MOE = dict(_TINY, num_experts=4, top_k=2, moe_intermediate_size=64)
_SMALL = dict(
    vocab_size=4096,
    hidden_size=512,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1408,
    dtype=torch.bfloat16,
)
_BENCH = dict(
    vocab_size=32000,
    hidden_size=4096,
    num_layers=8,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rope_theta=500000.0,
    dtype=torch.bfloat16,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-moe": _TINY_MOE,
    "tiny-moe-shared": dict(_TINY_MOE, num_shared_experts=1),
    "small": _SMALL,
    "small-moe": dict(_SMALL, num_experts=8, top_k=2, moe_intermediate_size=704, num_shared_experts=1),
    "dense-bench": _BENCH,
    "moe-bench": dict(_BENCH, num_experts=8, top_k=2, moe_intermediate_size=14336),
    # DeepSeek-style: fine-grained routed experts and one shared expert, so single-batch overlap has
    # work (the shared expert) to run under the dispatch; its 64 routed experts of 2048 take 3.2 GB
    # a layer in bf16, 26 GB over 8 layers, on one H200 per rank.
    "tiny-deepseek": dict(_TINY, num_experts=16, top_k=4, moe_intermediate_size=32, num_shared_experts=1),
    "deepseek-bench": dict(_BENCH, num_experts=64, top_k=8, moe_intermediate_size=2048, num_shared_experts=1),
}
