"""
Runs train.py over regimes x pools x seeds for one preset, then writes the tables and
figures in RESULTS.md: eval accuracy against wall-clock, time to a target accuracy,
steps per minute, stale tokens, lag, and where each process's time went.

    python lab/sweep.py default             # 5 regimes x 3 seeds of plain train.py (~4.5-6.5 min a run, ~75 min on 2 cores)
    python lab/sweep.py long                # 5 x 5 of `train.py --preset long` (~3 min a run, 72 min;
                                        # ~1.6 min, 40 min, on a twice as fast 2-core machine),
                                        # then 5 x 3 of default for the contrast (~75 min)
    python lab/sweep.py long --no-contrast      # the long preset's runs only
    python lab/sweep.py long --regimes stale recompute --pools fifo pace   # PACE vs fifo, and vs the sync runs on disk
                                        # (10 PACE runs, ~5 min each, ~2.8 on the faster machine)
    python lab/sweep.py long --table-only   # run nothing, write the tables and figures of what finished
    python lab/sweep.py default --out /tmp/s -- --steps 3    # arguments after `--` go to every train.py run
    python lab/sweep.py default --regimes sync recompute --tree ../old --out out/old   # another commit's train.py

Runs go to <out>/<preset>/<regime>-<pool>-s<seed> (+ .log), <out> = out/sweep, one
at a time, seed by seed (a sweep cut short still has every regime at the first
seeds). A finished run (metrics reach its last step, ledger.json written) is
skipped; an unfinished one starts over, so an interrupted sweep picks up where it
stopped. `long` runs the default preset after its own runs, over --contrast-seeds,
for the contrast: what changes when answers are long (--no-contrast: not those).

What it writes (and prints):
    <out>/<preset>/table.md     one row per regime: mean ± std over seeds (sample std, n-1)
    <out>/<preset>/runs.md      one row per run
    <out>/<preset>/acc_vs_wall.png, time_share.png
    <out>/contrast.md, contrast.png   default vs long: every finished run of each on disk (first
                                      of --pools), whenever both presets have finished runs

Clocks: a run's wall_s (metrics.jsonl) counts from the trainer's "starting" event,
taken after its model is loaded and just before the generator starts, so it
includes the generator's start-up (ledger.json's startup_s, ~10 s on a CPU) but
not the trainer's imports and model load. An eval logged on a step row carries
that step's wall_s, taken before the evaluation ran: the moment the weights it
evaluates existed.

The committed record (lab/marked.py): with --record NAME, every finished run's summary (its
numbers and pass@1 curve, the processor and commit) goes onto lab/data/sweep.jsonl under NAME,
and the pages' sweep tables (TABLES) are rewritten from that file alone. Its first 37 lines
were copied from RESULTS.md's per-run tables of two sweeps (each says "source"; their run
directories were lost with their machines): final pass@1, exact as right / eval_n, and the long
preset's steps per minute as the table printed them (0.1).
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules (train, generator, ...), wherever this is run from
import regimes  # noqa: E402
from plot import COLOURS as ACTIVITY_COLOURS  # noqa: E402  (its timeline figure: plot.py's colours)
from system.runlog import per_token, read_jsonl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import marked  # noqa: E402
from stats import interval, mean_std, said, show_paired, t_interval, verdict  # noqa: E402

# Target eval accuracy per preset, for the "s to target" column and the dashed line, chosen
# before the sweep: halfway from the start to the end of pilot sync runs of the preset
# (default: 0.578 -> 0.758, one run; long: 0.469 -> 0.626, the mean of sync seeds 0-2 from
# the step-400 tiny-long; lab/archive.md). Earlier long presets' sweeps used 0.44 and 0.61.
TARGETS = {"default": 0.67, "long": 0.55}

REGIMES = list(regimes.REGIMES)  # every regime registered, in regimes.py's order (sync first: the claims' base)
# a regime not named here is drawn in grey
COLOURS = {"sync": "black", "drain": "tab:orange", "discard": "tab:red", "stale": "tab:blue", "recompute": "tab:green"}
GENERATOR = [
    "generating",
    "draining",
    "loading",
    "evaluating",
    "idle",
]  # the ledger's activities, stacked in this order
TRAINER = ["training", "waiting", "syncing", "evaluating", "saving"]
EST_S = {"default": 300, "long": 175}  # seconds a run takes on 2 cores, until a run of this sweep has finished
PUBLISHED = [  # the published study's numbers, as reference rows of the contrast table
    ("published study: GSM8K", "<1", "-", "-", "-", "-"),
    ("published study: MATH", "38", "-", "-", "-", "-"),
]


def run_dir(out, preset, regime, pool, seed):
    return os.path.join(out, preset, f"{regime}-{pool}-s{seed}")


def summary(run):
    """The numbers of a finished run, or None (missing, unfinished, fewer than 2 evals)."""
    if not all(os.path.exists(os.path.join(run, f)) for f in ("config.json", "metrics.jsonl", "ledger.json")):
        return None
    with open(os.path.join(run, "config.json")) as f:
        cfg = json.load(f)
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_acc" in r]
    if not steps or steps[-1]["step"] < cfg["steps"] or len(evals) < 2:
        return None
    with open(os.path.join(run, "ledger.json")) as f:
        ledger = json.load(f)
    # steps per minute: from the start of step 1 (the trainer's first "waiting", after
    # start-up and the step-0 eval) to the end of the last step, evals in between included
    events = read_jsonl(os.path.join(run, "events.jsonl"))
    t0 = min(e["t"] for e in events if e["proc"] == "trainer" and e.get("what") == "starting")  # wall_s = 0
    first = min(e["t"] for e in events if e["proc"] == "trainer" and e.get("what") == "waiting") - t0
    tok, gen, trn = ledger["tokens"], ledger["seconds"]["generator"], ledger["seconds"]["trainer"]
    trained = sum(r["trained_tokens"] for r in steps)
    rejected = sum(r.get("rejected_tokens", 0) for r in steps)
    cpu0 = next((r["cpu_s"] for r in steps if "cpu_s" in r), None)
    return dict(
        run=run,
        regime=cfg["regime"],
        pool=cfg["pool"],
        seed=cfg["seed"],
        cfg=cfg,
        acc0=evals[0]["eval_acc"],
        acc1=evals[-1]["eval_acc"],
        curve=[(r["wall_s"], r["eval_acc"]) for r in evals],
        # CPU-seconds of both processes from the end of step 1 (start-up and the step-0 eval excluded)
        cpu_curve=None if cpu0 is None else [(max(0.0, r.get("cpu_s", cpu0) - cpu0), r["eval_acc"]) for r in evals],
        steps_per_min=len(steps) / ((steps[-1]["wall_s"] - first) / 60),
        stale=per_token(steps, "stale_token_frac"),
        lag=statistics.mean(r["lag_mean"] for r in steps),
        spanning=statistics.mean(r["spanning_frac"] for r in steps),
        gen_idle=(gen.get("idle", 0) + gen.get("draining", 0)) / sum(gen.values()),
        discarded=tok["discarded"] / tok["generated"],
        recomputed=tok["recomputed"] / tok["generated"],
        rejected=rejected / (trained + rejected),
        groups_rejected=sum(r.get("rejected_groups", 0) for r in steps),
        groups_trained=len(steps) * cfg["prompts_per_step"],
        gen_share={k: v / sum(gen.values()) for k, v in gen.items()},
        trainer_share={k: v / sum(trn.values()) for k, v in trn.items()},
    )


def smooth(curve, k=3):
    """The eval curve with each accuracy the mean of the k evals centred on it (fewer
    at the ends): one eval's noise (256-512 problems: +-2-3 points) does not decide."""
    accs = [acc for _, acc in curve]
    h = k // 2
    return [(t, statistics.mean(accs[max(0, i - h) : i + h + 1])) for i, (t, _) in enumerate(curve)]


