"""
lesson.py's clock costs, measured from a train.py run directory: what one engine step,
one prefilled token, one trained token and one weight load took there. Run it on a run
from your own machines (a GPU pair, say) and pass what it prints to lesson.py: the
lesson then keeps that pair's ratio of generation to training speed.

    .venv/bin/python tools/clock_costs.py out/<a train.py run>
    -> --step-s 0.0123 --prefill-s 1.2e-05 --train-s 0.000345 --load-s 0.0456

How, from the run's own files:
- engine steps (answers.jsonl): each answer's record says which consecutive engine
  steps wrote its tokens (a segment: n steps from t0 to t1), and which single steps
  prefilled its prompt or rebuilt its KV (n tokens). A segment's time is n x step-s +
  prefill-s x the tokens prefilled by the steps inside it (any answer's, as the steps are
  shared): least squares over every segment outside evaluations gives both, each
  engine's steps apart, and only up to the time after which an engine may have
  prefilled answers the file does not hold (clean_until).
- trainer steps (events.jsonl, metrics.jsonl): the trainer's "training" spans against
  the tokens each step ran through the model (run_tokens: padded micro-batches of the
  answers whose advantage is not 0), their ratio of sums: the lesson charges per token.
- weight loads (events.jsonl): the mean of the generator's "load" marks.
"""

import argparse
import bisect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from system.runlog import activity_spans, read_jsonl  # noqa: E402


def clean_until(answers, engines):
    """{engine: time}: until then every prompt the engine prefilled belongs to an answer in
    answers.jsonl. The file holds the groups the pool let go of; the ones still in the
    pool or in flight at the end (or lost in a crash) are missing, and their prefills
    share the engine's steps unseen. An engine admits groups e, e + engines, ... in
    order, so the first group missing from its sequence was admitted after the last one
    present before it: a step ending by that one's admission cannot have prefilled it."""
    admitted = {}
    for x in answers:
        admitted.setdefault(x["engine"], {})[x["group_id"]] = x["admitted"]
    until = {}
    for e, groups in admitted.items():
        ids = sorted(groups)
        last = next((a for a, b in zip(ids, ids[1:]) if b - a > engines), ids[-1])
        until[e] = groups[last]
    return until


def engine_costs(answers, evals, engines=1):
    """(step_s, prefill_s, segments used) by least squares over the answers' segments, each
    engine's steps apart, up to the time its steps hold only prefills this file shows."""
    until = clean_until(answers, engines)
    rows = []  # (steps in the segment, tokens prefilled inside it, its seconds)
    for e in until:
        mine = [x for x in answers if x["engine"] == e]
        tokens = {}  # each distinct prefill step of this engine: the tokens it prefilled
        for x in mine:
            for p in x["prefills"]:
                tokens[p[0], p[1]] = tokens.get((p[0], p[1]), 0) + p[3]
        steps = sorted(tokens)
        starts = [t0 for t0, _ in steps]
        for x in mine:
            for t0, t1, _, n, _ in x["segments"]:
                if t1 > until[e] or any(e0 < t1 and t0 < e1 for e0, e1 in evals):  # evaluations share steps, unseen
                    continue
                inside = steps[bisect.bisect_left(starts, t0) : bisect.bisect_right(starts, t1)]
                rows.append((n, sum(tokens[s] for s in inside if s[1] <= t1), t1 - t0))
    # normal equations of  seconds = step_s * n + prefill_s * tokens
    snn = sum(n * n for n, _, _ in rows)
    snp = sum(n * p for n, p, _ in rows)
    spp = sum(p * p for _, p, _ in rows)
    sns = sum(n * s for n, _, s in rows)
    sps = sum(p * s for _, p, s in rows)
    det = snn * spp - snp * snp
    if not rows or det <= 0:
        raise SystemExit(
            "clock_costs.py: too few engine steps with and without prefills in this run to tell them apart"
        )
    return (sns * spp - sps * snp) / det, (snn * sps - snp * sns) / det, len(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a train.py run directory (out/<run>)")
    run = p.parse_args().run
    if not os.path.isfile(os.path.join(run, "answers.jsonl")):
        raise SystemExit(f"clock_costs.py: {run} is not a run directory (no answers.jsonl)")
    events = read_jsonl(os.path.join(run, "events.jsonl"))
    metrics = [m for m in read_jsonl(os.path.join(run, "metrics.jsonl")) if "trained_tokens" in m]
    evals = [(e["t0"], e["t1"]) for e in events if e.get("mark") == "eval"]
    with open(os.path.join(run, "config.json")) as f:
        engines = json.load(f).get("engines", 1)
    step_s, prefill_s, n = engine_costs(read_jsonl(os.path.join(run, "answers.jsonl")), evals, engines)
    training = [t1 - t0 for proc, what, t0, t1 in activity_spans(events) if proc == "trainer" and what == "training"]
    if any("run_tokens" not in m for m in metrics):
        raise SystemExit(
            f"clock_costs.py: {run}'s metrics.jsonl has no run_tokens (a run from before they were logged)"
        )
    train_s = sum(training) / sum(m["run_tokens"] for m in metrics)
    loads = [e["t1"] - e["t0"] for e in events if e.get("mark") == "load"]
    print(f"{run}: {n} answer segments, {len(training)} trainer steps, {len(loads)} weight loads")
    print(
        f"--step-s {step_s:.4g} --prefill-s {prefill_s:.3g} --train-s {train_s:.4g} "
        f"--load-s {sum(loads) / len(loads):.4g}"
    )


if __name__ == "__main__":
    main()
