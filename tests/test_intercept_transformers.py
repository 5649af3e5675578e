"""A transformers Mixtral whose experts the user shards (examples/expert_parallel.py's
ExpertParallelExperts, all_to_all_single inside) overlaps inside ubatches: equal to the unsharded
single-process model, its decoder layers interleaved across ubatches."""

import copy

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_intercept import TOL, _free_cycles, _interleaved, _load_example, _record_order, _run_split
from ubatch import UBatchWrapper

# Spawned ranks import this module before init_process_group: importing transformers' model later
# would pin the default group for the life of the process (ubatch.teardown).
try:
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
except ImportError:  # the test skips
    pass


def _mixtral_with_user_sharded_experts_overlaps(rank, world):
    from transformers import MixtralConfig, MixtralForCausalLM

    example = _load_example("expert_parallel")
    config = MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    single = MixtralForCausalLM(config).eval()
    model = copy.deepcopy(single)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        layer.mlp.experts = example.ExpertParallelExperts(experts.gate_up_proj, experts.down_proj, rank, world)
    order = _record_order(model.model.layers)
    input_ids = torch.randint(0, 128, (4, 6), generator=torch.Generator().manual_seed(1 + rank))
    with torch.no_grad():
        reference = single(input_ids, use_cache=False).logits
        expected = model(input_ids, use_cache=False).logits
        torch.testing.assert_close(expected, reference, **TOL)
        for n in (2, 3):
            order.clear()
            got = _run_split(UBatchWrapper(model, num_ubatches=n, device="cpu"), input_ids, n, use_cache=False)
            torch.testing.assert_close(got.logits, expected, **TOL)
            assert order == _interleaved(n, config.num_hidden_layers), order
    _free_cycles()


def test_transformers_mixtral_with_user_sharded_experts_overlaps():
    pytest.importorskip("transformers")
    run_distributed(_mixtral_with_user_sharded_experts_overlaps, 2)
