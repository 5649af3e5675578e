"""Process-group teardown that reports groups kept alive past ``destroy_process_group``.

A group that outlives it (typically held by a reference cycle) keeps gloo's worker threads
running into interpreter exit, where one that drops a finished collective's tensors needs the
GIL and aborts the process (pytorch/pytorch#190489): a rare SIGABRT at exit, long after the
cause. Naming the survivors at teardown turns that into a message at the place it starts.

One such holder is torch itself: ``torch.distributed.nn.functional`` binds ``group.WORLD`` into
its functions' default arguments when it is first imported, and torch.profiler imports it
lazily (through torch._dynamo). Imported after ``init_process_group`` it pins the default group
for the life of the process; ``import_before_init`` imports it while WORLD is still None.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)


def import_before_init() -> None:
    """Import the torch modules that would pin the default group if first imported after
    ``init_process_group`` (see the module docstring). Call it just before that."""
    import torch.distributed.nn.functional  # noqa: F401 - imported for its import-time defaults


def destroy_process_groups() -> list[Any]:
    """``dist.destroy_process_group()``; the groups that are still referenced afterwards."""
    groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
    dist.destroy_process_group()
    return [group() for group in groups if group() is not None]


def destroy_process_groups_or_warn() -> None:
    """``destroy_process_groups``, logging a warning that names any group still referenced."""
    survivors = destroy_process_groups()
    if survivors:
        logger.warning(
            "%d process group(s) outlived destroy_process_group (something still references %s): "
            "gloo may abort this process at exit (pytorch/pytorch#190489); if the default group is "
            "among them, was torch.distributed.nn (or torch.profiler) first imported after "
            "init_process_group? ubatch.teardown.import_before_init",
            len(survivors),
            survivors,
        )
