"""UBatchWrapper run path: child contexts, argument slicing, output merging, failures."""

import dataclasses
import time

import pytest
import torch

from ubatch import ForwardContext, get_forward_context, override_forward_context, set_forward_context
from ubatch.attention import build_attention_metadata
from ubatch.scheduler import current_ubatch_id, yield_ubatch
from ubatch.slicing import split_batch
from ubatch.sm import SMPartition
from ubatch.wrapper import UBatchWrapper, make_ubatch_contexts


@dataclasses.dataclass
class MyContext(ForwardContext):
    model_specific: str = "default"


def _recorder(seen):
    def run(x, scale=1.0):
        ctx = get_forward_context()
        seen.append(ctx)
        yield_ubatch()
        return x * scale

    return run


def _metadata(query_lens):
    total = sum(query_lens)
    blocks = torch.arange(len(query_lens) * 4, dtype=torch.int32).view(len(query_lens), 4)
    return build_attention_metadata(query_lens, query_lens, blocks, torch.arange(total, dtype=torch.int64))


@pytest.mark.parametrize("skip_attention", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_children_inherit_every_parent_field(skip_attention, n):
    query_lens = [5, 7, 4, 8]
    slices = split_batch(query_lens, n)
    md = _metadata(query_lens)
    parent = MyContext(
        attn_metadata={"l0": md, "l1": md},
        slot_mapping={"l0": md.slot_mapping},
        ubatch_slices=slices,
        skip_attention=skip_attention,
        skip_compiled=True,
        additional_kwargs={"k": 1},
        no_compile_layers={"l0": object()},
        model_specific="kept",
    )
    seen = []
    wrapper = UBatchWrapper(_recorder(seen), num_ubatches=4, device="cpu")
    x = torch.randn(24, 3)
    with override_forward_context(parent):
        out = wrapper(x)
    assert torch.equal(out, x)
    assert [c.ubatch_id for c in seen] == list(range(n))
    for child, s in zip(seen, slices):
        assert type(child) is MyContext
        assert child.skip_attention is skip_attention and child.skip_compiled
        assert child.model_specific == "kept" and child.additional_kwargs == {"k": 1}
        assert child.no_compile_layers is parent.no_compile_layers
        assert child.ubatch_slices is None and child.num_tokens == s.num_tokens
        assert child.attn_metadata["l0"] is child.attn_metadata["l1"]
        assert child.attn_metadata["l0"].num_actual_tokens == s.num_tokens
        assert torch.equal(child.slot_mapping["l0"], md.slot_mapping[s.token_slice])
    assert parent.attn_metadata == {"l0": md, "l1": md}, "the parent's metadata stays untouched"


def test_every_field_is_inherited_including_future_ones():
    """Derive, don't rebuild: all fields not per-ubatch equal the parent's."""
    per_ubatch = {"attn_metadata", "slot_mapping", "ubatch_slices", "ubatch_id", "num_tokens",
                  "batch_descriptor", "dp_metadata", "is_padding"}
    parent = MyContext(ubatch_slices=split_batch([4, 4], 2), skip_attention=True, model_specific="x")
    for child in make_ubatch_contexts(parent, parent.ubatch_slices):
        for f in dataclasses.fields(parent):
            if f.name not in per_ubatch:
                assert getattr(child, f.name) is getattr(parent, f.name), f.name


def test_per_ubatch_metadata_list_is_used_as_given():
    slices = split_batch([4, 4], 2)
    mds = [{"l0": "first"}, {"l0": "second"}]
    seen = []
    wrapper = UBatchWrapper(_recorder(seen), device="cpu")
    with set_forward_context(mds, ubatch_slices=slices):
        wrapper(torch.zeros(8))
    assert [c.attn_metadata["l0"] for c in seen] == ["first", "second"]


def test_arguments_sliced_by_leading_dim_and_outputs_merged():
    slices = split_batch([3, 3, 4], 2, 12)
    calls = []

    def run(tokens, positions, table, *, flag, extra):
        calls.append((tokens.shape[0], positions.shape[0], table.shape[0], flag))
        return {"out": (tokens + positions, [positions * 2]), "flag": flag, "none": None}

    wrapper = UBatchWrapper(run, device="cpu")
    tokens, positions, table = torch.arange(12), torch.arange(12) * 10, torch.zeros(5, 12)
    with set_forward_context(None, ubatch_slices=slices):
        out = wrapper(tokens, positions, table, flag="f", extra=torch.ones(12))
    assert calls == [(6, 6, 5, "f"), (6, 6, 5, "f")]
    assert torch.equal(out["out"][0], tokens + positions)
    assert torch.equal(out["out"][1][0], positions * 2)
    assert out["flag"] == "f" and out["none"] is None


def test_without_slices_the_runnable_is_called_directly_and_one_slice_runs_as_one_ubatch():
    x = torch.ones(4)
    assert torch.equal(UBatchWrapper(lambda t, scale: t * scale, device="cpu")(x, scale=2.0), 2 * x)
    seen = []
    wrapper = UBatchWrapper(_recorder(seen), device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([4], 1)):
        wrapper(x)
    with set_forward_context(None):
        wrapper(x)
    assert [c.ubatch_id for c in seen] == [0, None]


def test_errors_name_the_problem():
    wrapper = UBatchWrapper(lambda x: x, num_ubatches=2, device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([4, 4, 4], 3)):
        with pytest.raises(ValueError, match="3 ubatch slices.*num_ubatches=2"):
            wrapper(torch.zeros(12))
    with set_forward_context([{}, {}, {}], ubatch_slices=split_batch([4, 4], 2)):
        with pytest.raises(ValueError, match="3 per-ubatch entries but there are 2"):
            wrapper(torch.zeros(8))
    with set_forward_context({"l0": "not metadata"}, ubatch_slices=split_batch([4, 4], 2)):
        with pytest.raises(TypeError, match="attn_metadata\\['l0'\\] is a str"):
            wrapper(torch.zeros(8))
    with pytest.raises(ValueError, match="num_ubatches must be an int >= 1, got 0"):
        UBatchWrapper(lambda x: x, num_ubatches=0)
    with pytest.raises(TypeError, match="callable"):
        UBatchWrapper(42)


def test_more_bad_inputs_name_the_problem():
    wrapper = UBatchWrapper(lambda x: x, num_ubatches=2, device="cpu")
    with set_forward_context(42, ubatch_slices=split_batch([4, 4], 2)):
        with pytest.raises(TypeError, match="attn_metadata must be a dict, a per-ubatch list of dicts, or None; got int"):
            wrapper(torch.zeros(8))
    from ubatch.scheduler import UbatchScheduler

    with pytest.raises(ValueError, match="the scheduler runs 2 ubatches but num_ubatches=3"):
        UBatchWrapper(lambda x: x, num_ubatches=3, scheduler=UbatchScheduler(2, "cpu"))
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()
    with pytest.raises(TypeError, match="override_forward_context expects a ForwardContext or None, got int"):
        with override_forward_context(7):
            pass
    with pytest.raises(ValueError, match=r"num_tokens_across_dp must be non-empty and non-negative, got \(3, -1\)"):
        with set_forward_context(None, num_tokens_across_dp=[3, -1]):
            pass
    with set_forward_context(None, num_tokens_across_dp=torch.tensor([3, 5])) as ctx:
        assert ctx.dp_metadata.num_tokens_across_dp == (3, 5) and ctx.dp_metadata.max_tokens_across_dp == 5


@pytest.mark.parametrize("outputs, message", [
    ([None, 1], "ubatch outputs disagree: some returned None, others a value"),
    ([1, 2], "cannot merge ubatch outputs of type int: they differ and are not tensors"),
])
def test_ubatch_outputs_that_cannot_merge_are_an_error(outputs, message):
    returned = iter(outputs)
    wrapper = UBatchWrapper(lambda x: next(returned), num_ubatches=2, device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([4, 4], 2)):
        with pytest.raises(TypeError, match=message):
            wrapper(torch.zeros(8))


def test_equal_non_tensor_outputs_merge_to_one_value():
    wrapper = UBatchWrapper(lambda x: ("tag", x), num_ubatches=2, device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([4, 4], 2)):
        tag, out = wrapper(torch.arange(8.0))
    assert tag == "tag" and torch.equal(out, torch.arange(8.0))


def test_unwrap_and_attribute_fall_through():
    module = torch.nn.Linear(2, 3)
    wrapper = UBatchWrapper(module, device="cpu")
    assert wrapper.unwrap() is module
    assert wrapper.out_features == 3 and wrapper.weight is module.weight
    with pytest.raises(AttributeError):
        wrapper.no_such_attribute


class LayerError(RuntimeError):
    pass


def test_fault_in_any_ubatch_at_any_layer_finishes_fast_and_recovers():
    num_layers, n = 4, 3

    def model(x, fail_at):
        for layer in range(num_layers):
            if (current_ubatch_id(), layer) == fail_at:
                raise LayerError(f"layer {layer} failed")
            x = x + 1
            yield_ubatch()
        return x

    wrapper = UBatchWrapper(model, num_ubatches=n, device="cpu")
    slices = split_batch([6, 6, 6], n)
    x = torch.zeros(18)
    t0 = time.monotonic()
    for ubatch in range(n):
        for layer in range(num_layers):
            with set_forward_context(None, ubatch_slices=slices):
                with pytest.raises(LayerError, match=f"layer {layer}") as info:
                    wrapper(x, (ubatch, layer))
                assert f"ubatch {ubatch}" in "".join(info.value.__notes__)
                assert torch.equal(wrapper(x, None), x + num_layers)
    assert time.monotonic() - t0 < 10


def test_grad_and_inference_mode_hold_inside_every_ubatch():
    modes = []

    def run(x):
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        yield_ubatch()
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return x

    wrapper = UBatchWrapper(run, device="cpu")
    with torch.inference_mode(), set_forward_context(None, ubatch_slices=split_batch([2, 2], 2)):
        wrapper(torch.zeros(4))
    assert modes == [(False, True)] * 4


def test_hugging_face_model_split_along_batch():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    input_ids = torch.randint(0, 64, (6, 10))
    wrapper = UBatchWrapper(model, num_ubatches=3, device="cpu")
    with torch.no_grad():
        expected = model(input_ids=input_ids, use_cache=False).logits
        for n in (2, 3):
            with set_forward_context(None, ubatch_slices=split_batch([1] * 6, n)):
                out = wrapper(input_ids=input_ids, use_cache=False)
            torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    assert wrapper.config is model.config


def test_an_sm_partition_degrades_to_none_on_cpu_and_the_wrapper_still_runs(caplog):
    partition = SMPartition("green", 16, "cpu")
    assert partition.effective_mode == "none" and partition.reason
    wrapper = UBatchWrapper(lambda x: x * 2, device="cpu", sm_partition=partition)
    with set_forward_context(None, ubatch_slices=split_batch([2, 2], 2)):
        assert torch.equal(wrapper(torch.ones(4)), torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="either a scheduler or an sm_partition"):
        UBatchWrapper(lambda x: x, device="cpu", sm_partition=partition, scheduler=wrapper.scheduler)


def test_the_public_contract_is_importable_from_the_package():
    import ubatch

    for name in ("ForwardContext", "set_forward_context", "override_forward_context", "get_forward_context",
                 "UBatchSlice", "split_batch", "UBatchWrapper", "current_ubatch_id", "yield_ubatch",
                 "CUDAGraphMode", "BatchExecutionDescriptor", "CudaGraphManager"):
        assert hasattr(ubatch, name), name
