"""
The first thing to run on a GPU machine (12-15 minutes, estimated: an engine start for check 1, one
per regime for check 2, one for check 3): does this machine run the experiment the way the CPU tests
say it does? One screen, pass/fail per check.

    python tools/gpu_check.py                             # Qwen/Qwen3-0.6B from the Hub, gsm8k prompts
    python tools/gpu_check.py --model /path/to/Qwen3-0.6B --data-file gsm8k_train.jsonl   # offline
    python tools/gpu_check.py --engines 2 --ranks 2       # 4+ GPUs: 2 engines, 2 trainer ranks under torchrun
    python tools/gpu_check.py --model tiny --dataset synth # CPU: the tiny model (what the tests run)

0. devices: where train.py puts every process of this layout (--engines, --ranks) on
   this machine, each on a GPU of its own (devices.plan_devices), or the one line that
   says what collides; and each of those GPUs free (at least 90% of its memory).
1. sync: after a push of perturbed weights, vLLM's generation-time logprobs of its
   answers (from every engine, with --engines N) equal the trainer's logprobs of the
   same tokens under the pushed weights
   (float32 on CPU: max |diff| < 1e-3; bf16 on GPU: mean |diff| < 0.05 nats, since
   vLLM's bf16 kernels and the trainer's bf16 autocast round differently), and are
   far from the unperturbed weights' (mean > twice the tolerance: the check can tell).
2. every regime, --steps short train.py runs with short answers (under torchrun with
   --ranks K, with --engines N): exit 0, versions consecutive, lag within --max-lag, no
   stale token outside `stale`, no preempted request, every engine's answers trained;
   generation and training tokens/s, the trainer's peak memory, vLLM's KV.
3. a weight push against a raw broadcast of the same bytes (within 1.2x it + 0.3 ms a tensor:
   push_bound), and the memory it holds in the engine against its plan (bench_sync.py --only
   sync; --bench-rounds, 5: their medians).
Checks 1-3 run in processes of their own (check 1: own_process; 2 and 3: programs), each stopped past
--deadline-s (20 min), its check failed (a program's with the last line it printed: the stage it was in).
It needs nothing from this repository beyond the code.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules (train, generator, ...), wherever this is run from

TOL = {"cpu": ("max", 1e-3), "cuda": ("mean", 0.05)}
# check 3's bound on the trainer's time blocked by a push: 1.2x a raw broadcast of the same bytes (bench_sync's
# target, the design's) + PUSH_SLACK_S a tensor. vLLM's reload takes one tensor at a time, with Python between
# (assumed ~0.1 ms each, ~30 ms for Qwen3-0.6B's 311), which over NVLink (a raw broadcast of 1.5 GB: ~10-20 ms)
# outlasts the transfer: 1.2x alone would fail a healthy machine there (docs/gpu.md). 3x that assumption
PUSH_SLACK_S = 3e-4
# check 0: a GPU of the layout must be this free (this process's CUDA context takes ~0.5 GiB of each it reads);
# an engine alone takes 0.85 of its card, and an engine sharing one with the trainer all of it
FREE_AT_START = 0.9


def check_devices(args):
    """Check 0: the layout train.py resolves here for --engines and --ranks. Fails with
    plan_devices' one line when processes collide or a GPU is asked for that this machine
    does not show, and when a GPU of the layout has less than FREE_AT_START of its memory
    free: another job holds it, and vLLM (which refuses to start with less than its share
    free) or the trainer would fail minutes later, after their loads."""
    import torch
    from data import UsageError
    from system.devices import plan_devices

    try:
        gens, trains, shared = plan_devices(
            args.gen_device or "auto", args.train_device or "auto", args.engines, args.ranks, torch.cuda.device_count()
        )
    except UsageError as e:
        return False, str(e)
    layout = f"generator {', '.join(gens)}; trainer ranks {', '.join(trains)}" + (
        f"; shared as asked: {', '.join(shared)}" if shared else ""
    )
    busy = []
    for d in sorted({d for d in gens + trains if d.startswith("cuda")}):
        free, total = torch.cuda.mem_get_info(d)
        if free < FREE_AT_START * total:
            busy.append(f"{d} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    if busy:
        return False, f"{layout}; another process holds memory: {'; '.join(busy)}"
    return True, layout


def check_sync(args):
    """Check 1: push perturbed weights, collect answers written entirely by them, and
    compare vLLM's logprobs with the trainer's."""
    import torch
    from transformers import AutoModelForCausalLM
    from system.handle import GeneratorHandle
    from system.devices import prepare
    from grpo import answer_logprobs
    from train import parse_config

    cfg = parse_config(
        [
            "--regime",
            "stale",
            "--out",
            "out/gpu_check/sync",
            "--max-new-tokens",
            "64",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            *common_flags(args),
        ]
    )
    envs = prepare(cfg)
    device = cfg["trainer_device"]
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).to(device)
    gen_dtype = torch.float32 if cfg["gen_devices"][0] == "cpu" else torch.bfloat16
    old = perturb(model)
    gen = GeneratorHandle(cfg, envs)
    try:
        gen.push({k: v.to(gen_dtype) for k, v in model.state_dict().items()})
        samples = []
        while len(samples) < 8 or len({s["engine"] for s in samples}) < args.engines:
            msg = gen.get(timeout=300)
            assert msg is not None, "no answer from the generator within 300 s"
            if msg[0] == "sample" and (msg[1]["versions"] == 1).all() and len(msg[1]["versions"]):
                samples.append(msg[1])
    finally:
        gen.stop()
    mu = torch.cat([s["logprobs"] for s in samples]).to(device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        new = answer_logprobs(model, samples, cfg["temperature"], device)
        model.load_state_dict(old)
        before = answer_logprobs(model, samples, cfg["temperature"], device)
    kind, tol = TOL["cuda" if device.startswith("cuda") else "cpu"]
    diff = (new - mu).abs()
    d = diff.max().item() if kind == "max" else diff.mean().item()
    far = (before - mu).abs().mean().item()
    return d < tol and far > 2 * tol, (
        f"{len(mu)} tokens of {len(samples)} answers from {args.engines} engine(s): "
        f"{kind} |vLLM - trainer| {d:.2e} (tolerance "
        f"{tol}); mean vs the unpushed weights {far:.2e} (must be > {2 * tol})"
    )


def perturb(model, seed=0):
    """v1 of check 1: every tensor moved by 20% of its spread, so that a tensor the push misses
    shows. The noise is drawn on the CPU (the same numbers on every device) and moved to the
    tensor's device before it meets the tensor's spread: a 0-dim CUDA tensor cannot enter an
    op on CPU tensors (it crashed the check on a GPU; tests/test_gpu_check.py runs this on
    the meta device, which catches the same mix). Returns the unperturbed state dict."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        old = {k: v.clone() for k, v in model.state_dict().items()}
        for v in model.state_dict().values():
            noise = torch.randn(v.shape, generator=g).to(v.device)
            v += (noise * v.float().std().nan_to_num(0.0) * 0.2).to(v.dtype)
    return old


