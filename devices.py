"""
Where each process of train.py runs: the trainer ranks and the generator engines, on
GPUs or on CPU cores, and the environment each generator process starts with.

It protects the user from the generator on the wrong GPU under CUDA_VISIBLE_DEVICES,
and from two processes fighting over the same CPU cores.
"""

import os

from data import UsageError
from preflight import model_path


def physical_gpu(device):
    """The CUDA_VISIBLE_DEVICES entry that shows the child process `device` (an index in
    this process's view) as its only GPU: with CUDA_VISIBLE_DEVICES=2,3 set by the user,
    our cuda:0 is their GPU 2, and the child must be given "2", not "0"."""
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def resolve_devices(cfg, world=1, local_rank=0):
    """Where each process runs. auto: with GPUs, the --engines generator engines on the
    first ones (cuda:0 .. cuda:N-1) and trainer rank r (of `world`, torchrun) on the next
    (cuda:N+r), sharing the last GPU when there are too few: two GPUs, one of each, is
    generator cuda:0 and trainer cuda:1; one GPU, both share it. No GPU: everything on
    CPU, the cores split in half (engines first), each half split among its processes.
    Returns the environment each engine's process starts with."""
    import torch
    n_gpu, n = torch.cuda.device_count(), cfg["engines"]
    if cfg["gen_device"] == "auto":
        gens = [f"cuda:{i}" for i in range(n)] if n_gpu else ["cpu"] * n
    else:
        gens = cfg["gen_device"].split(",")
        gens = gens * n if len(gens) == 1 and gens[0] == "cpu" else gens
    if len(gens) != n:
        raise UsageError(f"--gen-device {cfg['gen_device']}: {len(gens)} devices for --engines {n}")
    if cfg["train_device"] == "auto":
        cfg["train_device"] = f"cuda:{min(n + local_rank, n_gpu - 1)}" if n_gpu else "cpu"
    train = cfg["train_device"]
    cfg["gen_device"], cfg["gen_devices"] = gens[0], gens
    # NCCL needs distinct GPUs; otherwise weights travel through CPU memory over gloo
    all_cuda = train.startswith("cuda") and all(g.startswith("cuda") for g in gens)
    cfg["sync_backend"] = "nccl" if all_cuda and train not in gens and len(set(gens)) == n else "gloo"
    if cfg["gpu_memory_utilization"] is None:
        cfg["gpu_memory_utilization"] = 0.3 if train in gens else 0.85
    common = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the generator process: see engine.make_engine
              # vLLM logs every in-place reload (and warns that the rotary embedding has no
              # weights to load): quiet by default, VLLM_LOGGING_LEVEL=INFO shows it all
              "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    envs = [dict(common, CUDA_VISIBLE_DEVICES=physical_gpu(g) if g.startswith("cuda") else "") for g in gens]
    cores = sorted(os.sched_getaffinity(0))
    cfg["gen_threads"] = 1
    if gens[0] == "cpu":
        half = cores[:max(1, len(cores) // 2)]
        for i, env in enumerate(envs):
            mine = half[i::n] if len(half) >= n else half  # a core each if there are enough, else shared
            env["INFLIGHT_GEN_CORES"] = ",".join(map(str, mine))  # generator_main keeps to these
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: plenty for small models, leaves RAM for the trainer
            cfg["gen_threads"] = len(mine)
        if train == "cpu" and len(cores) > 1:  # the trainer ranks keep to the other half
            rest = cores[len(half):]
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            os.sched_setaffinity(0, rest[local_rank::local] if len(rest) >= local else rest)
    if train == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    else:
        torch.cuda.set_device(train)
    return envs


def prepare(cfg, world=1, local_rank=0):
    """Devices, the model's path and the generator's runtime settings; returns each
    engine's environment."""
    cfg["model_path"] = model_path(cfg["model"])
    envs = resolve_devices(cfg, world, local_rank)
    batch = cfg["prompts_per_step"] * cfg["group_size"]
    cfg.update(start_version=0, start_group=0, sync_host="127.0.0.1", queue_size=4 * batch, start_timeout=900)
    return envs
