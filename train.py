"""
Asynchronous GRPO, with a choice of what happens to half-written answers when the
generator gets new weights (--regime, see regimes.py).

    python train.py                                            # tiny model + synth task, CPU, minutes
    python train.py --regime stale --synth-steps 12            # long answers: stale tokens appear
    python train.py --regime recompute --dataset gsm8k         # Qwen3-0.6B, vLLM on GPU 0, trainer on GPU 1
    python train.py --resume out/<run>                         # continue a run where its checkpoint left it

Two processes: this one (the trainer) and the generator (generator.py: a vLLM
engine stepped one decode step at a time). Finished answers come over a bounded
queue; new weights go to the vLLM worker by torch.distributed broadcast after
every optimizer step.

The loss, and what it simplifies:
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
- Token-level mean over the batch (every token counts the same), no KL term, no
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

# -----------------------------------------------------------------------------
# config

DEFAULTS = {  # per dataset: what a plain `python train.py --dataset D` runs
    "synth": dict(model="tiny", steps=150, prompts_per_step=16, group_size=8, max_new_tokens=96, lr=3e-5,
                  temperature=0.5, lr_schedule="cosine", eval_every=25, eval_n=256, max_model_len=512),
    "gsm8k": dict(model="Qwen/Qwen3-0.6B", steps=500, prompts_per_step=32, group_size=8, max_new_tokens=1024,
                  lr=1e-6, temperature=1.0, lr_schedule="constant", eval_every=50, eval_n=500, max_model_len=2048),
    "math": dict(model="Qwen/Qwen3-0.6B", steps=500, prompts_per_step=32, group_size=8, max_new_tokens=2048,
                 lr=1e-6, temperature=1.0, lr_schedule="constant", eval_every=50, eval_n=500, max_model_len=4096),
}


def parse_config(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--regime", default="recompute", choices=["sync", "drain", "discard", "stale", "recompute"],
                   help="what happens to in-flight answers when new weights arrive (regimes.py)")
    p.add_argument("--dataset", default="synth", choices=["synth", "gsm8k", "math"], help="task")
    p.add_argument("--data-file", default=None, help="local .jsonl/.parquet train split in the Hub schema (offline)")
    p.add_argument("--eval-data-file", default=None, help="local .jsonl/.parquet test split in the Hub schema")
    p.add_argument("--synth-steps", type=int, default=2, help="operations per synth problem: sets answer length")
    p.add_argument("--model", default=None, help="'tiny', a Hub id or a directory (default: per dataset)")
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
    p.add_argument("--loss", default="tis", choices=["tis", "ppo"], help="off-policy correction (see docstring)")
    p.add_argument("--is-cap", type=float, default=2.0, help="truncation of pi/mu for --loss tis")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip for --loss ppo")
    p.add_argument("--max-lag", type=int, default=1,
                   help="AReaL's eta: admit a prompt only if it will be consumed at most this many versions "
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
    p.add_argument("--gen-device", default="auto", help="generator device: auto, cpu, cuda:N")
    p.add_argument("--train-device", default="auto", help="trainer device: auto, cpu, cuda:N")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's share of its GPU (default 0.85 alone, 0.3 when sharing one GPU with the trainer)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG at the end")
    args = p.parse_args(argv)
    if args.resume:  # the saved config wins; only --steps may grow
        with open(os.path.join(args.resume, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(resume=args.resume, steps=args.steps or cfg["steps"])
        return cfg
    cfg = vars(args)
    for k, v in DEFAULTS[cfg["dataset"]].items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    for k in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
        if cfg[k] < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    cfg["out"] = cfg["out"] or os.path.join("out", f"{cfg['regime']}-{cfg['dataset']}-s{cfg['seed']}-{time.strftime('%m%d-%H%M%S')}")
    return cfg


def resolve_devices(cfg):
    """auto: two GPUs -> generator cuda:0, trainer cuda:1; one GPU -> both share it;
    none -> both on CPU, with the cores split in half (generator first). Returns
    the environment the generator process starts with."""
    import torch
    n_gpu = torch.cuda.device_count()
    if cfg["gen_device"] == "auto":
        cfg["gen_device"] = "cuda:0" if n_gpu else "cpu"
    if cfg["train_device"] == "auto":
        cfg["train_device"] = f"cuda:{min(1, n_gpu - 1)}" if n_gpu else "cpu"
    gen, train = cfg["gen_device"], cfg["train_device"]
    # NCCL needs two distinct GPUs; otherwise weights travel through CPU memory over gloo
    cfg["sync_backend"] = "nccl" if gen.startswith("cuda") and train.startswith("cuda") and gen != train else "gloo"
    if cfg["gpu_memory_utilization"] is None:
        cfg["gpu_memory_utilization"] = 0.3 if gen == train else 0.85
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the generator process: see generator.make_engine
           "CUDA_VISIBLE_DEVICES": gen.split(":")[1] if gen.startswith("cuda") else "",
           # vLLM logs every in-place reload (and warns that the rotary embedding has no
           # weights to load): quiet by default, VLLM_LOGGING_LEVEL=INFO shows it all
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if gen == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        gen_cores = cores[:max(1, len(cores) // 2)]
        env["INFLIGHT_GEN_CORES"] = ",".join(map(str, gen_cores))  # generator_main keeps to these
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: plenty for small models, leaves RAM for the trainer
        cfg["gen_threads"] = len(gen_cores)
        if train == "cpu" and len(cores) > 1:  # the trainer keeps to the other half
            os.sched_setaffinity(0, cores[len(gen_cores):])
    else:
        cfg["gen_threads"] = 1
        gen_cores = []
    if train == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    else:
        torch.cuda.set_device(train)
    return env

def prepare(cfg):
    """Devices, the model's path (building the tiny model if asked) and the
    generator's runtime settings; returns the generator's environment."""
    if cfg["model"] == "tiny":  # before resolve_devices pins this process to half the cores
        from tiny import tiny_model_dir
        cfg["model_path"] = tiny_model_dir()
    else:
        cfg["model_path"] = cfg["model"]
    env = resolve_devices(cfg)
    batch = cfg["prompts_per_step"] * cfg["group_size"]
    cfg.update(start_version=0, start_group=0, sync_host="127.0.0.1", queue_size=4 * batch,
               start_timeout=900, max_num_seqs=max(64, 2 * batch))
    return env

# -----------------------------------------------------------------------------
# small helpers


def token_logprobs(model, batch, temperature, device):
    """log pi(token) for every answer token, under `model`; batch: list of samples.
    Returns a (B, T) tensor and a (B, T) mask, T = longest answer."""
    import torch
    seqs = [torch.cat([s["prompt_ids"], s["token_ids"]]).long() for s in batch]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)], attn[i, :len(x)] = x, 1
    ids, attn = ids.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature  # (B, W-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, W-1)
    T = max(len(s["token_ids"]) for s in batch)
    out = torch.zeros(len(batch), T, device=device)
    mask = torch.zeros(len(batch), T, device=device)
    for i, s in enumerate(batch):  # answer token j sits at position P+j, predicted from P+j-1
        P, n = len(s["prompt_ids"]), len(s["token_ids"])
        out[i, :n], mask[i, :n] = logp[i, P - 1:P - 1 + n], 1
    return out, mask


def lr_at(cfg, step):
    """Linear warmup, then constant or cosine decay to 0 at the last step."""
    lr = cfg["lr"] * min(1.0, step / max(1, cfg["warmup_steps"]))
    if cfg["lr_schedule"] == "cosine":
        lr *= 0.5 * (1 + math.cos(math.pi * (step - 1) / cfg["steps"]))
    return lr


def grpo_loss(cfg, logp, mask, behaviour, adv):
    """logp, behaviour, mask: (B, T); adv: (B,). Token-level mean of the surrogate."""
    import torch
    A = adv[:, None]
    if cfg["loss"] == "tis":
        w = torch.exp(logp.detach() - behaviour).clamp(max=cfg["is_cap"])
        per_token = -w * A * logp
    else:
        prox = logp.detach()
        r = torch.exp(logp - prox)
        eps = cfg["clip_eps"]
        per_token = -torch.exp(prox - behaviour) * torch.min(r * A, r.clamp(1 - eps, 1 + eps) * A)
    return (per_token * mask).sum() / mask.sum()


class RunLog:
    """metrics.jsonl and events.jsonl, appended and flushed line by line, so a crash
    loses nothing already logged."""

    def __init__(self, out):
        self.metrics = open(os.path.join(out, "metrics.jsonl"), "a")
        self.events = open(os.path.join(out, "events.jsonl"), "a")
        self.answers_f = open(os.path.join(out, "answers.jsonl"), "a")
        self.activity = None

    def event(self, e):
        self.events.write(json.dumps(e) + "\n")
        self.events.flush()

    def trainer(self, what):
        if what != self.activity:
            self.activity = what
            self.event(dict(t=time.time(), proc="trainer", what=what))

    def metric(self, m):
        self.metrics.write(json.dumps(m) + "\n")
        self.metrics.flush()

    def answers(self, consumed, rejected, step):
        """answers.jsonl: one line per answer the pool let go of, with its provenance
        (generator.Rollout) and its fate: consumed by this step or rejected (PACE)."""
        t = time.time()
        lines = [json.dumps(dict(sample_id=s["sample_id"], group_id=s["group_id"], prompt_id=s["prompt_id"],
                                 tokens=len(s["token_ids"]), fate=fate, step=step, t=t, **s["provenance"]))
                 for groups, fate in ((consumed, "consumed"), (rejected, "rejected")) for g in groups for s in g]
        self.answers_f.write("".join(line + "\n" for line in lines))
        self.answers_f.flush()


def write_ledger(cfg, t_start, start_step, gen_stats):
    """The wasted-work ledger of this session (from t_start): where the generated
    tokens went, and each process's wall-clock by activity (events.jsonl), as shares.
    generated = trained + discarded + rejected + left over (in the pool or in flight
    at the end); recomputed tokens were prefilled again, not generated."""
    from plot import activity_spans, read_jsonl
    steps = [m for m in read_jsonl(os.path.join(cfg["out"], "metrics.jsonl")) if m["step"] > start_step
             and "trained_tokens" in m]
    tok = dict(generated=gen_stats.get("gen_tokens", 0), trained=sum(m["trained_tokens"] for m in steps),
               discarded=gen_stats.get("discarded_tokens", 0),
               rejected=sum(m.get("rejected_tokens", 0) for m in steps))
    tok["left_over"] = tok["generated"] - tok["trained"] - tok["discarded"] - tok["rejected"]
    tok["recomputed"] = gen_stats.get("recomputed_tokens", 0)
    events = [e for e in read_jsonl(os.path.join(cfg["out"], "events.jsonl")) if e["t"] >= t_start]
    # shares of the time after start-up (the engine's start dominates short CPU runs)
    ready = min([e["t"] for e in events if e["proc"] == "trainer" and e.get("what", "starting") != "starting"]
                or [t_start])
    end = max([e["t"] for e in events] or [t_start])
    secs = {}
    for proc, what, t0, t1 in activity_spans(events):
        if what not in ("starting", "done") and min(t1, end) > max(t0, ready):
            secs.setdefault(proc, {}).setdefault(what, 0.0)
            secs[proc][what] += min(t1, end) - max(t0, ready)
    total = end - ready
    led = dict(tokens=tok, seconds=secs, total_s=total, startup_s=ready - t_start)
    with open(os.path.join(cfg["out"], "ledger.json"), "w") as f:
        json.dump(led, f, indent=1)
    g = max(1, tok["generated"])
    print(f"wasted-work ledger ({cfg['out']}/ledger.json): {tok['generated']:,} tokens generated = "
          + " + ".join(f"{tok[k]:,} {k.replace('_', ' ')} ({100 * tok[k] / g:.1f}%)"
                       for k in ("trained", "discarded", "rejected", "left_over"))
          + f"; {tok['recomputed']:,} prefilled again (recompute)")
    for proc, d in secs.items():
        shares = sorted(d.items(), key=lambda x: -x[1])
        print(f"  {proc:9s} {total:.0f} s after {ready - t_start:.0f} s of start-up: "
              + ", ".join(f"{w} {100 * s / max(total, 1e-9):.0f}%" for w, s in shares))
    return led


def save_checkpoint(cfg, model, tokenizer, opt, step, version, data_position):
    """HF-format model + tokenizer, plus what --resume needs, written then renamed."""
    import torch
    path = os.path.join(cfg["out"], "ckpt")
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(dict(opt=opt.state_dict(), step=step, version=version, data_position=data_position,
                    rng=dict(torch=torch.get_rng_state(), python=random.getstate())),
               os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(path):
        os.rename(path, path + ".old")
    os.rename(tmp, path)
    if os.path.exists(path + ".old"):
        import shutil
        shutil.rmtree(path + ".old")

# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    cfg = parse_config(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data import load_problems
    from eval import eval_prompts, pass_at_1
    from generator import GeneratorHandle
    from pace import default_target, pool_stats, take_groups_fifo, take_groups_pace
    from reward import score

    env = prepare(cfg)
    device = cfg["train_device"]
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    start_step, version, data_position = 0, 0, 0
    if cfg.get("resume"):
        state = torch.load(os.path.join(cfg["resume"], "ckpt", "trainer_state.pt"), weights_only=False)
        start_step, version, data_position = state["step"], state["version"], state["data_position"]
        cfg.update(model_path=os.path.join(cfg["resume"], "ckpt"), start_version=version, start_group=data_position)
    os.makedirs(cfg["out"], exist_ok=True)
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(json.dumps(cfg, indent=1))

    # the train split is the generator's (each sample carries its answer); the test split is ours
    test = load_problems(cfg["dataset"], "test", n=cfg["eval_n"], data_file=cfg["eval_data_file"],
                         steps=cfg["synth_steps"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    # float32 master weights everywhere: AdamW at lr 1e-6 on bf16 weights of size ~0.02
    # rounds most updates away (bf16's spacing there is ~1e-4). On GPU the forward
    # runs under bf16 autocast, and the push sends bf16, the generator's dtype.
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).to(device)
    gen_dtype = torch.float32 if cfg["gen_device"] == "cpu" else torch.bfloat16
    if device != "cpu":
        model.gradient_checkpointing_enable()  # long answers on a 0.6B model: trade compute for memory
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    if cfg.get("resume"):
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    log = RunLog(cfg["out"])
    t_start = time.time()  # wall_s counts from here, and so does the timeline
    log.trainer("starting")
    print(f"starting the generator ({cfg['gen_device']}, regime {cfg['regime']}) ...", flush=True)
    gen = GeneratorHandle(cfg, env)
    pool, partial = {}, {}  # complete groups; groups still missing answers
    last_stats, last_t = {}, time.time()
    eval_prompt_ids = eval_prompts(tokenizer, test, cfg["dataset"])

    def intake(msg):
        kind, item = msg
        if kind == "event":
            log.event(item)
        elif kind == "sample":
            g = partial.setdefault(item["group_id"], [])
            g.append(item)
            if len(g) == cfg["group_size"]:
                pool[item["group_id"]] = partial.pop(item["group_id"])
            gen_stats.update(item["gen_stats"])  # the generator's cumulative counters

    def evaluate():
        log.trainer("evaluating")
        token_ids, other = gen.evaluate(eval_prompt_ids, cfg["max_new_tokens"])
        for m in other:
            intake(m)
        return pass_at_1(tokenizer.batch_decode(token_ids, skip_special_tokens=True), test, cfg["dataset"])

    gen_stats = {}
    try:
        if cfg["eval_every"] and start_step == 0:
            acc = evaluate()
            log.metric(dict(step=0, wall_s=round(time.time() - t_start, 2), version=version, eval_acc=acc))
            print(f"step 0 | eval acc {acc:.3f}", flush=True)
        for step in range(start_step + 1, cfg["steps"] + 1):
            # 1. intake: wait for enough complete groups
            log.trainer("waiting")
            t0 = time.time()
            while len(pool) < cfg["prompts_per_step"]:
                msg = gen.get(timeout=60)
                if msg is not None:
                    intake(msg)
            while (msg := gen.get(timeout=0)) is not None:  # whatever else already arrived
                intake(msg)
            trainer_wait_s = time.time() - t0
            if cfg["pool"] == "pace":
                target = cfg["pace_target"] or default_target(cfg["prompts_per_step"])
                batch_groups, rejected = take_groups_pace(pool, cfg["prompts_per_step"], version,
                                                          cfg["pace_lambda"], target)
            else:
                batch_groups, rejected = take_groups_fifo(pool, cfg["prompts_per_step"]), []
            log.answers(batch_groups, rejected, step)
            batch = [s for g in batch_groups for s in g]

            # 2. rewards and group-normalised advantages
            log.trainer("training")
            texts = tokenizer.batch_decode([s["token_ids"].tolist() for s in batch], skip_special_tokens=True)
            rewards = torch.tensor([score(t, s["answer"], cfg["dataset"])
                                    for t, s in zip(texts, batch)])
            r = rewards.view(len(batch_groups), cfg["group_size"])
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1).to(device)

            # 3. loss and one optimizer step
            model.train()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
                logp, mask = token_logprobs(model, batch, cfg["temperature"], device)
            behaviour = torch.zeros_like(logp)
            for i, s in enumerate(batch):
                behaviour[i, :len(s["logprobs"])] = s["logprobs"].to(device)
            loss = grpo_loss(cfg, logp, mask, behaviour, adv)
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

            # 4. push the new weights to the generator
            log.trainer("syncing")
            t0 = time.time()
            new_version = gen.push({k: v.to(gen_dtype) for k, v in model.state_dict().items()})
            sync_s = time.time() - t0

            # 5. log: what explains the run (DESIGN.md's metrics contract)
            versions = torch.cat([s["versions"] for s in batch])
            stale = torch.cat([s["stale"] for s in batch])
            stats, prev = dict(gen_stats), last_stats or dict.fromkeys(gen_stats, 0)
            now = time.time()
            m = dict(step=step, wall_s=round(now - t_start, 2), version=version,
                     reward_mean=rewards.mean().item(), loss=loss.item(), trained_tokens=len(versions),
                     stale_token_frac=stale.float().mean().item(),
                     lag_mean=(version - versions.float()).mean().item(),
                     spanning_frac=sum(int(s["versions"].min() != s["versions"].max()) for s in batch
                                       if len(s["versions"])) / len(batch),
                     gen_tok_per_s=(stats["gen_tokens"] - prev["gen_tokens"]) / (now - last_t),
                     sync_s=sync_s, trainer_wait_s=trainer_wait_s,
                     gen_idle_s=stats["gen_idle_s"] - prev["gen_idle_s"],
                     discarded_tokens=stats["discarded_tokens"] - prev["discarded_tokens"],
                     recomputed_tokens=stats["recomputed_tokens"] - prev["recomputed_tokens"],
                     answer_len=len(versions) / len(batch), **pool_stats(batch_groups, rejected, pool, version),
                     # how far the behaviour policy is from the trainer's before this step: ~0 when on-policy
                     behaviour_gap=((logp.detach() - behaviour).abs() * mask).sum().item() / mask.sum().item())
            last_stats, last_t, version = stats, now, new_version
            data_position = max(data_position, 1 + max(g[0]["group_id"] for g in batch_groups))
            if cfg["eval_every"] and step % cfg["eval_every"] == 0 or step == cfg["steps"] and cfg["eval_every"]:
                m["eval_acc"] = evaluate()
            log.metric(m)
            print(f"step {step} | v{m['version']} | reward {m['reward_mean']:.3f}"
                  + (f" | eval {m['eval_acc']:.3f}" if "eval_acc" in m else "")
                  + f" | stale {100 * m['stale_token_frac']:.1f}% | lag {m['lag_mean']:.2f}"
                  + f" | {m['gen_tok_per_s']:.0f} tok/s | sync {sync_s:.2f}s | idle {m['gen_idle_s']:.2f}s"
                  + f" | wait {trainer_wait_s:.2f}s", flush=True)
            if step == cfg["steps"] or cfg["save_every"] and step % cfg["save_every"] == 0:
                log.trainer("saving")
                save_checkpoint(cfg, model, tokenizer, opt, step, version, data_position)
        log.trainer("done")
    except KeyboardInterrupt:
        print("interrupted: stopping the generator", file=sys.stderr)
        sys.exit(130)
    finally:
        gen.stop()
    print(f"done in {time.time() - t_start:.0f}s: {cfg['out']}")
    write_ledger(cfg, t_start, start_step, gen_stats)
    if not cfg["no_plot"]:
        from plot import plot_run
        print("plot:", plot_run(cfg["out"]))


if __name__ == "__main__":
    import signal
    from generator import GeneratorDied
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`, schedulers: stop as Ctrl-C does
    try:
        main()
    except GeneratorDied as e:
        sys.exit(f"train.py: {e}")
