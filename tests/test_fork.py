"""
The two fork seams used as docs/fork.md says a forker uses them: a sixth regime (a class in
regimes.REGIMES) and a task of your own (a row in data.TASKS, read from a local file in its own
schema, with answers checked by a function of your own in reward.CHECKS), each run through lesson.py
for a few steps on the long preset's tiny model. And the in-flight rule: a switch that returns False
with nothing in flight stops the lesson with a RuntimeError naming the regime, rather than spinning.

    .venv/bin/python -m pytest -q tests/test_fork.py
"""

import json
import os
import re
import signal

import pytest

import data
import lesson
import plot
import regimes
import reward
from helpers import LESSON_ARGS, lesson_engine, read
from plot import cost, plot_answers


class Patient:
    """A sixth regime: wait up to three engine steps for the answers in flight to finish, then load the
    new weights in place, as stale does, and let whatever is still in flight go on reading the old KV."""

    def __init__(self):
        self.waited = 0

    def switch(self, gen, version, weights):
        if gen.inflight and self.waited < 3:  # False only while answers are in flight (regimes.py)
            self.waited += 1
            return False
        self.waited = 0
        gen.load_weights(version, weights)
        return True


class Stuck:
    """Breaks the in-flight rule: never loads, so it would wait for ever once nothing is in flight."""

    max_lag = 0  # one batch per version, as sync: nothing is in flight once it is written

    def switch(self, gen, version, weights):
        return False


def run_lesson(args, out):
    """lesson.main in this process, on the engine the tests share for these flags; returns its run directory."""
    lesson.main([*args, "--out", str(out)], engine=lesson_engine(args))
    return str(out)


def test_a_sixth_regime_is_one_class(tmp_path, monkeypatch):
    """Registered in REGIMES, it is a --regime choice, runs the lesson's loop to its end, and its panel
    of the answers figure is titled by its name alone (plot.cost knows what the five pay, not what it does;
    the run's name joins a title where two panels share a regime)."""
    monkeypatch.setitem(regimes.REGIMES, "patient", Patient)
    run = run_lesson([*LESSON_ARGS, "--regime", "patient", "--steps", "3"], tmp_path / "patient")
    metrics, answers = read(run, "metrics.jsonl"), read(run, "answers.jsonl")
    assert json.load(open(os.path.join(run, "config.json")))["regime"] == "patient"
    assert [m["step"] for m in metrics] == [1, 2, 3] and len(answers) == 3 * 16
    assert any(m["stale_token_frac"] > 0 for m in metrics)  # it loaded while answers were being written
    assert all(m["discarded_tokens"] == m["recomputed_tokens"] == 0 for m in metrics)
    titles = {name: cost(run, name) for name in regimes.REGIMES}
    assert titles.pop("patient") == "" and all(titles.values()), titles
    monkeypatch.setattr(plot, "cost", lambda run, regime: "paid")  # as if it knew what patient pays
    _, sels = plot_answers([run, run], lanes=4, out=str(tmp_path / "two.png"))  # one regime twice: runs named
    assert [s["title"].split(":")[0] for s in sels] == ["patient (paid)"] * 2, sels[0]["title"]
    assert sels[0]["title"].endswith("   (patient)")
    _, (sel,) = plot_answers([run], lanes=4, out=str(tmp_path / "one.png"), costs=False)  # the README's titles
    n, v = sel["alive"], sel["switch"]["version"]
    assert sel["title"] == f"patient: {n} answer{'s' * (n != 1)} half-written when v{v} was sent", sel["title"]


def test_a_switch_that_waits_with_nothing_in_flight_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(regimes.REGIMES, "stuck", Stuck)

    def hung(*_):
        raise AssertionError("the lesson spun: a False with nothing in flight was not refused")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)
    try:
        with pytest.raises(RuntimeError, match="regime stuck: switch returned False with no answer in flight"):
            run_lesson([*LESSON_ARGS, "--regime", "stuck", "--steps", "2"], tmp_path / "stuck")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def count_problem(row):
    """A row of the toy task's schema -> a problem: the story is the question, the count its answer."""
    if not isinstance(row["count"], int):
        raise ValueError(f"has a count that is not a whole number ({row['count']!r})")
    return {"question": row["story"], "answer": str(row["count"])}


def within_one(completion, answer):
    """A check of your own: right when the completion's last number is within 1 of the answer."""
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and abs(int(numbers[-1]) - int(answer)) <= 1)


def test_a_task_of_your_own_is_a_row(tmp_path, monkeypatch):
    """A task read from local files only, rows {"story": str, "count": int}, checked by within_one: a
    --dataset choice, its rows read and refused as its schema says, its answers scored by its check."""
    rows = [{"story": p["question"], "count": int(p["answer"])} for p in data.synth_split("test", 32, "1-3")]
    path = tmp_path / "counts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    checked = []
    monkeypatch.setitem(
        reward.CHECKS, "within-one", reward.Check(lambda c, a: checked.append(a) or within_one(c, a), boxed=bool)
    )
    toy = data.Task(
        hub=None,
        fields=("story", "count"),
        schema='{"story": str, "count": int}',
        problem=count_problem,
        prompt=data.boxed_prompt,
        check="within-one",
        defaults=dict(data.TASKS["synth"].defaults, model="tiny-long"),
    )
    monkeypatch.setitem(data.TASKS, "counts", toy)

    assert data.load_problems("counts", "test", data_file=str(path))[0] == {
        "question": rows[0]["story"],
        "answer": str(rows[0]["count"]),
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"story": "Ann has 3 apples.", "count": "three"}) + "\n")
    with pytest.raises(data.UsageError, match=r"row 1 has a count that is not a whole number .* counts rows look like"):
        data.load_problems("counts", "train", data_file=str(bad))
    with pytest.raises(data.UsageError, match="read from local files only: pass --data-file"):
        data.load_problems("counts", "train")

    files = ["--data-file", str(path), "--eval-data-file", str(path)]
    flags = ["--dataset", "counts", *files, "--steps", "3", "--prompts-per-step", "4", "--group-size", "4"]
    run = run_lesson([*flags, "--eval-every", "3", "--eval-n", "8", "--no-plot"], tmp_path / "counts")
    metrics = read(run, "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3] and "eval_acc" in metrics[-1]
    assert len(checked) >= 3 * 16 + 2 * 8  # every answer trained on, and every answer evaluated
    assert set(checked) <= {r["answer"] for r in data.load_problems("counts", "test", data_file=str(path))}
    assert any(m["reward_mean"] > 0 for m in metrics if "reward_mean" in m)
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert (cfg["dataset"], cfg["model"], cfg["max_model_len"]) == ("counts", "tiny-long", 512)  # its row's defaults
