"""
Pool policies: which finished GRPO groups a trainer step consumes, and which it drops.

`fifo` consumes the groups that completed first and drops nothing. `pace` is our
reading of PACE ("Where Does Staleness Accumulate? Pool Aware Effective Staleness
Control for Asynchronous RL in LLM Post-Training"); only its abstract was available,
so the formulas below are our interpretation, not the paper's code. The idea:
staleness has two sources. *Generation staleness* is how many versions passed while
an answer was being written; *waiting staleness* is how many passed while it sat
in the pool. When the pool holds more groups than a target, the excess is a
rejection budget: drop that many groups, those with the highest effective
staleness (waiting + lam * generation) first.

What is ours, not the abstract's:
- generation staleness is prefix-aware and per token: the mean over answer tokens
  of (latest version in the answer - the token's version). An answer whose first
  token alone is old scores ~1/len, not 1: it is penalised by how much of it is
  old, weighted by how old, not merely for spanning versions.
- under `recompute` the prefix tokens still count as old: the KV rebuild fixes
  what later tokens *condition on*, but the prefix tokens were sampled, and their
  behaviour logprobs recorded, by the old weights, so they are just as off-policy
  for the importance ratio. `sample["recomputed"]` is therefore ignored here.
- waiting staleness = trainer version - latest version in the answer; an empty
  answer has no tokens to be stale, so both staleness terms are 0 for it.
- per GRPO group (groups are consumed or rejected whole): the mean over its
  samples. Ties go to the group that completed first.
- rejection never leaves fewer than the n groups the step needs, and consumption
  among the survivors is FIFO like `fifo`, so the *only* difference between
  `--pool fifo` and `--pool pace` is what gets rejected.
- the target occupancy defaults to one step's worth of groups + 50% (rounded up).
Note: waiting staleness shifts every group by the same `version`, so the ranking
itself does not depend on `version`; it matters for the logged values.
"""
import math


def _latest(sample):
    """The weights that wrote the answer's last token: its version when it finished
    (versions are non-decreasing along an answer). None for an empty answer."""
    v = sample["versions"]
    return int(v.max()) if len(v) else None


def generation_staleness(sample, version_finished=None):
    """Mean over answer tokens of (version_finished - token's version); by default
    version_finished is the latest version in the answer. 0 for an empty answer."""
    v = sample["versions"]
    if not len(v):
        return 0.0
    last = _latest(sample) if version_finished is None else version_finished
    return (last - v.double()).mean().item()


def waiting_staleness(sample, version):
    """Versions that passed between the answer's completion and trainer `version`."""
    last = _latest(sample)
    return 0.0 if last is None else float(version - last)


def effective_staleness(group, version, lam):
    """Mean over the group's samples of waiting + lam * generation staleness."""
    return sum(waiting_staleness(s, version) + lam * generation_staleness(s) for s in group) / len(group)


def _completed(group):
    return max(s["finished"] for s in group)


def take_groups_fifo(pool, n):
    """The pool policy: which finished groups this step consumes. FIFO (by the
    time a group completed). pool: {group_id: [samples]}, complete groups only."""
    ids = sorted(pool, key=lambda g: max(s["finished"] for s in pool[g]))[:n]
    return [pool.pop(g) for g in ids]


def take_groups_pace(pool, n, version, lam, target):
    """Reject up to max(0, len(pool) - target) groups, highest effective staleness
    first, never leaving fewer than n; then consume n FIFO among the survivors.
    Returns (consumed, rejected), lists of groups; both are removed from pool."""
    n_reject = min(max(0, len(pool) - target), max(0, len(pool) - n))
    eff = {g: effective_staleness(pool[g], version, lam) for g in pool}
    worst = sorted(pool, key=lambda g: (-eff[g], _completed(pool[g])))[:n_reject]
    rejected = [pool.pop(g) for g in worst]
    return take_groups_fifo(pool, n), rejected


def default_target(prompts_per_step):
    """Target pool occupancy: one step's worth of groups + 50% margin, rounded up,
    so ordinary arrival jitter never triggers a rejection."""
    return math.ceil(1.5 * prompts_per_step)


def pool_stats(consumed, rejected, pool, version):
    """Metrics for metrics.jsonl; the staleness means are over consumed samples,
    at trainer `version` (the version the step trains, before its push)."""
    samples = [s for g in consumed for s in g]
    k = max(1, len(samples))
    return dict(rejected_groups=len(rejected),
                rejected_tokens=sum(len(s["token_ids"]) for g in rejected for s in g),
                pool_size=len(pool),
                gen_staleness_mean=sum(generation_staleness(s) for s in samples) / k,
                wait_staleness_mean=sum(waiting_staleness(s, version) for s in samples) / k)
