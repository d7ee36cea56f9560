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
import re
import shutil
import sys
import time

from data import UsageError

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
    p.add_argument("--stall-s", type=float, default=0,
                   help="seconds a live generator may send nothing while the trainer waits for it, before both "
                        "stop with its stack (0: from --max-new-tokens and its slowest engine step, see stall_bound)")
    args = p.parse_args(argv)
    if args.resume:  # the saved config wins; only --steps may grow
        if not os.path.isfile(os.path.join(args.resume, "config.json")):
            raise UsageError(f"--resume {args.resume}: not a run directory (no config.json)")
        recover_checkpoint(args.resume)
        with open(os.path.join(args.resume, "config.json")) as f:
            cfg = json.load(f)
        # out: the directory as given now, wherever the run was started from
        cfg.update(resume=args.resume, out=args.resume, steps=args.steps or cfg["steps"])
        return cfg
    cfg = vars(args)
    for k, v in DEFAULTS[cfg["dataset"]].items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    check_config(cfg)
    cfg["out"] = cfg["out"] or os.path.join("out", f"{cfg['regime']}-{cfg['dataset']}-s{cfg['seed']}-{time.strftime('%m%d-%H%M%S')}")
    return cfg


def check_config(cfg):
    """What can be checked without loading anything: numbers and files. A mistake
    raises UsageError (one line, exit code 2)."""
    for k in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "max_model_len"):
        if cfg[k] < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    for flag in ("data_file", "eval_data_file"):
        if cfg[flag] and cfg["dataset"] == "synth":
            raise UsageError(f"--{flag.replace('_', '-')} is for --dataset gsm8k or math; synth problems are made in data.py")
        if cfg[flag] and not os.path.isfile(cfg[flag]):
            raise UsageError(f"--{flag.replace('_', '-')} {cfg[flag]}: no such file")
    if not os.path.isdir(cfg["model"]) and not hub_id_shaped(cfg["model"]):  # presets ('tiny') pass
        raise UsageError(f"--model {cfg['model']}: neither a directory nor a Hub id (org/name)")


def hub_id_shaped(name):
    """The Hub's rule: one or two names of letters, digits, '-', '_', '.'; not a path."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)) and not name.startswith((".", "-")) \
        and "--" not in name and ".." not in name


def check_model(name):
    """A directory with a config.json, or something shaped like a Hub id (org/name),
    found in the local cache when the Hub is unreachable. Without this a missing path
    reaches transformers as a Hub id and fails there with a traceback."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UsageError(f"--model {name}: a directory without config.json (not a Hugging Face checkpoint)")
        return
    if not hub_id_shaped(name):
        raise UsageError(f"--model {name}: neither a directory nor a Hub id (org/name)")
    from data import hub_reachable
    if not hub_reachable():
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise UsageError(f"--model {name}: no such directory, and the Hub is unreachable with no cached copy "
                             "of that id: pass a local directory")
        import huggingface_hub.constants  # cached: load it without five retries per file, here and
        os.environ["HF_HUB_OFFLINE"] = "1"  # in the generator (which inherits the environment)
        huggingface_hub.constants.HF_HUB_OFFLINE = True  # read at import: already imported here


def check_budget(cfg, problems):
    """The longest prompt plus --max-new-tokens must fit in --max-model-len, and that
    in the model's positions: vLLM would otherwise cap answers without a word, or
    refuse in the generator after its start. Needs the tokenizer, not the model;
    costs one batched tokenization of every prompt (~1 s for GSM8K's 7.5k)."""
    from transformers import AutoConfig, AutoTokenizer
    from data import make_prompt
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
        positions = getattr(AutoConfig.from_pretrained(cfg["model_path"]), "max_position_embeddings", None)
    except OSError as e:  # not a model, or not reachable: transformers says which
        raise UsageError(f"--model {cfg['model']}: {str(e).splitlines()[0]}") from None
    prompts = [make_prompt(tokenizer, p["question"], cfg["dataset"]) for p in problems]
    longest = max(map(len, tokenizer(prompts, add_special_tokens=False)["input_ids"]))
    n, limit = cfg["max_new_tokens"], cfg["max_model_len"]
    if positions and limit > positions:
        raise UsageError(f"--max-model-len {limit} exceeds the model's {positions} positions")
    if longest + n > limit:
        raise UsageError(f"--max-new-tokens {n} does not fit --max-model-len {limit} after the longest prompt "
                         f"({longest} tokens): lower it to {limit - longest} or raise --max-model-len to {longest + n}")


