"""
The whole asynchronous GRPO loop in one process, on a simulated clock. Read it after the README
(up to "What we found") and the course's Concepts (docs/course.md, "The first sitting").

    python lesson.py                                      # tiny model, short answers: 150 steps
    python lesson.py --preset long --regime stale         # long answers: stale tokens appear
    python plot.py --answers out/lesson-stale-long-s0     # one weight switch, answer by answer

The generator (engine.Generator, vLLM stepped one decode step at a time) writes answers, the trainer
takes a step's groups from the pool (pool.Pool) and trains (grpo.step), and the regime (regimes.py)
decides what happens to the answers half-written when its weights land. train.py runs the same pieces
in two processes at once; here one process plays both in turn, and each piece of work's time is
counted, not measured (SimClock), so a run is a pure function of its flags and seed.
"""

import argparse
import json
import os
import random
import shutil
from functools import partial
from typing import NamedTuple

from engine import Generator, as_tensors, load_in_place, make_engine, vllm_env

os.environ.update(vllm_env())  # before anything imports vLLM (vllm_env says what each setting is for)

import config
import grpo
from data import UsageError, load_splits, prompt_ids
from reward import scored
from grpo import batch_metrics, generator_metrics, minibatches, needs_pi_old, run_tokens, score_batch, token_weights
from pool import Pool, pool_stats
from system.preflight import check_budget, check_model
from regimes import make_regime
from system.runlog import Budgets, RunLog, StepLog, step_line, write_ledger


class SimClock:
    """The time a piece of work would take, counted: the Generator calls spend() after
    each engine step and each weight load (engine.WallClock, in the generator process,
    spends nothing: there the work itself takes the time)."""

    def __init__(self, cfg, log):
        self.t, self.cfg, self.log = 0.0, cfg, log  # log: a StepLog, what each engine step was charged
        self.busy_until = 0.0  # the trainer trains until then (main sets it): a step then costs --busy-s more

    def now(self):
        return self.t

    def spend(self, work, t0=None, answers=0, kv=0, prefilled=0):
        c = self.cfg
        if work == "step":  # what the engine held (answers, tokens in their KV) and wrote in one go
            self.t += c["step_s"] + c["answer_s"] * answers + c["kv_s"] * kv + c["prefill_s"] * prefilled
            self.t += c["busy_s"] * (t0 < self.busy_until)  # the two share a machine
            self.log.write(t0, self.t, answers, kv, prefilled)
        else:  # "load"
            self.t += c["load_s"]

    def wait_until(self, t):
        """Nothing to do until t: time jumps there. Returns the seconds waited."""
        waited = max(0.0, t - self.t)
        self.t = max(self.t, t)
        return waited


class Push(NamedTuple):
    """The trainer's new weights on their way to the generator."""

    version: int  # the version they become
    ready_s: float  # when the trainer has them: its step's start + its cost
    metrics: dict  # the step's metrics, finished when the weights land


def parse_config(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=config.Help)
    config.add_flags(p, "lesson")  # train.py's flags, defaults and presets, where they apply
    # fmt: off
    # the clock's costs, simulated seconds: fitted to train.py's own runs by tools/clock_costs.py and checked
    # against them regime by regime by lab/fidelity.py; fit yours to one run of your machines the same way
    config.add_table(p, [
        ("step-s",    float, 2.69e-3, "an engine step"),
        ("answer-s",  float, 7.42e-5, "... plus this per answer the engine holds"),
        ("kv-s",      float, 2.97e-7, "... plus this per token in their KV cache"),
        ("prefill-s", float, 2.52e-5, "... plus this per token whose KV it prefills (a prompt, a rebuild)"),
        ("busy-s",    float, 1.6e-3,  "... plus this while the trainer trains (the two share a machine)"),
        ("train-s",   float, 1.01e-4, "a trainer step, per token it runs through the model (grpo.run_tokens)"),
        ("load-s",    float, 0.0485,  "a weight load"),
    ])
    # fmt: on
    p.add_argument("--eval-at", type=lambda s: sorted(map(float, s.split(","))), default=[], help=Budgets.__doc__)
    p.add_argument(
        "--eval-steps",
        type=lambda s: sorted(map(int, s.split(","))),
        default=[],
        help="optimizer steps, comma-separated: pass@1 of the weights after each, as --eval-at's",
    )
    cfg = config.fill(vars(p.parse_args(argv)), "lesson")  # and what follows from them (sync: --max-lag 0)
    for k in ("step_s", "answer_s", "kv_s", "prefill_s", "busy_s", "train_s", "load_s"):
        if not cfg[k] >= 0:
            raise UsageError(f"--{k.replace('_', '-')} must be >= 0 (simulated seconds), got {cfg[k]}")
    if cfg["step_s"] <= 0:
        raise UsageError("--step-s must be > 0: every engine step takes time, or simulated time never moves")
    return cfg


