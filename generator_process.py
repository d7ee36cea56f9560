"""
The generator process: engine.py's Generator (a vLLM engine stepped one decode step
at a time, and the per-token bookkeeping) run in a process of its own, beside the
trainer, with what that takes: weights that arrive by broadcast, finished answers
that leave by queue, and the checks that turn a dead or stuck process into an error.

    trainer (rank 0) --- torch.distributed broadcast (nccl | gloo) ---> vLLM worker of engine i (rank 1+i)
    trainer <--------- bounded torch.multiprocessing queue ------------ generator loop of engine i

One engine by default; --engines N starts N generator processes, each its own vLLM
engine (vLLM's advice for dense models: independent instances), one weight group.

What crosses the queue is one dict per finished answer (engine.Rollout.to_sample).
lesson.py runs the same Generator and regimes in one process, on a simulated clock:
read it first; this file is what real concurrency adds.
"""

import math
import os
import queue
import sys
import time
import traceback

from engine import Generator, as_tensors, kv_capacity, lane, make_engine
from preflight import (
    PUSH_AHEAD_BYTES,
    PUSH_SEND_BYTES,
)  # how far a push runs ahead: the engine's receive, the trainer's send
from ranks import weight_specs  # what a push sends first

SYNC_HOST = "127.0.0.1"  # the weight group's rendezvous: the engines run on trainer rank 0's machine
START_TIMEOUT_S = 900  # for the engines to start (a model download, vLLM's warm-up), before the run stops
WEIGHT_GROUP_TIMEOUT_S = 3600  # the weight group's own timeout: above every bound of ours (init_weight_group)
POLL_S = 0.001  # how often a wait on the weight group looks (wait): torch's blocking NCCL wait polls every 1 ms

# -----------------------------------------------------------------------------
# weight sync: trainer side (rank 0) and vLLM worker side (ranks 1..N)


def init_weight_group(host, port, rank, world_size, backend, listen_socket=None):
    """The group trainer (rank 0) + the vLLM worker of every engine, made with vLLM's
    stateless helper so it leaves torch.distributed's global state (vLLM's own, and the
    trainer ranks' under torchrun) alone. Rank 0 hosts the rendezvous store on a socket
    it bound itself (no race for the port, and no torchrun agent store: see
    spawn_with_env). Its timeout is explicit: the helper's default is the backend's (NCCL
    10 min, gloo 30 min), and a push's join may wait as long as its stall bound (drain; 1460 s
    measured during the CPU warm-up), past which NCCL's watchdog would abort the process
    before our watchdog could name the engine. WEIGHT_GROUP_TIMEOUT_S (1 h) is above our
    bounds, so wait() reports first; forming the group, which it bounds too, is watched by
    GeneratorHandle.form_group."""
    from datetime import timedelta
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    group = stateless_init_torch_distributed_process_group(
        host,
        port,
        rank,
        world_size=world_size,
        backend=backend,
        listen_socket=listen_socket,
        timeout=timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S),
    )
    return nccl_wait_test_hook(group)


def wait(group, work, check):
    """Hold this thread until `work`, a collective of the weight group, has completed, on
    every backend. NCCL's work.wait() does not block the CPU: it makes the current stream wait
    for the collective and returns (ProcessGroupNCCL.hpp, WorkNCCL::wait; it blocks only under
    TORCH_NCCL_BLOCKING_WAIT), and a dead peer does not fail an NCCL collective: it hangs until
    the group's timeout, when NCCL's watchdog aborts the process without a word of ours. So:
    poll is_completed() every POLL_S and, between polls, check(), which raises when a peer is
    gone (the trainer's: an engine process exited; an engine's: its trainer did). Then the
    group is aborted (NCCL: its communicators, which no collective queued on the dead peer
    would leave; gloo has nothing to abort, its collective failed with "Connection closed by
    peer") and the error goes to the caller, which reports it as it did gloo's. A stuck
    peer is the trainer's push watchdog's (GeneratorHandle.push_stalled): it kills the engines
    that are late, and the check sees them gone. Once completed, work.wait() raises gloo's
    error, or on NCCL orders the current stream after the collective, so what the CPU reads
    next from that stream (tolist() synchronizes it) is what arrived."""
    while not work.is_completed():
        try:
            check()
        except RuntimeError:
            group.abort()
            raise
        time.sleep(POLL_S)
    work.wait()


def checksum(t):
    """Two integers that change whenever a bit of `t` changes (unless changes cancel out
    exactly): t's bytes read as int32 words, summed over its first half and over its second
    half, each wrapping mod 2^32, as an int32 tensor of 2 on t's device. Integer sums are
    exact mod 2^32 and do not depend on their order, so the same bits give the same two
    numbers on the CPU and on a GPU. One kernel a tensor, which reads t once and writes 8
    bytes (and two views): the sum is asked for in int32, the words' own type, because torch
    casts a whole copy of its input first when the dtype differs (an int16 view summed into
    int64: a copy 4x the tensor). send_weights and WeightReceiver.receive_weights add them up
    per push into int64 (one more kernel each): 2^31 x a model's tensors x the engines stays
    far inside it. Where it sits: on a GPU the kernels queue on the current stream (the CPU
    pays their launches, the stream a read of the bytes before the next forward); on CPU the
    trainer's thread reads every tensor once as it posts it, and the engine's every tensor
    that arrives. A tensor whose bytes are not whole int32 words in two equal halves (an
    odd-length bf16 vector; none of Qwen3's) is copied once, padded with zeros."""
    import torch

    size = t.element_size()
    whole = t.numel() * size % 8 == 0 and t.dim() and t.shape[-1] * size % 4 == 0 and t.storage_offset() * size % 4 == 0
    if whole and t.is_contiguous():
        words = t.view(torch.int32)
    else:
        b = t.reshape(-1).view(torch.uint8)
        words = torch.cat([b, b.new_zeros(-len(b) % 8)]).view(torch.int32)
    return words.view(2, -1).sum(1, dtype=torch.int32)


