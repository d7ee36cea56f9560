"""
The trainer's pool: finished answers gather into GRPO groups, and each step takes
--prompts-per-step whole groups (Pool). Which groups, and which are dropped, is the
pool policy: `fifo` drops nothing; `pace` is our reading of PACE's abstract
(docs/course.md, "PACE, as we read it"), dropping the stalest groups when the pool
holds more than a target.

Groups are consumed in admission order, so that --max-lag is a bound (Pool.take says why).
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
    """The n groups of `pool` admitted first (lowest group ids), removed from it.
    pool: {group_id: [samples]}, complete groups only."""
    return [pool.pop(g) for g in sorted(pool)[:n]]


def reject_stalest(pool, n, version, lam, target):
    """PACE: reject up to max(0, len(pool) - target) groups, highest effective
    staleness first, never leaving fewer than n. Returns them, removed from pool."""
    # staleness has two sources (the abstract's): generation, versions that passed while an answer
    # was written, and waiting, versions that passed while it sat in the pool; effective staleness
    # is waiting + lam * generation (the paper's code was not available: this is our reading)
    n_reject = min(max(0, len(pool) - target), max(0, len(pool) - n))
    eff = {g: effective_staleness(pool[g], version, lam) for g in pool}
    worst = sorted(pool, key=lambda g: (-eff[g], _completed(pool[g])))[:n_reject]
    return [pool.pop(g) for g in worst]


def take_groups_pace(pool, n, version, lam, target):
    """reject_stalest, then the n groups admitted first among the survivors.
    Returns (consumed, rejected), lists of groups; both are removed from pool."""
    rejected = reject_stalest(pool, n, version, lam, target)
    return take_groups_fifo(pool, n), rejected


class Pool:
    """Finished answers, by group, until a step takes them. add() each answer as it
    arrives; take(version) returns (consumed, rejected) groups once the step's groups,
    the oldest not yet taken, are all complete, else None (the trainer then waits for
    more answers). `position` is the oldest group not yet consumed or rejected, and
    `done` the groups after it that are (`--pool pace` can reject a group ahead of an older one
    still being written): a checkpoint saves both, so a resumed run regenerates
    exactly the groups neither consumed nor rejected."""

    def __init__(self, cfg, position=0, done=()):
        self.cfg, self.position, self.done = cfg, position, set(done)
        self.partial, self.complete, self.rejected = {}, {}, []  # group id -> answers; rejected groups
        self.n_rejected = 0  # groups rejected since this pool started: the generator admits as many more

    def add(self, sample):
        g = self.partial.setdefault(sample["group_id"], [])
        g.append(sample)
        if len(g) == self.cfg["group_size"]:  # groups are consumed whole
            self.complete[sample["group_id"]] = self.partial.pop(sample["group_id"])

    def next_ids(self, n):
        """The n oldest groups not yet consumed or rejected (complete or not)."""
        ids, g = [], self.position
        while len(ids) < n:
            if g not in self.done:
                ids.append(g)
            g += 1
        return ids

    def take(self, version):
        """The step's groups, the oldest not yet taken, or None while one of them is being written.
        (groups, rejected): rejected, PACE's drops."""
        # in admission order, never letting later groups overtake one still being written: the
        # generator admits group g only once g < (versions loaded + max_lag + 1) x prompts_per_step
        # (engine.Generator.may_admit), so g is trained at most max_lag versions after the weights
        # that started it. AReaL and SkyRL bound admission the same way but consume in completion
        # order (a long answer overtaken can exceed the bound); TRL and prime-rl drop at consumption
        n = self.cfg["prompts_per_step"]
        ids = self.next_ids(n)
        if not all(g in self.complete for g in ids):
            return None
        if self.cfg["pool"] == "pace":  # the excess over the target goes, stalest first; then look again
            rejected = reject_stalest(self.complete, n, version, self.cfg["pace_lambda"], self.cfg["pace_target"])
            self.mark_done(grp[0]["group_id"] for grp in rejected)
            self.rejected += rejected
            self.n_rejected += len(rejected)
            if rejected:
                return self.take(version)  # needs replacements if it rejected the step's groups
        consumed = [self.complete.pop(g) for g in ids]
        self.mark_done(ids)
        rejected, self.rejected = self.rejected, []
        return consumed, rejected

    def mark_done(self, ids):
        self.done |= set(ids)
        while self.position in self.done:
            self.done.remove(self.position)
            self.position += 1


def default_target(prompts_per_step):
    """Target pool occupancy unless --pace-target says (config.fill): one step's worth of
    groups + 50% margin, rounded up, so ordinary arrival jitter never triggers a rejection."""
    return math.ceil(1.5 * prompts_per_step)


def pool_stats(consumed, rejected, pool, version):
    """Metrics for metrics.jsonl; the staleness means are over consumed samples,
    at trainer `version` (the version the step trains, before its push)."""
    samples = [s for g in consumed for s in g]
    k = max(1, len(samples))
    return dict(
        rejected_groups=len(rejected),
        rejected_tokens=sum(len(s["token_ids"]) for g in rejected for s in g),
        pool_size=len(pool),
        gen_staleness_mean=sum(generation_staleness(s) for s in samples) / k,
        wait_staleness_mean=sum(waiting_staleness(s, version) for s in samples) / k,
    )