def common_flags(args):
    flags = [
        "--dataset",
        args.dataset,
        "--temperature",
        "1.0",
        "--eval-every",
        "0",
        "--no-plot",
        "--engines",
        str(args.engines),
    ]
    for k in ("model", "data_file", "gen_device", "train_device"):
        if getattr(args, k):
            flags += ["--" + k.replace("_", "-"), getattr(args, k)]
    return flags


def check_regime(args, regime):
    """Check 2 for one regime: a short train.py run, its metrics against the invariants."""
    out = os.path.join("out", "gpu_check", regime)
    launch = (
        [sys.executable]
        if args.ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks)]
    )
    cmd = [
        *launch,
        os.path.join(ROOT, "train.py"),
        "--regime",
        regime,
        "--out",
        out,
        "--steps",
        str(args.steps),
        "--max-new-tokens",
        "128",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        *common_flags(args),
    ]
    shutil.rmtree(out, ignore_errors=True)  # a run directory appends: start from none
    t0 = time.time()
    code, stdout, stderr = run_program(cmd, args.deadline_s)
    if code is None:
        return False, missed(args.deadline_s, stdout, stderr)
    if code != 0:
        return False, f"exit {code}: {(stderr.strip().splitlines() or ['?'])[-1][:200]}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        m = [json.loads(line) for line in f]
    cfg = json.load(open(os.path.join(out, "config.json")))
    kv = next((line for line in stdout.splitlines() if line.startswith("vLLM KV cache")), "vLLM KV cache: ?")
    problems = []
    if [x["version"] for x in m] != list(range(len(m))):
        problems.append("versions not consecutive")
    if max(x["lag_mean"] for x in m) > cfg["max_lag"] + 1e-6:  # what the run used (config.fill: sync's is 0)
        problems.append(f"lag above {cfg['max_lag']}")
    if regime != "stale" and any(x["stale_token_frac"] for x in m):
        problems.append("stale tokens outside the stale regime")
    if any(x.get("preempted") for x in m):
        problems.append("vLLM preempted requests")
    with open(os.path.join(out, "answers.jsonl")) as f:
        engines = {json.loads(line)["engine"] for line in f}
    if engines != set(range(args.engines)):
        problems.append(f"answers from engines {sorted(engines)}, not all {args.engines}")
    steps_s = m[-1]["wall_s"] - m[0]["wall_s"]
    train_tok_s = sum(x["trained_tokens"] for x in m[1:]) / max(steps_s, 1e-9)
    peak = max((x.get("train_peak_gib", 0) for x in m), default=0)  # logged on a GPU only
    info = (
        f"{len(m)} steps in {time.time() - t0:.0f}s; gen {sum(x['gen_tok_per_s'] for x in m) / len(m):.0f} tok/s, "
        f"trained {train_tok_s:.0f} tok/s, stale {100 * max(x['stale_token_frac'] for x in m):.0f}% max; "
        + (f"trainer peak {peak:.1f} GiB; " if peak else "")
        + kv.split(": ", 1)[1]
    )
    return not problems, "; ".join(problems) or info


