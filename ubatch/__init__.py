"""ubatch: split each batch into micro-batches whose communication hides under compute."""

from ubatch.context import (
    BatchDescriptor,
    CUDAGraphMode,
    DPMetadata,
    ForwardContext,
    get_forward_context,
    override_forward_context,
    set_forward_context,
)

__all__ = [
    "BatchDescriptor",
    "CUDAGraphMode",
    "DPMetadata",
    "ForwardContext",
    "get_forward_context",
    "override_forward_context",
    "set_forward_context",
]
