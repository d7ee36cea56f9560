"""
How far ahead should the generator run? The staleness frontier on lesson.py's simulated clock:
pass@1 at equal simulated time and at equal steps, steps per minute, lag and the off-policy
measures, over --max-lag (AReaL's eta), at two speeds of the trainer against the generator, at
the learning rate where staleness bites, per loss; then stale KV against recompute where a third
of the trained tokens would read stale KV. A rerun gives the same files (the clock is simulated).

    .venv/bin/python tools/frontier.py --block trainer-x1-lr-x4   # 54 runs, ~70 minutes on 2 cores
    .venv/bin/python tools/frontier.py --pilot                    # then the stale-KV pilot (26 runs)
    .venv/bin/python tools/frontier.py                            # the rest of the grid (18 runs)
    .venv/bin/python tools/frontier.py --table-only               # the tables from the runs on disk
    .venv/bin/python tools/frontier.py --figure                   # docs/frontier.png, from the runs on disk

The runs. `lesson.py --preset long --regime recompute` (AReaL's regime: the KV of a half-written
answer rebuilt under the new weights), 40 steps, pass@1 every 5 steps, seeds 0-2, each pinned to
one core, --jobs at once (tools/stress.py's launch), block by block. --max-lag 0 is `--regime
sync`, one batch per version. The cells (BLOCKS, ETAS, LOSSES below):

    block                                  | eta               | losses          | seeds
    trainer x1 (--train-s 1.16e-4), lr x4  | 0 1 2 4 8 16      | none ppo BEST   | 0-2
    trainer x4 (--train-s 4.64e-4), lr x4  | 0 1 2 4 8 16      | ppo             | 0-2

The default costs (trainer x1) make generation the slower side; trainer x4 makes training the
slower side, as at the stress experiment's setting (tools/stress.py). lr x4 (--lr 2.4e-4) is where
staleness bites (the stress pilot: the naive loss collapses at --max-lag 8).
`none` is the naive loss (mu ignored: on-policy GRPO's gradient, -A grad log pi, on whatever
the generator sampled; not AReaL's Table 2 row "without the decoupled objective", which is PPO's
clip against mu, a trust region around the behaviour policy: the project has no token-level
loss of that kind, gspo's clip against mu is per answer); `ppo` is AReaL's decoupled PPO;
BEST is the stress experiment's best correction by its own rule (tools/stress.py holds, at
max-lag 8, trainer x4, lr x4). Dropped, to fit one session's 3 hours with the pilot and
a CI run (a run takes ~2.5 minutes of one core; the full grid, 198 runs, would take ~4 hours of
both): at trainer x4, `none` and BEST (the stress experiment measured both there, at eta 8:
`none` collapses, BEST holds; AReaL's loss is the one its Table 2 sets beside ours), and the
preset's learning rate (lr x1), where the stress pilot found the naive loss holding (at
--max-lag 2). A first start of the earlier grid (90 runs, seed by seed) was stopped after 2
minutes, its 2 unfinished runs deleted, to put the pilot before the second block.

The stale-KV pilot (--pilot), its setting chosen by this rule before it runs: of the block
trainer-x1-lr-x4 (at trainer x4 only 9-13% of the trained tokens were stale in the stress runs),
the lower --max-lag of 1 and 2 at which `stale --loss none` seed 0 trains at least 30% stale
tokens (both are run first, side by side; the one not chosen is reported too); if neither
does (at lr x4 answers may shorten), the one with the higher share, and the table says so. The rule as first
committed read the recompute runs' `recomputed` instead; that counts every token a rebuild
prefills (the prompt's, and an answer's again at each push it spans: 66% of the trained tokens
at --max-lag 1, seeds 0-2, against the 35.4% stale tokens `stale` trained there), so it was
replaced before any pilot run. There, `--regime
stale` against `--regime recompute`, each with `none`, `tis` and BEST,
seeds 0-4, the same flags as the frontier's cells otherwise: its recompute runs with a loss
of the frontier's and seeds 0-2 are the frontier's runs, except recompute `none` seed 0, which
is run again (the two answers.jsonl must be identical; the table says whether they are).
25 runs, and the probe not chosen. Reported: stale - recompute per loss, paired
by seed, at step 40 and at equal time (the earliest end of the pilot's runs), with the 95% t
interval and its half-width (the smallest difference five seeds could have shown); and in the
stale runs, KL(mu||pi) and ESS of the tokens that read stale KV beside the fresh tokens at the
same lag (grpo.SPLITS), so the cache's own share of the mismatch is measured per token.

The rules, written before the first run:
- Equal time: within a block, T = the earliest end (last evaluation's simulated second) of any
  of its runs; a run's pass@1 at T is its last evaluation at or before T. Equal steps: pass@1 at
  step 40.
- The best eta of a block and loss: the highest mean pass@1 at T over the seeds; a tie goes to
  the smaller eta. Beside it, every eta whose paired difference from the best (per seed, t
  interval, tools/sweep.py's t_interval) includes 0: the seeds cannot tell them apart.
- Each difference is reported with its 95% t interval over the 3 seeds and the smallest
  difference those seeds could have shown (the interval's half-width): a null result states
  its power.

Runs go to out/frontier/<block>/<loss>-eta<k>-s<seed>/ (a finished run is not run again);
runtime.json in each records its wall-clock seconds.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from course import finished  # noqa: E402
from stress import at_time, launch, ms, read_run  # noqa: E402
from sweep import t_interval  # noqa: E402
from runlog import read_jsonl  # noqa: E402

SEEDS = (0, 1, 2)
ETAS = (0, 1, 2, 4, 8, 16)
BASE = ("--preset", "long", "--regime", "recompute", "--steps", "40", "--eval-every", "5")
TRAIN_S = {"x1": 1.16e-4, "x4": 4.64e-4}  # lesson.py's default, and 4x it
LR = {"x1": 6e-5, "x4": 2.4e-4}  # the long preset's, and 4x it
BEST = "gspo"  # the stress experiment's best correction by its rule (RESULTS.md); set before the first run
BLOCKS = {  # name -> (trainer speed, learning rate, losses); run in this order
    "trainer-x1-lr-x4": ("x1", "x4", ("none", "ppo", BEST)),
    "trainer-x4-lr-x4": ("x4", "x4", ("ppo",)),
}


def run_dir(out, block, loss, eta, seed):
    return os.path.join(out, block, f"{loss}-eta{eta}-s{seed}")


def flags(block, loss, eta, seed):
    speed, lr, _ = BLOCKS[block]
    regime = ("--regime", "sync") if eta == 0 else ("--max-lag", str(eta))
    return (*BASE, *regime, "--loss", loss, "--lr", str(LR[lr]), "--train-s", str(TRAIN_S[speed]), "--seed", str(seed))


def plan(out, blocks=BLOCKS):
    """Every (flags, run directory) of the grid, block by block, seed by seed within a block."""
    return [
        (flags(block, loss, eta, seed), run_dir(out, block, loss, eta, seed))
        for block in blocks
        for losses in [BLOCKS[block][2]]
        for seed in SEEDS
        for loss in losses
        for eta in ETAS
    ]


PILOT_SEEDS = (0, 1, 2, 3, 4)
PILOT_LOSSES = ("none", "tis", BEST)
PILOT_BLOCK = "trainer-x1-lr-x4"
PILOT_SHARE = 0.30  # the rule's least share of stale tokens


def probe_shares(out):
    """{--max-lag: share of stale tokens} of the rule's two probes, `stale --loss none` seed 0."""
    return {eta: read_run(pilot_plan(out, eta)[0][1])["stale"] for eta in (1, 2)}


