# tests for pool.py (the pool policies). run: python -m pytest -q tests/test_pace.py  (a few seconds, CPU only)
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pool import (
    Pool,
    default_target,
    effective_staleness,
    generation_staleness,
    pool_stats,
    take_groups_fifo,
    take_groups_pace,
    waiting_staleness,
)

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)

PROPS = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])


def make_sample(group_id, versions, finished, recomputed=0):
    return dict(
        group_id=group_id,
        token_ids=torch.arange(len(versions), dtype=torch.int32),
        versions=torch.tensor(versions, dtype=torch.int32),
        stale=torch.zeros(len(versions), dtype=torch.bool),
        recomputed=recomputed,
        finished=finished,
        submitted=0.0,
    )


def make_group(group_id, versions, finished, size=2):
    """A group of `size` samples with the same versions, finishing at `finished`."""
    return [make_sample(group_id, versions, finished - 0.1 * i) for i in range(size)]


def ids(groups):
    return [g[0]["group_id"] for g in groups]


def rejected_ids(groups):
    """Which groups were rejected: the task says which, not in what order they come back."""
    return sorted(ids(groups))


def test_formulas():
    s = make_sample(0, [3, 3, 5, 5], 1.0)
    assert generation_staleness(s) == pytest.approx((2 + 2 + 0 + 0) / 4)
    assert generation_staleness(s, version_finished=6) == pytest.approx((3 + 3 + 1 + 1) / 4)
    assert waiting_staleness(s, 8) == 3
    assert effective_staleness([s, make_sample(0, [7], 2.0)], 8, lam=0.5) == pytest.approx(((3 + 0.5) + 1) / 2)
    empty = make_sample(0, [], 1.0)
    assert generation_staleness(empty) == 0 and waiting_staleness(empty, 8) == 0


def test_recompute_does_not_refresh_prefix():
    # the rebuilt KV changes the conditioning, not who sampled the prefix tokens
    assert generation_staleness(make_sample(0, [1, 1, 2], 1.0, recomputed=2)) == generation_staleness(
        make_sample(0, [1, 1, 2], 1.0)
    )


def test_long_answer_with_one_old_token_is_fresher_than_short_old_answer():
    long_ = make_sample(0, [4] + [5] * 99, 1.0)  # spans versions, but 1% of it is 1 version old
    short = make_sample(1, [4, 4, 4, 5], 1.0)  # 75% of it is 1 version old
    assert generation_staleness(long_) < generation_staleness(short)
    pool = {0: [long_], 1: [short], 2: [make_sample(2, [5] * 10, 1.0)]}
    consumed, rejected = take_groups_pace(pool, 1, version=6, lam=1.0, target=2)
    assert rejected_ids(rejected) == [1]


def test_rejects_highest_effective_staleness_first():
    pool = {
        g: make_group(g, v, f)
        for g, v, f in [(0, [9, 9], 1.0), (1, [2, 9], 2.0), (2, [5, 5], 3.0), (3, [8, 9], 4.0), (4, [1, 1], 5.0)]
    }
    eff = {g: effective_staleness(pool[g], 10, 1.0) for g in pool}
    consumed, rejected = take_groups_pace(pool, 2, version=10, lam=1.0, target=3)
    assert rejected_ids(rejected) == sorted(sorted(eff, key=eff.get, reverse=True)[:2]) == [2, 4]
    assert ids(consumed) == [0, 1]  # FIFO among the survivors
    assert list(pool) == [3]


def test_lam_zero_ranks_by_waiting_only():
    # group 0: fresh finish, heavy generation staleness; group 1: no generation staleness, waited longer
    pool = {0: make_group(0, [1] * 9 + [6], 1.0), 1: make_group(1, [5, 5], 2.0), 2: make_group(2, [6], 3.0)}
    _, rejected = take_groups_pace(dict(pool), 1, version=7, lam=0.0, target=2)
    assert rejected_ids(rejected) == [1]
    _, rejected = take_groups_pace(dict(pool), 1, version=7, lam=1.0, target=2)
    assert rejected_ids(rejected) == [0]


@pytest.mark.parametrize("size, target, want", [(5, 8, 0), (8, 8, 0), (9, 8, 1), (12, 8, 4)])
def test_budget_is_excess_occupancy(size, target, want):
    pool = {g: make_group(g, [g % 3, 3], float(g)) for g in range(size)}
    consumed, rejected = take_groups_pace(pool, 2, version=4, lam=1.0, target=target)
    assert len(rejected) == want and len(consumed) == 2 and len(pool) == size - want - 2


def test_never_rejects_below_what_the_step_needs():
    pool = {g: make_group(g, [0], float(g)) for g in range(6)}
    consumed, rejected = take_groups_pace(pool, 4, version=9, lam=1.0, target=0)
    assert len(rejected) == 2 and len(consumed) == 4 and not pool
    pool = {g: make_group(g, [0], float(g)) for g in range(3)}
    consumed, rejected = take_groups_pace(pool, 4, version=9, lam=1.0, target=0)
    assert rejected == [] and len(consumed) == 3


def test_fifo_is_admission_order_not_completion_order():
    rng = random.Random(0)
    items = [(g, make_group(g, [0, 1], rng.random(), size=rng.randint(1, 4))) for g in range(30)]
    rng.shuffle(items)
    pool = dict(items)
    assert ids(take_groups_fifo(pool, 7)) == list(range(7)) and sorted(pool) == list(range(7, 30))


