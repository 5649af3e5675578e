"""Run N ubatches as persistent greenlets on the caller's thread, handing off round-robin.

Why greenlets: a switch costs about a microsecond, all ubatches stay on the caller's thread (so
CUDA-graph capture, grad mode and autocast are the caller's), and no thread is created per step.
Why round-robin: every rank issues its collectives in the same order, so NCCL/gloo stay matched.

Streams (CUDA): each ubatch has its own compute stream and all share one comm stream. At every
hand-off the outgoing ubatch records an event that the incoming one's stream waits on, so compute
runs in host issue order across ubatches. That order is what makes ubatch i's KV write at layer L
land before ubatch i+1's attention at layer L reads it (a request straddling the split). The
overlap comes from the comm stream: a collective runs there while the next ubatch computes. A
call of one task (single-batch overlap, expert pipelining) computes on the caller's stream
instead, unless the compute streams were handed in (an SM partition's): with no other ubatch to
run beside its waits, a stream of its own would only add a fork and a join, and graphs warmed on
side streams replay their kernels further apart (scripts/probe_graph_launch.py). On CPU the same
code runs with no streams at all.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import numbers
import re
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import greenlet
import torch

from ubatch.streams import ubatch_streams
from ubatch.trace import StepTrace

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0

MAX_UBATCHES = 16
"""The most ubatches one step may run. Every hand-off costs a switch and an event pair, and
every pipeline stage fills and drains once per layer, so the overlap a split can win (at most
2x) is gone long before this; the cap also stops a typo from building states by the million."""

ABORT_ATTEMPTS = 8
"""How often an aborted ubatch is thrown ``UBatchAborted`` again when it yields while unwinding
(a cleanup collective in a ``finally``) before its worker is discarded as refusing to stop."""

_current: contextvars.ContextVar[UBatchState | None] = contextvars.ContextVar("ubatch_state", default=None)

_refusing_workers: list[greenlet.greenlet] = []
"""Workers discarded because their task would not stop: held here, never resumed, for the life of
the process. Dropped, the garbage collector would throw ``GreenletExit`` into the task, which
swallows it and yields: its ``yield_ubatch`` would then switch into whatever call runs at that
moment, and greenlet leaks the worker anyway ("GreenletExit did not kill")."""


_idle = threading.local()
"""Per thread, ``workers``: the parked workers of pools that died, for the thread's next pools.
A dropped worker would be killed by its deallocation, often inside the garbage collector: a
switch into it with ``GreenletExit`` from wherever the collection ran, in the middle of another
ubatch's step. A recycled worker never dies before the interpreter does."""


def _idle_workers() -> list[greenlet.greenlet]:
    workers = getattr(_idle, "workers", None)
    if workers is None:
        workers = _idle.workers = []
    return workers


def _take_worker() -> greenlet.greenlet:
    """A parked worker for the calling driver: an idle one, reporting to the caller as a fresh one
    would (its parent is still the driver of its dead pool), else a fresh one."""
    idle = _idle_workers()
    if not idle:
        return _start_worker()
    worker = idle.pop()
    worker.parent = greenlet.getcurrent()
    return worker


def _recycle_workers(workers: list[greenlet.greenlet], idle: list[greenlet.greenlet]) -> None:
    """A dead pool's finalizer: its parked workers join its thread's idle ones. It may run on any
    thread (a collection anywhere), so it only appends, to the list of the pool's own thread."""
    idle.extend(worker for worker in workers if not worker.dead)


class UBatchAborted(BaseException):
    """Thrown into a suspended ubatch when another one failed; never escapes the scheduler."""


class Outcome(enum.Enum):
    """What a worker tells the driver when it hands control back."""

    YIELD = "yield"  # suspended; resume it later
    DONE = "done"  # the task returned; its value is on the state
    ERROR = "error"  # the task raised; the exception is on the state
    ABORTED = "aborted"  # the task unwound after ``UBatchAborted``


def check_num_ubatches(value: object, *, minimum: int = 1) -> int:
    """``value`` as an int in ``minimum .. MAX_UBATCHES``; TypeError / ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"num_ubatches must be an int, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= MAX_UBATCHES:
        raise ValueError(f"num_ubatches must be between {minimum} and MAX_UBATCHES={MAX_UBATCHES}, got {value}")
    return int(value)


def current_ubatch() -> UBatchState | None:
    """The running ubatch's state, or None outside a ubatch."""
    return _current.get()