def time_to(curve, target):
    """When the smoothed curve first reaches target, interpolated between the two evals
    around the crossing; None if it never does."""
    sm = smooth(curve)
    if sm[0][1] >= target:
        return sm[0][0]
    for (t0, a0), (t1, a1) in zip(sm, sm[1:]):
        if a1 >= target:
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return None


def acc_at(curve, t):
    """The smoothed curve's accuracy at time t (linear between evals; None past its end)."""
    import numpy as np

    sm = smooth(curve)
    return None if t > sm[-1][0] else float(np.interp(t, *zip(*sm)))


def cpu_to(r, acc):
    """CPU-seconds (both processes, from the end of step 1) until the run's smoothed
    curve first reaches acc; None if it never does or the run has no CPU clock."""
    return None if acc is None or r["cpu_curve"] is None else time_to(r["cpu_curve"], acc)


@functools.lru_cache(maxsize=None)
def mean_answer_tokens(run):
    """Mean tokens of the answers a run's steps trained; answers.jsonl read once per run,
    though table() and runs_table() both ask."""
    lengths, _ = answer_lengths([dict(run=run)])
    return statistics.mean(lengths) if lengths else None


def equal_wall_clock(rows):
    """The wall-clock every run reached: the earliest last eval of any run."""
    return min(r["curve"][-1][0] for r in rows)


