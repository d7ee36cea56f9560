"""
The course's experiments (docs/course.md), each a few runs of lesson.py on its simulated
clock, and their tables, which it also writes into the pages (lab/data/course.jsonl keeps
each run). A second run on the same processor prints the same tables; another processor's
rounding can change a sampled token, and every number after it.

    .venv/bin/python lab/course.py                      # every experiment, one run at a time, one thread each
    .venv/bin/python lab/course.py --jobs 2             # two runs at a time (one core each: the same files)
    .venv/bin/python lab/course.py regimes max_lag      # some of them
    .venv/bin/python lab/course.py --table-only         # the tables from the runs on disk

Every run has one thread (OMP_NUM_THREADS=1): the trainer's sums are made in another order with
another thread count, so a run is byte-reproducible on one processor at one count.

Runs go to out/course/<experiment>/<label>/; a finished run is not run again, and a run
that two experiments share (the same lesson.py settings) runs once, in the first one's
directory. Each run's summary (every number its rows print, its pass@1 curve, the md5 of its
answers.jsonl) goes onto lab/data/course.jsonl, committed; the tables are built from those lines
alone and written into docs/course.md, RESULTS.md and the README between their markers
(lab/marked.py). The first 16 lines there were copied from RESULTS.md's tables (each says
"source"): they have no curve, only pass@1 at the equal times those tables printed, so a table shows
them until every one of its rows has a run of this tool (choose).
"""

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import marked  # noqa: E402
from regimes import REGIMES  # noqa: E402
from system.runlog import per_token, read_jsonl  # noqa: E402

LONG = ("--preset", "long")
TRAIN_S = 1.01e-4  # lesson.py's default --train-s (tests/test_lesson.py checks that they agree)
EXPERIMENTS = {  # name -> (what it shows, [(label, lesson.py flags)])
    "regimes": (
        "the five regimes on the long preset, at the default costs",
        [(r, (*LONG, "--regime", r)) for r in REGIMES],
    ),
    "speed": (
        "stale tokens against the trainer's speed: --train-s, simulated seconds per trained token, "
        f"as a multiple of the default {TRAIN_S:.2e}",
        [
            (f"--train-s {TRAIN_S * x:.2e} (x{x:g})", (*LONG, "--regime", "stale", "--train-s", f"{TRAIN_S * x:.2e}"))
            for x in (0.25, 0.5, 1, 2, 4)
        ],
    ),
    "max_lag": (
        "how far ahead the generator may run (--max-lag), stale",
        [(f"--max-lag {k}", (*LONG, "--regime", "stale", "--max-lag", str(k))) for k in (1, 2, 4)],
    ),
    "loss": (
        "the off-policy correction, stale",
        [
            ("--loss tis --is-cap 2", (*LONG, "--regime", "stale")),
            ("--loss tis --is-cap 1.2", (*LONG, "--regime", "stale", "--is-cap", "1.2")),
            ("--loss ppo", (*LONG, "--regime", "stale", "--loss", "ppo")),
        ],
    ),
    "loss_agg": (
        "how the loss averages over tokens (--loss-agg), stale",
        [(f"--loss-agg {a}", (*LONG, "--regime", "stale", "--loss-agg", a)) for a in ("token", "answer", "constant")],
    ),
    "answers": (
        "short answers (the default preset) against long ones, stale",
        [("default preset", ("--regime", "stale")), ("--preset long", (*LONG, "--regime", "stale"))],
    ),
}
TARGET = 0.55  # the long preset's target accuracy (sweep.py's TARGETS)


def finished(run):
    """A run whose metrics reach its config's last step."""
    try:
        steps = json.load(open(os.path.join(run, "config.json")))["steps"]
        return any(m.get("step") == steps for m in read_jsonl(os.path.join(run, "metrics.jsonl")))
    except (OSError, ValueError, KeyError):
        return False


def summary(run):
    """One row: what the run's files say about staleness, time and learning."""
    metrics = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [m for m in metrics if "trained_tokens" in m]
    evals = [m for m in metrics if "eval_acc" in m]
    ledger = json.load(open(os.path.join(run, "ledger.json")))
    gen, trainer, total = ledger["seconds"].get("generator", {}), ledger["seconds"]["trainer"], ledger["total_s"]
    reached = [m["wall_s"] for m in evals if m["eval_acc"] >= TARGET] if evals[0]["eval_acc"] < TARGET else []
    return dict(
        final=evals[-1]["eval_acc"],
        start=evals[0]["eval_acc"],
        stale=per_token(steps, "stale_token_frac"),
        lag=per_token(steps, "lag_mean"),
        spanning=sum(m["spanning_frac"] for m in steps) / len(steps),
        gen_idle=(gen.get("idle", 0) + gen.get("draining", 0)) / total,
        waiting=trainer.get("waiting", 0) / total,
        discarded=ledger["tokens"]["discarded"] / ledger["tokens"]["generated"],
        recomputed=ledger["tokens"]["recomputed"] / ledger["tokens"]["generated"],
        steps_per_min=60 * len(steps) / steps[-1]["wall_s"],
        to_target=reached[0] if reached else None,
        wall=steps[-1]["wall_s"],
        curve=[(m["wall_s"], m["eval_acc"]) for m in evals],
    )


