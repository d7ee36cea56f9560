"""
The teacher-forcing study (lab/study.py) against independent computations: a plain
Hugging Face cache continuation for p_stale, and a cache-free forward of v+1 whose
upper layers get v's keys and values patched in by hooks for p_partial(k).
Tiny model, float32, CPU, ~15 s.

    .venv/bin/python -m pytest -q tests/test_study.py
"""

import copy
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab"))
import study  # noqa: E402

TOL = 1e-4  # float32 log-probs computed along different paths (cache vs none, spliced vs not)


@pytest.fixture(scope="module")
def setup():
    """(old, new, samples): v = the tiny model, v+1 = v with noise of 0.1 x each tensor's
    std (far enough that stale and fresh differ clearly), a few answers sampled from v."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data import load_problems
    from config import model_path

    torch.set_num_threads(1)  # tiny ops; more threads only spin against other processes on the cores
    torch.manual_seed(0)
    cfg = study.parse_config(["--prompts", "2", "--group-size", "2", "--max-new-tokens", "64"])
    path = model_path("tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 * p.std().nan_to_num(0.0) + 1e-3))
        problems = load_problems("synth", "train", n=2, steps=8)
        samples = study.sample_answers(old, tokenizer, problems, cfg, "cpu")
    samples = [s for s in samples if len(s["token_ids"]) >= 4]
    assert samples, "the tiny model wrote no answer of 4+ tokens"
    return old, new, samples


def switches(s):
    n = len(s["token_ids"])
    return [1, n // 2, n - 1]  # right after the prompt, the middle, only the last token after it


@torch.no_grad()
def hf_stale(old, new, s, sw):
    """What the stale regime computes (helpers.hf_stale_logprobs, full vocab): v runs
    over prompt + a_:s-1 and keeps its cache, v+1 feeds a_{s-1}.. reading it. No splicing."""
    P, n = len(s["prompt_ids"]), len(s["token_ids"])
    ids = torch.cat([s["prompt_ids"], s["token_ids"]]).long()[None]
    cache = old(ids[:, : P + sw - 1], use_cache=True).past_key_values
    return torch.log_softmax(new(ids[:, P + sw - 1 : P + n - 1], past_key_values=cache).logits[0], -1)


@torch.no_grad()
def patched(old, new, s, sw, k):
    """p_partial(k) without any cache: one forward of v+1 over the whole sequence in which
    layers >= k see v's keys and values at the m = P+s-1 prefix positions. Keys are swapped
    at k_norm's output, before RoPE, which both models apply identically."""
    P, n = len(s["prompt_ids"]), len(s["token_ids"])
    ids = torch.cat([s["prompt_ids"], s["token_ids"]]).long()[None]
    m, caught, hooks = P + sw - 1, {}, []

    def catch(key):
        def hook(mod, inp, out):  # k_norm: (1, T, kv_heads, head_dim); v_proj: (1, T, kv_heads * head_dim)
            caught[key] = out

        return hook

    def swap(key):
        def hook(mod, inp, out):
            out = out.clone()
            out[:, :m] = caught[key][:, :m]
            return out

        return hook

    for i, layer in enumerate(old.model.layers):
        hooks += [
            layer.self_attn.k_norm.register_forward_hook(catch(("k", i))),
            layer.self_attn.v_proj.register_forward_hook(catch(("v", i))),
        ]
    old(ids)
    for i, layer in list(enumerate(new.model.layers))[k:]:
        hooks += [
            layer.self_attn.k_norm.register_forward_hook(swap(("k", i))),
            layer.self_attn.v_proj.register_forward_hook(swap(("v", i))),
        ]
    try:
        logits = new(ids).logits[0, m : P + n - 1]  # positions that feed a_{s-1}..a_{n-2}
    finally:
        for h in hooks:
            h.remove()
    return torch.log_softmax(logits, -1)


def close(a, b):
    return (a - b).abs().max().item()