def sync_final(rows):
    """sync's final accuracy, the mean over its runs (PACE's second claim); None without sync runs."""
    sync = [r["acc1"] for r in rows if (r["regime"], r["pool"]) == ("sync", "fifo")]
    return statistics.mean(sync) if sync else None


def pairs(rows, a, b, value):
    """(value(run of regime-pool a), value(run of b)) for each seed that has both, None left out."""
    by = lambda key: {r["seed"]: value(r) for r in rows if (r["regime"], r["pool"]) == key}
    va, vb = by(a), by(b)
    return [(va[s], vb[s]) for s in sorted(va) if s in vb and va[s] is not None and vb[s] is not None]


def paired(rows, a, b, value):
    """value(run of regime-pool a) - value(run of b), paired by seed: (mean, 95% bootstrap
    interval over seeds, n). Seeds where either value is None are left out."""
    import random

    d = [x - y for x, y in pairs(rows, a, b, value)]
    if len(d) < 2:
        return None
    rng = random.Random(0)
    means = sorted(statistics.mean(rng.choices(d, k=len(d))) for _ in range(10000))
    return statistics.mean(d), (means[249], means[9749]), len(d)


def columns(rows, target):
    """(header, value of one run, format) for both tables. None: the run never reached the target."""
    cols = [
        ("final eval pass@1", lambda r: r["acc1"], "{:.3f}"),
        ("gain (points)", lambda r: 100 * (r["acc1"] - r["acc0"]), "{:+.1f}"),
        (
            f"s to {target}" if target is not None else "s to target",
            lambda r: None if target is None else time_to(r["curve"], target),
            "{:.0f}",
        ),
        ("steps/min", lambda r: r["steps_per_min"], "{:.1f}"),
        ("stale tokens %", lambda r: 100 * r["stale"], "{:.1f}"),
        ("lag", lambda r: r["lag"], "{:.2f}"),
        ("spanning answers %", lambda r: 100 * r["spanning"], "{:.1f}"),
        ("generator idle+draining %", lambda r: 100 * r["gen_idle"], "{:.1f}"),
        ("discarded / generated %", lambda r: 100 * r["discarded"], "{:.1f}"),
        ("recomputed / generated %", lambda r: 100 * r["recomputed"], "{:.1f}"),
    ]
    if any(r["pool"] == "pace" for r in rows):  # what PACE threw away, and its two claims, run by run
        t_eq, goal = equal_wall_clock(rows), sync_final(rows)
        cols += [
            ("rejected tokens %", lambda r: 100 * r["rejected"], "{:.1f}"),
            ("groups rejected per group trained", lambda r: r["groups_rejected"] / r["groups_trained"], "{:.2f}"),
            ("answer tokens trained (mean)", lambda r: mean_answer_tokens(r["run"]), "{:.1f}"),
            (f"pass@1 at {t_eq:.0f} s (smoothed)", lambda r: acc_at(r["curve"], t_eq), "{:.3f}"),
        ]
        if target is not None:
            cols.append((f"CPU-s to {target}", lambda r: cpu_to(r, target), "{:.0f}"))
        if goal is not None:
            cols.append((f"CPU-s to sync's final {goal:.3f}", lambda r: cpu_to(r, goal), "{:.0f}"))
    return cols


def groups(rows):
    """Runs by (regime, pool), regimes in the usual order."""
    keys = sorted({(r["regime"], r["pool"]) for r in rows}, key=lambda k: (REGIMES.index(k[0]), k[1]))
    return [(regime, pool, [r for r in rows if (r["regime"], r["pool"]) == (regime, pool)]) for regime, pool in keys]


def markdown(header, lines):
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(line) + " |" for line in lines]
    )


def table(rows, target):
    """One line per regime and pool: mean ± std over seeds."""
    cols = columns(rows, target)
    lines = []
    for regime, pool, rs in groups(rows):
        cells = [regime, pool, str(len(rs))]
        for header, value, fmt in cols:
            values = [v for r in rs if (v := value(r)) is not None]
            if header.startswith(("s to", "CPU-s to")):  # over the seeds that got there
                cells.append(
                    "-"
                    if header == "s to target"
                    # no target given
                    else f"{mean_std(values, fmt) if values else '-'} ({len(values)}/{len(rs)} reached)"
                )
            else:
                cells.append(mean_std(values, fmt) if values else "-")
        lines.append(cells)
    return markdown(["regime", "pool", "seeds"] + [c[0] for c in cols], lines)


