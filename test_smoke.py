"""
Every regime end to end through train.py, as a user runs it: a few steps on CPU with
the tiny model, then the run directory is checked against its contract (runlog.py's
docstring) and the regime's invariants against metrics.jsonl. Also: Ctrl-C, a killed generator
(resume: test_reliability.py, after a kill -9).

    .venv/bin/python -m pytest -q test_smoke.py
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

METRIC_KEYS = {"step", "wall_s", "version", "reward_mean", "loss", "trained_tokens", "stale_token_frac",
               "lag_mean", "spanning_frac", "gen_tok_per_s", "sync_s", "trainer_wait_s", "gen_idle_s",
               "discarded_tokens", "recomputed_tokens", "ess", "clipped_frac", "kl", "kl_stale", "kl_fresh"}
ACTIVITIES = {"starting", "generating", "draining", "loading", "idle", "evaluating", "training", "syncing",
              "waiting", "saving", "done", "stopped"}
SMALL = ["--eval-every", "3", "--eval-n", "8", "--prompts-per-step", "4", "--group-size", "4",
         "--synth-steps", "6", "--max-new-tokens", "64"]


def train(*args, timeout=600):
    r = subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def read(run, name):
    with open(os.path.join(run, name)) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("regime", ["sync", "drain", "discard", "stale", "recompute"])
def test_regime_end_to_end(regime, tmp_path):
    run = str(tmp_path / regime)
    # the one run that plots also turns the format reward on, so its line is drawn (tiny never boxes: 0)
    plot = ["--format-reward", "0.5", "--tensorboard"] if regime == "recompute" else ["--no-plot"]
    loss = ["--loss", "gspo", "--minibatches", "2"] if regime == "stale" else []  # several steps per batch
    train("--regime", regime, "--out", run, "--steps", "3", *SMALL, *plot, *loss)
    check_run(run, regime, steps=3)
    if regime == "recompute":  # --tensorboard: the same numbers as metrics.jsonl, read back
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        board = EventAccumulator(os.path.join(run, "tensorboard"))
        board.Reload()
        metrics = read(run, "metrics.jsonl")
        for key in ("reward_mean", "eval_acc", "stale_token_frac"):
            want = [(m["step"], m[key]) for m in metrics if key in m]
            got = [(e.step, e.value) for e in board.Scalars(key)]
            assert [s for s, _ in got] == [s for s, _ in want] and all(
                abs(a - b) < 1e-6 for (_, a), (_, b) in zip(got, want)), (key, got, want)


def check_run(run, regime, steps):
    """The run directory against its contract (runlog.py), and the regime's invariants
    against its metrics (test_smol.py checks SmolLM2's runs with it too)."""
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["regime"] == regime and cfg["steps"] == steps
    metrics = [m for m in read(run, "metrics.jsonl") if m["step"] > 0]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert METRIC_KEYS <= set(m), METRIC_KEYS - set(m)
        assert m["trained_tokens"] > 0 and 0 <= m["reward_mean"] <= 1 and 0 <= m["boxed_frac"] <= 1
        assert 0 <= m["truncated_frac"] <= 1 and 0 <= m["loss_tokens"] <= m["trained_tokens"]
        assert m["lag_max"] <= cfg["max_lag"]  # config.json: what the run used (sync: 0)
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
    assert {e["proc"] for e in events} == {"trainer", *(["generator"] if n == 1 else [f"generator{i}" for i in range(n)])}
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
    # the regime's invariants, as the metrics show them
    if regime == "sync":
        assert all(m["lag_mean"] == 0 for m in metrics)
    if regime in ("sync", "drain", "discard"):
        assert all(m["spanning_frac"] == 0 for m in metrics)
    if regime != "stale":
        assert all(m["stale_token_frac"] == 0 for m in metrics)
    if regime != "discard":
        assert all(m["discarded_tokens"] == 0 for m in metrics)
    if regime != "recompute":
        assert all(m["recomputed_tokens"] == 0 for m in metrics)
    else:
        assert os.path.exists(os.path.join(run, "run.png"))


def start_train(run):
    """train.py in its own process group, as a terminal would run it; its stderr goes
    to run + '.stderr' (read by stderr_tail)."""
    with open(run + ".stderr", "w") as err:  # the child keeps its own copy of the descriptor
        # SIGINT as a terminal leaves it: a job a script started in the background (`cmd &`)
        # inherits SIGINT ignored, and so would train.py, and Ctrl-C could not be tested
        proc = subprocess.Popen([sys.executable, "train.py", "--out", run, "--steps", "1000", *SMALL, "--no-plot"],
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.stderr_path = run + ".stderr"
    return proc


def stderr_tail(proc):
    with open(proc.stderr_path) as f:
        return f.read()[-3000:]


def exits(proc, timeout=30):
    """proc's exit code; if it is still alive after timeout, its Python stack (train.py
    dumps it on SIGUSR1) in the failure."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        raise AssertionError(f"train.py still alive {timeout}s later; its stderr and stack:\n{stderr_tail(proc)}") from None


def wait_for_step(proc, timeout=300):
    t0 = time.time()
    for line in proc.stdout:
        if line.startswith("step 1 "):
            return psutil.Process(proc.pid).children(recursive=True)
        assert time.time() - t0 < timeout
    raise AssertionError("train.py ended before its first step: " + stderr_tail(proc))


def still_running(procs):
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_ctrl_c_stops_both(tmp_path):
    proc = start_train(str(tmp_path / "ctrlc"))
    children = wait_for_step(proc)
    assert children, "no generator process"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert exits(proc) != 0
    time.sleep(1)
    assert not still_running(children)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_trainer_leaves_no_generator(tmp_path, sig):
    """`kill` (a scheduler's SIGTERM) stops both like Ctrl-C; after kill -9 the
    orphaned generator notices its trainer is gone and exits."""
    proc = start_train(str(tmp_path / "killtrainer"))
    children = wait_for_step(proc)
    os.kill(proc.pid, sig)
    assert exits(proc) != 0
    psutil.wait_procs(children, timeout=30)
    assert not still_running(children)


def test_killed_generator_stops_trainer(tmp_path):
    proc = start_train(str(tmp_path / "kill"))
    children = wait_for_step(proc)
    t0 = time.time()
    for c in children:
        c.kill()
    code = exits(proc)
    assert code != 0 and time.time() - t0 < 30
    assert "generator process" in stderr_tail(proc)