def pilot_eta(out, jobs, table_only):
    """The pilot's --max-lag by the rule (docstring): the lower of 1, 2 at which `stale --loss
    none` seed 0 trains >= 30% stale tokens (both run, side by side); if neither, the higher
    share's; None while a probe is unfinished."""
    probes = {eta: pilot_plan(out, eta)[0] for eta in (1, 2)}  # (flags, run) of stale none seed 0
    if not table_only:
        launch(jobs, [p for p in probes.values() if not finished(p[1])])
    if not all(finished(run) for _, run in probes.values()):
        return None
    share = probe_shares(out)
    print(", ".join(f"--max-lag {eta}: {v:.1%} stale tokens" for eta, v in share.items()), file=sys.stderr)
    return min((eta for eta, v in share.items() if v >= PILOT_SHARE), default=max(share, key=share.get))


RERUN = ("none", 0)  # the frontier cell the pilot runs again


def pilot_dir(out, eta, regime, loss, seed):
    """A recompute run the frontier made is read from the frontier (but RERUN, run again here)."""
    if regime == "recompute" and loss in BLOCKS[PILOT_BLOCK][2] and seed in SEEDS and (loss, seed) != RERUN:
        return run_dir(out, PILOT_BLOCK, loss, eta, seed)
    return os.path.join(out, "pilot", f"eta{eta}", f"{regime}-{loss}-s{seed}")


