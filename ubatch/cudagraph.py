"""CUDA graphs: execution descriptors, dispatch, capture (FULL and PIECEWISE) and replay.

FULL captures the whole step, ubatched or not, in one graph: every ubatch's compute stream, the
comm stream and the collectives; replay is one launch. Its inputs and attention metadata must
live in static buffers that the caller refills before each replay.

PIECEWISE captures the step as graph segments between eager islands (attention and
collectives, see ``ubatch.islands``); at replay the segments replay and the islands run eagerly
with the step's real forward context. A ubatched step becomes one such program per ubatch,
replayed through the scheduler so that collectives still overlap. By default attention takes its
profiling path during the warm-up and capture of a PIECEWISE descriptor; with
``use_breakable_cg`` it runs there too.

The rule that keeps a capture from running attention on dummy inputs: whether attention is skipped during a
descriptor's warm-up and capture is decided here, from the descriptor's target mode, and fixed
for every forward context built inside (``capture_scope``), never derived from the runtime mode
argument that the warm-up pass receives as NONE.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ubatch import islands
from ubatch.context import CUDAGraphMode, capture_scope
from ubatch.streams import named_stream

logger = logging.getLogger(__name__)

ForwardFn = Callable[[CUDAGraphMode], Any]


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    """What a graph was captured for: mode, padded token count, and for uniform batches the
    request count and tokens per request; ``num_ubatches`` > 1 for a ubatched schedule."""

    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None = None
    uniform_token_count: int | None = None
    num_ubatches: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "cg_mode", CUDAGraphMode(self.cg_mode))
        if self.cg_mode == CUDAGraphMode.NONE:
            raise ValueError("a BatchExecutionDescriptor describes a graph: cg_mode must be PIECEWISE or FULL")
        for name in ("num_tokens", "num_ubatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.uniform_token_count is not None:
            u = self.uniform_token_count
            if self.num_tokens % u:
                raise ValueError(f"num_tokens={self.num_tokens} is not a multiple of uniform_token_count={u}")
            expected = self.num_tokens // u
            if self.num_reqs not in (None, expected):
                raise ValueError(
                    f"a uniform batch of {self.num_tokens} tokens, {u} per request, has {expected} requests, "
                    f"not {self.num_reqs}"
                )
            object.__setattr__(self, "num_reqs", expected)
        if self.num_ubatches > self.num_tokens:
            raise ValueError(f"num_ubatches={self.num_ubatches} exceeds num_tokens={self.num_tokens}")


def sizes_with_multiples(capture_sizes: Iterable[int], tokens_per_request: Iterable[int]) -> list[int]:
    """The capture sizes, plus each rounded up to a multiple of every tokens-per-request count:
    FULL graphs of a count exist only at sizes it divides."""
    return sorted({math.ceil(s / u) * u for s in capture_sizes for u in (1, *tokens_per_request)})


def make_descriptors(
    capture_sizes: Iterable[int],
    *,
    modes: Sequence[CUDAGraphMode] = (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
    uniform_token_count: int | Sequence[int] = 1,
    ubatch_counts: Sequence[int] = (1,),
) -> list[BatchExecutionDescriptor]:
    """The usual set: FULL for uniform batches (decode by default; one set per tokens-per-request
    count given) and PIECEWISE for any batch, of every size and ubatch count."""
    widths = (uniform_token_count,) if isinstance(uniform_token_count, int) else tuple(uniform_token_count)
    out = []
    for size in sorted(set(capture_sizes)):
        for n in ubatch_counts:
            for u in widths:
                if CUDAGraphMode.FULL in modes and size % u == 0 and size // u >= n:
                    out.append(
                        BatchExecutionDescriptor(CUDAGraphMode.FULL, size, uniform_token_count=u, num_ubatches=n)
                    )
            if CUDAGraphMode.PIECEWISE in modes and size >= n:
                out.append(BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, size, num_ubatches=n))
    return out


def _compatible(
    desc: BatchExecutionDescriptor,
    num_tokens: int,
    num_reqs: int | None,
    uniform_token_count: int | None,
    num_ubatches: int,
) -> bool:
    if desc.num_ubatches != num_ubatches or desc.num_tokens < num_tokens:
        return False
    if desc.uniform_token_count is None:
        return True
    return uniform_token_count == desc.uniform_token_count and num_reqs is not None and num_reqs <= desc.num_reqs


def dispatch(
    descriptors: Iterable[BatchExecutionDescriptor],
    num_tokens: int,
    *,
    num_reqs: int | None = None,
    uniform_token_count: int | None = None,
    num_ubatches: int = 1,
) -> BatchExecutionDescriptor | None:
    """The smallest compatible descriptor, FULL before PIECEWISE; None means run eagerly.

    A uniform descriptor is never chosen for a batch that is not uniform with the same tokens
    per request, even when the token count fits.
    """
    fits = [d for d in descriptors if _compatible(d, num_tokens, num_reqs, uniform_token_count, num_ubatches)]
    if not fits:
        return None
    return min(fits, key=lambda d: (-int(d.cg_mode), d.num_tokens))


class CudaGraphBackend:
    """The torch.cuda graph calls, behind one small interface (tests substitute a fake)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = named_stream(device, "graph-capture")

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return graph, out

    def begin_segment(self) -> Any:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        return graph

    def end_segment(self, graph: Any) -> None:
        with warnings.catch_warnings():  # a segment between two adjacent islands is empty
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            graph.capture_end()

    def recover(self) -> None:
        """After a failed capture: drain the device, leave the aborted pool, heal the RNG.

        An aborted capture never reaches the end of ``capture_end``: the allocator still routes
        that pool's captures ("already recording to mempool_id" on the next capture into it) and
        the generator never ran its capture epilogue (the next random op fails with "Offset
        increment outside graph capture"). Later graphs take a fresh pool, and one small
        successful capture runs the generator's prologue and epilogue.
        """
        torch.cuda.synchronize(self.device)
        end_allocate = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_allocate is not None:
            with contextlib.suppress(Exception):
                end_allocate(self.device.index, self.pool)
        self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            torch.rand(1, device=self.device)
        torch.cuda.synchronize(self.device)

    def capture_stream(self) -> Any:
        return torch.cuda.stream(self.stream)

    def release(self, graph: Any) -> None:
        graph.reset()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_in_use(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def rng_state(self) -> Any:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state(state, self.device)


@dataclass
class _Island:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    out: Any

    def replay(self) -> None:
        result = self.fn(*self.args)
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(result)


@dataclass
class PiecewiseProgram:
    """Graph segments, eager islands and ubatched blocks, in the order they ran."""

    items: list[Any] = field(default_factory=list)
    output: Any = None

    def replay(self) -> Any:
        for item in self.items:
            item.replay()
        return self.output


@dataclass
class _UbatchBlock:
    """A ubatched schedule inside a piecewise program: one program per ubatch, replayed as
    ubatches again (so their collectives overlap) under contexts derived at replay time."""

    run: Callable[[list[Callable[[], Any]]], list[Any]]
    contextualize: Callable[[list[Callable[[], Any]]], list[Callable[[], Any]]]
    programs: list[PiecewiseProgram]

    def replay(self) -> None:
        self.run(self.contextualize([program.replay for program in self.programs]))


class _PiecewiseRecorder:
    """Closes the open segment at each island, runs the island eagerly, opens the next."""

    def __init__(self, backend: CudaGraphBackend) -> None:
        self.backend = backend
        self.program = PiecewiseProgram()
        self.graph: Any = None

    def open(self) -> None:
        self.graph = self.backend.begin_segment()

    def close(self) -> None:
        self.backend.end_segment(self.graph)
        self.program.items.append(self.graph)
        self.graph = None

    def island(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self.close()
        out = fn(*args)
        self.program.items.append(_Island(fn, args, out))
        self.open()
        return out

    def ubatches(
        self,
        run: Callable[[list[Callable[[], Any]]], list[Any]],
        tasks: list[Callable[[], Any]],
        contextualize: Callable[[list[Callable[[], Any]]], list[Callable[[], Any]]],
    ) -> list[Any]:
        """Capture each ubatch as its own program on its own stream. Captures never overlap:
        a ubatch yields only inside an island, where its segment is closed."""
        self.close()
        recorders = [_PiecewiseRecorder(self.backend) for _ in tasks]
        outputs = run(contextualize([functools.partial(r.record, t) for r, t in zip(recorders, tasks)]))
        self.program.items.append(_UbatchBlock(run, contextualize, [r.program for r in recorders]))
        self.open()
        return outputs

    def record(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward`` as this recorder's program, on the current stream."""
        with islands.recording(self):
            self.open()
            try:
                self.program.output = forward()
            finally:
                if self.graph is not None:
                    self.close()
        return self.program.output

    def capture(self, forward: Callable[[], Any]) -> PiecewiseProgram:
        with self.backend.capture_stream():
            self.record(forward)
        return self.program


class CudaGraphManager:
    """Captures a graph per descriptor (into one shared pool) and replays the right one."""

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        use_breakable_cg: bool = False,
        backend: Any = None,
    ) -> None:
        self.use_breakable_cg = use_breakable_cg
        if backend is None:
            device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
            backend = CudaGraphBackend(device)
        self.backend = backend
        self.graphs: dict[BatchExecutionDescriptor, Any] = {}
        self.enabled = True

    def skip_attention_for(self, desc: BatchExecutionDescriptor) -> bool:
        """Attention is skipped while warming up and capturing exactly this: a PIECEWISE
        descriptor captured without breakable graphs. Keyed on the descriptor, never on the
        runtime mode."""
        return desc.cg_mode == CUDAGraphMode.PIECEWISE and not self.use_breakable_cg

    def capture(
        self,
        create_forward_fn: Callable[[BatchExecutionDescriptor], ForwardFn],
        descriptors: Iterable[BatchExecutionDescriptor],
    ) -> None:
        """Per descriptor, largest first: an eager warm-up ``forward_fn(NONE)``, then the capture.

        A descriptor whose capture fails is left out (a warning says why; its batches run
        eagerly) and the process stays usable: the RNG state is restored and the device drained.
        """
        todo = sorted(set(descriptors), key=lambda d: (-int(d.cg_mode), -d.num_tokens, -d.num_ubatches))
        for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            batch = [d for d in todo if d.cg_mode == mode]
            if not batch:
                continue
            start, memory = time.perf_counter(), self.backend.memory_in_use()
            for desc in tqdm(batch, desc=f"Capturing CUDA graphs ({mode.name})", disable=len(batch) < 2):
                self._capture_one(create_forward_fn, desc)
            logger.info(
                "captured %d %s graphs in %.1f s, %.1f MiB of graph memory",
                sum(d in self.graphs for d in batch),
                mode.name,
                time.perf_counter() - start,
                (self.backend.memory_in_use() - memory) / 2**20,
            )

    def _capture_one(
        self, create_forward_fn: Callable[[BatchExecutionDescriptor], ForwardFn], desc: BatchExecutionDescriptor
    ) -> None:
        rng = self.backend.rng_state()
        try:
            forward_fn = create_forward_fn(desc)
            with capture_scope(skip_attention=self.skip_attention_for(desc)):
                forward_fn(CUDAGraphMode.NONE)
                self.backend.synchronize()
                if desc.cg_mode == CUDAGraphMode.FULL:
                    self.graphs[desc] = self.backend.capture(lambda: forward_fn(CUDAGraphMode.FULL))
                else:
                    self.graphs[desc] = _PiecewiseRecorder(self.backend).capture(
                        lambda: forward_fn(CUDAGraphMode.PIECEWISE)
                    )
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
            self.graphs.pop(desc, None)
            logger.warning("capturing %s failed, its batches will run eagerly: %r", desc, exc)
            self.backend.recover()
            self.backend.set_rng_state(rng)

    def dispatch(
        self,
        num_tokens: int,
        *,
        num_reqs: int | None = None,
        uniform_token_count: int | None = None,
        num_ubatches: int = 1,
    ) -> BatchExecutionDescriptor | None:
        """The captured descriptor to replay for this batch, or None (run eagerly)."""
        if not self.enabled:
            return None
        return dispatch(
            self.graphs,
            num_tokens,
            num_reqs=num_reqs,
            uniform_token_count=uniform_token_count,
            num_ubatches=num_ubatches,
        )

    def replay(self, desc: BatchExecutionDescriptor) -> Any:
        """Replay ``desc``'s graph and return its static output (refilled in place).

        FULL reads its inputs and metadata from the static buffers it was captured on; PIECEWISE
        runs its islands under the caller's current forward context (the real metadata).
        """
        if desc not in self.graphs:
            raise KeyError(f"no graph captured for {desc}; captured: {sorted(map(str, self.graphs))}")
        entry = self.graphs[desc]
        if isinstance(entry, PiecewiseProgram):
            return entry.replay()
        graph, out = entry
        graph.replay()
        return out

    def release(self) -> None:
        """Free every graph; later batches run eagerly.

        Call it before ``destroy_process_group``: NCCL's communicator teardown waits until every
        graph that captured one of its collectives is destroyed, and hangs while one is alive.
        """
        self.backend.synchronize()
        for entry in self.graphs.values():
            for graph in _graphs_in(entry):
                self.backend.release(graph)
        self.graphs.clear()
        self.enabled = False

    def self_check(
        self,
        prepare: Callable[[BatchExecutionDescriptor], None],
        run_eager: Callable[[BatchExecutionDescriptor], Any],
        *,
        atol: float,
        rtol: float,
    ) -> bool:
        """Replay every graph on fresh inputs (``prepare`` fills the static buffers, and for
        PIECEWISE installs the forward context) and compare with an eager run of the same
        inputs; on any mismatch disable graphs with a warning. Returns whether they agree."""
        for desc in list(self.graphs):
            prepare(desc)
            replayed = _clone(self.replay(desc))
            eager = run_eager(desc)
            mismatch = _first_mismatch(replayed, eager, atol=atol, rtol=rtol)
            if mismatch is not None:
                self.enabled = False
                logger.warning("CUDA graphs disabled: replay of %s differs from eager (%s)", desc, mismatch)
                return False
        return True


def _graphs_in(entry: Any) -> Iterator[Any]:
    """The backend graphs of a FULL entry ``(graph, output)`` or of a piecewise program."""
    if not isinstance(entry, PiecewiseProgram):
        yield entry[0]
        return
    for item in entry.items:
        if isinstance(item, _UbatchBlock):
            for program in item.programs:
                yield from _graphs_in(program)
        elif not isinstance(item, _Island):
            yield item


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _first_mismatch(a: Any, b: Any, *, atol: float, rtol: float) -> str | None:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
            return f"max abs difference {(a.float() - b.float()).abs().max().item():.3g}"
        return None
    if isinstance(a, (list, tuple)):
        return next((m for x, y in zip(a, b) if (m := _first_mismatch(x, y, atol=atol, rtol=rtol))), None)
    if isinstance(a, dict):
        return next((m for k in a if (m := _first_mismatch(a[k], b[k], atol=atol, rtol=rtol))), None)
    return None if a == b else f"{a!r} vs {b!r}"
