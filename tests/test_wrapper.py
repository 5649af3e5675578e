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
    per_ubatch = {
        "attn_metadata",
        "slot_mapping",
        "ubatch_slices",
        "ubatch_id",
        "num_tokens",
        "batch_descriptor",
        "dp_metadata",
        "is_padding",
    }
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

    wrapper = UBatchWrapper(run, device="cpu", shared=("table",))
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
    with pytest.raises(ValueError, match="num_ubatches must be between 1 and MAX_UBATCHES=16, got 0"):
        UBatchWrapper(lambda x: x, num_ubatches=0)
    with pytest.raises(TypeError, match="callable"):
        UBatchWrapper(42)


def test_more_bad_inputs_name_the_problem():
    wrapper = UBatchWrapper(lambda x: x, num_ubatches=2, device="cpu")
    with set_forward_context(42, ubatch_slices=split_batch([4, 4], 2)):
        with pytest.raises(
            TypeError, match="attn_metadata must be a dict, a per-ubatch list of dicts, or None; got int"
        ):
            wrapper(torch.zeros(8))
    from ubatch.scheduler import UBatchScheduler

    with pytest.raises(ValueError, match="the scheduler runs 2 ubatches but num_ubatches=3"):
        UBatchWrapper(lambda x: x, num_ubatches=3, scheduler=UBatchScheduler(2, "cpu"))
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


@pytest.mark.parametrize(
    "outputs, message",
    [
        ([None, 1], "cannot merge output: some ubatches returned None, others a value"),
        ([1, 2], "cannot merge output: the ubatches returned int objects that differ"),
    ],
)
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
        _ = wrapper.no_such_attribute


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


