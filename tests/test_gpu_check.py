"""
What the first GPU run reads, checked where a CPU reaches it: gpu_check's tensor code on
the meta device (which refuses a device mix as CUDA does), its device check failing, the
trainer's memory plan against the state dict a push sends (Qwen3 shapes built on the meta
device: no download, no memory), the plan on a GPU shared with an engine, and the vLLM
model runner pinned and read back. The whole of gpu_check on CPU: test_train.py.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py
"""

import argparse
import math
import os

import pytest
import torch

from tools import gpu_check
from tools.bench_train import QWEN3

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)

QWEN3_06B, QWEN3_4B = QWEN3["Qwen3-0.6B"], QWEN3["Qwen3-4B"]  # their config.json (tools/bench_train.py)
COPIES = "the push's copies (until the next optimizer step)"  # preflight.push_plan's item


def meta_model(**arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **arch)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def test_sync_check_perturbs_on_the_models_device():
    """Check 1's perturbation on a model on the meta device, as on a GPU: the noise drawn
    on the CPU meets the tensor's spread on the tensor's device (the old code multiplied
    CPU noise by a 0-dim device tensor: "Tensor on device meta is not on the expected
    device cpu", as CUDA refuses it). On CPU every tensor with a spread moves, the
    returned state dict is the unmoved one, and the same seed moves them alike."""
    from helpers import small_model

    _, model = meta_model(**dict(QWEN3_06B, num_hidden_layers=1))
    old = gpu_check.perturb(model)
    assert {v.device.type for v in model.state_dict().values()} == {"meta"} and old.keys() == model.state_dict().keys()
    a, b = small_model(), small_model()
    old = gpu_check.perturb(a)
    gpu_check.perturb(b)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]) and torch.equal(old[k], small_model().state_dict()[k])
        assert not torch.equal(v, old[k]) or old[k].float().std() == 0, k


def test_check_devices_fails_on_what_would_fail_later(monkeypatch):
    """Check 0 fails with devices.plan_devices' line for a GPU this machine does not show,
    and (two GPUs faked) for a GPU of the layout that another process holds memory on;
    it passes the same layout on free GPUs, and everything on CPU here."""
    args = lambda **kw: argparse.Namespace(**dict(dict(gen_device=None, train_device=None, engines=1, ranks=1), **kw))
    assert gpu_check.check_devices(args()) == (True, "generator cpu; trainer ranks cpu")
    assert gpu_check.check_devices(args(gen_device="cuda:0")) == (
        False,
        "--gen-device: cuda:0, but this machine shows 0 GPU(s)",
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    busy = {"cuda:0": 80, "cuda:1": 8}  # GiB free of 80
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (busy[d] * 2**30, 80 * 2**30))
    ok, detail = gpu_check.check_devices(args())
    assert not ok and detail == (
        "generator cuda:0; trainer ranks cuda:1; another process holds memory: cuda:1 has 8.0 of 80.0 GiB free"
    )
    busy["cuda:1"] = 79
    assert gpu_check.check_devices(args()) == (True, "generator cuda:0; trainer ranks cuda:1")


