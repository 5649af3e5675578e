"""The greenlet scheduler: round-robin order, isolation, failures that never hang, no leaks."""

import contextvars
import gc
import logging
import os
import random
import signal
import threading
import weakref

import greenlet
import psutil
import pytest
import torch

import ubatch.scheduler as scheduler_module
from ubatch import comm
from ubatch.context import ForwardContext, get_forward_context, override_forward_context
from ubatch.scheduler import MAX_UBATCHES, UBatchScheduler, current_ubatch_id, yield_ubatch


def _stepper(log, steps):
    def task():
        uid = current_ubatch_id()
        for step in range(steps):
            log.append((uid, step))
            yield_ubatch()
        return uid

    return task


@pytest.mark.parametrize("n", [2, 3, 4])
def test_round_robin_order_is_deterministic(n):
    sched = UBatchScheduler(n, "cpu")
    log = []
    results = sched.run([_stepper(log, 3) for _ in range(n)])
    assert results == list(range(n))
    assert log == [(u, step) for step in range(3) for u in range(n)]


def test_uneven_ubatches_finish_independently():
    sched = UBatchScheduler(3, "cpu")
    log = []
    results = sched.run([_stepper(log, 1), _stepper(log, 3), _stepper(log, 2)])
    assert results == [0, 1, 2]
    assert log == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (1, 2)]


def test_fewer_tasks_than_ubatches_and_too_many():
    sched = UBatchScheduler(4, "cpu")
    assert sched.run([_stepper([], 2)]) == [0]
    with pytest.raises(ValueError, match="1 to 4 ubatches, got 5"):
        sched.run([_stepper([], 1)] * 5)


def test_yield_and_id_outside_a_ubatch_are_noops():
    assert current_ubatch_id() is None
    yield_ubatch()


@pytest.mark.parametrize("bad", [0, -1, MAX_UBATCHES + 1, 10**6])
def test_num_ubatches_out_of_range(bad):
    with pytest.raises(ValueError, match=f"num_ubatches must be between 1 and MAX_UBATCHES=16, got {bad}"):
        UBatchScheduler(bad, "cpu")


@pytest.mark.parametrize("bad", [1.5, "2", True, None])
def test_num_ubatches_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match=f"num_ubatches must be an int, got {bad!r}"):
        UBatchScheduler(bad, "cpu")


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="device='cuda' asks for CUDA, but torch.cuda.is_available"):
        UBatchScheduler(2, "cuda")


def test_bad_timeout_and_streams_on_cpu():
    with pytest.raises(ValueError, match="timeout_s"):
        UBatchScheduler(2, "cpu", timeout_s=0)
    with pytest.raises(ValueError, match="not CUDA"):
        UBatchScheduler(2, "cpu", comm_stream=object())


def test_each_ubatch_sees_its_own_forward_context():
    sched = UBatchScheduler(3, "cpu")
    seen = []

    def task_for(i):
        def task():
            with override_forward_context(ForwardContext(ubatch_id=i, additional_kwargs={"i": i})):
                for _ in range(3):
                    ctx = get_forward_context()
                    seen.append((current_ubatch_id(), ctx.ubatch_id, ctx.additional_kwargs["i"]))
                    yield_ubatch()

        return task

    parent = ForwardContext(additional_kwargs={"parent": True})
    with override_forward_context(parent):
        sched.run([task_for(i) for i in range(3)])
        assert get_forward_context() is parent
    assert all(a == b == c for a, b, c in seen) and len(seen) == 9


def test_grad_mode_is_the_callers_and_restored():
    sched = UBatchScheduler(2, "cpu")

    def task():
        states = [torch.is_grad_enabled()]
        if current_ubatch_id() == 0:
            torch.set_grad_enabled(True)
        yield_ubatch()
        states.append(torch.is_grad_enabled())
        return states

    with torch.no_grad():
        results = sched.run([task, task])
        assert not torch.is_grad_enabled()
    assert results == [[False, True], [False, False]]


