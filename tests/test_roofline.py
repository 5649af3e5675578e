"""step_roofline: hand-counted bytes and FLOPs of tiny dense and MoE steps, monotonic in tokens, bad input; each
GPU's ceilings."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubatch.bench.roofline import (
    GPU_CEILINGS,
    H200_BF16_MATMUL_TFLOPS_MEASURED,
    H200_COPY_GBPS_MEASURED,
    Roofline,
    ceilings_for,
    device_ceilings,
    format_roofline,
    roofline_fields,
    step_roofline,
)
from ubatch.models.config import ModelConfig

# hidden 8, one layer, 2 query heads and 1 KV head of 4, bf16: q_dim 8, kv_dim 4, QKV + O weights
# 8 * (8 + 2 * 4) + 8 * 8 = 192 elements.
DENSE = ModelConfig(
    vocab_size=32,
    hidden_size=8,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    dtype=torch.bfloat16,
)
MOE = DENSE.replace(num_experts=4, top_k=2, moe_intermediate_size=16, num_shared_experts=1)
UNIT = dict(hbm_gbps=1.0, peak_tflops=1.0)  # 1e9 bytes/s, 1e12 FLOP/s


def check(r, *, weight, kv, activation, flops):
    assert (r.weight_bytes, r.kv_bytes, r.activation_bytes, r.flops) == pytest.approx((weight, kv, activation, flops))
    assert r.bytes_ms == pytest.approx((weight + kv + activation) / 1e9 * 1e3)
    assert r.flops_ms == pytest.approx(flops / 1e12 * 1e3)


def test_dense_decode():
    r = step_roofline(DENSE, num_tokens=3, num_reqs=3, context_len_per_req=5, **UNIT)
    # Weights: attention 192 * 2 B + two norms 2 * 8 * 2 B + MLP 3 * 8 * 16 * 2 B + final norm 16 B + 3 embedding
    # rows of 16 B = 384 + 32 + 768 + 16 + 48. KV: 3 requests read 5 cached and write 1 new token's K and V
    # (4 * 2 B each). Activations: 3 tokens of 16 B in and out of the layer.
    # FLOPs: projections 2 * 3 * 192, attention 4 * (3 requests x 6 keys) * q_dim 8, MLP 2 * 3 * 384.
    check(r, weight=1248, kv=3 * 6 * 2 * 4 * 2, activation=2 * 3 * 16, flops=1152 + 576 + 2304)
    assert r.bound == "memory" and r.floor_ms == r.bytes_ms


def test_dense_prefill_is_causal():
    r = step_roofline(DENSE, num_tokens=6, num_reqs=2, context_len_per_req=[0, 3], query_len_per_req=[2, 4], **UNIT)
    # Query-key pairs: request 0 (2 new, none cached) 1 + 2 = 3; request 1 (4 new after 3 cached) 4 + 5 + 6 + 7.
    check(
        r,
        weight=384 + 32 + 768 + 16 + 6 * 16,
        kv=(2 + 7) * 2 * 4 * 2,
        activation=2 * 6 * 16,
        flops=2 * 6 * 192 + 4 * (3 + 22) * 8 + 2 * 6 * 384,
    )


def test_tokens_split_evenly_over_requests_by_default():
    even = step_roofline(DENSE, num_tokens=7, num_reqs=2, context_len_per_req=0, **UNIT)
    given_lens = step_roofline(DENSE, num_tokens=7, num_reqs=2, context_len_per_req=0, query_len_per_req=[4, 3], **UNIT)
    assert even == given_lens


def test_moe_decode_reads_only_the_touched_experts():
    r = step_roofline(MOE, num_tokens=1, num_reqs=1, context_len_per_req=5, **UNIT)
    # One token picks 2 of 4 experts: 2 expert weight sets (3 * 8 * 16 elements each) of the 4, plus the float32
    # router (4 * 8 * 4 B) and the shared expert (3 * 8 * 16).
    ffn_bytes = 4 * 8 * 4 + (2 * 384 + 384) * 2
    ffn_flops = 2 * (4 * 8 + 3 * 8 * (2 * 16 + 16))
    check(
        r,
        weight=384 + 32 + ffn_bytes + 16 + 16,
        kv=6 * 2 * 4 * 2,
        activation=2 * 16,
        flops=2 * 192 + 4 * 6 * 8 + ffn_flops,
    )


def test_moe_expert_parallel_rank_share():
    """Two ranks of one token each: a rank's 2 experts are each missed by both tokens with probability
    (1 - 2/4)^2, so 2 * 0.75 of them are read; the rank computes 1 token x top-2 expert rows."""
    one = step_roofline(MOE, num_tokens=1, num_reqs=1, context_len_per_req=5, **UNIT)
    two = step_roofline(MOE, num_tokens=1, num_reqs=1, context_len_per_req=5, ep_world=2, **UNIT)
    assert one.weight_bytes - two.weight_bytes == pytest.approx((2 - 1.5) * 384 * 2)
    assert two.flops == one.flops


def test_moe_prefill_reads_every_expert_and_is_compute_bound_on_the_bench_preset():
    r = step_roofline(MOE, num_tokens=200, num_reqs=1, context_len_per_req=0, **UNIT)
    all_experts = step_roofline(
        MOE.replace(num_experts=2, top_k=2), num_tokens=200, num_reqs=1, context_len_per_req=0, **UNIT
    )
    # 4 experts and a 4-expert router against 2 and a 2-expert router, with all experts touched in both.
    assert r.weight_bytes - all_experts.weight_bytes == pytest.approx(2 * 384 * 2 + 2 * 8 * 4)
    bench = ModelConfig.preset("moe-bench", num_layers=4)
    assert step_roofline(bench, num_tokens=4096, num_reqs=32, context_len_per_req=0).bound == "compute"
    assert step_roofline(bench, num_tokens=1024, num_reqs=1024, context_len_per_req=512).bound == "memory"


def test_tensor_parallel_splits_heads_mlp_and_kv():
    whole = step_roofline(DENSE, num_tokens=4, num_reqs=4, context_len_per_req=9, **UNIT)
    half = step_roofline(
        DENSE.replace(num_heads=4, num_kv_heads=2), num_tokens=4, num_reqs=4, context_len_per_req=9, tp_world=2, **UNIT
    )
    doubled = step_roofline(
        DENSE.replace(num_heads=4, num_kv_heads=2, intermediate_size=32),
        num_tokens=4,
        num_reqs=4,
        context_len_per_req=9,
        tp_world=2,
        **UNIT,
    )
    assert half.kv_bytes == whole.kv_bytes and half.weight_bytes == whole.weight_bytes - 3 * 8 * 8 * 2
    assert doubled.flops == whole.flops
    assert doubled.weight_bytes == whole.weight_bytes


def test_defaults_are_the_measured_h200_ceilings():
    r = step_roofline(DENSE, num_tokens=3, num_reqs=3, context_len_per_req=5)
    assert r.bytes_ms == pytest.approx(r.total_bytes / (H200_COPY_GBPS_MEASURED * 1e9) * 1e3)
    assert r.flops_ms == pytest.approx(r.flops / (H200_BF16_MATMUL_TFLOPS_MEASURED * 1e12) * 1e3)


def test_fraction_bound_and_format():
    r = Roofline(weight_bytes=1.0, kv_bytes=0.0, activation_bytes=0.0, flops=1.0, bytes_ms=4.2, flops_ms=1.0)
    assert r.fraction(13.5) == pytest.approx(4.2 / 13.5)
    assert format_roofline(r, 13.5) == "31% of 4.2 ms (memory)"
    compute = Roofline(weight_bytes=1.0, kv_bytes=0.0, activation_bytes=0.0, flops=1.0, bytes_ms=0.1, flops_ms=0.25)
    assert format_roofline(compute, 0.5) == "50% of 0.25 ms (compute)"
    assert compute.as_dict()["floor_ms"] == 0.25 and compute.as_dict()["bound"] == "compute"


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 3000),
    more=st.integers(1, 3000),
    context=st.integers(0, 2000),
    moe=st.booleans(),
    decode=st.booleans(),
)
def test_monotonic_in_tokens(tokens, more, context, moe, decode):
    config = ModelConfig.preset("moe-bench" if moe else "dense-bench")

    def roofline(t):
        return step_roofline(config, num_tokens=t, num_reqs=t if decode else 1, context_len_per_req=context)

    small, large = roofline(tokens), roofline(tokens + more)
    assert large.flops > small.flops and large.total_bytes > small.total_bytes
    assert large.floor_ms > small.floor_ms


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_tokens=0), ValueError, "num_tokens"),
        (dict(num_tokens=True), ValueError, "num_tokens"),
        (dict(num_reqs=5), ValueError, r"num_reqs \(5\) > num_tokens \(4\)"),
        (dict(context_len_per_req=-1), ValueError, "context_len_per_req"),
        (dict(context_len_per_req=[1, 2]), ValueError, "2 entries for 4 requests"),
        (dict(context_len_per_req=[1, 2, 3, 1.5]), ValueError, "context_len_per_req entry"),
        (dict(context_len_per_req="1234"), TypeError, "sequence of ints"),
        (dict(query_len_per_req=[1, 1, 1, 2]), ValueError, "sums to 5"),
        (dict(query_len_per_req=[4, 0, 0, 0]), ValueError, "query_len_per_req entry"),
        (dict(ep_world=2), ValueError, "dense model"),
        (dict(tp_world=4), ValueError, "num_heads"),
        (dict(hbm_gbps=0.0), ValueError, "hbm_gbps"),
        (dict(peak_tflops=math.nan), ValueError, "peak_tflops"),
        (dict(config="tiny"), TypeError, "ModelConfig"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = {**dict(config=DENSE, num_tokens=4, num_reqs=4, context_len_per_req=3), **kwargs}
    config = args.pop("config")
    with pytest.raises(error, match=match):
        step_roofline(config, **args)


def test_moe_expert_parallel_must_divide_experts():
    with pytest.raises(ValueError, match="num_experts"):
        step_roofline(MOE, num_tokens=2, num_reqs=2, context_len_per_req=0, ep_world=3)


@pytest.mark.parametrize("measured", [0.0, -1.0, math.inf, math.nan, None])
def test_fraction_rejects_bad_times(measured):
    r = step_roofline(DENSE, num_tokens=1, num_reqs=1, context_len_per_req=0)
    with pytest.raises(ValueError, match="measured_ms"):
        r.fraction(measured)


def test_each_gpu_is_rated_at_its_own_ceilings_and_an_unknown_one_at_none():
    assert ceilings_for("NVIDIA H200") is GPU_CEILINGS["H200"]
    assert ceilings_for("NVIDIA H100 80GB HBM3") is GPU_CEILINGS["H100"]
    assert ceilings_for("NVIDIA A100-SXM4-80GB") is None
    assert device_ceilings(torch.device("cpu")) is None
    h100, h200 = GPU_CEILINGS["H100"], GPU_CEILINGS["H200"]
    assert h100.copy_gbps < h200.copy_gbps and h100.hbm_gbps_datasheet < h200.hbm_gbps_datasheet


def test_a_rows_roofline_uses_the_gpus_ceilings_and_none_without_them():
    class Metadata:  # three decodes with 5, 6 and 7 cached tokens
        seq_lens_cpu = torch.tensor([6, 7, 8])

        @staticmethod
        def query_lens():
            return [1, 1, 1]

    h100 = GPU_CEILINGS["H100"]
    got = roofline_fields(MOE, Metadata(), 2.0, ceilings=h100)
    expected = step_roofline(
        MOE,
        num_tokens=3,
        num_reqs=3,
        context_len_per_req=[5, 6, 7],
        query_len_per_req=[1, 1, 1],
        hbm_gbps=h100.copy_gbps,
        peak_tflops=h100.matmul_tflops,
    )
    assert got["roofline_ms"] == pytest.approx(expected.floor_ms, abs=1e-4)
    assert got["roofline_fraction"] == pytest.approx(expected.floor_ms / 2.0, abs=1e-4)
    assert got["queued_roofline_fraction"] is None
    queued = roofline_fields(MOE, Metadata(), 2.0, ceilings=h100, queued_ms=1.6)
    assert queued["queued_roofline_fraction"] == pytest.approx(expected.floor_ms / 1.6, abs=1e-4)
    assert roofline_fields(MOE, Metadata(), 2.0, ceilings=None) == {
        "roofline_ms": None,
        "roofline_bound": None,
        "roofline_fraction": None,
        "queued_roofline_fraction": None,
    }
