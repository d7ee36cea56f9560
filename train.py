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
- Token-level mean over the batch (every token counts the same), accumulated over
  micro-batches of --micro-batch-tokens (train_step), no KL term, no
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

from data import UsageError, last_boxed, steps_range

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
    # ahead, short micro-batches (less padding); 512 eval problems, as the gains are smaller (README)
    "long": dict(dataset="synth", synth_steps="1-12", max_new_tokens=160, max_lag=2, micro_batch_tokens=2048,
                 eval_n=512),
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
    p.add_argument("--model", default=None, help="'tiny', 'smol' (smol.py), a Hub id or a directory (default: per dataset)")
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
    p.add_argument("--loss", default="tis", choices=["tis", "ppo"], help="off-policy correction (see docstring)")
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
    p.add_argument("--gen-device", default="auto", help="generator device: auto, cpu, cuda:N")
    p.add_argument("--train-device", default="auto", help="trainer device: auto, cpu, cuda:N")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's share of its GPU (default 0.85 alone, 0.3 when sharing one GPU with the trainer)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG at the end")
    p.add_argument("--stall-s", type=float, default=0,
                   help="seconds a live generator may send nothing while the trainer waits for it, before both "
                        "stop with its stack (0: from --max-new-tokens and its slowest engine step, see stall_bound)")
    args = p.parse_args(argv)
    if args.resume:  # the saved config wins; only --steps may grow; flags added since it was saved take defaults
        if not os.path.isfile(os.path.join(args.resume, "config.json")):
            raise UsageError(f"--resume {args.resume}: not a run directory (no config.json)")
        recover_checkpoint(args.resume)
        with open(os.path.join(args.resume, "config.json")) as f:
            cfg = {**vars(p.parse_args([])), **json.load(f)}
        # out: the directory as given now, wherever the run was started from
        cfg.update(resume=args.resume, out=args.resume, steps=args.steps or cfg["steps"])
        for k, v in BASE.items():
            cfg[k] = v if cfg[k] is None else cfg[k]
        return cfg
    cfg = vars(args)
    for k, v in {**BASE, **PRESETS.get(cfg["preset"], {})}.items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    for k, v in DEFAULTS[cfg["dataset"]].items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    check_config(cfg)
    cfg["out"] = cfg["out"] or os.path.join("out", f"{cfg['regime']}-{cfg['dataset']}-s{cfg['seed']}-{time.strftime('%m%d-%H%M%S')}")
    return cfg


