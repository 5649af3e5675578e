"""ubatch.teardown names the process groups that outlive destroy_process_group."""

from __future__ import annotations

import logging

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
