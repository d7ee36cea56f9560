"""
Does a stale KV cache cost accuracy? A pre-registered equivalence test of `--regime stale`
(PipelineRL: new weights read the KV the old ones wrote) against `--regime recompute` (AReaL:
that KV rebuilt), on lesson.py's clock at the costs lab/fidelity.py validated against train.py.

    .venv/bin/python lab/equivalence.py                 # the pilot, then every run the data file lacks (hours)
    .venv/bin/python lab/equivalence.py --jobs 2        # two runs at a time (each a core, nice 19)
    .venv/bin/python lab/equivalence.py --table-only    # the tables, from lab/data/equivalence.jsonl alone
    .venv/bin/python lab/equivalence.py --rerun tis/stale-eta2-s0   # one run again: its answers' md5

Everything below was written down, and committed, before the first run of this test; the data
file's rows carry the commit and processor each ran on and when.

The question. On the long preset at its learning rate (6e-5), with generation the slower side
(the validated clock's default costs), is pass@1 after `stale` within 2 points of pass@1 after
`recompute`?

The comparisons: 4, `--loss` tis and gspo, each at `--max-lag` 2 and 8. Each compares `stale`
and `recompute` over seeds 0-19, paired by seed (one seed orders the problems and draws the same
samples up to the first switch).

The runs: `lesson.py --preset long --lr-schedule constant --eval-every 0 --steps 1000
--eval-steps 60 --eval-at T` with the comparison's `--loss`, `--max-lag`, `--regime` and `--seed`;
each run ends once both of its budgets are past, and pass@1 (greedy, the preset's 512 test
problems) is taken of the weights at each, evaluated after the run, so it costs no simulated
time. The learning rate is constant so that what a run did by a budget does not depend on how
far it runs past it. Every run of a comparison on one processor (the data file names it).

The two endpoints:
- A, equal optimizer steps: pass@1 of the weights after 60 optimizer steps (the preset's length).
  The stale KV's effect alone: both regimes trained the same number of steps.
- B, equal simulated time: pass@1 of the weights the generator held at T simulated seconds. The
  regime as a user runs it on a machine with these costs: `stale` does not pay recompute's
  prefills, so by T it has taken more steps. T is fixed by the pilot, before any run of the test:
  the simulated time at which `lesson.py --preset long --lr-schedule constant --eval-every 0
  --steps 60 --regime stale --loss tis --max-lag 2 --seed 100` (not one of the test's seeds) ends
  its step 60, rounded down to 0.1 s.

The margin: 2 points of pass@1 (100 x the share of the 512 problems right). A smaller cost is
below what one run can resolve (one run's pass@1 on 512 problems has a standard error of ~2.2
points at 0.6) and below every difference the course's experiments ask a student to predict.

The test, per comparison and endpoint: d_s = 100 x (pass@1 of stale - pass@1 of recompute) for
seed s; two one-sided t-tests at alpha 0.05 (TOST): "equivalent within +-2 points" when the 90% t
interval of the mean of d lies inside (-2, +2). Otherwise, "a cost of m points" (or "a gain") when
the 95% t interval, Bonferroni-corrected for the 8 tests (99.375%), lies wholly below (above) 0;
otherwise "cannot conclude". Each verdict is given with its interval. Equivalence in all 8 at once
is claimed only if each of the 8 holds (intersection-union: no correction needed for that claim).
The primary result: endpoint A pooled over the 4 comparisons (each seed's d averaged over them),
one TOST at alpha 0.05.

Power, stated beside each result: the smallest true difference the seeds would detect with 80%
power, (t_.975 + t_.80) x sd / sqrt(n), and the margin TOST could confirm with 80% power at a true
difference of 0, (t_.95 + t_.90) x sd / sqrt(n), each from the pooled spread of the 8 (comparison,
endpoint) cells (their variances pooled over their degrees of freedom), not one cell's.

How many seeds: 20, unless the rule says 30. Once seeds 0-9 of every run are in, the pooled sd of
d over the 8 cells gives the seeds TOST needs for 80% power at a true difference of 0 with this
margin: the least n with (t_.95 + t_.90, n - 1 degrees of freedom) x sd / sqrt(n) <= 2. If that n is
over 20, every comparison runs to 30 seeds (a cap: the result is then said with the power it has).

Reported, whatever the verdicts: every run's row, both endpoints' means, each comparison's
steps by T, stale share and lag; what the runs measured (the lag each reached), not only the bound.
"""

import argparse
import hashlib
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import marked  # noqa: E402
import stats  # noqa: E402
from system.runlog import per_token, read_jsonl  # noqa: E402

