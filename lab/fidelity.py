"""
Does the lesson's simulated clock keep time as the real trainer does? The five regimes on the
default and the long preset, run by train.py (two processes, the wall clock; >= 3 seeds a cell:
its run-to-run spread is part of the answer) and by lesson.py at the costs fitted from those same
runs (tools/clock_costs.py), side by side.

    .venv/bin/python lab/fidelity.py train                         # train.py's runs, one at a time, alone
    .venv/bin/python tools/clock_costs.py out/fidelity/train/*     # the costs those runs took
    .venv/bin/python lab/fidelity.py lesson --jobs 2 COSTS...      # lesson.py's runs at those costs
    .venv/bin/python lab/fidelity.py own --jobs 2                  # ... each at its own train.py run's costs
    .venv/bin/python lab/fidelity.py table                         # the tables, from lab/data/fidelity.jsonl
    .venv/bin/python lab/fidelity.py causes out/fidelity/*/*-s?    # what two misses turn on, from the runs' files

Each run's summary goes onto lab/data/fidelity.jsonl (its commit, processor, load average at its
start and end); a finished run is not run again.
"""

import argparse
import bisect
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import marked  # noqa: E402
import regimes  # noqa: E402
from system.runlog import activity_spans, per_token, read_jsonl  # noqa: E402

PRESETS = {"default": (), "long": ("--preset", "long")}
REGIMES = tuple(regimes.REGIMES)  # every regime registered, in regimes.py's order: a sixth is run too
SEEDS = (0, 1, 2)


def summary(run):
    """What a run's files say about its time and its tokens, the same for both programs. Its time
    is counted from the end of start-up (train.py's process and engine start; the lesson has none)
    to its last step, evaluations included: both spend that time."""
    metrics = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [m for m in metrics if "trained_tokens" in m]
    evals = [m for m in metrics if "eval_acc" in m]
    ledger = json.load(open(os.path.join(run, "ledger.json")))
    gen, trainer, total = ledger["seconds"].get("generator", {}), ledger["seconds"]["trainer"], ledger["total_s"]
    tokens = ledger["tokens"]
    seconds = steps[-1]["wall_s"] - ledger["startup_s"]
    return dict(
        steps=len(steps),
        seconds=seconds,
        steps_per_min=60 * len(steps) / seconds,
        stale=per_token(steps, "stale_token_frac"),
        lag=per_token(steps, "lag_mean"),
        spanning=sum(m["spanning_frac"] for m in steps) / len(steps),
        gen_idle=(gen.get("idle", 0) + gen.get("draining", 0)) / total,
        gen_draining=gen.get("draining", 0) / total,
        trainer_waiting=trainer.get("waiting", 0) / total,
        trainer_training=trainer.get("training", 0) / total,
        trainer_syncing=trainer.get("syncing", 0) / total,
        # the limit asynchrony chases: one step per max(generation, training) time, evaluations apart
        bound_steps_per_min=60
        * len(steps)
        / (
            max(sum(gen.get(k, 0) for k in ("generating", "draining", "loading")), trainer.get("training", 0))
            + trainer.get("evaluating", 0)
        ),
        recomputed=tokens["recomputed"] / tokens["generated"],
        discarded=tokens["discarded"] / tokens["generated"],
        final=evals[-1]["eval_acc"],
        answers_md5=hashlib.md5(open(os.path.join(run, "answers.jsonl"), "rb").read()).hexdigest(),
    )


# the columns of the fidelity table: (name, key, format)
COLUMNS = [
    ("steps/min", "steps_per_min", "{:.1f}"),
    ("stale tokens", "stale", "{:.0%}"),
    ("lag", "lag", "{:.2f}"),
    ("answers spanning a push", "spanning", "{:.0%}"),
    ("generator idle or draining", "gen_idle", "{:.0%}"),
    ("trainer waiting", "trainer_waiting", "{:.0%}"),
    ("recomputed / generated", "recomputed", "{:.0%}"),
    ("discarded / generated", "discarded", "{:.0%}"),
]


def within(lesson, real):
    """The rule, written before the lesson's runs: the lesson's mean lies within the real runs'
    min-max, or within 10% of their mean, whichever is wider."""
    lo, hi, mean = min(real), max(real), sum(real) / len(real)
    return lo - 1e-12 <= lesson <= hi + 1e-12 or abs(lesson - mean) <= 0.1 * abs(mean) + 1e-12


