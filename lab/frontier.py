"""
Stale KV or recompute, and how far ahead? The staleness frontier on lesson.py's simulated clock:
pass@1 at fixed simulated budgets (equal time, exactly), for `--regime stale` (PipelineRL: new
weights read the KV the old ones wrote) and `--regime recompute` (AReaL: that KV rebuilt) at
`--max-lag` (AReaL's eta) 1, 2, 4, 8, beside `--regime sync`, at the long preset's learning rate
and 4x it, per loss, at two speeds of the trainer against the generator. Every finished run's
summary is appended to lab/data/frontier.jsonl, which is committed: the tables and the figure are
made from that file alone, so they outlive the machine that ran the grid, and a later session
picks the grid up where the file leaves it.

    .venv/bin/python lab/frontier.py                  # run what the data file lacks, in ORDER (hours)
    .venv/bin/python lab/frontier.py --only gen-slower-lr-x1/tis   # one (block, loss) of ORDER
    .venv/bin/python lab/frontier.py --table-only     # the tables, from lab/data/frontier.jsonl alone
    .venv/bin/python lab/frontier.py --figure         # docs/frontier.png, from the same file
    .venv/bin/python lab/frontier.py --rerun gen-slower-lr-x1/tis/stale-eta2-s0   # md5 of answers.jsonl again

Everything below but the rule against `sync` and its power was written down before the first
run of this grid (the grid of 2026-12-04, all `recompute`, at one learning rate, with eta 8 and
16 that never got past lag ~3, is in lab/archive.md as it was; nothing of it is reused).

The runs. Each cell is `lesson.py --preset long --lr-schedule constant --eval-every 0` with the
block's `--lr` and `--train-s`, the loss's flags, `--seed s` and `--eval-at` the block's budgets:
the run ends at the last budget, and pass@1 (greedy, the preset's 512 test problems) is taken of
the weights the generator held at each budget, evaluated after the run so that it costs the run
no simulated time. The schedule is constant so that a run's path up to time T does not depend on
how many steps it takes in all (a cosine over --steps would give sync, which takes fewer steps,
a different learning rate at the same time). One core a run, --jobs at once, at nice 19.

    block               | --train-s           | --lr               | losses
    gen-slower-lr-x1    | 1.16e-4 (the clock) | 6e-5 (the preset's) | tis, ppo, gspo
    gen-slower-lr-x4    | 1.16e-4             | 2.4e-4             | tis, ppo, gspo
    train-slower-lr-x4  | 4.64e-4 (4x)        | 2.4e-4             | ppo

and in each, `sync` and `stale`/`recompute` at --max-lag 1, 2, 4, 8, seeds 0-2. At the clock's
measured costs generation is the slower side: the generator holds at most two batches in flight
(max_num_seqs), so a run's lag stays near 3 whatever the bound (the last grid: eta 8 and 16 gave
byte-identical files). At 4x --train-s training is the slower side: the generator fills the pool
up to its bound, so the bound binds; each table gives the mean and the max lag each eta reached.
The losses: `tis` (the default: truncated pi_old/mu weights), `ppo` (AReaL's decoupled PPO: the
clip of pi/pi_old acts only when pi moves away from pi_old within a step, so it runs with
`--minibatches 4`, AReaL's default `ppo_n_minibatches` in areal/api/cli_args.py; AReaL's gsm8k
example sets 1, where its clip cannot bind either), `gspo` (per-answer ratios, the stress
experiment's best by its rule). Dropped, and why: `none` (the naive loss; the stress experiment
measured it), --max-lag 16 (unreachable unless training is the slower side; at 8 the bound
already sits past what the pool holds at the default costs), `tis` and `gspo` when training is
the slower side (the issue's grid: the bound-binding block with `ppo`), lr x1 there.

The rules:
- Budgets: per block, the simulated seconds at which its probe (`sync`, the block's first loss,
  seed 0, `--steps 40`) ends steps 10, 20 and 40, to 0.1 s. The probe runs first; its budgets
  are recorded in the data file and used by every run of the block.
- Stale against recompute: at each eta and budget, stale - recompute per seed (paired: the
  same seed samples the same problems), the mean with its 95% t interval over the seeds.
  "cannot tell" where the interval holds 0.
- 5 seeds (3, 4 added) for the `tis` stale and recompute runs at the (block, eta) where `tis`
  `stale` trained the largest mean share of stale tokens over seeds 0-2.

The rule against `sync` and its power, written after the runs and applied to data gathered under
the rule they replace (so not a pre-registration; issue 68 says why that one was unsound: the
best of 9 means, then uncorrected intervals against it, and each cell's power from its own pairs):
- Per block and loss, at its last budget: a block where every setting's mean pass@1, `sync`'s
  too, ends below the starting model (START) diverges, and is said so, not ranked.
- Otherwise each of the 8 other settings against the one reference, `sync` (on-policy),
  setting - sync per seed (seeds 0-2), its t interval at 1 - 0.05/8 (Bonferroni over the
  block's 8 comparisons): "better" or "worse" only where that interval excludes 0, else
  "cannot tell".
- Power, beside every interval (stale - recompute at 95%, setting - sync at 1 - 0.05/8): the
  difference the seeds detect 80% of the time, (t_level + t_.80) x sd / sqrt(n), with sd pooled
  over the block's differences of that kind (every eta and budget; every setting against
  `sync`), not each cell's own 3 pairs, whose spread is itself a guess (the interval's
  half-width alone is found only about half the time).
"""

