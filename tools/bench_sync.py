"""
Benchmarks of the generator's two costs, each against a baseline measured in the
same run, printed as ratios (targets: sync <= 1.2x, tokens/s >= 0.95x); exits 1 when a
ratio misses its target (or a push's memory its plan), so a regression shows where it happens.

    .venv/bin/python tools/bench_sync.py           # CPU: tiny model for tokens/s, a ~50M random Qwen3 for sync
    .venv/bin/python tools/bench_sync.py --sync-model smol --gen-model smol --prompts 4  # SmolLM2-135M (build_smol.py)
    python tools/bench_sync.py --sync-model Qwen/Qwen3-0.6B --gen-device cuda:0 --train-device cuda:1   # GPUs

1. weight sync: the time train.py's push blocks the trainer vs a raw torch.distributed
   broadcast of the same tensors between two plain processes, each side with its
   buffers allocated once. As train.py does: the push returns once every engine has
   joined and every broadcast is posted (the vLLM worker posts its receives ahead of its
   loader by at most --push-ahead-mib), the trainer runs the next step's forward and
   backward (here: one of the pushed model on --step-tokens tokens), then waits for the
   engines' acknowledgement (Generator.settle); blocked = the push's return + that wait.
   Also printed: the push waited for at once (push + settle, nothing between: transfer
   and load end to end) and the forward/backward's own time. Medians of --rounds, the
   kinds alternating 1 s apart so that all meet the same machine. And the memory a push
   holds in the generator's process, sampled there every 1 ms (heap_probed_generator): on
   CPU the bytes malloc has handed out and not had back (glibc's mallinfo2), on a GPU
   torch's allocated CUDA memory; each push's peak above where it stood before it, against
   preflight.engine_plan, which a push must stay within. The process's resident memory is
   printed beside it, not checked: it is where glibc's heap happens to stand (lab/archive.md).
2. generation: system/generator.py's step loop (one engine.step() at a time, per-token
   bookkeeping) vs vLLM's own LLM.generate on the same prompts and sampling settings.
3. provenance (--only provenance): the step loop with the per-answer record
   (Rollout.record's run-length segments, answers.jsonl) vs the same loop with a
   record() that keeps only the per-token arrays, rounds alternating; then the
   bytes per generated token of the answers.jsonl lines train.py would write.
"""

import argparse
import os
import sys
import time
from statistics import median_high

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules (train, generator, ...), wherever this is run from
from system.preflight import PUSH_AHEAD_BYTES  # noqa: E402  (imports neither torch nor vLLM)


# sync: the engine posts its receives up to --push-ahead-mib ahead of vLLM's reload
# (system.push.WeightReceiver), so the trainer waits for the load only where the engine falls
# that far behind: 0.9x a raw broadcast when the engine received everything into a copy it
# kept; 1.75-2.3x when it received each tensor only once the loader had loaded the previous
# one (lab/archive.md, "Receive buffers"); 1.59x with 64 MiB ahead ("Run-ahead receive").
# The design's target; gpu_check holds a machine to a bound it expects a healthy one to meet (push_bound)
SYNC_TARGET, GENERATE_TARGET = 1.2, 0.95


def raw_receiver(host, port, backend, specs, rounds, go):
    """The baseline's receiving end: join a two-member group and receive, nothing else: a round's
    receives posted once the trainer says it sends them (`go`, a semaphore released per round), and
    all of them arrived before the next (on NCCL a posted receive is a kernel spinning on the GPU,
    beside the engine, until its bytes come: none may wait through a push). On CPU it keeps to the
    cores the generator gets, as vLLM's worker does. It returns once its last round has arrived."""
    import torch
    from system.push import first_collective, init_weight_group, wait
    from system.generator import keep_to_gen_cores

    keep_to_gen_cores()
    trainer = os.getppid()

    def check():  # for the waits: the trainer (bench_sync's process) is gone
        if os.getppid() != trainer:
            raise RuntimeError("bench_sync's trainer is gone")

    device = "cuda" if backend == "nccl" else "cpu"
    group = init_weight_group(host, port, 1, 2, backend)
    first_collective(group, device, check)  # NCCL's communicator (system.push.first_collective)
    buffers = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for _, dtype, shape in specs]
    for _ in range(rounds):  # into the same buffers each round, as the generator's worker does
        while not go.acquire(timeout=0.01):
            check()
        works = [group.broadcast(t, root=0) for t in buffers]
        for work in works:  # the CPU waits until each has arrived (on NCCL wait() alone only orders the stream)
            wait(group, work, check)


