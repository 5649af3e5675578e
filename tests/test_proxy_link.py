"""``ubatch.proxy_link``: the CPU link it shares with HostLink, its host thread's pacing and clock (on
the CPU, with a mailbox in ordinary memory standing for the pinned one), and on a GPU, waiting in
the driver and in a warp: values, graph capture and replay, and the transfers the thread served."""

import ctypes
import time

import pytest
import torch

from tests.interpreted import DONE, run_interpreted
from tests.link_graphs import replay_captured_collectives
from ubatch.link import is_link
from ubatch.proxy_link import ProxyLink, _Mailbox, proxy_library


def _compiler_or_skip():
    try:
        return proxy_library()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def test_needs_a_bandwidth_and_a_known_wait_and_is_a_link():
    with pytest.raises(ValueError, match="needs a bandwidth"):
        ProxyLink(2, None)
    with pytest.raises(ValueError, match="wait must be one of stream, warp, got 'spin'"):
        ProxyLink(2, 10.0, wait="spin")
    link = ProxyLink(4, 50.0, device="cpu")
    assert is_link(link) and link.size() == 4
    assert repr(link) == "ProxyLink(world_size=4, bandwidth_gbps=50.0, wait='stream')"
    assert not link.transfers_in_trace and ProxyLink(4, 50.0, wait="warp").transfers_in_trace


def test_cpu_link_leaves_values_and_charges_a_rank_of_w():
    link = ProxyLink(4, 1000.0, device="cpu")
    x = torch.randn(8, 3)
    out = torch.zeros_like(x)
    link.all_to_all_single(out, x)
    assert torch.equal(out, x) and link.bytes_moved == x.nbytes * 3 // 4
    assert link.busy_ms() == pytest.approx(link.bytes_moved / 1e12 * 1e3), "its clock: the bytes over the bandwidth"
    info = link.describe()
    assert info["kind"] == "proxy-link stand-in" and info["bandwidth_set_gbps"] == 1000.0 and info["wait"] == "stream"


def test_host_thread_waits_the_links_time_less_its_overhead():
    library = _compiler_or_skip()
    mailbox = _Mailbox(bytes_per_ns=1.0, overhead_ns=2e6)  # 1 GB/s; 2 ms of the time is the round trip's
    assert library.proxy_start(ctypes.addressof(mailbox)) == 0
    try:
        # 20 ms at 1 GB/s, less the 2 ms: as bytes, and as rows of a size
        for units, unit_bytes, at_least in ((0, 1, 0.0), (20_000_000, 1, 0.018), (5_000, 4_000, 0.018)):
            mailbox.units, mailbox.unit_bytes = units, unit_bytes
            start = time.perf_counter()
            mailbox.doorbell = 1
            while mailbox.done != 1:
                assert time.perf_counter() - start < 5, "the host thread never completed the transfer"
            assert time.perf_counter() - start >= at_least and mailbox.doorbell == 0
            lagged = mailbox.lagged
            time.sleep(0.003)  # a warp that waited 3 ms for an SM before it took the flag back
            mailbox.done = 0
            while mailbox.lagged == lagged:
                assert time.perf_counter() - start < 5, "the host thread never saw the flag taken back"
        assert 0.042 <= mailbox.busy_ns / 1e9 < 0.5, "2 + 20 + 20 ms: each transfer's time, its round trip included"
        busy = mailbox.busy_ns
        mailbox.closed = 1  # closed: no time on the link, and none counted
        mailbox.units, mailbox.unit_bytes = 20_000_000, 1
        start = time.perf_counter()
        mailbox.doorbell = 1
        while mailbox.done != 1:
            assert time.perf_counter() - start < 5, "a closed link's thread never served the transfer"
        assert time.perf_counter() - start < 0.018 and mailbox.busy_ns == busy
    finally:
        library.proxy_stop(ctypes.addressof(mailbox))
    assert mailbox.served == 4 and mailbox.lagged == 3
    assert 3e6 <= mailbox.lag_max_ns <= mailbox.lag_total_ns and mailbox.lag_total_ns >= 9e6