def load_splits(cfg):
    """Both splits, before torch or transformers load: the generator reads the train
    split itself, but a bad file or an offline Hub should stop the run before
    anything expensive starts. The test split is the trainer's, for evaluations."""
    from data import load_problems
    train = load_problems(cfg["dataset"], "train", data_file=cfg["data_file"], steps=cfg["synth_steps"])
    test = load_problems(cfg["dataset"], "test", n=cfg["eval_n"], data_file=cfg["eval_data_file"],
                         steps=cfg["synth_steps"], flag="--eval-data-file")
    return train, test


def stall_bound(cfg, gen_stats):
    """Seconds a live generator may send nothing while the trainer waits for it before
    the trainer calls it stuck (--stall-s overrides). Every answer ends within
    --max-new-tokens engine steps of its start, so: 30 s (a busy machine's hiccups)
    + 3 x max_new_tokens x the slowest of the generator's last 256 engine steps
    (1 s assumed before the first answer brings a measurement). It is logged as
    stall_bound_s: tiny model, 96 tokens, 2 busy cores: ~1460 s while the engine's
    ~5 s warm-up steps are in the window (14 steps of 4 x 4 answers), then 78-93 s.
    Evaluations allow one bound per wave
    of max_num_seqs prompts; a weight push, one bound (drain holds it until the
    answers in flight finish)."""
    if cfg.get("stall_s"):
        return cfg["stall_s"]
    return 30 + 3 * cfg["max_new_tokens"] * gen_stats.get("max_step_s", 1.0)


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


LOGS = ("metrics.jsonl", "events.jsonl")


def save_checkpoint(cfg, model, tokenizer, opt, step, version, data_position):
    """HF-format model + tokenizer, plus what --resume needs, in ckpt/. Safe against
    a crash at any point (not against a power cut: nothing is fsynced, which would
    cost seconds per GB): everything is written to ckpt.tmp/, trainer_state.pt last,
    and only a complete ckpt.tmp/ is renamed to ckpt/. So ckpt/ is complete whenever
    it exists; between the two renames only ckpt.old/ exists, complete, and
    recover_checkpoint puts it back. The log sizes let --resume cut the logs back
    to this moment (cut_logs)."""
    import torch
    path = os.path.join(cfg["out"], "ckpt")
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)  # what a save that died half-way left
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    log_sizes = {name: os.path.getsize(os.path.join(cfg["out"], name)) for name in LOGS
                 if os.path.exists(os.path.join(cfg["out"], name))}  # lines are flushed whole: a line boundary
    torch.save(dict(opt=opt.state_dict(), step=step, version=version, data_position=data_position,
                    log_sizes=log_sizes, rng=dict(torch=torch.get_rng_state(), python=random.getstate())),
               os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)  # a leftover of a save that died after its last rename
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_complete(path):
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "trainer_state.pt")) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def recover_checkpoint(run):
    """For --resume: <run>/ckpt/ if complete; else a complete ckpt.old/, which a save
    that died between its two renames leaves alone, renamed back to ckpt/. No
    complete checkpoint is a UsageError."""
    path = os.path.join(run, "ckpt")
    if checkpoint_complete(path):
        return path
    if not os.path.exists(path) and checkpoint_complete(path + ".old"):
        os.rename(path + ".old", path)
        print(f"resume: {path} was missing (a save was interrupted); using the previous checkpoint, "
              f"{path}.old", file=sys.stderr)
        return path
    raise UsageError(f"--resume {run}: no complete checkpoint in {path} (runs save one every --save-every "
                     "steps and at the last step)")