def send_weights(group, tensors, device, check, budget=PUSH_SEND_BYTES):
    """Once every engine has joined the push (an allreduce: it completes when the last
    one arrives; drain's wait, which this holds the trainer for), post a broadcast of every
    tensor from rank 0 and the acknowledgement (an allreduce of the versions the workers
    load, which they add once every tensor has arrived) without waiting for them: the
    process group moves them on its own threads (gloo) or stream (NCCL) while the trainer
    goes on. A tensor posted is held until it has gone out: past `budget` bytes in flight
    (PUSH_SEND_BYTES; preflight.memory_plan), the trainer waits for the oldest (the CPU
    waits, so on NCCL too at most the budget is queued, and the next step's forward is not
    queued behind the rest of the push). Every wait is wait()'s, with `check` (raises when a
    peer is gone). Returns (done, finish): done() says whether the ack is in, finish() waits
    for it and returns (the ack: the versions and the checksums of what arrived, summed over
    the engines; the checksum of what was sent; the positions of the tensors that changed
    while the push was in flight).

    Every tensor sent must stay unchanged until finish(): with one trainer rank and the
    generator's dtype they are the parameters themselves, which the next optimizer step
    overwrites. The guard has two parts, neither on the trainer's thread beyond a counter:
    - a change: each tensor's version counter (torch's `_version`, which every in-place op on
      it or a view of it increments: the optimizer's step, a load_state_dict) is noted as it
      is posted and compared in finish(). Exact, and free: no byte is read.
    - what arrived: checksum() of every tensor, read by a thread of its own as the tensors
      are posted (one read of the model: ~0.07x a raw broadcast on CPU, where gloo moves
      ~1.3 GB/s; on a GPU its launches), against the engines' checksums of what they
      received. Read after posting, it may read a tensor before or after it went out; both
      reads see the same bytes unless the tensor changed in between, which the counter
      shows. So a push that arrives other than it was sent raises in settle either way."""
    import collections
    import threading
    import torch

    wait(group, group.allreduce(torch.zeros((), dtype=torch.int64, device=device)), check)  # "all here"
    works, held = collections.deque(), 0  # (bytes, work) in flight; their bytes
    sent = torch.zeros(2, dtype=torch.int64, device=device)  # checksum() of every tensor, added up
    posted, to_read = [], queue.SimpleQueue()  # (tensor, its version counter when posted); the reader's

    def read():  # the checksums, off the trainer's thread (torch's kernels release the GIL)
        while (t := to_read.get()) is not None:
            sent.add_(checksum(t))

    reader = threading.Thread(target=read, name="push-checksum", daemon=True)
    reader.start()
    try:
        for t in tensors:
            t = t.to(device).contiguous()
            size = t.numel() * t.element_size()
            while works and held + size > budget:
                n, work = works.popleft()
                wait(group, work, check)
                held -= n
            posted.append((t, t._version))
            works.append((size, group.broadcast(t, root=0)))  # the work keeps its tensor until it completes
            to_read.put(t)
            held += size
    finally:
        to_read.put(None)  # the reader ends: on an error too
    ack = torch.zeros(3, dtype=torch.int64, device=device)  # each engine adds its version and checksums
    works.append((0, group.allreduce(ack)))

    def finish():
        for _, work in works:
            wait(group, work, check)
        reader.join()
        return ack.tolist(), sent.tolist(), [i for i, (t, v) in enumerate(posted) if t._version != v]

    return works[-1][1].is_completed, finish


def buffer_device(backend, worker_device):
    """Where the worker receives a broadcast: nccl moves GPU tensors, gloo CPU tensors
    (also for one shared GPU, where NCCL refuses two ranks on the same device). Decided
    on the backend string devices.resolve_devices chose: torch's ProcessGroup.name()
    answers lowercase "nccl"/"gloo", so a test against "NCCL" sent CPU buffers into
    an NCCL broadcast (test_generator.py::test_buffer_device_follows_backend)."""
    return worker_device if backend == "nccl" else "cpu"


def receive_broadcast(engine, version, specs, ahead_bytes=PUSH_AHEAD_BYTES):
    """Generator.receive in the generator process: the trainer broadcasts the weights
    (`specs` says which tensors, in order); the worker receives and loads them. Returns,
    with several engines, when the last one joined the push (None with one)."""
    return engine.collective_rpc("receive_weights", args=(version, specs, ahead_bytes))[0]


