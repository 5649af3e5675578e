"""Host values to the GPU without holding the host.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy from pageable memory,
which synchronizes: the host waits until the GPU has drained every earlier kernel, so a serving loop
that builds its next step's inputs while the current step runs would launch that step just in time.
A copy from pinned memory with ``non_blocking=True`` does not wait, and torch's pinned-memory cache
keeps the host buffer until the copy has read it. Nothing is uploaded while a CUDA graph is being
captured: a captured copy would read its host buffer at every replay, long after it is freed (torch
refuses a pageable one outright). Upload before capturing and copy into the graph's static inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(
    values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``values`` (a sequence or a tensor on any device) as a ``dtype`` tensor on ``device``; from
    the host to a GPU without a stream sync (see the module docstring)."""
    source = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or source.device.type != "cpu":
        return source.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"upload of {tuple(source.shape)} host values while a CUDA graph is being captured: the captured "
            "copy would read a freed host buffer at every replay; upload before capture and copy into the "
            "graph's static inputs"
        )
    return source.pin_memory().to(device, non_blocking=True)


def host_and_device(
    values: Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` as a ``dtype`` tensor on the host and its upload to ``device``."""
    host = torch.tensor(values, dtype=dtype)
    return host, upload(host, dtype, device)
