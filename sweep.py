"""
Runs train.py over regimes x pools x seeds and prints the tables in RESULTS.md: start
and end eval accuracy, wall time, lag, stale tokens and PACE's rejected share.

    python sweep.py                                   # 5 regimes x 3 seeds, fifo (~50 min on 2 cores)
    python sweep.py --regimes drain discard stale recompute --pools pace
    python sweep.py --table-only                      # just print what is in out/sweep

Each run goes to out/sweep/<regime>-<pool>-s<seed>, and the accuracy-vs-wall-clock
curves to out/sweep/acc_vs_wall-<pools>.png. A run whose metrics already
reach its last step is skipped, so an interrupted sweep picks up where it stopped.
Extra arguments after `--` go to every train.py run.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys


def summary(run):
    """One row for a finished run, or None."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(os.path.join(run, "config.json")) as f:
        cfg = json.load(f)
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_acc" in r]
    if not steps or steps[-1]["step"] < cfg["steps"] or len(evals) < 2:
        return None
    n = len(steps)
    consumed = sum(r["trained_tokens"] for r in steps)
    rejected = sum(r.get("rejected_tokens", 0) for r in steps)
    return dict(regime=cfg["regime"], pool=cfg["pool"], seed=cfg["seed"],
                acc0=evals[0]["eval_acc"], acc1=evals[-1]["eval_acc"], wall_s=evals[-1]["wall_s"],
                lag=sum(r["lag_mean"] for r in steps) / n,
                stale=sum(r["stale_token_frac"] * r["trained_tokens"] for r in steps) / consumed,
                rejected=rejected / (consumed + rejected),
                curve=[(r["wall_s"], r["eval_acc"]) for r in evals])


def table(rows):
    lines = ["| regime | pool | seed | eval acc start -> end | gain (points) | wall s | lag | stale tokens | rejected tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['regime']} | {r['pool']} | {r['seed']} | {r['acc0']:.3f} -> {r['acc1']:.3f} | "
                     f"{100 * (r['acc1'] - r['acc0']):+.1f} | {r['wall_s']:.0f} | {r['lag']:.2f} | "
                     f"{100 * r['stale']:.1f}% | {100 * r['rejected']:.1f}% |")
    return "\n".join(lines)


def acc_at(curve, t):
    """Eval accuracy of a run by wall-clock t: its last evaluation at or before t."""
    return max((p for p in curve if p[0] <= t), default=curve[0])[1]


def means(rows):
    """One line per regime and pool, means over seeds; `acc at T` is each run's eval
    accuracy at T, when the regime's shortest run ended: a wall-clock every run reached."""
    lines = ["| regime | pool | seeds | gain (points) | wall s | lag | stale tokens | rejected tokens | T s | acc at T |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for regime in dict.fromkeys(r["regime"] for r in rows):
        same = [r for r in rows if r["regime"] == regime]
        t_end = min(r["wall_s"] for r in same)
        for pool in dict.fromkeys(r["pool"] for r in same):
            rs = [r for r in same if r["pool"] == pool]
            mean = lambda f: sum(map(f, rs)) / len(rs)
            lines.append(f"| {regime} | {pool} | {len(rs)} | {100 * mean(lambda r: r['acc1'] - r['acc0']):+.1f} | "
                         f"{mean(lambda r: r['wall_s']):.0f} | {mean(lambda r: r['lag']):.2f} | "
                         f"{100 * mean(lambda r: r['stale']):.1f}% | {100 * mean(lambda r: r['rejected']):.1f}% | "
                         f"{t_end:.0f} | {mean(lambda r: acc_at(r['curve'], t_end)):.3f} |")
    return "\n".join(lines)


def plot(rows, path):
    """Eval accuracy vs wall-clock, one panel per regime, one colour per pool."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    first_seed = min(r["seed"] for r in rows)  # one legend entry per pool
    fig, axes = plt.subplots(1, len(regimes), figsize=(3.2 * len(regimes), 3), sharey=True, squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        for r in rows:
            if r["regime"] == regime:
                t, acc = zip(*r["curve"])
                ax.plot(t, acc, color={"fifo": "tab:blue", "pace": "tab:orange"}[r["pool"]], alpha=0.7,
                        label=r["pool"] if r["seed"] == first_seed else None)
        ax.set_title(regime)
        ax.set_xlabel("wall-clock s")
    axes[0][0].set_ylabel("eval pass@1 (greedy)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regimes", nargs="+", default=["sync", "drain", "discard", "stale", "recompute"])
    p.add_argument("--pools", nargs="+", default=["fifo"], choices=["fifo", "pace"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", default="out/sweep", help="parent directory of the runs")
    p.add_argument("--table-only", action="store_true", help="run nothing, print the table of finished runs")
    args = p.parse_args(argv)
    # seed by seed, so a sweep cut short still has every regime and pool at the first seeds
    runs = [(r, pool, s) for s in args.seeds for pool in args.pools for r in args.regimes]
    for i, (regime, pool, seed) in enumerate(runs):
        run = os.path.join(args.out, f"{regime}-{pool}-s{seed}")
        if args.table_only or summary(run):
            continue
        print(f"[{i + 1}/{len(runs)}] {run}", flush=True)
        shutil.rmtree(run, ignore_errors=True)  # an unfinished run starts over
        os.makedirs(args.out, exist_ok=True)
        cmd = [sys.executable, "train.py", "--regime", regime, "--pool", pool, "--seed", str(seed),
               "--out", run, "--no-plot", *extra]
        with open(run + ".log", "w") as log:
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
                print(f"  failed: see {run}.log", flush=True)
    rows = [s for r, pool, seed in runs if (s := summary(os.path.join(args.out, f"{r}-{pool}-s{seed}")))]
    print(table(rows))
    print()
    print(means(rows))
    if rows:
        plot(rows, os.path.join(args.out, f"acc_vs_wall-{'-'.join(args.pools)}.png"))


if __name__ == "__main__":
    main()