class WeightReceiver:
    """vLLM worker extension (`worker_extension_cls`): these methods run inside the
    vLLM worker, called through `engine.collective_rpc(name, args)`."""

    def init_weight_group(self, host, port, rank, world_size, backend, trainer):
        """Join the weight group; `trainer`, the trainer's pid, is this process's parent (the
        worker runs in the generator process: VLLM_ENABLE_V1_MULTIPROCESSING=0, one device per
        engine), which the waits watch (wait)."""
        if os.getppid() != trainer:
            raise RuntimeError(f"vLLM's worker runs outside the generator process (its parent {os.getppid()})")
        self.weight_group = init_weight_group(host, port, rank, world_size, backend)
        self.weight_backend = backend  # the string we chose, not one read back from torch (see buffer_device)
        self.trainer = trainer

    def check_trainer(self):
        """For wait(): raise once the trainer is gone (this process was handed to another parent)."""
        if os.getppid() != self.trainer:
            raise RuntimeError(f"the trainer (pid {self.trainer}) is gone")

    def receive_weights(self, version, specs, ahead_bytes):
        """Join the push, then receive every tensor into a buffer of its own, the broadcasts
        posted ahead of what vLLM's loader has taken by at most `ahead_bytes`, so that the
        transfer goes on (on the process group's own threads, or NCCL's stream) while the
        loader loads. The trainer is released (the ack: the version, and the checksum of every
        tensor that arrived, which the trainer holds against what it sent) once the last tensor
        has arrived, not once it is loaded. No engine step runs before this returns, so nothing samples
        from a half-loaded model; a push that breaks halfway raises here, and the generator
        process ends. Returns, with several engines, the time every engine had joined
        (before that, this one was waiting for the others to finish draining: idle, not
        loading); None with one."""
        import collections
        import torch

        device = buffer_device(self.weight_backend, self.device)
        group, check = self.weight_group, self.check_trainer
        wait(group, group.allreduce(torch.zeros((), dtype=torch.int64, device=device)), check)  # all engines here
        joined = time.time() if group.size() > 2 else None  # when the last one came (wait: not when posted)
        # The engine's memory holds no second copy of the model: vLLM's layerwise reload keeps
        # a received tensor only until its module (q+k+v, gate+up, an embedding) is complete,
        # then copies it in place and lets it go (vllm/model_executor/model_loader/reload/
        # layerwise.py). Each tensor gets a fresh buffer (a reused one would be overwritten
        # while vLLM still holds it). Besides what vLLM holds (about a module), the buffers
        # posted and not yet taken are at most `ahead_bytes`, or one tensor when a single one
        # is larger (preflight.engine_plan). The posting is done here, by the loader's thread:
        # a receiving thread of our own (tried first) blocked the trainer longer (2.26x a raw
        # broadcast in bench_sync, one push of 44 s) and grew the engine more (220 MiB above its
        # start), likely because it needed the GIL after every tensor while the loader ran
        # Python, and allocated from a malloc arena of its own that the loader's frees never
        # shrank. The group's own threads need no GIL.
        posted = collections.deque()  # (name, buffer, the broadcast's work), in send order
        ahead, done, ack = 0, 0, []  # bytes posted and not taken; tensors taken; the ack's work
        got = torch.zeros(2, dtype=torch.int64, device=device)  # checksum() of every tensor that arrived

        def received():  # what vLLM's loader iterates over
            nonlocal ahead
            for name, dtype, shape in specs:
                dtype = getattr(torch, dtype)
                size = math.prod(shape) * dtype.itemsize
                while posted and ahead + size > ahead_bytes:  # wait for the oldest, hand it over
                    yield take()
                t = torch.empty(shape, dtype=dtype, device=device)
                posted.append((name, t, group.broadcast(t, root=0)))
                ahead += size
            while posted:
                yield take()

        def take():
            nonlocal ahead, done
            name, t, work = posted.popleft()
            try:  # the CPU waits until the bytes are here (not only the stream), so `ahead` is true
                wait(group, work, check)
            except RuntimeError as e:  # a dead trainer or engine: "Connection closed by peer", or check's
                # vLLM would put the old tensors back into the layers it got nothing for and
                # build the half-received ones from what arrived: never step on that
                raise RuntimeError(
                    f"the push of v{version} broke after {done} of {len(specs)} tensors; "
                    "this engine's weights are half loaded, so it stops"
                ) from e
            ahead -= t.numel() * t.element_size()
            done += 1
            got.add_(checksum(t))  # what arrived, before vLLM's loader takes it
            if done == len(specs):  # every byte is here: release the trainer before the last load
                mine = torch.cat([torch.tensor([version], dtype=torch.int64, device=device), got])
                ack.append(group.allreduce(mine))
            return name, t

        # in-place reload: the same parameter storage, so CUDA graphs and the KV cache
        # stay valid. (model.load_weights from here fails on CPU: "'Parameter' object
        # has no attribute 'weight_loader'"; reload_weights goes through the loaders.)
        self.reload_weights(weights_iterator=die_test_hook(version, specs, received(), "ENGINE_DIES_IN_PUSH"))
        if done < len(specs):  # vLLM's loader stopped taking tensors: some layers were not loaded
            raise RuntimeError(f"vLLM loaded {done} of the {len(specs)} tensors of v{version}; this engine stops")
        wait(group, ack[0], check)
        return joined


# -----------------------------------------------------------------------------
# the Generator as the process runs it


class ProcessGenerator(Generator):
    """engine.Generator with what the generator process adds and lesson.py does not have:
    engine `engine_id` of `engines` (engine i writes the groups g = i mod engines); a resumed
    run (start_version, start_group: the data position; skip_groups: groups after it already
    consumed or rejected; start_stats: its counters); the groups the trainer's pool rejected
    (`rejected`, set from each push), which leave their places to new ones; `queue_size`,
    the finished answers it may hold before it stops admitting (the queue's back-pressure)."""

    def __init__(
        self,
        cfg,
        engine,
        problems,
        tokenizer,
        outbox,
        receive,
        *,
        engine_id=0,
        engines=1,
        start_version=0,
        start_group=0,
        skip_groups=(),
        start_stats=None,
        queue_size=float("inf"),
        step_log=None,
    ):
        super().__init__(cfg, engine, problems, tokenizer, outbox, receive=receive)
        self.engine_id, self.engines, self.queue_size = engine_id, engines, queue_size
        self.proc = lane(engine_id, engines)
        self.version = self.start_version = start_version  # > 0 when resuming
        self.start_group = start_group
        self.next_group = start_group + (engine_id - start_group) % engines
        self.skip = set(skip_groups)
        self.rejected = 0  # groups the trainer's pool rejected since this generator started
        self.stats.update(start_stats or {})  # resume: the run's counters at its checkpoint
        self.step_log = step_log  # a StepLog, or None

    def step(self):
        """Generator.step, and its line in the step log: what the engine held, what the step took."""
        if self.step_log is None:
            return super().step()
        evals = [ev for ev in self.eval_out.values() if ev["reason"] is None]
        held = len(self.inflight) + len(evals)
        kv = sum(len(r.prompt_ids) + len(r.tokens) for r in self.inflight.values())
        kv += sum(ev["prompt"] + len(ev["ids"]) for ev in evals)
        made = lambda: self.stats["gen_tokens"] + sum(len(ev["ids"]) for ev in evals)
        before, t0 = made(), time.time()
        super().step()
        made = made() - before
        self.step_log.write(t0, time.time(), held, kv, self.prefilled, made, len(evals))

    @property
    def budget_offset(self):
        """The groups Generator.may_admit's bound admits beyond the lesson's count: a resumed run
        counts its versions from start_version and its groups from start_group, and a group the
        pool rejected leaves its place to a new one, so that a generator faster than the trainer
        keeps the pool above PACE's target."""
        return self.start_group - self.start_version * self.cfg["prompts_per_step"] + self.rejected

    def may_admit(self):
        """Generator.may_admit (with budget_offset), and only while the queue has room for what
        is finished (queue_size): the queue's back-pressure."""
        return super().may_admit() and len(self.outbox) < self.queue_size

    def admit(self):
        """Engine i of N starts the groups i, i + N, ...; a group consumed or rejected before
        the run was resumed is passed over."""
        while self.may_admit():
            g = self.next_group
            self.next_group += self.engines
            if g not in self.skip:
                self.submit_group(g)

    def load_weights(self, version, weights):
        """Generator.load_weights; with several engines, the time this engine waited for the
        others to join the push (they were draining) is idle, not loading."""
        t0 = self.clock.now()
        joined = self.receive(self.engine, version, weights)  # several engines: when the last one joined
        if joined is not None and joined > t0:
            self.set_activity("idle", t0)
            self.stats["gen_idle_s"] += joined - t0
            t0 = joined
        self.loaded(version, t0)


