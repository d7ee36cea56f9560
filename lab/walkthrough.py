"""
The course's worked examples (docs/course.md, "Worked examples"), written from two short runs of
lesson.py at its default costs: `--max-lag`, batch by batch, and `sync` against `stale`, second by
second. The runs are the ones the course asks a student to make:

    .venv/bin/python lab/walkthrough.py               # the two runs (a minute each), their lines, the pages
    .venv/bin/python lab/walkthrough.py --table-only  # the tables and values from lab/data/walkthrough.jsonl

Each run's line on lab/data/walkthrough.jsonl holds what the tables show (its commit, processor and
answers' md5 beside it), so the pages are rebuilt from the data alone, as every table's.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import marked  # noqa: E402
from system.runlog import read_jsonl  # noqa: E402

FLAGS = ("--preset", "long", "--steps", "8", "--eval-every", "0")  # the course's command, less --regime and --out
REGIMES = ("stale", "sync")


def summary(run):
    """One run's line: each step's times, and each batch (a step's worth of groups) as its answers tell it."""
    cfg = json.load(open(os.path.join(run, "config.json")))
    metrics = [m for m in read_jsonl(os.path.join(run, "metrics.jsonl")) if "trained_tokens" in m]
    events = read_jsonl(os.path.join(run, "events.jsonl"))
    loads = sorted((e["t1"], e["t0"], e["version"]) for e in events if e.get("mark") == "load")
    train = [e["t"] for e in events if e.get("proc") == "trainer" and e.get("what") == "training"]
    ready = [e["t"] for e in events if e.get("proc") == "trainer" and e.get("what") == "syncing"]
    steps = [
        dict(step=m["step"], version=m["version"], run_tokens=m["run_tokens"], start=t, ready=r, load=[t0, t1])
        for m, t, r, (t1, t0, _) in zip(metrics, train, ready, loads)
    ]
    P, batches = cfg["prompts_per_step"], {}
    for a in read_jsonl(os.path.join(run, "answers.jsonl")):
        if a["fate"] != "consumed":
            continue
        b = batches.setdefault(a["group_id"] // P, dict(admitted=[], steps=set(), lags=set(), tokens=0, stale=0))
        b["admitted"].append(a["admitted"])
        b["steps"].add(a["step"])
        b["finished"] = max(b.get("finished", 0), a["finished"])
        trained_with = metrics[a["step"] - 1]["version"]
        for _, _, version, tokens, stale in a["segments"]:
            b["lags"].add(trained_with - version)
            b["tokens"] += tokens
            b["stale"] += tokens if stale else 0
    rows = []
    for n, b in sorted(batches.items()):
        first = min(b["admitted"])
        rows.append(
            dict(
                batch=n,
                admitted=[first, max(b["admitted"])],
                version=sum(t1 <= first + 1e-9 for t1, _, _ in loads),  # the weights the generator held then
                steps=sorted(b["steps"]),
                lags=sorted(b["lags"]),
                tokens=b["tokens"],
                stale=b["stale"],
                finished=b["finished"],
            )
        )
    return dict(regime=cfg["regime"], max_lag=cfg["max_lag"], P=P, train_s=cfg["train_s"], steps=steps, batches=rows)


def line(regime):
    """The last committed line of one run."""
    return [r for r in marked.read("walkthrough") if r["regime"] == regime][-1]


def batch_table():
    """`stale`'s eight batches: when each was admitted, under which weights, and what it trained on."""
    s = line("stale")
    P, k, steps = s["P"], s["max_lag"], {x["step"]: x for x in s["steps"]}
    out = [
        f"| batch b (its groups) | admitted at (s) | generator's version then, v | b <= v + {k}? | trained by step "
        "| with version | lags of its tokens | stale tokens | that step's push loads |",
        "|---" * 9 + "|",
    ]
    for b in s["batches"]:
        (step,) = b["steps"]
        t0, t1 = b["admitted"]
        out.append(
            f"| {b['batch']} ({P * b['batch']}-{P * b['batch'] + P - 1}) | "
            + (f"{t0:.2f}" if t1 - t0 < 5e-3 else f"{t0:.2f}-{t1:.2f}")
            + f" | v{b['version']} | {b['batch']} <= {b['version'] + k} | {step} | v{steps[step]['version']} | "
            f"{', '.join(map(str, b['lags']))} | {b['stale']}/{b['tokens']} ({100 * b['stale'] / b['tokens']:.1f}%) | "
            f"v{step} at {steps[step]['load'][1]:.2f} s |"
        )
    return "\n".join(out)


def happenings(s, until):
    """[(time, what)] of one run up to `until`: each batch's last answer, each step, each load, in the
    order they happen (at one moment: an answer ends, a push is ready, a load ends, a step starts)."""
    out = []
    for x in s["steps"]:
        tokens, ms, d = x["run_tokens"], 1e3 * s["train_s"], x["ready"] - x["start"]
        out.append((x["start"], 3, f"step {x['step']} trains: {tokens} tokens x {ms:.3f} ms = {d:.3f} s"))
        out.append((x["ready"], 1, f"v{x['step']} ready; its load starts at {x['load'][0]:.3f}"))
        out.append((x["load"][1], 2, f"v{x['step']} loaded"))
    for b in s["batches"]:
        out.append((b["finished"], 0, f"batch {b['batch']}'s last answer"))
    return [(t, w) for t, _, w in sorted(out) if t <= until + 1e-9]


def until():
    """The timeline's end: the moment `stale` has loaded v3."""
    return line("stale")["steps"][2]["load"][1]


def timeline_table():
    """`sync` and `stale` side by side, every happening until `stale` has loaded v3."""
    sync, stale, until_s = line("sync"), line("stale"), until()
    rows = [(t, w, "") for t, w in happenings(sync, until_s)] + [(t, "", w) for t, w in happenings(stale, until_s)]
    out = ["| s | `sync` | `stale` |", "|---|---|---|"]
    for t, a, b in sorted(rows, key=lambda r: (r[0], r[1] == "")):  # stable: each run's own order kept
        out.append(f"| {t:.3f} | {a} | {b} |")
    return "\n".join(out)


def steps_by(regime, t):
    return sum(x["load"][1] <= t + 1e-9 for x in line(regime)["steps"])


TABLES = {"walkthrough-batches": batch_table, "walkthrough-timeline": timeline_table}
VALUES = {  # the numbers the worked examples' sentences quote
    "walk-until": lambda: f"{until():.2f}",
    "walk-sync-steps": lambda: str(steps_by("sync", until())),
    "walk-stale-8": lambda: f"{line('stale')['steps'][-1]['load'][1]:.1f}",
    "walk-sync-8": lambda: f"{line('sync')['steps'][-1]['load'][1]:.1f}",
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out", help="the runs go to OUT/stale-8 and OUT/sync-8, as the course names them")
    p.add_argument("--table-only", action="store_true", help="no new runs: the pages from the committed lines")
    args = p.parse_args()
    if not args.table_only:
        for regime in REGIMES:
            run = os.path.join(args.out, f"{regime}-8")
            print(f"lesson.py --regime {regime} {' '.join(FLAGS)} --out {run}", file=sys.stderr, flush=True)
            lesson = [sys.executable, os.path.join(ROOT, "lesson.py"), "--regime", regime, *FLAGS]
            subprocess.run([*lesson, "--out", run, "--no-plot"], check=True, stdout=subprocess.DEVNULL)
            md5 = hashlib.md5(open(os.path.join(run, "answers.jsonl"), "rb").read()).hexdigest()
            stamp = dict(code=marked.commit(), processor=marked.processor(), answers_md5=md5)
            marked.record("walkthrough", dict(summary(run), **stamp), key=("regime",))
    print(batch_table() + "\n\n" + timeline_table())
    for page, name in marked.write(TABLES, values=VALUES):
        print(f"wrote {name} into {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