def _tiny_llama():
    """A two-layer transformers Llama with seeded weights (skips without transformers)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_hugging_face_model_split_along_batch():
    model = _tiny_llama()
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

    for name in (
        "ForwardContext",
        "set_forward_context",
        "override_forward_context",
        "get_forward_context",
        "UBatchSlice",
        "split_batch",
        "UBatchWrapper",
        "current_ubatch_id",
        "yield_ubatch",
        "CUDAGraphMode",
        "BatchExecutionDescriptor",
        "CudaGraphManager",
    ):
        assert hasattr(ubatch, name), name


def _sizes_seen(seen):
    def run(x, *rest, **kwargs):
        seen.append((current_ubatch_id(), tuple(x.shape)))
        yield_ubatch()
        return x

    return run


@pytest.mark.parametrize(
    "x, message",
    [
        (
            torch.zeros(10),
            r"argument 0 \(x\) has leading dimension 10, but the ubatch slices cover 8: declare it "
            r"shared",
        ),
        (torch.zeros(2, 8, 3), r"argument 0 \(x\) has leading dimension 2, but the ubatch slices cover 8"),
        (
            torch.tensor(1.0),
            r"argument 0 \(x\) is a 0-d tensor, which cannot be split into ubatches: declare it "
            r"shared",
        ),
    ],
)
def test_a_tensor_that_matches_no_slice_is_an_error_naming_it(x, message):
    wrapper = UBatchWrapper(_sizes_seen([]), device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([4, 4], 2)):
        with pytest.raises(ValueError, match=message):
            wrapper(x)


def test_keyword_tensors_are_named_and_shared_ones_pass_whole():
    seen = []

    def run(x, *, bias, scale):
        seen.append((x.shape[0], bias.shape[0], scale.dim()))
        return x + bias[: x.shape[0]] * scale

    wrapper = UBatchWrapper(run, device="cpu", shared=("bias", "scale"))
    with set_forward_context(None, ubatch_slices=split_batch([4, 4], 2)):
        out = wrapper(torch.zeros(8), bias=torch.ones(10), scale=torch.tensor(2.0))
        with pytest.raises(ValueError, match=r"argument 'other' has leading dimension 3, but the ubatch slices"):
            UBatchWrapper(lambda x, other: x, device="cpu")(torch.zeros(8), other=torch.zeros(3))
    assert seen == [(4, 10, 0), (4, 10, 0)] and torch.equal(out, torch.full((8,), 2.0))


def test_a_declared_batch_dim_is_split_and_merged_along_that_dim():
    seen = []
    wrapper = UBatchWrapper(_sizes_seen(seen), num_ubatches=3, device="cpu", batched={"x": 1})
    x = torch.arange(24.0).view(2, 12)
    with set_forward_context(None, ubatch_slices=split_batch([4, 4, 4], 3)):
        out = wrapper(x)
        with pytest.raises(
            ValueError,
            match=r"argument 0 \(x\) is declared batched along dim 1, where it has size "
            r"10, but the ubatch slices cover 12",
        ):
            wrapper(torch.zeros(2, 10))
    assert [shape for _, shape in seen] == [(2, 4)] * 3
    assert torch.equal(out, x)


def test_without_a_forward_context_the_declared_batch_dim_is_split_evenly():
    seen = []
    wrapper = UBatchWrapper(_sizes_seen(seen), num_ubatches=3, device="cpu", batched={"x": 0})
    for rows, expected in [(5, [(0, 1), (1, 2), (2, 2)]), (2, [(0, 1), (1, 1)]), (1, [(None, 1)])]:
        seen.clear()
        x = torch.arange(rows * 4.0).view(rows, 4)
        assert torch.equal(wrapper(x), x)
        assert [(uid, shape[0]) for uid, shape in seen] == expected
        assert all(shape[1:] == (4,) for _, shape in seen)


def test_with_a_forward_context_that_says_no_split_the_call_runs_whole():
    seen = []
    wrapper = UBatchWrapper(_sizes_seen(seen), device="cpu", batched={"x": 0})
    with set_forward_context(None):
        wrapper(torch.zeros(6))
    assert seen == [(None, (6,))]


def test_batched_arguments_must_agree_on_the_batch_size():
    wrapper = UBatchWrapper(lambda a, b: a, device="cpu", batched={"a": 0, "b": 1})
    with pytest.raises(
        ValueError,
        match=r"batched arguments disagree on the batch size: argument 0 \(a\) has 4 "
        r"rows along its batch dimension, argument 'b' has 3",
    ):
        wrapper(torch.zeros(4), b=torch.zeros(2, 3))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(batched={"y": 0}), ValueError, r"argument 'y' is declared, but .* has no parameter of that name"),
        (dict(batched={3: 0}), ValueError, r"positional argument 3 is declared, but .* takes 2 positional arguments"),
        (dict(batched={"x": 0}, shared=("x",)), ValueError, "argument 'x' is declared both batched and shared"),
        (dict(batched={"x": 0}, shared=(0,)), ValueError, "argument 0 is declared twice, by name and by position"),
        (dict(batched={"x": -1}), ValueError, r"batched\['x'\] must be a dimension \(an int >= 0\), got -1"),
        (dict(batched={"x": True}), TypeError, r"batched\['x'\] must be a dimension"),
        (dict(batched={"x": 0.0}), TypeError, r"batched\['x'\] must be a dimension \(an int >= 0\), got 0.0"),
        (dict(batched={True: 0}), TypeError, "batched keys must be argument names .* got True"),
        (dict(batched=["x"]), TypeError, "batched must map argument names or indices to a dim, got list"),
        (dict(shared="x"), TypeError, "shared must be a collection of argument names or indices, got 'x'"),
    ],
)
def test_bad_declarations_are_refused_at_construction(kwargs, error, message):
    def run(x, scale):
        return x

    with pytest.raises(error, match=message):
        UBatchWrapper(run, device="cpu", **kwargs)


def test_a_declared_argument_may_be_passed_by_position_or_by_name():
    seen = []

    def run(x, table):
        seen.append((x.shape[0], table.shape[0]))
        return x

    wrapper = UBatchWrapper(run, device="cpu", shared=("table",))
    with set_forward_context(None, ubatch_slices=split_batch([4, 4], 2)):
        wrapper(torch.zeros(8), torch.zeros(8))
        wrapper(torch.zeros(8), table=torch.zeros(8))
    assert seen == [(4, 8)] * 4


@dataclasses.dataclass
class _Output(dict):
    """Like transformers' ModelOutput: a dataclass that is also a dict."""

    logits: torch.Tensor = None
    extra: object = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            self[f.name] = getattr(self, f.name)


