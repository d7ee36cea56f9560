"""
The five regimes: what happens to half-written answers when weights v+1 arrive. A regime is one class
in REGIMES (the contract below); lesson.py and the generator process (system/generator.py) drive the same ones.

| regime    | in-flight answers at the switch          | off-policy afterwards         | cost                        |
|-----------|------------------------------------------|-------------------------------|-----------------------------|
| sync      | none (one batch per version)             | nothing                       | generator idles in training |
| drain     | finish under v, then load                | each answer from one version  | idle slots while draining   |
| discard   | aborted, tokens and KV thrown away       | nothing spans versions        | discarded tokens            |
| stale     | continue: v+1 reads KV written by v      | tokens after the switch stale | none in time; stale tokens  |
| recompute | KV of prompt + partial rebuilt under v+1 | prefix tokens from v          | recomputed (prefill) tokens |
"""

# The contract (docs/fork.md adds a sixth). A regime is a class made with no arguments, once per engine, with one
# method, switch(gen, version, weights): the loop calls it between two engine steps, on every turn while
# weights `version` wait, until it returns True, which it does once it has loaded them. The in-flight rule:
# in lesson.py, switch may return False only while answers are in flight, since time there moves only by
# engine steps; a False with nothing in flight stops the lesson with a RuntimeError (in the generator
# process the real clock goes on, and the switch is asked again). What a regime may read or call, no more:
#
#   gen.load_weights(version, weights)  load them in place, between two engine steps (weights as given)
#   gen.abort_all()                     take every answer out of vLLM, freeing its KV; returns their Rollouts
#   gen.submit(rollout)                 (re)start an answer: prompt + its tokens so far are prefilled
#   gen.admitting = False/True          stop / resume admitting new prompts: the timeline shows "draining"
#                                       meanwhile, and gen.stats["gen_drain_s"] counts that time (as Drain)
#   gen.inflight                        the answers vLLM is writing now (request id -> Rollout)
#   gen.clock.now()                     the time: real in the generator process, simulated in lesson.py
#   gen.stats[key] += x                 its cost, which metrics.jsonl reports: "discarded_tokens", "gen_drain_s"
#   rollout.tokens                      the answer's tokens so far
#   rollout.restart(now)                forget them (count them first; its provenance keeps them): it starts
#                                       again from its prompt
#   rollout.kv_version = None           its KV is about to be rebuilt: the step that prefills it records the
#                                       version that wrote it and counts the rebuilt tokens (Rollout.record).
#                                       Not set, the old KV counts as kept: later tokens are flagged stale
#                                       and the clock charges no prefill
#   max_lag = k (class attribute)       the regime's own --max-lag, over the flag's (config.fill; sync: 0)
#
# Per-token bookkeeping (engine.Rollout.record) follows from these calls: a token carries the version loaded
# when it was sampled, and is flagged stale when its request's oldest KV was written by an older version.


class Sync:
    """Classic GRPO. Generate one batch with v, hand it over, wait, load v+1.

    Nothing is ever in flight at a switch: the admission bound is forced to
    max_lag = 0, so after its batch the generator sits idle until the trainer
    has trained on it and pushed v+1. Fully on-policy (lag 0), and the most
    expensive: generator and trainer never work at the same time."""

    max_lag = 0

    def switch(self, gen, version, weights):
        assert not gen.inflight, "sync admits one batch per version; nothing may be in flight"
        gen.load_weights(version, weights)
        return True


class Drain:
    """Stop admitting prompts, let the answers in flight finish under v, then
    load v+1 and resume.

    No answer spans two versions and no token reads stale KV, but answers finished
    during the drain were sampled by v alone, up to --max-lag versions behind the
    trainer when it takes them (lag, not stale KV). Cost: while
    draining, the batch shrinks as answers finish and the freed slots stay empty
    until the longest answer is done. That time is counted once, as draining: gen_drain_s
    (per step in metrics.jsonl), "draining" on the timeline; not as idle, which is time with
    nothing to write. The trainer's push blocks meanwhile (sync_s)."""

    def __init__(self):
        self.drain_start = None

    def switch(self, gen, version, weights):
        if gen.inflight:
            if self.drain_start is None:
                self.drain_start = gen.clock.now()
                gen.admitting = False  # the loop shows this as "draining" on the timeline
            return False
        if self.drain_start is not None:
            waited = gen.clock.now() - self.drain_start
            gen.stats["gen_drain_s"] += waited
            self.drain_start = None
        gen.load_weights(version, weights)
        gen.admitting = True
        return True


class Discard:
    """Abort the answers in flight, throw away their tokens and KV, and restart
    those prompts under v+1.

    Every finished answer comes from one version, with fresh KV: nothing is
    off-policy except by waiting in the pool. Cost: all tokens generated for the
    aborted answers are wasted (discarded_tokens), and long answers are the ones
    most often cut, so the surviving batch is biased towards short answers."""

    def switch(self, gen, version, weights):
        aborted = gen.abort_all()
        for r in aborted:  # thrown away now, before the load (the provenance notes when)
            gen.stats["discarded_tokens"] += len(r.tokens)
            r.restart(gen.clock.now())
        gen.load_weights(version, weights)
        for r in aborted:
            gen.submit(r)
        return True


class Stale:
    """As PipelineRL does: load v+1 between two decode steps and keep going.

    The KV cache stays as v wrote it, so every later token is sampled by v+1 attending to KV
    written by v: flagged stale. Its logprob is what that mixed computation gave, so the
    trainer's importance weights see it as it was. Cost: no compute; the price is in the
    tokens after the switch."""

    def switch(self, gen, version, weights):
        # an answer with k tokens: v wrote the KV of the prompt and tokens 1..k-1; token k was
        # sampled but not yet fed through the model, so v+1 writes its KV in the next step
        gen.load_weights(version, weights)
        return True


class Recompute:
    """As AReaL does: load v+1, then rebuild the KV of prompt + partial answer under v+1 and
    keep going. vLLM cannot overwrite a running request's KV, so the answer is aborted (its KV
    freed) and submitted again with prompt + partial answer as its prompt: one prefill under
    v+1. Its tokens keep their logprobs and versions (v sampled them). No token reads stale KV.
    Cost: that prefill per answer in flight (recomputed_tokens)."""

    def switch(self, gen, version, weights):
        aborted = gen.abort_all()
        gen.load_weights(version, weights)
        for r in aborted:
            r.kv_version = None  # its KV is about to be written by v+1: Rollout.record counts it then
            gen.submit(r)
        return True


REGIMES = {"sync": Sync, "drain": Drain, "discard": Discard, "stale": Stale, "recompute": Recompute}


def make_regime(name):
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}, expected one of {list(REGIMES)}")
    return REGIMES[name]()
