"""Overlapped collectives: equal to the plain torch.distributed calls, inside and outside ubatches."""

import contextlib
import functools
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from ubatch import comm
from ubatch.scheduler import PendingCollective, UBatchScheduler, UBatchState, current_ubatch, current_ubatch_id
from ubatch.slicing import split_batch


def _collectives(x: torch.Tensor) -> list[torch.Tensor]:
    """Every collective once, on a [tokens, hidden] input; world size from the default group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    reduced = x.clone()
    comm.all_reduce(reduced)
    exchanged = torch.empty_like(x)
    comm.all_to_all_single(exchanged, x.contiguous())
    gathered = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    comm.all_gather_into_tensor(gathered, x.contiguous())
    scattered = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype)
    comm.reduce_scatter_tensor(scattered, x.contiguous())
    return [reduced, exchanged, gathered, scattered]


def _ubatched_equals_plain(rank, world_size, n):
    """Each ubatch's collectives, overlapped, equal the same collectives run plainly on its rows
    (run on the scheduler directly: gathered and scattered outputs are not per row, so a
    wrapper would rightly refuse to concatenate them)."""
    torch.manual_seed(rank)
    slices = split_batch([4] * n, n)
    x = torch.randn(4 * n, 3)
    got = UBatchScheduler(n, "cpu").run([functools.partial(_collectives, x[s.token_slice]) for s in slices])
    for ubatch, s in zip(got, slices):
        for g, e in zip(ubatch, _collectives(x[s.token_slice])):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("n", [2, 3])
def test_ubatched_collectives_equal_plain_ones_gloo(n):
    run_distributed(_ubatched_equals_plain, 2, n)


def test_single_process_collectives_are_local_copies():
    x = torch.randn(4, 3)
    reduced, exchanged, gathered, scattered = _collectives(x)
    for t in (reduced, exchanged, gathered, scattered):
        assert torch.equal(t, x)


def test_single_process_collectives_still_yield_inside_ubatches():
    order = []

    def task():
        x = torch.ones(2)
        order.append((current_ubatch_id(), "before"))
        comm.all_reduce(x)
        order.append((current_ubatch_id(), "after"))

    UBatchScheduler(2, "cpu").run([task, task])
    assert order == [(0, "before"), (1, "before"), (0, "after"), (1, "after")]


def test_bad_arguments_raise_type_and_value_errors():
    with pytest.raises(TypeError, match="output must be a torch.Tensor, got list"):
        comm.all_to_all_single([1], torch.zeros(2))
    with pytest.raises(ValueError, match=r"output.shape == input.shape, got \(3,\) and \(2,\)"):
        comm.all_to_all_single(torch.zeros(3), torch.zeros(2))
    with pytest.raises(
        ValueError, match="all_gather_into_tensor with one rank needs equal sizes, got 6 and 3 elements"
    ):
        comm.all_gather_into_tensor(torch.zeros(6), torch.zeros(3))
    with pytest.raises(ValueError, match="reduce_scatter_tensor with one rank needs equal sizes, got 2 and 4 elements"):
        comm.reduce_scatter_tensor(torch.zeros(2), torch.zeros(4))


def _peer_missing(rank, world_size):
    if rank == 1:
        time.sleep(6)  # late: rank 0's two ubatches time out first; then match their collectives
        for _ in range(2):
            dist.all_reduce(torch.ones(2))
        return
    sched = UBatchScheduler(2, "cpu", timeout_s=2)

    def task():
        comm.all_reduce(torch.ones(2))

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ubatch 0 waited more than 2 s for all_reduce"):
        sched.run([task, task])
    assert time.monotonic() - t0 < 5


def test_a_missing_peer_gives_a_timeout_error_not_a_hang():
    run_distributed(_peer_missing, 2, timeout_s=60)


class _FailingWork:
    """A collective's work handle whose wait fails as gloo's does."""

    def __init__(self, message):
        self.message = message

    def wait(self, timeout):
        raise RuntimeError(self.message)


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:53391. This is typically caused "
            "by a remote worker crashing.",
            "ubatch 1's all_to_all_single failed: a peer rank closed its connection",
        ),
        (
            "[gloo/transport/tcp/pair.cc:575] Read error [127.0.0.1]:41234: Connection reset by peer",
            "ubatch 1's all_to_all_single failed: a peer rank closed its connection",
        ),
        ("Operation timed out!", "ubatch 1 waited more than 7 s for all_to_all_single (timed out"),
        (
            "Timed out waiting 7000ms for recv operation to complete",
            "ubatch 1 waited more than 7 s for all_to_all_single",
        ),
        (
            "unsupported reduction",
            "ubatch 1's all_to_all_single failed while waiting for its result: unsupported reduction",
        ),
    ],
)
def test_a_failed_wait_says_whether_the_peer_left_or_time_ran_out(message, expected):
    sched = UBatchScheduler(2, "cpu", timeout_s=7)

    def task():
        if current_ubatch_id() == 1:
            current_ubatch().run_collective("all_to_all_single", lambda is_async: _FailingWork(message), None)

    with pytest.raises(RuntimeError, match=re.escape(expected)) as info:
        sched.run([task, task])
    assert isinstance(info.value.__cause__, RuntimeError) and message in str(info.value)
    assert ("waited more than" in str(info.value)) == ("waited more than" in expected)


def _peer_exits(rank, world_size):
    if rank == 1:
        time.sleep(0.5)
        os._exit(0)  # gone without a word: rank 0's pending all-reduce sees the connection close
    sched = UBatchScheduler(2, "cpu", timeout_s=60)

    def task():
        comm.all_reduce(torch.ones(2))

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ubatch 0's all_reduce failed: a peer rank closed its connection"):
        sched.run([task, task])
    assert time.monotonic() - t0 < 30, "reported when the peer left, not when the 60 s ran out"
    os._exit(0)  # the peer is gone: skip the harness's closing barrier


def test_a_peer_that_exits_is_reported_as_gone_not_as_a_timeout():
    run_distributed(_peer_exits, 2, timeout_s=90)


def test_a_handle_makes_the_stream_it_is_given_wait_once(monkeypatch):
    """``wait(stream=...)``: inside a ubatch the ubatch's finish_collective gets the stream; outside
    one the work is waited with that stream current; a second wait does nothing."""
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append((self.name, "waits", event))

    class Scheduler:
        trace = None

    state = UBatchState(ubatch_id=0, scheduler=Scheduler(), compute_stream=Stream("compute"))
    monkeypatch.setattr(UBatchState, "yield_now", lambda self: log.append(("yield",)))
    monkeypatch.setattr(comm.scheduler, "current_ubatch", lambda: state)
    inside = comm.CollectiveHandle("all_to_all_single")
    inside.pending = PendingCollective("all_to_all_single", done_event="dispatch done")
    assert inside.wait(stream=Stream("beside")) and inside.wait()
    assert log == [("yield",), ("beside", "waits", "dispatch done")]

    log.clear()

    @contextlib.contextmanager
    def current(stream):
        log.append(("current", stream.name))
        yield
        log.append(("current", "back"))

    class Work:
        def wait(self):
            log.append(("work waited",))

    monkeypatch.setattr(comm.torch.cuda, "stream", current)
    outside = comm.CollectiveHandle("all_to_all_single")
    outside.work = Work()
    outside.wait(stream=Stream("beside"))
    assert log == [("current", "beside"), ("work waited",), ("current", "back")]