def pilot_plan(out, eta):
    """The pilot's (flags, run directory): the frontier cell's flags with --regime stale or recompute."""
    todo = []
    for seed in PILOT_SEEDS:
        for loss in PILOT_LOSSES:
            for regime in ("stale", "recompute"):
                f = list(flags(PILOT_BLOCK, loss, eta, seed))
                f[f.index("--regime") + 1] = regime
                todo.append((tuple(f), pilot_dir(out, eta, regime, loss, seed)))
    return todo


def pilot_table(out, eta):
    """stale - recompute per loss (paired by seed, at step 40 and at equal time), and the stale
    runs' per-token KL and ESS of stale-KV tokens beside fresh ones at the same lag."""
    runs = {
        (regime, loss): [pilot_dir(out, eta, regime, loss, s) for s in PILOT_SEEDS]
        for regime in ("stale", "recompute")
        for loss in PILOT_LOSSES
    }
    if not all(finished(r) for rs in runs.values() for r in rs):
        return "(the pilot's runs are not all finished)"
    data = {k: [read_run(r) for r in rs] for k, rs in runs.items()}
    t = min(r["curve"][-1][1] for rs in data.values() for r in rs)
    probes = probe_shares(out)
    lines = [
        "The rule's probes, `stale --loss none` seed 0: "
        + ", ".join(f"--max-lag {k} trains {v:.1%} stale tokens" for k, v in probes.items())
        + (
            f"; the pilot runs at {eta}"
            if probes[eta] >= PILOT_SHARE
            else f"; neither reaches {PILOT_SHARE:.0%}: the higher, {eta}"
        ),
        "",
        f"Stale KV against recompute at `--max-lag {eta}` (block {PILOT_BLOCK}), seeds "
        f"{PILOT_SEEDS[0]}-{PILOT_SEEDS[-1]}; equal time T = {t:.0f} simulated s; stale - recompute in points, "
        "paired by seed (95% t interval; ± its half-width, the smallest difference the seeds could show)",
        "",
        "| loss | stale at step 40 | recompute | stale - recompute | stale at T | recompute at T "
        "| stale - recompute at T | stale tokens | recomputed |",
        "|---" * 9 + "|",
    ]
    for loss in PILOT_LOSSES:
        s, r = data[("stale", loss)], data[("recompute", loss)]
        cells = []
        for pick in (lambda x: x["final"], lambda x: at_time(x["curve"], t)):
            text, half = interval([100 * (pick(a) - pick(b)) for a, b in zip(s, r)])
            cells += [ms([pick(a) for a in s]), ms([pick(b) for b in r]), f"{text} (± {half:.1f})"]
        lines.append(
            f"| {loss} | {' | '.join(cells)} | {100 * statistics.mean(a['stale'] for a in s):.1f}% "
            f"| {100 * statistics.mean(b['recomputed'] for b in r):.1f}% |"
        )
    a, b = (
        os.path.join(d, "answers.jsonl")
        for d in (pilot_dir(out, eta, "recompute", *RERUN), run_dir(out, PILOT_BLOCK, RERUN[0], eta, RERUN[1]))
    )
    same = open(a, "rb").read() == open(b, "rb").read()
    lines += [
        "",
        f"recompute {RERUN[0]} seed {RERUN[1]} run twice (the pilot's and the frontier's): answers.jsonl "
        + ("identical" if same else "DIFFERENT"),
        "",
        "The stale runs' tokens split by whether they read stale KV, at the same lag: KL(mu‖pi) and ESS, "
        "the mean over steps and seeds of each step's value (steps without such a token left out)",
        "",
        "| loss | lag | KL stale-KV tokens | KL fresh tokens | ESS stale-KV | ESS fresh |",
        "|---" * 6 + "|",
    ]
    for loss in PILOT_LOSSES:
        steps = [m for d in runs[("stale", loss)] for m in read_jsonl(os.path.join(d, "metrics.jsonl")) if "kl" in m]
        for lag in (0, 1, 2):
            mean = lambda key, fmt="{:.1e}": (
                fmt.format(statistics.mean(v)) if (v := [m[key] for m in steps if m.get(key) is not None]) else "-"
            )
            lines.append(
                f"| {loss} | {lag if lag < 2 else '2+'} | {mean(f'kl_stale_lag{lag}')} | {mean(f'kl_fresh_lag{lag}')} "
                f"| {mean(f'ess_stale_lag{lag}', '{:.4f}')} | {mean(f'ess_fresh_lag{lag}', '{:.4f}')} |"
            )
    return "\n".join(lines)