import argparse
import collections
import functools
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
from system.runlog import per_token, read_jsonl  # noqa: E402
from stats import detectable, interval, mean_std, pooled_sd, said, show_paired, verdict  # noqa: E402

DATA = os.path.join(ROOT, "lab", "data", "frontier.jsonl")
SEEDS, EXTRA_SEEDS = (0, 1, 2), (3, 4)
ETAS = (1, 2, 4, 8)
REGIMES = ("stale", "recompute")
SETTINGS = [("sync", 0)] + [(regime, eta) for eta in ETAS for regime in REGIMES]  # the tables' row order
BASE = ("--preset", "long", "--lr-schedule", "constant", "--eval-every", "0", "--steps", "1000")
TRAIN_S = {"gen-slower": 1.16e-4, "train-slower": 4.64e-4}  # lesson.py's measured clock, and training 4x slower
LR = {"x1": 6e-5, "x4": 2.4e-4}  # the long preset's, and 4x it
LOSS_FLAGS = {"tis": (), "ppo": ("--minibatches", "4"), "gspo": ()}
BLOCKS = {  # name -> (trainer speed, learning rate, losses)
    "gen-slower-lr-x1": ("gen-slower", "x1", ("tis", "ppo", "gspo")),
    "gen-slower-lr-x4": ("gen-slower", "x4", ("tis", "ppo", "gspo")),
    "train-slower-lr-x4": ("train-slower", "x4", ("ppo",)),
}
ORDER = [  # (block, loss) in the order they run: the default loss first, at both rates, then the binding bound
    ("gen-slower-lr-x1", "tis"),
    ("gen-slower-lr-x4", "tis"),
    ("train-slower-lr-x4", "ppo"),
    ("gen-slower-lr-x1", "ppo"),
    ("gen-slower-lr-x4", "ppo"),
    ("gen-slower-lr-x1", "gspo"),
    ("gen-slower-lr-x4", "gspo"),
]
PROBE_STEPS = (10, 20, 40)  # the budgets: when the block's sync probe ends these steps
REFERENCE = ("sync", 0)  # the setting every other is compared with: the on-policy baseline
# pass@1 at step 0 of tiny-long, the long preset's warm start, on the 512 problems a run evaluates
# (docs/presets.md): the runs evaluate at the budgets alone (--eval-every 0), so the data file does not hold it
START = 0.469
DIVERGES = "diverges: every setting ends below the starting model"


def cell_flags(block, loss, regime, eta, seed):
    speed, lr, _ = BLOCKS[block]
    lag = ("--regime", "sync") if regime == "sync" else ("--regime", regime, "--max-lag", str(eta))
    speed_flags = ("--lr", str(LR[lr]), "--train-s", str(TRAIN_S[speed]))
    return (*BASE, *lag, "--loss", loss, *LOSS_FLAGS[loss], *speed_flags, "--seed", str(seed))


def cell_name(block, loss, regime, eta, seed):
    return f"{block}/{loss}/{regime}-eta{eta}-s{seed}"