def at_time(curve, t):
    """pass@1 at the run's last evaluation at or before simulated second t."""
    return [acc for wall, acc in curve if wall <= t + 1e-9][-1]


def equal_time(runs):
    """The table's equal time and each run's pass@1 then: from the curves, T the earliest end among
    the runs; for lines backfilled from RESULTS.md (no curve), the one time all of them state."""
    if all(s.get("curve") for s in runs):
        t = min(s["curve"][-1][0] for s in runs)
        return f"{t:.0f}", [at_time(s["curve"], t) for s in runs]
    times = set.intersection(*(set(s.get("at_s") or ()) for s in runs))
    if len(times) != 1:
        raise ValueError("a table mixes fresh runs with lines copied from RESULTS.md: run all its rows again")
    (t,) = times
    return t, [s["at_s"][t] for s in runs]


def lines_of(name):
    """[(label, every committed line of that row, oldest first)] of one experiment, in its order."""
    lines = marked.read("course")
    return [(label, [s for s in lines if [name, label] in s["rows"]]) for label, _ in EXPERIMENTS[name][1]]


def choose(found):
    """lines_of's rows -> [(label, the line its table shows)]. A table is built from one kind of line: each
    row's last run of this tool (with a curve) when every row on file has one, else each row's line copied
    from RESULTS.md. A run is a row of several experiments (`stale` at the defaults is one of six), so a
    run of one experiment leaves the others' tables as they were until all their rows are run; a row
    with no line of the kind chosen is left out, as a row never run is."""
    found = [(label, lines) for label, lines in found if lines]
    fresh = all(any(s.get("curve") for s in lines) for _, lines in found)
    chosen = [(label, [s for s in lines if bool(s.get("curve")) == fresh]) for label, lines in found]
    return [(label, lines[-1]) for label, lines in chosen if lines]


def rows_of(name):
    """[(label, the committed line its table shows)] of one experiment, in its order (choose)."""
    return choose(lines_of(name))


def table(name):
    """One row per run: pass@1 at equal steps (the end) and at equal simulated time (the
    earliest end among the rows, T: each run's last evaluation by then), then where the time went."""
    what, _ = EXPERIMENTS[name]
    rows = rows_of(name)
    if not rows:
        return f"**{name}**: {what}: not run at this clock yet (`lab/course.py {name}`)"
    t, equal = equal_time([s for _, s in rows])
    head = (
        f"| | pass@1 start -> end | pass@1 at {t} s | s to 0.55 | steps/min | stale tokens | lag "
        "| answers spanning a push | generator idle or draining | trainer waiting | discarded / recomputed tokens |"
    )
    lines = [f"**{name}**: {what} (simulated seconds)", "", head, "|---" * 11 + "|"]
    for (label, s), at_t in zip(rows, equal):
        lines.append(
            f"| {label} | {s['start']:.3f} -> {s['final']:.3f} | {at_t:.3f} | "
            + (f"{s['to_target']:.0f}" if s["to_target"] is not None else "-")
            + f" | {s['steps_per_min']:.1f} | {100 * s['stale']:.1f}% | {s['lag']:.2f} | "
            f"{100 * s['spanning']:.0f}% | {100 * s['gen_idle']:.0f}% | {100 * s['waiting']:.0f}% | "
            f"{100 * s['discarded']:.0f}% / {100 * s['recomputed']:.0f}% |"
        )
    return "\n".join(lines)


def regime(label):
    """The last committed line of one row of the regimes table."""
    return dict(rows_of("regimes"))[label]


def cell(name, label, key, fmt="{:.0f}%"):
    """A value: one row's share, in percent, the row named by the end of its label."""
    return lambda: fmt.format(100 * [s for lab, s in rows_of(name) if lab.endswith(label)][0][key])


def cells(name, labels, key):
    """A value: the range of one number over some rows (labels: a tuple of label ends), "lo-hi%"."""

    def build():
        got = sorted(100 * s[key] for lab, s in rows_of(name) if lab.endswith(labels))
        return f"{got[0]:.0f}-{got[-1]:.0f}%"

    return build