def runs_table(rows, target):
    """One line per run."""
    cols = columns(rows, target)
    lines = [
        [r["regime"], r["pool"], str(r["seed"])]
        + ["-" if (v := value(r)) is None else fmt.format(v) for _, value, fmt in cols]
        for _, _, rs in groups(rows)
        for r in sorted(rs, key=lambda r: r["seed"])
    ]
    return markdown(["regime", "pool", "seed"] + [c[0] for c in cols], lines)


NOTES = """\
- final eval pass@1: greedy, the run's last evaluation; gain: from its first (step 0)
- s to target: when the run's eval curve, smoothed over 3 evaluations, first reaches the target (interpolated between evaluations; mean over the seeds that reached it)
- steps/min: optimizer steps / minutes from the start of step 1 (after start-up and the step-0 eval) to the end of the last step, evaluations in between included
- stale tokens: token-weighted share of trained tokens; lag, spanning answers: means of the steps' lag_mean, spanning_frac
- generator idle+draining: share of the generator's time in ledger.json; discarded, recomputed: share of generated tokens (ledger.json)"""
PACE_NOTES = """\
- PACE's columns: rejected tokens, share of the trained and rejected tokens; groups rejected per group trained (metrics.jsonl);
  answer tokens trained: mean over the answers the steps consumed (answers.jsonl); pass@1 at T s: the smoothed curve at
  the shortest run's last evaluation (equal wall-clock); CPU-s to X: both processes' CPU-seconds from the end of step 1
  until the smoothed curve reaches X (- never)"""


def setting(preset, rows):
    """'long preset: synth 1-12 operations, tiny model, 3 seeds'"""
    cfg = rows[0]["cfg"]
    task = f"synth {cfg['synth_steps']} operations" if cfg["dataset"] == "synth" else cfg["dataset"]
    n = len({r["seed"] for r in rows})
    return f"{preset} preset: {task}, {os.path.basename(os.path.normpath(cfg['model']))} model, {n} seed{'s' * (n > 1)}"


def answer_lengths(rows):
    """Tokens of every answer a step trained on, over the runs (answers.jsonl), or the
    steps' mean answer_len (metrics.jsonl) where a run has no answers.jsonl; and which."""
    lengths, source = [], "answers"
    for r in rows:
        path = os.path.join(r["run"], "answers.jsonl")
        if os.path.exists(path):
            lengths += [a["tokens"] for a in read_jsonl(path) if a["fate"] == "consumed"]
        else:
            lengths += [
                m["answer_len"] for m in read_jsonl(os.path.join(r["run"], "metrics.jsonl")) if "answer_len" in m
            ]
            source = "step means"
    return sorted(lengths), source


def contrast_table(by_preset):
    """default vs long: what the `stale` regime sees, the answers' length, and the pace of `sync`;
    then the published study's numbers."""
    lines = []
    for preset, rows in by_preset.items():
        stale = [r for r in rows if r["regime"] == "stale"]
        sync = [r for r in rows if r["regime"] == "sync"]
        mean = lambda rs, f: f"{statistics.mean(map(f, rs)):.2f}" if rs else "-"
        lengths, source = answer_lengths(stale)
        pct = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]
        lines.append(
            [
                f"{preset} preset (stale: {len(stale)} seed{'s' * (len(stale) > 1)})",
                mean(stale, lambda r: 100 * r["stale"]),
                mean(stale, lambda r: 100 * r["spanning"]),
                mean(stale, lambda r: r["lag"]),
                f"{pct(0.5):.0f} / {pct(0.9):.0f} / {lengths[-1]:.0f}"
                + (" (step means)" if source != "answers" else "")
                if lengths
                else "-",
                mean(sync, lambda r: r["steps_per_min"]),
            ]
        )
    lines += [list(row) for row in PUBLISHED]
    return markdown(
        [
            "",
            "stale tokens % (stale)",
            "spanning answers % (stale)",
            "lag (stale)",
            "answer length p50 / p90 / max, tokens (stale)",
            "steps/min (sync)",
        ],
        lines,
    )


