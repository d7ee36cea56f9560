"""
The run directory, out/<run>/, as both trainers write it (lesson.py on its simulated clock,
train.py on the wall clock), how its files are read back (read_jsonl, activity_spans,
per_token), and the wasted-work ledger read back from it. Every figure is drawn from these
files (plot.py); system/checkpoint.py keeps them across a crash. Each file and every key of
metrics.jsonl: docs/run-directory.md.
"""

import json
import os
import time


class RunLog:
    """metrics.jsonl, events.jsonl and answers.jsonl, appended and flushed line by
    line, so a crash loses nothing already logged."""

    def __init__(self, out, tensorboard=False, clock=time.time):
        # --tensorboard: the same numbers for TensorBoard (metrics.jsonl stays the record)
        self.tracker = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tracker = SummaryWriter(os.path.join(out, "tensorboard"))
        self.metrics = open(os.path.join(out, "metrics.jsonl"), "a")
        self.events = open(os.path.join(out, "events.jsonl"), "a")
        self.answers_f = open(os.path.join(out, "answers.jsonl"), "a")
        self.evals = open(os.path.join(out, "eval_answers.jsonl"), "a")
        self.activity = None
        self.clock = clock  # the time of a trainer activity or a step's answers: real, or lesson.py's simulated

    def event(self, e):
        self.events.write(json.dumps(e) + "\n")
        self.events.flush()

    def trainer(self, what, t=None):
        """The trainer's activity (events.jsonl), when it changes (at time t: now by default)."""
        if what != self.activity:
            self.activity = what
            self.event(dict(t=self.clock() if t is None else t, proc="trainer", what=what))

    def eval_at(self, m):
        """eval_at.jsonl: lesson.py --eval-at's pass@1 of the weights the generator held at simulated second m["t"]."""
        with open(os.path.join(os.path.dirname(self.metrics.name), "eval_at.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")

    def metric(self, m):
        self.metrics.write(json.dumps(m) + "\n")
        self.metrics.flush()
        if self.tracker:
            for k, v in m.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tracker.add_scalar(k, v, m["step"])
            self.tracker.flush()

    def answers(self, consumed, rejected, step, t=None):
        """answers.jsonl: one line per answer the pool let go of, with its provenance
        (engine.Rollout) and its fate: consumed by this step (at time t: now by
        default) or rejected (PACE)."""
        t = self.clock() if t is None else t
        lines = [
            json.dumps(
                dict(
                    sample_id=s["sample_id"],
                    group_id=s["group_id"],
                    prompt_id=s["prompt_id"],
                    engine=s["engine"],
                    tokens=len(s["token_ids"]),
                    fate=fate,
                    step=step,
                    t=t,
                    **s["provenance"],
                )
            )
            for groups, fate in ((consumed, "consumed"), (rejected, "rejected"))
            for g in groups
            for s in g
        ]
        self.answers_f.write("".join(line + "\n" for line in lines))
        self.answers_f.flush()

    def evaluation(self, step, version, texts, problems, truncated, right):
        """eval_answers.jsonl: each evaluation answer, after `step` with weights `version`:
        the problem, the right answer, what the model wrote, whether it finished (not cut
        at the length cap) and was graded right. So a learning claim can be read, not only counted."""
        lines = [
            json.dumps(
                dict(step=step, version=version, problem=i, answer=p["answer"], text=t, finished=not cut, right=bool(r))
            )
            for i, (t, p, cut, r) in enumerate(zip(texts, problems, truncated, right))
        ]
        self.evals.write("".join(line + "\n" for line in lines))
        self.evals.flush()


class StepLog:
    """generator-steps.jsonl (<engine lane>-steps.jsonl with several engines): a line per engine step,
    [t0, t1, answers the engine held, tokens in their KV, tokens it prefilled], a second's worth at a
    time. The generator process notes what each step took (engine.WallClock), lesson.py what its
    clock charged; tools/clock_costs.py fits the lesson's costs to the first."""

    def __init__(self, path):
        self.f, self.rows, self.last = open(path, "a"), [], time.time()

    def write(self, t0, t1, answers, kv, prefilled):
        self.rows.append(json.dumps([t0, t1, answers, kv, prefilled]) + "\n")
        if time.time() - self.last > 1.0:
            self.flush()

    def flush(self):
        self.f.write("".join(self.rows))
        self.f.flush()
        self.rows, self.last = [], time.time()


class Budgets:
    """simulated seconds, comma-separated: pass@1 of the weights the generator holds at each (eval_at.jsonl),
    evaluated after the run, so that it costs the run no simulated time; the run ends once every budget
    (these, and --eval-steps') is past"""

    # lesson.py --eval-at (lab/frontier.py's equal time): the weights held at t are the last version
    # loaded at or before t; each load's weights are kept (a tiny model's: a few MB) until the next
    # load says whether a budget fell in between. --eval-steps (equal optimizer steps): the weights
    # after k steps, kept when they load

    def __init__(self, times, steps, model):
        self.times, self.steps, self.model = times, steps, model
        self.at, self.at_step, self.held = {}, {}, None  # {t or k: (version, step, weights)}
        self.loaded(0, 0, 0.0)

    def loaded(self, version, step, now):
        """The generator loaded `version` (the trainer's weights after `step` steps) at simulated second `now`."""
        if self.times:
            self.at.update({t: self.held for t in self.times if t < now and t not in self.at})
        if self.times or step in self.steps:
            self.held = (version, step, {k: v.clone() for k, v in self.model.state_dict().items()})
        if step in self.steps:
            self.at_step[step] = self.held

    def over(self, now, step):
        """Every budget past: the time's and, after `step` optimizer steps, the steps'."""
        if not (self.times or self.steps):
            return False
        return (not self.times or now >= self.times[-1]) and (not self.steps or step >= self.steps[-1])

    def evaluate(self, now, load, evaluate, log):
        """At the run's end (simulated second `now`): load(version, weights), then evaluate(step, version),
        for each budget's weights."""
        self.at.update({t: self.held for t in self.times if t <= now and t not in self.at})
        for t, (version, step, weights) in sorted(self.at.items()):
            load(version, weights)
            log.eval_at(m := dict(t=t, step=step, version=version, **evaluate(step, version)))
            print(f"at {t:g} s: step {step} v{version} | eval {m['eval_acc']:.3f}", flush=True)
        for k, (version, step, weights) in sorted(self.at_step.items()):
            load(version, weights)
            log.eval_at(m := dict(at_step=k, step=step, version=version, **evaluate(step, version)))
            print(f"after step {k}: v{version} | eval {m['eval_acc']:.3f}", flush=True)
        if missed := [t for t in self.times if t not in self.at] + [k for k in self.steps if k not in self.at_step]:
            print(f"budgets {missed}: after the run's end ({now:.1f} simulated s)")


def push_part(m):
    """What the pushes did to half-written answers: the share of the step's answers written across one,
    and what the regime paid for them (only what it paid: a share that is 0 by its design is not shown)."""
    paid = [
        f"stale {100 * m['stale_token_frac']:.1f}%" if m["stale_token_frac"] else "",  # stale: tokens that read old KV
        f"rebuilt {m['recomputed_tokens']} tok" if m.get("recomputed_tokens") else "",  # recompute: KV prefilled again
        f"thrown {m['discarded_tokens']} tok" if m.get("discarded_tokens") else "",  # discard: aborted, restarted
    ]
    return f" | across a push {100 * m['spanning_frac']:.0f}%" + "".join(f", {p}" for p in paid if p)


def step_line(m):
    """The log line of a step (metrics.jsonl has the same numbers, and more)."""
    return (
        f"step {m['step']} | v{m['version']} | reward {m['reward_mean']:.3f}"
        + (f" | eval v{m['eval_version']} {m['eval_acc']:.3f}" if "eval_acc" in m else "")
        + push_part(m)
        + f" | lag {m['lag_mean']:.2f}"
        + (
            f" | ess {m['ess']:.3f} clipped {100 * m['clipped_frac']:.1f}% kl {m['kl']:.1e}"
            if m.get("ess") is not None
            else ""
        )
        + f" | {m['gen_tok_per_s']:.0f} tok/s | sync {m['sync_s']:.2f}s | idle {m['gen_idle_s']:.2f}s"
        + (f" drain {m['gen_drain_s']:.2f}s" if m.get("gen_drain_s") else "")
        + f" | wait {m['trainer_wait_s']:.2f}s"
    )


# -----------------------------------------------------------------------------
# reading the files back (plot.py, the ledger, --resume, the tools)


def read_jsonl(path):
    """The records of a .jsonl file of the run directory, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def activity_spans(events):
    """(proc, what, t0, t1) for each stretch of one activity; marks are not activities.
    A process's last activity lasts until the last event of the run."""
    acts = [e for e in events if "what" in e]
    end = max([e["t"] for e in events] or [0])
    out = []
    for proc in sorted({e["proc"] for e in acts}):
        mine = [e for e in acts if e["proc"] == proc]
        out += [(proc, e["what"], e["t"], nxt["t"] if nxt else end) for e, nxt in zip(mine, mine[1:] + [None])]
    return out


def per_token(steps, key):
    """A metrics.jsonl key's mean over every trained token of `steps` (each step's value
    weighted by its trained_tokens): the run's share, not the mean of its steps' shares."""
    return sum(m[key] * m["trained_tokens"] for m in steps) / max(1, sum(m["trained_tokens"] for m in steps))


def write_ledger(cfg, gen_stats):
    """The wasted-work ledger of the run (every session of it, when it was resumed):
    where the generated tokens went, and each process's wall-clock by activity
    (events.jsonl), as shares of the time after start-up. generated = trained +
    discarded + rejected + left over (in the pool or in flight at the end, or lost
    when a run died after its checkpoint); recomputed tokens were prefilled again, not
    generated. gen_stats: the generator's counters, which a resumed run continues."""
    steps = [m for m in read_jsonl(os.path.join(cfg["out"], "metrics.jsonl")) if "trained_tokens" in m]
    tok = dict(
        generated=gen_stats.get("gen_tokens", 0),
        trained=sum(m["trained_tokens"] for m in steps),
        discarded=gen_stats.get("discarded_tokens", 0),
        rejected=sum(m.get("rejected_tokens", 0) for m in steps),
    )
    tok["left_over"] = tok["generated"] - tok["trained"] - tok["discarded"] - tok["rejected"]
    tok["recomputed"] = gen_stats.get("recomputed_tokens", 0)
    secs, startup, total = {}, 0.0, 0.0
    for proc, what, t0, t1 in activity_spans(read_jsonl(os.path.join(cfg["out"], "events.jsonl"))):
        if what == "starting" and proc == "trainer":  # the engine's start dominates short CPU runs
            startup += t1 - t0
        elif what not in ("starting", "done", "stopped"):  # stopped: between a crash and --resume
            secs.setdefault(proc, {}).setdefault(what, 0.0)
            secs[proc][what] += t1 - t0
            total += (t1 - t0) * (proc == "trainer")  # the trainer's activities tile the run
    led = dict(tokens=tok, seconds=secs, total_s=total, startup_s=startup)
    with open(os.path.join(cfg["out"], "ledger.json"), "w") as f:
        json.dump(led, f, indent=1)
    g = max(1, tok["generated"])
    print(
        f"wasted-work ledger ({cfg['out']}/ledger.json): {tok['generated']:,} tokens generated = "
        + " + ".join(
            f"{tok[k]:,} {k.replace('_', ' ')} ({100 * tok[k] / g:.1f}%)"
            for k in ("trained", "discarded", "rejected", "left_over")
        )
        + f"; {tok['recomputed']:,} prefilled again (recompute)"
    )
    for proc, d in secs.items():
        shares = sorted(d.items(), key=lambda x: -x[1])
        print(
            f"  {proc:9s} {total:.0f} s after {startup:.0f} s of start-up: "
            + ", ".join(f"{w} {100 * s / max(total, 1e-9):.0f}%" for w, s in shares)
        )
    return led