class Boom(Exception):
    pass


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("fail_step", [0, 1, 2])
def test_failure_in_any_ubatch_aborts_the_rest_and_is_reraised(n, fail_step):
    sched = UBatchScheduler(n, "cpu")
    for failing in range(n):
        started, cleaned = set(), set()

        def task():
            uid = current_ubatch_id()
            started.add(uid)
            try:
                for step in range(3):
                    if uid == failing and step == fail_step:
                        raise Boom(f"bad ubatch {uid}")
                    yield_ubatch()
            finally:
                cleaned.add(uid)

        with pytest.raises(Boom, match=f"bad ubatch {failing}") as info:
            sched.run([task] * n)
        assert f"raised in ubatch {failing}" in "".join(getattr(info.value, "__notes__", []))
        if fail_step == 0:
            assert started == set(range(failing + 1)), "ubatches after the failing one must not start"
        assert cleaned == started, "every started ubatch unwinds"
        log = []
        assert sched.run([_stepper(log, 2) for _ in range(n)]) == list(range(n))


def test_exception_type_is_kept_for_base_exceptions():
    sched = UBatchScheduler(2, "cpu")

    def task():
        if current_ubatch_id() == 1:
            raise KeyboardInterrupt
        yield_ubatch()

    with pytest.raises(KeyboardInterrupt):
        sched.run([task, task])
    assert sched.run([_stepper([], 1)] * 2) == [0, 1]


def test_run_is_not_reentrant():
    sched = UBatchScheduler(2, "cpu")

    def task():
        sched.run([_stepper([], 1)] * 2)

    with pytest.raises(RuntimeError, match="not re-entrant"):
        sched.run([task, task])


def test_no_thread_or_greenlet_leak_over_many_calls():
    """Python and OS threads (psutil sees native ones too), greenlets and resident memory stay
    flat over 1000 calls."""
    process = psutil.Process()
    sched = UBatchScheduler(3, "cpu")
    tasks = [_stepper([], 2) for _ in range(3)]
    sched.run(tasks)
    gc.collect()
    threads, os_threads = threading.active_count(), process.num_threads()
    greenlets = sum(type(o) is greenlet.greenlet for o in gc.get_objects())
    rss = process.memory_info().rss
    for _ in range(1000):
        sched.run(tasks)
    gc.collect()
    assert threading.active_count() == threads and process.num_threads() == os_threads
    assert sum(type(o) is greenlet.greenlet for o in gc.get_objects()) == greenlets
    assert process.memory_info().rss - rss < 32 << 20, "resident memory grew by more than 32 MiB"


