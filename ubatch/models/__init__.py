"""Reference transformer models (dense and MoE) with tensor and expert parallelism."""

from __future__ import annotations

from typing import Any

import torch

from ubatch.models.config import PRESETS, ModelConfig
from ubatch.models.dense import Decoder, DenseDecoder
from ubatch.models.moe import MoEDecoder, MoEFFN


def build_model(
    config: ModelConfig,
    *,
    device: torch.device | str,
    tp_group: Any = None,
    ep_group: Any = None,
    attn_backend: Any = None,
) -> Decoder:
    """The model ``config`` describes ("dense" or "moe"), in eval mode on ``device``."""
    if config.kind == "moe":
        model: Decoder = MoEDecoder(
            config, device=device, tp_group=tp_group, ep_group=ep_group, attn_backend=attn_backend
        )
    else:
        if ep_group is not None:
            raise ValueError("ep_group is only meaningful for a MoE config (num_experts > 0)")
        model = DenseDecoder(config, device=device, tp_group=tp_group, attn_backend=attn_backend)
    return model.eval()


__all__ = ["PRESETS", "Decoder", "DenseDecoder", "MoEDecoder", "MoEFFN", "ModelConfig", "build_model"]
