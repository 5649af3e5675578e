"""Ranks of this host for a run that needs communication to hide, started the way torchrun
starts them (its elastic launcher), unless the run is already one of torchrun's ranks."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or other env://) launch."""
    return "WORLD_SIZE" in os.environ


def run_on_local_ranks(entry: Callable[..., Any], *args: Any, nproc: int) -> Any:
    """``entry(*args)`` on ``nproc`` new processes of this host, each a rank of one process group
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT`` set, the port a
    free one); rank 0's return value. A rank that fails stops the others and raises here.
    ``entry`` must be importable by name (the ranks are spawned, not forked). The launcher's
    signal handlers (it stops the ranks on SIGINT / SIGTERM) are this process's own again after."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ubatch-bench-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    previous = {sig: signal.getsignal(sig) for sig in handled}
    try:
        return elastic_launch(config, entry)(*args)[0]
    finally:
        if threading.current_thread() is threading.main_thread():  # the only thread the launcher sets them on
            for sig, handler in previous.items():
                if handler is not None:  # None: set outside Python, nothing to put back
                    signal.signal(sig, handler)
