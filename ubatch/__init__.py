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
from ubatch.cudagraph import BatchExecutionDescriptor, CudaGraphManager
from ubatch.link import HostLink
from ubatch.overlap import OverlapMode
from ubatch.policy import ModePolicy, SplitPolicy, StepCosts, calibrate
from ubatch.proxy_link import ProxyLink
from ubatch.scheduler import MAX_UBATCHES, current_ubatch_id, join_ubatches, yield_ubatch
from ubatch.slicing import UBatchSlice, register_metadata_splitter, split_batch
from ubatch.wrapper import UBatchWrapper

__all__ = [
    "BatchDescriptor",
    "BatchExecutionDescriptor",
    "CUDAGraphMode",
    "CudaGraphManager",
    "DPMetadata",
    "ForwardContext",
    "HostLink",
    "MAX_UBATCHES",
    "ModePolicy",
    "OverlapMode",
    "ProxyLink",
    "SplitPolicy",
    "StepCosts",
    "UBatchSlice",
    "UBatchWrapper",
    "calibrate",
    "current_ubatch_id",
    "get_forward_context",
    "join_ubatches",
    "override_forward_context",
    "register_metadata_splitter",
    "set_forward_context",
    "split_batch",
    "yield_ubatch",
]