def check_config(cfg):
    """What can be checked without loading anything: numbers and files. A mistake
    raises UsageError (one line, exit code 2)."""
    for k in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "max_model_len", "micro_batch_tokens",
              "max_num_seqs"):
        if cfg[k] is not None and cfg[k] < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    if not 0 <= cfg["format_reward"] <= 1:
        raise UsageError(f"--format-reward must be in [0, 1] (a right answer earns 1), got {cfg['format_reward']}")
    if cfg["max_num_seqs"] is not None and cfg["max_num_seqs"] < cfg["group_size"]:
        raise UsageError(f"--max-num-seqs {cfg['max_num_seqs']} is below --group-size {cfg['group_size']}: "
                         "a group is admitted whole, so none ever would be")
    for flag in ("data_file", "eval_data_file"):
        if cfg[flag] and cfg["dataset"] == "synth":
            raise UsageError(f"--{flag.replace('_', '-')} is for --dataset gsm8k or math; synth problems are made in data.py")
        if cfg[flag] and not os.path.isfile(cfg[flag]):
            raise UsageError(f"--{flag.replace('_', '-')} {cfg[flag]}: no such file")
    if cfg.get("preset") and cfg["dataset"] != PRESETS[cfg["preset"]]["dataset"]:
        raise UsageError(f"--preset {cfg['preset']} is a {PRESETS[cfg['preset']]['dataset']} preset, not for --dataset {cfg['dataset']}")
    steps_range(cfg["synth_steps"])
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
    Evaluations allow one bound per wave of as many prompts as the engine holds at
    once (generator.kv_capacity); a weight push, one bound (drain holds it until the
    answers in flight finish)."""
    if cfg.get("stall_s"):
        return cfg["stall_s"]
    return 30 + 3 * cfg["max_new_tokens"] * gen_stats.get("max_step_s", 1.0)


def physical_gpu(device):
    """The CUDA_VISIBLE_DEVICES entry that shows the child process `device` (an index in
    this process's view) as its only GPU: with CUDA_VISIBLE_DEVICES=2,3 set by the user,
    our cuda:0 is their GPU 2, and the child must be given "2", not "0"."""
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


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
           "CUDA_VISIBLE_DEVICES": physical_gpu(gen) if gen.startswith("cuda") else "",
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
    elif cfg["model"] == "smol":  # SmolLM2-135M-Instruct from PyPI, de-quantized once (smol.py)
        from smol import smol_model_dir
        cfg["model_path"] = smol_model_dir()
    else:
        cfg["model_path"] = cfg["model"]
    env = resolve_devices(cfg)
    batch = cfg["prompts_per_step"] * cfg["group_size"]
    cfg.update(start_version=0, start_group=0, sync_host="127.0.0.1", queue_size=4 * batch,
               start_timeout=900, max_num_seqs=cfg["max_num_seqs"] or max(64, 2 * batch))
    return env

def memory_plan(cfg, config):
    """The trainer's memory, estimated from the model's config before the model loads
    (bytes by item). AdamW with float32 master weights: 4 (weights) + 4 (grads) + 8
    (two moments) bytes per parameter, plus the bf16 copy a push sends. Activations, per
    token of the largest micro-batch, with gradient checkpointing (on for CUDA) and SDPA
    attention: each layer keeps its float32 input; the layer being recomputed holds
    its bf16 intermediates and their gradients. Logits: a float32 chunk
    (LOGIT_CHUNK_BYTES) and ~4 more of its size (scaled logits, exp in logsumexp,
    their gradients)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    H, L, I = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = 4 * H + 2 * q + 2 * kv + 4 * I  # one layer's intermediates per token (elements)
    on_gpu = cfg["train_device"].startswith("cuda")
    # checkpointed (CUDA): float32 layer inputs + one layer's bf16 intermediates and gradients;
    # CPU (no checkpointing): every layer's float32 intermediates
    per_token = 4 * H * L + 2 * 2 * layer if on_gpu else 4 * layer * L
    return {"weights + grads (fp32)": 8 * n_params, "AdamW moments (fp32)": 8 * n_params,
            "bf16 copy for the push": 2 * n_params if on_gpu else 0,
            f"activations ({cfg['micro_batch_tokens']} tokens)": per_token * cfg["micro_batch_tokens"],
            "logit chunks": 5 * min(LOGIT_CHUNK_BYTES, 4 * config.vocab_size * cfg["micro_batch_tokens"])}


def check_memory_plan(cfg):
    """Print the trainer's memory plan; on a GPU, stop before loading anything when it cannot fit."""
    import torch
    from transformers import AutoConfig
    plan = memory_plan(cfg, AutoConfig.from_pretrained(cfg["model_path"]))
    total = sum(plan.values())
    print("trainer memory plan: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items())
          + f" -> {total / 2**30:.1f} GiB", flush=True)
    if cfg["train_device"].startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(cfg["train_device"])
        if total > 0.9 * free:  # 10% for the CUDA context and the allocator's fragmentation
            sys.exit(f"train.py: the trainer needs ~{total / 2**30:.1f} GiB and {cfg['train_device']} has "
                     f"{free / 2**30:.1f} GiB free: lower --micro-batch-tokens (now {cfg['micro_batch_tokens']})")


def check_kv_plan(cfg, info):
    """The generator's KV cache against what may be admitted. Requests in the engine are
    capped at what it holds (generator.kv_capacity), so vLLM never preempts; a cache that
    cannot hold one group stops the run."""
    batch = cfg["prompts_per_step"] * cfg["group_size"]
    print(f"vLLM KV cache: {info['kv_tokens']} tokens = {info['kv_answers']} answers of --max-model-len "
          f"{cfg['max_model_len']}; at most {info['admit_at_once']} in the engine at once (a step trains {batch})",
          flush=True)
    if info["admit_at_once"] < cfg["group_size"]:
        return (f"train.py: vLLM's KV cache holds {info['kv_answers']} answers of {cfg['max_model_len']} tokens, "
                f"fewer than one group ({cfg['group_size']}): raise --gpu-memory-utilization or lower --max-model-len")


# -----------------------------------------------------------------------------
# small helpers


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
    # every layer's keys and values for the whole micro-batch: ~1.8 GB at 16k tokens on Qwen3-0.6B)
    hidden = model.get_decoder()(input_ids=ids.to(device), attention_mask=attn.to(device),
                                 use_cache=False).last_hidden_state  # (B, W, H)
    # answer token j of sample i sits at position P+j and is predicted from position P+j-1
    rows = torch.cat([torch.arange(len(s["prompt_ids"]) - 1, len(x) - 1) + i * width
                      for i, (s, x) in enumerate(zip(samples, seqs))])
    h = hidden.reshape(len(seqs) * width, -1)[rows.to(device)]  # (N, H)
    targets = torch.cat([s["token_ids"] for s in samples]).long().to(device)
    head = model.get_output_embeddings()
    chunk = max(1, LOGIT_CHUNK_BYTES // (4 * head.weight.shape[0]))  # positions per chunk (read here: tests shrink it)
    return torch.cat([checkpoint(chunk_logprobs, head, h[a:a + chunk], targets[a:a + chunk], temperature,
                                 use_reentrant=False) for a in range(0, len(h), chunk)])


def train_step(cfg, model, batch, adv, device):
    """Forward and backward of the whole batch, micro-batch by micro-batch
    (--micro-batch-tokens), gradients accumulating in .grad. Each micro-batch's
    loss is divided by the answer tokens of the *whole* batch, so the gradient is
    that of the token-level mean over the batch, whatever the split. Returns
    (loss, mean |log pi - log mu| per token of the answers it ran).

    An answer whose advantage is 0 (its group's rewards all equal) adds exactly 0 to
    the loss and its gradient, so it is not run at all: the gradient is the same,
    for less work. On long-tailed tasks many groups are all right or all wrong."""
    import torch
    n_tokens = sum(len(s["token_ids"]) for s in batch)
    run = [i for i, nonzero in enumerate((adv != 0).tolist()) if nonzero]
    loss_sum, gap_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    for idx in micro_batches([batch[i] for i in run], cfg["micro_batch_tokens"]):
        idx = [run[j] for j in idx]
        mb = [batch[i] for i in idx]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logp = answer_logprobs(model, mb, cfg["temperature"], device)  # (N_mb,)
        behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)
        a = torch.cat([adv[i].expand(len(batch[i]["token_ids"])) for i in idx])
        loss = grpo_loss(cfg, logp, behaviour, a) / n_tokens
        loss.backward()
        loss_sum += loss.detach()
        gap_sum += (logp.detach() - behaviour).abs().sum()
    run_tokens = sum(len(batch[i]["token_ids"]) for i in run)
    return loss_sum.item(), gap_sum.item() / max(1, run_tokens)  # syncs: this, and `run` before any work is queued


def lr_at(cfg, step):
    """Linear warmup, then constant or cosine decay to 0 at the last step."""
    lr = cfg["lr"] * min(1.0, step / max(1, cfg["warmup_steps"]))
    if cfg["lr_schedule"] == "cosine":
        lr *= 0.5 * (1 + math.cos(math.pi * (step - 1) / cfg["steps"]))
    return lr


def grpo_loss(cfg, logp, behaviour, adv):
    """logp, behaviour, adv: (N,) per answer token. Returns the *sum* of the per-token
    surrogate; train_step divides by the batch's token count."""
    import torch
    if cfg["loss"] == "tis":
        w = torch.exp(logp.detach() - behaviour).clamp(max=cfg["is_cap"])
        per_token = -w * adv * logp
    else:
        prox = logp.detach()
        r = torch.exp(logp - prox)
        eps = cfg["clip_eps"]
        per_token = -torch.exp(prox - behaviour) * torch.min(r * adv, r.clamp(1 - eps, 1 + eps) * adv)
    return per_token.sum()


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


def load_trainer_state(run):
    """What save_checkpoint wrote beside the model. map_location: the optimizer state
    may come from another device layout (saved on cuda:1, resumed on cuda:0 or a CPU);
    opt.load_state_dict then moves each state tensor to its parameter's device."""
    import torch
    return torch.load(os.path.join(run, "ckpt", "trainer_state.pt"), map_location="cpu", weights_only=False)

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
    from reward import reward

    env = prepare(cfg)
    check_model(cfg["model_path"])  # after prepare: presets ('tiny') are directories by now
    check_budget(cfg, train_problems + test)
    device = cfg["train_device"]
    random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    start_step, version, data_position = 0, 0, 0
    if cfg.get("resume"):
        state = load_trainer_state(cfg["resume"])
        start_step, version, data_position = state["step"], state["version"], state["data_position"]
        cfg.update(model_path=os.path.join(cfg["resume"], "ckpt"), start_version=version, start_group=data_position)
    os.makedirs(cfg["out"], exist_ok=True)
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(json.dumps(cfg, indent=1))

    check_memory_plan(cfg)
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
    if problem := check_kv_plan(cfg, gen.engine_info):
        gen.stop()
        sys.exit(problem)
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
        waves = 1 + len(eval_prompt_ids) // gen.engine_info["admit_at_once"]  # what the engine holds at once
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
            log.answers(batch_groups, rejected, step)
            batch = [s for g in batch_groups for s in g]

            # 2. rewards and group-normalised advantages
            log.trainer("training")
            texts = tokenizer.batch_decode([s["token_ids"].tolist() for s in batch], skip_special_tokens=True)
            rewards = torch.tensor([reward(t, s["answer"], cfg["dataset"], cfg["format_reward"])
                                    for t, s in zip(texts, batch)])
            r = rewards.view(len(batch_groups), cfg["group_size"])
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1).to(device)

            # 3. loss and one optimizer step (micro-batches accumulate into one gradient)
            model.train()
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            opt.zero_grad(set_to_none=True)
            loss, behaviour_gap = train_step(cfg, model, batch, adv, device)
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
                     reward_mean=rewards.mean().item(), loss=loss, trained_tokens=len(versions),
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
                     preempted=stats["preempted"] - prev["preempted"],  # kept at 0 by generator.kv_capacity
                     **({"train_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device != "cpu" else {}),
                     answer_len=len(versions) / len(batch), **pool_stats(batch_groups, rejected, pool, version),
                     boxed_frac=sum(last_boxed(t) is not None for t in texts) / len(batch),  # --format-reward's aim
                     # how far the behaviour policy is from the trainer's before this step: ~0 when on-policy
                     behaviour_gap=behaviour_gap)
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
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack on stderr
    try:
        main()
    except UsageError as e:  # a user's mistake: one line, no traceback
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(2)
    except GeneratorDied as e:
        sys.exit(f"train.py: {e}")
