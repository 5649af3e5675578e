"""ubatch.teardown names the process groups that outlive destroy_process_group."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch.distributed as dist

from ubatch.teardown import destroy_process_groups, destroy_process_groups_or_warn


def _init(store) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def test_a_group_still_referenced_is_reported_and_a_released_one_is_not(tmp_path):
    _init(tmp_path / "store")
    kept = dist.new_group([0], backend="gloo")
    survivors = destroy_process_groups()
    assert survivors == [kept]
    del survivors, kept
    _init(tmp_path / "store_again")
    dist.new_group([0], backend="gloo")
    assert destroy_process_groups() == []


def test_the_warning_names_the_count_and_the_upstream_abort(tmp_path, caplog):
    _init(tmp_path / "store")
    kept = dist.new_group([0], backend="gloo")
    with caplog.at_level(logging.WARNING, logger="ubatch.teardown"):
        destroy_process_groups_or_warn()
    (record,) = caplog.records
    assert "1 process group(s) outlived destroy_process_group" in record.getMessage()
    assert "pytorch/pytorch#190489" in record.getMessage()
    del kept


_PROFILE_AFTER_INIT = """
import sys
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from ubatch.teardown import destroy_process_groups, import_before_init
if sys.argv[2] == "import_before_init":
    import_before_init()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
with profile(activities=[ProfilerActivity.CPU]):
    torch.ones(2) + 1
print(len(destroy_process_groups()))
"""


def _survivors_after_profiling(tmp_path, order: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _PROFILE_AFTER_INIT, str(tmp_path / "store"), order],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.split()[-1])


def test_the_profiler_pins_the_default_group_unless_its_imports_came_first(tmp_path):
    """torch.profiler imports torch.distributed.nn.functional, whose default arguments bind
    group.WORLD: after init_process_group that is the live group, before it None."""
    assert _survivors_after_profiling(tmp_path, "after_init") == 1
    assert _survivors_after_profiling(tmp_path, "import_before_init") == 0