def test_ends_of_the_grid(setup):
    """k = L is the full recompute, k = 0 the stale cache; and the two really differ."""
    old, new, samples = setup
    L = old.config.num_hidden_layers
    gap = 0.0
    for s in samples:
        for sw in switches(s):
            lp = study.switch_logprobs(old, new, s["prompt_ids"], s["token_ids"], sw, range(L + 1), "cpu")
            assert close(lp[L], lp["fresh"]) < TOL
            assert close(lp[0], lp["stale"]) == 0
            assert lp["fresh"].shape == (len(s["token_ids"]) - sw, old.config.vocab_size)
            gap = max(gap, close(lp["stale"], lp["fresh"]))
    assert gap > 1e-2, "stale and fresh agree: the perturbation is too small to test anything"


def test_stale_matches_plain_cache_continuation(setup):
    """p_stale from the spliced whole-sequence caches == v+1 continuing v's own prefix cache,
    at the switch position (the first row) and every position after it."""
    old, new, samples = setup
    for s in samples:
        for sw in switches(s):
            lp = study.switch_logprobs(old, new, s["prompt_ids"], s["token_ids"], sw, [0], "cpu")
            assert close(lp["stale"], hf_stale(old, new, s, sw)) < TOL


def test_partial_matches_patched_forward(setup):
    """Every k in 0..L against the cache-free hooked forward of v+1."""
    old, new, samples = setup
    L = old.config.num_hidden_layers
    for s in samples:
        for sw in switches(s):
            lp = study.switch_logprobs(old, new, s["prompt_ids"], s["token_ids"], sw, range(L + 1), "cpu")
            for k in range(L + 1):
                assert close(lp[k], patched(old, new, s, sw, k)) < TOL, f"k={k}, s={sw}"


def test_identical_weights_give_zero_kl(tmp_path):
    """End to end with lr 0 (v+1 == v): every KL is 0 and the JSON and PNG are written."""
    out = tmp_path / "study.json"
    study.main(["--prompts", "2", "--group-size", "4", "--max-new-tokens", "48", "--lr", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    assert os.path.exists(tmp_path / "study.png")
    n = res["positions"]
    assert n > 0 and res["kl_per_token_per_step"] < 1e-6
    for b in res["bins"]:
        assert b["kl_fresh_old"] < 1e-6 * max(1, b["tokens"]) and b["kl_fresh_stale"] < 1e-6 * max(1, b["tokens"])
    for p in res["partial"]:
        assert p["kl_fresh_partial"] < 1e-6 * n


def test_record_appends_what_the_run_printed_once(tmp_path, monkeypatch):
    """--record: the run's summary becomes one line of lab/data/study.jsonl (here a file in
    tmp_path) and the pages' study tables are rewritten; recording the same run again adds
    nothing; the tables read plain `python lab/study.py --seed S` runs only, not this 2-prompt one."""
    import marked

    monkeypatch.setattr(marked, "data_path", lambda tool: str(tmp_path / f"{tool}.jsonl"))
    written = []
    write = lambda tables, values=(), **kw: written.append([*sorted(tables), *sorted(values)]) or []  # noqa: E731
    monkeypatch.setattr(marked, "write", write)
    flags = ["--prompts", "2", "--group-size", "4", "--max-new-tokens", "48", "--seed", "3"]
    res = study.main([*flags, "--out", str(tmp_path / "study.json"), "--record"])
    (line,) = map(json.loads, open(tmp_path / "study.jsonl"))
    assert (line["seed"], line["prompts"], line["answers"]) == (3, 2, res["answers"])
    assert line["undone_first8"] == res["bins"][0]["share_undone"] is not None
    assert line["undone_after32"] == res["bins"][-1]["share_undone"]
    assert line["removed"] == {str(p["k"]): p["share_removed"] for p in res["partial"]}
    assert written == [["study-tiny", *sorted(study.VALUES)]]  # its table, and the README's values
    study.record(res)
    assert len(open(tmp_path / "study.jsonl").readlines()) == 1
    assert study.tiny_runs() == []