def analysis(rows, target):
    """The seed's claims, each a comparison paired by seed with its 95% bootstrap
    interval (10,000 resamples of the seeds): a difference exceeds the spread when the
    interval excludes 0; and the paired t-test's interval beside it. Then, when --pool pace
    runs exist, PACE's two claims."""
    keys = {(r["regime"], r["pool"]) for r in rows}
    t_eq = equal_wall_clock(rows)
    claims = []
    if target is not None:
        claims += [
            (
                f"s to {target} (smoothed): {x} - drain",
                (x, "fifo"),
                ("drain", "fifo"),
                lambda r: time_to(r["curve"], target),
                "{:+.0f} s",
            )
            for x in ("stale", "recompute")
        ]
    claims += [
        ("final pass@1: stale - recompute", ("stale", "fifo"), ("recompute", "fifo"), lambda r: r["acc1"], "{:+.3f}")
    ]
    # does the main job still learn as sync does? (lab/archive.md, "Does it learn?": every regime against sync)
    claims += [
        (f"final pass@1: {x} - sync", (x, "fifo"), ("sync", "fifo"), lambda r: r["acc1"], "{:+.3f}")
        for x in REGIMES[1:]
    ]
    claims += [
        (
            f"pass@1 at {t_eq:.0f} s: {x} - drain",
            (x, "fifo"),
            ("drain", "fifo"),
            lambda r: acc_at(r["curve"], t_eq),
            "{:+.3f}",
        )
        for x in ("stale", "recompute")
    ]
    claims += [
        ("steps/min: stale - drain", ("stale", "fifo"), ("drain", "fifo"), lambda r: r["steps_per_min"], "{:+.1f}")
    ]
    goal = sync_final(rows)
    if goal is not None and any(pool == "pace" for _, pool in keys):
        for regime in sorted({k[0] for k in keys if k[1] == "pace"}, key=REGIMES.index):
            claims += [
                (
                    f"final pass@1: {regime} pace - {regime} fifo",
                    (regime, "pace"),
                    (regime, "fifo"),
                    lambda r: r["acc1"],
                    "{:+.3f}",
                ),
                (
                    f"pass@1 at {t_eq:.0f} s: {regime} pace - {regime} fifo",
                    (regime, "pace"),
                    (regime, "fifo"),
                    lambda r: acc_at(r["curve"], t_eq),
                    "{:+.3f}",
                ),
                (
                    f"pass@1 at {t_eq:.0f} s: {regime} pace - sync",
                    (regime, "pace"),
                    ("sync", "fifo"),
                    lambda r: acc_at(r["curve"], t_eq),
                    "{:+.3f}",
                ),
                (
                    f"CPU-s to sync's final {goal:.3f}: {regime} pace - sync",
                    (regime, "pace"),
                    ("sync", "fifo"),
                    lambda r: cpu_to(r, goal),
                    "{:+.0f}",
                ),
                (
                    f"CPU-s to sync's final {goal:.3f}: {regime} fifo - sync",
                    (regime, "fifo"),
                    ("sync", "fifo"),
                    lambda r: cpu_to(r, goal),
                    "{:+.0f}",
                ),
            ]
            # every regime plateaus near sync's final accuracy, so whether a run reaches it is
            # close to chance (lab/archive.md); the target, where the curves still climb, separates them
            if target is not None:
                claims += [
                    (
                        f"CPU-s to {target}: {regime} {pool} - sync",
                        (regime, pool),
                        ("sync", "fifo"),
                        lambda r: cpu_to(r, target),
                        "{:+.0f}",
                    )
                    for pool in ("pace", "fifo")
                ]
    lines = []
    for name, a, b, value, fmt in claims:
        if a in keys and b in keys and (p := paired(rows, a, b, value)):
            m, (lo, hi), n = p
            # the same as a share of b's mean over the paired seeds: can these seeds see a 10% difference?
            both = pairs(rows, a, b, value)
            base = statistics.mean(y for _, y in both)
            share = "-" if not base else f"{100 * m / base:+.1f}% [{100 * lo / base:+.1f}, {100 * hi / base:+.1f}]"
            t = t_interval([x - y for x, y in both])
            lines.append(
                [
                    name,
                    fmt.format(m),
                    f"[{fmt.format(lo)}, {fmt.format(hi)}]",
                    share,
                    str(n),
                    "yes" if lo > 0 or hi < 0 else "no",
                    f"[{fmt.format(t[0])}, {fmt.format(t[1])}]" if t else "-",
                ]
            )
    return (
        markdown(
            [
                "comparison, paired by seed",
                "mean difference",
                "95% interval",
                "as % of the second's mean",
                "seeds",
                "exceeds the spread",
                "t-test 95% interval",
            ],
            lines,
        )
        if lines
        else ""
    )


# -----------------------------------------------------------------------------
# the committed record, and the tables written from it

KEPT = ("regime", "pool", "seed", "acc0", "acc1", "curve", "cpu_curve", "steps_per_min", "stale", "lag", "spanning")
KEPT += ("gen_idle", "discarded", "recomputed", "rejected", "gen_share", "trainer_share")


