"""
The trainer's handle on the generator process: spawn the engines, take what they send, push
them new weights and settle the push, stop them. What it does when an engine dies or stalls is
the watchdog's (system/watchdog.py).
"""

import os
import queue
import threading
import time
from typing import Callable, NamedTuple

from engine import as_tensors
from system.generator import generator_main
from system.preflight import PUSH_SEND_BYTES  # bytes a push may hold in flight (send_weights)
from system.push import SYNC_HOST, first_collective, init_weight_group, send_weights, watched
from system.ranks import weight_specs  # what a push sends first
from system.watchdog import GeneratorDied, Watchdog

START_TIMEOUT_S = 900  # for the engines to start (a model download, vLLM's warm-up), before the run stops
# the weight group's first collective, once every engine has come to it: NCCL makes its communicator
# there (ncclCommInitRank, seconds on one node), so one stuck this long with every rank present is
# reported now, not after the stall bound (3,102 s at gsm8k's defaults before any engine step)
FIRST_COLLECTIVE_S = 120


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


class Pending(NamedTuple):
    """A push posted and not yet settled (push with wait=False; settle)."""

    done: Callable  # whether every engine has acknowledged it
    finish: Callable  # waits for the acknowledgement: (the ack, the checksums sent, the tensors changed)
    watchdog: threading.Timer  # the push's timer thread: Watchdog.push_stalled, unless settled first
    specs: list  # (name, dtype, shape) of every tensor sent, in order