def current_ubatch_id() -> int | None:
    """The running ubatch's index (0-based), or None outside a ubatch."""
    state = _current.get()
    return None if state is None else state.ubatch_id


def yield_ubatch() -> None:
    """Let the next ubatch run; a no-op outside a ubatch."""
    state = _current.get()
    if state is not None:
        state.yield_now()


def join_ubatches(key: Hashable, value: Any, fn: Callable[[list[Any]], Sequence[Any]]) -> Any:
    """Run ``fn`` once over the ``value`` every ubatch of the step passes at its ``key`` join,
    and give each ubatch its own entry of the result (``fn(values)[i]`` to ubatch i).

    Why: work that reads the same large operands for every ubatch (a MoE layer's expert weights)
    can run once over all ubatches' rows instead of once per ubatch. Ubatches wait here, yielding,
    until the last one arrives; ``fn`` runs in that one, on its stream, after every ubatch's work
    issued so far (the hand-off order), so it may read what the others produced and start
    collectives whose results they wait for. Outside a ubatch, or in a step of one ubatch, it is
    ``fn([value])[0]``. Ubatches leave the join in ubatch order. Every ubatch must reach the same
    joins in the same order (the n-th join of ``key`` in one ubatch meets the n-th in the others);
    a ubatch that ends or waits at another join instead is a RuntimeError, not a hang.
    """
    state = _current.get()
    if state is None:
        return _joined_results(fn, [value], key)[0]
    return state.join(key, value, fn)


def _joined_results(fn: Callable[[list[Any]], Sequence[Any]], values: list[Any], key: Hashable) -> Sequence[Any]:
    results = fn(values)
    if len(results) != len(values):
        raise RuntimeError(f"join {key!r}: fn returned {len(results)} results for {len(values)} ubatches")
    return results