def check_push(args):
    """Check 3: bench_sync.py's push against a raw broadcast of the same bytes, and the memory
    a push holds in the engine against preflight.engine_plan: bench_sync.py --only sync itself,
    run as the user would (its own flags and defaults: a Namespace built here missed two of them,
    and crashed), whose exit status says whether the memory met its plan. The push's time is held
    here to push_bound() (bench_sync.py is run with --sync-target inf)."""
    import re
    from config import model_path

    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "bench_sync.py"),
        "--only",
        "sync",
        "--sync-model",
        model_path(args.model or "Qwen/Qwen3-0.6B"),
        "--rounds",
        str(args.bench_rounds),
        "--gen-device",
        args.gen_device or "auto",
        "--train-device",
        args.train_device or "auto",
        "--sync-target",
        "inf",
    ]
    code, stdout, stderr = run_program(cmd, args.deadline_s)
    if code is None:
        return False, missed(args.deadline_s, stdout, stderr)
    lines = stdout.splitlines()
    sync = next((x for x in lines if x.startswith("weight sync")), None)
    memory = next((x for x in lines if x.startswith("push memory")), None)
    if sync is None or memory is None:
        return False, f"exit {code}: {(stderr.strip().splitlines() or ['?'])[-1][:200]}"
    n, push_s, raw_s = map(float, re.search(r"(\d+) tensors.*blocked ([\d.]+)s by a push vs ([\d.]+)s", sync).groups())
    ok, bound = push_bound(args.sync_target, push_s, raw_s, int(n))
    return ok and code == 0, (
        f"the trainer blocked {push_s:.4f}s by a push vs {raw_s:.4f}s by a raw broadcast "
        f"-> {push_s / raw_s:.2f}x; "
        f"{bound}; {memory}" + (f"; {stderr.strip().splitlines()[-1]}" if code else "")
    )


def push_bound(target, push_s, raw_s, tensors):
    """Check 3's bound on the push, and what it is and why, in words: `target` x the raw broadcast
    (--sync-target), or by default 1.2x it + PUSH_SLACK_S a tensor; inf: printed, not checked."""
    if target == float("inf"):
        return True, "not checked (--sync-target inf)"
    if target is not None:
        return push_s <= target * raw_s, f"bound {target * raw_s:.4f}s: {target}x the raw broadcast (--sync-target)"
    bound = 1.2 * raw_s + PUSH_SLACK_S * tensors
    return push_s <= bound, (
        f"bound {bound:.4f}s: 1.2x the raw broadcast + {PUSH_SLACK_S * 1e3:.1f} ms x {tensors} tensors, as vLLM "
        "reloads one tensor at a time, which over NVLink outlasts the transfer (docs/gpu.md)"
    )


