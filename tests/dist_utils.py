"""Run a test body in N processes (gloo on CPU, or NCCL with one GPU per rank), re-raising the
first failure in the parent (and stopping the other ranks at once)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ubatch.teardown import destroy_process_groups


def _entry(
    rank: int, world_size: int, backend: str, init_file: str, fn: Callable[..., Any], args: tuple, errors: Any
) -> None:
    torch.set_num_threads(1)  # several ranks share the cores (OMP_NUM_THREADS would come after torch's import)
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, device_id=device_id
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # tear down together: gloo aborts a rank whose peer closed mid-teardown
        destroy_and_check_released()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def destroy_and_check_released() -> None:
    """``destroy_process_group``, then fail if any group outlived it (see ``ubatch.teardown``):
    the rare gloo abort at exit that such a group can cause, caught deterministically."""
    alive = destroy_process_groups()
    if alive:
        raise AssertionError(
            f"{len(alive)} process group(s) outlived destroy_process_group: something still references {alive}"
        )


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc: int, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``torch.distributed.run --standalone`` with ``nproc`` processes from the repo root, the
    repo importable; ``args`` name the script (or ``-m module``) and its arguments."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120, backend: str = "gloo"
) -> None:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes sharing a process group."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, backend, init_file, fn, args, errors), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        # Stop at the first failure: its peers would wait in a collective until they time out.
        deadline = time.monotonic() + timeout_s
        while errors.empty() and any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        hung = [i for i, p in enumerate(procs) if p.is_alive()] if errors.empty() else []
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if not errors.empty():
            raise AssertionError(errors.get())
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise AssertionError(f"ranks exited with codes {codes}")