def test_memory_plan_counts_what_a_push_holds():
    """The trainer's plan for a push, against the state dict a push sends, of Qwen3 built on
    the meta device: every tensor, the tied lm_head.weight under its own name (Qwen3-0.6B:
    751,632,384 elements, 1.50 GB of bf16, where 2 x its 596M parameters planned 1.19 GB),
    held up to preflight.PUSH_SEND_BYTES and the largest tensor beside it (Qwen3-4B's 8.8 GB
    are not all held); under FSDP2 rank 0's float32 gather of the largest tensor, the embedding
    (0.62 GB and 1.56 GB); nothing on one float32 CPU rank (the parameters go out themselves);
    over gloo from a GPU one tensor at a time. (What send_weights holds against it:
    test_a_push_holds_what_the_plan_says.)"""
    from grpo import LOGIT_CHUNK_BYTES
    from system.preflight import PUSH_SEND_BYTES, memory_plan

    copies, gather = COPIES, "the push's FSDP2 gather (fp32, one tensor)"
    gpu = dict(trainer_device="cuda:0", micro_batch_tokens=16384)
    config, model = meta_model(**QWEN3_06B)
    sizes = [t.numel() for t in model.state_dict().values()]
    assert sum(sizes) == 751_632_384 == sum(p.numel() for p in model.parameters()) + 151936 * 1024
    plan = memory_plan(gpu, config, LOGIT_CHUNK_BYTES)
    assert plan[copies] == 2 * sum(sizes) and gather not in plan
    plan = memory_plan(gpu, config, LOGIT_CHUNK_BYTES, world=2)
    assert plan[copies] == 2 * sum(sizes) and plan[gather] == 4 * max(sizes) == 4 * 151936 * 1024
    assert memory_plan(dict(gpu, sync_backend="gloo"), config, LOGIT_CHUNK_BYTES)[copies] == 2 * max(sizes)
    cpu = dict(gpu, trainer_device="cpu")
    assert memory_plan(cpu, config, LOGIT_CHUNK_BYTES)[copies] == 0
    # 3.0 GB of fp32, held up to the budget and the embedding
    assert memory_plan(cpu, config, LOGIT_CHUNK_BYTES, world=2)[copies] == PUSH_SEND_BYTES + 4 * max(sizes)

    config, model = meta_model(**QWEN3_4B)
    sizes = [t.numel() for t in model.state_dict().values()]
    assert sum(sizes) == 4_411_424_256  # 8.8 GB of bf16
    plan = memory_plan(gpu, config, LOGIT_CHUNK_BYTES, world=2)
    assert plan[copies] == PUSH_SEND_BYTES + 2 * 151936 * 2560 and plan[gather] == 4 * 151936 * 2560


def test_the_plan_counts_the_weight_copies_autocast_keeps():
    """Under autocast the bf16 cast of every weight a matmul reads is kept until the autocast region ends
    (a micro-batch's forward in grpo.train_step): on a GPU the plan counts them, every Linear's, the head's
    too (the model's own one position of logits reads it; the chunks' matmuls run in float32): Qwen3-0.6B
    595,984,384 x 2 B (1.11 GiB), Qwen3-4B 4,022,272,000 x 2 B (7.49 GiB), on each rank under FSDP2 too (it
    casts the gathered weights); none on CPU. The probe: grpo.answer_logprobs under CPU bf16 autocast, as
    train_step runs it, every cast of a parameter seen (a dispatch mode): each Linear's weight is cast once
    and its copy still held at the region's end, then let go; their bytes are the plan's item."""
    import gc
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    from grpo import LOGIT_CHUNK_BYTES, answer_logprobs
    from helpers import batch_of, small_model
    from system.preflight import memory_plan

    item = "autocast's weight copies (bf16)"
    gpu = dict(trainer_device="cuda:0", micro_batch_tokens=16384)
    for name, n in [("Qwen3-0.6B", 595_984_384), ("Qwen3-4B", 4_022_272_000)]:
        config, _ = meta_model(**QWEN3[name])
        assert [memory_plan(gpu, config, LOGIT_CHUNK_BYTES, k)[item] for k in (1, 2)] == [2 * n, 2 * n]
    assert item not in memory_plan(dict(gpu, trainer_device="cpu"), config, LOGIT_CHUNK_BYTES)

    model = small_model()
    params = {p.data_ptr(): name for name, p in model.named_parameters()}
    casts = []  # (the parameter's name, a weak reference to its bf16 copy)

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in params:
                casts.append((params[args[0].data_ptr()], weakref.ref(out)))
            return out

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), Casts():
        answer_logprobs(model, batch_of([5, 9]), 1.0, "cpu")
        held = [name for name, copy in casts if copy() is not None]
    gc.collect()
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # the tied head's is the embedding
    assert sorted(held) == sorted(name for name, _ in casts) == sorted(params[m.weight.data_ptr()] for m in linear), (
        "a weight cast more or less than once, or its copy not held to the region's end"
    )
    assert all(copy() is None for _, copy in casts)  # let go as the region ends
    bytes_ = 2 * sum(m.weight.numel() for m in linear)
    assert memory_plan(gpu, model.config, LOGIT_CHUNK_BYTES)[item] == bytes_