# -----------------------------------------------------------------------------
# the process


def keep_to_gen_cores():
    """On CPU, pin every thread of this process to the generator's cores
    (INFLIGHT_GEN_CORES, from devices.resolve_devices). vLLM's VLLM_CPU_OMP_THREADS_BIND binds
    only the workers its multiprocess executor spawns, not an in-process engine, and
    a spawned child inherits the trainer's cores: both ran on one core."""
    if cores := os.environ.get("INFLIGHT_GEN_CORES"):
        for tid in os.listdir("/proc/self/task"):  # every thread started so far
            os.sched_setaffinity(int(tid), [int(c) for c in cores.split(",")])


def stack_file(cfg):
    """Where the generator writes its Python stack when the trainer sends SIGUSR1."""
    return os.path.join(cfg["out"], f"{lane(cfg['engine'], cfg['engines'])}-stack.txt")


def generator_main(cfg, samples_q, control_q, joined):
    """Entry point of the spawned generator process. Its device was chosen by the
    spawner's environment (CUDA_VISIBLE_DEVICES / INFLIGHT_GEN_CORES), which the
    process read before importing torch or vLLM."""
    import faulthandler
    import signal

    keep_to_gen_cores()
    try:  # `ps` and the tests tell the engines apart (setproctitle comes with vLLM)
        import setproctitle

        setproctitle.setproctitle(f"inflight-generator{cfg.get('engine', 0)}")
    except ImportError:
        pass
    # SIGUSR1 -> every thread's Python stack into the run directory: the trainer's stall
    # watchdog asks for it (GeneratorHandle.stalled). faulthandler writes from the C
    # signal handler, so it answers even while the main thread is stuck inside C code.
    os.makedirs(cfg["out"], exist_ok=True)
    stack = open(stack_file(cfg), "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    # tqdm's bars (vLLM's, the evaluation's) take a multiprocessing lock: a named semaphore
    # that this process, when the trainer has to kill it, would leave behind ("resource_tracker:
    # There appear to be 1 leaked semaphore objects"). A thread lock does, in one process.
    import threading
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        run_generator(cfg, samples_q, control_q, joined, trainer=os.getppid())
    except KeyboardInterrupt:  # Ctrl-C reaches both processes; the trainer reports it
        samples_q.cancel_join_thread()  # exit now: the trainer may have stopped reading
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)  # in the log even if the trainer is gone
        samples_q.put(("error", (cfg.get("engine", 0), tb)))
        flush(samples_q, timeout=10)
        raise SystemExit(1)
    finally:  # no stack was asked for: leave no empty file in the run directory
        if os.path.getsize(stack.name) == 0:
            os.remove(stack.name)
    # stopped (or its trainer gone): out at once. Python's own exit, unloading torch and vLLM,
    # took ~2 s more, which the trainer waits out (GeneratorHandle.stop); nobody reads what
    # this process has not yet sent.
    samples_q.cancel_join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def flush(q, timeout):
    """Give q's feeder thread `timeout` seconds to write what was put (the error
    goes last), then give up. A trainer blocked in a weight broadcast reads nothing
    until this process exits and the broadcast fails: waiting for it would deadlock."""
    import threading

    q.close()
    t = threading.Thread(target=q.join_thread, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        q.cancel_join_thread()


def run_generator(cfg, samples_q, control_q, joined, trainer):
    import collections
    import random
    import torch
    from transformers import AutoTokenizer
    from data import load_problems
    from regimes import make_regime

    torch.set_num_threads(cfg["gen_threads"])
    regime = make_regime(cfg["regime"])
    problems = load_problems(cfg["dataset"], "train", data_file=cfg.get("data_file"), steps=cfg["synth_steps"])
    random.Random(cfg["seed"]).shuffle(problems)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    engine = make_engine(cfg, worker_extension="generator_process.WeightReceiver")
    outbox = []

    def receive(engine, version, specs):
        """Generator.receive: say that this engine joins the push of `version` (the trainer's
        watchdog then knows which engines never came), then take the broadcast."""
        stall_test_hook("push", version, cfg.get("engine", 0))
        joined.value = version
        return receive_broadcast(engine, version, specs, cfg.get("push_ahead_bytes", PUSH_AHEAD_BYTES))

    gen = ProcessGenerator(
        cfg,
        engine,
        problems,
        tokenizer,
        outbox,
        receive,
        engine_id=cfg["engine"],
        engines=cfg["engines"],
        start_version=cfg["start_version"],
        start_group=cfg["start_group"],
        skip_groups=cfg["skip_groups"],
        start_stats=cfg["start_stats"],
        queue_size=cfg["queue_size"],
        step_log=StepLog(cfg),
    )
    kv_answers, kv_tokens = kv_capacity(engine, cfg["max_model_len"])
    samples_q.put(
        (
            "engine_ready",
            dict(engine=gen.engine_id, kv_answers=kv_answers, kv_tokens=kv_tokens, admit_at_once=gen.kv_answers),
        )
    )
    stall_test_hook("group", 1, gen.engine_id)
    engine.collective_rpc(
        "init_weight_group",
        args=(SYNC_HOST, cfg["sync_port"], 1 + gen.engine_id, 1 + cfg.get("engines", 1), cfg["sync_backend"], trainer),
    )
    pending, evals = None, []  # weights being broadcast (version, specs); eval requests
    idle, steps, recent = False, 0, collections.deque(maxlen=256)  # recent: engine step times, s
    last_put = time.time()
    cpu_s0 = (cfg.get("start_stats") or {}).get("cpu_s", 0.0)  # resume: the CPU time before the checkpoint
    while True:
        if os.getppid() != trainer:  # the trainer died without a word (kill -9): nobody is listening
            samples_q.cancel_join_thread()  # so exiting does not wait to flush a pipe no one reads
            return
        try:  # control messages, in order: new weights, evaluate, stop. With nothing else to
            # do, wait on the queue itself, so a push is picked up as soon as it is sent
            t0 = time.time()
            msg = control_q.get(timeout=0.005) if idle else control_q.get_nowait()
            while True:
                if msg[0] == "stop":
                    gen.step_log.flush()
                    return
                if msg[0] == "weights":  # (version, specs, groups the pool has rejected)
                    pending, gen.rejected = msg[1:3], msg[3]
                else:
                    evals.append(msg[1:])
                msg = control_q.get_nowait()
        except queue.Empty:
            pass
        if idle:
            gen.stats["gen_idle_s"] += time.time() - t0
        if pending is not None and regime.switch(gen, *pending):
            pending = None
        if pending is None and evals:
            prompts, max_tokens = evals.pop(0)
            outbox.append(
                ("eval", dict(engine=gen.engine_id, version=gen.version, answers=gen.evaluate(prompts, max_tokens)))
            )
        gen.admit()
        idle = not gen.inflight
        if idle:  # nothing to do: wait for weights (sync, max-lag) or for the trainer to drain the queue
            gen.set_activity("idle")
        else:
            gen.set_activity("draining" if not gen.admitting else "generating")
            stall_test_hook("step", steps := steps + 1, gen.engine_id)
            t0 = time.time()
            gen.step()
            # the slowest of the last 256 steps sets the trainer's stall bound (GeneratorHandle.stall_bound):
            # recent, so the first steps' warm-up (~3 s each for the tiny model on CPU) ages out
            recent.append(time.time() - t0)
            gen.stats["max_step_s"] = max(recent)
        if not outbox and time.time() - last_put > 1.0:  # alive, even when idle: the trainer's
            outbox.append(("alive", gen.engine_id))  # stall watchdog tells a stuck engine from an idle one
        while outbox:  # never block on a full queue: the control queue must stay served
            kind, item = outbox[0]
            if kind == "sample":  # cpu_s: this process's CPU time, every thread (what a GPU's busy time would be)
                item["gen_stats"] = dict(gen.stats, version=gen.version, cpu_s=time.process_time() + cpu_s0)
            try:
                samples_q.put_nowait((kind, item))
            except queue.Full:
                break
            outbox.pop(0)
            last_put = time.time()


class StepLog:
    """<engine lane>-steps.jsonl in the run directory, a line per engine step: [t0, t1, answers in
    the engine, tokens in their KV, tokens prefilled, tokens sampled, evaluation answers among them]
    (tools/clock_costs.py fits the lesson's clock to it), written a second's worth at a time."""

    def __init__(self, cfg):
        self.f = open(os.path.join(cfg["out"], f"{lane(cfg['engine'], cfg['engines'])}-steps.jsonl"), "a")
        self.rows, self.last = [], time.time()

    def write(self, t0, t1, *held):
        self.rows.append(f"[{t0:.6f}, {t1:.6f}, {', '.join(map(str, held))}]\n")
        if t1 - self.last > 1.0:
            self.flush()

    def flush(self):
        self.f.write("".join(self.rows))
        self.f.flush()
        self.rows, self.last = [], time.time()


def stall_test_hook(kind, n, engine):
    """TEST HOOK (test_reliability.py): with INFLIGHT_TEST_STALL_AT_STEP=N in the
    environment the generator hangs forever before its N-th engine step, with
    INFLIGHT_TEST_STALL_AT_PUSH=V before it joins the push of version V, with
    INFLIGHT_TEST_STALL_AT_GROUP=1 before it joins the weight group, alive and
    silent, as a stuck engine or a deadlocked worker would; with
    INFLIGHT_TEST_STALL_ENGINE=i, only engine i does."""
    if n == int(os.environ.get(f"INFLIGHT_TEST_STALL_AT_{kind.upper()}", 0)) and os.environ.get(
        "INFLIGHT_TEST_STALL_ENGINE", str(engine)
    ) == str(engine):
        while True:
            time.sleep(3600)


def die_test_hook(version, specs, tensors, who="DIE_IN_PUSH"):
    """TEST HOOK (test_reliability.py, test_generator.py): with INFLIGHT_TEST_DIE_IN_PUSH=V in
    the environment the trainer kills itself (-9) once it has sent half the tensors of the push
    of version V, as a trainer lost halfway through a push; with INFLIGHT_TEST_ENGINE_DIES_IN_PUSH=V
    (who="ENGINE_DIES_IN_PUSH", WeightReceiver.receive_weights) the engine does, once it has
    received half of them."""
    if version != int(os.environ.get(f"INFLIGHT_TEST_{who}", 0)):
        return tensors

    def halfway():
        import signal

        for i, t in enumerate(tensors):
            if i == len(specs) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield t

    return halfway()


class NcclWaits:
    """TEST HOOK (nccl_wait_test_hook): a gloo group whose works behave as NCCL's do on a GPU."""

    def __init__(self, group):
        self.group = group

    def broadcast(self, t, root):
        return NcclWork(self.group.broadcast(t, root=root))

    def allreduce(self, t):
        return NcclWork(self.group.allreduce(t))

    def __getattr__(self, name):  # size(), rank(), abort(): gloo's
        return getattr(self.group, name)


class NcclWork:
    """A gloo work as NCCL's on a GPU: wait() without a timeout returns at once (NCCL's makes
    the current stream wait for the collective and returns: ProcessGroupNCCL.hpp, WorkNCCL::wait),
    and a collective broken by a dead peer never completes (gloo's fails at once with "Connection
    closed by peer"; NCCL's hangs until the group's timeout, when NCCL's watchdog aborts the
    process). Only is_completed() says when the bytes are here."""

    def __init__(self, work):
        self.work = work

    def is_completed(self):
        return self.work.is_completed() and self.work.exception() is None

    def wait(self, timeout=None):
        return True if timeout is None else self.work.wait(timeout)


def nccl_wait_test_hook(group):
    """TEST HOOK (test_generator.py, test_reliability.py): with INFLIGHT_TEST_NCCL_WAITS=1 in
    the environment (the trainer's, which its engines inherit) the weight group's works
    behave as NCCL's do on a GPU (NcclWork): a wait that waits and a dead peer that is noticed
    must come from the code that waits, as they must on a GPU."""
    return NcclWaits(group) if os.environ.get("INFLIGHT_TEST_NCCL_WAITS") else group


# -----------------------------------------------------------------------------
# the trainer's handle on the generator process


class GeneratorDied(RuntimeError):
    pass


def spawn_with_env(ctx, env, target, args, **kw):
    """Start a process that sees `env` in its environment (None: unset there): the child
    reads its device from there before it imports torch, while this process's
    environment is left as it was."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        proc = ctx.Process(target=target, args=args, **kw)
        proc.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return proc


# torchrun's variables, which a generator spawned by trainer rank 0 must not inherit: vLLM
# reads some of them, and with TORCHELASTIC_USE_AGENT_STORE=True torch's rendezvous turns the
# weight group's store into a client of torchrun's agent, and the group never forms
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


class GeneratorHandle:
    """Trainer side: spawns the generator engines (one by default), pushes weights to
    all of them at once, receives their samples and events on one queue, and turns any
    death of an engine into an exception that carries its own traceback."""

    def __init__(self, cfg, envs):
        """envs: one environment per engine (devices.resolve_devices)."""
        import socket
        import torch.multiprocessing as mp

        self.n = len(envs)
        listen = socket.socket()  # the weight group's store: this port, bound here, handed to vLLM's helper
        listen.bind((SYNC_HOST, 0))
        listen.listen()
        cfg = dict(cfg, sync_port=listen.getsockname()[1], engines=self.n)
        ctx = mp.get_context("spawn")  # vLLM and CUDA do not survive fork
        self.samples_q = ctx.Queue(maxsize=cfg["queue_size"])  # bounded: back-pressure; one for all engines
        self.control_qs = [ctx.Queue() for _ in envs]
        self.joined = [ctx.Value("i", cfg["start_version"], lock=False) for _ in envs]  # the last push each joined
        self.procs = [
            spawn_with_env(
                ctx,
                {**dict.fromkeys(TORCHRUN_ENV), **env},
                generator_main,
                (
                    dict(
                        cfg,
                        engine=i,
                        engine_device=cfg["gen_devices"][i],
                        start_stats=cfg.get("start_stats") if i == 0 else None,
                    ),
                    self.samples_q,
                    self.control_qs[i],
                    self.joined[i],
                ),
                daemon=True,
                name=f"inflight-generator{i}",
            )
            for i, env in enumerate(envs)
        ]
        self.cfg, self.version = cfg, cfg["start_version"]
        self.stats = dict(cfg.get("start_stats") or {})  # the generators' counters (summed), as samples carry them
        self.engine_stats = [dict(self.stats) if i == 0 else {} for i in range(self.n)]
        self.transfer_device = cfg["trainer_device"] if cfg["sync_backend"] == "nccl" else "cpu"
        self.last_seen = [time.time()] * self.n  # when each engine last sent anything (stall watchdog)
        self.last_msg, self.last_event = [(time.time(), "nothing yet")] * self.n, [None] * self.n
        self.stall_report = None
        self.send_budget = PUSH_SEND_BYTES  # bytes a push may hold in flight (send_weights)
        self.pending = None  # the push in flight: (done, finish, its watchdog, specs) (push with wait=False)
        self.broke = False  # a push broke (push_broke): engines still in it wait on a dead peer
        infos = {}
        while len(infos) < self.n:
            if (msg := self.get(timeout=START_TIMEOUT_S)) is None:
                self.stalled(START_TIMEOUT_S, [i for i in range(self.n) if i not in infos])
            assert msg[0] == "engine_ready", msg[0]
            infos[msg[1]["engine"]] = msg[1]
        # the KV cache's size (preflight.check_kv_plan): the smallest engine's
        self.engine_info = min(infos.values(), key=lambda info: info["admit_at_once"])
        self.group = self.form_group(listen)

    def form_group(self, listen):
        """The weight group, formed on a thread while this one watches the engines as wait()
        watches a push: init_weight_group returns once every engine's worker has joined, or
        after the group's own timeout (1 h). An engine that exits first ends the run with its
        traceback (died); one alive that has not joined within the stall bound, with its stack
        (stalled)."""
        import threading

        made = []

        def form():
            try:
                made.append(
                    init_weight_group(SYNC_HOST, self.cfg["sync_port"], 0, 1 + self.n, self.cfg["sync_backend"], listen)
                )
            except Exception as e:  # raised below, on the trainer's thread
                made.append(e)

        former = threading.Thread(target=form, name="weight-group", daemon=True)
        former.start()
        t0, bound = time.time(), self.stall_bound()
        while former.is_alive():
            former.join(POLL_S * 100)
            if dead := [i for i, p in enumerate(self.procs) if not p.is_alive()]:
                self.died(dead[0], " while the weight group formed")
            if former.is_alive() and time.time() - t0 > bound:
                raise GeneratorDied(self.stop_stalled(bound, "not in the weight group"))
        if isinstance(made[0], Exception):
            raise made[0]
        return made[0]

    def name(self, i):
        return "generator" if self.n == 1 else f"generator engine {i}"

    def stall_bound(self):
        """Seconds a live generator may send nothing while the trainer waits for it before
        the trainer calls it stuck (--stall-s overrides). Every answer ends within
        --max-new-tokens engine steps of its start, so: 30 s (a busy machine's hiccups)
        + 3 x max_new_tokens x the slowest of the generator's last 256 engine steps
        (1 s assumed before the first answer brings a measurement). It is logged as
        stall_bound_s: tiny model, 96 tokens, 2 busy cores: ~1460 s while the engine's
        ~5 s warm-up steps are in the window (14 steps of 4 x 4 answers), then 78-93 s.
        An idle engine says it is alive every second, so with several engines one that
        is stuck is told apart from one with nothing to do. Evaluations allow one bound
        per wave of as many prompts as an engine holds at once (kv_capacity); a weight
        push, one bound (drain holds it until the answers in flight finish)."""
        if self.cfg.get("stall_s"):
            return self.cfg["stall_s"]
        return 30 + 3 * self.cfg["max_new_tokens"] * max(s.get("max_step_s", 1.0) for s in self.engine_stats)

    def next(self):
        """The next (kind, item) from the generators. An engine that is alive but sends
        nothing for stall_bound() seconds is stopped, and GeneratorDied raised with its stack."""
        while True:
            bound = self.stall_bound()
            if (msg := self.get(timeout=1.0)) is not None:
                return msg
            silent = [i for i in range(self.n) if time.time() - self.last_seen[i] > bound]
            if silent:
                self.stalled(bound, silent)

    def evaluate(self, prompts, max_tokens):
        """Greedy answers of `prompts` under the generators' weights, as (token ids, finish
        reason), the prompts split evenly across the engines; samples that arrive
        meanwhile are returned too, for the trainer's pool."""
        size = -(-len(prompts) // self.n)
        chunks = [prompts[i * size : (i + 1) * size] for i in range(self.n)]
        waves = 1 + size // self.engine_info["admit_at_once"]  # what an engine holds at once
        timeout = self.stall_bound() * waves
        for q, chunk in zip(self.control_qs, chunks):
            q.put(("eval", chunk, max_tokens))
        other, results = [], {}
        while (msg := self.get(timeout)) is not None:
            if msg[0] == "eval":
                results[msg[1]["engine"]] = msg[1]["answers"]
                if len(results) == self.n:
                    return [a for i in range(self.n) for a in results[i]], other
            else:
                other.append(msg)
        self.stalled(timeout, [i for i in range(self.n) if i not in results])

    def get(self, timeout):
        """Next (kind, item) from the generators, or None after `timeout` seconds."""
        deadline = time.time() + timeout
        while True:
            try:
                kind, item = self.samples_q.get(timeout=min(1.0, max(0.0, deadline - time.time())))
            except queue.Empty:
                for i, proc in enumerate(self.procs):
                    if not proc.is_alive():
                        self.died(i, "")
                if time.time() >= deadline:
                    return None
                continue
            except (EOFError, OSError) as e:  # a message cut off by its sender's death
                self.died(
                    next((i for i, p in enumerate(self.procs) if not p.is_alive()), 0),
                    f" ({type(e).__name__} reading its queue)",
                )
            if kind == "error":
                self.died(item[0], "", {item[0]: item[1]})
            i = item if kind == "alive" else item.get("engine", 0)
            self.last_seen[i] = time.time()
            if kind == "alive":
                continue
            self.last_msg[i] = (time.time(), kind)
            if kind == "event":
                self.last_event[i] = item
            if kind == "sample":  # numpy arrays (Rollout.to_sample) -> tensors, sharing their memory
                item = as_tensors(item)
                self.engine_stats[i] = item["gen_stats"]
                self.stats = {
                    k: sum(s.get(k, 0) for s in self.engine_stats)
                    for k in item["gen_stats"]
                    if k not in ("version", "max_step_s")
                }
                self.stats["max_step_s"] = max(s.get("max_step_s", 0.0) for s in self.engine_stats)
            return kind, item

    def died(self, i, how, errors=None):
        """Raise GeneratorDied for engine i, with the engine's own traceback when it sent one.
        With several engines, one engine's death breaks the others' weight group ("Connection
        closed by peer"), and they report that: an engine that died without a word (killed)
        is named as the cause before any engine that failed with a traceback."""
        self.procs[i].join(timeout=5)
        errors = dict(errors or {})
        while True:
            try:
                kind, item = self.samples_q.get(timeout=0.5)
            except queue.Empty:
                break
            except (EOFError, OSError):
                continue
            if kind == "error":
                errors.setdefault(item[0], item[1])
        silent = [j for j, p in enumerate(self.procs) if not p.is_alive() and j not in errors]
        if silent or not errors:
            j = i if i in silent or not silent else silent[0]
            then = f"; then {', '.join(self.name(k) for k in sorted(errors))} failed" if errors else ""
            raise GeneratorDied(
                f"{self.name(j)} process died{how if j == i else ''} (exit code {self.procs[j].exitcode}){then}"
            )
        k = i if i in errors else min(errors)
        raise GeneratorDied(f"{self.name(k)} process failed:\n" + errors[k])

    def stalled(self, silent_s, engines):
        """Engines alive but silent for `silent_s` seconds: stop them and raise
        GeneratorDied with their last activity and Python stack."""
        raise GeneratorDied(self.stop_stalled(silent_s, "silent", engines))

    def stop_stalled(self, silent_s, how, engines=None):
        """Ask each stuck engine for its Python stack (SIGUSR1, see generator_main), kill
        it, and return the report."""
        import signal

        reports = []
        for i in range(self.n) if engines is None else engines:
            path = stack_file(dict(self.cfg, engine=i))
            os.kill(self.procs[i].pid, signal.SIGUSR1)
            for _ in range(50):  # written from a signal handler: milliseconds, unless the process is frozen
                time.sleep(0.1)
                if os.path.exists(path) and os.path.getsize(path) > 0:
                    time.sleep(0.2)  # let every thread's stack land
                    break
            self.procs[i].kill()
            self.procs[i].join()
            with open(path) as f:
                stack = f.read().strip() or "(no stack: the process did not answer SIGUSR1)"
            now, e = time.time(), self.last_event[i]
            last = f"{e['what']} under v{e['version']}, {now - e['t']:.0f}s ago" if e else "no activity reported"
            reports.append(
                f"{self.name(i)} stalled: alive but {how} for {silent_s:.0f}s (last message, "
                f"{self.last_msg[i][1]}: {now - self.last_msg[i][0]:.0f}s ago; last activity it "
                f"reported: {last}); stopped it. Its Python stack ({path}):\n{stack}"
            )
        self.stall_report = "\n".join(reports)
        return self.stall_report

    def check_engines(self):
        """For wait(): raise once an engine process has exited (a dead peer never fails an NCCL
        collective; push_broke names it)."""
        if any(not p.is_alive() for p in self.procs):
            raise RuntimeError("an engine of the weight group exited")

    def push_stalled(self, silent_s):
        """The push watchdog: the engines that have not joined this push (they never reached
        the load: stuck, or still draining a stuck answer) are stopped, and named; if every
        engine joined, the push itself is stuck, and all are. A push whose acknowledgement
        is in is not stuck, however long the trainer takes to settle it."""
        if self.pending and not self.pushing():
            return
        late = [i for i in range(self.n) if self.joined[i].value < self.version]
        self.stop_stalled(silent_s, "not taking new weights", late or None)

    def push(self, specs, tensors=None, rejected=0, wait=True):
        """Broadcast new weights to every engine: `specs` (weight_specs) first, then the
        tensors, in that order (or a state dict alone, both at once), and how many
        groups the trainer's pool has rejected (they no longer count as admitted). Blocks
        until every engine has joined the push: a regime that makes its engine wait (drain:
        until its answers in flight finish) holds the trainer here, waiting for the engine
        with the longest tail, idle -- part of the sync time the trainer reports. Then the
        tensors go out on the process group's threads (send_weights): with wait=False this
        returns at once, and settle() must be called before anything changes the tensors
        (train.py: before the next optimizer step); by default it settles here. Each engine
        loads them before its next engine step. A push not acknowledged within
        stall_bound() seconds means a stuck engine: a watchdog thread stops the engines that
        never joined it (push_stalled), which breaks the broadcast, and the stall report,
        naming them, is raised. Returns the new version."""
        import threading

        if tensors is None:
            specs, tensors = weight_specs(specs), specs.values()
        self.settle()
        timeout = self.stall_bound()
        self.version += 1
        for q in self.control_qs:
            q.put(("weights", self.version, specs, rejected))
        watchdog = threading.Timer(timeout, self.push_stalled, (timeout,))
        watchdog.daemon = True
        watchdog.start()
        try:
            self.pending = (
                *send_weights(
                    self.group,
                    die_test_hook(self.version, specs, tensors),
                    self.transfer_device,
                    self.check_engines,
                    self.send_budget,
                ),
                watchdog,
                specs,
            )
        except RuntimeError as e:
            self.push_broke(watchdog, e)
        if wait:
            self.settle()
        return self.version

    def pushing(self):
        """Whether a push is in flight, not yet acknowledged by every engine."""
        return bool(self.pending) and not self.pending[0]()

    def settle(self):
        """Wait for the push in flight (none: return at once) until every engine has
        acknowledged it. Returns the seconds it waited."""
        if not self.pending:
            return 0.0
        t0 = time.time()
        _, finish, watchdog, specs = self.pending
        try:
            (held, *arrived), sent, changed = finish()
        except RuntimeError as e:
            self.push_broke(watchdog, e)
        finally:
            self.pending = None
        watchdog.cancel()
        if held != self.n * self.version:
            raise RuntimeError(
                f"weight sync: the engines acknowledged versions summing to {held}, not {self.n} x v{self.version}"
            )
        if changed:  # an in-place op on a tensor in flight: settle() must come before the optimizer step
            raise RuntimeError(
                f"weight sync: {len(changed)} tensor(s) of the push for v{self.version} changed before it was "
                f"acknowledged ({specs[changed[0]][0]} first): call settle() before anything writes the weights"
            )
        if arrived != [self.n * x for x in sent]:  # every engine received every bit the trainer sent
            raise RuntimeError(
                f"weight sync: the weights that arrived for v{self.version} are not the ones sent (checksums "
                f"{arrived} summed over {self.n} engine(s), sent {sent}): a tensor changed before it went out"
            )
        return time.time() - t0

    def push_broke(self, watchdog, e):
        """A dead peer breaks the broadcast: say why it died."""
        self.broke = True
        watchdog.cancel()
        watchdog.join()  # a report being written: wait for it
        if self.stall_report:
            raise GeneratorDied(self.stall_report) from None
        dead = next((i for i, p in enumerate(self.procs) if not p.is_alive()), 0)
        self.died(dead, f" during the weight broadcast ({str(e).splitlines()[0][:200]})")

    def stop(self):
        if self.pending:  # a push never settled (the trainer is going down): its engines are stopped below
            self.pending[2].cancel()
        for q, proc in zip(self.control_qs, self.procs):
            if proc.is_alive():
                q.put(("stop",))
        for proc in self.procs:
            # after a broken push an engine may still wait in it (on NCCL, for a dead peer, until the
            # group's timeout): it reads no "stop", so it is killed at once instead of after 10 s
            proc.join(timeout=0 if self.broke else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
