"""
Every regime end to end through train.py, as a user runs it: a few steps on CPU with
the tiny model, then the run directory is checked against its contract (system/runlog.py's
docstring) and the regime's invariants against metrics.jsonl (tests/helpers.py's check_run,
which test_smol.py and test_train.py::test_gpu_check_on_cpu use too); the stale run's answers figure and
wasted-work ledger against its files. Also: Ctrl-C, a killed generator
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))  # for tests/helpers.py
from helpers import ROOT, check_run, read, train  # noqa: E402  (train: train.py to its end)
from regimes import REGIMES  # noqa: E402

SMALL = [
    "--eval-every",
    "3",
    "--eval-n",
    "8",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--synth-steps",
    "6",
    "--max-new-tokens",
    "64",
]


@pytest.mark.parametrize("regime", list(REGIMES))  # every regime registered, a sixth too
def test_regime_end_to_end(regime, tmp_path):
    run = str(tmp_path / regime)
    # the one run that plots also turns the format reward on, so its line is drawn (tiny never boxes: 0)
    plot = ["--format-reward", "0.5", "--tensorboard"] if regime == "recompute" else ["--no-plot"]
    steps, stale = 3, []
    if regime == "stale":  # several optimizer steps per batch; long answers (in flight at the pushes) for the figure
        steps, stale = 4, ["--loss", "gspo", "--minibatches", "2", "--synth-steps", "8", "--max-new-tokens", "96"]
    r = train("--regime", regime, "--out", run, "--steps", str(steps), *SMALL, *plot, *stale)  # later flags win
    check_run(run, regime, steps)  # the run directory's contract (the ledger's sums too), the regime's invariants
    if regime == "stale":
        check_answers_figure_and_ledger(run, r.stdout)
    if regime == "recompute":  # --tensorboard: the same numbers as metrics.jsonl, read back
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        board = EventAccumulator(os.path.join(run, "tensorboard"))
        board.Reload()
        metrics = read(run, "metrics.jsonl")
        for key in ("reward_mean", "eval_acc", "stale_token_frac"):
            want = [(m["step"], m[key]) for m in metrics if key in m]
            got = [(e.step, e.value) for e in board.Scalars(key)]
            assert [s for s, _ in got] == [s for s, _ in want] and all(
                abs(a - b) < 1e-6 for (_, a), (_, b) in zip(got, want)
            ), (key, got, want)


def check_answers_figure_and_ledger(run, stdout):
    """The answers figure's lanes, and the wasted-work ledger's line and time shares (its token
    sums: check_run), checked against the run's own files."""
    from plot import plot_answers
    from system.runlog import read_jsonl

    assert "wasted-work ledger" in stdout
    path, (sel,) = plot_answers([run], lanes=10)
    assert os.path.getsize(path) > 10_000
    answers = read_jsonl(os.path.join(run, "answers.jsonl"))
    assert 0 < len(sel["answers"]) <= 10 and sel["switch"]["version"] >= 2
    push = sel["switch"]["push"]  # the trainer's last "syncing" before the load
    assert push == max(
        e["t"]
        for e in read_jsonl(os.path.join(run, "events.jsonl"))
        if e.get("what") == "syncing" and e["t"] <= sel["switch"]["t0"]
    )
    alive = [a for a in answers if a["admitted"] < push < a["finished"]]
    ids, alive = {a["sample_id"] for a in sel["answers"]}, {a["sample_id"] for a in alive}
    assert alive <= ids if len(alive) <= 10 else ids <= alive  # the rule: answers alive first
    if not alive:  # the rule's other branch (a loaded machine: train.py runs on the wall clock): no push had any
        syncs = [e["t"] for e in read_jsonl(os.path.join(run, "events.jsonl")) if e.get("what") == "syncing"]
        assert not [t for t in syncs if t >= push for a in answers if a["admitted"] < t < a["finished"]]
    for a in sel["answers"]:
        assert sum(seg[3] for seg in a["segments"]) == a["tokens"]
    led = json.load(open(os.path.join(run, "ledger.json")))
    shares = {p: sum(d.values()) / led["total_s"] for p, d in led["seconds"].items()}
    assert 0.9 < shares["trainer"] <= 1.0001, shares  # the trainer's activities cover the run


def start_train(run):
    """train.py in its own process group, as a terminal would run it; its stderr goes
    to run + '.stderr' (read by stderr_tail)."""
    with open(run + ".stderr", "w") as err:  # the child keeps its own copy of the descriptor
        # SIGINT as a terminal leaves it: a job a script started in the background (`cmd &`)
        # inherits SIGINT ignored, and so would train.py, and Ctrl-C could not be tested
        proc = subprocess.Popen(
            [sys.executable, "train.py", "--out", run, "--steps", "1000", *SMALL, "--no-plot"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
            cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
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
        raise AssertionError(
            f"train.py still alive {timeout}s later; its stderr and stack:\n{stderr_tail(proc)}"
        ) from None


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


def test_killed_trainer_leaves_no_generator(tmp_path):
    """`kill` (a scheduler's SIGTERM) stops both like Ctrl-C. (After kill -9 the orphaned
    generator notices its trainer is gone and exits: tests/test_reliability.py's
    test_resume_after_kill_9_loses_and_repeats_nothing, whose run is killed so.)"""
    proc = start_train(str(tmp_path / "killtrainer"))
    children = wait_for_step(proc)
    os.kill(proc.pid, signal.SIGTERM)
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
