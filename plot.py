"""
Plots of a run (or several, to compare regimes): reward and eval accuracy against
wall-clock, and the timeline of what each process was doing when.

    python plot.py out/run-a out/run-b ...     # writes out/run-a/run.png (and one per run)
"""

import json
import os
import sys

COLOURS = {"starting": "white", "generating": "tab:green", "draining": "tab:orange", "loading": "tab:red", "idle": "lightgrey",
           "evaluating": "tab:purple", "training": "tab:blue", "syncing": "tab:red", "waiting": "lightgrey",
           "saving": "tab:brown"}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run):
    """reward + eval accuracy vs wall-clock on top, the process timeline below -> run/run.png"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = read_jsonl(os.path.join(run, "metrics.jsonl"))
    events = read_jsonl(os.path.join(run, "events.jsonl"))
    t0 = min([e["t"] for e in events] or [0])
    fig, (ax, tl) = plt.subplots(2, 1, figsize=(10, 6), gridspec_kw=dict(height_ratios=[3, 1]))
    steps = [m for m in metrics if "reward_mean" in m]
    # wall_s counts from the trainer's "starting" event, the first of the timeline
    ax.plot([m["wall_s"] for m in steps], [m["reward_mean"] for m in steps], label="reward (train batch)")
    evals = [m for m in metrics if "eval_acc" in m]
    ax.plot([m["wall_s"] for m in evals], [m["eval_acc"] for m in evals], "o-", label="eval pass@1")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(os.path.basename(os.path.normpath(run)))
    ax.legend()
    for lane, proc in enumerate(["trainer", "generator"]):
        mine = [e for e in events if e["proc"] == proc]
        for e, nxt in zip(mine, mine[1:] + [None]):
            end = nxt["t"] if nxt else max(e["t"] for e in events)
            tl.barh(lane, end - e["t"], left=e["t"] - t0, color=COLOURS.get(e["what"], "black"), height=0.8)
    tl.set_yticks([0, 1], ["trainer", "generator"])
    tl.set_xlabel("wall-clock (s)")
    tl.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()], labels=list(COLOURS),
              ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    ax.set_xlim(tl.get_xlim())
    fig.tight_layout()
    path = os.path.join(run, "run.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    for run in sys.argv[1:] or sys.exit(__doc__):
        print(plot_run(run))
