"""
The stress experiment: when does off-policy data hurt learning, and what holds it? Runs of
lesson.py on its simulated clock (a rerun gives the same files), in two stages, 3 seeds each.

    .venv/bin/python tools/stress.py pilot               # stage 1: where staleness bites
    .venv/bin/python tools/stress.py holds               # stage 2: what holds it, at the pilot's setting
    .venv/bin/python tools/stress.py --table-only pilot holds   # the tables from the runs on disk
    .venv/bin/python tools/stress.py --figure holds      # docs/stress-curves.png: learning curves

Stage 1 (pilot) walks SETTINGS in order, each more off-policy than the one before, and at each
runs `--regime stale --loss none` (the naive loss: the engine's mu ignored, as if the data
were on-policy) against `--regime sync --loss none` (on-policy: nothing to correct), seeds 0-2.
The rule, fixed before stage 2 ran: a setting *breaks* the naive loss when stale's final
pass@1 is below sync's, paired by seed, with the 95% t interval of the difference below 0
throughout. The walk stops at the first setting that breaks; stage 2 runs there, or, if none
breaks, at the last (most off-policy) setting.

Stage 2 (holds), at that setting, seeds 0-2: `stale` with every --loss; then the best
correction (rule: the highest mean final pass@1 over the seeds, ties to the earlier in
grpo.LOSSES, `none` excluded) on `recompute` (stale KV against KV rebuilt under the new
weights) and on `sync` (nothing off-policy: the reference); and `recompute --loss none`
(stale KV against rebuilt KV when nothing corrects either). Each --loss with its own
defaults: `gspo` averages per answer (--loss-agg answer, as its paper; issue 49 changed
this from the token mean, and its runs were made again), `m2po` was added by issue 50.

Tables: final pass@1 at equal steps (every run takes the preset's steps) and at equal simulated
time (the earliest end among the runs compared: each run's last evaluation at or before it),
each against the reference row as a paired difference (mean, 95% t interval over seeds;
tools/sweep.py's t_interval). Runs go to out/stress/<stage>/<label>-s<seed>/, a finished run is
not run again. Each run is pinned to one core, --jobs at once, so the numbers do not depend on
how many run together; runtime.json in a run records its wall-clock seconds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from course import finished  # noqa: E402
from runlog import per_token, read_jsonl  # noqa: E402
from sweep import t_interval  # noqa: E402

SEEDS = (0, 1, 2)
# the long preset cut to 40 steps (every regime has reached its plateau by step ~40, RESULTS.md), pass@1 every
# 10 steps for the learning curves: ~3 minutes a run on one core
BASE = ("--preset", "long", "--steps", "40", "--eval-every", "10")
SETTINGS = [  # (label, lesson.py flags), from the least off-policy to the most
    ("long preset", ()),
    ("max-lag 8, trainer x4, lr x4", ("--max-lag", "8", "--train-s", "4.64e-4", "--lr", "2.4e-4")),
    (
        "max-lag 16, trainer x8, lr x4, 4 minibatches",
        ("--max-lag", "16", "--train-s", "9.28e-4", "--lr", "2.4e-4", "--minibatches", "4"),
    ),
]


def slug(label):
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label).strip("_")


def run_dir(out, stage, label, seed):
    return os.path.join(out, stage, f"{slug(label)}-s{seed}")


def launch(jobs, todo):
    """Run lesson.py for each (flags, run directory) in todo, `jobs` at once, each pinned to one core."""
    running, cores = [], list(range(max(1, jobs)))
    ncores = len(os.sched_getaffinity(0))
    while todo or running:
        while todo and cores:
            flags, run = todo.pop(0)
            core = cores.pop(0)
            print(f"lesson.py {' '.join(flags)} -> {run} (core {core % ncores})", file=sys.stderr, flush=True)
            os.makedirs(run, exist_ok=True)
            log = open(os.path.join(run, "stdout.txt"), "w")
            p = subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "lesson.py"), *flags, "--out", run, "--no-plot"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda c=core % ncores: os.sched_setaffinity(0, {c}),
            )
            running.append((p, core, run, time.time()))
        time.sleep(1)
        for item in list(running):
            p, core, run, t0 = item
            if p.poll() is not None:
                running.remove(item)
                cores.append(core)
                if p.returncode:
                    sys.exit(f"stress.py: lesson.py failed in {run} (exit {p.returncode}): see {run}/stdout.txt")
                json.dump(dict(wall_s=round(time.time() - t0, 1)), open(os.path.join(run, "runtime.json"), "w"))


def ensure(out, stage, rows, jobs, table_only):
    """rows: [(label, flags)] -> {label: [run directories, one per seed]}; runs what is missing."""
    todo, dirs = [], {}
    for label, flags in rows:
        dirs[label] = []
        for seed in SEEDS:
            run = run_dir(out, stage, label, seed)
            if not finished(run) and not table_only:
                todo.append(((*BASE, *flags, "--seed", str(seed)), run))
            dirs[label].append(run)
    launch(jobs, todo)
    return {label: [r for r in runs if finished(r)] for label, runs in dirs.items()}


def read_run(run):
    """What a table needs of one run: its curve (step, simulated s, pass@1), the off-policy means."""
    metrics = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [m for m in metrics if "trained_tokens" in m]
    evals = [(m["step"], m.get("wall_s", 0.0), m["eval_acc"]) for m in metrics if "eval_acc" in m]
    answers = [a for a in read_jsonl(os.path.join(run, "eval_answers.jsonl")) if a["step"] == evals[-1][0]]
    mean = lambda key: statistics.mean(m[key] for m in steps if m.get(key) is not None)
    runtime = os.path.join(run, "runtime.json")
    return dict(
        curve=evals,
        final=evals[-1][2],
        steps_per_min=60 * len(steps) / steps[-1]["wall_s"],
        stale=per_token(steps, "stale_token_frac"),
        lag=per_token(steps, "lag_mean"),
        recomputed=sum(m.get("recomputed_tokens", 0) for m in steps) / max(sum(m["trained_tokens"] for m in steps), 1),
        ess=mean("ess"),
        clipped=mean("clipped_frac"),
        kl=mean("kl"),
        kl_last=statistics.mean(m["kl"] for m in steps[-10:] if m.get("kl") is not None),
        reward=statistics.mean(m["reward_mean"] for m in steps[-10:]),
        finished=sum(a["finished"] for a in answers) / len(answers),
        runtime=json.load(open(runtime))["wall_s"] if os.path.exists(runtime) else None,
    )


def at_time(curve, t):
    """pass@1 at the run's last evaluation at or before simulated second t."""
    return [acc for _, wall, acc in curve if wall <= t + 1e-9][-1]


