"""ceiling: hand-counted weight bytes each overlap mode reads again, and the efficiency they leave."""

import pytest
import torch

from ubatch.bench.ceiling import ceiling_fields, extra_weight_bytes
from ubatch.bench.roofline import GPU_CEILINGS
from ubatch.models.config import ModelConfig
from ubatch.overlap import OverlapMode

# hidden 8, two layers, 2 query heads and 1 KV head of 4, bf16 (2 bytes): QKV 8 * (8 + 2 * 4) = 128
# and O 8 * 8 = 64 elements, two norms of 8: 208 elements, 416 bytes per layer and ubatch.
DENSE = ModelConfig(
    hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, dtype=torch.bfloat16
)
ATTENTION_BYTES = 416
DOWN_BYTES = 8 * 16 * 2  # one MLP projection; gate, up and down are three
# 4 experts of 3 * 8 * 16 bf16 elements (768 bytes), top-2, a float32 router of 4 * 8, no shared.
MOE = DENSE.replace(num_experts=4, top_k=2, moe_intermediate_size=16)
EXPERT_BYTES = 3 * 8 * 16 * 2
ROUTER_BYTES = 4 * 8 * 4
H200 = GPU_CEILINGS["H200"]
MANY = 4096  # tokens enough that every expert receives a row (in expectation, to within 0.5^4096)


def mode(name: str) -> OverlapMode:
    return OverlapMode.parse(name)


@pytest.mark.parametrize("name", ["unsplit", "overlap", "pipeline2", "pipeline4"])
def test_modes_that_do_not_split_read_every_weight_once(name):
    assert extra_weight_bytes(MOE, mode(name), MANY) == 0


def test_a_dense_split_reads_every_weight_once_per_ubatch():
    per_layer = ATTENTION_BYTES + 3 * DOWN_BYTES
    assert extra_weight_bytes(DENSE, mode("split2"), 64) == 2 * per_layer
    assert extra_weight_bytes(DENSE, mode("split3"), 64) == 2 * 2 * per_layer


def test_chunked_all_reduces_read_each_row_parallel_projection_once_per_chunk():
    row_parallel = 64 * 2 + DOWN_BYTES  # the attention's output projection and the MLP's down
    assert extra_weight_bytes(DENSE, mode("allreduce4"), 64) == 2 * 3 * row_parallel
    split = extra_weight_bytes(DENSE, mode("split2"), 64)
    assert extra_weight_bytes(DENSE, mode("split2+allreduce2"), 64) == split + 2 * 2 * row_parallel


def test_a_moe_split_reads_every_local_expert_again_unless_its_expert_stages_are_joined():
    per_ubatch = ATTENTION_BYTES + ROUTER_BYTES
    assert extra_weight_bytes(MOE, mode("split2+join"), MANY) == pytest.approx(2 * per_ubatch)
    assert extra_weight_bytes(MOE, mode("split2+join+pipeline2"), MANY) == pytest.approx(2 * per_ubatch)
    assert extra_weight_bytes(MOE, mode("split2"), MANY) == pytest.approx(2 * (per_ubatch + 4 * EXPERT_BYTES))
    # over two ranks a rank holds 2 of the 4 experts: half the expert bytes again
    assert extra_weight_bytes(MOE, mode("split2"), MANY, ep_world=2) == pytest.approx(
        2 * (per_ubatch + 2 * EXPERT_BYTES)
    )


def test_joined_stages_read_the_shared_experts_once_unless_they_are_tensor_parallel():
    shared = MOE.replace(num_shared_experts=1)  # one more expert's bytes, read by every token
    per_ubatch = ATTENTION_BYTES + ROUTER_BYTES
    assert extra_weight_bytes(shared, mode("split2+join"), MANY) == pytest.approx(2 * per_ubatch)
    assert extra_weight_bytes(shared, mode("split2"), MANY) == pytest.approx(
        2 * (per_ubatch + EXPERT_BYTES + 4 * EXPERT_BYTES)
    )
    # tensor-parallel shared experts keep their own all-reduce, so each ubatch runs its own
    tp = extra_weight_bytes(shared, mode("split2+join"), MANY, tp_world=2)
    assert tp > extra_weight_bytes(MOE, mode("split2+join"), MANY, tp_world=2)


