"""
What keeps train.py's run directory, out/<run>/ (its files: system/runlog.py), across a
crash: the checkpoint, and --resume. It protects the user from a crash while saving that
leaves no checkpoint, or half of one (save_checkpoint, recover_checkpoint); a resumed run
that shows some steps or answers twice, or loses groups (cut_logs; the checkpoint keeps
which groups were consumed or rejected, so exactly the others are generated again); and
optimizer state saved on one device layout that will not load on another (load_trainer_state).
train.py calls one of these per line; this file says how each works.
"""

import json
import os
import random
import shutil
import sys
import time

from data import UsageError
from system.runlog import read_jsonl

LOGS = ("metrics.jsonl", "events.jsonl", "answers.jsonl", "eval_answers.jsonl")


def resume_config(run, steps, defaults):
    """--resume RUN: the config saved in RUN wins; only --steps may change; flags added
    to train.py since it was saved take their defaults (config.fill, after this); the
    model, the weight version, the data position and the generator's counters are the
    checkpoint's. The devices are the user's flags as saved (system/devices.py resolves them
    again, on this machine, for this rank)."""
    if not os.path.isfile(os.path.join(run, "config.json")):
        raise UsageError(f"--resume {run}: not a run directory (no config.json)")
    if int(os.environ.get("RANK", 0)) == 0:  # torchrun: rank 0 alone puts a checkpoint back; the others wait
        recover_checkpoint(run)
    else:
        wait_for_checkpoint(run)
    with open(os.path.join(run, "config.json")) as f:
        cfg = {**defaults, **json.load(f)}
    state = load_trainer_state(run)
    done = state["step"]
    if (steps or cfg["steps"]) <= done:  # it would start, do nothing and stop
        raise UsageError(f"--resume {run}: its checkpoint is at step {done}; pass --steps above {done} to go on")
    cfg.setdefault("schedule_steps", cfg["steps"])  # the lr schedule's length, as first planned
    # out: the directory as given now, wherever the run was started from; the rest: where its checkpoint
    # left it (the weights, their version, the data position, the groups done after it, the generator's counters)
    cfg.update(
        resume=run,
        out=run,
        steps=steps or cfg["steps"],
        model_path=os.path.join(run, "ckpt"),
        start_version=state.get("version", 0),
        start_group=state.get("data_position", 0),
        skip_groups=state.get("done_groups", []),
        start_stats=state.get("gen_stats", {}),
    )
    return cfg


def save_checkpoint(cfg, model, tokenizer, opt, ranks, progress):
    """HF-format model + tokenizer, plus what --resume needs, in ckpt/: the optimizer,
    the RNGs and `progress` (step, version, the pool's position and the groups after it
    already done, the generator's counters). Safe against
    a crash at any point (not against a power cut: nothing is fsynced, which would
    cost seconds per GB): everything is written to ckpt.tmp/, trainer_state.pt last,
    and only a complete ckpt.tmp/ is renamed to ckpt/. So ckpt/ is complete whenever
    it exists; between the two renames only ckpt.old/ exists, complete, and
    recover_checkpoint puts it back. The log sizes let --resume cut the logs back
    to this moment (cut_logs). Several trainer ranks (system/ranks.py) all call it: the
    weights are gathered for rank 0 to write, each rank writes its optimizer shards."""
    import torch

    path = os.path.join(cfg["out"], "ckpt")
    tmp, old = path + ".tmp", path + ".old"
    state_dict = ranks.full_state_dict(model)  # collective: every rank takes part
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a save that died half-way left
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
    ranks.barrier()
    ranks.save_optimizer(model, opt, tmp)
    ranks.barrier()
    if ranks.is_main and ranks.world > 1:  # DCP names each rank's file __<rank>_<n>.distcp
        shards = os.listdir(os.path.join(tmp, "optimizer"))
        missing = [r for r in range(ranks.world) if not any(f.startswith(f"__{r}_") for f in shards)]
        if missing:  # the ranks wrote to different directories: a checkpoint that would not resume
            raise RuntimeError(f"checkpoint {tmp}: the optimizer shards of trainer ranks {missing} are missing")
    if ranks.is_main:
        log_sizes = {
            name: os.path.getsize(os.path.join(cfg["out"], name))
            for name in LOGS
            if os.path.exists(os.path.join(cfg["out"], name))
        }  # lines are flushed whole: a line boundary
        torch.save(
            dict(
                opt=opt.state_dict() if ranks.world == 1 else None,
                world=ranks.world,
                **progress,
                log_sizes=log_sizes,
                saved_t=time.time(),
                rng=dict(torch=torch.get_rng_state(), python=random.getstate()),
            ),
            os.path.join(tmp, "trainer_state.pt"),
        )
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)  # a leftover of a save that died after its last rename
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    ranks.barrier()


def checkpoint_complete(path):
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "trainer_state.pt")) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")
    )


def recover_checkpoint(run):
    """For --resume: <run>/ckpt/ if complete; else a complete ckpt.old/, which a save
    that died between its two renames leaves alone, renamed back to ckpt/. No
    complete checkpoint is a UsageError."""
    path = os.path.join(run, "ckpt")
    if checkpoint_complete(path):
        return path
    if not os.path.exists(path) and checkpoint_complete(path + ".old"):
        os.rename(path + ".old", path)
        print(
            f"resume: {path} was missing (a save was interrupted); using the previous checkpoint, {path}.old",
            file=sys.stderr,
        )
        return path
    raise UsageError(
        f"--resume {run}: no complete checkpoint in {path} (runs save one every --save-every "
        "steps and at the last step)"
    )


def wait_for_checkpoint(run, timeout=600):
    """Trainer ranks 1..K-1 under --resume: wait until rank 0 has recovered ckpt/ (recover_checkpoint)."""
    for _ in range(int(timeout / 0.2)):
        if checkpoint_complete(os.path.join(run, "ckpt")):
            return
        if not any(checkpoint_complete(os.path.join(run, d)) for d in ("ckpt", "ckpt.old")):
            break  # nothing rank 0 could recover: it says why
        time.sleep(0.2)
    raise UsageError(f"--resume {run}: no complete checkpoint in {os.path.join(run, 'ckpt')} appeared")


def cut_logs(out, state):
    """--resume: cut the logs back to their size when the checkpoint was saved, so
    each step and each answer appears once; what the dead run logged after it moves to
    <name>.cut-<time>.jsonl. Returns wall_s at the checkpoint, for the resumed run's
    clock to continue from."""
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
            print(
                f"resume: {lines} lines of {name} written after the step-{state['step']} checkpoint moved to {side}",
                file=sys.stderr,
            )
    with open(os.path.join(out, "events.jsonl"), "a") as f:  # the gap until this restart is no activity
        for proc in ["trainer"] + sorted(
            {e["proc"] for e in read_jsonl(os.path.join(out, "events.jsonl"))} - {"trainer"}
        ):
            f.write(json.dumps(dict(t=state.get("saved_t", time.time()), proc=proc, what="stopped")) + "\n")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return max([json.loads(line).get("wall_s", 0.0) for line in f if line.strip()] or [0.0])


def load_trainer_state(run):
    """What save_checkpoint wrote beside the model. map_location: the optimizer state
    may come from another device layout (saved on cuda:1, resumed on cuda:0 or a CPU);
    opt.load_state_dict then moves each state tensor to its parameter's device."""
    import torch  # mmap: nothing is read until used (--resume reads the step first, the optimizer state later)

    return torch.load(os.path.join(run, "ckpt", "trainer_state.pt"), map_location="cpu", weights_only=False, mmap=True)