def rows(program, costs=None):
    """{(preset, regime): [rows of its seeds]} of one program, the last line of each run; the
    lesson's at the pooled costs, or with costs="own" at its own train.py run's (own_costs)."""
    last = {}
    for r in marked.read("fidelity"):
        if r["program"] == program and r.get("costs") == costs:
            last[r["preset"], r["regime"], r["seed"]] = r
    out = {}
    for (preset, regime, _), r in sorted(last.items()):
        out.setdefault((preset, regime), []).append(r)
    return out


def seeds(n):
    return f"{n} seed" + "s" * (n != 1)


def outside(sim, real, key):
    """Whether the lesson's seeds' mean of `key` lies outside the rule (within) against train.py's runs."""
    return not within(sum(r[key] for r in sim) / len(sim), [r[key] for r in real])


def misses(costs=None):
    """(lesson numbers outside the rule, lesson numbers compared): a number 0 in the lesson and in every
    train.py run by the regime's design (`sync`'s lag, `stale`'s discarded tokens) is not counted."""
    real, sim, out, n = rows("train.py"), rows("lesson.py", costs), 0, 0
    for cell, l in sim.items():
        for _, key, _ in COLUMNS:
            if real.get(cell) and any(r[key] for r in [*l, *real[cell]]):
                n += 1
                out += outside(l, real[cell], key)
    return out, n


def fidelity_table():
    """train.py (each cell its seeds' mean and min-max) against lesson.py at the fitted costs (its
    seeds' mean), a mark on each lesson number outside the rule (within)."""
    real, sim, own = rows("train.py"), rows("lesson.py"), rows("lesson.py", "own")
    head = "| preset | regime | | " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for preset in PRESETS:
        for regime in REGIMES:
            t, l = real.get((preset, regime)), sim.get((preset, regime))
            if not t:
                continue
            cells = []
            for _, key, fmt in COLUMNS:
                v = [r[key] for r in t]
                cells.append(f"{fmt.format(sum(v) / len(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})")
            lines.append(f"| {preset} | `{regime}` | train.py, {seeds(len(t))} | " + " | ".join(cells) + " |")
            for name, l in (("", l), (", own costs", own.get((preset, regime)))):
                if l:
                    cells = []
                    for _, key, fmt in COLUMNS:
                        mean = sum(r[key] for r in l) / len(l)
                        cells.append(fmt.format(mean) + (" **x**" if outside(l, t, key) else ""))
                    lines.append(f"| | | lesson.py, {seeds(len(l))}{name} | " + " | ".join(cells) + " |")
    text = (
        "{} of {} lesson numbers outside the rule (**x**; a number 0 by the regime's design in both, "
        "`sync`'s lag say, is not counted)".format(*misses())
    )
    if own:
        text += "; at each run's own costs, {} of {}".format(*misses("own"))
    return "\n".join(lines) + "\n\n" + text + "."


# the comparisons the course asks a student to predict: (name, numerator, denominator or None, key)
RATIOS = [
    ("`stale` / `sync` steps/min", "stale", "sync", "steps_per_min"),
    ("`stale` / `drain` steps/min", "stale", "drain", "steps_per_min"),
    ("`discard` / `drain` steps/min", "discard", "drain", "steps_per_min"),
    ("`drain`: generator idle or draining", "drain", None, "gen_idle"),
]


def ratio(program, preset, a, b, key, costs=None):
    """[one value per seed]: a's over b's (the same seed's runs, made one after the other, so a
    machine's drift over the afternoon is in both), or a's alone."""
    got = {
        (r["regime"], r["seed"]): r[key]
        for cell in rows(program, costs).values()
        for r in cell
        if r["preset"] == preset
    }
    seeds = sorted({s for (reg, s) in got if reg == a and (b is None or (b, s) in got)})
    return [got[a, s] / got[b, s] if b else got[a, s] for s in seeds]


