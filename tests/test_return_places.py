"""place_returns: each received dispatch row's place in the combine, the Triton kernel against the
torch path (interpreted on CPU where triton is installed, and on a GPU), and the torch path
against the rule written out row by row."""

import pytest
import torch

from tests.interpreted import run_interpreted
from ubatch.models.dispatch import dispatch_row_width, row_column_offsets
from ubatch.models.return_places import place_returns

CASE = """
import torch
from ubatch.models.dispatch import dispatch_row_width, row_column_offsets


def case(rows, hidden, top_k, n_local, chunks, world, dtype, device, seed):
    '''Received rows with random ids (-1: none) and distinct return positions, their blocks, and a
    combine table whose blocks never overlap, so that every row has a place of its own.'''
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randn(rows, dispatch_row_width(hidden, top_k, dtype), generator=g).to(dtype)
    position_at, ids_at = row_column_offsets(hidden, top_k, dtype)
    ids = torch.randint(-1, n_local, (rows, top_k), generator=g)
    buffer[:, ids_at : ids_at + top_k] = ids.to(dtype)
    position = torch.randperm(rows, generator=g).to(torch.int32)
    buffer[:, position_at:ids_at] = position.view(dtype).view(rows, ids_at - position_at)
    row_block = torch.randint(0, chunks * world, (rows + 3,), generator=g)
    starts = torch.arange(chunks * world) * rows
    source = torch.full((chunks * world * rows + 1,), -1)
    return [t.to(device) for t in (buffer, ids, position, row_block, starts, source)]
"""


def _expected(ids, position, row_block, starts, source, first_row, group_size, world):
    expected = source.clone()
    for i in range(len(ids)):
        groups = [int(e) // group_size for e in ids[i] if e >= 0]
        if groups:
            sender = int(row_block[first_row + i]) % world
            expected[int(starts[max(groups) * world + sender]) + int(position[i])] = first_row + i
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k, n_local, chunks, world", [(2, 4, 2, 2), (8, 32, 4, 2), (1, 8, 4, 4)])
def test_torch_path_follows_the_rule(dtype, top_k, n_local, chunks, world):
    namespace: dict = {}
    exec(CASE, namespace)
    buffer, ids, position, row_block, starts, source = namespace["case"](
        40, 16, top_k, n_local, chunks, world, dtype, "cpu", 0
    )
    expected = _expected(ids, position, row_block, starts, source, 3, n_local // chunks, world)
    place_returns(buffer, 3, 16, top_k, n_local // chunks, world, row_block, starts, source)
    assert torch.equal(source[:-1], expected[:-1])


def test_rows_without_an_expert_go_to_the_trash_slot():
    hidden, top_k = 8, 2
    rows = torch.zeros(1, dispatch_row_width(hidden, top_k, torch.float32))
    rows[0, row_column_offsets(hidden, top_k, torch.float32)[1] :][:top_k] = -1
    source = torch.full((5,), -1)
    place_returns(
        rows, 0, hidden, top_k, 2, 1, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), source
    )
    assert source.tolist() == [-1, -1, -1, -1, 0]


def test_triton_kernel_interpreted():
    run_interpreted(
        CASE
        + """
from ubatch.models import return_places as m
for dtype in (torch.float32, torch.bfloat16):
    for top_k, n_local, chunks, world in ((2, 4, 2, 2), (8, 32, 4, 2), (1, 8, 4, 4)):
        buffer, ids, position, row_block, starts, source = case(30, 16, top_k, n_local, chunks, world, dtype, "cpu", 1)
        want = source.clone()
        m.place_returns(buffer, 3, 16, top_k, n_local // chunks, world, row_block, starts, want)
        got = source.clone()
        position_at, ids_at = row_column_offsets(16, top_k, dtype)
        m._place_returns_kernel[(len(buffer),)](
            buffer, buffer.stride(0), position_at, ids_at, 3, row_block, starts, got, len(got) - 1, top_k,
            n_local // chunks, world, BLOCK_K=16, num_warps=1,
        )
        assert torch.equal(got[:-1], want[:-1]), (dtype, top_k)
print("interpreted kernel ok")
"""
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_places_rows_as_the_rule_says(dtype):
    namespace: dict = {}
    exec(CASE, namespace)
    buffer, ids, position, row_block, starts, source = namespace["case"](3000, 4096, 8, 32, 4, 2, dtype, "cuda", 2)
    expected = _expected(ids.cpu(), position.cpu(), row_block.cpu(), starts.cpu(), source.cpu(), 3, 8, 2)
    place_returns(buffer, 3, 4096, 8, 8, 2, row_block, starts, source)
    assert torch.equal(source[:-1].cpu(), expected[:-1])