def own_process(fn, *args, deadline_s):
    """fn(*args), a check, in a process of its own (spawned as the trainer spawns: system.handle), for
    what it leaves: check 1's model and CUDA memory, its weight group's NCCL communicator, and a thread
    that may still be in NCCL's init (a check that failed there) all go with that process, which ends
    with os._exit (the interpreter's teardown around such a thread may hang or abort), and the next
    checks' programs find the GPUs as check 0 did. Stopped with its session (its engines) after
    `deadline_s`. Returns fn's (ok, detail)."""
    import multiprocessing
    from system.handle import spawn_with_env

    ctx = multiprocessing.get_context("spawn")
    results, mine = ctx.Pipe(duplex=False)
    proc = spawn_with_env(ctx, {}, alone, (mine, fn, *args))
    mine.close()
    try:
        if not results.poll(deadline_s):
            return False, f"still running after {deadline_s:.0f} s (--deadline-s), stopped"
        return results.recv()
    except EOFError:  # it ended without a word
        proc.join(5)
        return False, f"its process ended without a result (exit code {proc.exitcode})"
    finally:
        proc.join(10)  # it exits at once after its result
        if proc.is_alive():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join()


def alone(results, fn, *args):
    """own_process's child: fn(*args) in a session of its own (the engines it starts join it), its
    (ok, detail) sent back, then out at once (os._exit)."""
    os.setsid()
    try:
        result = fn(*args)
    except Exception as e:  # a check that crashes has failed
        result = False, crashed(e)
    results.send(result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def crashed(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run_program(cmd, deadline_s):
    """cmd (train.py, bench_sync.py) to its end, or killed with every process of its session once
    `deadline_s` seconds have passed: a program that hangs (on NCCL a dead peer hangs a collective
    until the group's timeout, 1 h) fails its check instead of holding this one. Returns (exit code,
    None at the deadline; stdout; stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its engines and receivers are in its session (torchrun's ranks
        return None, *proc.communicate()  # follow their launcher: system/ranks.py)
    return proc.returncode, out, err


def missed(deadline_s, stdout, stderr):
    """What a program that missed its deadline was doing: the last line it printed (train.py and
    bench_sync.py print a line as each stage starts)."""
    last = (stdout.strip().splitlines() or stderr.strip().splitlines() or ["nothing"])[-1].strip()
    return f"still running after {deadline_s:.0f} s (--deadline-s), stopped; the last it printed: {last[:200]}"


def main(argv=None):
    from data import DATASETS
    from regimes import REGIMES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hub id or directory (default: train.py's for --dataset)")
    p.add_argument("--dataset", default="gsm8k", choices=DATASETS, help="prompts to use")
    p.add_argument("--data-file", default=None, help="local train split (offline)")
    p.add_argument("--gen-device", default=None, help="as train.py (default auto)")
    p.add_argument("--train-device", default=None, help="as train.py (default auto)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per regime")
    p.add_argument("--engines", type=int, default=1, help="generator engines (train.py --engines)")
    p.add_argument("--ranks", type=int, default=1, help="trainer ranks: the regime checks run under torchrun")
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    p.add_argument("--skip-bench", action="store_true", help="skip check 3 (push vs raw broadcast)")
    p.add_argument("--bench-rounds", type=int, default=5, help="check 3: pushes and raw broadcasts, their medians")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=1200,
        help="checks 1-3: seconds each check's process may take before it is stopped and fails",
    )
    p.add_argument(
        "--sync-target",
        type=float,
        default=None,
        help="check 3: the push's ratio to a raw broadcast it fails over (default: 1.2x + 0.3 ms a tensor, "
        "push_bound; 'inf': printed, not checked, as the tests run it: a loaded machine decides their ms)",
    )
    args = p.parse_args(argv)
    results = []

    cores = os.sched_getaffinity(0)

    def report(name, fn, *a):
        try:
            ok, detail = fn(*a)
        except Exception as e:  # a check that crashes has failed; the others still run
            ok, detail = False, crashed(e)
        finally:  # a check that called devices.prepare kept this process to the trainer's cores: give the
            os.sched_setaffinity(0, cores)  # next check's train.py and bench_sync.py the whole machine again
        results.append(ok)
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)

    report("devices", check_devices, args)
    report("sync", lambda: own_process(check_sync, args, deadline_s=args.deadline_s))
    for regime in args.regimes:
        report(f"regime {regime}", check_regime, args, regime)
    if not args.skip_bench:
        report("push vs raw broadcast", check_push, args)
    print(f"{sum(results)}/{len(results)} checks passed")
    return all(results)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
