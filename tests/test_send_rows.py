"""The static dispatch plan's Triton kernels against the torch plan (``dispatch.dispatch_plan``):
the same combine slots, dropped count and send rows (a padding row's hidden state aside, which
no expert reads), interpreted on CPU where triton is installed, and on a GPU."""

import pytest
import torch

from tests.interpreted import run_interpreted

CASES = [
    # tokens, top_k, experts, chunks, world, caps per chunk (some too small: rows are dropped)
    (40, 2, 8, 1, 2, (40,)),
    (40, 2, 8, 1, 2, (13,)),
    (300, 8, 64, 2, 2, (120, 90)),
    (37, 8, 64, 4, 2, (10, 9, 8, 7)),
    (50, 1, 16, 2, 4, (6, 5)),
    (0, 2, 8, 2, 2, (1, 1)),
    (33, 3, 12, 1, 1, (20,)),
    (600, 2, 8, 2, 2, (600, 600)),
]

CHECK = """
import torch
from ubatch.models.dispatch import dispatch_plan, row_column_offsets, static_tables
from ubatch.models import send_rows


def check(tokens, hidden, top_k, experts, chunks, world, caps, dtype, device, seed):
    '''Both plans on random routing; returns the assignments dropped.'''
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)] or [torch.empty(0, top_k)])
    ids = ids.long().view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=g)
    x, ids, weights = (t.to(device) for t in (x, ids, weights))
    tables = None if chunks == 1 else static_tables(list(caps), world, torch.device(device))
    args = (x, ids, weights, experts // world, chunks, world, tuple(caps), tables)
    want_slot, want_dropped, want_send = dispatch_plan(*args)
    got_slot, got_dropped, got_send = send_rows.dispatch_plan_kernel(*args)
    assert torch.equal(got_slot, want_slot), (tokens, chunks, caps)
    assert int(got_dropped) == int(want_dropped), (int(got_dropped), int(want_dropped))
    ids_at = row_column_offsets(hidden, top_k, dtype)[1]
    padding = (want_send[:, ids_at : ids_at + top_k] == -1).all(dim=1)
    want_send[padding, :hidden] = 0
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got_send.view(bits), want_send.view(bits)), (tokens, chunks, caps)
    for plan in (send_rows.dispatch_plan_kernel, send_rows.static_plan):  # counting into a running total
        counter = torch.full((), 5, dtype=torch.int64, device=device)
        counted = plan(*args, counter=counter)[1]
        assert counted is counter and int(counter) == 5 + int(want_dropped), (plan.__name__, int(counter))
    return int(want_dropped)
"""


def test_kernels_interpreted():
    """The interpreter pays per program and loop step, so the blocks shrink (32 rows a scan
    step, 64 slots a clearing step, 16 elements a copy step: a row of 24 spans two), the
    300-token case runs with a tenth of its tokens and capacities, and the 600-token one is left
    to the CUDA test (as wide in its scan, and as long to interpret as all the others)."""
    run_interpreted(
        CHECK
        + f"""
send_rows._BLOCK_ROWS, send_rows._BLOCK_FILL, send_rows._MAX_BLOCK_HIDDEN = 32, 64, 16
dropped = 0
for dtype in (torch.bfloat16, torch.float32):
    for tokens, top_k, experts, chunks, world, caps in {CASES!r}:
        if tokens > 500:
            continue
        if tokens >= 300:
            tokens, caps = tokens // 10, tuple(cap // 10 for cap in caps)
        dropped += check(tokens, 24, top_k, experts, chunks, world, caps, dtype, "cpu", tokens + chunks)
assert dropped > 0
print("interpreted kernel ok")
""",
        timeout=300,
    )


@pytest.mark.cuda
@pytest.mark.parametrize(
    "tokens, top_k, experts, chunks, world, caps",
    [
        *CASES,
        (1024, 2, 8, 1, 2, (1024,)),
        (1024, 2, 8, 2, 2, (700, 300)),
        (1024, 8, 64, 4, 2, (400, 300, 200, 150)),
        (4096, 8, 64, 2, 8, (1500, 400)),
    ],
)
def test_cuda_kernels_match_the_torch_plan(tokens, top_k, experts, chunks, world, caps):
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["check"](tokens, 4096, top_k, experts, chunks, world, caps, torch.bfloat16, "cuda", tokens)
