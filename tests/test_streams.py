"""ubatch's side streams never alias, though torch's stream pool wraps round: on CPU against a
stand-in pool of four streams, on the GPU against torch's own after its pool went round."""

import contextlib
import itertools

import pytest
import torch

import ubatch.streams as streams
from ubatch.link import HostLink
from ubatch.scheduler import UBatchScheduler
from ubatch.streams import named_stream, ubatch_streams


@pytest.fixture
def small_pool(monkeypatch):
    """torch.cuda.Stream() as a pool of four streams handed out in turn, as torch hands out 32."""
    handles = itertools.cycle(range(1, 5))

    class PooledStream:
        def __init__(self):
            self.cuda_stream = next(handles)

    monkeypatch.setattr(streams, "POOL_SIZE", 4)
    monkeypatch.setattr(streams, "_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", PooledStream)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())


def test_each_role_keeps_one_stream_that_no_other_role_shares(small_pool):
    compute, comm = ubatch_streams("cuda:0", 2)
    for _ in range(9):  # others take streams from the pool meanwhile: it goes round twice
        torch.cuda.Stream()
    link = named_stream("cuda:0", "link-copy")
    assert ubatch_streams("cuda:0", 2) == (compute, comm), "the same streams at every call"
    handles = [s.cuda_stream for s in [*compute, comm, link]]
    assert len(set(handles)) == 4, f"roles share a stream: {handles}"
    assert named_stream("cuda:1", "comm") is not comm, "streams are per device"


def test_more_roles_than_the_pool_holds_is_an_error_that_says_so(small_pool):
    ubatch_streams("cuda:0", 3)
    with pytest.raises(RuntimeError, match="pool of 4 CUDA streams on device 0 .* 4 roles"):
        named_stream("cuda:0", "link-copy")


def test_named_streams_are_cuda_streams():
    with pytest.raises(ValueError, match="named streams are CUDA streams, got device cpu"):
        named_stream("cpu", "comm")


@pytest.mark.cuda
def test_cuda_schedulers_and_the_link_run_on_distinct_streams_after_the_pool_went_round():
    first = torch.cuda.Stream()
    later = [torch.cuda.Stream() for _ in range(streams.POOL_SIZE)]
    assert later[-1].cuda_stream == first.cuda_stream, "torch's pool hands the first stream out again"
    link = HostLink(2, bandwidth_gbps=20.0)
    link.prepare("cuda")
    schedulers = []
    for n in (2, 3, 2, 4):
        schedulers.append(UBatchScheduler(n, device="cuda"))
        for _ in range(10):  # others take streams from the pool meanwhile
            torch.cuda.Stream()
    side = link._staging().side
    for scheduler in schedulers:
        handles = [s.cuda_stream for s in [*scheduler.compute_streams, scheduler.comm_stream, side]]
        assert len(set(handles)) == len(handles), f"streams alias: {handles}"


def test_a_stream_beside_another_is_its_own_and_the_same_at_every_call(small_pool):
    compute, comm = ubatch_streams("cuda:0", 1)
    compute[0].device = torch.device("cuda", 0)
    beside = streams.beside_stream(compute[0])
    assert streams.beside_stream(compute[0]) is beside
    assert beside.cuda_stream not in (compute[0].cuda_stream, comm.cuda_stream)


def test_a_green_stream_gets_its_stream_beside_from_its_context_owner():
    made = []

    class Owner:
        def beside(self, stream):
            made.append(stream)
            return "on the same context"

    class GreenStream:
        _ubatch_green_owner = Owner()

    green = GreenStream()
    assert streams.beside_stream(green) == "on the same context" and made == [green]