class HeldWork:
    """A broadcast's work as NCCL's: it holds its tensor until it is let go, and is done whenever
    asked (the trainer waits for none it need not)."""

    def __init__(self, t):
        self.t = t

    def is_completed(self):
        return True

    def exception(self):
        return None

    def wait(self):
        return True


class Group:
    """A weight group of one trainer on the meta device: what send_weights posts, held."""

    def broadcast(self, t, root):
        return HeldWork(t)

    def allreduce(self, t):
        return HeldWork(t)


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B"])
def test_a_push_holds_what_the_plan_says(name):
    """system.push.send_weights, run on the meta device as train.py runs it on one GPU (Ranks.weights:
    each float32 parameter cast to bf16 as it is sent), holds at most what preflight.push_plan says
    of the copies, at every tensor it makes: every tensor alive that it made is counted (weakref
    finalizers), through the return of the push (the rest is let go in settle). Qwen3-0.6B's 1.50 GB
    are all held; 1.7B's 4.7 GB and 4B's 8.8 GB are not: up to PUSH_SEND_BYTES and the embedding
    beside it (it kept every copy until settle before: 4.7 and 8.8 GB). The budget is used."""
    import weakref
    from system.preflight import PUSH_SEND_BYTES, push_plan
    from system.push import send_weights
    from system.ranks import Ranks

    config, model = meta_model(**QWEN3[name])
    plan = push_plan(model.state_dict(), on_gpu=True)[COPIES]
    held, peak = [0], [0]

    def counted(tensors):
        for t in tensors:
            held[0] += t.numel() * t.element_size()
            weakref.finalize(t, lambda n=t.numel() * t.element_size(): held.__setitem__(0, held[0] - n))
            peak[0] = max(peak[0], held[0])
            yield t

    specs, tensors = Ranks().weights(model, torch.bfloat16)
    send_weights(Group(), counted(tensors), "meta", lambda: None)
    total = sum(math.prod(shape) for _, _, shape in specs) * 2
    largest = 2 * max(t.numel() for t in model.state_dict().values())
    assert plan == min(PUSH_SEND_BYTES + largest, total)
    assert peak[0] <= plan, f"{name}: a push held {peak[0] / 2**30:.2f} GiB, the plan says {plan / 2**30:.2f}"
    assert peak[0] == total if total <= PUSH_SEND_BYTES else peak[0] > PUSH_SEND_BYTES


def test_the_raw_receiver_posts_a_round_only_once_it_is_sent(tmp_path, monkeypatch):
    """Check 3's baseline (bench_sync.RawBroadcast), its weight group as NCCL's on a GPU (tests/faults.py):
    there each receive posted is a kernel spinning on GPU 0, beside the engine, until its bytes come, and
    every push measured against the baseline shared the GPU with them. Posted while nothing has been sent:
    at most one round's receives (before: all 4 rounds' at start, 20 of 4 x 5); each round's, once sent;
    the receiver then exits 0."""
    import time
    import torch.multiprocessing as mp
    from faults import install
    from tools.bench_sync import RawBroadcast

    log = tmp_path / "posts"
    install(dict(nccl=True, log_posts=str(log)), monkeypatch.setattr)
    tensors = [torch.randn(1000 * (1 + i)) for i in range(5)]
    posted = lambda: sum(line.split() == ["1", "broadcast"] for line in open(log)) if log.exists() else 0  # receives
    raw = RawBroadcast(mp.get_context("spawn"), {}, "gloo", tensors, 4, "cpu")
    try:
        time.sleep(2)  # nothing sent
        assert posted() <= len(tensors), f"{posted()} receives posted before anything was sent"
        for _ in range(4):
            raw.round()
    finally:
        raw.proc.join(60)
        raw.proc.kill()
    assert raw.proc.exitcode == 0 and posted() == 4 * len(tensors)


