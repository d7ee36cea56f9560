"""
The generator process: engine.py's Generator (a vLLM engine stepped one decode step at a time,
and the per-token bookkeeping) run in a process of its own, beside the trainer: weights arrive
by broadcast (system/push.py), finished answers leave by a bounded queue.

    trainer <--------- bounded torch.multiprocessing queue ------------ generator loop of engine i

One engine by default; --engines N starts N generator processes, each its own vLLM engine (vLLM's
advice for dense models: independent instances), one weight group. What crosses the queue is one
dict per finished answer (engine.Rollout.to_sample). lesson.py runs the same Generator and
regimes in one process, on a simulated clock; this is what real concurrency adds.
"""

import os
import queue
import sys
import time
import traceback

from engine import Generator, WallClock, kv_capacity, lane, make_engine
from system.preflight import PUSH_AHEAD_BYTES
from system.push import SYNC_HOST, receive_broadcast
from system.runlog import StepLog


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
        clock=None,
    ):
        super().__init__(cfg, engine, problems, tokenizer, outbox, clock, receive=receive)
        self.engine_id, self.engines, self.queue_size = engine_id, engines, queue_size
        self.proc = lane(engine_id, engines)
        self.version = self.start_version = start_version  # > 0 when resuming
        self.start_group = start_group
        self.next_group = start_group + (engine_id - start_group) % engines
        self.skip = set(skip_groups)
        self.rejected = 0  # groups the trainer's pool rejected since this generator started
        self.stats.update(start_stats or {})  # resume: the run's counters at its checkpoint

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
    engine = make_engine(cfg, worker_extension="system.push.WeightReceiver")
    outbox = []

    def receive(engine, version, specs):
        """Generator.receive: say that this engine joins the push of `version` (the trainer's
        watchdog then knows which engines never came), then take the broadcast."""
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
        clock=WallClock(StepLog(os.path.join(cfg["out"], f"{lane(cfg['engine'], cfg['engines'])}-steps.jsonl"))),
    )
    kv_answers, kv_tokens = kv_capacity(engine, cfg["max_model_len"])
    samples_q.put(
        (
            "engine_ready",
            dict(engine=gen.engine_id, kv_answers=kv_answers, kv_tokens=kv_tokens, admit_at_once=gen.kv_answers),
        )
    )
    engine.collective_rpc(  # the weight group: its rendezvous, then its first collective (system.push.first_collective)
        "init_weight_group",
        args=(SYNC_HOST, cfg["sync_port"], 1 + gen.engine_id, 1 + cfg.get("engines", 1), cfg["sync_backend"], trainer),
    )
    joined.value = cfg["start_version"]  # in the group's first collective: the push of the weights it starts with
    engine.collective_rpc("first_collective")
    pending, evals = None, []  # weights being broadcast (version, specs); eval requests
    idle, recent = False, collections.deque(maxlen=256)  # recent: engine step times, s
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
                    gen.clock.log.flush()
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
