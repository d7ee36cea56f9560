"""
lesson.py's clock costs, fitted to what train.py runs took: what an engine step costs as a function
of what it holds, what a token through the trainer costs, what a load costs. Run it on runs of your
own machines (a GPU pair, say) and pass what it prints to lesson.py: the lesson then keeps their
speeds, and their ratio of generation to training.

    .venv/bin/python tools/clock_costs.py out/<a train.py run> [more runs ...]
    -> --step-s 0.0041 --answer-s 4.1e-05 --kv-s 2.2e-07 --prefill-s 2.6e-05 --train-s 0.000101 --load-s 0.0521

From each run's own files:
- an engine step (generator-steps.jsonl, a line per step: when, what the engine held, what it
  prefilled): least squares of its seconds on 1, the answers it held, the tokens in their KV, the
  tokens it prefilled and whether the trainer was training meanwhile (events.jsonl: the two share a
  machine), over every step of every run but each engine's first WARMUP (vLLM's first steps are
  slow; the lesson's engine is warm when its clock starts).
- a trainer step (events.jsonl, metrics.jsonl): its "training" spans over the tokens each step ran
  through the model (run_tokens: padded micro-batches of the answers whose advantage is not 0),
  their ratio of sums.
- a weight load (events.jsonl): the mean of the generator's "load" marks.
"""

import argparse
import bisect
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from system.runlog import activity_spans, read_jsonl  # noqa: E402

WARMUP = 50  # steps of each engine left out of the fit (--warmup; a lesson run's clock has none)
TERMS = ("step_s", "answer_s", "kv_s", "prefill_s", "busy_s")  # seconds = step_s + answer_s x answers + ...


def training(run):
    """The trainer's "training" spans, [(t0, t1)] in order."""
    events = read_jsonl(os.path.join(run, "events.jsonl"))
    return sorted((t0, t1) for proc, what, t0, t1 in activity_spans(events) if proc == "trainer" and what == "training")


def engine_steps(run, warmup=WARMUP):
    """[(seconds, answers, kv tokens, prefilled tokens, trainer training)] of every engine's steps past
    its warm-up; the trainer counts as training when it was at the step's start (as the lesson charges)."""
    spans, rows = training(run), []
    starts = [t0 for t0, _ in spans]
    for path in sorted(glob.glob(os.path.join(run, "generator*-steps.jsonl"))):
        for t0, t1, a, kv, p, *_ in read_jsonl(path)[warmup:]:
            i = bisect.bisect_right(starts, t0) - 1
            rows.append((t1 - t0, a, kv, p, int(i >= 0 and t0 < spans[i][1])))
    return rows


def least_squares(rows):
    """The coefficients c of seconds = c . (1, answers, kv, prefilled, busy), least squares with no
    term below 0 (a cost; one run's jitter can fit a small term negative, which the lesson refuses);
    a term the runs never vary (busy in a sync run: the trainer never trains meanwhile) gets 0."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.array(rows, dtype=float)
    x = np.c_[np.ones(len(a)), a[:, 1:]]
    used = [0] + [j for j in range(1, x.shape[1]) if x[:, j].any()]
    scale = np.abs(x[:, used]).max(axis=0)  # columns of one size, for the solver
    c = np.zeros(x.shape[1])
    c[used] = nnls(x[:, used] / scale, a[:, 0], maxiter=100 * len(used))[0] / scale
    return c.tolist()


def trainer_costs(run):
    """(seconds training, tokens run) of a run's optimizer steps."""
    steps = [m for m in read_jsonl(os.path.join(run, "metrics.jsonl")) if "trained_tokens" in m]
    return sum(t1 - t0 for t0, t1 in training(run)), sum(m["run_tokens"] for m in steps)


def loads(run):
    return [e["t1"] - e["t0"] for e in read_jsonl(os.path.join(run, "events.jsonl")) if e.get("mark") == "load"]


def fit(runs, warmup=WARMUP):
    """The lesson's cost flags from train.py run directories: {flag name: value}."""
    steps = [row for run in runs for row in engine_steps(run, warmup)]
    if len(steps) < 100:
        raise SystemExit(f"clock_costs.py: {len(steps)} engine steps past the warm-up: too few to fit")
    costs = dict(zip(TERMS, least_squares(steps)))
    trained = [trainer_costs(run) for run in runs]
    costs["train_s"] = sum(s for s, _ in trained) / sum(n for _, n in trained)
    every = [x for run in runs for x in loads(run)]
    costs["load_s"] = sum(every) / len(every)
    return costs


def flags(costs):
    return " ".join(f"--{k.replace('_', '-')} {v:.3g}" for k, v in costs.items())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="train.py run directories (out/<run>)")
    p.add_argument("--warmup", type=int, default=WARMUP, help="each engine's first steps left out (vLLM's are slow)")
    args = p.parse_args()
    runs = args.runs
    for run in runs:
        if not glob.glob(os.path.join(run, "generator*-steps.jsonl")):
            raise SystemExit(
                f"clock_costs.py: {run} has no generator-steps.jsonl (not a train.py run, or an older one)"
            )
    print(flags(fit(runs, args.warmup)))


if __name__ == "__main__":
    main()