def fresh_run_dir(out):
    """The run directory, emptied of an earlier lesson run (whose files would be appended to);
    anything else already there is left alone and refused."""
    old = os.path.join(out, "config.json")
    if os.path.exists(old):
        with open(old) as f:
            if "step_s" not in json.load(f):
                raise UsageError(f"--out {out} holds a train.py run; give the lesson a directory of its own")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)


def train_on(cfg, model, opt, tokenizer, step, batch, version):
    """The trainer's step: rewards and group advantages, then grpo.step (train.py takes the same
    step, on each rank's share). Returns its metrics, run_tokens what the clock charges for it."""
    adv, scores = score_batch(cfg, tokenizer, batch, version)
    parts = [
        (part, adv[idx], token_weights(cfg, part), 0)
        for idx in minibatches(len(batch), cfg["minibatches"])
        for part in [[batch[i] for i in idx]]
    ]
    cost = sum(run_tokens(cfg, part, part_adv) for part, part_adv, *_ in parts)
    if needs_pi_old(cfg):  # pi_old: a forward of every answer, a third of a step's work
        cost += run_tokens(cfg, batch, adv) / 3
    m = grpo.step(cfg, model, opt, step, parts)
    return dict(**scores, **m, **batch_metrics(batch, adv, version), run_tokens=cost)


