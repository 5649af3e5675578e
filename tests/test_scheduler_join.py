"""``join_ubatches``: one call of ``fn`` over every ubatch's value, each ubatch its own result,
ubatches leaving in order; a join that can never complete is a RuntimeError, not a hang."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubatch.scheduler import UBatchScheduler, current_ubatch_id, join_ubatches, yield_ubatch


def test_outside_a_ubatch_fn_runs_on_the_one_value():
    assert join_ubatches("k", 3, lambda values: [v * 10 for v in values]) == 30


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 4),
    yields=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    joins=st.integers(1, 3),
)
def test_fn_runs_once_per_join_over_values_in_ubatch_order(n, yields, joins):
    """However many times each ubatch yields before a join, fn runs once per join, sees the
    values in ubatch order, and every ubatch leaves with its own entry, in ubatch order."""
    calls, left = [], []

    def fn(values):
        calls.append(list(values))
        return [(j, i + 100) for j, i in values]

    def task():
        i = current_ubatch_id()
        got = []
        for j in range(joins):
            for _ in range(yields[i]):
                yield_ubatch()
            got.append(join_ubatches("layer", (j, i), fn))
            left.append((j, i))
        return got

    results = UBatchScheduler(4, device="cpu").run([task] * n)
    assert calls == [[(j, i) for i in range(n)] for j in range(joins)]
    assert results == [[(j, i + 100) for j in range(joins)] for i in range(n)]
    for j in range(joins):
        assert [i for jj, i in left if jj == j] == list(range(n)), left


def test_each_ubatch_gets_its_own_result():
    def task():
        return join_ubatches("k", current_ubatch_id(), lambda values: [f"r{v}" for v in values])

    assert UBatchScheduler(3, device="cpu").run([task] * 3) == ["r0", "r1", "r2"]


def test_fn_runs_in_the_last_ubatch_to_arrive_and_may_yield():
    """fn may wait on collectives (it yields); the others keep waiting, none leaves early."""
    ran_in = []

    def fn(values):
        ran_in.append(current_ubatch_id())
        yield_ubatch()
        return values

    def task():
        if current_ubatch_id() == 0:
            yield_ubatch()
            yield_ubatch()
        return join_ubatches("k", current_ubatch_id(), fn)

    assert UBatchScheduler(3, device="cpu").run([task] * 3) == [0, 1, 2]
    assert ran_in == [0]


def test_a_ubatch_that_ends_without_joining_is_an_error():
    def task():
        if current_ubatch_id() == 1:
            return None
        return join_ubatches("layers.0", 1, lambda values: values)

    with pytest.raises(RuntimeError, match=r"ubatch 1 ended without reaching join 'layers.0'"):
        UBatchScheduler(2, device="cpu").run([task] * 2)


def test_joins_reached_in_different_orders_are_an_error():
    def task():
        first, second = ("a", "b") if current_ubatch_id() == 0 else ("b", "a")
        join_ubatches(first, 0, lambda values: values)
        join_ubatches(second, 0, lambda values: values)

    with pytest.raises(RuntimeError, match=r"wait at different joins.*ubatch 0 at 'a'.*ubatch 1 at 'b'"):
        UBatchScheduler(2, device="cpu").run([task] * 2)


def test_fn_must_return_one_result_per_ubatch():
    def task():
        return join_ubatches("k", 0, lambda values: values[:1])

    with pytest.raises(RuntimeError, match=r"join 'k': fn returned 1 results for 2 ubatches"):
        UBatchScheduler(2, device="cpu").run([task] * 2)


def test_a_failed_join_leaves_nothing_for_the_next_call():
    sched = UBatchScheduler(2, device="cpu")

    def failing(values):
        raise ValueError("boom")

    def task(fn):
        return lambda: join_ubatches("k", current_ubatch_id(), fn)

    with pytest.raises(ValueError, match="boom"):
        sched.run([task(failing)] * 2)
    assert sched.run([task(lambda values: values)] * 2) == [0, 1]


def test_join_ubatches_is_public():
    import ubatch

    assert ubatch.join_ubatches is join_ubatches and "join_ubatches" in ubatch.__all__