def paired_t(a, b):
    """a - b over seeds (lists in seed order): 'mean [low, high]' in points, by the t interval."""
    d = [100 * (x - y) for x, y in zip(a, b)]
    ci = t_interval(d)
    return f"{statistics.mean(d):+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else f"{statistics.mean(d):+.1f}"


def ms(values, fmt="{:.3f}"):
    return (
        f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"
        if len(values) > 1
        else fmt.format(values[0])
    )


def table(title, rows, reference):
    """rows: [(label, [read_run per seed])]; differences against the row labelled `reference`."""
    ref = dict(rows)[reference]
    t_equal = min(r["curve"][-1][1] for _, runs in rows for r in runs)
    head = (
        "| | seeds | final pass@1 (equal steps) | vs "
        + reference
        + " | pass@1 at "
        + f"{t_equal:.0f} s"
        + " | vs "
        + reference
        + " | steps/min | stale tokens | lag | ESS | clipped | KL(mu‖pi) mean / last 10 "
        "| reward, last 10 steps | eval answers finished | runtime s |"
    )
    lines = [title, "", head, "|---" * 14 + "|"]
    for label, runs in rows:
        n = min(len(runs), len(ref))
        same = runs is ref
        lines.append(
            f"| {label} | {len(runs)} | {ms([r['final'] for r in runs])} | "
            + ("-" if same else paired_t([r["final"] for r in runs[:n]], [r["final"] for r in ref[:n]]))
            + f" | {ms([at_time(r['curve'], t_equal) for r in runs])} | "
            + (
                "-"
                if same
                else paired_t(
                    [at_time(r["curve"], t_equal) for r in runs[:n]], [at_time(r["curve"], t_equal) for r in ref[:n]]
                )
            )
            + f" | {ms([r['steps_per_min'] for r in runs], '{:.1f}')}"
            f" | {100 * statistics.mean(r['stale'] for r in runs):.1f}%"
            f" | {statistics.mean(r['lag'] for r in runs):.2f} | {statistics.mean(r['ess'] for r in runs):.4f}"
            f" | {100 * statistics.mean(r['clipped'] for r in runs):.2f}%"
            f" | {statistics.mean(r['kl'] for r in runs):.1e} / {statistics.mean(r['kl_last'] for r in runs):.1e}"
            f" | {statistics.mean(r['reward'] for r in runs):.3f}"
            f" | {100 * statistics.mean(r['finished'] for r in runs):.1f}%"
            + (f" | {statistics.mean(r['runtime'] for r in runs):.0f} |" if all(r["runtime"] for r in runs) else " | |")
        )
    return "\n".join(lines)


def pilot(out, jobs, table_only):
    """Stage 1. Returns the chosen setting (label, flags) by the rule in the docstring, and the tables."""
    tables, chosen = [], SETTINGS[-1]
    for label, flags in SETTINGS:
        runs = ensure(
            out,
            "pilot",
            [
                (f"{label}: stale none", ("--regime", "stale", "--loss", "none", *flags)),
                (f"{label}: sync none", ("--regime", "sync", "--loss", "none", *flags)),
            ],
            jobs,
            table_only,
        )
        rows = [(k, [read_run(r) for r in v]) for k, v in runs.items()]
        if any(len(v) < len(SEEDS) for _, v in rows):
            tables.append(f"({label}: {min(len(v) for _, v in rows)} of {len(SEEDS)} seeds on disk)")
            return None, tables
        tables.append(
            table(f"**pilot: {label}** (`{' '.join(flags) or 'the preset as it is'}`)", rows, f"{label}: sync none")
        )
        d = [100 * (a["final"] - b["final"]) for a, b in zip(rows[0][1], rows[1][1])]
        breaks = t_interval(d)[1] < 0
        tables.append(
            f"rule: stale none - sync none = {statistics.mean(d):+.1f} points, t interval "
            f"[{t_interval(d)[0]:+.1f}, {t_interval(d)[1]:+.1f}]: " + ("breaks" if breaks else "holds")
        )
        if breaks:
            chosen = (label, flags)
            break
    return chosen, tables