def read_block(out, block):
    """{(loss, eta): [read_run per finished seed]} of a block."""
    rows = {}
    for loss in BLOCKS[block][2]:
        for eta in ETAS:
            runs = [run_dir(out, block, loss, eta, s) for s in SEEDS]
            rows[(loss, eta)] = [read_run(r) for r in runs if finished(r)]
    return rows


def interval(d):
    """'mean [low, high]' in points, and the interval's half-width (the smallest difference the seeds could show)."""
    ci = t_interval(d)
    if not ci:
        return f"{statistics.mean(d):+.1f}", None
    return f"{statistics.mean(d):+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]", (ci[1] - ci[0]) / 2


def best_eta(cells):
    """The rule: cells {eta: [pass@1 at T per seed, in seed order]} -> (the eta of the highest
    mean, ties to the smaller; every eta whose paired difference from it has a 95% t interval
    holding 0, the best included)."""
    top = max(cells, key=lambda eta: (statistics.mean(cells[eta]), -eta))
    same = []
    for eta, accs in cells.items():
        ci = t_interval([100 * (a - b) for a, b in zip(accs, cells[top])])
        if eta == top or (ci and ci[0] <= 0 <= ci[1]):
            same.append(eta)
    return top, same


def block_table(out, block):
    """The block's table and the best eta per loss by the rule; None when a cell is unfinished."""
    rows = read_block(out, block)
    if any(len(v) < len(SEEDS) for v in rows.values()):
        missing = sum(len(SEEDS) - len(v) for v in rows.values())
        return f"({block}: {missing} runs not finished)", None
    t = min(r["curve"][-1][1] for runs in rows.values() for r in runs)
    speed, lr, losses = BLOCKS[block]
    lines = [
        f"**{block}** (`--train-s {TRAIN_S[speed]:g} --lr {LR[lr]:g}`): pass@1 at equal time T = {t:.0f} simulated s, "
        "and at step 40; differences from the best eta of the same loss, paired by seed (points, 95% t interval)",
        "",
        "| loss | eta | pass@1 at T | vs best | pass@1 at step 40 | steps/min | lag | stale tokens | recomputed "
        "| ESS | KL(mu‖pi) | clipped | runtime s |",
        "|---" * 13 + "|",
    ]
    best = {}
    for loss in losses:
        top, same = best_eta({eta: [at_time(r["curve"], t) for r in rows[(loss, eta)]] for eta in ETAS})
        for eta in ETAS:
            runs = rows[(loss, eta)]
            d = [100 * (at_time(a["curve"], t) - at_time(b["curve"], t)) for a, b in zip(runs, rows[(loss, top)])]
            text, half = interval(d) if eta != top else ("best", None)
            text += f" (± {half:.1f})" if half is not None else ""
            mean = lambda key, fmt: fmt.format(statistics.mean(r[key] for r in runs))
            lines.append(
                f"| {loss} | {eta if eta else '0 (sync)'} | {ms([at_time(r['curve'], t) for r in runs])} | {text} "
                f"| {ms([r['final'] for r in runs])} | {ms([r['steps_per_min'] for r in runs], '{:.1f}')} "
                f"| {mean('lag', '{:.2f}')} | {100 * statistics.mean(r['stale'] for r in runs):.1f}% "
                f"| {100 * statistics.mean(r['recomputed'] for r in runs):.0f}% "
                f"| {mean('ess', '{:.3f}')} | {mean('kl', '{:.1e}')} "
                f"| {100 * statistics.mean(r['clipped'] for r in runs):.1f}% "
                f"| {statistics.mean(r['runtime'] or 0 for r in runs):.0f} |"
            )
        best[loss] = (top, same)
    lines.append("")
    for loss, (top, same) in best.items():
        lines.append(
            f"- {loss}: best eta by the rule **{top}**; the seeds cannot tell it from eta "
            + ", ".join(str(e) for e in same if e != top)
            if len(same) > 1
            else f"- {loss}: best eta by the rule **{top}**, apart from every other eta"
        )
    return "\n".join(lines), best


