"""
Graders of the exercises (tools/exercise.py) worked by hand, each in well under a second:
the cases the wrong answers in tests/exercise_mutants.py get wrong (a group of 2, a group
whose rewards are all equal, provenance notes, the admission bound's every term, PACE's
ties), as numbers written here, not computed by the code under test.

    .venv/bin/python -m pytest -q tests/test_graders.py
"""

import math
from types import SimpleNamespace

import pytest
import torch

import engine
import grpo
import losses
from pool import reject_stalest
import regimes

pytestmark = pytest.mark.fast


def test_advantages_of_a_group_of_two_and_of_equal_rewards():
    """A group of 2 (1, 0): mean 0.5, unbiased std sqrt(0.5), so +-0.5 / (0.70711 + 1e-4);
    a group of 3 equal rewards (0.3 each): std 0, advantages 0, not 0/0. Rewards' shape and dtype."""
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # 0.70700...
    adv = grpo.advantages(torch.tensor([1.0, 0.0, 0.25, 0.25]), 2)
    assert adv.shape == (4,) and adv.tolist() == pytest.approx([a, -a, 0.0, 0.0], abs=1e-6)
    assert adv.dtype == torch.float32, f"advantages in {adv.dtype}: the task asks for the rewards' dtype, float32"
    adv = grpo.advantages(torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.5]), 3)  # mean 0.5, std 0.5
    b = 0.5 / (0.5 + 1e-4)
    assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0, b, -b, 0.0], abs=1e-6)


def test_record_by_hand():
    """One answer (a 3-token prompt) through a prefill under v0, a token under v0, a stale
    token under v1 (a switch that kept the KV), then a recompute (kv_version reset) and a
    token under v2: its tokens, versions, stale flags, rebuild count and provenance."""
    r = engine.Rollout(0, 0, 0, [1, 2, 3], 10, now=0.0)
    assert r.record([5], [-0.1], 0, 0, 0.0, 1.0) == 0  # the prompt's prefill: nothing rebuilt
    assert r.record([6, 9], [-0.2, -0.25], 0, 1, 1.0, 2.0) == 0  # two tokens in one step
    assert r.record([7], [-0.3], 1, 2, 2.0, 3.0) == 0  # v1 reads the KV v0 wrote: stale
    r.kv_version = None  # what Recompute.switch does
    assert r.record([8], [-0.4], 2, 5, 5.0, 6.0) == 7  # prompt 3 + partial answer 4 prefilled again
    assert (r.tokens, r.logprobs, r.versions, r.stale) == (
        [5, 6, 9, 7, 8],
        [-0.1, -0.2, -0.25, -0.3, -0.4],
        [0, 0, 0, 1, 2],
        [False, False, False, True, False],
    )
    assert r.recomputed == 7 and r.kv_version == 2
    assert r.prefills == [[0.0, 1.0, 0, 3, "prompt"], [5.0, 6.0, 2, 7, "recompute"]]
    assert r.segments == [[0.0, 2.0, 0, 3, False], [2.0, 3.0, 1, 1, True], [5.0, 6.0, 2, 1, False]]


class FakeGenerator:
    """What Recompute.switch may call, each call written down. A wrong call (one the real
    Generator does not have) fails with an AssertionError that names it, not an AttributeError."""

    def __init__(self, answers):
        self.answers, self.calls, self.stats = answers, [], dict(discarded_tokens=0)
        self.clock = SimpleNamespace(now=lambda: 9.0)
        self.inflight = {r.request_id: r for r in answers}

    def abort_all(self):
        self.calls.append("abort")
        return list(self.answers)

    def load_weights(self, version, weights):
        self.calls.append(("load", version, weights))

    def submit(self, r):
        self.calls.append(("submit", r))

    def __getattr__(self, name):
        raise AssertionError(f"Recompute.switch used gen.{name}, which the task does not give it")


def test_recompute_switch_by_hand():
    """Abort and load v+1 (in either order: nothing steps in between), then submit each answer
    again, once, in any order, with its tokens, logprobs and versions kept; by the time the
    switch returns (the engine steps next, nothing runs in between) each has kv_version None,
    so that record counts the prefill as a rebuild. Returns True."""
    answers = []
    for i in range(2):
        r = engine.Rollout(i, 0, 0, [1, 2], 10, now=0.0)
        r.record([5 + i, 6], [-0.5, -0.6], 0, 0, 0.0, 1.0)
        answers.append(r)
    gen = FakeGenerator(answers)
    assert regimes.Recompute().switch(gen, 1, "w1") is True
    assert "abort" in gen.calls[:2] and ("load", 1, "w1") in gen.calls[:2], gen.calls
    submitted = [c[1] for c in gen.calls[2:]]
    assert all(c[0] == "submit" for c in gen.calls[2:]) and sorted(r.sample_id for r in submitted) == [0, 1]
    assert all(r.kv_version is None for r in answers)
    assert [(r.tokens, r.versions, r.logprobs) for r in answers] == [
        ([5, 6], [0, 0], [-0.5, -0.6]),
        ([6, 6], [0, 0], [-0.5, -0.6]),
    ]
    assert gen.stats["discarded_tokens"] == 0 and [r.discarded for r in answers] == [[], []]