class _Cache:
    """Per-ubatch state without a merge (a transformers DynamicCache, say)."""


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (
            lambda rows: _Cache(),
            TypeError,
            r"cannot merge output\.extra: the ubatches returned _Cache objects that differ",
        ),
        (
            lambda rows: (torch.zeros(rows), torch.tensor(float(rows))),
            ValueError,
            r"cannot merge output\.extra\[1\]: each ubatch returned a different 0-d tensor",
        ),
        (
            lambda rows: [torch.zeros(rows * 3, 2)],
            ValueError,
            r"cannot merge output\.extra\[0\]: ubatch 0 returned shape \(9, 2\), "
            r"but its slice holds 3 rows along dim 0",
        ),
        (
            lambda rows: {"k": torch.zeros(rows)} if rows == 3 else {"j": torch.zeros(rows)},
            TypeError,
            r"cannot merge output\.extra: ubatch 0 returned keys \['k'\], ubatch 1 \['j'\]",
        ),
    ],
)
def test_outputs_that_cannot_merge_name_the_field(extra, error, message):
    wrapper = UBatchWrapper(lambda x: _Output(logits=x, extra=extra(x.shape[0])), device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([3, 4], 2)):
        with pytest.raises(error, match=message):
            wrapper(torch.zeros(7))


def test_equal_zero_d_tensors_and_scalars_pass_through():
    wrapper = UBatchWrapper(lambda x: (x, torch.tensor(1.0), 3, None), device="cpu")
    with set_forward_context(None, ubatch_slices=split_batch([3, 4], 2)):
        out, one, three, none = wrapper(torch.arange(7.0))
    assert torch.equal(out, torch.arange(7.0)) and one.item() == 1.0 and three == 3 and none is None


def test_bad_slices_and_sizes_are_clear_errors(monkeypatch):
    wrapper = UBatchWrapper(lambda x: x, device="cpu")
    with set_forward_context(None, ubatch_slices=2):
        with pytest.raises(TypeError, match="ubatch_slices must be a sequence of UBatchSlice .*got int"):
            wrapper(torch.zeros(8))
    with pytest.raises(TypeError, match="num_ubatches must be an int, got True"):
        UBatchWrapper(lambda x: x, num_ubatches=True)
    with pytest.raises(ValueError, match="num_ubatches must be between 1 and MAX_UBATCHES=16, got 1000000"):
        UBatchWrapper(lambda x: x, num_ubatches=10**6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="device='cuda' asks for CUDA, but torch.cuda.is_available"):
        UBatchWrapper(lambda x: x, device="cuda")


def test_metadata_of_any_splittable_type_reaches_each_ubatch():
    @dataclasses.dataclass
    class Rows:
        rows: range

        def split(self, slices):
            return [Rows(self.rows[s.token_slice]) for s in slices]

    seen = []

    def run(x):
        seen.append(get_forward_context().attn_metadata["l0"].rows)
        return x

    with set_forward_context({"l0": Rows(range(8))}, ubatch_slices=split_batch([4, 4], 2)):
        UBatchWrapper(run, device="cpu")(torch.zeros(8))
    assert seen == [range(0, 4), range(4, 8)]


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))


def test_the_wrapper_is_a_module_that_owns_the_wrapped_one():
    torch.manual_seed(0)
    inner = _mlp()
    wrapper = UBatchWrapper(inner, device="cpu")
    assert isinstance(wrapper, torch.nn.Module)
    assert [name for name, _ in wrapper.named_children()] == ["module"], "the scheduler is no submodule"
    assert [id(p) for p in wrapper.parameters()] == [id(p) for p in inner.parameters()]
    assert wrapper.eval() is wrapper and not inner.training
    assert wrapper.train() is wrapper and inner.training
    assert wrapper.to(torch.float64) is wrapper and inner[0].weight.dtype == torch.float64
    assert wrapper.half() is wrapper and inner[0].weight.dtype == torch.float16
    assert wrapper.float().eval() is wrapper and wrapper.scheduler.num_ubatches == 2
    x = torch.randn(6, 4)
    with set_forward_context(None, ubatch_slices=split_batch([3, 3], 2)):
        torch.testing.assert_close(wrapper(x), inner(x))


