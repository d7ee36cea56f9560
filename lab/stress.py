"""
The stress experiment: when does off-policy data hurt learning, and what holds it? Runs of
lesson.py on its simulated clock (a rerun gives the same files), in two stages, 3 seeds each.

    .venv/bin/python lab/stress.py pilot               # stage 1: where staleness bites
    .venv/bin/python lab/stress.py holds               # stage 2: what holds it, at the pilot's setting
    .venv/bin/python lab/stress.py --table-only pilot holds   # the tables from the runs on disk
    .venv/bin/python lab/stress.py --figure holds      # docs/stress-curves.png: learning curves

Stage 1 (pilot) walks SETTINGS in order, each more off-policy than the one before, and at each
runs `--regime stale --loss none` (the naive loss: the engine's mu ignored, as if the data
were on-policy) against `--regime sync --loss none` (on-policy: nothing to correct), seeds 0-2.
The rule, fixed before stage 2 ran: a setting *breaks* the naive loss when stale's final
pass@1 is below sync's, paired by seed, with the 95% t interval of the difference below 0
throughout. The walk stops at the first setting that breaks; stage 2 runs there, or, if none
breaks, at the last (most off-policy) setting.

Stage 2 (holds), at that setting, seeds 0-2: `stale` with every --loss; then the best
correction (rule: the highest mean final pass@1 over the seeds, ties to the earlier in
losses.LOSSES, `none` excluded) on `recompute` (stale KV against KV rebuilt under the new
weights) and on `sync` (nothing off-policy: the reference); and `recompute --loss none`
(stale KV against rebuilt KV when nothing corrects either). Each --loss with its own
defaults: `gspo` averages per answer (--loss-agg answer, as its paper; issue 49 changed
this from the token mean, and its runs were made again), `m2po` was added by issue 50.
The losses are those losses.LOSSES held then (HOLDS_LOSSES): `m2po-authors`, added later, has no runs here.

Tables: final pass@1 at equal steps (every run takes the preset's steps) and at equal simulated
time (the earliest end among the runs compared: each run's last evaluation at or before it),
each against the reference row as a paired difference (mean, 95% t interval over seeds;
lab/stats.py). Each row's numbers (over its seeds, with each seed's final pass@1 and
answers.jsonl md5) go onto lab/data/stress.jsonl, committed, and the course's table (TABLES) is built
from those lines alone and written into docs/course.md between its markers (lab/marked.py); so are
RESULTS.md's stress tables, whose lines were copied from RESULTS.md (each says "source" and its batch).
Runs go to out/stress/<stage>/<label>-s<seed>/, a finished run is not run again. Each run is pinned
to one core, --jobs at once, so the numbers do not depend on how many run together; runtime.json in
a run records its wall-clock seconds.
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import marked  # noqa: E402
from course import finished  # noqa: E402
from system.runlog import per_token, read_jsonl  # noqa: E402
from stats import paired_t, show_paired, show_spread, spread, verdict  # noqa: E402

SEEDS = (0, 1, 2)
HOLDS_LOSSES = ("none", "tis", "ppo", "icepop", "geo", "cispo", "gspo", "m2po")  # stage 2's: losses.LOSSES at issue 50
# the long preset cut to 40 steps (every regime has reached its plateau by step ~40, lab/archive.md), pass@1 every
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
        loss_agg=json.load(open(os.path.join(run, "config.json")))["loss_agg"],
        answers_md5=hashlib.md5(open(os.path.join(run, "answers.jsonl"), "rb").read()).hexdigest(),
    )


def at_time(curve, t):
    """pass@1 at the run's last evaluation at or before simulated second t."""
    return [acc for _, wall, acc in curve if wall <= t + 1e-9][-1]


KEY = ("batch", "stage", "setting", "label", "loss_agg")  # a row of the data file: the last line with these wins


