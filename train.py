"""
Asynchronous GRPO, with a choice of what happens to half-written answers when the
generator gets new weights (--regime, see regimes.py).

    python train.py                                            # tiny model + synth task, CPU, minutes
    python train.py --regime stale --preset long               # long answers: stale tokens appear
    python train.py --regime recompute --dataset gsm8k         # Qwen3-0.6B, vLLM on GPU 0, trainer on GPU 1
    python train.py --resume out/<run>                         # continue a run where its checkpoint left it
    torchrun --nproc_per_node 2 train.py --engines 2           # 2 trainer ranks (FSDP2), 2 vLLM engines (ranks.py)

Two processes: this one (the trainer) and the generator (generator.py: a vLLM
engine stepped one decode step at a time). Finished answers come over a bounded
queue; new weights go to the vLLM worker by torch.distributed broadcast after
every optimizer step. What guards the run before it starts is in preflight.py,
what keeps its directory (logs, checkpoint, resume) in rundir.py, what several
trainer ranks add (torchrun, FSDP2) in ranks.py: one line each here. Read it with one
process in mind: with one, each ranks.* call is the identity.

The loss, and what it simplifies:
- Reward (reward.py): 1 for a right final answer, else 0, or --format-reward for a
  wrong answer that at least puts something in a \\boxed{} (default 0: correctness only).
- GRPO advantages: reward minus the group mean, over the group std (+1e-4); groups
  of --group-size answers to one prompt, consumed whole.
- Off-policy correction per token with the generation-time logprobs as the
  behaviour policy mu (they come from the weights that actually sampled each
  token, stale KV included):
    --loss tis  (default, PipelineRL-style): w = min(pi/mu, --is-cap), detached;
                loss = -w * A * log pi
    --loss ppo  (AReaL's decoupled PPO): prox = pi before this step (detached);
                loss = -(prox/mu) * min(r*A, clip(r, 1-eps, 1+eps)*A), r = pi/prox.
                With one optimizer step per batch (as here) r = 1 at the only
                step, so the clip never binds and this equals uncapped IS.
- The mean over the batch's tokens (--loss-agg token: every token counts the same),
  or over answers of each answer's mean (answer: the original GRPO), or the sum over
  tokens over answers x --max-new-tokens (constant: Dr. GRPO), accumulated over
  micro-batches of --micro-batch-tokens (train_step), no KL term, no
  entropy bonus, one optimizer step per batch, AdamW with a linear warmup
  (--warmup-steps), then a constant or cosine-decayed learning rate (--lr-schedule).
"""

import argparse
import json
import math
import os
import random
import sys
import time

from data import UsageError, last_boxed
from preflight import (check_budget, check_config, check_kv_plan, check_memory_plan, check_model, load_splits,
                       prepare)
from ranks import Ranks
from rundir import RunLog, cut_logs, load_trainer_state, resume_config, save_checkpoint, write_ledger

# -----------------------------------------------------------------------------
# config

BASE = dict(dataset="synth", synth_steps="2", max_lag=1, micro_batch_tokens=16384)  # unless a preset says otherwise
DEFAULTS = {  # per dataset: what a plain `python train.py --dataset D` runs
    "synth": dict(model="tiny", steps=150, prompts_per_step=16, group_size=8, max_new_tokens=96, lr=3e-5,
                  temperature=0.5, lr_schedule="cosine", eval_every=25, eval_n=256, max_model_len=512),
    "gsm8k": dict(model="Qwen/Qwen3-0.6B", steps=500, prompts_per_step=32, group_size=8, max_new_tokens=1024,
                  lr=1e-6, temperature=1.0, lr_schedule="constant", eval_every=50, eval_n=500, max_model_len=2048),
    "math": dict(model="Qwen/Qwen3-0.6B", steps=500, prompts_per_step=32, group_size=8, max_new_tokens=2048,
                 lr=1e-6, temperature=1.0, lr_schedule="constant", eval_every=50, eval_n=500, max_model_len=4096),
}
PRESETS = {  # named settings on top of a dataset's defaults; flags given on the command line win
    # MATH's analog: long-tailed answers (p50 32 tokens, p90 86, max ~120), the generator two versions
    # ahead, short micro-batches (less padding); a warm start half-way through learning to chain
    # operations (tools/tiny.py), so RL has something to sharpen; 60 steps: every regime has
    # reached its plateau by step ~40 (RESULTS.md); 512 eval problems (README)
    "long": dict(dataset="synth", synth_steps="1-12", max_new_tokens=160, max_lag=2, micro_batch_tokens=2048,
                 model="tiny-long", steps=60, lr=6e-5, eval_every=20, eval_n=512),
}