class RawBroadcast:
    """The baseline's sending end: `tensors` broadcast from this process (rank 0) to raw_receiver, spawned
    with `env` as the generator is, over a two-member group of `backend`, `rounds` times (round())."""

    def __init__(self, ctx, env, backend, tensors, rounds, device):
        import socket
        from system.handle import spawn_with_env
        from system.push import first_collective, init_weight_group
        from system.ranks import weight_specs

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        specs = weight_specs(dict(enumerate(tensors)))
        self.go = ctx.Semaphore(0)  # a round's receives are posted once this process sends it (raw_receiver)
        self.proc = spawn_with_env(ctx, env, raw_receiver, ("127.0.0.1", port, backend, specs, rounds, self.go))
        print("  sync: the raw receiver joins", flush=True)  # a stage gpu_check names if its deadline passes here
        self.group = init_weight_group("127.0.0.1", port, 0, 2, backend)
        transfer = device if backend == "nccl" else "cpu"
        first_collective(self.group, transfer, self.receiver_failed)
        self.send = [t.detach().to(transfer).contiguous() for t in tensors]

    def receiver_failed(self):  # for the waits (it exits 0 once its last receive has arrived)
        if not self.proc.is_alive() and self.proc.exitcode != 0:
            raise RuntimeError(f"bench_sync's raw receiver exited (exit code {self.proc.exitcode})")

    def round(self):
        from system.push import wait

        self.go.release()
        for t in self.send:
            work = self.group.broadcast(t, root=0)
            work.wait()  # gloo: until it has gone out; NCCL: orders the stream after it
        wait(self.group, work, self.receiver_failed)  # the last has completed (NCCL: and every one before it)

    def close(self):
        self.proc.join()


class MallInfo2:
    """glibc's mallinfo2(), through ctypes (glibc >= 2.33)."""

    def __init__(self):
        import ctypes

        class Fields(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
            ]

        self.call = ctypes.CDLL("libc.so.6").mallinfo2
        self.call.restype = Fields

    def live(self):
        """Bytes malloc has handed out and not had back: in its arenas (uordblks) and in
        chunks mapped for themselves (hblkhd). Unlike the resident memory, not moved by
        what glibc keeps of a freed heap or hands back (malloc_trim)."""
        m = self.call()
        return m.uordblks + m.hblkhd


def heap_probed_generator(cfg, samples_q, control_q, joined):
    """system.generator.generator_main, with the vLLM worker's receive_weights wrapped:
    a thread samples the process's live memory every 1 ms from its start until it returns
    (the last module loaded), and the push's (before, peak, after) in bytes is appended to
    cfg["heap_log"], one JSON line per push. On CPU, live = MallInfo2.live(): the received
    buffers, vLLM's rebuilt layers and oneDNN's packings all come from malloc, and oneDNN
    packs with the GIL released, so the thread sees each packing's peak (a native sampler
    every 0.2 ms found the same peaks to 0.1 MiB); on a GPU, torch's CUDA memory allocated
    and its peak."""
    import json
    import threading
    import system.generator
    import system.push

    receive = system.push.WeightReceiver.receive_weights

    def receive_weights(self, version, specs, ahead_bytes):
        import torch

        on_gpu = str(self.device).startswith("cuda")
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        live = torch.cuda.memory_allocated if on_gpu else MallInfo2().live
        before, peak, done = live(), [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], live())
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            return receive(self, version, specs, ahead_bytes)
        finally:
            done.set()
            watcher.join()
            peak[0] = max(peak[0], live(), torch.cuda.max_memory_allocated() if on_gpu else 0)
            with open(cfg["heap_log"], "a") as f:
                f.write(json.dumps(dict(version=version, before=before, peak=peak[0], after=live())) + "\n")

    system.push.WeightReceiver.receive_weights = receive_weights
    system.generator.generator_main(cfg, samples_q, control_q, joined)


