"""A transformers Llama sharded with ``tp_plan="auto"``, overlapped by ubatch as it is.

    torchrun --nproc-per-node 2 examples/transformers_tp.py     # two ranks over gloo
    python examples/transformers_tp.py [--device cuda]          # one process: no sharding

A small random-config ``LlamaForCausalLM`` is saved to a temporary directory and loaded back with
``tp_plan="auto"`` (under torchrun: its weights become DTensors, and each decoder layer ends its
attention and its MLP in a ``torch.distributed.all_reduce``). Wrapped with ``UBatchWrapper`` for
N = 2 and 3, its logits equal the unwrapped TP model's and the single-process model's (float32,
rtol = atol = 1e-5), and its decoder layers run interleaved across ubatches (ubatch 0 layer 0,
ubatch 1 layer 0, ...): each all-reduce handed the turn to the next ubatch while in flight. In one
process there is no collective, so each ubatch runs its layers in one go; on CUDA each ubatch runs
on its own stream, and the example prints the streams its layers ran on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ubatch

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
BATCH, SEQ = 6, 8


def record_layer_order(model: LlamaForCausalLM) -> list[tuple[int | None, int, int | None]]:
    """(ubatch, decoder layer, CUDA stream or None) for every decoder layer call."""
    order: list[tuple[int | None, int, int | None]] = []

    def hook(_module, _args, index):
        stream = torch.cuda.current_stream().stream_id if torch.cuda.is_available() and _args[0].is_cuda else None
        order.append((ubatch.current_ubatch_id(), index, stream))

    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, index=index: hook(m, a, index))
    return order


def save_random_model(sharded: bool) -> str:
    """Rank 0 saves a seeded random model; every rank gets its directory."""
    path = [tempfile.mkdtemp(prefix="ubatch-llama-")] if not sharded or dist.get_rank() == 0 else [None]
    if path[0] is not None:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path[0])
    if sharded:
        dist.broadcast_object_list(path, src=0)
    return path[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one process only)")
    device = torch.device(parser.parse_args().device)
    sharded = "RANK" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if sharded else 0
    path = save_random_model(sharded)
    single = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval() if sharded else single
    if sharded and not isinstance(model.model.layers[0].self_attn.o_proj.weight, torch.distributed.tensor.DTensor):
        raise SystemExit("tp_plan='auto' left the weights unsharded")
    order = record_layer_order(model)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(device)
    layers = CONFIG["num_hidden_layers"]
    with torch.no_grad():
        reference = single(input_ids, use_cache=False).logits
        expected = model(input_ids, use_cache=False).logits
        torch.testing.assert_close(expected, reference, rtol=1e-5, atol=1e-5)
        for n in (2, 3):
            wrapped = ubatch.UBatchWrapper(model, num_ubatches=n, device=device, batched={"input_ids": 0})
            order.clear()
            got = wrapped(input_ids=input_ids, use_cache=False).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
            ran = [(u, layer) for u, layer, _ in order]
            interleaved = ran == [(u, layer) for layer in range(layers) for u in range(n)]
            if rank == 0:
                print(
                    f"N={n}: equals the unwrapped and the single-process model: True; "
                    f"decoder layer order {ran}; interleaved: {interleaved}"
                )
                if device.type == "cuda":
                    streams = {u: sorted({s for v, _, s in order if v == u}) for u in range(n)}
                    print(f"N={n}: streams per ubatch {streams}")
            if sharded and not interleaved:
                raise SystemExit(f"the ubatches ran their decoder layers in order {ran}, not interleaved")
    if sharded:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