DATA = "equivalence"  # lab/data/equivalence.jsonl
LOSSES, ETAS, REGIMES = ("tis", "gspo"), (2, 8), ("stale", "recompute")
SEEDS, MORE_SEEDS, FIRST = 20, 30, 10  # seeds 0-19; 0-29 if the rule says so after seeds 0-9
STEPS, MARGIN, ALPHA, TESTS = 60, 2.0, 0.05, 8
BASE = ("--preset", "long", "--lr-schedule", "constant", "--eval-every", "0", "--no-plot")
PILOT = (*BASE, "--steps", str(STEPS), "--regime", "stale", "--loss", "tis", "--max-lag", "2", "--seed", "100")
OUT = os.path.join(ROOT, "out", "equivalence")


def cell(loss, eta, regime, seed):
    return f"{loss}/{regime}-eta{eta}-s{seed}"


def flags(loss, eta, regime, seed, budget):
    run = ("--steps", "1000", "--eval-steps", str(STEPS), "--eval-at", f"{budget:g}")
    return (*BASE, *run, "--loss", loss, "--max-lag", str(eta), "--regime", regime, "--seed", str(seed))


def read():
    """{"budget": T or None, "runs": {cell: its last row}} from the data file."""
    budget, runs = None, {}
    for r in marked.read(DATA):
        if r["kind"] == "pilot":
            budget = r["budget"]
        else:
            runs[r["cell"]] = r
    return dict(budget=budget, runs=runs)


COMMIT = []  # the checkout's commit, asked once: the rows this appends make the tree differ from it


def stamp():
    COMMIT[:] = COMMIT or [marked.commit()]
    return dict(commit=COMMIT[0], processor=marked.processor(), date=time.strftime("%Y-%m-%d %H:%M"))


def lesson(args, out):
    """lesson.py with `args` into `out`, alone on one core at nice 19; raises if it fails."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one core a run: the same thread count for every run
    with open(out + ".log", "w") as log:
        r = subprocess.run(
            ["nice", "-n", "19", sys.executable, "lesson.py", *args, "--out", out],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
        )
    if r.returncode:
        raise SystemExit(f"lesson.py failed: see {out}.log")


def pilot():
    """T: the simulated time at which the pilot ends step STEPS, rounded down to 0.1 s."""
    out = os.path.join(OUT, "pilot")
    lesson(PILOT, out)
    end = [m["wall_s"] for m in read_jsonl(os.path.join(out, "metrics.jsonl")) if m.get("step") == STEPS][0]
    budget = math.floor(end * 10) / 10
    marked.append(DATA, dict(kind="pilot", flags=list(PILOT), end_s=end, budget=budget, **stamp()))
    return budget


def summary(out):
    """A run's two endpoints and what it measured."""
    at = read_jsonl(os.path.join(out, "eval_at.jsonl"))
    steps = [m for m in read_jsonl(os.path.join(out, "metrics.jsonl")) if "trained_tokens" in m]
    by_time = [a for a in at if "t" in a][0]
    return dict(
        at_steps=[a for a in at if a.get("at_step") == STEPS][0]["eval_acc"],
        at_time=by_time["eval_acc"],
        steps_by_time=by_time["step"],
        stale=per_token(steps[:STEPS], "stale_token_frac"),
        lag=per_token(steps[:STEPS], "lag_mean"),
        lag_max=max(m["lag_max"] for m in steps[:STEPS]),
        answers_md5=hashlib.md5(open(os.path.join(out, "answers.jsonl"), "rb").read()).hexdigest(),
    )


def run_one(loss, eta, regime, seed, budget):
    name = cell(loss, eta, regime, seed)
    out = os.path.join(OUT, name)
    t0 = time.time()
    lesson(flags(loss, eta, regime, seed, budget), out)
    row = dict(kind="run", cell=name, loss=loss, eta=eta, regime=regime, seed=seed, budget=budget)
    row.update(summary(out), run_s=round(time.time() - t0, 1), **stamp())
    marked.append(DATA, row)
    print(f"{time.strftime('%H:%M:%S')} {name}: {row['at_steps']:.3f} after {STEPS} steps, {row['at_time']:.3f} at T")


def seeds_needed(data):
    """The rule, once seeds 0-9 are in: SEEDS, or MORE_SEEDS if TOST's 80% power at a true
    difference of 0 needs more than SEEDS at the pooled sd. None while seeds 0-9 are incomplete."""
    cells = differences(data, FIRST)
    if any(len(d) < FIRST for d in cells.values()):
        return None
    sd = stats.pooled_sd(list(cells.values()))
    n = next(n for n in range(2, 10**4) if stats.tost_detectable(sd, n) <= MARGIN)
    return SEEDS if n <= SEEDS else MORE_SEEDS


def differences(data, seeds=None):
    """{(loss, eta, endpoint): [d_s, ...]} in points, over the seeds both regimes have run."""
    out = {}
    for loss in LOSSES:
        for eta in ETAS:
            for endpoint in ("at_steps", "at_time"):
                d = []
                for seed in range(seeds or MORE_SEEDS):
                    a, b = (data["runs"].get(cell(loss, eta, r, seed)) for r in REGIMES)
                    if a and b:
                        d.append(100 * (a[endpoint] - b[endpoint]))
                out[loss, eta, endpoint] = d
    return out


