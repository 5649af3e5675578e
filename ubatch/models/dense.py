"""The decoder skeleton shared by both reference models, and the dense (Llama-style) model.

The token dimension is the only batch dimension (a flattened varlen batch), so a wrapper can
slice every input along dim 0. Attention metadata is never an argument: the attention layers
read it from the forward context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ubatch.attention import Attention
from ubatch.models.config import ModelConfig
from ubatch.models.layers import RMSNorm, SelfAttention, SwiGLUMLP, frozen, init_weight
from ubatch.models.rms_norm import add_rms_norm


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)).

    The block's last residual add is left to its caller, which folds it into the next block's
    norm (or the final one): ``forward`` takes the previous block's FFN output with ``x`` and
    returns ``(x, ffn output)``, so every add meets its norm in one pass (``add_rms_norm``)."""

    def __init__(self, attn: SelfAttention, ffn: nn.Module, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_eps, dtype=config.dtype, device=device)
        self.attn = attn
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_eps, dtype=config.dtype, device=device)
        self.ffn = ffn

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pending``: the previous block's FFN output, not yet added to ``x`` (None: nothing)."""
        x, normed = _add_norm(x, pending, self.input_norm)
        x, normed = _add_norm(x, self.attn(normed, positions), self.post_attn_norm)
        return x, self.ffn(normed)


def _add_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm by ``norm``); without ``delta``, (x, norm(x))."""
    if delta is None:
        return x, norm(x)
    return add_rms_norm(x, delta, norm.weight, norm.eps)


class Decoder(nn.Module):
    """Embedding, N decoder layers, final norm and a replicated lm_head; ``make_ffn(i)`` gives
    layer i's feed-forward block.

    ``attention_layers`` is the static registry of Attention layers (pass it as the forward
    context's ``no_compile_layers``); ``layer_names`` lists its keys in layer order;
    ``row_parallel_layers`` the modules whose projection ends in a tensor-parallel all-reduce;
    ``num_kv_heads`` / ``head_dim`` size this rank's KV cache.
    """

    def __init__(
        self,
        config: ModelConfig,
        make_ffn: Callable[[int], nn.Module],
        *,
        device: torch.device | str,
        tp_group: Any = None,
        attn_backend: Any = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.attention_layers: dict[str, Attention] = {}
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed = frozen(
            init_weight((vocab, hidden), seed=config.seed, name="embed", std=1.0, dtype=config.dtype, device=device)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                SelfAttention(
                    config,
                    i,
                    registry=self.attention_layers,
                    device=device,
                    tp_group=tp_group,
                    attn_backend=attn_backend,
                ),
                make_ffn(i),
                config,
                device,
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_eps, dtype=config.dtype, device=device)
        self.lm_head = frozen(
            init_weight(
                (vocab, hidden), seed=config.seed, name="lm_head", std=hidden**-0.5, dtype=config.dtype, device=device
            )
        )
        self.layer_names: list[str] = list(self.attention_layers)
        # the projections whose all-reduce a mode may chunk (allreduceK), found once: a mode is
        # put in force every step a policy picks one
        self.row_parallel_layers: list[nn.Module] = [
            m for m in self.modules() if hasattr(m, "all_reduce_chunks") and getattr(m, "tp_group", None) is not None
        ]
        self.num_kv_heads: int = self.layers[0].attn.num_kv_heads
        self.head_dim: int = config.head_dim

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the flattened batch."""
        x, pending = F.embedding(input_ids, self.embed), None
        for layer in self.layers:
            x, pending = layer(x, positions, pending)
        return _add_norm(x, pending, self.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, vocab]."""
        return F.linear(hidden, self.lm_head).float()

    def overflow_counters(self) -> dict[str, torch.Tensor]:
        """Layer name -> device counter of tokens dropped for lack of capacity (none here)."""
        return {}


class DenseDecoder(Decoder):
    """Llama-style dense decoder with optional tensor parallelism over ``tp_group``."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str,
        tp_group: Any = None,
        attn_backend: Any = None,
    ) -> None:
        device = torch.device(device)

        def make_mlp(i: int) -> nn.Module:
            return SwiGLUMLP(
                config.hidden_size,
                config.intermediate_size,
                prefix=f"layers.{i}.mlp",
                seed=config.seed,
                dtype=config.dtype,
                device=device,
                tp_group=tp_group,
            )

        super().__init__(config, make_mlp, device=device, tp_group=tp_group, attn_backend=attn_backend)