def summarise(stage, setting, rows, reference):
    """rows: [(label, flags, [read_run per seed])] -> one line per row as lab/data/stress.jsonl keeps it:
    the numbers its cells print, over its seeds (mean and sample std; the paired difference against the
    reference row, mean and 95% t interval in points, at equal steps and at the table's equal time),
    each seed's final pass@1 and answers.jsonl md5. The equal time is the earliest end among the rows."""
    t = min(r["curve"][-1][1] for _, _, runs in rows for r in runs)
    ref = {label: runs for label, _, runs in rows}[reference]
    lines = []
    for label, flags, runs in rows:
        n = min(len(runs), len(ref))
        mean = lambda key: statistics.mean(r[key] for r in runs)  # noqa: E731
        at = lambda rs: [at_time(r["curve"], t) for r in rs]  # noqa: E731
        vs = {}
        if label != reference:
            finals = [r["final"] for r in runs[:n]], [r["final"] for r in ref[:n]]
            vs[reference] = dict(final=paired_t(*finals), at=paired_t(at(runs[:n]), at(ref[:n])))
        lines.append(
            dict(
                batch=None,  # a fresh run's; the lines copied from RESULTS.md name theirs
                code=marked.commit(),
                stage=stage,
                setting=setting,
                label=label,
                flags=list(flags),
                loss_agg=runs[0]["loss_agg"],
                seeds=list(SEEDS[: len(runs)]),
                finals=[r["final"] for r in runs],
                answers_md5=[r["answers_md5"] for r in runs],
                final=spread([r["final"] for r in runs]),
                at_s={f"{t:.0f}": spread(at(runs))},
                vs=vs,
                steps_per_min=spread([r["steps_per_min"] for r in runs]),
                stale=mean("stale"),
                lag=mean("lag"),
                ess=mean("ess"),
                clipped=mean("clipped"),
                kl=mean("kl"),
                kl_last=mean("kl_last"),
                reward=mean("reward"),
                finished=mean("finished"),
                runtime=mean("runtime") if all(r["runtime"] for r in runs) else None,
            )
        )
    return lines


def keep(*tables):
    """Every row of the tables (summarise's lines) onto lab/data/stress.jsonl once: a row in two tables
    (against two references) is one line with both differences."""
    merged = {}
    for line in (line for lines in tables for line in lines):
        key = tuple(line.get(k) for k in KEY)
        if key in merged:
            merged[key]["vs"].update(line["vs"])
            merged[key]["at_s"].update(line["at_s"])
        else:
            merged[key] = json.loads(json.dumps(line))
    for line in merged.values():
        marked.record("stress", line, key=KEY)


def table(title, lines, reference):
    """The table of summarise's lines: differences against the row labelled `reference`."""
    times = set.intersection(*(set(line["at_s"]) for line in lines))  # one, unless lines of two batches mix
    if len(times) != 1:
        raise ValueError(f"{title or reference}: its rows have no equal time in common: run all of them again")
    (t,) = times
    ref = f"{lines[0]['setting']}: {reference}" if lines[0]["stage"] == "pilot" else reference
    head = (
        f"| | seeds | final pass@1 (equal steps) | vs {ref} | pass@1 at {t} s | vs {ref} "
        "| steps/min | stale tokens | lag | ESS | clipped | KL(mu‖pi) mean / last 10 "
        "| reward, last 10 steps | eval answers finished | runtime s |"
    )
    out = [*([title, ""] if title else []), head, "|---" * 15 + "|"]
    for s in lines:
        vs = s["vs"].get(reference)
        out.append(
            f"| {s['setting'] + ': ' if s['stage'] == 'pilot' else ''}{s['label']} | {len(s['seeds'])} "
            f"| {show_spread(s['final'])} | {show_paired(vs['final']) if vs else '-'} "
            f"| {show_spread(s['at_s'][t])} | {show_paired(vs['at']) if vs else '-'} "
            f"| {show_spread(s['steps_per_min'], '{:.1f}')} | {100 * s['stale']:.1f}% | {s['lag']:.2f} "
            f"| {s['ess']:.4f} "
            f"| {100 * s['clipped']:.2f}% | {s['kl']:.1e} / {s['kl_last']:.1e} | {s['reward']:.3f} "
            f"| {100 * s['finished']:.1f}% | " + (f"{s['runtime']:.0f} |" if s["runtime"] else "|")
        )
    return "\n".join(out)


def last(**match):
    """The last line of lab/data/stress.jsonl whose fields have these values."""
    return [s for s in marked.read("stress") if all(s.get(k) == v for k, v in match.items())][-1]


def archived(batch, stage, setting, labels, reference):
    """A table of RESULTS.md as its batch of runs printed it (the lines copied from there)."""
    return table(None, [last(batch=batch, stage=stage, setting=setting, label=label) for label in labels], reference)