def main(argv=None, engine=None):
    """engine: a vLLM engine made by engine.make_engine for these settings, to reuse (tests); None: a new one."""
    cfg = parse_config(argv)
    train_problems, test = load_splits(cfg)  # a bad file or flag stops here, in seconds
    check_model(cfg["model_path"])
    check_budget(cfg["model_path"], cfg["dataset"], train_problems + test, cfg["max_new_tokens"], cfg["max_model_len"])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    regime = make_regime(cfg["regime"])
    fresh_run_dir(cfg["out"])
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    random.Random(cfg["seed"]).shuffle(train_problems)  # the order the generator admits them in (as train.py's)

    # the trainer's model (float32, on CPU), and the generator: a vLLM engine in this process
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    clock = SimClock(cfg, StepLog(os.path.join(cfg["out"], "generator-steps.jsonl")))
    outbox = []  # what the generator finished: answers, timeline events
    if engine is not None:  # reused: it may hold an earlier run's weights
        load_in_place(engine, 0, model.state_dict())
    gen = Generator(cfg, engine or make_engine(cfg), train_problems, tokenizer, outbox, clock)
    pool, log = Pool(cfg), RunLog(cfg["out"], clock=clock.now)
    eval_ids = prompt_ids(tokenizer, test, cfg["dataset"])
    torch.manual_seed(cfg["seed"])  # vLLM samples from torch's generator: the same draws on every run

    def evaluate(step, version):
        """Greedy pass@1 of the generator's weights on the test problems, each answer kept in
        eval_answers.jsonl (reward.scored); the engine's steps cost clock time."""
        return scored(
            gen.evaluate(eval_ids, cfg["max_new_tokens"]), tokenizer, test, cfg["dataset"], log, step, version
        )

    if cfg["eval_every"]:
        gen.admit()  # train.py's generator admits its first prompts before the trainer's eval request comes
        log.trainer("evaluating")
        log.metric(m := dict(step=0, wall_s=0.0, version=0, **evaluate(0, 0), eval_version=0))
        print(f"step 0 | eval v0 {m['eval_acc']:.3f}", flush=True)
    log.trainer("waiting")
    version, step = 0, 0  # the weights the trainer holds; optimizer steps taken
    push = None  # a Push, from the end of a trainer step until the generator loads its weights
    free_at, last_stats, last_t = clock.now(), dict(gen.stats), clock.now()
    budgets = Budgets(cfg["eval_at"], cfg["eval_steps"], model)  # --eval-at, --eval-steps: weights to evaluate
    while (step < cfg["steps"] or push) and not budgets.over(clock.now(), version):
        # 1. what the generator finished since the last turn: answers into the pool, events into the log
        for kind, item in outbox:
            if kind == "sample":
                pool.add(as_tensors(item))
            else:
                log.event(item)
        outbox.clear()

        # 2. the trainer: a step as soon as it is free and the pool holds the step's groups (oldest first)
        if push is None and step < cfg["steps"] and (taken := pool.take(version)) is not None:
            groups, rejected = taken  # rejected: PACE's, when --pool pace
            batch = [s for g in groups for s in g]
            # it started when it was free and the batch's last answer was in (the loop looks once an engine step)
            step, start = step + 1, max(free_at, *(s["finished"] for s in batch))
            log.answers(groups, rejected, step, t=start)
            log.trainer("training", t=start)
            m = dict(
                step=step,
                version=version,
                **train_on(cfg, model, opt, tokenizer, step, batch, version),
                **pool_stats(groups, rejected, pool.complete, version),
                trainer_wait_s=start - free_at,
            )
            push = Push(version + 1, start + cfg["train_s"] * m["run_tokens"], m)
            clock.busy_until = push.ready_s

        # 3. the push: once the weights are ready, the regime decides, between two engine steps,
        #    what happens to the answers in flight (drain keeps the trainer waiting until they finish)
        if push and clock.now() >= push.ready_s:
            log.trainer("syncing", t=push.ready_s)
            gen.budget_offset = pool.n_rejected  # a rejected group leaves its place to a new one, as in train.py
            if regime.switch(gen, push.version, model.state_dict()):
                now, m = clock.now(), push.metrics
                # train.py's trainer goes on once the engine joins the push, when its load begins (the
                # tensors go out on their own while it takes its next batch)
                free_at = max(push.ready_s, now - cfg["load_s"])
                m.update(wall_s=now, sync_s=now - push.ready_s)
                m.update(generator_metrics(gen.stats, last_stats, now - last_t))
                version, last_stats, last_t, push = push.version, dict(gen.stats), now, None
                budgets.loaded(version, step, now)
                if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or step == cfg["steps"]):
                    gen.admit()  # as train.py's: the next prompts go in with the load, before the eval request
                    log.trainer("evaluating")
                    m.update(evaluate(step, version), eval_version=version)  # the weights just loaded
                    free_at = clock.now()
                log.metric(m)
                print(step_line(m), flush=True)
                log.trainer("waiting", t=free_at)
                continue

        # 4. the generator: admit prompts (within --max-lag), then one engine step, or idle until the weights come
        gen.admit()
        if gen.inflight:
            gen.set_activity("generating" if gen.admitting else "draining")
            gen.step()
        elif push and clock.now() < push.ready_s:  # sync, or --max-lag reached: nothing to write until they come
            gen.idle_until(push.ready_s)  # time jumps to the weights' arrival
        elif push:  # regimes.py's in-flight rule: no engine step would come, so no time, and it would wait for ever
            raise RuntimeError(f"regime {cfg['regime']}: switch returned False with no answer in flight (regimes.py)")
        else:
            raise RuntimeError("nothing in flight, no weights coming and no batch ready: the loop cannot go on")

    gen.abort_all()  # answers still in flight are left unfinished
    clock.log.flush()
    gen.set_activity("done")
    for event in [item for kind, item in outbox if kind == "event"]:
        log.event(event)
    log.trainer("done")
    print(f"done: {cfg['out']} ({clock.now():.1f} simulated seconds)")
    write_ledger(cfg, gen.stats)
    budgets.evaluate(clock.now(), partial(load_in_place, gen.engine), evaluate, log)  # after the ledger: no time
    if not cfg["no_plot"]:
        from plot import plot_run

        print("plot:", plot_run(cfg["out"]))


if __name__ == "__main__":  # vLLM may start helper processes: the guard keeps them from running this file
    config.run(main, "lesson.py")  # a user's mistake (UsageError): one line, exit code 2