CFG = dict(prompts_per_step=2, group_size=2, pool="fifo", pace_target=None, pace_lambda=1.0)


def feed(pool, group_id, finished):
    for s in make_group(group_id, [0, 0], finished):
        pool.add(s)


def test_pool_waits_for_the_oldest_group():
    """--max-lag holds because a long answer is not overtaken: groups 1-3 complete while
    group 0 is still being written, and the step waits for group 0."""
    pool = Pool(CFG)
    for g in (1, 2, 3):
        feed(pool, g, finished=float(g))
    pool.add(make_group(0, [0, 0], 9.0)[0])  # one of group 0's two answers
    assert pool.take(version=0) is None
    pool.add(make_group(0, [0, 0], 9.0)[1])
    consumed, rejected = pool.take(version=0)
    assert ids(consumed) == [0, 1] and rejected == [] and pool.position == 2
    assert ids(pool.take(version=1)[0]) == [2, 3] and pool.position == 4 and not pool.done


def test_pace_pool_replaces_a_rejected_group_in_order():
    """PACE rejects the stalest complete groups over its target; a rejected group of the
    step is replaced by the next in admission order, waited for if need be; a checkpoint's
    (position, done) skip exactly what was consumed or rejected."""
    pool = Pool(dict(CFG, pool="pace", pace_target=2))
    for g, versions in ((0, [0, 0]), (1, [1, 1]), (2, [1, 1]), (3, [1, 1])):
        for s in make_group(g, versions, finished=float(g)):
            pool.add(s)
    consumed, rejected = pool.take(version=2)  # 4 complete, target 2: group 0 (the stalest) and one more go
    assert len(rejected) == 2 and 0 in rejected_ids(rejected)
    assert sorted(ids(consumed) + rejected_ids(rejected)) == [0, 1, 2, 3] and pool.position == 4
    pool = Pool(dict(CFG, pool="pace", pace_target=1))
    for g, versions in ((0, [0, 0]), (1, [2, 2]), (3, [2, 2])):  # group 2 still being written
        for s in make_group(g, versions, finished=float(g)):
            pool.add(s)
    assert pool.take(version=2) is None  # 0 rejected (the stalest); the step is 1 and 2: waits for 2
    assert (pool.position, pool.done) == (1, set())
    for s in make_group(2, [2, 2], finished=5.0):
        pool.add(s)
    consumed, rejected = pool.take(version=2)  # 3 complete, target 1: one more goes (a tie: the first done)
    assert rejected_ids(rejected) == [0, 1] and ids(consumed) == [2, 3] and pool.position == 4
    pool = Pool(dict(CFG, pool="pace", pace_target=1))
    for g, versions in ((0, [2, 2]), (1, [2, 2]), (3, [0, 0])):  # 3, ahead of 2, is the stalest
        for s in make_group(g, versions, finished=float(g)):
            pool.add(s)
    consumed, rejected = pool.take(version=2)
    assert rejected_ids(rejected) == [3] and ids(consumed) == [0, 1] and (pool.position, pool.done) == (2, {3})
    assert Pool(CFG, pool.position, pool.done).next_ids(2) == [2, 4]  # what a resumed run generates next


def test_default_target_and_stats():
    assert default_target(8) == 12 and default_target(1) == 2 and default_target(3) == 5
    pool = {g: make_group(g, [g, 4], float(g)) for g in range(5)}
    consumed, rejected = take_groups_pace(pool, 2, version=5, lam=1.0, target=3)
    m = pool_stats(consumed, rejected, pool, version=5)
    assert m["rejected_groups"] == 2 and m["rejected_tokens"] == 2 * 2 * 2 and m["pool_size"] == 1
    assert rejected_ids(rejected) == [0, 1] and ids(consumed) == [2, 3]
    assert m["gen_staleness_mean"] == pytest.approx((1.0 + 0.5) / 2) and m["wait_staleness_mean"] == 1.0


@st.composite
def pools(draw):
    size = draw(st.integers(1, 4))
    pool = {}
    for g in draw(st.lists(st.integers(0, 1000), max_size=15, unique=True)):
        samples = []
        for _ in range(size):
            steps = draw(st.lists(st.integers(0, 2), max_size=12))
            start = draw(st.integers(0, 5))
            versions = [start + sum(steps[: i + 1]) for i in range(len(steps))]  # non-decreasing
            samples.append(make_sample(g, versions, draw(st.floats(0, 100))))
        pool[g] = samples
    return pool


@PROPS
@given(pools(), st.integers(1, 8), st.integers(0, 20), st.floats(0, 4), st.integers(30, 40))
def test_partition(pool, n, target, lam, version):
    original = {g: list(samples) for g, samples in pool.items()}
    consumed, rejected = take_groups_pace(pool, n, version, lam, target)
    c, r, rest = ids(consumed), rejected_ids(rejected), list(pool)
    assert sorted(c + r + rest) == sorted(original)  # a partition: nothing lost, nothing twice
    assert len(consumed) == min(n, len(original))
    assert len(rejected) == min(max(0, len(original) - target), max(0, len(original) - n))
    for grp in consumed + rejected:  # groups stay whole
        assert list(map(id, grp)) == list(map(id, original[grp[0]["group_id"]]))
    if rejected:  # every rejected group is at least as stale as every kept or consumed one
        eff = lambda grp: effective_staleness(grp, version, lam)
        kept = consumed + list(pool.values())
        assert min(map(eff, rejected)) >= max(map(eff, kept), default=float("-inf"))