def course_losses():
    """The course's table: every --loss on stale at the setting the pilot chose, each --loss with its own
    defaults (gspo per answer), and gspo's token mean beside it: the runs the best-correction rule read."""
    setting = SETTINGS[1][0]  # where the pilot's rule broke the naive loss (RESULTS.md)
    rows = [(f"`{loss}`", "stale " + loss, "answer" if loss == "gspo" else "token") for loss in HOLDS_LOSSES]
    at = [label for _, label, _ in rows].index("stale gspo")
    rows[at : at + 1] = [
        ("`gspo` (per answer: its default)", "stale gspo", "answer"),
        ("`gspo --loss-agg token` (what the rule chose by)", "stale gspo", "token"),
    ]
    rows.append(("`sync --loss none` (no lag)", "sync none", "token"))
    lines = [(shown, last(setting=setting, label=label, loss_agg=agg)) for shown, label, agg in rows]
    best = max(s["final"][0] for shown, s in lines if s["label"].startswith("stale"))
    out = [
        "| `--loss` on `stale` | final pass@1 | vs `stale none` (points) | stale tokens | ESS | KL(mu‖pi) | clipped |",
        "|---" * 7 + "|",
    ]
    for shown, s in lines:
        final, vs = show_spread(s["final"]), s["vs"].get("stale none")
        out.append(
            f"| {shown} | {f'**{final}**' if s['final'][0] == best else final} "
            f"| {show_paired(vs['final']) if vs else ''} "
            f"| {100 * s['stale']:.1f}% | {s['ess']:.2f} | {s['kl']:.2g} | {100 * s['clipped']:.2g}% |"
        )
    return "\n".join(out)


def pilot_line(setting, label):
    """The pilot's line (batch issue 40) of one setting and row: what the README quotes."""
    return last(batch="issue 40", stage="pilot", setting=setting, label=label)


def vs_sync(setting):
    """stale none - sync none at a pilot setting, final pass@1 in points: [mean, low, high]."""
    return pilot_line(setting, "stale none")["vs"]["sync none"]["final"]


def calm():
    """vs_sync at the long preset's own setting, and what its interval lets the README say."""
    d = vs_sync(SETTINGS[0][0])
    return f"{show_paired(d)}: {verdict(d[1], d[2])}"


STRESS = SETTINGS[1][0]
VALUES = {  # the README's sentence: the naive loss where the pilot's rule found it broken, and where it did not
    "lag": lambda: f"{pilot_line(STRESS, 'stale none')['lag']:.1f}",
    "naive": lambda: f"{pilot_line(STRESS, 'stale none')['final'][0]:.2f}",  # stale none's final pass@1
    "sync": lambda: f"{pilot_line(STRESS, 'sync none')['final'][0]:.2f}",
    "gap": lambda: show_paired(vs_sync(STRESS)),
    "calm": calm,
}
TABLES = {
    "stress-losses": course_losses,
    "stress-pilot-long": lambda: archived("issue 40", "pilot", "long preset", ["stale none", "sync none"], "sync none"),
    "stress-pilot-lag8": lambda: archived("issue 40", "pilot", STRESS, ["stale none", "sync none"], "sync none"),
    "stress-holds-losses": lambda: archived(
        "issue 40",
        "holds",
        STRESS,
        [f"stale {x}" for x in ("none", "tis", "ppo", "icepop", "geo", "cispo", "gspo")],
        "stale none",
    ),
    "stress-holds-regimes": lambda: archived(
        "issue 40",
        "holds",
        STRESS,
        ["stale gspo", "recompute gspo", "sync gspo", "recompute none", "stale none"],
        "sync gspo",
    ),
    "stress-rerun-losses": lambda: archived(
        "issues 49-50", "holds", STRESS, ["stale none", "stale gspo", "stale m2po"], "stale none"
    ),
    "stress-rerun-regimes": lambda: archived(
        "issues 49-50",
        "holds",
        STRESS,
        ["stale gspo", "recompute gspo", "sync gspo", "recompute none", "stale none"],
        "sync gspo",
    ),
}