def guard_ops(tensors):
    """The aten ops the push's guard dispatches for each of `tensors`, as send_weights's checksum
    thread runs it (`sent.add_(checksum(t))`; the engine's take() runs the same for each tensor
    that arrives): one Counter per tensor, op -> calls. Views (view, detach) are counted too: they launch no kernel
    but are a dispatch each; `op.is_view` tells them apart. Works on the meta device."""
    import collections
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from system.push import checksum

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func] += 1
            return func(*args, **(kwargs or {}))

    per_tensor, sent = [], None
    for t in tensors:
        if sent is None:
            sent = torch.zeros(2, dtype=torch.int64, device=t.device)
        ops = collections.Counter()
        with Count():
            sent.add_(checksum(t))
        per_tensor.append(ops)
    return per_tensor


def guard_cost(tensors, rounds=5):
    """The guard of one push on one side, alone: (seconds, median of `rounds`; ops dispatched;
    of which kernels). On a GPU the seconds are the GPU's (synchronized), not the CPU's launches."""
    import torch
    from system.push import checksum

    took = []
    for _ in range(rounds):
        t0 = time.time()
        sent = torch.zeros(2, dtype=torch.int64, device=tensors[0].device)
        for t in tensors:
            sent.add_(checksum(t))
        sent.tolist()  # waits for a GPU's kernels
        took.append(time.time() - t0)
    ops = guard_ops(tensors)
    return (
        median_high(took),
        sum(sum(c.values()) for c in ops),
        sum(n for c in ops for f, n in c.items() if not f.is_view),
    )