def test_check_3s_bound_says_what_it_is_and_why():
    """Check 3's default bound: 1.2x the raw broadcast + 0.3 ms a tensor, said in words. docs/gpu.md's
    estimate of a healthy NVLink pair for Qwen3-0.6B (a raw broadcast of ~15 ms, vLLM's reload ~0.1 ms
    a tensor for 311 tensors: ~45 ms, 3x) passes it, where bench_sync's 1.2x would fail it; a push that
    waited a millisecond a tensor (as the engine's waits once did) fails it over PCIe and NVLink."""
    ok, said = gpu_check.push_bound(None, 0.045, 0.015, 311)
    assert ok and said.startswith("bound 0.1113s: 1.2x the raw broadcast + 0.3 ms x 311 tensors, as vLLM reloads")
    assert not gpu_check.push_bound(1.2, 0.045, 0.015, 311)[0]
    for raw in (0.015, 0.07):
        assert not gpu_check.push_bound(None, raw + 0.311, raw, 311)[0]
    assert gpu_check.push_bound(float("inf"), 9.0, 0.015, 311) == (True, "not checked (--sync-target inf)")


STUCK = None  # check 1's stand-in: a thread that never ends (an Event never set), and what it held


def a_sync_check_that_leaves_a_thread(args):
    """Check 1 as it may end on a GPU: passed, its memory held (a model), a thread still in NCCL's
    communicator init (it never returns, and Python's exit would wait for it: not a daemon)."""
    import threading

    global STUCK
    STUCK = threading.Event(), torch.zeros(2**20)
    threading.Thread(target=STUCK[0].wait, name="weight-group-first").start()
    return True, "synced"


def test_check_1_leaves_nothing_in_gpu_checks_process(monkeypatch, capsys):
    """gpu_check's check 1 (the sync check: the trainer's model, a weight group, vLLM engines) runs in a
    process of its own that ends with os._exit: what it leaves, its model and CUDA memory, and a thread
    that may still be in NCCL's init, goes with it, not into the checks after it. A stand-in for check 1
    holds memory and leaves such a thread (the other checks stand in too: they run programs, the whole
    of gpu_check runs in test_train.py): it passes, and gpu_check's process holds neither (before: both)."""
    import threading

    monkeypatch.setattr(gpu_check, "check_devices", lambda args: (True, "a layout"))
    monkeypatch.setattr(gpu_check, "check_sync", a_sync_check_that_leaves_a_thread)
    monkeypatch.setattr(gpu_check, "check_regime", lambda args, regime: (True, "a run"))
    try:
        assert gpu_check.main(["--model", "tiny", "--dataset", "synth", "--regimes", "stale", "--skip-bench"])
        assert "[PASS] sync: synced" in capsys.readouterr().out
        assert STUCK is None and "weight-group-first" not in [t.name for t in threading.enumerate()]
    finally:
        if STUCK is not None:  # before: it ran here; let its thread end
            STUCK[0].set()