def holds(out, setting, jobs, table_only):
    """Stage 2 at `setting`. Returns the tables."""
    from grpo import LOSSES

    label, flags = setting
    losses = ensure(
        out,
        "holds",
        [(f"stale {name}", ("--regime", "stale", "--loss", name, *flags)) for name in LOSSES],
        jobs,
        table_only,
    )
    rows = [(k, [read_run(r) for r in v]) for k, v in losses.items() if v]
    complete = [(k, v) for k, v in rows if len(v) == len(SEEDS) and k != "stale none"]
    best = max(complete, key=lambda kv: statistics.mean(r["final"] for r in kv[1]))[0].split()[1] if complete else "tis"
    regimes = ensure(
        out,
        "holds",
        [
            (f"recompute {best}", ("--regime", "recompute", "--loss", best, *flags)),
            (f"sync {best}", ("--regime", "sync", "--loss", best, *flags)),
            ("recompute none", ("--regime", "recompute", "--loss", "none", *flags)),
        ],
        jobs,
        table_only,
    )
    rows2 = [
        (k, [read_run(r) for r in v])
        for k, v in [(f"stale {best}", losses[f"stale {best}"]), *regimes.items(), ("stale none", losses["stale none"])]
        if v
    ]
    missing = [k for k, v in [*losses.items(), *regimes.items()] if len(v) < len(SEEDS)]
    runs = dict(rows2)
    kv = [
        f"stale KV against rebuilt KV, {name}: stale - recompute = "
        + paired_t([r["final"] for r in runs[f"stale {name}"]], [r["final"] for r in runs[f"recompute {name}"]])
        + " points at equal steps, "
        + paired_t(
            [at_time(r["curve"], t) for r in runs[f"stale {name}"]],
            [at_time(r["curve"], t) for r in runs[f"recompute {name}"]],
        )
        + f" at {t:.0f} s"
        for name in (best, "none")
        if len(runs.get(f"stale {name}", [])) == len(runs.get(f"recompute {name}", [])) > 1
        for t in [min(r["curve"][-1][1] for r in runs[f"stale {name}"] + runs[f"recompute {name}"])]
    ]
    return [
        table(f"**holds: every --loss on stale**, at {label} (`{' '.join(flags)}`)", rows, "stale none"),
        f"best correction by the rule: {best}" + (f" (so far: {', '.join(missing)} not finished)" if missing else ""),
        table(f"**holds: stale against recompute against sync**, at {label}", rows2, f"sync {best}")
        if regimes[f"sync {best}"]
        else f"(sync {best} not run yet)",
        *kv,
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stages", nargs="+", choices=["pilot", "holds"])
    p.add_argument("--out", default=os.path.join("out", "stress"), help="where the runs go")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="runs at once, one core each")
    p.add_argument("--table-only", action="store_true", help="no new runs: tables from the runs on disk")
    p.add_argument("--figure", action="store_true", help="draw docs/stress-curves.png from stage 2's runs")
    args = p.parse_args()
    setting, tables = pilot(args.out, args.jobs, args.table_only or "pilot" not in args.stages)
    if "pilot" in args.stages:
        print("\n\n".join(tables) + (f"\n\nstage 2 runs at: {setting[0]}\n" if setting else "\n"), flush=True)
    if setting is None and ("holds" in args.stages or args.figure):
        sys.exit(
            "stress.py: the pilot has not finished, so no setting is chosen yet: run `tools/stress.py pilot` first"
        )
    if "holds" in args.stages:
        print("\n\n".join(holds(args.out, setting, args.jobs, args.table_only)) + "\n", flush=True)
    if args.figure:
        from plot import plot_curves
        from grpo import LOSSES

        runs = {f"stale {name}": [run_dir(args.out, "holds", f"stale {name}", s) for s in SEEDS] for name in LOSSES}
        runs.update(
            {
                label: [run_dir(args.out, "holds", label, s) for s in SEEDS]  # the on-policy reference
                for label in sorted(os.listdir(os.path.join(args.out, "holds")))
                if label.startswith("sync_") and label.endswith("-s0")
                for label in [label[:-3].replace("_", " ")]
            }
        )
        print(
            "figure:",
            plot_curves(
                {k: [r for r in v if finished(r)] for k, v in runs.items()},
                os.path.join(ROOT, "docs", "stress-curves.png"),
                f"every --loss on stale, and sync, at {setting[0]} (seeds {SEEDS[0]}-{SEEDS[-1]})",
            ),
        )


if __name__ == "__main__":
    main()