def test_one_scheduler_from_two_threads():
    sched = UBatchScheduler(2, "cpu")
    results, errors = {}, []

    def worker(name):
        try:
            for _ in range(200):
                results[name] = sched.run([_stepper([], 3)] * 2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and results == {"a": [0, 1], "b": [0, 1]}


def test_a_live_scheduler_keeps_no_task_or_context_of_a_finished_run():
    """A worker's first task came in as its start argument, which the greenlet kept for its
    whole life: the first step's closure (and so a model and its process groups) and its
    forward context stayed pinned while the scheduler lived."""

    class Payload:
        pass

    gc.disable()
    try:
        scheduler = UBatchScheduler(2, "cpu")
        for _ in range(2):
            payloads = [Payload(), Payload()]
            held = [weakref.ref(p) for p in payloads]
            marker = contextvars.ContextVar("marker")
            marker.set(Payload())
            in_context = weakref.ref(marker.get())
            scheduler.run([lambda p=p: (yield_ubatch(), p)[0] for p in payloads])
            del payloads
            marker.set(None)
            assert [ref() for ref in held] == [None, None], "a finished task is still referenced"
            assert in_context() is None, "a finished run's context copy is still referenced"
    finally:
        gc.enable()


def test_finished_ubatches_keep_nothing_alive_and_a_dropped_scheduler_needs_no_gc():
    """Parked workers hold no reference to their last task's result, and nothing ties the
    scheduler, its states and its workers in a cycle: dropping it frees everything at once
    (a cycle left them to the garbage collector, which ran them down at interpreter exit)."""

    class Payload:
        pass

    made = []

    def task():
        payload = Payload()
        made.append(weakref.ref(payload))
        yield_ubatch()
        return payload

    gc.disable()
    try:
        scheduler = UBatchScheduler(2, "cpu")
        outputs = scheduler.run([task, task])
        assert len(outputs) == 2
        del outputs
        assert [ref() for ref in made] == [None, None]
        dropped = weakref.ref(scheduler)
        del scheduler
        assert dropped() is None
    finally:
        gc.enable()


def test_a_dropped_schedulers_workers_are_recycled_not_killed_inside_a_ubatch():
    """A dropped pool's parked workers go to its thread's next pools. Freed, each would be killed
    by its deallocation, often inside the garbage collector: a switch into it from whatever ran,
    here another scheduler's ubatch (a GPU test run once aborted in such a collection)."""
    first = UBatchScheduler(2, "cpu")
    first.run([_stepper([], 2)] * 2)
    workers = [weakref.ref(worker) for worker in first._local.pool.workers]
    first.cycle = first  # only the collector frees it
    del first

    def collect_inside_a_ubatch():
        gc.collect()
        yield_ubatch()
        return [ref() is not None and not ref().dead for ref in workers]

    second = UBatchScheduler(3, "cpu")
    assert second.run([collect_inside_a_ubatch] * 3) == [[True, True]] * 3
    made = {id(ref()) for ref in workers} | {id(worker) for worker in second._local.pool.workers}
    del second
    third = UBatchScheduler(4, "cpu")  # more than the second left: the first's workers serve too
    assert third.run([_own("third")] * 4) == [("third", i) for i in range(4)]
    assert {id(worker) for worker in third._local.pool.workers} < made
    # a recycled worker reports to whoever took it, as a fresh one does to its maker
    del third
    driver = greenlet.greenlet(lambda: scheduler_module._take_worker())
    assert driver.switch().parent is driver


def _own(tag):
    """Tasks that yield twice and return (tag, their ubatch id): a stale result shows."""

    def task():
        yield_ubatch()
        yield_ubatch()
        return (tag, current_ubatch_id())

    return task


def _check_next_call_is_clean(sched, n):
    assert sched.run([_own("next")] * n) == [("next", i) for i in range(n)]


def test_an_aborted_ubatch_whose_finally_yields_is_finished_before_the_next_call():
    sched = UBatchScheduler(2, "cpu")
    cleaned = []

    def with_cleanup_collective():
        try:
            yield_ubatch()
            yield_ubatch()
            return "first"
        finally:
            comm.all_reduce(torch.ones(2))  # one rank: a local no-op that still yields
            cleaned.append(current_ubatch_id())

    def failing():
        yield_ubatch()
        raise Boom("ubatch 1 fails")

    with pytest.raises(Boom):
        sched.run([with_cleanup_collective, failing])
    _check_next_call_is_clean(sched, 2)
    assert cleaned == [], "the clean-up's yield raises UBatchAborted again, so the rest of it never ran"


@pytest.mark.parametrize("yields_after_catching", [1, 3, 10_000])
def test_a_task_that_swallows_the_abort_and_keeps_yielding_is_finished_or_thrown_out(
    yields_after_catching, caplog, capfd
):
    """A worker thrown out is never resumed again: not by the garbage collector either, whose
    ``GreenletExit`` the task would swallow (greenlet then says "GreenletExit did not kill")."""
    sched = UBatchScheduler(2, "cpu")

    def stubborn():
        for _ in range(yields_after_catching + 1):
            try:
                yield_ubatch()
            except BaseException:  # noqa: BLE001 - the misbehaviour under test
                pass
        return "stale"

    def failing():
        raise Boom("fails at once")

    for _ in range(3):
        with caplog.at_level(logging.WARNING, logger="ubatch.scheduler"), pytest.raises(Boom):
            sched.run([stubborn, failing])
        _check_next_call_is_clean(sched, 2)
    discarded = "its worker is discarded" in caplog.text
    assert discarded == (yields_after_catching >= 8)
    del sched
    gc.collect()
    assert "did not kill" not in capfd.readouterr().err


def test_a_task_that_swallows_the_abort_and_returns_leaves_nothing_behind():
    sched = UBatchScheduler(3, "cpu")

    def swallowing():
        try:
            yield_ubatch()
            yield_ubatch()
        except BaseException:  # noqa: BLE001 - the misbehaviour under test
            return "swallowed"
        return "finished"

    def failing():
        yield_ubatch()
        raise Boom("fails")

    with pytest.raises(Boom):
        sched.run([swallowing, failing, swallowing])
    _check_next_call_is_clean(sched, 3)


@pytest.mark.parametrize("where", ["_enter", "_leave"])
@pytest.mark.parametrize("n", [2, 3])
def test_an_interrupt_on_the_driver_between_switches_leaves_no_stale_result(where, n, monkeypatch):
    sched = UBatchScheduler(n, "cpu")
    original = getattr(sched, where)
    for interrupt_at in range(1, 3 * n + 1):
        calls = [0]

        def interrupting(*args, interrupt_at=interrupt_at, calls=calls):
            calls[0] += 1
            if calls[0] == interrupt_at:
                raise KeyboardInterrupt
            return original(*args)

        monkeypatch.setattr(sched, where, interrupting)
        with pytest.raises(KeyboardInterrupt):
            sched.run([_own("interrupted")] * n)
        monkeypatch.setattr(sched, where, original)
        _check_next_call_is_clean(sched, n)


def test_a_real_sigint_at_random_moments_never_gives_a_stale_result():
    """SIGINT at a random point of a call (timed by SIGALRM, whose handler sends it): the call
    raises KeyboardInterrupt or returns its own results, and so does every later call."""
    sched = UBatchScheduler(3, "cpu")
    rng = random.Random(0)
    armed = [False]

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def task_for(call):
        def task():
            for _ in range(rng.randrange(12)):
                yield_ubatch()
            return (call, current_ubatch_id())

        return task

    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_alarm = signal.signal(signal.SIGALRM, lambda signum, frame: os.kill(os.getpid(), signal.SIGINT))
    interrupted = completed = 0
    gc.disable()  # a SIGINT that lands in a gc callback (hypothesis installs one) is swallowed there
    try:
        for call in range(400):
            try:
                armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2e-4))
                results = sched.run([task_for(call)] * 3)
                armed[0] = False
            except KeyboardInterrupt:
                interrupted += 1
                continue
            assert results == [(call, i) for i in range(3)]
            completed += 1
    finally:
        gc.enable()
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGINT, previous)
    _check_next_call_is_clean(sched, 3)
    print("sigint", interrupted, completed)
    assert interrupted > 50 and completed > 50, (interrupted, completed)


@pytest.mark.cuda
def test_on_cuda_an_abort_restores_the_callers_stream_and_the_next_call_is_clean():
    sched = UBatchScheduler(2, "cuda")
    sched.prepare()

    def cleanup_yields():
        try:
            x = torch.ones(256, 256, device="cuda")
            yield_ubatch()
            return x @ x
        finally:
            yield_ubatch()

    def failing():
        yield_ubatch()
        raise Boom("fails on CUDA")

    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        with pytest.raises(Boom):
            sched.run([cleanup_yields, failing])
        assert torch.cuda.current_stream() == caller
        results = sched.run([lambda: torch.full((4,), float(current_ubatch_id()), device="cuda")] * 2)
        assert torch.cuda.current_stream() == caller
    torch.cuda.synchronize()
    assert [r.tolist() for r in results] == [[0.0] * 4, [1.0] * 4]
