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
  shared): least squares over every segment outside evaluations gives both.
- trained tokens (events.jsonl, metrics.jsonl): the trainer's "training" spans against
  each step's trained tokens (their ratio of sums: the lesson charges per token).
- weight loads (events.jsonl): the mean of the generator's "load" marks.
"""

import argparse
import bisect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plot import activity_spans, read_jsonl  # noqa: E402


def engine_costs(answers, evals):
    """(step_s, prefill_s, segments used) by least squares over the answers' segments."""
    steps = sorted({(p[0], p[1]): 0 for x in answers for p in x["prefills"]})  # distinct prefill steps
    tokens = {}
    for x in answers:
        for p in x["prefills"]:
            tokens[p[0], p[1]] = tokens.get((p[0], p[1]), 0) + p[3]
    starts = [t0 for t0, _ in steps]
    rows = []  # (steps in the segment, tokens prefilled inside it, its seconds)
    for x in answers:
        for t0, t1, _, n, _ in x["segments"]:
            if any(e0 < t1 and t0 < e1 for e0, e1 in evals):  # evaluation requests share those steps, unseen
                continue
            inside = steps[bisect.bisect_left(starts, t0):bisect.bisect_right(starts, t1)]
            rows.append((n, sum(tokens[s] for s in inside if s[1] <= t1), t1 - t0))
    # normal equations of  seconds = step_s * n + prefill_s * tokens
    snn = sum(n * n for n, _, _ in rows)
    snp = sum(n * p for n, p, _ in rows)
    spp = sum(p * p for _, p, _ in rows)
    sns = sum(n * s for n, _, s in rows)
    sps = sum(p * s for _, p, s in rows)
    det = snn * spp - snp * snp
    if not rows or det <= 0:
        raise SystemExit("clock_costs.py: too few engine steps with and without prefills in this run to tell them apart")
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
    step_s, prefill_s, n = engine_costs(read_jsonl(os.path.join(run, "answers.jsonl")), evals)
    training = [t1 - t0 for proc, what, t0, t1 in activity_spans(events) if proc == "trainer" and what == "training"]
    train_s = sum(training) / sum(m["trained_tokens"] for m in metrics)
    loads = [e["t1"] - e["t0"] for e in events if e.get("mark") == "load"]
    print(f"{run}: {n} answer segments, {len(training)} trainer steps, {len(loads)} weight loads")
    print(f"--step-s {step_s:.4g} --prefill-s {prefill_s:.3g} --train-s {train_s:.4g} "
          f"--load-s {sum(loads) / len(loads):.4g}")


if __name__ == "__main__":
    main()
