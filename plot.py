"""
Plots of a run (or several, to compare regimes), drawn from its run directory.

    python plot.py out/run-a out/run-b ...           # reward, accuracy and the process timeline -> RUN/run.png
    python plot.py --answers RUN [--window T0 T1]    # half-written answers around a weight switch -> RUN/answers.png
    python plot.py --answers RUN_sync RUN_drain RUN_discard RUN_stale RUN_recompute --out regimes.png
    python plot.py --curves out/stress/holds/stale_*-s* --out curves.png   # learning curves, seeds pooled

The curves figure pools runs whose names differ only in a trailing -s<seed> (plot_curves); the
answers figure draws a lane per answer, each token coloured by the version that sampled it
(draw_answers says how each mark reads).
"""

import argparse
import json
import os

from system.runlog import activity_spans, per_token, read_jsonl  # the run directory's files, read back

COLOURS = {
    "starting": "white",
    "generating": "tab:green",
    "draining": "tab:orange",
    "loading": "tab:red",
    "idle": "lightgrey",
    "evaluating": "navy",
    "training": "tab:blue",
    "syncing": "tab:red",
    "waiting": "lightgrey",
    "saving": "tab:brown",
    "done": "white",
    "stopped": "white",
}  # stopped: a crash until --resume
# one colour per weight version (cycled): tokens of v and v+1 must differ at a glance,
# and from the process colours above
VERSION_COLOURS = ["#E6A700", "#9E6BC8", "#2AA198", "#F06EAA", "#B5B528", "#56B4E9"]


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
    with open(os.path.join(run, "config.json")) as f:
        if json.load(f).get("format_reward"):  # what the format reward asks for
            ax.plot(
                [m["wall_s"] for m in steps],
                [m["boxed_frac"] for m in steps],
                ":",
                label="answers with a \\boxed{} (train batch)",
            )
    if any("truncated_frac" in m for m in steps):  # answers that never finished (they earn 0)
        ax.plot(
            [m["wall_s"] for m in steps],
            [m.get("truncated_frac", 0) for m in steps],
            "--",
            color="grey",
            label="answers cut at --max-new-tokens (train batch)",
        )
    evals = [m for m in metrics if "eval_acc" in m]
    ax.plot([m["wall_s"] for m in evals], [m["eval_acc"] for m in evals], "o-", label="eval pass@1")
    ax.set_ylabel("reward / accuracy / share")
    ax.set_title(os.path.basename(os.path.normpath(run)))
    ax.legend()
    draw_processes(tl, events, t0)
    tl.set_xlabel("wall-clock (s)")
    tl.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()],
        labels=list(COLOURS),
        ncol=5,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.45),
    )
    ax.set_xlim(tl.get_xlim())
    fig.tight_layout()
    path = os.path.join(run, "run.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_processes(ax, events, x0):
    """The trainer's and the generators' activities, one lane each (the trainer's at the
    bottom; with several engines, generator0, generator1, ... above it)."""
    procs = ["trainer"] + sorted({e["proc"] for e in events} - {"trainer"})
    for proc, what, t0, t1 in activity_spans(events):
        ax.barh(procs.index(proc), t1 - t0, left=t0 - x0, color=COLOURS.get(what, "black"), height=0.8)
    ax.set_yticks(range(len(procs)), procs)


# -----------------------------------------------------------------------------
# the answers figure


def select_answers(run, window=None, lanes=24, engine=None):
    """What the answers figure of `run` shows: dict(answers=[answers.jsonl records, a lane each, top
    first], switch=the load mark, its "push" when the trainer sent it, alive=answers half-written at
    it, x0=where x counts from, xlim, loads, events, regime); engine: one engine's (--engines N).
    The switch shown: the first push of version >= 2 with an answer half-written (else the first
    push of version >= 2); lanes go first to those answers, then to the others alive from the load
    before to the load after, earliest admitted first. With window=(t0, t1): the answers alive then."""
    answers = read_jsonl(os.path.join(run, "answers.jsonl"))
    events = read_jsonl(os.path.join(run, "events.jsonl"))
    if engine is not None:
        answers = [a for a in answers if a.get("engine", 0) == engine]
        events = [e for e in events if e["proc"] == "trainer" or e.get("engine", 0) == engine]
    with open(os.path.join(run, "config.json")) as f:
        regime = json.load(f)["regime"]
    loads = sorted((e for e in events if e.get("mark") == "load"), key=lambda e: e["t0"])
    start = min(e["t"] for e in events)
    if window:
        lo, hi = start + window[0], start + window[1]
        alive = [a for a in answers if a["admitted"] < hi and a["t"] > lo]
        switch, x0, chosen = None, start, sorted(alive, key=lambda a: a["admitted"])[:lanes]
        alive = len(alive)
    else:
        later = [e for e in loads if e["version"] >= 2] or loads
        if not later:
            raise SystemExit(f"{run}: no weight load recorded; nothing to draw")

        syncs = [e["t"] for e in events if e.get("what") == "syncing"]

        def push(e):  # when the trainer sent the weights e loaded (drain loads them only later)
            return max([t for t in syncs if t <= e["t0"]] or [e["t0"]])

        def across(e):  # half-written when the weights were sent
            return [a for a in answers if a["admitted"] < push(e) < a["finished"]]

        switch = next((e for e in later if across(e)), later[0])
        i = loads.index(switch)
        lo = loads[i - 1]["t0"] if i > 0 else start
        hi = loads[i + 1]["t1"] if i + 1 < len(loads) else max(a["t"] for a in answers)
        first = across(switch)
        alive = len(first)
        rest = [a for a in answers if a not in first and a["admitted"] < hi and a["t"] > lo]
        chosen = (sorted(first, key=lambda a: a["admitted"]) + sorted(rest, key=lambda a: a["admitted"]))[:lanes]
        x0 = switch["push"] = push(switch)
        chosen.sort(key=lambda a: a["admitted"])
    if chosen:
        lo = min(lo, min(a["admitted"] for a in chosen))
        hi = max(hi, max(a["t"] for a in chosen))
    pad = 0.02 * (hi - lo)
    return dict(
        answers=chosen,
        alive=alive,
        switch=switch,
        x0=x0,
        xlim=(lo - pad - x0, hi + pad - x0),
        loads=loads,
        events=events,
        regime=regime,
        run=run,
    )


def draw_answers(ax, pax, sel):
    """One panel: answer lanes on ax, the two process lanes on pax. Returns the set
    of versions drawn (for the legend)."""
    # a lane per answer, x = seconds: each token at the engine step that sampled it, coloured by the
    # version that sampled it; hatched where it read stale KV; faded and crossed where discard threw it
    # away; a black block where recompute rebuilt its KV; dotted while it waited in the pool; a red band
    # at each weight load
    x0, n = sel["x0"], len(sel["answers"])
    versions = set()
    for lane, a in enumerate(sel["answers"]):
        y = n - 1 - lane  # the first admitted on top

        def bars(segments, **kw):
            for t0, t1, v, _, stale in segments:
                versions.add(v)
                ax.barh(
                    y,
                    t1 - t0,
                    left=t0 - x0,
                    height=0.7,
                    color=VERSION_COLOURS[v % len(VERSION_COLOURS)],
                    hatch="////" if stale else None,
                    edgecolor="black",
                    linewidth=0,
                    **kw,
                )

        ax.plot([a["admitted"] - x0, a["finished"] - x0], [y, y], color="lightgrey", lw=1, zorder=0)
        for _, _, segments in a["discarded"]:
            bars(segments, alpha=0.35)
            ax.plot([s[1] - x0 for s in segments[-1:]], [y], "x", color="black", ms=5)
        for t0, t1, _, _, kind in a["prefills"]:
            if kind == "recompute":
                ax.barh(y, t1 - t0, left=t0 - x0, height=0.9, color="black")
        bars(a["segments"])
        ax.plot([a["finished"] - x0, a["t"] - x0], [y, y], ":", color="black", lw=1)
        ax.plot(
            [a["t"] - x0],
            [y],
            "|" if a["fate"] == "consumed" else "X",
            ms=7,
            color="black" if a["fate"] == "consumed" else "red",
        )
    for ax_ in (ax, pax):
        for e in sel["loads"]:
            ax_.axvspan(e["t0"] - x0, e["t1"] - x0, color="red", alpha=0.25, lw=0)
            ax_.axvline(e["t0"] - x0, color="red", lw=0.8)
    if sel["switch"]:
        for ax_ in (ax, pax):
            ax_.axvline(sel["switch"]["push"] - x0, color="black", ls="--", lw=1)
    for e in sel["loads"]:
        if sel["xlim"][0] <= e["t0"] - x0 <= sel["xlim"][1]:
            ax.text(e["t0"] - x0, n - 0.3, f" v{e['version']}", color="red", fontsize=8, va="bottom")
    ax.set_yticks([])
    ax.set_ylim(-0.7, n + 0.6)
    ax.set_ylabel(f"{n} answers")
    draw_processes(pax, sel["events"], x0)
    ax.set_xlim(*sel["xlim"])
    return versions


def legend_handles(versions):
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    h = [
        Patch(color=VERSION_COLOURS[v % len(VERSION_COLOURS)], label=f"token sampled by weights v{v}")
        for v in sorted(versions)
    ]
    h += [
        Patch(
            facecolor="white", edgecolor="black", hatch="////", label="token read KV written by older weights (stale)"
        ),
        Patch(facecolor="grey", alpha=0.35, label="tokens thrown away, answer restarted (discard; x = abort)"),
        Patch(color="black", label="KV of prompt + partial answer rebuilt (recompute)"),
        Line2D([], [], color="lightgrey", label="alive, no token being written (queued, paused)"),
        Line2D([], [], ls=":", color="black", marker="|", label="finished, waiting in the pool | consumed by a step"),
        Line2D([], [], ls="", color="red", marker="X", label="rejected by the pool (PACE)"),
        Patch(color="red", alpha=0.25, label="generator loading new weights"),
        Line2D([], [], ls="--", color="black", label="the push shown: the trainer sends new weights"),
    ]
    h += [
        plt.Rectangle((0, 0), 1, 1, color=COLOURS[k], label=f"process: {k}")
        for k in ("generating", "draining", "idle", "training", "syncing", "evaluating")
    ]
    return h


def cost(run, regime):
    """What the regime paid in this run, from its ledger: a panel's title ("" for a regime not named here)."""
    path = os.path.join(run, "ledger.json")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        led = json.load(f)
    tok, gen = led["tokens"], led["seconds"].get("generator", {})
    share = lambda x: f"{100 * x / max(led['total_s'], 1e-9):.0f}%"
    if regime == "sync":
        return f"generator idle {share(gen.get('idle', 0))} of the run"
    if regime == "drain":
        return f"generator idle or draining {share(gen.get('idle', 0) + gen.get('draining', 0))} of the run"
    if regime == "discard":
        return f"{100 * tok['discarded'] / max(1, tok['generated']):.0f}% of generated tokens thrown away"
    if regime == "recompute":
        return f"{100 * tok['recomputed'] / max(1, tok['generated']):.0f}% of generated tokens prefilled again"
    if regime == "stale":
        steps = [m for m in read_jsonl(os.path.join(run, "metrics.jsonl")) if "trained_tokens" in m]
        return f"{100 * per_token(steps, 'stale_token_frac'):.0f}% of trained tokens stale"
    return ""  # a regime of your own (regimes.REGIMES): its panel is titled by its name alone


def plot_answers(runs, window=None, lanes=24, out=None, engine=None, costs=True):
    """The answers figure of one run, or one panel per run sharing the time scale; with costs, each
    panel's title says what its run's regime paid (plot.cost). Returns (path, selections): what
    each panel shows, for tests and captions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sels = [select_answers(r, window, lanes, engine) for r in runs]
    n = len(sels)
    ratios = [r for s in sels for r in (max(4, len(s["answers"])), 2.2)]
    fig, axes = plt.subplots(
        2 * n, 1, figsize=(12, 0.2 * sum(ratios) + 2.2), sharex=True, gridspec_kw=dict(height_ratios=ratios, hspace=0.4)
    )
    versions = set()
    for i, s in enumerate(sels):
        ax, pax = axes[2 * i], axes[2 * i + 1]
        versions |= draw_answers(ax, pax, s)
        name = os.path.basename(os.path.normpath(s["run"]))
        shared = sum(t["regime"] == s["regime"] for t in sels) > 1  # two panels of one regime: name the runs
        what = (
            f"{s['alive']} answer{'s' * (s['alive'] != 1)} half-written when v{s['switch']['version']} was sent"
            if s["switch"]
            else f"answers alive in {window[0]:g}-{window[1]:g} s"
        )
        paid = cost(s["run"], s["regime"]) if costs else ""
        s["title"] = s["regime"] + (f" ({paid})" if paid else "") + f": {what}" + (f"   ({name})" if shared else "")
        ax.set_title(s["title"], fontsize=10, loc="left")
    lo = min(s["xlim"][0] for s in sels)
    hi = max(s["xlim"][1] for s in sels)
    axes[-1].set_xlim(lo, hi)
    axes[-1].set_xlabel(
        "seconds from the start of the run"
        if window
        else "seconds from the push shown (0 = the trainer sends new weights)"
    )
    fig.legend(
        handles=legend_handles(versions),
        loc="lower center",
        ncol=3,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.5 / fig.get_figheight(), bottom=1.9 / fig.get_figheight())
    path = out or os.path.join(runs[0], "answers.png" if n == 1 else "answers_compare.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path, sels


def plot_curves(groups, out, title=""):
    """groups: {label: [run directories, one per seed]} -> the curves figure at `out`: per label the mean
    over seeds with a band from the lowest to the highest, of pass@1 against the step and against seconds,
    the batch's reward, and how off-policy its trained tokens were (grpo.offpolicy_metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        ("eval_acc", "step", "eval pass@1"),
        ("eval_acc", "wall_s", "eval pass@1"),
        ("reward_mean", "step", "reward (train batch)"),
        ("ess", "step", "ESS of pi/mu (1: on-policy)"),
        ("clipped_frac", "step", "share of tokens clipped or masked"),
        ("kl", "step", "KL(mu || pi), nats/token"),
    ]
    for i, (label, runs) in enumerate(groups.items()):
        metrics = [read_jsonl(os.path.join(r, "metrics.jsonl")) for r in runs]
        for ax, (key, x, name) in zip(axes.flat, panels):
            rows = [
                [
                    m
                    for m in ms
                    if m.get(key) is not None and (key != "eval_acc" or "trained_tokens" in m or m["step"] == 0)
                ]
                for ms in metrics
            ]
            n = min(len(r) for r in rows)
            if not n:
                continue
            xs = np.mean([[m[x] for m in r[:n]] for r in rows], 0)  # seeds share steps; seconds: their mean
            ys = np.array([[m[key] for m in r[:n]] for r in rows])
            ax.plot(xs, ys.mean(0), "o-" if key == "eval_acc" else "-", ms=3, color=f"C{i}", label=label)
            ax.fill_between(xs, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.15, lw=0)
            ax.set_xlabel("simulated seconds" if x == "wall_s" else x)
            ax.set_title(name, fontsize=10)
    axes[1, 2].set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title + " (line: mean over seeds; band: lowest to highest seed)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_frontier(blocks, etas, out):
    """lab/frontier.py's figure: blocks {title: {loss: [(pass@1 per seed, steps/min per seed)
    per eta]}}, one row per block: pass@1 at the block's equal time against --max-lag (a line per
    loss, the mean; a band from the lowest to the highest seed) and steps/min against --max-lag
    (AReaL's Fig. 5c). --max-lag 0 is sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(max(len(blocks), 1), 2, figsize=(11, 3.4 * max(len(blocks), 1)), squeeze=False)
    x = np.arange(len(etas))  # evenly spaced: 0 1 2 4 8 16
    color = {}  # one color per loss across the rows
    for row, (title, losses) in zip(axes, blocks.items()):
        for loss, cells in losses.items():
            c = color.setdefault(loss, f"C{len(color)}")
            for ax, k in zip(row, (0, 1)):
                ys = [np.array(cell[k], dtype=float) for cell in cells]
                ax.plot(x, [y.mean() for y in ys], "o-", ms=3, color=c, label=loss)
                ax.fill_between(x, [y.min() for y in ys], [y.max() for y in ys], color=c, alpha=0.15, lw=0)
        for ax, name in zip(row, ("pass@1 at equal simulated time", "steps per simulated minute")):
            ax.set_xticks(x, [str(e) if e else "0 (sync)" for e in etas])
            ax.set_xlabel("--max-lag (eta)")
            ax.set_title(f"{title}: {name}", fontsize=9)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def seed_groups(runs):
    """Run directories grouped by name less a trailing -s<seed>: {label: [runs]}, in the order given."""
    import re

    groups = {}
    for run in runs:
        groups.setdefault(re.sub(r"-s\d+$", "", os.path.basename(os.path.normpath(run))), []).append(run)
    return groups


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("runs", nargs="+", help="run directories (out/<run>)")
    p.add_argument("--answers", action="store_true", help="the answers figure (one panel per run) instead of run.png")
    p.add_argument("--curves", action="store_true", help="learning curves and off-policy diagnostics, seeds pooled")
    p.add_argument(
        "--window",
        nargs=2,
        type=float,
        metavar=("T0", "T1"),
        help="answers alive between T0 and T1 s from the run's start (default: around a weight switch)",
    )
    p.add_argument("--lanes", type=int, default=24, help="at most this many answers per panel")
    p.add_argument("--engine", type=int, default=None, help="--engines N runs: one engine's answers (default: all)")
    p.add_argument(
        "--no-cost",
        action="store_true",
        help="titles without what each run paid (the README's figure: a table beside it gives the costs)",
    )
    p.add_argument(
        "--out", default=None, help="PNG path (default: RUN/answers.png, or the first RUN's answers_compare.png)"
    )
    args = p.parse_args()
    if args.curves:
        print(plot_curves(seed_groups(args.runs), args.out or os.path.join(args.runs[0], "curves.png")))
    elif args.answers:
        print(plot_answers(args.runs, args.window, args.lanes, args.out, args.engine, not args.no_cost)[0])
    else:
        for run in args.runs:
            print(plot_run(run))