def figure(out, path):
    """pass@1 at equal time against eta, one line per loss (the seeds' range as a band), and
    steps/min against eta beside it (AReaL's Fig. 5c), one row per block."""
    from plot import plot_frontier

    blocks = {}
    for block in BLOCKS:
        rows = read_block(out, block)
        if any(len(v) < len(SEEDS) for v in rows.values()):
            continue
        t = min(r["curve"][-1][1] for runs in rows.values() for r in runs)
        blocks[f"{block} (T = {t:.0f} s)"] = {
            loss: [
                ([at_time(r["curve"], t) for r in rows[(loss, eta)]], [r["steps_per_min"] for r in rows[(loss, eta)]])
                for eta in ETAS
            ]
            for loss in BLOCKS[block][2]
        }
    return plot_frontier(blocks, ETAS, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("out", "frontier"), help="where the runs go")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="runs at once, one core each")
    p.add_argument("--block", choices=list(BLOCKS), help="run only this block of the grid")
    p.add_argument("--pilot", action="store_true", help="the stale-KV pilot (after the frontier's first block)")
    p.add_argument("--table-only", action="store_true", help="no new runs: tables from the runs on disk")
    p.add_argument("--figure", action="store_true", help="draw docs/frontier.png from the runs on disk")
    args = p.parse_args()
    if args.pilot:
        eta = pilot_eta(args.out, args.jobs, args.table_only)
        if eta is None:
            sys.exit("frontier.py --pilot: the probes (stale none seed 0 at --max-lag 1 and 2) are not finished")
        print(f"the pilot's --max-lag by the rule: {eta}", file=sys.stderr)
        if not args.table_only:
            launch(args.jobs, [(f, r) for f, r in pilot_plan(args.out, eta) if not finished(r)])
        print(pilot_table(args.out, eta))
        return
    if not args.table_only and not args.figure:
        grid = plan(args.out, [args.block] if args.block else BLOCKS)
        todo = [(f, r) for f, r in grid if not finished(r)]
        print(f"{len(grid) - len(todo)} of {len(grid)} runs finished already", file=sys.stderr)
        launch(args.jobs, todo)
    for block in BLOCKS:
        print(block_table(args.out, block)[0] + "\n", flush=True)
    if args.figure:
        print("figure:", figure(args.out, os.path.join(ROOT, "docs", "frontier.png")))


if __name__ == "__main__":
    main()