def bench_sync(args):
    import threading
    import json
    import psutil
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoConfig, AutoModelForCausalLM
    import system.handle
    from system.handle import GeneratorHandle
    from system.preflight import engine_plan
    from system.devices import prepare
    from train import parse_config

    path = args.sync_model
    if path == "medium":  # a random Qwen3 big enough that bytes, not per-call overhead, dominate
        path = os.path.join("out", "bench-medium")
        if not os.path.exists(os.path.join(path, "config.json")):
            from tools.build_tiny import build_tokenizer

            tok = build_tokenizer()
            config = AutoConfig.for_model(
                "qwen3",
                vocab_size=len(tok),
                hidden_size=768,
                intermediate_size=2048,
                num_hidden_layers=8,
                num_attention_heads=12,
                num_key_value_heads=4,
                head_dim=64,
                max_position_embeddings=512,
                tie_word_embeddings=True,
            )
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
            tok.save_pretrained(path)
    elif path == "smol":
        from tools.build_smol import smol_model_dir

        path = smol_model_dir()
    cfg = parse_config(
        [
            "--regime",
            "stale",
            "--model",
            path,
            "--out",
            "out/bench",
            "--gen-device",
            args.gen_device,
            "--train-device",
            args.train_device,
            "--max-lag",
            "-1000000",
        ]
    )  # admits nothing: idle engine
    cfg["push_ahead_bytes"] = args.push_ahead_mib * 2**20  # not a train.py flag: preflight.PUSH_AHEAD_BYTES there
    cfg["heap_log"] = os.path.abspath(os.path.join(cfg["out"], "push-heap.jsonl"))  # heap_probed_generator's
    os.makedirs(cfg["out"], exist_ok=True)
    if os.path.exists(cfg["heap_log"]):
        os.remove(cfg["heap_log"])
    (env,) = prepare(cfg)
    device = cfg["trainer_device"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    plan = engine_plan(
        AutoConfig.from_pretrained(path),
        dtype.itemsize,
        cfg["push_ahead_bytes"],
        on_cpu=not cfg["gen_devices"][0].startswith("cuda"),
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    sd = model.state_dict()
    n_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    ctx = mp.get_context("spawn")
    # the same device placement as the generator; a round for the warm-up and one each of --rounds
    baseline = RawBroadcast(ctx, env, cfg["sync_backend"], list(sd.values()), args.rounds + 1, device)
    raw_broadcast = baseline.round

    generator_main = system.handle.generator_main
    system.handle.generator_main = heap_probed_generator  # what GeneratorHandle spawns, for this run
    print("  sync: the generator starts", flush=True)
    try:
        gen = GeneratorHandle(cfg, [env])
    finally:
        system.handle.generator_main = generator_main
    engine = psutil.Process(gen.procs[0].pid)  # the generator process: its vLLM worker runs in it
    memory = []  # per push: (resident peak - resident before, resident 1 s after - before), bytes
    heap = []  # per push: heap_probed_generator's line

    def heap_line():
        """The generator's line for the push just settled (written once its last module is loaded)."""
        for _ in range(600):
            if os.path.exists(cfg["heap_log"]):
                with open(cfg["heap_log"]) as f:
                    lines = f.readlines()
                if len(lines) > len(heap) and lines[len(heap)].endswith("\n"):
                    return json.loads(lines[len(heap)])
            time.sleep(0.1)
        raise RuntimeError(f"the generator wrote no live-memory line for push {len(heap) + 1} to {cfg['heap_log']}")

    ids = torch.randint(0, model.config.vocab_size, (1, args.step_tokens), device=device)
    step_s = []  # each overlapped push's forward and backward

    def watched_push(overlap=True):
        """A push, the generator's resident memory sampled every 2 ms from before it until 1 s
        after it returns (the load of the last modules ends after the acknowledgement)."""
        before, peak, done = engine.memory_info().rss, [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], engine.memory_info().rss)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.time()
        gen.push(sd, wait=False)
        took = time.time() - t0
        if overlap:
            t1 = time.time()
            loss = model(ids, labels=ids).loss  # the next step's forward and backward: reads the weights
            loss.backward()
            model.zero_grad(set_to_none=True)
            step_s.append(time.time() - t1)
        t2 = time.time()
        gen.settle()
        took += time.time() - t2
        time.sleep(1)  # as in training, a step passes between pushes: the reload of the last one is done
        done.set()
        watcher.join()
        memory.append((peak[0] - before, engine.memory_info().rss - before))
        heap.append(heap_line())
        return took

    print("  sync: warm-up", flush=True)
    watched_push()  # warm-up, both
    raw_broadcast()
    push, raw, whole = [], [], []
    for i in range(args.rounds):  # alternate, so all meet the same machine; both receivers idle between
        print(f"  sync: round {i + 1} of {args.rounds}", flush=True)
        push.append(watched_push())
        time.sleep(1)
        t0 = time.time()
        raw_broadcast()
        raw.append(time.time() - t0)
        time.sleep(1)
        whole.append(watched_push(overlap=False))
    del step_s[0]  # the warm-up's
    gen.stop()
    baseline.close()
    mib = lambda b: f"{b / 2**20:+.1f} MiB"
    peaks, kept = [h["peak"] - h["before"] for h in heap], [h["after"] - h["before"] for h in heap]
    kind = "CUDA, torch" if cfg["gen_devices"][0].startswith("cuda") else "malloc, mallinfo2"
    print(
        f"  generator live memory ({kind}): "
        f"{heap[0]['before'] / 2**20:.0f} MiB before the first push; each push's peak above its start "
        f"{' '.join(f'{p / 2**20:.1f}' for p in peaks)} MiB; each kept {mib(median_high(kept))} (median), "
        f"{mib(heap[-1]['after'] - heap[0]['before'])} over all {len(heap)}"
    )
    # the resident memory is glibc's heap: a push's freed buffers stay in it, and the next push
    # reuses them or not (112 vs 182 MiB above the engine after its first push in two identical
    # runs; +233 per push once malloc_trim handed them back after each), so it is not checked
    print(
        f"  generator resident memory (glibc's heap, not checked): first push peak {mib(memory[0][0])}, kept "
        f"{mib(memory[0][1])}; later pushes peak {mib(median_high(m[0] for m in memory[1:]))}, kept "
        f"{mib(median_high(m[1] for m in memory[1:]))} (medians)"
    )
    extra = max(peaks)  # every push, the warm-up's included: the first reload holds no more live memory
    print(
        f"push memory ({len(heap)} pushes, {args.push_ahead_mib} MiB ahead): live peak {extra / 2**20:.1f} MiB above "
        f"the engine before the push vs the plan's {plan / 2**20:.1f} MiB (preflight.engine_plan) and the model's "
        f"{n_bytes / 2**20:.0f} MiB -> {extra / n_bytes:.2f}x the model"
    )
    push_s, raw_s, whole_s = median_high(push), median_high(raw), median_high(whole)
    rounds = lambda xs: " ".join(f"{x:.3f}" for x in xs)
    print(
        f"  blocked rounds {rounds(push)}; raw rounds {rounds(raw)}; push waited at once {rounds(whole)}; "
        f"forward+backward between {rounds(step_s)}"
    )
    print(
        f"  the push waited for at once (transfer and load end to end): {whole_s:.3f}s -> {whole_s / raw_s:.2f}x "
        f"the raw broadcast; the forward and backward of {args.step_tokens} tokens it overlaps: "
        f"{median_high(step_s):.3f}s"
    )
    guard_s, ops, kernels = guard_cost(baseline.send)
    print(
        f"  the guard's checksum (system.push.checksum, each side of a push; the trainer's on a thread of "
        f"its own): {ops} ops dispatched for {len(baseline.send)} tensors "
        f"({ops / len(baseline.send):.1f} a tensor, {kernels} of them kernels), {guard_s:.4f}s alone (median of 5) "
        f"-> {guard_s / raw_s:.3f}x the raw broadcast"
    )
    print(
        f"weight sync ({n_bytes / 2**20:.0f} MiB, {len(sd)} tensors, {cfg['sync_backend']}): "
        f"the trainer blocked {push_s:.4f}s by a push vs {raw_s:.4f}s by a raw broadcast (medians of {args.rounds}) "
        f"-> {push_s / raw_s:.2f}x "
        + (f"(target <= {args.sync_target}x)" if args.sync_target != float("inf") else "(printed, not a target here)")
    )
    return push_s / raw_s, extra, plan


class step_split:
    """An LLMEngine's step() timed in two parts, per round: its engine core's output (schedule,
    forward, sample: engine_core.get_output) and its output processor (RequestOutputs); the
    round's wall time less the two is the caller's own. A perf_counter pair per call, on both sides."""

    def __init__(self, engine):
        self.rounds, self.now = [], {"core": 0.0, "outputs": 0.0}
        for part, obj, name in (
            ("core", engine.engine_core, "get_output"),
            ("outputs", engine.output_processor, "process_outputs"),
        ):
            setattr(obj, name, self.timed(part, getattr(obj, name)))

    def timed(self, part, f):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - t0

        return call

    def round(self, wall):
        self.rounds.append((self.now["core"], self.now["outputs"], wall - self.now["core"] - self.now["outputs"]))
        self.now = {"core": 0.0, "outputs": 0.0}

    def __str__(self):
        rounds = self.rounds[1:]
        return "; ".join(
            f"{part} {' '.join(f'{r[i]:.3f}' for r in rounds)} (median {median_high(r[i] for r in rounds):.3f})"
            for i, part in enumerate(("engine core", "output processor", "the rest"))
        )


def bench_generate(args):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from data import load_problems, prompt_ids
    from engine import Generator, make_engine
    from system.devices import prepare
    from train import parse_config

    cfg = parse_config(
        [
            "--regime",
            "stale",
            "--model",
            args.gen_model,
            "--out",
            "out/bench",
            "--synth-steps",
            "8",
            "--max-new-tokens",
            "96",
            "--prompts-per-step",
            str(args.prompts),
            "--group-size",
            "8",
            "--max-lag",
            "0",
            "--gen-device",
            args.gen_device,
            "--train-device",
            args.train_device,
        ]
    )
    (env,) = prepare(cfg)
    if "VLLM_CPU_KVCACHE_SPACE" in env:  # two engines in this process: each gets its share
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = env["VLLM_CPU_KVCACHE_SPACE"]
    problems = load_problems("synth", "test", n=args.prompts, steps=8)
    tok = AutoTokenizer.from_pretrained(cfg["model_path"])
    gen = Generator(cfg, make_engine(dict(cfg, engine_device=cfg["gen_devices"][0])), problems, tok, [])
    llm = LLM(
        model=cfg["model_path"],
        seed=0,
        dtype="float32" if cfg["gen_devices"][0] == "cpu" else "bfloat16",
        max_model_len=cfg["max_model_len"],
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_seqs=cfg["max_num_seqs"],
        enforce_eager=cfg["gen_devices"][0] == "cpu",
        logprobs_mode="processed_logprobs",
        gpu_memory_utilization=cfg["gen_memory_utilization"],
    )
    params = SamplingParams(
        temperature=cfg["temperature"], max_tokens=cfg["max_new_tokens"], logprobs=0, detokenize=False
    )
    prompts = [dict(prompt_token_ids=ids) for ids in prompt_ids(tok, problems, "synth") for _ in range(8)]
    # where each side's round goes: vLLM's engine core (schedule, forward, sample), its output
    # processor (the step loop asks for DELTA outputs: a RequestOutput per answer per step, which
    # LLM.generate's FINAL_ONLY makes once per answer), and the rest (our bookkeeping; theirs)
    split = {"ours": step_split(gen.engine), "theirs": step_split(llm.llm_engine)}
    ours, theirs = [], []
    for _ in range(args.rounds):  # alternate, so both see the same machine; the first round warms up
        gen.next_group, gen.stats["gen_tokens"] = 0, 0
        gen.outbox.clear()
        gen.admit()  # prompts x group_size answers, all at once
        t0 = time.time()
        while gen.inflight:
            gen.step()
        ours.append(gen.stats["gen_tokens"] / (time.time() - t0))
        split["ours"].round(time.time() - t0)
        t0 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        theirs.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - t0))
        split["theirs"].round(time.time() - t0)
    for name, sp in split.items():
        print(f"  {name}, seconds per round (after the first): {sp}")
    ours, theirs = median_high(ours[1:]), median_high(theirs[1:])
    print(
        f"generation ({len(prompts)} answers, median of {args.rounds - 1} rounds each): step loop {ours:.0f} tok/s "
        f"vs LLM.generate {theirs:.0f} tok/s "
        f"-> {ours / theirs:.2f}x (target >= {GENERATE_TARGET}x)"
    )
    return ours / theirs


