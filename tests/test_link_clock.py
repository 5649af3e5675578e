"""``ubatch.bench.link_clock``: where a profiler cannot see a link's transfers, the bench times a
step's communication by the link's own clock."""

import pytest
import torch

from ubatch.bench.link_clock import link_busy_ms, untraced_link
from ubatch.bench.measure import unsplit_call
from ubatch.bench.workload import make_step
from ubatch.link import HostLink
from ubatch.models import ModelConfig, build_model
from ubatch.proxy_link import ProxyLink


def _model(preset: str, group):
    config = ModelConfig.preset(preset)
    groups = {"ep_group": group} if config.kind == "moe" else {"tp_group": group}
    return build_model(config, device="cpu", **groups)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny"])
def test_only_a_link_that_waits_in_the_driver_is_timed_by_its_clock(preset):
    stream_wait = ProxyLink(2, 10.0, device="cpu")
    assert untraced_link(_model(preset, stream_wait)) is stream_wait
    for group in (ProxyLink(2, 10.0, device="cpu", wait="warp"), HostLink(2, 10.0, device="cpu"), None):
        assert untraced_link(_model(preset, group)) is None


def test_a_steps_link_time_is_what_its_collectives_charged():
    link = ProxyLink(4, 10.0, device="cpu")
    model = _model("tiny-moe", link)
    step, _ = make_step(model, [4] * 8)
    before = link.bytes_moved
    ms = link_busy_ms(unsplit_call(model, step), torch.device("cpu"), link)
    charged = link.bytes_moved - before
    assert charged > 0 and ms == pytest.approx(charged / 10e9 * 1e3)


def test_the_unsplit_steps_m_comes_from_the_links_clock_and_c_from_its_kernels(monkeypatch):
    """``modes.unsplit_costs`` over an untraced link: C from the profiled kernels (here a fixed
    trace: 2 ms of compute, and a size copy that marks each of two collectives), each M sample the
    link's time over a replay of the step."""
    from ubatch.bench import modes
    from ubatch.bench.kernels import Kernel

    trace = [
        Kernel("gemm", 0.0, 1000.0),
        Kernel("Memcpy DtoH (Device -> Pinned)", 1000.0, 1002.0),
        Kernel("gemm", 1002.0, 2002.0),
        Kernel("Memcpy DtoH (Device -> Pinned)", 2002.0, 2004.0),
    ]
    monkeypatch.setattr(modes, "profile_kernels", lambda fn, device: trace)
    link = ProxyLink(2, 10.0, device="cpu")
    x = torch.randn(8, 1000)

    def step():
        link.all_to_all_single(torch.empty_like(x), x)  # 4 rows of 4000 bytes to the other rank: 1.6 us

    compute_ms, comm_ms, samples, share = modes.unsplit_costs(step, torch.device("cpu"), link)
    assert compute_ms == pytest.approx(2.0) and share == pytest.approx(0.5)
    assert samples == pytest.approx([16_000 / 10e9 * 1e3] * modes.COST_REPLAYS) and comm_ms == pytest.approx(samples[0])
    assert modes.unsplit_costs(step, torch.device("cpu"))[1] == pytest.approx(0.004), "without a link: the trace's"
