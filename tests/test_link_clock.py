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
