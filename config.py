"""
The settings both trainers share (lesson.py, train.py): the flags of the algorithm,
each dataset's defaults and the named presets, applied in one place so that the two
run the same thing from the same flags. train.py adds the flags of its processes
and devices; lesson.py those of its simulated clock.
"""

from grpo import LOSSES
from preflight import check_config


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
    # MATH's analog: long-tailed answers (2,000 test problems' solutions: p50 32 tokens, p90 86, max 117),
    # the generator two versions ahead, short micro-batches (less padding); a warm start early in the jump
    # in which it learns to chain operations (tools/tiny.py, docs/presets.md), so RL has something to
    # sharpen; 60 steps: every regime has reached its plateau by step ~40; 512 eval problems (RESULTS.md)
    "long": dict(dataset="synth", synth_steps="1-12", max_new_tokens=160, max_lag=2, micro_batch_tokens=2048,
                 model="tiny-long", steps=60, lr=6e-5, eval_every=20, eval_n=512),
}


def add_flags(p):
    """The algorithm's flags on argparse parser `p`: the task, the model, the regime, the loss, the pool, evaluation."""
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
    p.add_argument("--loss", default="tis", choices=list(LOSSES),
                   help="off-policy correction (grpo.LOSSES): none (mu ignored), tis, ppo (decoupled), icepop, geo, "
                        "cispo, gspo")
    p.add_argument("--minibatches", type=int, default=1,
                   help="optimizer steps per batch: the batch cut into this many parts, one step each, before the "
                        "weights are pushed (the policy then drifts within a batch, and PPO-style clips bind)")
    p.add_argument("--loss-agg", default="token", choices=["token", "answer", "constant"],
                   help="how the loss averages over tokens (token_weights): every token alike, every answer alike, "
                        "or a constant normaliser")
    p.add_argument("--is-cap", type=float, default=2.0, help="truncation of pi/mu for --loss tis")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip for --loss none, ppo, icepop, geo")
    p.add_argument("--icepop-low", type=float, default=0.5, help="--loss icepop: pi_old/mu below this is masked")
    p.add_argument("--icepop-high", type=float, default=5.0, help="--loss icepop: pi_old/mu above this is masked")
    p.add_argument("--geo-threshold", type=float, default=1.001,
                   help="--loss geo: an answer whose geometric mean pi_old/mu is outside [1/T, T] is masked")
    p.add_argument("--cispo-eps-low", type=float, default=1.0, help="--loss cispo: weight >= 1 - this (1: no bound)")
    p.add_argument("--cispo-eps-high", type=float, default=4.0, help="--loss cispo: weight <= 1 + this")
    p.add_argument("--gspo-eps-low", type=float, default=3e-4, help="--loss gspo: sequence ratio clip below 1")
    p.add_argument("--gspo-eps-high", type=float, default=4e-4, help="--loss gspo: sequence ratio clip above 1")
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
    p.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
    p.add_argument("--out", default=None,
                   help="run directory (default: out/<regime>-<dataset>-s<seed>-<time>; lesson.py: out/lesson-...)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG at the end")


def fill(cfg):
    """Flags not given take the preset's value, then the dataset's default; checked (preflight.check_config)."""
    for k, v in {**BASE, **PRESETS.get(cfg["preset"], {})}.items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    for k, v in DEFAULTS[cfg["dataset"]].items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    check_config(cfg, PRESETS)
    cfg["schedule_steps"] = cfg["steps"]  # the lr schedule's length: --resume keeps it
    cfg["max_num_seqs"] = cfg["max_num_seqs"] or max(64, 2 * cfg["prompts_per_step"] * cfg["group_size"])
    return cfg