def test_state_dict_keys_are_the_wrapped_modules_both_ways():
    inner = _mlp()
    wrapper = UBatchWrapper(inner, device="cpu")
    saved = wrapper.state_dict()
    assert list(saved) == list(inner.state_dict())
    assert dict(saved._metadata) == dict(inner.state_dict()._metadata), "module versions follow the keys"
    other = UBatchWrapper(_mlp(), device="cpu")
    assert not other.load_state_dict(inner.state_dict()).missing_keys
    bare = _mlp()
    bare.load_state_dict(saved)
    for a, b, c in zip(inner.state_dict().values(), other.state_dict().values(), bare.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({})


def test_state_dict_of_a_model_holding_a_wrapper_is_that_of_the_unwrapped_model():
    plain = torch.nn.ModuleDict({"pre": torch.nn.Linear(4, 4), "body": _mlp(), "post": torch.nn.Linear(4, 1)})
    holder = torch.nn.ModuleDict(
        {"pre": torch.nn.Linear(4, 4), "body": UBatchWrapper(_mlp(), device="cpu"), "post": torch.nn.Linear(4, 1)}
    )
    assert list(holder.state_dict()) == list(plain.state_dict())
    holder.load_state_dict(plain.state_dict())
    assert torch.equal(holder["body"].module[0].weight, plain["body"][0].weight)
    nested = UBatchWrapper(UBatchWrapper(torch.nn.Linear(2, 2), device="cpu"), device="cpu")
    assert list(nested.state_dict()) == ["weight", "bias"]
    nested.load_state_dict(torch.nn.Linear(2, 2).state_dict())


def test_hooks_on_the_wrapper_see_the_call_and_on_the_module_each_ubatch():
    inner = torch.nn.Linear(4, 4)
    wrapper = UBatchWrapper(inner, device="cpu")
    outer_calls, inner_calls = [], []
    wrapper.register_forward_hook(lambda module, args, out: outer_calls.append(out.shape[0]))
    inner.register_forward_hook(lambda module, args, out: inner_calls.append((current_ubatch_id(), out.shape[0])))
    with set_forward_context(None, ubatch_slices=split_batch([2, 4], 2)):
        wrapper(torch.randn(6, 4))
    assert outer_calls == [6] and inner_calls == [(0, 3), (1, 3)]


def test_a_compiled_module_runs_under_the_wrapper():
    torch.manual_seed(0)
    inner = torch.nn.Linear(4, 4)
    x = torch.randn(6, 4)
    expected = inner(x)
    compiled = UBatchWrapper(torch.compile(inner, backend="eager"), device="cpu")
    in_place = UBatchWrapper(inner, device="cpu")
    in_place.module.compile(backend="eager")
    with set_forward_context(None, ubatch_slices=split_batch([3, 3], 2)):
        torch.testing.assert_close(compiled(x), expected)
        torch.testing.assert_close(in_place(x), expected)


def test_a_plain_callable_is_kept_as_an_attribute():
    def double(x):
        return 2 * x

    double.note = "kept"
    wrapper = UBatchWrapper(double, device="cpu")
    assert wrapper.module is double and wrapper.unwrap() is double and wrapper.note == "kept"
    assert list(wrapper.children()) == [] and not wrapper.state_dict()
    assert wrapper.to(torch.float64) is wrapper
    with set_forward_context(None, ubatch_slices=split_batch([2, 2], 2)):
        assert torch.equal(wrapper(torch.ones(4)), torch.full((4,), 2.0))


def test_a_transformers_model_splits_its_batch_without_a_forward_context():
    model = _tiny_llama()
    input_ids = torch.randint(0, 64, (5, 10))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    rows = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    wrapper = UBatchWrapper(model, num_ubatches=3, device="cpu", batched={"input_ids": 0, "attention_mask": 0})
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        rows.clear()
        out = wrapper(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        assert rows == [1, 2, 2]
        torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(
            TypeError,
            match=r"cannot merge output\.(past_key_values|cache): the ubatches returned "
            r"DynamicCache objects that differ",
        ):
            wrapper(input_ids=input_ids, use_cache=True)
    assert list(wrapper.state_dict()) == list(model.state_dict())
    assert wrapper.eval() is wrapper and wrapper.config is model.config


def test_generate_is_refused_rather_than_run_unsplit():
    class WithGenerate(torch.nn.Module):
        def forward(self, x):
            return x

        def generate(self, x):
            return x

    wrapper = UBatchWrapper(WithGenerate(), device="cpu")
    with pytest.raises(RuntimeError, match="does not ubatch generate\\(\\)"):
        wrapper.generate(torch.zeros(2))
    assert wrapper.unwrap().generate(torch.zeros(2)).shape == (2,)
