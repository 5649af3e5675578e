"""Expert stages on two lanes (``ubatch.models.gemm_lanes``): on CPU every stage runs in turn
after its collectives; on the GPU odd stages compute on a second stream that waits for their
own collective only, and the layer's output is the one stage-by-stage order gives (bf16
atol = rtol = 2e-2 against one expert group, whose grouped GEMM blocks rows differently;
float32 1e-5 between the same groups)."""

import contextlib

import pytest
import torch

from ubatch.models import ModelConfig, build_model, expert_compute, gemm_lanes
from ubatch.models.gemm_lanes import GemmLanes


class Handle:
    def __init__(self, log):
        self.log = log

    def wait(self, **kwargs):
        self.log.append(("wait", kwargs))


def test_on_cpu_each_stage_waits_for_its_collectives_then_runs_in_turn():
    log = []
    lanes = GemmLanes(torch.device("cpu"), 2, rows=64)
    for stage in range(2):
        with lanes.stage(stage, [Handle(log), None]):
            log.append(("run", stage))
    assert log == [("wait", {}), ("run", 0), ("wait", {}), ("run", 1)]


class FakeStream:
    """Logs what a CUDA stream would be asked to do, for the lanes' order on a CPU."""

    def __init__(self, name, log):
        self.name, self.log, self.events = name, log, 0

    def record_event(self):
        self.events += 1
        event = f"{self.name} event {self.events}"
        self.log.append((self.name, "record", event))
        return event

    def wait_event(self, event):
        self.log.append((self.name, "wait", event))

    def wait_stream(self, other):
        self.log.append((self.name, "wait", other.name))


def test_a_lane_waits_for_the_current_stream_as_the_even_stage_before_it_opened(monkeypatch):
    """Stage 3 on the lane may start beside stage 2, but only after the current stream issued
    stage 1's consumers (recorded where stage 2 opened): else blocks the lane freed after stage 1
    are rewritten while the current stream still reads them."""
    log = []
    main, side = FakeStream("main", log), FakeStream("side", log)
    current = [main]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(gemm_lanes.torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(gemm_lanes.torch.cuda, "stream", on)
    monkeypatch.setattr(gemm_lanes, "beside_stream", lambda stream: side)

    class Collective:
        def __init__(self, stage):
            self.stage = stage

        def wait(self, stream=None):
            log.append(((stream or main).name, "wait", f"dispatch {self.stage}"))

    lanes = GemmLanes(torch.device("cuda"), 4, rows=64)
    for stage in range(4):
        with lanes.stage(stage, [Collective(stage)]):
            log.append((current[-1].name, "gemms", stage))
        log.append(("main", "sums", stage))
    assert log == [
        ("main", "record", "main event 1"),
        ("main", "wait", "dispatch 0"),
        ("main", "gemms", 0),
        ("main", "sums", 0),
        ("side", "wait", "main event 1"),
        ("side", "wait", "dispatch 1"),
        ("side", "gemms", 1),
        ("main", "wait", "side"),
        ("main", "sums", 1),
        ("main", "record", "main event 2"),
        ("main", "wait", "dispatch 2"),
        ("main", "gemms", 2),
        ("main", "sums", 2),
        ("side", "wait", "main event 2"),
        ("side", "wait", "dispatch 3"),
        ("side", "gemms", 3),
        ("main", "wait", "side"),
        ("main", "sums", 3),
    ]


def test_stages_of_many_rows_run_in_turn(monkeypatch):
    """Long GEMMs beside each other only stretch the even stage, whose combine then starts later."""
    log = []
    main, side = FakeStream("main", log), FakeStream("side", log)
    monkeypatch.setattr(gemm_lanes.torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(gemm_lanes, "beside_stream", lambda stream: side)
    lanes = GemmLanes(torch.device("cuda"), 2, rows=2 * gemm_lanes.MAX_STAGE_ROWS + 1)
    for stage in range(2):
        with lanes.stage(stage, [Handle(log)]):
            log.append(("run", stage))
    assert log == [("wait", {}), ("run", 0), ("wait", {}), ("run", 1)]


@pytest.mark.parametrize("chunks, runs", [(2, 1), (4, 1), (1, 2), (1, 4)])
def test_the_moe_layer_gives_the_lanes_its_received_rows(monkeypatch, chunks, runs):
    """Every received row (padding included): what the stages' GEMMs take together."""
    from ubatch.link import HostLink
    from ubatch.models import moe

    seen = []
    original = GemmLanes.__init__

    def recording(self, device, stages, *, rows):
        seen.append((stages, rows))
        original(self, device, stages, rows=rows)

    monkeypatch.setattr(moe.GemmLanes, "__init__", recording)
    config = ModelConfig(num_experts=8, top_k=2, hidden_size=32, moe_intermediate_size=32, capacity_factor=2.0)
    model = build_model(config, device="cpu", ep_group=HostLink(2))
    layer = next(iter(model.moe_layers.values()))
    layer.expert_chunks, layer.token_chunks = chunks, runs
    with torch.inference_mode():
        layer(torch.randn(64, 32))
    per_destination = layer.capacity(64)  # rows each rank sends each destination, per chunk
    received = 2 * (sum(per_destination) if runs == 1 else runs * -(-per_destination[0] // runs))
    assert seen == [(chunks * runs, received)]


def _moe_layer(dtype: torch.dtype, chunks: int):
    config = ModelConfig(num_experts=8, top_k=2, hidden_size=128, moe_intermediate_size=128, dtype=dtype)
    model = build_model(config, device="cuda")
    layer = next(iter(model.moe_layers.values()))
    layer.expert_chunks = chunks
    return layer


@pytest.mark.cuda
@pytest.mark.parametrize("chunks", [2, 4])
def test_odd_expert_groups_compute_beside_the_even_ones(monkeypatch, chunks):
    layer = _moe_layer(torch.float32, chunks)
    streams = []
    original = expert_compute.group_outputs

    def recording(*args, **kwargs):
        streams.append(torch.cuda.current_stream().cuda_stream)
        return original(*args, **kwargs)

    x = torch.randn(96, 128, device="cuda")
    with torch.inference_mode():
        monkeypatch.setattr(expert_compute, "group_outputs", recording)
        got = layer(x)
        monkeypatch.setattr(expert_compute, "group_outputs", original)
        in_turn = GemmLanes.__init__

        def one_lane(self, device, stages, **kwargs):
            in_turn(self, device, 1, **kwargs)

        monkeypatch.setattr(GemmLanes, "__init__", one_lane)
        expected = layer(x)
    main = torch.cuda.current_stream().cuda_stream
    assert len(streams) == chunks
    assert set(streams[0::2]) == {main}, "even groups run on the current stream"
    assert len(set(streams[1::2])) == 1 and main not in streams[1::2], "odd groups run on one stream beside it"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_bf16_expert_groups_on_two_lanes_equal_one_group():
    layer = _moe_layer(torch.bfloat16, 2)
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        layer.expert_chunks = 1
        expected = layer(x)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