def cut_logs(out, state):
    """--resume: cut metrics.jsonl and events.jsonl back to their size when the
    checkpoint was saved, so each step appears once; what the dead run logged after
    it moves to <name>.cut-<time>.jsonl. Returns wall_s at the checkpoint, for the
    resumed run's clock to continue from."""
    for name, size in state.get("log_sizes", {}).items():
        path = os.path.join(out, name)
        with open(path, "rb") as f:
            f.seek(size)
            tail = f.read()
        if tail:  # copy first, then truncate: a crash in between loses nothing
            lines = tail.count(b"\n")
            side = os.path.join(out, f"{name.removesuffix('.jsonl')}.cut-{time.strftime('%m%d-%H%M%S')}.jsonl")
            with open(side, "wb") as f:
                f.write(tail)
            os.truncate(path, size)
            print(f"resume: {lines} lines of {name} written after the step-{state['step']} "
                  f"checkpoint moved to {side}", file=sys.stderr)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return max([json.loads(line).get("wall_s", 0.0) for line in f if line.strip()] or [0.0])

# -----------------------------------------------------------------------------
# the run


def main(argv=None):
    cfg = parse_config(argv)
    train_problems, test = load_splits(cfg)  # a bad file or flag stops the run here, in seconds
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from eval import eval_prompts, pass_at_1
    from generator import GeneratorHandle
    from pace import default_target, pool_stats, take_groups_fifo, take_groups_pace
    from reward import score

    env = prepare(cfg)
    check_model(cfg["model_path"])  # after prepare: presets ('tiny') are directories by now
    check_budget(cfg, train_problems + test)
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

    wall_s0 = cut_logs(cfg["out"], state) if cfg.get("resume") else 0.0  # resume: drop what came after the checkpoint
    log = RunLog(cfg["out"])
    t_start = time.time() - wall_s0  # wall_s counts from here (a resumed run continues its clock)
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
        waves = 1 + len(eval_prompt_ids) // cfg["max_num_seqs"]  # the engine runs max_num_seqs at a time
        token_ids, other = gen.evaluate(eval_prompt_ids, cfg["max_new_tokens"], stall_bound(cfg, gen_stats) * waves)
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
                bound = stall_bound(cfg, gen_stats)
                if (msg := gen.get(timeout=bound)) is None:  # alive (get raises if not), yet silent
                    gen.stalled(bound)  # stops it and raises, with its stack
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
            new_version = gen.push({k: v.to(gen_dtype) for k, v in model.state_dict().items()},
                                   timeout=stall_bound(cfg, gen_stats))  # drain holds it up to one answer
            sync_s = time.time() - t0

            # 5. log: what explains the run (DESIGN.md's metrics contract)
            versions = torch.cat([s["versions"] for s in batch])
            stale = torch.cat([s["stale"] for s in batch])
            stats, prev = dict(gen_stats), last_stats or dict.fromkeys(gen_stats, 0)
            now = time.time()
            m = dict(step=step, wall_s=round(now - t_start, 2), version=version,
                     reward_mean=rewards.mean().item(), loss=loss.item(), trained_tokens=len(versions),
                     stale_token_frac=stale.float().mean().item(),
                     lag_mean=(version - versions.float()).mean().item(), lag_max=(version - versions).max().item(),
                     stall_bound_s=round(stall_bound(cfg, gen_stats), 1),  # the watchdog's bound as it stands
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
    if not cfg["no_plot"]:
        from plot import plot_run
        print("plot:", plot_run(cfg["out"]))


if __name__ == "__main__":
    import signal
    from generator import GeneratorDied
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`, schedulers: stop as Ctrl-C does
    try:
        main()
    except UsageError as e:  # a user's mistake: one line, no traceback
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(2)
    except GeneratorDied as e:
        sys.exit(f"train.py: {e}")