def todo(data, n):
    return [
        (loss, eta, regime, seed)
        for seed in range(n)
        for loss in LOSSES
        for eta in ETAS
        for regime in REGIMES
        if cell(loss, eta, regime, seed) not in data["runs"]
    ]


def run_all(jobs):
    data = read()
    budget = data["budget"] if data["budget"] is not None else pilot()
    print(f"T = {budget} simulated seconds")
    for n in (FIRST, None):
        data = read()
        n = n or seeds_needed(data)
        print(f"seeds 0-{n - 1}: {len(todo(data, n))} runs to go")
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda c: run_one(*c, budget), todo(data, n)))


ENDPOINTS = {"at_steps": f"after {STEPS} steps", "at_time": "at T"}


def results_table():
    """TOST per comparison and endpoint, and the pooled primary result."""
    data = read()
    cells = differences(data)
    if not any(cells.values()):
        return "(no runs yet)"
    sd = stats.pooled_sd([d for d in cells.values() if len(d) > 1])
    lines = [
        f"stale - recompute, pass@1 points; T = {data['budget']} simulated s; margin +-{MARGIN:g}",
        "",
        "| loss | eta | endpoint | seeds | mean | 90% interval | verdict | 80% power: detects | TOST confirms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (loss, eta, endpoint), d in cells.items():
        if len(d) < 2:
            continue
        v = stats.tost(d, MARGIN, ALPHA, TESTS)
        lines.append(
            f"| `{loss}` | {eta} | {ENDPOINTS[endpoint]} | {len(d)} | {v['mean']:+.2f} | "
            f"[{v['low90']:+.2f}, {v['high90']:+.2f}] | {v['verdict']} | "
            f"{stats.detectable(sd, len(d)):.1f} | +-{stats.tost_detectable(sd, len(d)):.1f} |"
        )
    pooled = pooled_primary(cells)
    if len(pooled) > 1:
        v = stats.tost(pooled, MARGIN, ALPHA, 1)
        lines += [
            "",
            f"Primary (after {STEPS} steps, each seed's difference averaged over the 4 comparisons, "
            f"{len(pooled)} seeds): {v['mean']:+.2f}, 90% interval [{v['low90']:+.2f}, {v['high90']:+.2f}]: "
            f"{v['verdict']}.",
        ]
    return "\n".join(lines)


def pooled_primary(cells):
    """Endpoint A's per-seed differences averaged over the 4 comparisons (seeds all 4 have)."""
    ds = [cells[loss, eta, "at_steps"] for loss in LOSSES for eta in ETAS]
    n = min(len(d) for d in ds)
    return [sum(d[s] for d in ds) / len(ds) for s in range(n)]


def measured_table():
    """What each comparison's runs reached: pass@1 at both endpoints, steps by T, stale share, lag."""
    runs = read()["runs"].values()
    lines = [
        "| loss | eta | regime | seeds | after 60 steps | at T | steps by T | stale tokens | lag (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for loss in LOSSES:
        for eta in ETAS:
            for regime in REGIMES:
                rs = [r for r in runs if (r["loss"], r["eta"], r["regime"]) == (loss, eta, regime)]
                if not rs:
                    continue
                mean = lambda k: sum(r[k] for r in rs) / len(rs)
                lines.append(
                    f"| `{loss}` | {eta} | `{regime}` | {len(rs)} | {mean('at_steps'):.3f} | {mean('at_time'):.3f} | "
                    f"{mean('steps_by_time'):.1f} | {mean('stale'):.1%} | {mean('lag'):.2f} "
                    f"({max(r['lag_max'] for r in rs)}) |"
                )
    return "\n".join(lines)


TABLES = {"equivalence": results_table, "equivalence-runs": measured_table}


def rerun(name):
    """One run again into a directory of its own: its answers' md5 against the data file's."""
    row = read()["runs"][name]
    out = os.path.join(OUT, "rerun", name)
    lesson(flags(row["loss"], row["eta"], row["regime"], row["seed"], row["budget"]), out)
    got = hashlib.md5(open(os.path.join(out, "answers.jsonl"), "rb").read()).hexdigest()
    said = "the data file says the same" if got == row["answers_md5"] else "the data file says " + row["answers_md5"]
    print(f"{name}: {got} ({said})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each one core, nice 19)")
    p.add_argument("--table-only", action="store_true", help="the tables from the data file, no runs")
    p.add_argument("--rerun", help="one run again (loss/regime-etaE-sS): its answers' md5 against the file's")
    a = p.parse_args()
    if a.rerun:
        return rerun(a.rerun)
    if not a.table_only:
        run_all(a.jobs)
    print(results_table() + "\n\n" + measured_table())
    for page, name in marked.write(TABLES):
        print(f"wrote {name} into {page}")


if __name__ == "__main__":
    main()