def pilot(out, jobs, table_only):
    """Stage 1. Returns the chosen setting (label, flags) by the rule in the docstring, and the tables."""
    tables, chosen = [], SETTINGS[-1]
    for label, flags in SETTINGS:
        pair = [(f"{regime} none", ("--regime", regime, "--loss", "none", *flags)) for regime in ("stale", "sync")]
        runs = ensure(out, "pilot", [(f"{label}: {name}", f) for name, f in pair], jobs, table_only)
        rows = [(name, f, [read_run(r) for r in runs[f"{label}: {name}"]]) for name, f in pair]
        if any(len(v) < len(SEEDS) for _, _, v in rows):
            tables.append(f"({label}: {min(len(v) for _, _, v in rows)} of {len(SEEDS)} seeds on disk)")
            return None, tables
        lines = summarise("pilot", label, rows, "sync none")
        keep(lines)
        tables.append(table(f"**pilot: {label}** (`{' '.join(flags) or 'the preset as it is'}`)", lines, "sync none"))
        m, lo, hi = paired_t(*([r["final"] for r in runs] for _, _, runs in rows))  # stale none - sync none
        breaks = hi < 0
        tables.append(
            f"rule: stale none - sync none = {m:+.1f} points, t interval [{lo:+.1f}, {hi:+.1f}]: "
            + ("breaks" if breaks else "holds")
        )
        if breaks:
            chosen = (label, flags)
            break
    return chosen, tables


def after_losses(best):
    """Stage 2's runs after the losses: (regime, --loss), as the docstring says."""
    return [("recompute", best), ("sync", best), ("recompute", "none")]


def holds(out, setting, jobs, table_only):
    """Stage 2 at `setting`. Returns the tables."""
    label, flags = setting
    of = {f"stale {name}": ("--regime", "stale", "--loss", name, *flags) for name in HOLDS_LOSSES}  # label -> flags
    losses = ensure(out, "holds", list(of.items()), jobs, table_only)
    rows = [(k, [read_run(r) for r in v]) for k, v in losses.items() if v]
    complete = [(k, v) for k, v in rows if len(v) == len(SEEDS) and k != "stale none"]
    best = max(complete, key=lambda kv: statistics.mean(r["final"] for r in kv[1]))[0].split()[1] if complete else "tis"
    of |= {f"{regime} {loss}": ("--regime", regime, "--loss", loss, *flags) for regime, loss in after_losses(best)}
    regimes = ensure(
        out,
        "holds",
        [(k, of[k]) for k in (f"{regime} {loss}" for regime, loss in after_losses(best))],
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
        + show_paired(
            paired_t([r["final"] for r in runs[f"stale {name}"]], [r["final"] for r in runs[f"recompute {name}"]])
        )
        + " points at equal steps, "
        + show_paired(
            paired_t(
                [at_time(r["curve"], t) for r in runs[f"stale {name}"]],
                [at_time(r["curve"], t) for r in runs[f"recompute {name}"]],
            )
        )
        + f" at {t:.0f} s"
        for name in (best, "none")
        if len(runs.get(f"stale {name}", [])) == len(runs.get(f"recompute {name}", [])) > 1
        for t in [min(r["curve"][-1][1] for r in runs[f"stale {name}"] + runs[f"recompute {name}"])]
    ]
    lines = summarise("holds", label, [(k, of[k], v) for k, v in rows], "stale none")
    lines2 = (
        summarise("holds", label, [(k, of[k], v) for k, v in rows2], f"sync {best}") if regimes[f"sync {best}"] else []
    )
    keep(lines, lines2)
    return [
        table(f"**holds: every --loss on stale**, at {label} (`{' '.join(flags)}`)", lines, "stale none"),
        f"best correction by the rule: {best}" + (f" (so far: {', '.join(missing)} not finished)" if missing else ""),
        table(f"**holds: stale against recompute against sync**, at {label}", lines2, f"sync {best}")
        if lines2
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
        sys.exit("stress.py: the pilot has not finished, so no setting is chosen yet: run `lab/stress.py pilot` first")
    if "holds" in args.stages:
        print("\n\n".join(holds(args.out, setting, args.jobs, args.table_only)) + "\n", flush=True)
    for page, name in marked.write(TABLES, values=VALUES):
        print(f"wrote {name} into {page}", file=sys.stderr)
    if args.figure:
        from plot import plot_curves

        runs = {
            f"stale {name}": [run_dir(args.out, "holds", f"stale {name}", s) for s in SEEDS] for name in HOLDS_LOSSES
        }
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