TABLES = {f"course-{name}": functools.partial(table, name) for name in EXPERIMENTS}
VALUES = {  # the course's numbers from its tables: the worked examples, the sentences under the tables
    "drain-lag": lambda: f"{regime('drain')['lag']:.2f}",  # and the worked example's
    "drain-idle": lambda: f"{100 * regime('drain')['gen_idle']:.0f}%",  # the README's regimes table
    "sync-idle": lambda: f"{100 * regime('sync')['gen_idle']:.0f}%",
    "speed-x2-stale": cell("speed", "(x2)", "stale", fmt="{:.1f}%"),  # the course's sentences under its tables
    "speed-x4-stale": cell("speed", "(x4)", "stale", fmt="{:.1f}%"),
    "speed-x4-idle": cell("speed", "(x4)", "gen_idle"),
    "speed-fast-wait": cells("speed", ("(x0.5)", "(x0.25)"), "waiting"),
    "speed-fast-idle": cells("speed", ("(x0.5)", "(x0.25)"), "gen_idle"),
    "speed-x05-stale": cell("speed", "(x0.5)", "stale", fmt="{:.1f}%"),
    "speed-x025-stale": cell("speed", "(x0.25)", "stale", fmt="{:.1f}%"),
    "speed-x05-span": cell("speed", "(x0.5)", "spanning"),
    "speed-x025-span": cell("speed", "(x0.25)", "spanning"),
    "answers-stale": cell("answers", "default preset", "stale", fmt="{:.1f}%"),
    "lossagg-spread": lambda: "{:.1f}".format(100 * (max(f := [s["final"] for _, s in rows_of("loss_agg")]) - min(f))),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiments", nargs="*", help=f"which of {', '.join(EXPERIMENTS)} (default: all)")
    p.add_argument("--out", default=os.path.join("out", "course"), help="where the runs go")
    p.add_argument(
        "--table-only",
        action="store_true",
        help="no new runs: the tables from the runs on disk (or lab/data), into the pages",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each on one thread)")
    args = p.parse_args()
    unknown = [e for e in args.experiments if e not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment {unknown[0]!r}: choose from {', '.join(EXPERIMENTS)}")
    import lesson

    first = {}  # lesson.py's settings -> the first run directory that has them
    rows = {}  # that directory -> every (experiment, label) it is a row of
    for name, (_, runs) in EXPERIMENTS.items():
        for label, flags in runs:
            key = json.dumps(lesson.parse_config([*flags, "--out", "-"]), sort_keys=True)
            first.setdefault(
                key,
                os.path.join(args.out, name, "".join(c for c in label.replace("--", "_") if c.isalnum() or c in "._-")),
            )
            rows.setdefault(first[key], []).append([name, label])
    wanted = {}  # run directory -> its flags, for the experiments asked for, in order
    for name in args.experiments or EXPERIMENTS:
        for label, flags in EXPERIMENTS[name][1]:
            wanted.setdefault(first[json.dumps(lesson.parse_config([*flags, "--out", "-"]), sort_keys=True)], flags)
    todo = [(run, flags) for run, flags in wanted.items() if not finished(run)]
    code = marked.commit()  # once, before the first line is written (a written data file reads as a change)
    if todo and not args.table_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: run_lesson(*job, code), todo))
    for run, flags in wanted.items():
        if finished(run):
            record(run, flags, rows[run])
    for name in args.experiments or EXPERIMENTS:
        print(table(name) + "\n", flush=True)
    for name in EXPERIMENTS:
        found = [lines for _, lines in lines_of(name) if lines]
        fresh = sum(any(s.get("curve") for s in lines) for lines in found)
        if 0 < fresh < len(found):
            print(
                f"{name}: {fresh} of its {len(found)} rows run by this tool; its table shows the lines copied from "
                f"RESULTS.md until all are (lab/course.py {name})",
                file=sys.stderr,
            )
    for page, name in marked.write(TABLES, values=VALUES):
        print(f"wrote {name} into {page}", file=sys.stderr)


def run_lesson(run, flags, code):
    """One lesson.py run into `run`, on one thread; `code`, the commit that ran it, beside its files."""
    print(f"lesson.py {' '.join(flags)} -> {run}", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "lesson.py"), *flags, "--out", run, "--no-plot"],
        check=True,
        stdout=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    with open(os.path.join(run, "code.txt"), "w") as f:
        f.write(code)


def record(run, flags, rows):
    """The run's summary onto lab/data/course.jsonl, unless its last line there says the same already
    (a second --table-only adds nothing): the tables are built from those lines alone."""
    line = dict(
        summary(run),
        rows=rows,
        flags=list(flags),
        seed=json.load(open(os.path.join(run, "config.json")))["seed"],
        code=open(stamp).read().strip() if os.path.exists(stamp := os.path.join(run, "code.txt")) else None,
        processor=marked.processor(),
        answers_md5=hashlib.md5(open(os.path.join(run, "answers.jsonl"), "rb").read()).hexdigest(),
    )
    marked.record("course", line, key=("rows",))


if __name__ == "__main__":
    main()
