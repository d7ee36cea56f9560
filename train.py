"""
Asynchronous GRPO, with a choice of what happens to half-written answers when the
generator gets new weights (--regime, see regimes.py).

    python train.py                                            # tiny model + synth task, CPU, minutes
    python train.py --regime stale --preset long               # long answers: stale tokens appear
    python train.py --regime recompute --dataset gsm8k         # Qwen3-0.6B, vLLM on GPU 0, trainer on GPU 1
    python train.py --resume out/<run>                         # continue a run where its checkpoint left it
    torchrun --nproc_per_node 2 train.py --engines 2           # 2 trainer ranks (FSDP2), 2 vLLM engines

lesson.py's algorithm (read it first), in two processes at once: this one, the trainer, and the
generator; answers come over a queue, weights go out by broadcast after every step (system/: one line each).
"""

import argparse
import json
import os
import random
import sys
import time

import config
import grpo
from data import UsageError, load_splits, prompt_ids
from grpo import (
    LOGIT_CHUNK_BYTES,
    TrainingDiverged,
    activation_checkpointing,
    batch_metrics,
    generator_metrics,
    micro_batches,
    minibatches,
    run_tokens,
    score_batch,
    token_weights,
)
from system.checkpoint import cut_logs, load_trainer_state, resume_config, save_checkpoint
from system.devices import prepare
from system.preflight import check_budget, check_kv_plan, check_memory_plan, check_model
from system.push import check_guard
from system.ranks import Ranks
from system.runlog import RunLog, step_line, write_ledger

# -----------------------------------------------------------------------------
# config: the algorithm's flags (config.py), then the processes' and devices'


def parse_config(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=config.Help)
    config.add_flags(p, "train")
    # fmt: off
    config.add_table(p, [  # the processes and devices: a row each (name, type, default, help)
        ("save-every",             int,                   0,      "checkpoint every N steps (the last step always)"),
        ("resume",                 str,                   None,   "run directory to continue from its checkpoint "
                                                                  "(default: none, a new run)"),
        ("engines",                int,                   1,      "generator engines, each its own process and vLLM "
                                                                  "engine"),
        ("gen-device",             str,                   "auto", "generator device: auto, cpu, cuda:N, or one per "
                                                                  "engine: cuda:0,cuda:1 (auto: the first GPUs, the "
                                                                  "trainer's the next)"),
        ("train-device",           str,                   "auto", "trainer device: auto, cpu, cuda:N"),
        ("grad-checkpointing",     ("auto", "on", "off"), "auto", "recompute each layer's activations in backward "
                                                                  "(grpo.activation_checkpointing); auto: on a GPU"),
        ("tensorboard",            bool,                  False,  "also write the metrics for TensorBoard, in "
                                                                  "<run>/tensorboard"),
        ("gpu-memory-utilization", float,                 None,   "vLLM's share of its GPU (default 0.85 alone, 0.3 "
                                                                  "when sharing one GPU with the trainer)"),
        ("stall-s",                float,                 0,      "seconds a live generator may send nothing while "
                                                                  "the trainer waits for it, before both stop with "
                                                                  "its stack (0: from --max-new-tokens and its "
                                                                  "slowest engine step, "
                                                                  "system.watchdog.Watchdog.stall_bound)"),
    ])
    # fmt: on
    args = p.parse_args(argv)
    if args.resume:  # the saved config wins; only --steps may grow; it goes on from its checkpoint
        cfg = resume_config(args.resume, args.steps, defaults=vars(p.parse_args([])))
        if cfg["lr_schedule"] == "cosine" and cfg["steps"] > cfg["schedule_steps"]:
            raise UsageError(
                f"--resume {args.resume} --steps {cfg['steps']}: its cosine schedule reaches lr 0 at step "
                f"{cfg['schedule_steps']}; a run with --lr-schedule constant can be extended"
            )
        return config.fill(cfg, "train")  # flags added since it was saved
    return config.fill(vars(args), "train")  # and what follows from them (sync: --max-lag 0)


# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    # setup: every check before anything expensive (system/preflight.py), then the model, then the generator
    cfg = parse_config(argv)
    train_problems, test = load_splits(cfg)  # a bad file or flag stops the run here, in seconds
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from reward import scored
    from system.handle import GeneratorHandle
    from pool import Pool, pool_stats

    ranks = Ranks()  # torchrun's trainer ranks, or this one process (system/ranks.py)
    envs = prepare(cfg, ranks.world, ranks.local_rank)  # where each process runs, and what follows from it
    check_model(cfg["model_path"])
    check_budget(
        cfg["model_path"],
        cfg["dataset"],
        train_problems + test,
        cfg["max_new_tokens"],
        cfg["max_model_len"],
        name=cfg["model"],
    )
    device = cfg["trainer_device"]
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    # what a checkpoint saves of the run's progress (checkpoint.save_checkpoint): zero at the start
    progress = dict(step=0, version=0, data_position=0, done_groups=[], gen_stats={}, trainer_cpu_s=0.0)
    if cfg.get("resume"):
        state = load_trainer_state(cfg["resume"])
        progress = {k: state.get(k, v) for k, v in progress.items()}  # cfg has them too (checkpoint.resume_config)
    start_step, version = progress["step"], progress["version"]
    check_memory_plan(cfg, LOGIT_CHUNK_BYTES, ranks.world)
    ranks.start(device)
    cfg["out"] = ranks.from_main(cfg["out"])  # one run directory: rank 0's (each rank's default names its own second)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    # float32 master weights everywhere: AdamW at lr 1e-6 on bf16 weights of size ~0.02
    # rounds most updates away (bf16's spacing there is ~1e-4). On GPU the forward
    # runs under bf16 autocast, and the push sends bf16, the generator's dtype.
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).to(device)
    gen_dtype = torch.float32 if cfg["gen_devices"][0] == "cpu" else torch.bfloat16
    if cfg["checkpointing"]:
        activation_checkpointing(model)  # long answers on a 0.6B model: trade compute for memory
    model = ranks.shard(model)  # FSDP2 across the trainer ranks; one rank: the model as it is
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    check_guard(model, opt, gen_dtype, device if cfg["sync_backend"] == "nccl" else "cpu")  # what the push can see
    if cfg.get("resume"):
        ranks.load_optimizer(model, opt, state, cfg["model_path"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
    if not ranks.is_main:  # trainer ranks 1..K-1: the same steps on their share of each batch
        return follow(cfg, model, opt, ranks, start_step, gen_dtype, device)
    os.makedirs(cfg["out"], exist_ok=True)
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(
        f"every setting: {os.path.join(cfg['out'], 'config.json')} (--regime {cfg['regime']}, "
        f"--preset {cfg['preset']}, --dataset {cfg['dataset']}, {cfg['steps']} steps)"
    )

    wall_s0 = cut_logs(cfg["out"], state) if cfg.get("resume") else 0.0  # resume: drop what came after the checkpoint
    log = RunLog(cfg["out"], cfg["tensorboard"])
    t_start = time.time() - wall_s0  # wall_s counts from here (a resumed run continues its clock)
    log.trainer("starting")
    print(f"starting the generator ({', '.join(cfg['gen_devices'])}, regime {cfg['regime']}) ...", flush=True)
    gen = GeneratorHandle(cfg, envs)  # one process per engine
    if problem := check_kv_plan(cfg, gen.engine_info):
        gen.stop()
        sys.exit(problem)
    pool = Pool(cfg, progress["data_position"], progress["done_groups"])  # finished answers, by group (pool.py)
    last_stats, last_t = dict(gen.stats), time.time()
    cpu_s0 = progress["trainer_cpu_s"] - time.process_time()  # resume: the trainer's CPU time at the checkpoint
    eval_prompt_ids = prompt_ids(tokenizer, test, cfg["dataset"])

    def intake(msg):
        """One message from the generator: an event for the timeline, or an answer for the pool."""
        kind, item = msg
        if kind == "event":
            log.event(item)
        elif kind == "sample":
            pool.add(item)

    def evaluate(step, version):
        """Greedy pass@1 of the generator's weights (each answer in eval_answers.jsonl); an
        answer cut at the length cap is wrong."""
        log.trainer("evaluating")
        answers, other = gen.evaluate(eval_prompt_ids, cfg["max_new_tokens"])
        for m in other:  # training answers that finished meanwhile
            intake(m)
        return scored(answers, tokenizer, test, cfg["dataset"], log, step, version)  # as lesson.py's

    waited = [0.0]  # how long this step's optimizer step waited for the last push (settle)

    def settle():
        """Settle the last push, acknowledged or not: the next optimizer step overwrites the
        weights it sends, and settle() checks they were not written before that (the guard)."""
        busy = gen.pushing()
        if busy:
            log.trainer("syncing")
        waited[0] += gen.settle()  # at once when the ack is in
        if busy:
            log.trainer("training")

    try:
        if cfg["eval_every"] and start_step == 0:
            m = dict(step=0, wall_s=0.0, version=version, **evaluate(0, version), eval_version=version)
            log.metric(dict(m, wall_s=round(time.time() - t_start, 2)))
            print(f"step 0 | eval v0 {m['eval_acc']:.3f}", flush=True)
        for step in range(start_step + 1, cfg["steps"] + 1):
            # 1. intake: the oldest groups not yet trained, once all their answers are in (pool.Pool)
            log.trainer("waiting")
            t0, waited[0] = time.time(), 0.0
            while (msg := gen.get(timeout=0)) is not None:  # whatever already arrived
                intake(msg)
            while (taken := pool.take(version)) is None:
                intake(gen.next())  # a generator that stays silent too long is stopped (stall_bound)
            batch_groups, rejected = taken
            trainer_wait_s = time.time() - t0
            log.answers(batch_groups, rejected, step)
            batch = [s for g in batch_groups for s in g]

            # 2. rewards and group-normalised advantages; an answer cut at the length cap earns 0
            log.trainer("training")
            adv, scores = score_batch(cfg, tokenizer, batch, version)

            # 3. loss and --minibatches optimizer steps, each on its part of the batch (micro-batches
            # accumulate into one gradient); several trainer ranks: each takes its share of each part (system/ranks.py)
            count = lambda answers: len(micro_batches(answers, cfg["micro_batch_tokens"]))
            parts = [
                ranks.scatter(part, adv[idx], token_weights(cfg, part), count)  # token_weights: of the whole part
                for idx in minibatches(len(batch), cfg["minibatches"])
                for part in [[batch[i] for i in idx]]
            ]
            trained = grpo.step(cfg, model, opt, step, parts, device, ranks, settle)

            # 4. push the new weights to the generator (drain holds the push until its answers finish);
            # the tensors go out while the next step waits for its groups and runs its forward and
            # backward, and that step's optimizer step waits for them (settle)
            log.trainer("syncing")
            t0 = time.time()
            # tensor by tensor, gathered from the ranks; rejected groups leave their places to new ones
            new_version = gen.push(*ranks.weights(model, gen_dtype), rejected=pool.n_rejected, wait=False)
            sync_s = time.time() - t0

            # 5. log what explains the run, evaluate the new weights, save
            now, stats = time.time(), dict(gen.stats)
            m = dict(
                step=step,
                wall_s=round(now - t_start, 2),
                version=version,
                **scores,
                **trained,
                sync_s=sync_s,
                sync_wait_s=waited[0],
                trainer_wait_s=trainer_wait_s,
                stall_bound_s=round(gen.stall_bound(), 1),
                **batch_metrics(batch, adv, version),
                run_tokens=run_tokens(cfg, batch, adv),
                **pool_stats(batch_groups, rejected, pool.complete, version),
                **generator_metrics(stats, last_stats, now - last_t),
                cpu_s=round(time.process_time() + cpu_s0 + stats.get("cpu_s", 0.0), 1),  # both processes, so far
                **({"train_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device != "cpu" else {}),
            )
            last_stats, last_t, version = stats, now, new_version
            if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or step == cfg["steps"]):
                m.update(evaluate(step, version), eval_version=version)  # the weights just pushed: v+1
            log.metric(m)
            print(step_line(m), flush=True)
            if saves_at(cfg, step):
                gen.settle()  # a checkpoint's version is one every engine holds
                log.trainer("saving")
                save_checkpoint(
                    cfg,
                    model,
                    tokenizer,
                    opt,
                    ranks,
                    dict(
                        step=step,
                        version=version,
                        data_position=pool.position,
                        done_groups=sorted(pool.done),
                        gen_stats=stats,
                        trainer_cpu_s=time.process_time() + cpu_s0,
                    ),
                )
        gen.settle()
        log.trainer("done")
    except KeyboardInterrupt:
        print("interrupted: stopping the generator", file=sys.stderr)
        sys.exit(130)
    finally:
        gen.stop()
        ranks.stop()
    print(f"done in {time.time() - t_start:.0f}s: {cfg['out']}")
    write_ledger(cfg, gen.stats)
    if not cfg["no_plot"]:
        from plot import plot_run

        print("plot:", plot_run(cfg["out"]))


def follow(cfg, model, opt, ranks, start_step, gen_dtype, device):
    """Trainer ranks 1..K-1 under torchrun (system/ranks.py): each step, take the share of the
    batch rank 0 hands out, the same optimizer step, help gather the weights rank 0
    pushes and the checkpoints it saves. Rank 0 does everything else."""
    for step in range(start_step + 1, cfg["steps"] + 1):
        grpo.step(cfg, model, opt, step, [ranks.scatter() for _ in range(cfg["minibatches"])], device, ranks)
        for _ in ranks.weights(model, gen_dtype)[1]:  # the gather is collective; rank 0 broadcasts
            pass
        if saves_at(cfg, step):
            save_checkpoint(cfg, model, None, opt, ranks, {})
    ranks.stop()


def saves_at(cfg, step):
    return step == cfg["steps"] or cfg["save_every"] and step % cfg["save_every"] == 0


if __name__ == "__main__":
    import signal
    from system.watchdog import GeneratorDied

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`, schedulers: stop as Ctrl-C does
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack on stderr
    config.run(main, "train.py", GeneratorDied, TrainingDiverged)  # a user's mistake: one line, exit code 2