def read_data(path=DATA):
    """{"budgets": {block: [t, ...]}, "runs": {cell name: summary}} from the data file."""
    budgets, runs = {}, {}
    for rec in read_jsonl(path) if os.path.exists(path) else []:
        if rec["kind"] == "budgets":
            budgets[rec["block"]] = rec["budgets"]
        else:
            runs[rec["cell"]] = rec
    return dict(budgets=budgets, runs=runs)


def append(rec, path=DATA):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")


def md5(path):
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def summarize(run):
    """What the tables need of one finished run, read from its files."""
    metrics = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [m for m in metrics if "trained_tokens" in m]
    at = read_jsonl(os.path.join(run, "eval_at.jsonl"))
    last = [a for a in read_jsonl(os.path.join(run, "eval_answers.jsonl")) if a["step"] == at[-1]["step"]]
    mean = lambda key: statistics.mean(v) if (v := [m[key] for m in steps if m.get(key) is not None]) else None
    trained = sum(m["trained_tokens"] for m in steps)
    return dict(
        acc={str(a["t"]): a["eval_acc"] for a in at},  # pass@1 at each budget (str: a JSON key)
        step_at={str(a["t"]): a["step"] for a in at},
        steps=len(steps),
        end_s=steps[-1]["wall_s"],
        steps_per_min=60 * len(steps) / steps[-1]["wall_s"],
        lag_mean=per_token(steps, "lag_mean"),
        lag_max=max(m["lag_max"] for m in steps),
        stale=per_token(steps, "stale_token_frac"),
        recomputed=sum(m.get("recomputed_tokens", 0) for m in steps) / max(trained, 1),
        ess=mean("ess"),
        kl=mean("kl"),
        clipped=mean("clipped_frac"),
        finished_right=sum(a["finished"] and a["right"] for a in last),  # at the last budget, of len(last)
        finished=sum(a["finished"] for a in last),
        answers=len(last),
        answers_md5=md5(os.path.join(run, "answers.jsonl")),
        processor=marked.processor(),
    )