@pytest.mark.cuda
@pytest.mark.parametrize("wait", ["stream", "warp"])
def test_cuda_values_capture_and_replay_served_by_the_thread(wait):
    _compiler_or_skip()
    link = ProxyLink(4, 50.0, wait=wait)
    link.prepare()
    info = link.describe()
    assert info["overhead_us"] > 0 and info["bandwidth_reached_gbps"] > 0
    lag = info["flag_lag_us"]  # on an idle GPU the wait is ready: the flag is taken back at once
    served = link._proxy.mailbox.served  # the last flag's lag may land just after the host reads them
    assert served - 1 <= lag["transfers"] <= served and 0 < lag["mean"] <= lag["max"] < 1000, lag
    busy = link.busy_ms()
    static_in = torch.randn(4, 1 << 16, device="cuda")
    static_out = torch.zeros_like(static_in)
    link.all_to_all_single(static_out, static_in)
    torch.cuda.synchronize()
    assert torch.equal(static_out, static_in) and link._proxy.mailbox.served == served + 1
    paced_ms = 3 * (4 << 16) / 50e6  # three rows of 256 KiB at 50 GB/s: 15.7 us, about one round trip
    assert max(paced_ms, link._proxy.overhead_us / 1e3) * 0.5 < link.busy_ms() - busy < 1.0, "its clock"
    replay_captured_collectives(link, static_in, replays=3)
    assert link._proxy.mailbox.served == served + 1 + 3 * 2
    sized = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        link.all_to_all_single(static_out, static_in, moved_rows=sized)
    mailbox = link._proxy.mailbox
    for rows in (0, 3):  # the rows the replay charges are the tensor's at replay time, at the input's row size
        sized.fill_(rows)
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, static_in) and (mailbox.units, mailbox.unit_bytes) == (rows, 4 << 16)
    link.all_to_all_single(static_out, static_in)  # an eager transfer sized when issued: its bytes, once each
    torch.cuda.synchronize()
    assert (mailbox.units, mailbox.unit_bytes) == (3 * (4 << 16), 1)
    link.close()
    static_in.copy_(torch.randn_like(static_in))
    sized.fill_(1 << 30)  # a replay that paced these rows would not end for hours
    start = time.perf_counter()
    graph.replay()  # after close(): the values, served at once by the napping thread
    torch.cuda.synchronize()
    assert torch.equal(static_out, static_in) and time.perf_counter() - start < 1.0


def test_moved_rows_only_where_sizes_are_set_on_the_device():
    from ubatch.link import HostLink

    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="use a ProxyLink"):
        HostLink(2, 1000.0, device="cpu").all_to_all_single(torch.zeros_like(x), x, moved_rows=torch.tensor([2]))
    link = ProxyLink(2, 1000.0, device="cpu")
    with pytest.raises(TypeError, match="one-element int64 tensor"):
        link.all_to_all_single(torch.zeros_like(x), x, moved_rows=torch.tensor([2.0]))
    out = torch.zeros_like(x)
    link.all_to_all_single(out, x, moved_rows=torch.tensor([2]))
    assert torch.equal(out, x) and link.bytes_moved == 2 * 3 * 4, "two rows of three floats"


def test_the_waiting_warp_reads_the_flag_and_re_arms_it_under_the_interpreter():
    script = f"""
import torch
from ubatch.proxy_link import _proxy_link_transfer

done = torch.tensor([1], dtype=torch.int32)  # the host thread has set it: no wait
_proxy_link_transfer[(1,)](done, num_warps=1)
assert done.tolist() == [0], done
print({DONE!r})
"""
    run_interpreted(script)


@pytest.mark.cuda
@pytest.mark.parametrize("expert_chunks", [1, 2])
def test_cuda_moe_layer_over_the_link_is_charged_the_rows_the_plan_counted(expert_chunks):
    """A static dispatch pads every block to its capacity; over a slow ProxyLink (10 MB/s, so the
    rows' bytes set the time) the dispatch and the combine, whole or per expert group, take the
    time of the rows to other ranks that hold a token: what the plan's kernels counted, copied to
    the mailbox and multiplied by the row's bytes on the host. The values equal HostLink's."""
    _compiler_or_skip()
    from ubatch.link import HostLink
    from ubatch.models import ModelConfig
    from ubatch.models.dispatch import dispatch_row_width
    from ubatch.models.moe import MoEFFN

    config = ModelConfig.preset("tiny-deepseek")
    world, gbps = 4, 0.01
    link = ProxyLink(world, gbps)
    layers = [MoEFFN(config, 0, device=torch.device("cuda"), ep_group=group) for group in (HostLink(world), link)]
    for layer in layers:
        layer.capacity_factor, layer.expert_chunks = 2.0, expert_chunks
    x = torch.randn(29, config.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    with torch.no_grad():
        layers[1](x)  # starts the host thread and compiles the kernels
        torch.cuda.synchronize()
        busy = link.busy_ms()
        out = layers[1](x)
        torch.cuda.synchronize()
        busy = link.busy_ms() - busy
        torch.testing.assert_close(out, layers[0](x), atol=0, rtol=0)
    _, ids = layers[1].route(x)
    rank_of = ids // layers[1].num_local_experts
    remote = sum(int((rank_of == r).any(dim=1).sum()) for r in range(1, world))
    assert int(layers[1].overflow_count) == 0, "a factor of 2 keeps every row of this batch"
    row_bytes = 4 * dispatch_row_width(config.hidden_size, config.top_k, torch.float32) + 4 * config.hidden_size
    real_ms = remote * row_bytes / (gbps * 1e6)
    round_trips_ms = 2 * expert_chunks * 2 * link._proxy.overhead_us / 1e3  # a transfer takes at least one
    assert real_ms * 0.95 <= busy <= real_ms + round_trips_ms + 0.3, (busy, real_ms)
    padded_ms = expert_chunks * 29 * (world - 1) * row_bytes / (gbps * 1e6)  # what sizes set when issued would charge
    assert busy < padded_ms * 0.9, (busy, padded_ms)
    link.close()
