"""
Where each process of train.py runs: the trainer ranks and the generator engines, on
GPUs or on CPU cores, and the environment each generator process starts with.

It protects the user from two processes on one GPU that were not asked to share it
(NCCL refuses two ranks on one device; vLLM and a trainer overrun its memory), from a
GPU index that does not exist (a failure minutes later, inside vLLM), from the
generator on the wrong GPU under CUDA_VISIBLE_DEVICES, and from two processes fighting
over the same CPU cores: the run stops before anything loads, with one line that says
what collides and which flag to change. tests/test_devices.py checks every layout of
1-8 GPUs, 1-4 trainer ranks and 1-4 engines, fresh and resumed.
"""

import os
import re

from data import UsageError
from engine import vllm_env


def physical_gpu(device):
    """The CUDA_VISIBLE_DEVICES entry that shows the child process `device` (an index in
    this process's view) as its only GPU: with CUDA_VISIBLE_DEVICES=2,3 set by the user,
    our cuda:0 is their GPU 2, and the child must be given "2", not "0"."""
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def device_list(flag, n, what):
    """--gen-device / --train-device: None for auto, else one device per process (a
    single cpu serves them all). A cuda device must name an index: cuda:0, not cuda."""
    if flag == "auto":
        return None
    devs = [d.strip() for d in flag.split(",")]
    if devs == ["cpu"]:
        return ["cpu"] * n
    bad = [d for d in devs if d != "cpu" and not re.fullmatch(r"cuda:\d+", d)]
    if bad:
        raise UsageError(f"--{what}-device {flag}: {bad[0]!r} is not cpu or cuda:N")
    if len(devs) != n:
        per = "engine (--engines)" if what == "gen" else "trainer rank (torchrun --nproc_per_node)"
        raise UsageError(f"--{what}-device {flag}: {len(devs)} devices for {n} processes; give one per {per}, or auto")
    return devs


def plan_devices(gen_flag, train_flag, engines, ranks, n_gpu):
    """Where every process on this machine runs: the --engines generator engines and the
    `ranks` trainer ranks torchrun starts on it (one machine: resolve_devices). auto, with
    GPUs: the engines on the first ones, the ranks on the next, each its own; with none:
    everything on CPU. A GPU is shared only where both flags name it (the generator and
    the trainer on one card: vLLM takes 0.3 of its memory). Anything else that would put
    two processes on one GPU, or use a GPU this machine does not show, is a UsageError
    saying which flag to change.
    Returns (engine devices, rank devices, the GPUs shared by choice)."""
    gens, trains = device_list(gen_flag, engines, "gen"), device_list(train_flag, ranks, "train")
    if gens is None:
        if n_gpu and engines > n_gpu:
            raise UsageError(
                f"--engines {engines} needs {engines} GPUs, one per engine, and this machine shows {n_gpu}: "
                "lower --engines"
            )
        gens = [f"cuda:{i}" for i in range(engines)] if n_gpu else ["cpu"] * engines
    if trains is None:
        free = [f"cuda:{i}" for i in range(n_gpu) if f"cuda:{i}" not in gens]
        if n_gpu and len(free) < ranks:
            raise UsageError(
                f"{engines} generator engine(s) and {ranks} trainer rank(s) need {engines + ranks} GPUs, this "
                f"machine shows {n_gpu}: lower --engines or torchrun's --nproc_per_node, or share a "
                "GPU by naming it in both --gen-device and --train-device"
            )
        trains = free[:ranks] if n_gpu else ["cpu"] * ranks
    for flag, devs in (("gen", gens), ("train", trains)):
        for d in devs:
            if d.startswith("cuda") and int(d[5:]) >= n_gpu:
                seen = os.environ.get("CUDA_VISIBLE_DEVICES")
                raise UsageError(
                    f"--{flag}-device: {d}, but this machine shows {n_gpu} GPU(s)"
                    + (f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else "")
                )
        gpus = [d for d in devs if d.startswith("cuda")]
        if len(set(gpus)) < len(gpus):
            who = "generator engines" if flag == "gen" else "trainer ranks"
            raise UsageError(f"--{flag}-device {','.join(devs)}: two {who} on one GPU; each needs its own")
    shared = sorted({d for d in gens if d.startswith("cuda")} & set(trains))
    auto = [d for d in shared if gen_flag == "auto" or train_flag == "auto"]
    if auto:
        raise UsageError(
            f"{auto[0]} would hold a generator engine and a trainer rank: give them distinct GPUs, or "
            f"share it on purpose by naming it in both --gen-device and --train-device"
        )
    return gens, trains, shared


