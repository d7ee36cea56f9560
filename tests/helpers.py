"""
What several test files share: plain functions and constants, imported by name
(`from helpers import start, collect`). No test module imports another
(tests/test_layout.py checks it): what two of them need lives here.

- processes: a generator process as train.py starts it, its samples, train.py runs;
- the independent references: Hugging Face's model and its logprobs, perturbed weights;
- the forced weight switch on a shared in-process engine (test_regimes.py, test_native.py);
- the checks test_smol.py repeats on SmolLM2: the weight sync, stale and recompute;
- the trainer's step on a small model (test_train.py, test_ranks.py);
- the run directory's contract (test_smoke.py, test_smol.py, test_ranks.py);
- the project's import graph (test_layout.py, test_lesson.py), and the first sitting of the course.
"""

import ast
import glob
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# processes: the generator process, train.py


def start(regime, *extra, tmp=None, **overrides):
    """A generator process as train.py starts it; returns (handle, cfg). overrides:
    settings train.py refuses (temperature 0: greedy answers to compare with HF's). Its
    directory (stack file): out/test, one per pytest-xdist worker."""
    tmp = tmp or "out/test" + os.environ.get("PYTEST_XDIST_WORKER", "")
    from system.devices import prepare
    from system.handle import GeneratorHandle
    from train import parse_config

    cfg = dict(parse_config(["--regime", regime, "--out", tmp, *extra]), **overrides)
    cores = os.sched_getaffinity(0)
    envs = prepare(cfg)  # pins this process to the trainer's half of the cores...
    os.sched_setaffinity(0, cores)  # ...which later tests and their subprocesses would inherit
    return GeneratorHandle(cfg, envs), cfg


def collect(gen, n, timeout=120):
    """The next n finished samples (events are skipped)."""
    out = []
    while len(out) < n:
        msg = gen.get(timeout)
        assert msg is not None, f"no sample within {timeout}s"
        if msg[0] == "sample":
            out.append(msg[1])
    return out


def train(*args, timeout=600):
    """train.py to its end, as a user runs it from the repository root; it must succeed."""
    r = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def wait_for(proc, prefix, timeout=300):
    """Read train.py's stdout up to a line that starts with `prefix`."""
    t0 = time.time()
    for line in proc.stdout:
        if line.startswith(prefix):
            return
        assert time.time() - t0 < timeout
    raise AssertionError(f"train.py ended before {prefix!r}: " + proc.stderr.read()[-3000:])


# -----------------------------------------------------------------------------
# the independent references: Hugging Face transformers


def hf_model(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        cfg["model_path"], dtype=torch.float32, attn_implementation="eager"
    ).eval()


def perturbed(model, seed, scale=0.5):
    """A copy of the weights with noise of `scale` x each tensor's std: far enough
    from the original that a tensor the sync misses shows up in the logprobs."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in model.state_dict().items():
        noise = torch.randn(v.shape, generator=g) * (v.float().std().nan_to_num(0.0) * scale + 1e-3)
        sd[k] = (v + noise).to(v.dtype)
    return sd


@torch.no_grad()
def hf_logprobs(model, prompt_ids, token_ids, temperature=1.0):
    """log p(token_j | prompt, tokens_<j) for every answer token, teacher-forced,
    from the logits over `temperature` (what vLLM samples from)."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    P = len(prompt_ids)
    return logp[P - 1 : -1].gather(-1, torch.tensor(token_ids)[:, None].long())[:, 0]


@torch.no_grad()
def hf_stale_logprobs(old, new, prompt, tokens, k, temperature):
    """What the stale regime computes: KV of prompt + tokens[:k-1] written by `old`
    (token k-1 was sampled by old but not yet fed through the model), then `new`
    feeds tokens[k-1:] attending to that cache. Returns logprobs of tokens[k:]."""
    ctx = torch.tensor([prompt + tokens[: k - 1]])
    cache = old(ctx, use_cache=True).past_key_values
    logits = new(torch.tensor([tokens[k - 1 :]]), past_key_values=cache, use_cache=True).logits[0, :-1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(tokens[k:])[:, None])[:, 0]


# -----------------------------------------------------------------------------
# a weight switch at a fixed engine step, on an engine in this process (the
# Generator and the regimes as lesson.py drives them; tests/test_regimes.py says how)

