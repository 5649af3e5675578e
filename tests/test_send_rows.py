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
RUN_CASES = [
    # tokens, top_k, experts, world, cap, runs: one expert group, its blocks in runs (token chunks)
    (40, 2, 8, 2, 40, 4),
    (50, 1, 16, 4, 12, 3),
    (37, 8, 64, 8, 16, 2),
]

CHECK = """
import torch
from ubatch.models.dispatch import count_link_rows, dispatch_plan, row_column_offsets, static_tables
from ubatch.models import send_rows


def check(tokens, hidden, top_k, experts, chunks, world, caps, dtype, device, seed, runs=1):
    '''Both plans on random routing; returns the assignments dropped.'''
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)] or [torch.empty(0, top_k)])
    ids = ids.long().view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=g)
    x, ids, weights = (t.to(device) for t in (x, ids, weights))
    tables = None if chunks == 1 else static_tables(list(caps), world, torch.device(device))
    args = (x, ids, weights, experts // world, chunks, world, tuple(caps), tables)
    want_slot, want_dropped, want_send = dispatch_plan(*args, runs=runs)
    got_slot, got_dropped, got_send = send_rows.dispatch_plan_kernel(*args, runs=runs)
    assert torch.equal(got_slot, want_slot), (tokens, chunks, caps)
    assert int(got_dropped) == int(want_dropped), (int(got_dropped), int(want_dropped))
    ids_at = row_column_offsets(hidden, top_k, dtype)[1]
    padding = (want_send[:, ids_at : ids_at + top_k] == -1).all(dim=1)
    want_send[padding, :hidden] = 0
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got_send.view(bits), want_send.view(bits)), (tokens, chunks, caps)
    for plan in (send_rows.dispatch_plan_kernel, send_rows.static_plan):  # counting into a running total
        counter = torch.full((), 5, dtype=torch.int64, device=device)
        counted = plan(*args, runs=runs, counter=counter)[1]
        assert counted is counter and int(counter) == 5 + int(want_dropped), (plan.__name__, int(counter))
    # each transfer's kept rows to the other ranks: the kernel's count against the torch one, and
    # both against the rows themselves (by their slots: a slot's block and run, or group chunk)
    transfers = chunks if chunks > 1 else runs
    own_rank = world - 1
    stale = torch.full((2, transfers), 7, dtype=torch.int64, device=device)  # the counts are written, not added
    routed = (ids, want_slot, experts // world, chunks, world, tuple(caps))
    want_link = count_link_rows(stale.clone(), *routed, runs=runs, own_rank=own_rank)
    got_link = stale.clone()
    send_rows.dispatch_plan_kernel(*args, runs=runs, link_rows=got_link, own_rank=own_rank)
    assert torch.equal(got_link, want_link), (got_link.tolist(), want_link.tolist())
    kept = (want_slot >= 0) & (torch.arange(world, device=device) != own_rank)
    assert int(want_link[0].sum()) == int(want_link[1].sum()) == int(kept.sum())
    if chunks == 1:
        run = want_slot // (world * (caps[0] // runs))
        sent = returned = [int((kept & (run == r)).sum()) for r in range(runs)]
    else:  # a row travels with its earliest expert group on the rank and returns with its latest
        n_local = experts // world
        on = (ids // n_local)[:, None, :] == torch.arange(world, device=device)[None, :, None]
        group = (ids % n_local // (n_local // chunks))[:, None, :]
        first, last = torch.where(on, group, chunks).amin(dim=2), torch.where(on, group, -1).amax(dim=2)
        sent = [int((kept & (first == g)).sum()) for g in range(chunks)]
        returned = [int((kept & (last == g)).sum()) for g in range(chunks)]
    assert want_link.tolist() == [sent, returned], (want_link.tolist(), sent, returned)
    return int(want_dropped)
"""


def test_kernels_interpreted():
    """The interpreter pays per program and loop step, so the blocks shrink (32 rows a plan
    program, 16 where the plan counts 16 keys or more; 16 elements a copy step: a row of 24 spans
    two; several plan programs, whose earlier counts a program sums two at a time), the
    300-token case runs with a tenth of its tokens and capacities, and the 600-token one is left
    to the CUDA test (as wide in its scan, and as long to interpret as all the others)."""
    run_interpreted(
        CHECK
        + f"""
send_rows._BLOCK_ROWS, send_rows._MAX_BLOCK_HIDDEN, send_rows._TILE, send_rows._BASE_TILE = 32, 16, 256, 2
dropped = 0
for dtype in (torch.bfloat16, torch.float32):
    for tokens, top_k, experts, chunks, world, caps in {CASES!r}:
        if tokens > 500:
            continue
        if tokens >= 300:
            tokens, caps = tokens // 10, tuple(cap // 10 for cap in caps)
        dropped += check(tokens, 24, top_k, experts, chunks, world, caps, dtype, "cpu", tokens + chunks)
    for tokens, top_k, experts, world, cap, runs in {RUN_CASES!r}:
        dropped += check(tokens, 24, top_k, experts, 1, world, (cap,), dtype, "cpu", tokens, runs)
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
        (1024, 8, 64, 8, 8, (300, 250, 200, 150, 120, 100, 90, 80)),  # 128 keys: 32 rows a program
        (4096, 2, 8, 1, 8, (1332,)),  # one expert per rank: the block layout of the runs case below
    ],
)
def test_cuda_kernels_match_the_torch_plan(tokens, top_k, experts, chunks, world, caps):
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["check"](tokens, 4096, top_k, experts, chunks, world, caps, torch.bfloat16, "cuda", tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, top_k, experts, world, cap, runs", [*RUN_CASES, (4096, 2, 8, 8, 1332, 4)])
def test_cuda_kernels_lay_out_runs_as_the_torch_plan(tokens, top_k, experts, world, cap, runs):
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["check"](tokens, 4096, top_k, experts, 1, world, (cap,), torch.bfloat16, "cuda", tokens, runs)


@pytest.mark.parametrize("tokens, top_k, experts, world, cap, runs", RUN_CASES)
def test_runs_lay_each_ranks_block_out_run_major(tokens, top_k, experts, world, cap, runs):
    """The plan in runs is the plain plan with every rank's block cut into ``runs`` equal runs,
    run by run: the same rows, at ``chunk_major_slots``' slots."""
    from ubatch.models.dispatch import chunk_major_slots, dispatch_plan

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 24, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    args = (x, ids, weights, experts // world, 1, world, (cap,))
    plain_slot, plain_dropped, plain_send = dispatch_plan(*args)
    slot, dropped, send = dispatch_plan(*args, runs=runs)
    q = cap // runs
    assert torch.equal(slot, chunk_major_slots(plain_slot, cap, world, runs)) and int(dropped) == int(plain_dropped)
    assert torch.equal(send, plain_send.view(world, runs, q, -1).transpose(0, 1).reshape(send.shape))
    with pytest.raises(ValueError, match="runs=3 needs one expert group whose capacity it divides"):
        dispatch_plan(*args[:-1], (cap + 1,), runs=3)