def record(rows, name, preset, tree=ROOT):
    """Each finished run's summary, a line of lab/data/sweep.jsonl (once: recording again adds nothing)."""
    where = dict(processor=marked.processor(), commit=marked.commit(tree))
    for r in rows:
        line = dict({k: r[k] for k in KEPT}, sweep=name, preset=preset, eval_n=r["cfg"]["eval_n"], **where)
        line.update(right=round(r["acc1"] * line["eval_n"]))
        marked.record("sweep", line, key=["sweep", "regime", "pool", "seed"])
    for page, table in marked.write(TABLES, values=VALUES):
        print(f"wrote table {table} in {page}")


def recorded(sweep):
    """{(regime, pool, seed): line} of one recorded sweep, the last line for each run."""
    return {(r["regime"], r["pool"], r["seed"]): r for r in marked.read("sweep") if r["sweep"] == sweep}


def difference(sweep, a, b):
    """Final pass@1 of regime a - regime b (fifo runs), in points, paired by seed."""
    runs = list(recorded(sweep).values())
    return [100 * (x - y) for x, y in pairs(runs, (a, "fifo"), (b, "fifo"), lambda r: r["acc1"])]


# the comparisons the pages quote, each one of analysis()'s claims for its sweep: (sweep, a, b)
QUOTED = [
    ("long-3935084", "stale", "recompute"),
    ("issue51-f4a32f1", "recompute", "sync"),
    ("issue51-9bcf05e", "recompute", "sync"),  # issue 51's other commit: the same sync runs
]


def finals_table():
    """Every recorded sweep's final pass@1, per regime and seed, then the quoted comparisons."""
    data = marked.read("sweep")
    lines = [["sweep", "regime", "pool", "final pass@1 by seed (0, 1, ...)", "mean ± sd", "processor", "source"]]
    for sweep in sorted({r["sweep"] for r in data}):
        for regime, pool, rs in groups(list(recorded(sweep).values())):
            rs = sorted(rs, key=lambda r: r["seed"])
            finals = [r["acc1"] for r in rs]
            source = "recorded" if "source" not in rs[0] else "copied"
            cells = [" / ".join(f"{v:.3f}" for v in finals), mean_std(finals, "{:.3f}"), rs[0]["processor"], source]
            lines.append([sweep, regime, pool, *cells])
    table = markdown(lines[0], lines[1:])
    quoted = [[f"{q[0]}: {q[1]} - {q[2]}", said(d), str(len(d))] for q in QUOTED for d in [difference(*q)]]
    return (
        table
        + "\n\n"
        + markdown(["final pass@1, paired by seed (points)", "mean [95% t] verdict; 80%", "seeds"], quoted)
    )


def quoted(i):
    """The i-th quoted comparison as the README says it: 'mean [low, high], verdict', in points."""
    m, lo, hi, _ = interval(difference(*QUOTED[i]))
    return f"{show_paired((m, lo, hi))}, {verdict(lo, hi)}"


def pace_ratios(sweep, a, b):
    """Steps a minute of regime a over regime b (fifo runs), paired by seed: 'min-max'."""
    runs = list(recorded(sweep).values())
    r = [x / y for x, y in pairs(runs, (a, "fifo"), (b, "fifo"), lambda r: r["steps_per_min"])]
    return f"{min(r):.2f}-{max(r):.2f}x"


TABLES = {"sweep-finals": finals_table}
VALUES = {  # the README's train.py sentences
    "t-level": lambda: quoted(0),
    "t-cost": lambda: quoted(1),
    "t-cost-9bcf05e": lambda: quoted(2),
    "t-stale-drain-sweep": lambda: pace_ratios("long-3935084", "stale", "drain"),
}


# -----------------------------------------------------------------------------
# figures


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acc(ax, rows, target):
    """Eval accuracy vs wall-clock, one curve per regime (and pool): each seed's evals
    linearly interpolated on a common grid, from the latest first eval to the earliest
    last eval of the seeds; line = mean, band = min-max over seeds, dots = the evals."""
    import numpy as np

    for regime, pool, rs in groups(rows):
        colour, ls = COLOURS.get(regime, "tab:gray"), "--" if pool == "pace" else "-"
        grid = np.linspace(max(r["curve"][0][0] for r in rs), min(r["curve"][-1][0] for r in rs), 100)
        accs = np.array([np.interp(grid, *zip(*r["curve"])) for r in rs])
        label = regime if len({r["pool"] for r in rows}) == 1 else f"{regime} ({pool})"
        ax.plot(grid, accs.mean(0), color=colour, ls=ls, label=label)
        ax.fill_between(grid, accs.min(0), accs.max(0), color=colour, alpha=0.15, lw=0)
        for r in rs:
            ax.plot(*zip(*r["curve"]), ".", color=colour, ms=2)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target}")
    ax.set_xlabel("wall-clock (s from the trainer's start)")
    ax.set_ylabel("eval pass@1 (greedy)")
    ax.legend(fontsize=7)