def test_a_split_of_few_tokens_reads_only_the_experts_its_ubatches_reach():
    # one token per rank and ubatch reaches at most top_k = 2 of the 4 experts: in expectation
    # 4 * (1 - (1 - 2/4)^1) = 2 per ubatch, against 4 * (1 - 0.5^2) = 3 for the whole step
    assert extra_weight_bytes(MOE, mode("split2"), 2) == pytest.approx(
        2 * (ATTENTION_BYTES + ROUTER_BYTES + (2 + 2 - 3) * EXPERT_BYTES)
    )


def test_token_chunks_read_every_local_expert_again_per_chunk_but_nothing_else():
    assert extra_weight_bytes(MOE, mode("tokens2"), MANY) == pytest.approx(2 * 4 * EXPERT_BYTES)  # two layers
    assert extra_weight_bytes(MOE, mode("tokens4"), MANY, ep_world=2) == pytest.approx(2 * 3 * 2 * EXPERT_BYTES)
    split = extra_weight_bytes(MOE, mode("split2"), MANY)
    assert extra_weight_bytes(MOE, mode("split2+tokens2"), MANY) == pytest.approx(split + 2 * 2 * 4 * EXPERT_BYTES)
    # a chunk of one token reaches top_k = 2 of the 4 experts, where the 2-token step reaches 3
    assert extra_weight_bytes(MOE, mode("tokens4"), 2) == pytest.approx(2 * (2 + 2 - 3) * EXPERT_BYTES)


def test_own_rows_first_reads_each_expert_stage_twice_but_changes_nothing_on_one_rank():
    assert extra_weight_bytes(MOE, mode("local"), MANY) == 0
    assert extra_weight_bytes(MOE, mode("local"), MANY, ep_world=2) == pytest.approx(2 * 2 * EXPERT_BYTES)


def test_ceiling_is_the_efficiency_of_the_unsplit_compute_plus_the_reread_time():
    reread_ms = extra_weight_bytes(MOE, mode("split2"), MANY) / (4800 * 1e6)  # an H200's datasheet bandwidth
    got = ceiling_fields(MOE, mode("split2"), MANY, compute_ms=4.0, comm_ms=3.0, unsplit_ms=7.5, ceilings=H200)
    ideal = 7.0 / 4.0
    assert got["reread_ms"] == pytest.approx(reread_ms, abs=1e-4)
    assert got["efficiency_ceiling"] == pytest.approx(min(1.0, (7.5 / (4.0 + reread_ms) - 1) / (ideal - 1)), abs=1e-4)
    # a mode that reads nothing again can at most reach the ideal
    once = ceiling_fields(MOE, mode("pipeline2"), MANY, compute_ms=4.0, comm_ms=3.0, unsplit_ms=7.5, ceilings=H200)
    assert once == {"reread_ms": 0.0, "efficiency_ceiling": 1.0}


def test_a_split_whose_rereads_outlast_the_transfer_has_a_negative_ceiling():
    big = ModelConfig.preset("moe-bench", num_layers=4)
    got = ceiling_fields(big, mode("split2"), 256, compute_ms=4.0, comm_ms=0.4, unsplit_ms=4.4, ceilings=H200)
    assert got["efficiency_ceiling"] < 0  # 5.6 GB again (over 1 ms) to hide 0.4 ms


def test_a_slower_gpu_reads_the_same_bytes_again_more_slowly():
    args = (MOE, mode("split2"), MANY)
    kwargs = dict(compute_ms=4.0, comm_ms=3.0, unsplit_ms=7.5)
    h100 = ceiling_fields(*args, **kwargs, ceilings=GPU_CEILINGS["H100"])
    assert h100["reread_ms"] == pytest.approx(ceiling_fields(*args, **kwargs, ceilings=H200)["reread_ms"] * 4800 / 3350)


@pytest.mark.parametrize(
    "name, ceilings, comm_ms", [("split2", None, 3.0), ("split2", H200, 0.0), ("unsplit", H200, 3.0)]
)
def test_no_ceiling_for_the_unsplit_step_without_gpu_rates_or_without_communication(name, ceilings, comm_ms):
    got = ceiling_fields(MOE, mode(name), MANY, compute_ms=4.0, comm_ms=comm_ms, unsplit_ms=7.0, ceilings=ceilings)
    assert got == {"reread_ms": None, "efficiency_ceiling": None}


@pytest.mark.parametrize("tokens", [1, 0, 2.0, True])
def test_fewer_tokens_than_ubatches_is_an_error(tokens):
    with pytest.raises(ValueError, match="num_tokens must be an int >= 2"):
        extra_weight_bytes(MOE, mode("split2"), tokens)