@dataclass
class UBatchState:
    """One ubatch's identity, streams and the events that order its work."""

    ubatch_id: int
    scheduler: UBatchScheduler
    compute_stream: Any = None
    handoff_event: Any = None
    comm_ready_event: Any = None
    grad_enabled: bool = True
    segment_start: Any = None
    join_counts: dict[Hashable, int] = field(default_factory=dict)  # joins of each key this task reached
    busy: bool = False  # a task was handed to this ubatch's worker and has not reported its end
    result: Any = None  # the ended task's value or exception, until the driver takes it
    discarded: bool = False  # its worker refused to stop and was thrown out

    def finish(self) -> Any:
        """The ended task's value or exception, dropped from the state (which outlives the step)."""
        result, self.result = self.result, None
        self.busy = False
        return result

    def yield_now(self) -> None:
        if self.discarded:  # hand control back to whoever is killing it; never touch the scheduler
            greenlet.getcurrent().parent.switch(Outcome.YIELD)
            return
        self.scheduler._yield_from(self)

    def join(self, key: Hashable, value: Any, fn: Callable[[list[Any]], Sequence[Any]]) -> Any:
        """This ubatch's side of ``join_ubatches``."""
        pool = self.scheduler._local.pool
        if pool.num_tasks == 1:
            return _joined_results(fn, [value], key)[0]
        count = self.join_counts.get(key, 0)
        self.join_counts[key] = count + 1
        join_id = (key, count)
        join = pool.joins.setdefault(join_id, _Join())
        join.values[self.ubatch_id] = value
        if len(join.values) == pool.num_tasks:
            join.results = _joined_results(fn, [join.values[i] for i in range(pool.num_tasks)], key)
        # Leave in ubatch order, as the round-robin would: ubatch i's work at every later point
        # (its KV write at the next layer) must still come before ubatch i + 1's.
        while join.results is None or join.taken < self.ubatch_id:
            pool.joining[self.ubatch_id] = join_id
            try:
                _check_join_can_complete(pool, join_id, join)
                self.yield_now()
            finally:
                del pool.joining[self.ubatch_id]
        result = join.results[self.ubatch_id]
        join.taken += 1
        if join.taken == pool.num_tasks:
            del pool.joins[join_id]
        return result

    def run_collective(self, op_name: str, launch: Callable[[bool], Any], timeout: float | None) -> None:
        """Issue a collective on the comm stream (CUDA) or asynchronously (CPU), yield, then wait."""
        self.finish_collective(self.start_collective(op_name, launch, timeout))

    def start_collective(
        self,
        op_name: str,
        launch: Callable[[bool], Any],
        timeout: float | None,
        pending: PendingCollective | None = None,
    ) -> PendingCollective:
        """Launch a collective without waiting for it: on CUDA it is enqueued on the comm stream
        after the compute issued so far; on CPU ``launch(True)`` returns the in-flight work.

        ``pending`` is refilled when given, so a piecewise graph replay that re-runs the launch
        leaves its wait, recorded once at capture, waiting on this launch.
        """
        sched = self.scheduler
        pending = pending or PendingCollective(op_name)
        pending.timeout = timeout
        if self.compute_stream is None:
            pending.start = sched.trace.mark() if sched.trace else None
            pending.work = launch(True)
            return pending
        self.comm_ready_event.record(self.compute_stream)
        sched.comm_stream.wait_event(self.comm_ready_event)
        sched._note_comm_stream_used()
        start = sched.trace.mark(sched.comm_stream) if sched.trace else None
        with torch.cuda.stream(sched.comm_stream):
            launch(False)
        if pending.done_event is None:
            pending.done_event = torch.cuda.Event()
        pending.done_event.record(sched.comm_stream)
        if sched.trace:
            sched.trace.add(self.ubatch_id, "comm", op_name, start, sched.trace.mark(sched.comm_stream))
        return pending

    def finish_collective(self, pending: PendingCollective, stream: Any = None) -> None:
        """Yield to the other ubatches while the collective is in flight, then make this ubatch's
        compute (or ``stream``, one beside it) wait for its result."""
        self.yield_now()
        if pending.done_event is not None:
            (self.compute_stream if stream is None else stream).wait_event(pending.done_event)
        else:
            sched = self.scheduler
            limit = sched.timeout_s if pending.timeout is None else pending.timeout
            try:
                pending.work.wait(timedelta(seconds=limit))
            except RuntimeError as exc:
                raise RuntimeError(wait_failure_message(exc, self.ubatch_id, pending.op_name, limit)) from exc
            pending.work = None
            if sched.trace:
                sched.trace.add(self.ubatch_id, "comm", pending.op_name, pending.start, sched.trace.mark())
        self._restart_segment()

    def _restart_segment(self) -> None:
        """Compute after a collective starts once its result is in: waiting is not computing."""
        if self.scheduler.trace:
            self.segment_start = self.scheduler.trace.mark(self.compute_stream)


_PEER_CLOSED = re.compile(
    r"connection (was )?(closed|reset)|(closed|reset) by (the )?peer|broken pipe|remote process exited", re.IGNORECASE
)
_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)


def wait_failure_message(exc: BaseException, ubatch_id: int, op_name: str, limit_s: float) -> str:
    """Say which of the usual reasons made a collective's wait fail: a peer that closed its
    connection (it exited or crashed), a wait that ran out of time, or something else."""
    if _PEER_CLOSED.search(str(exc)):
        return (
            f"ubatch {ubatch_id}'s {op_name} failed: a peer rank closed its connection "
            f"(it exited or crashed; check its logs): {exc}"
        )
    if _TIMED_OUT.search(str(exc)):
        return (
            f"ubatch {ubatch_id} waited more than {limit_s:g} s for {op_name} "
            f"(timed out: a peer rank may be slow, stuck or missing this collective): {exc}"
        )
    return f"ubatch {ubatch_id}'s {op_name} failed while waiting for its result: {exc}"


@dataclass
class PendingCollective:
    """A collective a ubatch launched and has not waited for yet (its done event on CUDA, its
    work object on CPU)."""

    op_name: str
    timeout: float | None = None
    done_event: Any = None
    work: Any = None
    start: Any = None


@dataclass
class _Join:
    """One join in progress: the values the ubatches brought, then the results they take."""

    values: dict[int, Any] = field(default_factory=dict)
    results: Sequence[Any] | None = None
    taken: int = 0