def bench_provenance(args):
    """Tokens/s of the step loop with and without the provenance record, same engine,
    alternating rounds; and answers.jsonl's bytes per token."""
    import json

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from data import load_problems
    from engine import Generator, Rollout, make_engine
    from system.devices import prepare
    from train import parse_config

    cfg = parse_config(
        [
            "--regime",
            "stale",
            "--out",
            "out/bench",
            "--prompts-per-step",
            str(args.prompts),
            "--max-lag",
            "0",
            "--gen-device",
            args.gen_device,
            "--train-device",
            args.train_device,
        ]
    )
    prepare(cfg)  # the synth defaults: 2-operation problems, group size 8, as a default run
    problems = load_problems("synth", "train", n=args.prompts, steps=cfg["synth_steps"])
    gen = Generator(
        cfg,
        make_engine(dict(cfg, engine_device=cfg["gen_devices"][0])),
        problems,
        AutoTokenizer.from_pretrained(cfg["model_path"]),
        [],
    )
    notes = Rollout.note_tokens, Rollout.note_prefill

    def provenance(on):  # Rollout.record with or without its provenance notes (answers.jsonl's segments, prefills)
        Rollout.note_tokens, Rollout.note_prefill = notes if on else (lambda *a: None, lambda *a: None)

    rates = {"with": [], "without": []}
    for i in range(2 * args.rounds):  # alternate; the first round of each kind warms up
        kind = ["with", "without"][i % 2]
        provenance(kind == "with")
        gen.next_group, gen.stats["gen_tokens"] = 0, 0
        gen.outbox.clear()
        gen.admit()
        t0 = time.time()
        while gen.inflight:
            gen.step()
        rates[kind].append(gen.stats["gen_tokens"] / (time.time() - t0))
    provenance(True)
    w, wo = median_high(rates["with"][1:]), median_high(rates["without"][1:])
    print("tok/s per round, with:", [round(x) for x in rates["with"]], "without:", [round(x) for x in rates["without"]])
    # the record itself, outside the engine: one call per answer per step, as Generator.step makes them
    cost = {}
    for kind in ["with", "without"] * 3:
        provenance(kind == "with")
        r = Rollout("0-0", 0, 0, [1] * 20, 10**6, 0.0)
        t0 = time.perf_counter()
        for step in range(100_000):
            r.record([7], [-0.5], 0, step, 0.0, 0.0)
        cost[kind] = min(cost.get(kind, 1e9), (time.perf_counter() - t0) / 100_000 * 1e6)
    provenance(True)
    print(
        f"Rollout.record per call (one token): with {cost['with']:.2f} us, without {cost['without']:.2f} us "
        "(best of 3, alternating)"
    )
    # the lines runlog.RunLog.answers writes for these answers (the last round was "without": one more "with")
    gen.next_group, gen.stats["gen_tokens"] = 0, 0
    gen.outbox.clear()
    gen.admit()
    while gen.inflight:
        gen.step()
    samples = [item for kind, item in gen.outbox if kind == "sample"]
    size = sum(
        len(
            json.dumps(
                dict(
                    sample_id=s["sample_id"],
                    group_id=s["group_id"],
                    prompt_id=s["prompt_id"],
                    tokens=len(s["token_ids"]),
                    fate="consumed",
                    step=1,
                    t=time.time(),
                    **s["provenance"],
                )
            )
        )
        + 1
        for s in samples
    )
    tokens = sum(len(s["token_ids"]) for s in samples)
    print(
        f"provenance ({len(samples)} answers, median of {args.rounds - 1} rounds each): with {w:.0f} tok/s, "
        f"without {wo:.0f} tok/s -> {w / wo:.3f}x; answers.jsonl {size / len(samples):.0f} bytes per answer, "
        f"{size / tokens:.1f} bytes per generated token ({tokens / len(samples):.1f} tokens per answer)"
    )
    return w / wo


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sync-model", default="medium", help="model whose weights are pushed ('medium': a random ~50M Qwen3)"
    )
    p.add_argument("--rounds", type=int, default=7, help="pushes (and raw broadcasts) to take the median of")
    p.add_argument(
        "--step-tokens",
        type=int,
        default=128,
        help="tokens of the forward and backward a push overlaps, as the next training step's",
    )
    p.add_argument(
        "--push-ahead-mib",
        type=int,
        default=PUSH_AHEAD_BYTES // 2**20,
        help="how far the engine's receiving runs ahead of vLLM's loader (preflight.PUSH_AHEAD_BYTES)",
    )
    p.add_argument(
        "--sync-target",
        type=float,
        default=SYNC_TARGET,
        help="the push's ratio to miss ('inf': print it, fail only on memory; a loaded machine's ms: the tests)",
    )
    p.add_argument("--gen-model", default="tiny", help="model for the generation benchmark ('tiny', 'smol', a path)")
    p.add_argument("--prompts", type=int, default=16, help="prompts for the generation benchmark (x8 answers each)")
    p.add_argument("--gen-device", default="auto")
    p.add_argument("--train-device", default="auto")
    p.add_argument(
        "--only",
        choices=["sync", "generate", "provenance"],
        default=None,
        help="run one benchmark (provenance runs only when asked)",
    )
    args = p.parse_args()
    missed = []
    if args.only == "provenance":
        bench_provenance(args)
    if args.only in (None, "sync"):
        ratio, extra, plan = bench_sync(args)
        if ratio > args.sync_target:
            missed.append(f"weight sync {ratio:.2f}x > {args.sync_target}x")
        if extra > plan:
            missed.append(f"a push's memory {extra / 2**20:.0f} MiB > its plan's {plan / 2**20:.0f} MiB")
    if args.only in (None, "generate") and (ratio := bench_generate(args)) < GENERATE_TARGET:
        missed.append(f"generation {ratio:.2f}x < {GENERATE_TARGET}x")
    if missed:
        sys.exit("bench_sync.py: missed its target: " + "; ".join(missed))