def parse_config(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--regime", default="recompute", choices=["sync", "drain", "discard", "stale", "recompute"],
                   help="what happens to in-flight answers when new weights arrive (regimes.py)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="named settings (PRESETS); flags given win")
    p.add_argument("--dataset", default=None, choices=["synth", "gsm8k", "math"], help="task")
    p.add_argument("--data-file", default=None, help="local .jsonl/.parquet train split in the Hub schema (offline)")
    p.add_argument("--eval-data-file", default=None, help="local .jsonl/.parquet test split in the Hub schema")
    p.add_argument("--synth-steps", default=None,
                   help="operations per synth problem, which set answer length: S, or a long-tailed range A-B (data.py)")
    p.add_argument("--model", default=None, help="'tiny', 'smol' (tools/smol.py), a Hub id or a directory "
                                                 "(default: per dataset)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: per dataset)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="GRPO groups per optimizer step")
    p.add_argument("--group-size", type=int, default=None, help="answers sampled per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length cap")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + answer cap for vLLM")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (the loss uses it too)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="linear lr warmup: Adam's first steps move every weight by ~lr whatever its gradient's noise")
    p.add_argument("--lr-schedule", default=None, choices=["constant", "cosine"],
                   help="after warmup: constant, or cosine decay to 0 at --steps (default: per dataset)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="answers the generator writes at once (vLLM's max_num_seqs), like a GPU whose KV cache "
                        "holds only so many long answers (default: twice a step's answers, at least 64)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="gradient accumulation: padded tokens (answers x longest prompt+answer) per forward/backward; "
                        "default 16384, which fits Qwen3-0.6B's trainer in 24 GB (README, GPU runs)")
    p.add_argument("--format-reward", type=float, default=0.0,
                   help="reward of a wrong answer that puts something in a \\boxed{} (reward.py; 0: correctness only)")
    p.add_argument("--truncated", default="zero", choices=["zero", "filter"],
                   help="an answer cut at --max-new-tokens earns reward 0 (zero), and with filter is also left out "
                        "of the loss (DAPO's overlong filtering)")
    p.add_argument("--loss", default="tis", choices=["tis", "ppo"], help="off-policy correction (see docstring)")
    p.add_argument("--loss-agg", default="token", choices=["token", "answer", "constant"],
                   help="how the loss averages over tokens (token_weights): every token alike, every answer alike, "
                        "or a constant normaliser")
    p.add_argument("--is-cap", type=float, default=2.0, help="truncation of pi/mu for --loss tis")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip for --loss ppo")
    p.add_argument("--max-lag", type=int, default=None,
                   help="AReaL's eta (default 1): admit a prompt only if it will be consumed at most this many versions "
                        "after the weights that start it (sync forces 0)")
    p.add_argument("--pool", default="fifo", choices=["fifo", "pace"],
                   help="which finished groups a step consumes (pace.py): fifo, or PACE's staleness-aware rejection")
    p.add_argument("--pace-lambda", type=float, default=1.0, help="PACE: weight of generation staleness")
    p.add_argument("--pace-target", type=int, default=None,
                   help="PACE: pool occupancy above which groups are rejected (default: 1.5 steps' worth)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (0: never)")
    p.add_argument("--eval-n", type=int, default=None, help="test problems per evaluation")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (the last step always)")
    p.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
    p.add_argument("--out", default=None, help="run directory (default: out/<regime>-<dataset>-s<seed>-<time>)")
    p.add_argument("--resume", default=None, help="run directory to continue from its checkpoint")
    p.add_argument("--engines", type=int, default=1, help="generator engines, each its own process and vLLM engine")
    p.add_argument("--gen-device", default="auto", help="generator device: auto, cpu, cuda:N, or one per engine: "
                                                        "cuda:0,cuda:1 (auto: the first GPUs, the trainer's the next)")
    p.add_argument("--train-device", default="auto", help="trainer device: auto, cpu, cuda:N")
    p.add_argument("--tensorboard", action="store_true", help="also write the metrics for TensorBoard, in <run>/tensorboard")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's share of its GPU (default 0.85 alone, 0.3 when sharing one GPU with the trainer)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG at the end")
    p.add_argument("--stall-s", type=float, default=0,
                   help="seconds a live generator may send nothing while the trainer waits for it, before both "
                        "stop with its stack (0: from --max-new-tokens and its slowest engine step, "
                        "generator.GeneratorHandle.stall_bound)")
    args = p.parse_args(argv)
    if args.resume:  # the saved config wins; only --steps may grow
        cfg = resume_config(args.resume, args.steps, defaults=vars(p.parse_args([])))
        if cfg["lr_schedule"] == "cosine" and cfg["steps"] > cfg["schedule_steps"]:
            raise UsageError(f"--resume {args.resume} --steps {cfg['steps']}: its cosine schedule reaches lr 0 at step "
                             f"{cfg['schedule_steps']}; a run with --lr-schedule constant can be extended")
        return {**cfg, **{k: v for k, v in BASE.items() if cfg[k] is None}}
    cfg = vars(args)
    for k, v in {**BASE, **PRESETS.get(cfg["preset"], {})}.items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    for k, v in DEFAULTS[cfg["dataset"]].items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    check_config(cfg, PRESETS)
    cfg["schedule_steps"] = cfg["steps"]  # the lr schedule's length: --resume keeps it
    cfg["out"] = cfg["out"] or os.path.join("out", f"{cfg['regime']}-{cfg['dataset']}-s{cfg['seed']}-{time.strftime('%m%d-%H%M%S')}")
    return cfg

# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    # setup: every check before anything expensive (preflight.py), then the model, then the generator
    cfg = parse_config(argv)
    train_problems, test = load_splits(cfg)  # a bad file or flag stops the run here, in seconds
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from eval import eval_prompts, pass_at_1
    from generator import GeneratorHandle
    from pace import Pool, pool_stats
    from reward import reward

    ranks = Ranks()  # torchrun's trainer ranks, or this one process (ranks.py)
    envs = prepare(cfg, ranks.world, ranks.local_rank)  # devices, the model's directory, the generators' settings
    check_model(cfg["model_path"])
    check_budget(cfg["model_path"], cfg["dataset"], train_problems + test, cfg["max_new_tokens"],
                 cfg["max_model_len"], name=cfg["model"])
    device = cfg["train_device"]
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    # what a checkpoint saves of the run's progress (rundir.save_checkpoint): zero at the start
    progress = dict(step=0, version=0, data_position=0, done_groups=[], gen_stats={}, trainer_cpu_s=0.0)
    if cfg.get("resume"):
        state = load_trainer_state(cfg["resume"])
        progress = {k: state.get(k, v) for k, v in progress.items()}
        cfg.update(model_path=os.path.join(cfg["resume"], "ckpt"), start_version=progress["version"],
                   start_group=progress["data_position"], skip_groups=progress["done_groups"],
                   start_stats=progress["gen_stats"])
    start_step, version = progress["step"], progress["version"]
    check_memory_plan(cfg, LOGIT_CHUNK_BYTES, ranks.world)
    ranks.start(device)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    # float32 master weights everywhere: AdamW at lr 1e-6 on bf16 weights of size ~0.02
    # rounds most updates away (bf16's spacing there is ~1e-4). On GPU the forward
    # runs under bf16 autocast, and the push sends bf16, the generator's dtype.
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).to(device)
    gen_dtype = torch.float32 if cfg["gen_device"] == "cpu" else torch.bfloat16
    if device != "cpu":
        model.gradient_checkpointing_enable()  # long answers on a 0.6B model: trade compute for memory
    model = ranks.shard(model)  # FSDP2 across the trainer ranks; one rank: the model as it is
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    if cfg.get("resume"):
        ranks.load_optimizer(model, opt, state, cfg["model_path"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
    if not ranks.is_main:  # trainer ranks 1..K-1: the same steps on their share of each batch
        return follow(cfg, model, opt, ranks, start_step, gen_dtype, device)
    os.makedirs(cfg["out"], exist_ok=True)
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(json.dumps(cfg, indent=1))

    wall_s0 = cut_logs(cfg["out"], state) if cfg.get("resume") else 0.0  # resume: drop what came after the checkpoint
    log = RunLog(cfg["out"], cfg["tensorboard"])
    t_start = time.time() - wall_s0  # wall_s counts from here (a resumed run continues its clock)
    log.trainer("starting")
    print(f"starting the generator ({', '.join(cfg['gen_devices'])}, regime {cfg['regime']}) ...", flush=True)
    gen = GeneratorHandle(cfg, envs)  # one process per engine
    if problem := check_kv_plan(cfg, gen.engine_info):
        gen.stop()
        sys.exit(problem)
    pool = Pool(cfg, progress["data_position"], progress["done_groups"])  # finished answers, by group (pace.py)
    last_stats, last_t = dict(gen.stats), time.time()
    cpu_s0 = progress["trainer_cpu_s"] - time.process_time()  # resume: the trainer's CPU time at the checkpoint
    eval_prompt_ids = eval_prompts(tokenizer, test, cfg["dataset"])

    def intake(msg):
        """One message from the generator: an event for the timeline, or an answer for the pool."""
        kind, item = msg
        if kind == "event":
            log.event(item)
        elif kind == "sample":
            pool.add(item)

    def evaluate():
        """Greedy pass@1 of the generator's weights; an answer cut at the length cap is wrong."""
        log.trainer("evaluating")
        answers, other = gen.evaluate(eval_prompt_ids, cfg["max_new_tokens"])
        for m in other:  # training answers that finished meanwhile
            intake(m)
        texts = tokenizer.batch_decode([ids for ids, _ in answers], skip_special_tokens=True)
        truncated = [reason == "length" for _, reason in answers]
        return dict(eval_acc=pass_at_1(texts, test, cfg["dataset"], truncated),
                    eval_truncated_frac=sum(truncated) / len(truncated))

    try:
        if cfg["eval_every"] and start_step == 0:
            m = dict(step=0, wall_s=0.0, version=version, **evaluate(), eval_version=version)
            log.metric(dict(m, wall_s=round(time.time() - t_start, 2)))
            print(f"step 0 | eval v0 {m['eval_acc']:.3f}", flush=True)
        for step in range(start_step + 1, cfg["steps"] + 1):
            # 1. intake: the oldest groups not yet trained, once all their answers are in (pace.Pool)
            log.trainer("waiting")
            t0 = time.time()
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
            texts = tokenizer.batch_decode([s["token_ids"].tolist() for s in batch], skip_special_tokens=True)
            truncated = torch.tensor([s["finish_reason"] == "length" for s in batch])
            rewards = torch.tensor([reward(t, s["answer"], cfg["dataset"], cfg["format_reward"], bool(cut))
                                    for t, s, cut in zip(texts, batch, truncated)])
            adv = advantages(rewards, cfg["group_size"])
            if cfg["truncated"] == "filter":  # DAPO's overlong filtering: no gradient from a cut answer
                adv[truncated] = 0.0
            weights = token_weights(cfg, batch)  # how the loss averages over the batch's tokens

            # 3. loss and one optimizer step (micro-batches accumulate into one gradient);
            # several trainer ranks: each takes its share of the batch (ranks.py)
            loss, behaviour_gap, grad_norm = optimize(cfg, model, opt, ranks, step, *ranks.scatter(
                batch, adv, weights, lambda answers: len(micro_batches(answers, cfg["micro_batch_tokens"]))), device)

            # 4. push the new weights to the generator (drain holds the push until its answers finish)
            log.trainer("syncing")
            t0 = time.time()
            # tensor by tensor, gathered from the ranks; rejected groups leave their places to new ones
            new_version = gen.push(*ranks.weights(model, gen_dtype), rejected=pool.n_rejected)
            sync_s = time.time() - t0

            # 5. log what explains the run, evaluate the new weights, save
            now, stats = time.time(), dict(gen.stats)
            m = dict(step=step, wall_s=round(now - t_start, 2), version=version, reward_mean=rewards.mean().item(),
                     loss=loss, grad_norm=grad_norm, behaviour_gap=behaviour_gap, sync_s=sync_s,
                     trainer_wait_s=trainer_wait_s, stall_bound_s=round(gen.stall_bound(), 1),
                     truncated_frac=truncated.float().mean().item(),
                     boxed_frac=sum(last_boxed(t) is not None for t in texts) / len(batch),  # --format-reward's aim
                     **batch_metrics(batch, adv, version), **pool_stats(batch_groups, rejected, pool.complete, version),
                     **generator_metrics(stats, last_stats, now - last_t),
                     cpu_s=round(time.process_time() + cpu_s0 + stats.get("cpu_s", 0.0), 1),  # both processes, so far
                     **({"train_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device != "cpu" else {}))
            last_stats, last_t, version = stats, now, new_version
            if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or step == cfg["steps"]):
                m.update(evaluate(), eval_version=version)  # the weights just pushed: v+1
            log.metric(m)
            print(f"step {step} | v{m['version']} | reward {m['reward_mean']:.3f}"
                  + (f" | eval v{version} {m['eval_acc']:.3f}" if "eval_acc" in m else "")
                  + f" | stale {100 * m['stale_token_frac']:.1f}% | lag {m['lag_mean']:.2f}"
                  + f" | {m['gen_tok_per_s']:.0f} tok/s | sync {sync_s:.2f}s | idle {m['gen_idle_s']:.2f}s"
                  + f" | wait {trainer_wait_s:.2f}s", flush=True)
            if saves_at(cfg, step):
                log.trainer("saving")
                save_checkpoint(cfg, model, tokenizer, opt, ranks, dict(
                    step=step, version=version, data_position=pool.position, done_groups=sorted(pool.done),
                    gen_stats=stats, trainer_cpu_s=time.process_time() + cpu_s0))
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


def optimize(cfg, model, opt, ranks, step, batch, adv, weights, n_micro, device):
    """One optimizer step on `batch` (this rank's share of the step's answers: all of
    them with one rank), each answer's tokens weighted by `weights` (token_weights, of
    the whole batch). Returns (loss, behaviour gap, gradient norm), over all ranks."""
    model.train()
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, step)
    opt.zero_grad(set_to_none=True)
    loss, gap, gap_tokens = ranks.sum(*train_step(cfg, model, batch, adv.to(device), weights.to(device), device,
                                                  n_micro))
    return loss, gap / max(1, gap_tokens), optimizer_step(model, opt, loss)


def follow(cfg, model, opt, ranks, start_step, gen_dtype, device):
    """Trainer ranks 1..K-1 under torchrun (ranks.py): each step, take the share of the
    batch rank 0 hands out, the same optimizer step, help gather the weights rank 0
    pushes and the checkpoints it saves. Rank 0 does everything else."""
    for step in range(start_step + 1, cfg["steps"] + 1):
        optimize(cfg, model, opt, ranks, step, *ranks.scatter(), device)
        for _ in ranks.weights(model, gen_dtype)[1]:  # the gather is collective; rank 0 broadcasts
            pass
        if saves_at(cfg, step):
            save_checkpoint(cfg, model, None, opt, ranks, {})
    ranks.stop()


def saves_at(cfg, step):
    return step == cfg["steps"] or cfg["save_every"] and step % cfg["save_every"] == 0

# -----------------------------------------------------------------------------
# the helpers the loop teaches: advantages, log-probabilities over micro-batches, the loss, the schedule


def advantages(rewards, group_size):
    """GRPO: each answer's reward minus its group's mean, over the group's std (+1e-4).
    rewards: (groups x group_size,) in group order -> the same shape."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def micro_batches(batch, budget):
    """Split `batch` (samples) into lists of indices whose padded size, rows x longest
    prompt + answer, stays within `budget` tokens. Sorted by length first, so that
    answers of similar length share a micro-batch and little of it is padding; a
    sequence longer than the budget gets a micro-batch of its own."""
    length = lambda i: len(batch[i]["prompt_ids"]) + len(batch[i]["token_ids"])
    out, width = [], 0
    for i in sorted(range(len(batch)), key=length):
        if out and max(width, length(i)) * (len(out[-1]) + 1) <= budget:
            out[-1].append(i)
            width = max(width, length(i))
        else:
            out.append([i])
            width = length(i)
    return out


LOGIT_CHUNK_BYTES = 256 << 20  # float32 logits computed at once: 441 positions of Qwen3's 151,936-token vocabulary


def chunk_logprobs(head, hidden, targets, temperature):
    """hidden: (n, H) -> log pi(targets) (n,), through a (n, V) float32 logit tensor:
    the only full-vocabulary tensor of the step, one chunk at a time."""
    logits = head(hidden).float() / temperature  # (n, V)
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def answer_logprobs(model, samples, temperature, device):
    """log pi(token) of every answer token of `samples` under `model`, concatenated
    sample by sample into one (N,) tensor (N = answer tokens). Logits exist only at
    answer positions and a chunk at a time: each chunk is checkpointed, so backward
    recomputes its logits instead of keeping all of them (at the gsm8k defaults,
    whole-batch float32 logits would be ~190 GB)."""
    import torch
    from torch.utils.checkpoint import checkpoint
    seqs = [torch.cat([s["prompt_ids"], s["token_ids"]]).long() for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)], attn[i, :len(x)] = x, 1
    # use_cache=False: a training forward needs no KV cache (made by default, it would hold
    # every layer's keys and values for the whole micro-batch: ~1.8 GB at 16k tokens on Qwen3-0.6B).
    # The model itself is called, for the last hidden states, not its decoder: under FSDP2 the
    # root's hooks gather the weights (the lm_head's too) and reduce their gradients; logits_to_keep=1
    # makes its own logits one position
    hidden = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False, logits_to_keep=1,
                   output_hidden_states=True).hidden_states[-1]  # (B, W, H), after the final norm
    # answer token j of sample i sits at position P+j and is predicted from position P+j-1
    rows = torch.cat([torch.arange(len(s["prompt_ids"]) - 1, len(x) - 1) + i * width
                      for i, (s, x) in enumerate(zip(samples, seqs))])
    h = hidden.reshape(len(seqs) * width, -1)[rows.to(device)]  # (N, H)
    targets = torch.cat([s["token_ids"] for s in samples]).long().to(device)
    head = model.get_output_embeddings()
    chunk = max(1, LOGIT_CHUNK_BYTES // (4 * head.weight.shape[0]))  # positions per chunk (read here: tests shrink it)
    return torch.cat([checkpoint(chunk_logprobs, head, h[a:a + chunk], targets[a:a + chunk], temperature,
                                 use_reentrant=False) for a in range(0, len(h), chunk)])


def train_step(cfg, model, batch, adv, weights, device, n_micro=0):
    """Forward and backward of the whole batch, micro-batch by micro-batch
    (--micro-batch-tokens), gradients accumulating in .grad. Every token of answer i
    counts with weights[i], which token_weights computes for the *whole* batch (more
    than `batch` holds when it is one rank's share), so the gradient is that of the
    batch's loss whatever the split. Returns the loss, and the sum of |log pi - log mu|
    over the answer tokens it ran, and their number.

    An answer whose advantage is 0 (its group's rewards all equal) adds exactly 0 to
    the loss and its gradient, so it is not run at all: the gradient is the same,
    for less work. On long-tailed tasks many groups are all right or all wrong.
    (Several ranks: every rank runs n_micro micro-batches, empty ones if it has fewer,
    since FSDP2's gathers are collective: ranks.py.)"""
    import torch
    run = [i for i, nonzero in enumerate((adv != 0).tolist()) if nonzero]
    loss_sum, gap_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    mbs = micro_batches([batch[i] for i in run], cfg["micro_batch_tokens"])
    for _ in range(n_micro - len(mbs)):  # an empty micro-batch: one token through the model, weighted 0
        empty = dict(prompt_ids=torch.zeros(1, dtype=torch.long), token_ids=torch.zeros(1, dtype=torch.long))
        (0 * answer_logprobs(model, [empty], cfg["temperature"], device).sum()).backward()
    for idx in mbs:
        idx = [run[j] for j in idx]
        mb = [batch[i] for i in idx]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logp = answer_logprobs(model, mb, cfg["temperature"], device)  # (N_mb,)
        behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)
        a = torch.cat([adv[i].expand(len(batch[i]["token_ids"])) for i in idx])
        w = torch.cat([weights[i].expand(len(batch[i]["token_ids"])) for i in idx])
        loss = grpo_loss(cfg, logp, behaviour, a, w)
        loss.backward()
        loss_sum += loss.detach()
        gap_sum += (logp.detach() - behaviour).abs().sum()
    run_tokens = sum(len(batch[i]["token_ids"]) for i in run)
    return loss_sum.item(), gap_sum.item(), run_tokens  # syncs: these, and `run` before any work is queued


def token_weights(cfg, batch):
    """(answers,): how much each token of each answer counts in the loss (--loss-agg).
    A token-level mean over the batch weights every token alike, so long answers
    dominate; the per-answer mean (the original GRPO) weights every answer alike, its
    tokens 1/length each; Dr. GRPO's constant normaliser (answers x --max-new-tokens)
    weights every token alike but does not shrink a batch of short answers' gradient."""
    import torch
    lengths = torch.tensor([len(s["token_ids"]) for s in batch], dtype=torch.float32)
    if cfg["loss_agg"] == "token":
        return torch.full_like(lengths, 1 / max(1.0, lengths.sum().item()))
    if cfg["loss_agg"] == "answer":
        return 1 / (lengths.clamp(min=1) * len(batch))
    return torch.full_like(lengths, 1 / (len(batch) * cfg["max_new_tokens"]))


def grpo_loss(cfg, logp, behaviour, adv, weight):
    """logp, behaviour, adv, weight: (N,) per answer token. Returns the weighted sum
    of the per-token surrogate (token_weights make it a mean)."""
    import torch
    if cfg["loss"] == "tis":
        w = torch.exp(logp.detach() - behaviour).clamp(max=cfg["is_cap"])
        per_token = -w * adv * logp
    else:
        prox = logp.detach()
        r = torch.exp(logp - prox)
        eps = cfg["clip_eps"]
        per_token = -torch.exp(prox - behaviour) * torch.min(r * adv, r.clamp(1 - eps, 1 + eps) * adv)
    return (per_token * weight).sum()


def lr_at(cfg, step):
    """Linear warmup, then constant or cosine decay to 0 at the run's last step (as first
    planned: a resumed run keeps the schedule it started with)."""
    lr = cfg["lr"] * min(1.0, step / max(1, cfg["warmup_steps"]))
    if cfg["lr_schedule"] == "cosine":
        lr *= 0.5 * (1 + math.cos(math.pi * (step - 1) / cfg.get("schedule_steps", cfg["steps"])))
    return lr


class TrainingDiverged(RuntimeError):
    pass


def optimizer_step(model, opt, loss):
    """Clip the gradient to norm 1 and take one AdamW step; returns the norm before
    clipping. A parameter with no gradient (every answer's advantage was 0, so
    train_step ran nothing) gets a zero one: every step is the same AdamW step whether
    or not its answers ran (the moments decay; the weights move by momentum alone). A
    non-finite loss or gradient stops the run before the weights change or reach the
    generator."""
    import torch
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # over every rank's shards under FSDP2
    norm = getattr(norm, "full_tensor", lambda: norm)().item()  # a CPU-GPU sync point
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise TrainingDiverged(f"loss {loss}, gradient norm {norm}: not finite; stopped before the optimizer "
                               "step (lower --lr, or look at the step's behaviour_gap for broken logprobs)")
    opt.step()
    return norm

# -----------------------------------------------------------------------------
# what a step logs (metrics.jsonl; DESIGN.md's contract)


def batch_metrics(batch, adv, version):
    """Where the trained tokens came from: stale KV, how many versions old, answers
    spanning versions, over every token the step consumed (trained_tokens: DESIGN.md's
    contract); and the same over the tokens the loss saw (loss_*: answers whose
    advantage is not 0). `version`: the weights this step trains."""
    import torch
    versions = torch.cat([s["versions"] for s in batch])
    stale = torch.cat([s["stale"] for s in batch])
    in_loss = torch.cat([(a != 0).expand(len(s["versions"])) for s, a in zip(batch, adv)])
    return dict(trained_tokens=len(versions), answer_len=len(versions) / len(batch),
                stale_token_frac=stale.float().mean().item(),
                lag_mean=(version - versions.float()).mean().item(), lag_max=(version - versions).max().item(),
                spanning_frac=sum(int(s["versions"].min() != s["versions"].max()) for s in batch
                                  if len(s["versions"])) / len(batch),
                loss_tokens=int(in_loss.sum()), loss_stale_token_frac=stale[in_loss].float().mean().nan_to_num(0).item(),
                loss_lag_mean=(version - versions[in_loss].float()).mean().nan_to_num(0).item())


def generator_metrics(stats, prev, seconds):
    """What the generator did since the last step, from its cumulative counters."""
    prev = prev or dict.fromkeys(stats, 0)
    return dict(gen_tok_per_s=(stats["gen_tokens"] - prev["gen_tokens"]) / seconds,
                gen_idle_s=stats["gen_idle_s"] - prev["gen_idle_s"],
                **{k: stats[k] - prev[k] for k in ("discarded_tokens", "recomputed_tokens",
                                                   "preempted")})  # preempted: kept at 0 (generator.kv_capacity)


if __name__ == "__main__":
    import signal
    from generator import GeneratorDied
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`, schedulers: stop as Ctrl-C does
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack on stderr
    try:
        main()
    except UsageError as e:  # a user's mistake: one line, no traceback
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(2)
    except (GeneratorDied, TrainingDiverged) as e:
        sys.exit(f"train.py: {e}")