def _check_join_can_complete(pool: _Pool, join_id: tuple[Hashable, int], join: _Join) -> None:
    """Raise if the ubatches still missing at ``join_id`` can never arrive."""
    key, count = join_id
    for i in range(pool.num_tasks):
        if i not in join.values and i not in pool.running:
            raise RuntimeError(f"ubatch {i} ended without reaching join {key!r} (#{count + 1}) that the others wait at")
    if all(i in pool.joining and pool.joins[pool.joining[i]].results is None for i in pool.running):
        waits = ", ".join(f"ubatch {i} at {k!r} (#{c + 1})" for i, (k, c) in sorted(pool.joining.items()))
        raise RuntimeError(f"ubatches wait at different joins and none can complete: {waits}")


@dataclass
class _Pool:
    """One thread's workers and ubatch states for one scheduler (greenlets cannot cross threads,
    and a state's outcome and grad mode belong to the thread driving it)."""

    workers: list[greenlet.greenlet] = field(default_factory=list)
    states: list[UBatchState] = field(default_factory=list)
    driver: greenlet.greenlet | None = None
    entered: set[int] = field(default_factory=set)  # ubatches whose streams the current call used
    comm_stream_used: bool = False
    num_tasks: int = 0  # ubatches in the current call
    running: set[int] = field(default_factory=set)  # ubatches whose task has not ended
    joins: dict[tuple[Hashable, int], _Join] = field(default_factory=dict)
    joining: dict[int, tuple[Hashable, int]] = field(default_factory=dict)  # ubatch -> the join it waits at


