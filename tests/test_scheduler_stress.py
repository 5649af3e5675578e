"""One scheduler driven from two threads at once, with the interpreter switching threads as often
as it can: every call returns its own results and every ubatch runs in its thread's grad mode."""

import sys
import threading

import pytest
import torch

from ubatch.scheduler import UBatchScheduler, current_ubatch_id, yield_ubatch


@pytest.fixture
def switch_threads_constantly():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _drive(sched, name, grad, steps, report):
    """``steps`` calls from this thread; what went wrong goes to ``report[name]``."""
    problems = report[name]
    try:
        with torch.set_grad_enabled(grad):
            for step in range(steps):

                def task():
                    modes = [torch.is_grad_enabled()]
                    for _ in range(2):
                        yield_ubatch()
                        modes.append(torch.is_grad_enabled())
                    return (name, step, current_ubatch_id(), modes)

                results = sched.run([task, task])
                expected = [(name, step, i, [grad] * 3) for i in range(2)]
                if results != expected:
                    problems.append((step, results))
                if torch.is_grad_enabled() != grad:
                    problems.append((step, "the caller's grad mode was not restored"))
    except Exception as exc:  # noqa: BLE001 - reported by the test
        problems.append(("raised", repr(exc)))


def _run_two_threads(steps):
    """Two threads, one under torch.no_grad and one with grad, drive one scheduler."""
    sched = UBatchScheduler(2, "cpu")
    report = {"no_grad": [], "grad": []}
    threads = [threading.Thread(target=_drive, args=(sched, name, name == "grad", steps, report)) for name in report]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert report == {"no_grad": [], "grad": []}


def test_two_threads_share_one_scheduler_for_5000_steps_each(switch_threads_constantly):
    _run_two_threads(5000)
