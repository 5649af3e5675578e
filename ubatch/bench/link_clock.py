"""A step's communication from the link stand-in's own clock, where a profiler cannot see it.

The bench takes a replayed step's communication time (M) from the kernels torch.profiler records
(``ubatch.bench.kernels``). A ``ProxyLink`` that waits for its transfers in the driver
(``wait="stream"``, no SM, as a NIC's transfer takes none) leaves no activity there, so M comes
from the link's host thread instead, which times every transfer it paces (``busy_ms``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ubatch.bench.measure import drain
from ubatch.link import is_link
from ubatch.overlap import moe_layers, tensor_parallel_projections


def untraced_link(model: Any) -> Any | None:
    """The link stand-in ``model`` communicates over, where a profiler does not see its transfers
    (``transfers_in_trace`` False); None for any other group or none."""
    groups = [layer.ep_group for layer in moe_layers(model)]
    groups += [module.tp_group for module in tensor_parallel_projections(model)]
    return next((group for group in groups if is_link(group) and not group.transfers_in_trace), None)


def link_busy_ms(fn: Callable[[], Any], device: torch.device, link: Any) -> float:
    """The link's time during one call of ``fn``, by its own clock, the device drained around the
    call (every transfer's time is counted before the stream that waits for it goes on)."""
    drain(device)
    before = link.busy_ms()
    fn()
    drain(device)
    return link.busy_ms() - before