def test_a_program_that_misses_its_deadline_is_stopped_and_named():
    """Checks 2 and 3 run train.py and bench_sync.py through run_program: one still running at its
    deadline is stopped with every process of its session (here a child holding its stdout, as an
    engine does), and the check fails naming the last line it printed, the stage it hung in (before:
    no deadline, and on NCCL a push to a peer gone hangs until the group's 1 h timeout)."""
    import subprocess
    import sys
    import time

    code = (
        "import subprocess, sys, time; print('  sync: round 2 of 5', flush=True); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    )
    t0 = time.time()
    exit_code, out, err = gpu_check.run_program([sys.executable, "-c", code], 2)
    assert exit_code is None and time.time() - t0 < 30
    said = "still running after 2 s (--deadline-s), stopped; the last it printed: sync: round 2 of 5"
    assert gpu_check.missed(2, out, err) == said
    assert gpu_check.run_program([sys.executable, "-c", "print('done')"], 60) == (0, "done\n", "")
    assert subprocess.run(["pgrep", "-f", "time.sleep\\(120\\)"], capture_output=True).stdout == b""


def test_memory_plan_on_a_gpu_shared_with_an_engine(monkeypatch, capsys):
    """check_memory_plan reads the trainer's GPU before vLLM has started on it: on a GPU
    shared with an engine, vLLM's share of the card and a push's buffers beside it are
    taken from what is free, and a trainer that fits the free memory alone but not beside
    the engine stops, saying so (the old check compared with the free memory whole). Two
    GPUs faked; the tiny model's plans."""
    from system.preflight import check_memory_plan, engine_plan, memory_plan
    from transformers import AutoConfig

    cfg = dict(
        model_path=os.path.join("weights", "tiny"),
        trainer_device="cuda:0",
        gen_devices=["cuda:0"],
        gen_memory_utilization=0.3,
        micro_batch_tokens=16384,
        sync_backend="gloo",
    )
    config = AutoConfig.from_pretrained(cfg["model_path"])
    need, push = sum(memory_plan(cfg, config, 2**20).values()), engine_plan(config)
    total = (need / 0.9 + (need + push) / 0.6) / 2  # fits 0.9 of it alone, not beside 0.3 of it and a push
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (total, total))
    with pytest.raises(SystemExit, match="of them the engine's that shares it: lower --micro-batch-tokens"):
        check_memory_plan(cfg, 2**20)
    check_memory_plan(dict(cfg, gen_devices=["cpu"]), 2**20)  # the same GPU, the engine elsewhere: fits
    assert "trainer memory plan" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), dict(total_memory=80 * 2**30)))
    check_memory_plan(dict(cfg, gen_devices=["cuda:1"]), 2**20)  # an engine on a GPU: its share of the card
    assert "vLLM's share of its GPU (0.3)" in capsys.readouterr().out
    check_memory_plan(dict(cfg, trainer_device="cpu", gen_devices=["cpu"]), 2**20)  # train.py on a CPU
    out = capsys.readouterr().out
    assert "vLLM's KV cache on the CPU (" in out and "GPU" not in out, out


def test_vllm_model_runner_is_pinned_and_read_back():
    """Every engine's environment asks vLLM for its V1 model runner (engine.vllm_env), and
    make_engine's read-back (engine.check_engine_config) passes a real VllmConfig for the
    tiny model made under it (EngineArgs.create_engine_config: no engine started) and
    refuses the same config once it answers V2: vLLM's use_v2_model_runner reads the
    environment when asked (a CPU config cannot be made with V2: it needs triton)."""
    import vllm.envs
    from vllm import EngineArgs
    from engine import check_engine_config, vllm_env

    assert (
        vllm_env(on_cpu=True)["VLLM_USE_V2_MODEL_RUNNER"] == vllm_env(on_cpu=False)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    )
    cached, saved = vllm.envs._is_envs_cache_enabled(), os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    vllm.envs.disable_envs_cache()  # an engine started in this process froze vLLM's reading of the environment
    try:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = vllm_env()["VLLM_USE_V2_MODEL_RUNNER"]
        path = os.path.join("weights", "tiny")
        config = EngineArgs(model=path, dtype="float32", async_scheduling=False).create_engine_config()
        assert config.use_v2_model_runner is False
        check_engine_config(config)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        assert config.use_v2_model_runner is True
        with pytest.raises(RuntimeError, match="Model Runner V2"):
            check_engine_config(config)
    finally:
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
        if cached:
            vllm.envs.enable_envs_cache()