def resolve_devices(cfg, world=1, local_rank=0):
    """Where this process and the generator engines run (plan_devices), from the user's
    --gen-device / --train-device, which stay in cfg as given (config.json keeps them,
    and --resume resolves them again on the machine it runs on). Sets cfg's
    gen_devices (one per engine), trainer_device (this rank's), sync_backend and
    gen_memory_utilization; prints the layout. No GPU: everything on CPU, the cores split in
    half (engines first), each half split among its processes. Returns the environment
    each engine's process starts with."""
    import torch

    n, local = cfg["engines"], int(os.environ.get("LOCAL_WORLD_SIZE", world))
    rank = int(os.environ.get("RANK", 0))
    if rank != local_rank:  # a node without trainer rank 0, whose engines' devices it cannot know
        raise UsageError(
            f"trainer rank {rank} is local rank {local_rank}: its node does not hold rank 0, and runs across "
            "nodes are on paper only (docs/gpu.md, 'More GPUs'); run every rank on one node"
        )
    gens, trains, shared = plan_devices(cfg["gen_device"], cfg["train_device"], n, local, torch.cuda.device_count())
    train = cfg["trainer_device"] = trains[local_rank]
    cfg["gen_devices"] = gens
    # the weight group is trainer rank 0 + the engines: NCCL needs each on its own GPU, else gloo through CPU memory
    nccl = all(d.startswith("cuda") for d in gens + trains[:1]) and not shared
    cfg["sync_backend"] = "nccl" if nccl else "gloo"
    cfg["gen_memory_utilization"] = cfg["gpu_memory_utilization"] or (0.3 if shared else 0.85)
    if local_rank == 0:
        print(
            f"devices: generator {', '.join(gens)}; trainer {', '.join(trains)}; weights over {cfg['sync_backend']}"
            + (
                f"; {', '.join(shared)} shared by the generator and the trainer, as asked (vLLM takes "
                f"{cfg['gen_memory_utilization']} of it)"
                if shared
                else ""
            ),
            flush=True,
        )
    # engine.vllm_env: the engine core in the generator process, vLLM quiet (it logs every
    # in-place reload; VLLM_LOGGING_LEVEL=INFO shows it all), on CPU a fixed KV cache that
    # leaves RAM for the trainer
    envs = [
        dict(vllm_env(on_cpu=gens[0] == "cpu"), CUDA_VISIBLE_DEVICES=physical_gpu(g) if g.startswith("cuda") else "")
        for g in gens
    ]
    cores = sorted(os.sched_getaffinity(0))
    cfg["gen_threads"] = 1
    if gens[0] == "cpu":
        half = cores[: max(1, len(cores) // 2)]
        for i, env in enumerate(envs):
            mine = half[i::n] if len(half) >= n else half  # a core each if there are enough, else shared
            env["INFLIGHT_GEN_CORES"] = ",".join(map(str, mine))  # generator_main keeps to these
            cfg["gen_threads"] = len(mine)
        if train == "cpu" and len(cores) > 1:  # the trainer ranks keep to the other half
            rest = cores[len(half) :]
            os.sched_setaffinity(0, rest[local_rank::local] if len(rest) >= local else rest)
    if train == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    else:
        torch.cuda.set_device(train)
    return envs


def prepare(cfg, world=1, local_rank=0):
    """Where each process runs (resolve_devices) and what follows from it: activation
    checkpointing, on by --grad-checkpointing auto on a GPU. The settings that follow
    from the flags alone are config.fill's. Returns each engine's environment."""
    envs = resolve_devices(cfg, world, local_rank)
    cfg["checkpointing"] = cfg["grad_checkpointing"] == "on" or (
        cfg["grad_checkpointing"] == "auto" and cfg["trainer_device"] != "cpu"
    )
    return envs