class UBatchScheduler:
    """Runs callables as ubatches; see the module docstring for the ordering rules."""

    def __init__(
        self,
        num_ubatches: int,
        device: torch.device | str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        compute_streams: Sequence[Any] | None = None,
        comm_stream: Any = None,
        comm_group: Callable[[Any], Any] | None = None,
    ) -> None:
        self.num_ubatches = check_num_ubatches(num_ubatches)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.device = torch.device(device) if device is not None else _default_device()
        self.timeout_s = float(timeout_s)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and not torch.cuda.is_available():
            raise RuntimeError(
                f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}): pass device='cpu', or None to use CUDA only where it exists"
            )
        self._local = threading.local()
        self.trace: StepTrace | None = None
        self._comm_group = comm_group
        self.compute_streams: list[Any] = []
        self.comm_stream: Any = None
        self.single_task_on_caller_stream = False
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._make_streams(compute_streams, comm_stream)
        elif compute_streams is not None or comm_stream is not None:
            raise ValueError(f"streams were given but the device is {self.device}, not CUDA")

    def _make_streams(self, compute_streams: Sequence[Any] | None, comm_stream: Any) -> None:
        if compute_streams is not None and len(compute_streams) != self.num_ubatches:
            raise ValueError(f"need one compute stream per ubatch ({self.num_ubatches}), got {len(compute_streams)}")
        own_compute, own_comm = ubatch_streams(self.device, self.num_ubatches)
        self.compute_streams = list(compute_streams or own_compute)
        self.single_task_on_caller_stream = compute_streams is None
        self.comm_stream = comm_stream if comm_stream is not None else own_comm

    def _make_state(self, i: int) -> UBatchState:
        # A weak back-reference: a cycle would leave the scheduler, its pool and its parked
        # greenlets to the garbage collector, which may only run them down at interpreter exit.
        state = UBatchState(ubatch_id=i, scheduler=weakref.proxy(self))
        if self.is_cuda:
            state.compute_stream = self.compute_streams[i]
            state.handoff_event = torch.cuda.Event()
            state.comm_ready_event = torch.cuda.Event()
        return state

    def resolve_group(self, group: Any) -> Any:
        """The process group a ubatch's collective on ``group`` uses (an SM partition may give
        overlapped collectives a dedicated, CTA-capped communicator)."""
        return group if self._comm_group is None else self._comm_group(group)

    def prepare(self) -> None:
        """Create this thread's workers and every stream's cuBLAS handle before any graph capture.

        A cuBLAS handle created inside a capture breaks it (docs/cuda-graphs.md), so touch one
        per stream.
        """
        self._pool()
        if self.is_cuda:
            with torch.cuda.device(self.device):
                for stream in [*self.compute_streams, self.comm_stream]:
                    with torch.cuda.stream(stream):
                        torch.cuda.current_blas_handle()

    def start_trace(self) -> StepTrace:
        """Record compute and comm intervals of the following calls until ``stop_trace()``."""
        self.trace = StepTrace(is_cuda=self.is_cuda)
        return self.trace

    def stop_trace(self) -> StepTrace | None:
        trace, self.trace = self.trace, None
        return trace

    def _pool(self) -> _Pool:
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = _Pool()
            weakref.finalize(pool, _recycle_workers, pool.workers, _idle_workers())
            self._local.pool = pool
        while len(pool.workers) < self.num_ubatches:  # two loops: an interrupt leaves no gap
            pool.workers.append(_take_worker())
        while len(pool.states) < self.num_ubatches:
            pool.states.append(self._make_state(len(pool.states)))
        return pool

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[i]`` as ubatch i and return their results in order.

        Each task sees a copy of the caller's context variables (the forward context included)
        and the caller's grad mode. If one raises, the others are aborted (those not yet started
        never start; a suspended one gets ``UBatchAborted`` at every yield until it ends), and
        the exception is re-raised here with the ubatch id noted. However a call ends, a
        return, an exception or an interrupt, no task of it is left to run into the next call.
        """
        n = len(tasks)
        if not 1 <= n <= self.num_ubatches:
            raise ValueError(f"this scheduler runs 1 to {self.num_ubatches} ubatches, got {n} tasks")
        pool = self._pool()
        if pool.driver is not None:
            raise RuntimeError("UBatchScheduler.run is not re-entrant: a ubatch called it again")
        caller_stream = torch.cuda.current_stream(self.device) if self.is_cuda else None
        grad_enabled = torch.is_grad_enabled()
        try:
            pool.driver = greenlet.getcurrent()
            pool.entered.clear()
            pool.comm_stream_used = False
            pool.joins.clear()
            for worker in pool.workers:  # a worker reports to (and parks in) its parent
                if worker.parent is not pool.driver:
                    worker.parent = pool.driver
            self._settle(pool)  # what an interrupted clean-up of the previous call left
            return self._drive(pool, tasks, caller_stream, grad_enabled)
        finally:
            try:
                self._settle(pool)
            finally:
                pool.driver = None
                pool.joins.clear()
                pool.running.clear()
                torch.set_grad_enabled(grad_enabled)
                self._join(pool, caller_stream)

    def _drive(
        self, pool: _Pool, tasks: Sequence[Callable[[], Any]], caller_stream: Any, grad_enabled: bool
    ) -> list[Any]:
        n = len(tasks)
        states = pool.states[:n]
        pool.entered.update(range(n))  # forked from the caller's stream below, so joined back
        if caller_stream is not None:
            for state, stream in zip(states, self._call_streams(n, caller_stream)):
                state.compute_stream = stream
                if stream != caller_stream:
                    stream.wait_stream(caller_stream)
        for state in states:
            state.grad_enabled = grad_enabled
            state.join_counts.clear()
        results: list[Any] = [None] * n
        active = list(range(n))
        pool.num_tasks = n
        pool.running = set(active)
        previous: UBatchState | None = None
        while active:
            for i in list(active):
                state = states[i]
                self._enter(pool, state, previous)
                previous = state
                if state.busy:
                    kind = pool.workers[i].switch(None)
                else:
                    state.busy = True  # before the switch: a false "busy" is settled harmlessly
                    kind = pool.workers[i].switch((state, tasks[i], contextvars.copy_context()))
                self._leave(state)
                if kind is Outcome.YIELD:
                    continue
                active.remove(i)
                pool.running.discard(i)
                value = state.finish()
                if kind is Outcome.ERROR:
                    _note_ubatch(value, i)
                    raise value
                if kind is not Outcome.DONE:
                    raise RuntimeError(f"ubatch {i} ended with {kind}, but nothing aborted it")
                results[i] = value
        return results

    def _enter(self, pool: _Pool, state: UBatchState, previous: UBatchState | None) -> None:
        pool.entered.add(state.ubatch_id)
        torch.set_grad_enabled(state.grad_enabled)
        if state.compute_stream is not None:
            if previous is not None and previous is not state:
                state.compute_stream.wait_event(previous.handoff_event)
            torch.cuda.set_stream(state.compute_stream)
        if self.trace:
            state.segment_start = self.trace.mark(state.compute_stream)

    def _leave(self, state: UBatchState) -> None:
        state.grad_enabled = torch.is_grad_enabled()
        if self.trace:
            self.trace.add(
                state.ubatch_id, "compute", "compute", state.segment_start, self.trace.mark(state.compute_stream)
            )
        if state.compute_stream is not None:
            state.handoff_event.record(state.compute_stream)

    def _settle(self, pool: _Pool) -> None:
        """Abort every task still running (and replace dead workers), so none outlives its call."""
        for i in range(len(pool.states)):
            if pool.states[i].busy or pool.workers[i].dead:
                self._abort(pool, i)

    def _abort(self, pool: _Pool, i: int) -> None:
        """Throw ``UBatchAborted`` into ubatch i until its task ends; discard a worker that
        will not stop (a task that catches BaseException and keeps yielding)."""
        worker, state = pool.workers[i], pool.states[i]
        for _ in range(ABORT_ATTEMPTS):
            if worker.dead:
                break
            self._enter(pool, state, None)
            try:
                kind = worker.throw(UBatchAborted())
            except UBatchAborted:
                break  # it was parked (marked busy just before or after its task): the throw ended it
            finally:
                self._leave(state)
            if kind is not Outcome.YIELD:
                value = state.finish()
                if kind is Outcome.ERROR:
                    logger.warning("ubatch %d also failed while aborting: %r", i, value)
                return
        else:
            logger.warning(
                "ubatch %d kept running after %d aborts (does it catch BaseException?); its worker is discarded",
                i,
                ABORT_ATTEMPTS,
            )
        state.discarded = True
        if not worker.dead:
            _refusing_workers.append(worker)
        pool.workers[i] = _take_worker()  # the worker first: a fresh state must never meet the old one
        pool.states[i] = self._make_state(i)

    def _call_streams(self, n: int, caller_stream: Any) -> list[Any]:
        """The compute stream of each of a call's ``n`` ubatches (see the module docstring)."""
        if n == 1 and self.single_task_on_caller_stream:
            return [caller_stream]
        return self.compute_streams[:n]

    def _join(self, pool: _Pool, caller_stream: Any) -> None:
        if caller_stream is None:
            return
        torch.cuda.set_stream(caller_stream)
        for i in sorted(pool.entered):
            stream = pool.states[i].compute_stream
            if stream != caller_stream:
                caller_stream.wait_stream(stream)
        if pool.comm_stream_used:  # joining an unused stream would break a graph capture
            caller_stream.wait_stream(self.comm_stream)

    def _yield_from(self, state: UBatchState) -> None:
        self._local.pool.driver.switch(Outcome.YIELD)

    def _note_comm_stream_used(self) -> None:
        self._local.pool.comm_stream_used = True