T = 0.7  # not 1: every reference must divide the logits by the sampling temperature, as vLLM does
LONG = (
    "--synth-steps",
    "8",
    "--max-new-tokens",
    "96",
    "--group-size",
    "4",
    "--prompts-per-step",
    "4",
    "--temperature",
    str(T),
)
ENGINES = {}  # model -> the engine the tests share

# the lesson's runs in tests (test_lesson.py, test_fork.py): 6 steps of 4 groups of 4 long answers, every
# push landing while answers are being written; a test's own flags come after and win
LESSON_ARGS = ("--preset", "long", "--steps", "6", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0")
LESSON_ARGS += ("--no-plot",)
LESSON_ENGINES = {}  # what the engine depends on -> the engine lesson.main reuses (its `engine`)


def lesson_engine(args):
    """The engine for lesson runs with these flags, shared by every test in this process that asks for the
    same model, lengths, batch and seed: a run loads its starting weights and seeds torch's generator
    itself, so a reused engine gives what a new one would."""
    import lesson
    from engine import make_engine

    cfg = lesson.parse_config([*args, "--out", "-"])
    key = tuple(cfg[k] for k in ("model_path", "max_model_len", "max_num_seqs", "seed"))
    if key not in LESSON_ENGINES:
        LESSON_ENGINES[key] = make_engine(cfg)
    return LESSON_ENGINES[key]


def generator(regime, *args, process=False):
    """A Generator on the shared engine, its regime and its outbox, as lesson.py makes them
    (process: the generator process's ProcessGenerator, its receive set by the test)."""
    from transformers import AutoTokenizer
    from data import load_problems
    from engine import Generator, make_engine
    from system.generator import ProcessGenerator
    from lesson import parse_config
    from regimes import make_regime

    cfg = parse_config(["--regime", regime, *LONG, "--max-lag", "1", *args])
    regime = make_regime(regime)  # cfg["max_lag"]: the regime's (config.fill: sync's is 0)
    if cfg["model"] not in ENGINES:
        ENGINES[cfg["model"]] = make_engine(cfg)
    outbox = []
    parts = (
        cfg,
        ENGINES[cfg["model"]],
        load_problems("synth", "train", n=64, steps="8"),
        AutoTokenizer.from_pretrained(cfg["model_path"]),
        outbox,
    )
    gen = ProcessGenerator(*parts, receive=None) if process else Generator(*parts)
    return gen, regime, outbox, cfg


def run_with_switch(regime, n=32, model_args=(), at_step=20):
    """Admit, take `at_step` engine steps under v0 (sync: its whole batch), switch to
    perturbed weights v1 through the regime, then write every answer admitted before
    v2 would be needed. Returns (the first n samples, old HF model, new HF model, stats)."""
    from engine import load_in_place
    from engine import as_tensors

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


# -----------------------------------------------------------------------------
# the checks the tiny model's tests run and tests/test_smol.py repeats on SmolLM2
# (`model_args`: --model smol; `tol`: its looser tolerance)


def check_sync_is_exact(model_args=(), tol=1e-3, posted=True):
    """tests/test_generator.py::test_sync_is_exact: push perturbed weights, generate
    greedily under them: vLLM's tokens and logprobs equal the HF model's. posted: the second
    push overlapped with a training step (the tiny model's test; the mechanism is the same for
    every model, so test_smol.py spares its 30 layers the step)."""
    gen, cfg = start(
        "sync",
        "--prompts-per-step",
        "4",
        "--synth-steps",
        "3",
        "--max-new-tokens",
        "48",
        *model_args,
        temperature=0.0,
        group_size=1,
    )
    try:
        model = hf_model(cfg)
        eos = model.generation_config.eos_token_id  # tiny: 0; SmolLM2: <|im_end|>
        collect(gen, 4)  # the batch of version 0

        # 1. the wrong push: named_parameters() skips the tied lm_head.weight
        bad = perturbed(model, seed=1)
        model.load_state_dict(bad)
        gen.push({k: v for k, v in model.named_parameters()})
        diffs = [
            (hf_logprobs(model, s["prompt_ids"].tolist(), s["token_ids"].tolist()) - s["logprobs"]).abs().max()
            for s in collect(gen, 4)
        ]
        assert max(diffs) > 1e-2, f"a push without lm_head.weight went unnoticed (max diff {max(diffs):.2e})"

        # 2. the right push: the whole state_dict; twice (the receiver keeps nothing
        # between pushes: a second one must not depend on the first). The second as train.py
        # pushes: posted without waiting, through a send budget far below the model (so the
        # trainer waits for its oldest sends), while the next step (grpo.step) runs its
        # forward and backward on the very tensors in flight, settles, and then moves them
        # with an AdamW step. settle() held the checksums of what arrived against what was
        # sent, bit for bit; the answers must come from the weights as they were pushed.
        for version in (2, 3):
            model.load_state_dict(perturbed(model, seed=version))
            if version == 2 or not posted:
                assert gen.push(model.state_dict()) == version
                batch = collect(gen, 4)
            else:
                pushed = {k: v.clone() for k, v in model.state_dict().items()}
                gen.send_budget = 64 * 2**10
                assert gen.push(model.state_dict(), wait=False) == version
                overlap_a_step(cfg, model, batch, settle=gen.settle)
                assert not gen.pushing()
                assert any(not torch.equal(v, pushed[k]) for k, v in model.state_dict().items()), "no weight moved"
                model.load_state_dict(pushed)  # what the engine must hold
                batch = collect(gen, 4)
            for s in batch:
                prompt = s["prompt_ids"].tolist()
                greedy = model.generate(
                    torch.tensor([prompt]), do_sample=False, max_new_tokens=48, pad_token_id=eos, eos_token_id=eos
                )[0, len(prompt) :].tolist()
                assert s["token_ids"].tolist() == greedy, "vLLM's greedy answer differs from HF's"
                ref = hf_logprobs(model, prompt, s["token_ids"].tolist())
                assert (ref - s["logprobs"]).abs().max() < tol
                assert s["versions"].tolist() == [version] * len(greedy)

        # 3. the guard can fail, both ways. (a) A tensor changes while its push is in flight
        # (an optimizer step before settle): one sign bit of the first tensor, flipped in place
        # once the push is posted; its version counter shows it, whenever the bytes went out.
        import system.push

        sd = model.state_dict()
        gen.push(sd, wait=False)
        with torch.no_grad():
            next(iter(sd.values())).view(-1)[1].neg_()
        with pytest.raises(RuntimeError, match="changed before it was acknowledged"):
            gen.settle()
        collect(gen, 4)  # sync: the batch of that version, before the next push
        # (b) What arrived is not what was sent: one bit changed on the way. The sender's
        # checksum is taken of the first tensor with its sign bit flipped (as if that bit had
        # flipped in transit): the engine's checksum of what arrived must differ from it.
        real = system.push.checksum

        def flipped_on_the_way(t):
            if not flipped:
                flipped.append(t)
                t = t.clone()
                t.view(-1)[1].neg_()
            return real(t)

        flipped = []
        system.push.checksum = flipped_on_the_way  # the push's checksum thread calls it
        try:
            gen.push(model.state_dict(), wait=False)
            with pytest.raises(RuntimeError, match="are not the ones sent"):
                gen.settle()
        finally:
            system.push.checksum = real
    finally:
        gen.stop()


def overlap_a_step(cfg, model, batch, settle):
    """train.py's next step while a push is in flight: grpo.step on `batch` (its
    forward and backward, then settle(), then an AdamW step at a learning rate that moves
    every weight), as train.py's loop calls it."""
    import grpo

    adv = torch.tensor([1.0, -1.0] * (len(batch) // 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    step_cfg = dict(cfg, lr=1e-2, warmup_steps=0, lr_schedule="constant", temperature=1.0)
    grpo.step(step_cfg, model, opt, 1, [(batch, adv, grpo.token_weights(step_cfg, batch), 0)], "cpu", settle=settle)


def check_stale_reads_old_kv(model_args=(), tol=1e-3, n=32):
    """tests/test_regimes.py::test_stale_reads_old_kv: after the switch, the stale
    regime's logprobs are HF's continuation of the old KV, not a full recompute."""
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


def check_recompute_rebuilds_kv(model_args=(), tol=1e-3, n=32):
    """tests/test_regimes.py::test_recompute_rebuilds_kv: after the switch, the
    recompute regime's logprobs are HF's full recompute, not the stale continuation."""
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


# -----------------------------------------------------------------------------
# the trainer's step on a small model (no vLLM)


def small_model(vocab=97, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")


def batch_of(lengths, vocab=97, seed=1):
    """Answers of very different lengths after prompts of different lengths."""
    g = torch.Generator().manual_seed(seed)
    return [
        dict(
            prompt_ids=torch.randint(vocab, (5 + i % 7,), generator=g),
            token_ids=torch.randint(vocab, (n,), generator=g),
        )
        for i, n in enumerate(lengths)
    ]


def with_logprobs(batch):
    for s in batch:
        s["logprobs"] = torch.randn(len(s["token_ids"]), generator=torch.Generator().manual_seed(5)) - 4.6
    return batch


LOSS_CFG = dict(
    is_cap=2.0,
    clip_eps=0.2,
    icepop_low=0.5,
    icepop_high=5.0,
    geo_threshold=1.001,
    cispo_eps_low=1.0,
    cispo_eps_high=4.0,
    gspo_eps_low=3e-4,
    gspo_eps_high=4e-4,
)  # config.py's defaults

# -----------------------------------------------------------------------------
# the run directory against its contract (system/runlog.py's docstring)

METRIC_KEYS = {
    "step",
    "wall_s",
    "version",
    "reward_mean",
    "loss",
    "trained_tokens",
    "stale_token_frac",
    "lag_mean",
    "spanning_frac",
    "gen_tok_per_s",
    "sync_s",
    "trainer_wait_s",
    "gen_idle_s",
    "gen_drain_s",
    "discarded_tokens",
    "recomputed_tokens",
    "ess",
    "clipped_frac",
    "kl",
    "kl_stale",
    "kl_fresh",
}
ACTIVITIES = {
    "starting",
    "generating",
    "draining",
    "loading",
    "idle",
    "evaluating",
    "training",
    "syncing",
    "waiting",
    "saving",
    "done",
    "stopped",
}


def read(run, name):
    with open(os.path.join(run, name)) as f:
        return [json.loads(line) for line in f]


def check_engines(run, n):
    """The run's processes are the trainer and its n engines; with several engines, each
    wrote answers, and engine i only the groups i mod n."""
    assert {e["proc"] for e in read(run, "events.jsonl")} == {
        "trainer",
        *(["generator"] if n == 1 else [f"generator{i}" for i in range(n)]),
    }
    if n > 1:
        answers = read(run, "answers.jsonl")
        assert {a["engine"] for a in answers} == set(range(n))
        assert all(a["group_id"] % n == a["engine"] for a in answers)


def check_run(run, regime, steps):
    """The run directory against its contract (system/runlog.py), and the regime's invariants
    against its metrics (test_smoke.py, test_smol.py and test_ranks.py check their runs with it)."""
    assert not [f for f in os.listdir(run) if f.endswith("-stack.txt")], "a stack file no stall asked for"
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["regime"] == regime and cfg["steps"] == steps
    metrics = [m for m in read(run, "metrics.jsonl") if m["step"] > 0]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert METRIC_KEYS <= set(m), METRIC_KEYS - set(m)
        assert m["trained_tokens"] > 0 and 0 <= m["reward_mean"] <= 1 and 0 <= m["boxed_frac"] <= 1
        assert 0 <= m["truncated_frac"] <= 1 and 0 <= m["loss_tokens"] <= m["trained_tokens"]
        assert m["lag_max"] <= cfg["max_lag"]  # config.json: what the run used (sync: 0)
    if cfg["eval_every"]:  # (tools/gpu_check.py's runs evaluate nothing)
        assert "eval_acc" in metrics[-1] and "eval_acc" in read(run, "metrics.jsonl")[0]
        evals = read(run, "eval_answers.jsonl")  # every evaluation's answers, graded as eval_acc counts them
        for m in read(run, "metrics.jsonl"):
            if "eval_acc" in m:
                mine = [a for a in evals if a["step"] == m["step"]]
                assert len(mine) == cfg["eval_n"] and sum(a["right"] for a in mine) / len(mine) == m["eval_acc"]
    # an evaluation measures the weights pushed after its step: eval_version = version + 1
    assert all(m["eval_version"] == m["version"] + 1 for m in metrics if "eval_acc" in m)
    assert [m["version"] for m in metrics] == list(range(steps))
    events = read(run, "events.jsonl")
    n = cfg.get("engines", 1)
    check_engines(run, n)
    assert {e["what"] for e in events if "what" in e} <= ACTIVITIES  # the others are marks (plot.py)
    assert any(e.get("what") == "loading" for e in events)
    for proc in {e["proc"] for e in events} - {"trainer"}:  # each engine loads each version once, in order
        loads = [e["version"] for e in events if e.get("mark") == "load" and e["proc"] == proc]
        assert loads and loads == list(range(1, len(loads) + 1))  # (the last may not have been read)
    # the wasted-work ledger and answers.jsonl agree with metrics.jsonl
    led = json.load(open(os.path.join(run, "ledger.json")))["tokens"]
    answers = read(run, "answers.jsonl")
    assert len(answers) == steps * cfg["prompts_per_step"] * cfg["group_size"]
    assert all(a["fate"] == "consumed" for a in answers)
    assert sum(a["tokens"] for a in answers) == led["trained"] == sum(m["trained_tokens"] for m in metrics)
    assert led["generated"] == led["trained"] + led["discarded"] + led["rejected"] + led["left_over"]
    assert led["left_over"] >= 0
    ckpt = os.path.join(run, "ckpt")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"):
        assert os.path.exists(os.path.join(ckpt, f)), f
    # the regime's invariants, as the metrics show them: what it never has (ZERO; a regime of your own: its row)
    for key in ZERO.get(regime, ()):
        assert all(m[key] == 0 for m in metrics), (regime, key)
    if regime == "recompute" and not cfg["no_plot"]:
        assert os.path.exists(os.path.join(run, "run.png"))


NEVER = ("stale_token_frac", "discarded_tokens", "recomputed_tokens")  # no stale KV read, nothing wasted or rebuilt
ZERO = {  # regime: the metrics that stay 0 in every step of its runs
    "sync": ("lag_mean", "spanning_frac", *NEVER),  # one batch per version
    "drain": ("spanning_frac", *NEVER),  # each answer from one version
    "discard": ("spanning_frac", "stale_token_frac", "recomputed_tokens"),
    "stale": ("discarded_tokens", "recomputed_tokens"),
    "recompute": ("stale_token_frac", "discarded_tokens"),
}


# -----------------------------------------------------------------------------
# the project's import graph (ast: nothing is imported to read it)


def project_modules():
    """{module name: path}: the course at the root (lesson, train, ...), the system
    (system.handle, ...), the tools (tools.x) and the lab (lab.x)."""
    mods = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
    for room in ("system", "tools", "lab"):
        rooms = glob.glob(os.path.join(ROOT, room, "*.py"))
        mods.update({f"{room}.{os.path.basename(p)[:-3]}": p for p in rooms if not p.endswith("__init__.py")})
    return mods


def imports(path, mods):
    """The project modules `path` imports anywhere in it (functions included: a lazy
    import still makes a circle). A tool or a lab script imports its neighbours by their
    bare names (its folder is on its path): `import marked` in lab/ is lab.marked."""
    room = os.path.basename(os.path.dirname(path))
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if room in ("tools", "lab"):
            names += [f"{room}.{n}" for n in names]
        found |= {n for n in names if n in mods}
    return found


def graph():
    """{project module: the project modules it imports}, test_smoke.py left out."""
    mods = project_modules()
    return {m: imports(p, mods) - {m} for m, p in mods.items() if not os.path.basename(p).startswith("test_")}


# -----------------------------------------------------------------------------
# docs/course.md's first sitting (test_layout.py counts it, test_lesson.py checks it against a run)

SITTING_MODULES = ("lesson", "pool", "grpo", "regimes", "engine")  # what the first sitting's path runs through


def first_sitting():
    """The first sitting's text, and its steps in order: [(file, [names], kind)] (lab/sitting.py)."""
    from lab import sitting

    return sitting.part(), sitting.steps()