def ratio_table():
    """The comparisons the course asks about, train.py's seed by seed (mean and min-max) beside the lesson's."""
    lines = ["| preset | | " + " | ".join(name for name, *_ in RATIOS) + " |", "|---|---|" + "---|" * len(RATIOS)]
    for preset in PRESETS:
        for program, costs, name in (
            ("train.py", None, ""),
            ("lesson.py", None, ""),
            ("lesson.py", "own", ", own costs"),
        ):
            n = len(ratio(program, preset, "sync", None, "seed", costs))
            if not n:
                continue
            cells = []
            for _, a, b, key in RATIOS:
                v = ratio(program, preset, a, b, key, costs)
                fmt = "{:.0%}" if b is None else "{:.2f}x"
                spread = f" ({fmt.format(min(v))}-{fmt.format(max(v))})" if len(v) > 1 else ""
                cells.append(fmt.format(sum(v) / len(v)) + spread if v else "-")
            lines.append(f"| {preset} | {program}, {seeds(n)}{name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bound_table():
    """How close the real pipeline comes to its bound: steps per minute of a perfect overlap."""
    real = rows("train.py")
    lines = ["| preset | regime | steps/min | perfect overlap | share of the bound |", "|---|---|---|---|---|"]
    for preset in PRESETS:
        for regime in ("sync", "stale", "recompute"):
            t = real.get((preset, regime))
            if t:
                got = sum(r["steps_per_min"] for r in t) / len(t)
                bound = sum(r["bound_steps_per_min"] for r in t) / len(t)
                lines.append(f"| {preset} | `{regime}` | {got:.1f} | {bound:.1f} | {got / bound:.0%} |")
    return "\n".join(lines)


def real(regime, key, preset="long"):
    """train.py's seeds' mean of one number, on one preset."""
    v = [r[key] for r in rows("train.py")[preset, regime]]
    return sum(v) / len(v)


def readme_table():
    """The README's regimes table: train.py's own runs on the long preset, each number its seeds' mean."""
    t = rows("train.py")
    lines = [
        "| regime | pass@1 0.469 -> | steps/min | stale tokens | lag | generator idle or draining "
        "| trainer waiting for answers |",
        "|---" * 7 + "|",
    ]
    for regime in REGIMES:
        lo, hi = (f(r["steps_per_min"] for r in t["long", regime]) for f in (min, max))
        lines.append(
            f"| `{regime}` | {real(regime, 'final'):.3f} | {real(regime, 'steps_per_min'):.1f} ({lo:.1f}-{hi:.1f}) "
            f"| {100 * real(regime, 'stale'):.0f}% | {real(regime, 'lag'):.2f} | {100 * real(regime, 'gen_idle'):.0f}% "
            f"| {100 * real(regime, 'trainer_waiting'):.0f}% |"
        )
    return "\n".join(lines)


def within_count(costs=None):
    """The README's count: lesson numbers within the rule, of those compared."""
    out, n = misses(costs)
    return f"{n - out} of {n}"


def mean_ratio(a, b):
    v = ratio("train.py", "long", a, b, "steps_per_min")
    return f"{sum(v) / len(v):.2f}x"


CAUSED = [("default", "drain"), ("default", "stale"), ("long", "drain"), ("long", "stale")]


def causes(run):
    """What two misses turn on, from a run's files (RESULTS, What the tables say), keyed to its row
    of lab/data/fidelity.jsonl by its answers' md5: the trainer's waits during which no answer
    finished (the batch was done: what is left is taking the answers off the generator's queue), their
    share of the run and median; each answer's time from its first token to its last (median, upper
    quartile); the share of answers still being written at the next load (the spanning share); the
    generator's idle time by what it did before."""
    md5 = hashlib.md5(open(os.path.join(run, "answers.jsonl"), "rb").read()).hexdigest()
    row = next((r for r in marked.read("fidelity") if r["answers_md5"] == md5), None)
    if row is None:
        raise SystemExit(f"fidelity.py: {run} is not a run of lab/data/fidelity.jsonl (its answers differ)")
    events, answers = read_jsonl(os.path.join(run, "events.jsonl")), read_jsonl(os.path.join(run, "answers.jsonl"))
    total = json.load(open(os.path.join(run, "ledger.json")))["total_s"]
    spans = activity_spans(events)
    gen = [s for s in spans if s[0] == "generator"]
    idle = {}  # what the generator did before it idled -> [seconds idle]
    for (_, before, _, _), (_, what, t0, t1) in zip(gen, gen[1:]):
        if what == "idle":
            idle.setdefault(before, []).append(t1 - t0)
    done = sorted(a["finished"] for a in answers if a.get("finished"))
    waits = [  # no answer finished during the wait: the batch was done, what is left is taking it off the queue
        t1 - t0
        for p, what, t0, t1 in spans
        if p == "trainer" and what == "waiting" and bisect.bisect_right(done, t1) == bisect.bisect_right(done, t0)
    ]
    loads = sorted(e["t0"] for e in events if e.get("mark") == "load")
    times, written = [], 0
    for a in answers:
        first = a["segments"][0][0]
        i = bisect.bisect_right(loads, first)
        if a.get("finished") and i < len(loads):  # a load came after its first token
            times.append(a["finished"] - first)
            written += a["finished"] > loads[i]
    q1, median, q3 = statistics.quantiles(times, n=4)
    intervals = [b - a for a, b in zip(loads, loads[1:])]
    return dict(
        {k: row[k] for k in ("program", "preset", "regime", "seed", "commit", "processor", "answers_md5")},
        analysed=marked.commit(),
        waits_done=len(waits),
        waits_done_share=sum(waits) / total,
        waits_done_ms=1000 * statistics.median(waits) if waits else 0.0,
        answer_s=median,
        answer_s_q3=q3,
        answer_tokens=statistics.mean(a["tokens"] for a in answers if a.get("finished")),
        load_interval_s=statistics.median(intervals),
        answer_in_intervals=median / statistics.median(intervals),
        small_steps_over_clock=small_steps_over_clock(run),
        idle_after_generating=sum(idle.get("generating", [])) / total,  # it made all it may (--max-lag)
        idle_after_generating_ms=1000 * statistics.median(idle.get("generating", [0.0])),
        idle_after_evaluating=sum(idle.get("evaluating", [])) / total,
        written_at_load=written / len(times),
    )


def small_steps_over_clock(run):
    """The run's engine steps of under 96 answers while its trainer was not training (where long
    answers end), past the warm-up: their time over what the lesson's clock (its default costs)
    charges them."""
    import types

    import lesson
    from tools.clock_costs import engine_steps

    clock = lesson.SimClock(lesson.parse_config([]), types.SimpleNamespace(write=lambda *step: None))
    steps = [(s, a, kv, p) for s, a, kv, p, busy in engine_steps(run) if a < 96 and not busy]
    for _, a, kv, p in steps:  # charged as the lesson charges them, the trainer not training (no --busy-s)
        clock.spend("step", 0.0, a, kv, p)
    charged = clock.now()
    return sum(s for s, *_ in steps) / charged


def causes_table():
    """The numbers behind two misses (causes), each cell its seeds' mean (and min-max)."""
    got = {}
    for r in marked.read("fidelity-causes"):
        got.setdefault((r["preset"], r["regime"], r["program"]), {})[r["seed"]] = r
    lines = [
        "| preset | regime | | trainer waiting, no answer finishing (median) | an answer, first token to last: median "
        "(slowest quarter from) | the median answer in load intervals | still being written at the next load "
        "| steps < 96 answers, trainer not training: time / clock | generator idle after generating (median) "
        "| ... after evaluating |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(rs, k, fmt):  # the seeds' mean (min-max, where they differ)
        v = [r[k] for r in rs]
        lo, hi = fmt.format(min(v)), fmt.format(max(v))
        return fmt.format(sum(v) / len(v)) + (f" ({lo}-{hi})" if lo != hi else "")

    for preset, regime in CAUSED:
        for program in ("train.py", "lesson.py"):
            rs = list(got.get((preset, regime, program), {}).values())
            if rs:
                lines.append(
                    f"| {preset} | `{regime}` | {program}, {seeds(len(rs))} | {f(rs, 'waits_done_share', '{:.1%}')} "
                    f"({f(rs, 'waits_done_ms', '{:.0f}')} ms) | {f(rs, 'answer_s', '{:.2f}')} s "
                    f"({f(rs, 'answer_s_q3', '{:.2f}')}) | {f(rs, 'answer_in_intervals', '{:.2f}')} "
                    f"| {f(rs, 'written_at_load', '{:.0%}')} | {f(rs, 'small_steps_over_clock', '{:.2f}')} "
                    f"| {f(rs, 'idle_after_generating', '{:.1%}')} ({f(rs, 'idle_after_generating_ms', '{:.0f}')} ms) "
                    f"| {f(rs, 'idle_after_evaluating', '{:.1%}')} |"
                )
    return "\n".join(lines)


TABLES = {
    "fidelity": fidelity_table,
    "fidelity-ratios": ratio_table,
    "fidelity-bound": bound_table,
    "regimes-real": readme_table,
    "fidelity-causes": causes_table,
}
VALUES = {  # the README's: its numbers are train.py's (the lesson's are the course's, beside their check)
    "fidelity-within": within_count,
    "fidelity-own-within": lambda: within_count("own"),
    "t-sync-wait": lambda: f"{100 * real('sync', 'trainer_waiting'):.0f}%",
    "t-sync-pace": lambda: f"{real('sync', 'steps_per_min'):.1f}",
    "t-stale-pace": lambda: f"{real('stale', 'steps_per_min'):.1f}",
    "t-stale-sync": lambda: mean_ratio("stale", "sync"),
    "t-stale-drain": lambda: mean_ratio("stale", "drain"),
    "t-sync-bound": lambda: f"{real('sync', 'steps_per_min') / real('sync', 'bound_steps_per_min'):.0%}",
    "t-drain-idle": lambda: f"{100 * real('drain', 'gen_idle'):.0f}%",
    "t-discard-thrown": lambda: f"{100 * real('discard', 'discarded'):.0f}%",
    "t-stale": lambda: f"{100 * real('stale', 'stale'):.0f}%",
    "t-recompute-again": lambda: f"{100 * real('recompute', 'recomputed'):.0f}%",
}


def finished(run):
    try:
        steps = json.load(open(os.path.join(run, "config.json")))["steps"]
        return any(m.get("step") == steps for m in read_jsonl(os.path.join(run, "metrics.jsonl"))) and os.path.exists(
            os.path.join(run, "ledger.json")
        )
    except (OSError, ValueError, KeyError):
        return False


def load():
    return float(open("/proc/loadavg").read().split()[0])


def run_one(program, preset, regime, seed, extra, out, stamp):
    """One run into out/<program>/<preset>-<regime>-s<seed>, and its row onto the data file. train.py
    runs alone (its time is the measurement); lesson.py's at nice 19 on one thread (its time is counted)."""
    run = os.path.join(out, program, f"{preset}-{regime}-s{seed}")
    if finished(run):
        return
    if program == "own":  # fitted here, for the runs still to make: a finished one needs no train.py run
        extra = own_costs(out, preset, regime, seed) + extra
    args = [*PRESETS[preset], "--regime", regime, "--seed", str(seed), "--out", run, "--no-plot", *extra]
    script, env, nice = "train.py", None, []
    if program in ("lesson", "own"):
        script, env, nice = "lesson.py", dict(os.environ, OMP_NUM_THREADS="1"), ["nice", "-n", "19"]
    print(f"{time.strftime('%H:%M:%S')} {script} {' '.join(args)}", flush=True)
    start, t0 = load(), time.time()
    os.makedirs(os.path.dirname(run), exist_ok=True)
    with open(run + ".log", "w") as f:
        r = subprocess.run(
            [*nice, sys.executable, script, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        )
    if r.returncode:
        raise SystemExit(f"{script} failed: see {run}.log")
    row = dict(program=script, preset=preset, regime=regime, seed=seed, flags=extra, **stamp)
    if program == "own":
        row["costs"] = "own"
    row.update(
        date=time.strftime("%Y-%m-%d %H:%M"), load_start=start, load_end=load(), run_s=round(time.time() - t0, 1)
    )
    row.update(summary(run))
    marked.append("fidelity", row)
    print(
        f"  {row['steps_per_min']:.1f} steps/min, stale {100 * row['stale']:.1f}%, "
        f"gen idle {100 * row['gen_idle']:.0f}%, load {start:.2f} -> {row['load_end']:.2f}",
        flush=True,
    )


def own_costs(out, preset, regime, seed):
    """The lesson's cost flags fitted from one train.py run alone: the run of the same preset,
    regime and seed (own). The question, written before these runs: do the cells the pooled
    costs miss (the long preset's `drain` idle, the default preset's `discard` against `drain`)
    come out within the same rule (within) when each lesson seed keeps its own train.py run's
    speeds? Within: the machine's drift between runs, which one fit over all 30 averages away,
    made the miss. Still outside: the clock's form lacks something."""
    from tools.clock_costs import fit, flags

    run = os.path.join(out, "train", f"{preset}-{regime}-s{seed}")
    if not finished(run):
        raise SystemExit(f"fidelity.py: own costs need train.py's run {run} (lab/fidelity.py train)")
    return flags(fit([run])).split()


def run_all(program, extra, out, jobs=1):
    stamp = dict(commit=marked.commit(), processor=marked.processor())  # once: the rows make the tree differ
    cells = [(p, r, s) for s in SEEDS for p in PRESETS for r in REGIMES]
    if program == "train":
        jobs = 1  # alone on the machine: two at once would time each other
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda c: run_one(program, *c, extra, out, stamp), cells))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("program", choices=["train", "lesson", "own", "table", "causes"])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "fidelity"))
    p.add_argument("--jobs", type=int, default=1, help="lesson.py runs at a time (train.py's run alone)")
    a, extra = p.parse_known_args()  # the rest: flags for every run (the lesson's: its costs)
    if a.program == "causes":  # the rest: run directories
        for run in extra:
            if os.path.isdir(run) and ((row := causes(run))["preset"], row["regime"]) in CAUSED:
                marked.record("fidelity-causes", row, ("program", "preset", "regime", "seed"))
        print(causes_table())
        return
    if a.program != "table":
        run_all(a.program, extra, a.out, a.jobs)
    print(fidelity_table() + "\n\n" + ratio_table() + "\n\n" + bound_table())


if __name__ == "__main__":
    main()