def trainer_ranks():
    """The trainer ranks in this process's default group (torchrun's: FSDP2's collectives); 1 without one.
    The weight group, made by vLLM's stateless helper, is not it."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


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
        # the last push each engine joined: the group's first collective is that of the weights it starts with
        self.joined = [ctx.Value("i", cfg["start_version"] - 1, lock=False) for _ in envs]
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
        self.watchdog = Watchdog(cfg, self.procs, self.samples_q, self.joined)  # what it reports when one fails
        self.send_budget = PUSH_SEND_BYTES  # bytes a push may hold in flight (send_weights)
        self.pending = None  # the push in flight, a Pending (push with wait=False)
        self.broke = False  # a push broke (push_broke): engines still in it wait on a dead peer
        infos = {}
        try:
            while len(infos) < self.n:
                if (msg := self.get(timeout=START_TIMEOUT_S)) is None:
                    raise self.watchdog.stalled(START_TIMEOUT_S, [i for i in range(self.n) if i not in infos])
                assert msg[0] == "engine_ready", msg[0]
                infos[msg[1]["engine"]] = msg[1]
            # the KV cache's size (preflight.check_kv_plan): the smallest engine's
            self.engine_info = min(infos.values(), key=lambda info: info["admit_at_once"])
            self.group = self.form_group(listen)
        except BaseException:  # no handle for the caller to stop: the engines left alive are stopped here,
            self.broke = True  # at once (one may wait in a collective and read no "stop"), before the report,
            self.stop()  # which they would otherwise follow with "the trainer is gone" once this process exits
            raise

    def form_group(self, listen):
        """The weight group, its rendezvous and its first collective (where NCCL makes its
        communicator: system.push.first_collective), each watched as wait() watches a push: an
        engine that exits first ends the run with its traceback (died); one alive that has not
        come to the first collective within the stall bound, with its stack (stalled); all of
        them, if all came and the collective has not completed FIRST_COLLECTIVE_S later."""
        t0, bound, all_in = time.time(), self.stall_bound(), []  # all_in: when every engine had come

        def check():
            if dead := [i for i, p in enumerate(self.procs) if not p.is_alive()]:
                raise self.watchdog.died(dead[0], " while the weight group formed")
            if not all_in and all(j.value >= self.version for j in self.joined):
                all_in.append(time.time())
            if all_in and time.time() - all_in[0] > FIRST_COLLECTIVE_S:
                how = "in the weight group's first collective with every engine (NCCL's communicator init)"
                raise GeneratorDied(self.watchdog.stop_stalled(FIRST_COLLECTIVE_S, how))
            if time.time() - t0 > bound:
                late = self.watchdog.late(self.version)
                raise GeneratorDied(self.watchdog.stop_stalled(bound, "not in the weight group", late or None))

        try:
            group = watched(
                lambda: init_weight_group(
                    SYNC_HOST, self.cfg["sync_port"], 0, 1 + self.n, self.cfg["sync_backend"], listen
                ),
                check,
                "weight-group",
            )
            first_collective(group, self.transfer_device, check)
        except GeneratorDied:
            raise
        except RuntimeError as e:  # gloo: a peer's death fails the collective, maybe before this thread sees it
            raise self.watchdog.lost(e, " while the weight group formed")
        return group

    def next(self):
        """The next (kind, item) from the generators. An engine that is alive but sends
        nothing for stall_bound() seconds is stopped, and GeneratorDied raised with its stack."""
        while True:
            bound = self.stall_bound()
            if (msg := self.get(timeout=1.0)) is not None:
                return msg
            if silent := self.watchdog.silent(bound):
                raise self.watchdog.stalled(bound, silent)

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
        raise self.watchdog.stalled(timeout, [i for i in range(self.n) if i not in results])

    def get(self, timeout):
        """Next (kind, item) from the generators, or None after `timeout` seconds."""
        deadline = time.time() + timeout
        while True:
            try:
                kind, item = self.samples_q.get(timeout=min(1.0, max(0.0, deadline - time.time())))
            except queue.Empty:
                for i, proc in enumerate(self.procs):
                    if not proc.is_alive():
                        raise self.watchdog.died(i, "")
                if time.time() >= deadline:
                    return None
                continue
            except (EOFError, OSError) as e:  # a message cut off by its sender's death
                raise self.watchdog.died(
                    next((i for i, p in enumerate(self.procs) if not p.is_alive()), 0),
                    f" ({type(e).__name__} reading its queue)",
                )
            if kind == "error":
                raise self.watchdog.died(item[0], "", {item[0]: item[1]})
            i = item if kind == "alive" else item.get("engine", 0)
            self.watchdog.heard(i, kind, item)
            if kind == "alive":
                continue
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

    def push(self, specs, tensors=None, rejected=0, wait=True):
        """Broadcast new weights to every engine: `specs` (weight_specs) first, then the tensors (or a
        state dict alone, both at once), and how many groups the trainer's pool has rejected (they no
        longer count as admitted). Returns the new version; with wait=False it returns once the tensors
        are posted, and settle() must be called before anything changes them (train.py: before the
        next optimizer step)."""
        if tensors is None:
            specs, tensors = weight_specs(specs), specs.values()
        several = trainer_ranks() > 1  # each tensor is gathered over the ranks' group as it is taken
        self.settle()
        timeout = self.stall_bound()
        self.version += 1
        for q in self.control_qs:  # each engine loads the weights before its next engine step
            q.put(("weights", self.version, specs, rejected))
        # a push not acknowledged within stall_bound() seconds means a stuck engine: this thread stops the
        # engines that never joined it, which breaks the broadcast, and the stall report, naming them, is raised
        acknowledged = lambda: self.pending is not None and self.pending.done()
        watchdog = threading.Timer(timeout, self.watchdog.push_stalled, (timeout, self.version, acknowledged))
        watchdog.daemon = True
        watchdog.start()
        try:
            # blocks until every engine has joined: a regime that makes its engine wait (drain: until its
            # answers in flight finish) holds the trainer here, idle until the engine with the longest tail
            # joins (part of the sync time the trainer reports); then the tensors go out on the process
            # group's threads
            done, finish = send_weights(
                self.group, tensors, self.transfer_device, self.watchdog.check_engines, self.send_budget, serial=several
            )
            self.pending = Pending(done, finish, watchdog, specs)
        except RuntimeError as e:
            raise self.push_broke(watchdog, e)
        # several trainer ranks settle here whatever `wait` says: the next step's FSDP2 collectives would run
        # beside this push's broadcasts on rank 0's GPU, two NCCL communicators busy at once, which NCCL does
        # not support
        if wait or several:
            self.settle()
        return self.version

    def push_broke(self, watchdog, e):
        """A dead peer broke the broadcast (`e`): the error that says why, for the caller to raise."""
        self.broke = True  # engines still in the push wait on a dead peer: stop() kills them at once
        watchdog.cancel()
        watchdog.join()  # a report being written: wait for it
        return self.watchdog.push_broke(e, f" during the weight broadcast of v{self.version}")

    def pushing(self):
        """Whether a push is in flight, not yet acknowledged by every engine."""
        return self.pending is not None and not self.pending.done()

    def stall_bound(self):
        """Seconds an engine may stay silent before we call it stuck (Watchdog.stall_bound)."""
        return self.watchdog.stall_bound(self.engine_stats)

    def settle(self):
        """Wait for the push in flight (none: return at once) until every engine has
        acknowledged it. Returns the seconds it waited."""
        if self.pending is None:
            return 0.0
        t0 = time.time()
        push = self.pending
        try:
            (held, *arrived), sent, changed = push.finish()
        except RuntimeError as e:
            raise self.push_broke(push.watchdog, e)
        finally:
            self.pending = None
        push.watchdog.cancel()
        if held != self.n * self.version:
            raise RuntimeError(
                f"weight sync: the engines acknowledged versions summing to {held}, not {self.n} x v{self.version}"
            )
        if changed:  # an in-place op on a tensor in flight: settle() must come before the optimizer step
            raise RuntimeError(
                f"weight sync: {len(changed)} tensor(s) of the push for v{self.version} changed before it was "
                f"acknowledged ({push.specs[changed[0]][0]} first): call settle() before anything writes the weights"
            )
        if arrived != [self.n * x for x in sent]:  # every engine received every bit the trainer sent
            raise RuntimeError(
                f"weight sync: the weights that arrived for v{self.version} are not the ones sent (checksums "
                f"{arrived} summed over {self.n} engine(s), sent {sent}): a tensor changed before it went out"
            )
        return time.time() - t0

    def stop(self):
        if self.pending is not None:  # a push never settled (the trainer is going down): its engines are stopped below
            self.pending.watchdog.cancel()
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