def generator(**kw):
    """An engine.Generator with the state may_admit reads, and every other attribute its
    __init__ sets (so any reading of the task finds what a real one has), without an engine
    (the task gives the KV cache's room as kv_answers): version 3, max_lag 1, 2 groups a step
    (budget (3 + 1 + 1) x 2 = 10), group 8 next."""
    gen = engine.Generator.__new__(engine.Generator)
    cfg = dict(
        max_lag=1, prompts_per_step=2, group_size=4, max_num_seqs=8, temperature=1.0, max_new_tokens=8, max_model_len=64
    )
    gen.__dict__.update(
        cfg=dict(cfg, **kw.pop("cfg", {})),
        engine=None,
        outbox=[],
        clock=engine.WallClock(),
        receive=None,
        prompts=[[1, 2]] * 4,
        answers=["1"] * 4,
        params=None,
        inflight={},
        admitting=True,
        version=3,
        next_group=8,
        stats={},
        kv_answers=8,
        activity=None,
        steps=0,
        eval_out={},
    )
    gen.__dict__.update(kw)
    return gen


def may_admit(**kw):
    return engine.Generator.may_admit(generator(**kw))


def test_max_lag_admission_bound_by_hand():
    """Budget (3 + 1 + 1) x 2 = 10 groups: group 9 may start, 10 may not; each term moves
    it (the version, max_lag + 1, the groups a step, budget_offset)."""
    assert may_admit(next_group=9) and not may_admit(next_group=10)
    assert may_admit(next_group=12, budget_offset=3) and not may_admit(next_group=13, budget_offset=3)  # budget 13
    assert may_admit(next_group=11, version=4) and not may_admit(next_group=12, version=4)  # budget 12
    lag0 = dict(cfg=dict(max_lag=0))
    assert may_admit(next_group=7, **lag0) and not may_admit(next_group=8, **lag0)  # budget 8
    lag2 = dict(cfg=dict(max_lag=2, prompts_per_step=3))
    assert may_admit(next_group=17, **lag2) and not may_admit(next_group=18, **lag2)  # budget (3 + 2 + 1) x 3 = 18
    assert not may_admit(admitting=False)


def test_max_lag_kv_cache_by_hand():
    """Only while the KV cache has room for one more group of 4 next to those in flight;
    the lesson's outbox has no bound (it is emptied every turn)."""
    assert may_admit(inflight=dict.fromkeys(range(4))) and not may_admit(inflight=dict.fromkeys(range(5)))
    assert not may_admit(kv_answers=3)
    assert may_admit(outbox=list(range(500)))


def group(group_id, versions, finished):
    """Two samples of one group, generated under `versions`, the last finishing at `finished`."""
    return [
        dict(
            group_id=group_id,
            token_ids=torch.arange(len(versions), dtype=torch.int32),
            versions=torch.tensor(versions, dtype=torch.int32),
            stale=torch.zeros(len(versions), dtype=torch.bool),
            recomputed=0,
            finished=finished - 0.1 * i,
            submitted=0.0,
        )
        for i in range(2)
    ]


def test_pace_breaks_ties_by_completion():
    """Four groups of equal effective staleness, completed in the order 2, 3, 0, 1 (not
    their ids'): target 2 rejects two, the two completed first, and leaves the others."""
    pool = {g: group(g, [1, 1], finished) for g, finished in ((0, 3.0), (1, 4.0), (2, 1.0), (3, 2.0))}
    rejected = reject_stalest(pool, 1, 2, 0.5, 2)
    assert sorted(g[0]["group_id"] for g in rejected) == [2, 3] and sorted(pool) == [0, 1]


def test_pace_reject_by_hand():
    """Effective staleness at version 4, lam 0.5: group 0 (v3, waiting 1) 1, group 1 (v1,
    generation 0, waiting 3) 3, group 2 (tokens of v0 and v2: waiting 2, generation
    (2 + 0)/2 = 1) 2.5: over target 1 with n 2, one goes, group 1; with n 1, two."""

    def pool():
        return {0: group(0, [3, 3], 1.0), 1: group(1, [1, 1], 2.0), 2: group(2, [0, 2], 3.0)}

    p = pool()
    assert sorted(g[0]["group_id"] for g in reject_stalest(p, 2, 4, 0.5, 1)) == [1] and sorted(p) == [0, 2]
    p = pool()
    assert sorted(g[0]["group_id"] for g in reject_stalest(p, 1, 4, 0.5, 1)) == [1, 2] and sorted(p) == [0]
    p = pool()
    assert reject_stalest(p, 1, 4, 0.5, 3) == [] and sorted(p) == [0, 1, 2]


def test_icepop_reports_a_masked_token_that_ppo_does_not_clip():
    """Two tokens at pi = pi_old (PPO's clip cannot bind), A = +1: k = pi_old/mu = 10 is
    outside [0.5, 5], masked (loss 0, gradient 0, reported); k = 2 inside: loss -2, gradient -2."""
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    mu = logp.detach() - torch.tensor([10.0, 2.0], dtype=torch.float64).log()
    cfg = dict(clip_eps=0.2, icepop_low=0.5, icepop_high=5.0)
    per_token, clipped = losses.loss_icepop(
        cfg, logp, logp.detach(), mu, torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([0, 0])
    )
    per_token.sum().backward()
    assert per_token.tolist() == pytest.approx([0.0, -2.0]) and logp.grad.tolist() == pytest.approx([0.0, -2.0])
    assert clipped.tolist() == [True, False]