def launch_one(flags, run, cores):
    """lesson.py with these flags into `run`, at nice 19, pinned to `cores`: a Popen."""
    os.makedirs(run, exist_ok=True)
    return subprocess.Popen(
        ["nice", "-n", "19", sys.executable, os.path.join(ROOT, "lesson.py"), *flags, "--out", run, "--no-plot"],
        stdout=open(os.path.join(run, "stdout.txt"), "w"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )


def run_all(jobs, todo, on_done):
    """Run each (name, flags, run directory) of todo, `jobs` at once, a core each; on_done(name, run, seconds)."""
    ncores = len(os.sched_getaffinity(0))
    running, free = [], list(range(jobs))
    while todo or running:
        while todo and free:
            name, flags, run = todo.pop(0)
            core = free.pop(0)
            print(f"{time.strftime('%H:%M:%S')} start {name} (core {core % ncores})", file=sys.stderr, flush=True)
            running.append((launch_one(flags, run, {core % ncores}), core, name, run, time.time()))
        time.sleep(2)
        for item in list(running):
            p, core, name, run, t0 = item
            if p.poll() is None:
                continue
            running.remove(item)
            free.append(core)
            if p.returncode:
                sys.exit(f"frontier.py: {name} failed (exit {p.returncode}): see {run}/stdout.txt")
            on_done(name, run, time.time() - t0)
            print(f"{time.strftime('%H:%M:%S')} done {name} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)


def probe_budgets(out, block, jobs):
    """The block's budgets by the rule: its sync probe's simulated time at the ends of PROBE_STEPS."""
    data = read_data()
    if block in data["budgets"]:
        return data["budgets"][block]
    loss = next(loss for b, loss in ORDER if b == block)
    run = os.path.join(out, block, "probe")
    flags = (*cell_flags(block, loss, "sync", 0, 0), "--steps", str(PROBE_STEPS[-1]))  # the last --steps wins
    run_all(1, [(f"{block}/probe", flags, run)], lambda *a: None)
    wall = {m["step"]: m["wall_s"] for m in read_jsonl(os.path.join(run, "metrics.jsonl")) if "wall_s" in m}
    budgets = [round(wall[s], 1) for s in PROBE_STEPS]
    append(dict(kind="budgets", block=block, budgets=budgets, probe=" ".join(flags), probe_steps=PROBE_STEPS))
    return budgets


def grid(block, loss, seeds=SEEDS, settings=SETTINGS):
    return [(block, loss, regime, eta, seed) for seed in seeds for regime, eta in settings]


def extension():
    """The rule's 5-seed pairs: tis stale and recompute, seeds 3-4, at the (block, eta) where tis stale
    trained the most stale tokens over seeds 0-2; None until those runs are all in the data file."""
    runs = read_data()["runs"]
    shares = {}
    for block, (_, _, losses) in BLOCKS.items():
        for eta in ETAS if "tis" in losses else ():
            cells = [runs.get(cell_name(block, "tis", "stale", eta, s)) for s in SEEDS]
            if None in cells:
                return None
            shares[(block, eta)] = statistics.mean(c["stale"] for c in cells)
    block, eta = max(shares, key=shares.get)
    return block, eta, shares[(block, eta)]


def run_grid(out, jobs, only=None):
    def done(name, run, seconds):
        block, loss, rest = name.split("/")
        flags = " ".join(flag_of[name])
        append(
            dict(
                kind="run",
                cell=name,
                block=block,
                loss=loss,
                flags=flags,
                runtime_s=round(seconds, 1),
                **summarize(run),
            )
        )

    flag_of = {}
    for block, loss in [tuple(only.split("/"))] if only else ORDER:
        budgets = probe_budgets(out, block, jobs)
        have = read_data()["runs"]
        todo = []
        for cell in grid(block, loss):
            name = cell_name(*cell)
            if name not in have:
                flag_of[name] = (*cell_flags(*cell), "--eval-at", ",".join(f"{t:g}" for t in budgets))
                todo.append((name, flag_of[name], os.path.join(out, name)))
        print(f"{block}/{loss}: {len(todo)} runs to go, budgets {budgets} s", file=sys.stderr, flush=True)
        run_all(jobs, todo, done)
        if not only and (ext := extension()):  # as soon as the tis blocks are in: the headline pairs first
            block, eta, _ = ext
            have, todo = read_data()["runs"], []
            for regime in REGIMES:
                for seed in EXTRA_SEEDS:
                    name = cell_name(block, "tis", regime, eta, seed)
                    if name not in have:
                        at = ",".join(f"{t:g}" for t in read_data()["budgets"][block])
                        flag_of[name] = (*cell_flags(block, "tis", regime, eta, seed), "--eval-at", at)
                        todo.append((name, flag_of[name], os.path.join(out, name)))
            run_all(jobs, todo, done)


# -----------------------------------------------------------------------------
# the tables, from the data file alone


def cells(runs, block, loss, regime, eta, seeds=SEEDS):
    got = [runs.get(cell_name(block, loss, regime, eta, s)) for s in seeds]
    return got if None not in got else None


def diverges(accs):
    """accs {setting: [pass@1 at the last budget per seed]} -> True where every setting's mean is below START."""
    return all(statistics.mean(a) < START for a in accs.values())


def against_sync(accs):
    """The rule: accs {setting: [pass@1 at the last budget per seed, seed order]}, sync among them -> None where
    the block diverges, else ({setting: (mean, low, high, verdict)} of each setting - sync in points, paired by
    seed, its t interval Bonferroni-corrected over the comparisons; the difference detectable with 80% power at
    that level from the sd pooled over all the comparisons' differences)."""
    if diverges(accs):
        return None
    ref = accs[REFERENCE]
    diffs = {k: [100 * (a - b) for a, b in zip(v, ref)] for k, v in accs.items() if k != REFERENCE}
    ruled = {}
    for k, d in diffs.items():
        m, lo, hi, _ = interval(d, tests=len(diffs))
        ruled[k] = (m, lo, hi, {"higher": "better", "lower": "worse"}.get(verdict(lo, hi), "cannot tell"))
    return ruled, detectable(pooled_sd(diffs.values()), len(ref), tests=len(diffs))


def block_table(data, block, loss):
    """The (block, loss) table: every setting at every budget, lag reached, off-policy measures, stale - recompute,
    and the rule against `sync`; with what the rule says: None (runs missing), DIVERGES, or against_sync's."""
    runs, budgets = data["runs"], data["budgets"].get(block)
    rows = {s: cells(runs, block, loss, *s) for s in SETTINGS}
    if budgets is None or None in rows.values():
        n = sum(1 for s in SETTINGS for seed in SEEDS if cell_name(block, loss, *s, seed) not in runs)
        return f"({block}, {loss}: {n} of {len(SETTINGS) * len(SEEDS)} runs not in the data file yet)", None
    speed, lr, _ = BLOCKS[block]
    ts = [str(t) for t in budgets]
    head = " | ".join(f"pass@1 at {float(t):g} s" for t in ts)
    lines = [
        f"**{block}, `{loss}`** (`--train-s {TRAIN_S[speed]:g} --lr {LR[lr]:g}{' '.join(('',) + LOSS_FLAGS[loss])}`; "
        f"budgets: `sync` seed 0's steps {', '.join(map(str, PROBE_STEPS))}); mean ± sd over seeds 0-{SEEDS[-1]}",
        "",
        f"| setting | {head} | steps by the last | steps/min | lag mean | lag max | stale tokens | recomputed "
        "| ESS | KL(mu‖pi) | clipped | finished & right at the last |",
        "|---" * (11 + len(ts)) + "|",
    ]
    on = collections.Counter(r.get("processor", "?") for rs in rows.values() for r in rs)
    lines[0] += "; runs by processor: " + ", ".join(f"{n} on {p}" for p, n in sorted(on.items()))
    pct = lambda rs, k, f="{:.1f}%": f.format(100 * statistics.mean(r[k] or 0 for r in rs))
    for (regime, eta), rs in rows.items():
        name = "sync" if regime == "sync" else f"{regime} eta {eta}"
        mean = lambda k, f: f.format(statistics.mean(r[k] for r in rs)) if all(r[k] is not None for r in rs) else "-"
        lines.append(
            f"| {name} | " + " | ".join(mean_std([r["acc"][t] for r in rs], "{:.3f}") for t in ts)
            + f" | {statistics.mean(r['steps'] for r in rs):.0f}"
            f" | {mean_std([r['steps_per_min'] for r in rs], '{:.1f}')}"
            f" | {mean('lag_mean', '{:.2f}')} | {max(r['lag_max'] for r in rs)}"
            f" | {pct(rs, 'stale')} | {pct(rs, 'recomputed', '{:.0f}%')}"
            f" | {mean('ess', '{:.3f}')} | {mean('kl', '{:.1e}')} | {pct(rs, 'clipped')}"
            f" | {statistics.mean(r['finished_right'] for r in rs):.0f} of {rs[0]['answers']} |"
        )  # fmt: skip
    diffs = {(eta, t): d for _, _, eta, t, d in stale_minus_recompute(data, [(block, loss)])}
    sd = pooled_sd(diffs.values())  # over every eta and budget: 3 pairs alone say little of their spread
    lines += [
        "",
        "stale - recompute, paired by seed (points: mean [95% t interval]; 80%: detectable from the block's "
        f"pooled sd, {sd:.1f} points over every eta and budget: the difference the seeds would detect with 80% power)",
        "",
    ]
    lines += ["| eta | " + " | ".join(f"at {float(t):g} s" for t in ts) + " |", "|---" * (1 + len(ts)) + "|"]
    for eta in ETAS:
        five = " (5 seeds)" if len(diffs[eta, ts[0]]) > len(SEEDS) else ""
        lines.append(f"| {eta}{five} | " + " | ".join(said(diffs[eta, t], sd) for t in ts) + " |")
    ruled = against_sync({k: [r["acc"][ts[-1]] for r in v] for k, v in rows.items()})
    lines.append("")
    if ruled is None:
        lines.append(f"Not ranked: at {float(ts[-1]):g} s this block {DIVERGES} ({START:.3f}).")
        return "\n".join(lines), DIVERGES
    against, power = ruled
    level = f"{1 - 0.05 / len(against):.1%}"
    lines.append(
        f"Against `sync` at {float(ts[-1]):g} s (each setting - `sync`, paired by seed; {level} t intervals, "
        f"Bonferroni over {len(against)}): "
        + "; ".join(f"{setting_name(k)} {show_paired(v[:3])} {v[3]}" for k, v in against.items())
        + f". 80%: detectable from the block's pooled sd at {level}: {power:.1f}."
    )
    return "\n".join(lines), ruled


def stale_minus_recompute(data, pairs=ORDER):
    """Every stale - recompute comparison of the (block, loss) pairs' finished runs: (block, loss, eta, budget,
    the paired differences in points), over seeds 0-4 where both regimes have them (the 5-seed rule), else 0-2."""
    runs, out = data["runs"], []
    for block, loss in pairs:
        for eta in ETAS:
            five = SEEDS + EXTRA_SEEDS
            seeds = five if all(cells(runs, block, loss, regime, eta, five) for regime in REGIMES) else SEEDS
            s, r = (cells(runs, block, loss, regime, eta, seeds) for regime in REGIMES)
            if s and r and block in data["budgets"]:
                for t in map(str, data["budgets"][block]):
                    out.append((block, loss, eta, t, [100 * (a["acc"][t] - b["acc"][t]) for a, b in zip(s, r)]))
    return out


def where(block, loss):
    """A (block, loss) in words: the loss, the rate, and which side is slower where the grid has both."""
    speed, lr, _ = BLOCKS[block]
    rate = "the preset's rate" if lr == "x1" else f"{lr[1:]}x the rate"
    both = sum(loss in losses for _, r, losses in BLOCKS.values() if r == lr) > 1
    side = {"gen-slower": "generation", "train-slower": "training"}[speed]
    return f"`{loss}` at {rate}" + (f", {side} the slower side" if both else "")


def sides(data):
    """The grid's stale - recompute comparisons, and those whose interval excludes 0 by side:
    {"higher": [...], "lower": [...]}, each (block, loss, eta, budget, mean, low, high, seeds)."""
    found, out = stale_minus_recompute(data), {"higher": [], "lower": []}
    for block, loss, eta, t, d in found:
        m, lo, hi, _ = interval(d)
        if verdict(lo, hi) != "cannot tell":
            out[verdict(lo, hi)].append((block, loss, eta, t, m, lo, hi, len(d)))
    return found, out


def counts(data=None):
    """What the pages say of the grid's stale - recompute intervals, each a value of VALUES: how many runs
    and intervals, how many hold 0, and each that does not, by side; how many would exclude 0 by chance."""
    data = data or read_data()
    found, side = sides(data)
    listed = {
        k: "; ".join(
            f"{where(b, loss)}, eta {eta}, {float(t):g} s: {show_paired((m, lo, hi))}"
            + (f", {n} seeds" if n > len(SEEDS) else "")
            for b, loss, eta, t, m, lo, hi, n in v
        )
        or "none"
        for k, v in side.items()
    }
    same = len(found) - len(side["higher"]) - len(side["lower"])
    return {
        "runs": str(len(data["runs"])),
        "intervals": str(len(found)),
        "pairs": str(len({x[:2] for x in found})),  # (block, loss) pairs
        "etas": str(len(ETAS)),
        "budgets": str(len({x[3] for x in found if x[:2] == found[0][:2]})),
        "same": str(same),  # intervals that hold 0
        "up": str(len(side["higher"])),  # favour stale
        "up-list": listed["higher"],
        "down": str(len(side["lower"])),  # favour recompute
        "down-list": listed["lower"],
        "luck": str(round(0.05 * len(found))),  # intervals that would exclude 0 by chance at 95%
    }


def tables(data):
    return "\n\n".join(block_table(data, block, loss)[0] for block, loss in ORDER)


def setting_name(k):
    return "`sync`" if k[0] == "sync" else f"`{k[0]}` eta {k[1]}"


def decision(data=None):
    """The table a user reads before a run: rows the trainer's speed, columns the learning rate; in each
    cell, per loss measured there, what the rule says at the last budget: `sync`'s pass@1, the settings
    better and worse than it, and the difference the block's seeds detect with 80% power; or that it diverges."""
    data = data or read_data()
    lines = [
        "| | the preset's lr (6e-5) | 4x (2.4e-4) |",
        "|---|---|---|",
    ]
    for speed, row in (("gen-slower", "generation is the slower side"), ("train-slower", "training is")):
        cells = []
        for lr in LR:
            block = next((b for b, (sp, r, _) in BLOCKS.items() if (sp, r) == (speed, lr)), None)
            if block is None:
                cells.append("not in the grid")
                continue
            said_here = []
            for loss in BLOCKS[block][2]:
                text, ruled = block_table(data, block, loss)
                if ruled is None:
                    said_here.append(f"`{loss}`: {text.strip('()').split(': ', 1)[1]}")
                    continue
                if ruled == DIVERGES:
                    said_here.append(f"`{loss}`: {DIVERGES} ({START:.3f})")
                    continue
                against, power = ruled
                t = str(data["budgets"][block][-1])
                sync = statistics.mean(r["acc"][t] for r in cells_of(data, block, loss, REFERENCE))
                by = {v: [k for k in against if against[k][3] == v] for v in ("better", "worse", "cannot tell")}
                told = [
                    f"{v}: " + (", ".join(f"{setting_name(k)} {show_paired(against[k][:3])}" for k in by[v]) or "none")
                    for v in ("better", "worse")
                ]
                n = len(by["cannot tell"])
                rest = f"all {n}" if n == len(against) else f"the other {n}"
                said_here.append(
                    f"`{loss}`: `sync` {sync:.3f}; " + "; ".join(told) + f"; cannot tell: {rest}; 80%: {power:.1f}"
                )
            cells.append("<br>".join(said_here))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cells_of(data, block, loss, setting):
    return cells(data["runs"], block, loss, *setting)


def block_text(block, loss):
    return block_table(read_data(), block, loss)[0]


TABLES = {f"frontier-{b}-{loss}": functools.partial(block_text, b, loss) for b, loss in ORDER} | {
    "frontier-decision": decision,
}
COUNTED = "runs intervals pairs etas budgets same up up-list down down-list luck".split()  # counts()
VALUES = {name: functools.partial(lambda name: counts()[name], name) for name in COUNTED}  # README's and course's


def figure(data, path):
    """pass@1 at the last budget against eta, stale and recompute (sync at 0), one panel per (block, loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [(b, loss) for b, loss in ORDER if block_table(data, b, loss)[1]]
    fig, axes = plt.subplots(1, max(1, len(done)), figsize=(3.6 * max(1, len(done)), 3.2), squeeze=False)
    for ax, (block, loss) in zip(axes[0], done):
        t = str(data["budgets"][block][-1])
        sync = [r["acc"][t] for r in cells(data["runs"], block, loss, "sync", 0)]
        ax.axhline(statistics.mean(sync), color="black", lw=1, label="sync")
        for regime, c in zip(REGIMES, ("tab:blue", "tab:green")):
            ys = [[r["acc"][t] for r in cells(data["runs"], block, loss, regime, eta)] for eta in ETAS]
            ax.plot(range(len(ETAS)), [statistics.mean(y) for y in ys], "o-", color=c, ms=3, label=regime)
            ax.fill_between(range(len(ETAS)), [min(y) for y in ys], [max(y) for y in ys], color=c, alpha=0.15, lw=0)
        ax.set_xticks(range(len(ETAS)), [str(e) for e in ETAS])
        ax.set_xlabel("--max-lag")
        ax.set_title(f"{block}\n{loss}: pass@1 at {float(t):g} s", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "out", "frontier"), help="where the runs go")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="runs at once, one core each")
    p.add_argument("--only", choices=[f"{b}/{loss}" for b, loss in ORDER], help="run only this (block, loss)")
    p.add_argument("--table-only", action="store_true", help="no runs: the tables from lab/data/frontier.jsonl")
    p.add_argument("--figure", action="store_true", help="no runs: docs/frontier.png from lab/data/frontier.jsonl")
    p.add_argument("--rerun", metavar="CELL", help="run one cell of the data file again; compare answers.jsonl's md5")
    args = p.parse_args()
    if args.rerun:
        rec = read_data()["runs"][args.rerun]
        run = os.path.join(args.out, "rerun", args.rerun)
        run_all(1, [(args.rerun, tuple(rec["flags"].split()), run)], lambda *a: None)
        again = md5(os.path.join(run, "answers.jsonl"))
        same = "the same" if again == rec["answers_md5"] else "DIFFERENT"
        print(f"{args.rerun}: answers.jsonl md5 {again}, the data file's {rec['answers_md5']}: {same}")
        on = rec.get("processor", "an unrecorded processor")
        print(f"  ran on {marked.processor()}; the data file's row on {on}")
        return
    if not args.table_only and not args.figure:
        run_grid(args.out, args.jobs, args.only)
    data = read_data()
    if args.figure:
        print("figure:", figure(data, os.path.join(ROOT, "docs", "frontier.png")))
    print(tables(data) + "\n\n" + decision(data))
    for page, name in marked.write(TABLES, values=VALUES):
        print(f"wrote {name} into {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