def plot_shares(ax, rows, procs):
    """Stacked shares of each process's time (ledger.json), mean over seeds, one bar per
    regime (and pool) and process in procs; x labels in the regimes' colours."""
    labels = []
    width = 0.8 / len(procs)
    for i, (regime, pool, rs) in enumerate(groups(rows)):
        for j, proc in enumerate(procs):
            bottom = 0
            for what in GENERATOR if proc == "generator" else TRAINER:
                share = statistics.mean(
                    r["gen_share" if proc == "generator" else "trainer_share"].get(what, 0) for r in rs
                )
                ax.bar(
                    i + (j - (len(procs) - 1) / 2) * width,
                    share,
                    width * 0.9,
                    bottom=bottom,
                    color=ACTIVITY_COLOURS[what],
                    edgecolor="black",
                    lw=0.3,
                )
                bottom += share
            if len(procs) > 1:
                ax.text(i + (j - (len(procs) - 1) / 2) * width, 1.01, proc[0].upper(), ha="center", fontsize=7)
        labels.append(regime if len({r["pool"] for r in rows}) == 1 else f"{regime}\n{pool}")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    for tick, (regime, _, _) in zip(ax.get_xticklabels(), groups(rows)):
        tick.set_color(COLOURS.get(regime, "tab:gray"))
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("share of the process's time")


def activity_legend(ax, procs):
    from matplotlib.patches import Patch

    names = list(dict.fromkeys(w for p in procs for w in (GENERATOR if p == "generator" else TRAINER)))
    ax.legend(
        handles=[Patch(facecolor=ACTIVITY_COLOURS[w], edgecolor="black", lw=0.3, label=w) for w in names],
        fontsize=6,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )


def figures(preset, rows, target, folder):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    plot_acc(ax, rows, target)
    ax.set_title(
        f"{setting(preset, rows)}\nmean over seeds, band min-max (seeds interpolated between\n"
        "their evals, up to the shortest seed's last)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "acc_vs_wall.png"), dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, proc in zip(axes, ["generator", "trainer"]):
        plot_shares(ax, rows, [proc])
        ax.set_title(proc, fontsize=9)
        activity_legend(ax, [proc])
    fig.suptitle(f"where the time went (ledger.json, mean over seeds), {setting(preset, rows)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "time_share.png"), dpi=100)
    plt.close(fig)
    print(f"wrote {folder}/acc_vs_wall.png, {folder}/time_share.png")


def contrast_figure(by_preset, targets, path):
    """2x2: a row per preset; accuracy vs wall-clock, and the time-share bars
    (G = generator, T = trainer) side by side per regime."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(8.4, 5.8), gridspec_kw=dict(width_ratios=[1, 1.2]))
    for (preset, rows), (acc_ax, share_ax) in zip(by_preset.items(), axes):
        plot_acc(acc_ax, rows, targets[preset])
        acc_ax.set_title(f"{setting(preset, rows)}\nmean over seeds, band min-max", fontsize=8)
        plot_shares(share_ax, rows, ["generator", "trainer"])
        share_ax.set_title(f"{preset} preset: where the time went (G generator, T trainer)", fontsize=8)
        activity_legend(share_ax, ["generator", "trainer"])
    fig.tight_layout()
    fig.savefig(path, dpi=90)  # four panels: a smaller dpi keeps the file near the others' size
    plt.close(fig)
    print(f"wrote {path}")


# -----------------------------------------------------------------------------
# the sweep


def finished_on_disk(out, preset, regimes, pools):
    """Every finished run of a preset in <out>/<preset>, whatever its seed."""
    folder = os.path.join(out, preset)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    rows = [
        s for name in names if os.path.isdir(os.path.join(folder, name)) and (s := summary(os.path.join(folder, name)))
    ]
    return [r for r in rows if r["regime"] in regimes and r["pool"] in pools]


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset", choices=["default", "long"], help="train.py's settings: plain, or --preset long")
    p.add_argument("--regimes", nargs="+", default=REGIMES, choices=REGIMES)
    p.add_argument("--pools", nargs="+", default=["fifo"], choices=["fifo", "pace"])
    # long: 5 seeds, as its regimes differ by less than 3 seeds' spread (README)
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0-2, and 0-4 for long")
    p.add_argument(
        "--contrast-seeds",
        nargs="+",
        type=int,
        default=[0, 1, 2],
        help="seeds of the default preset's runs that `long` adds, for the contrast",
    )
    p.add_argument("--no-contrast", action="store_true", help="`long`: the long preset's runs only")
    p.add_argument("--target", type=float, default=None, help="target eval accuracy (default: TARGETS[preset])")
    p.add_argument("--out", default="out/sweep", help="parent directory of the presets' run directories")
    p.add_argument("--table-only", action="store_true", help="run nothing, write the tables of finished runs")
    p.add_argument(
        "--record",
        metavar="NAME",
        default=None,
        help="append every finished run's summary to lab/data/sweep.jsonl as sweep NAME, rewrite its tables",
    )
    p.add_argument(
        "--tree",
        default=ROOT,
        help="the checkout whose train.py runs (another commit, for a before/after: `git worktree add DIR COMMIT`)",
    )
    args = p.parse_args(argv)
    args.seeds = args.seeds or ([0, 1, 2, 3, 4] if args.preset == "long" else [0, 1, 2])
    targets = dict(TARGETS, **({args.preset: args.target} if args.target is not None else {}))

    # seed by seed, so a sweep cut short still has every regime and pool at the first seeds
    plan = [(args.preset, r, pool, s) for s in args.seeds for pool in args.pools for r in args.regimes]
    if args.preset == "long":  # the contrast, once the long sweep is complete
        plan += [
            ("default", r, pool, s)
            for s in ([] if args.no_contrast else args.contrast_seeds)
            for pool in args.pools
            for r in args.regimes
        ]
    todo = [] if args.table_only else [x for x in plan if not summary(run_dir(args.out, *x))]
    if not args.table_only:
        print(f"{len(plan) - len(todo)} of {len(plan)} runs finished already, {len(todo)} to run", flush=True)
    took = {"default": [], "long": []}  # seconds per run, this sweep
    for i, (preset, regime, pool, seed) in enumerate(todo):
        run = run_dir(args.out, preset, regime, pool, seed)
        left = sum(statistics.mean(took[x[0]]) if took[x[0]] else EST_S[x[0]] for x in todo[i:])
        print(f"[{i + 1}/{len(todo)}] {run} (about {left / 60:.0f} min left)", flush=True)
        shutil.rmtree(run, ignore_errors=True)  # an unfinished run starts over
        os.makedirs(os.path.dirname(run), exist_ok=True)
        cmd = [
            sys.executable,
            os.path.join(args.tree, "train.py"),
            "--regime",
            regime,
            "--pool",
            pool,
            "--seed",
            str(seed),
            "--out",
            run,
            "--no-plot",
            *(["--preset", "long"] if preset == "long" else []),
            *extra,
        ]
        t0 = time.time()
        with open(run + ".log", "w") as log:
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
                print(f"  failed: see {run}.log", flush=True)
        took[preset].append(time.time() - t0)

    folder = os.path.join(args.out, args.preset)
    rows = [s for x in plan if x[0] == args.preset and (s := summary(run_dir(args.out, *x)))]
    if "pace" in args.pools and "sync" not in args.regimes:  # PACE's claims are against sync: its runs on disk
        rows += [s for seed in args.seeds if (s := summary(run_dir(args.out, args.preset, "sync", "fifo", seed)))]
    if rows:
        target = targets[args.preset]
        notes = NOTES + ("\n" + PACE_NOTES if any(r["pool"] == "pace" for r in rows) else "")
        text = (
            f"# {setting(args.preset, rows)}, target {target if target is not None else '-'}\n\n"
            f"{table(rows, target)}\n\n{notes}\n\n{analysis(rows, target)}\n"
        )
        print(text)
        with open(os.path.join(folder, "table.md"), "w") as f:
            f.write(text)
        with open(os.path.join(folder, "runs.md"), "w") as f:
            f.write(f"# {setting(args.preset, rows)}, one row per run\n\n{runs_table(rows, target)}\n\n{notes}\n")
        print(f"wrote {folder}/table.md, {folder}/runs.md")
        figures(args.preset, rows, target, folder)
        if args.record:
            record(rows, args.record, args.preset, args.tree)
    else:
        print(f"no finished runs in {folder}")

    # the contrast: every finished run of each preset on disk, of the first pool
    pool = args.pools[0]
    by_preset = {preset: finished_on_disk(args.out, preset, args.regimes, [pool]) for preset in ("default", "long")}
    if all(by_preset.values()):
        text = f"# short vs long answers (every finished {pool} run of each preset)\n\n{contrast_table(by_preset)}\n"
        print(text)
        with open(os.path.join(args.out, "contrast.md"), "w") as f:
            f.write(text)
        contrast_figure(by_preset, targets, os.path.join(args.out, "contrast.png"))


if __name__ == "__main__":
    main()