def _start_worker() -> greenlet.greenlet:
    worker = greenlet.greenlet(_worker_loop)
    worker.switch()  # start it: it parks at once and takes every task as a switch value
    return worker


def _worker_loop() -> None:
    """A persistent ubatch: park, then run each task it is switched to, leave the result on its
    state, report how the task ended, and park again.

    A parked worker holds no reference to its last task, context or result: they would keep
    the step's tensors alive until the next call, and a reference back to the pool would tie
    the pool and its workers in a cycle that only the garbage collector frees (at interpreter
    exit that outlived ``destroy_process_group`` and aborted gloo ranks). Tasks arrive as switch
    values, never as the start argument: a greenlet keeps that for as long as it lives.
    """
    kind: Outcome | None = None
    while True:
        state, task, context = greenlet.getcurrent().parent.switch(kind)
        kind = context.run(_run_task, state, task)
        state = task = context = None


def _run_task(state: UBatchState, task: Callable[[], Any]) -> Outcome:
    """Runs inside a copy of the caller's context, so the ubatch state set here dies with it."""
    _current.set(state)
    try:
        state.result = task()
        return Outcome.DONE
    except UBatchAborted:
        return Outcome.ABORTED
    except greenlet.GreenletExit:  # the worker itself is being killed: let it die
        raise
    except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's greenlet
        state.result = exc
        return Outcome.ERROR


def _note_ubatch(exc: BaseException, ubatch_id: int) -> None:
    note = f"raised in ubatch {ubatch_id}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.args = (*exc.args, note) if exc.args else (note,)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
