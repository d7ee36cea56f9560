"""
Faults for the reliability tests, put into the real programs from outside: nothing in the
project reads them. Run a program under faults as a user runs it, with this file in front:

    python tests/faults.py --stall-at-step 60 -- train.py --steps 1000 ...
    python tests/faults.py --nccl -- tools/gpu_check.py --model tiny ...

In this process (the trainer) the faults are patched in before the program runs (runpy, as
`python train.py` runs it: its __main__ block, its signal handlers, config.run); they reach
every process it spawns through the one function the trainer spawns with
(system.handle.spawn_with_env: the generator, bench_sync's raw receiver), whose target is
wrapped in `child`, and every Python program it runs (gpu_check's train.py and bench_sync.py)
through this file again. Tests that start a generator in their own process call `install`.
"""

import functools
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = dict(
    nccl=False,  # the weight group's collectives as NCCL's on a GPU (NcclGroup), in every process
    hang_in_connect=False,  # ... whose first collective (NCCL's communicator init) hangs once every rank came
    first_collective_s=0,  # the trainer's bound on that (system.handle.FIRST_COLLECTIVE_S), if not 0
    one_communicator=None,  # a file: no trainer-ranks collective beside a pending weight-group work (OneCommunicator)
    log_posts=None,  # a file: a line per collective each NcclGroup posts ("rank kind")
    stall_at_step=0,  # an engine hangs before its N-th engine step
    stall_at_push=0,  # ... before it joins the push of version V
    stall_in_group=None,  # ... "before" or "after" the weight group's rendezvous (after: before its first collective)
    die_in_group=False,  # an engine kills itself (-9) after the rendezvous, before the first collective
    engine=None,  # the faults above in engine i alone (None: every engine)
    engine_dies_in_push=0,  # an engine kills itself once it has received half the tensors of the push of V
    die_in_push=0,  # the trainer kills itself once it has sent half the tensors of the push of V
)


def hang_forever():
    """Alive and silent, as a stuck engine or a deadlocked worker is (its stack names this)."""
    while True:
        time.sleep(3600)


def die_halfway(tensors, n):
    """`tensors` (n of them), this process killed (-9) once half have been taken."""
    for i, t in enumerate(tensors):
        if i == n // 2:
            os.kill(os.getpid(), signal.SIGKILL)
        yield t


class NcclGroup:
    """A gloo group whose collectives behave as those of ProcessGroupNCCL made as vLLM's helper
    makes it (no device_id) on a GPU:
    - the first collective makes the communicator (ncclCommInitRank, blocking): the call itself
      returns only once every rank has made its first collective, and never if one is gone or
      never comes;
    - wait() returns at once (it only orders the current stream after the collective);
    - a collective broken by a dead peer never completes (gloo's fails: "Connection closed by peer");
    - a process that exits leaves what it queued undone (gloo's would finish it first: here it ends
      at once, with 1, and its peers' collectives never complete).
    Only is_completed() says when the bytes are here. With `hang`, the first collective hangs once every
    rank has made it (an NCCL init stuck with every rank present); with `log`, each collective posted is
    a line there."""

    def __init__(self, group, hang=False, log=None):
        import atexit
        import collections

        self.group, self.connected, self.works = group, False, collections.deque()  # works maybe not done
        self.hang, self.log = hang, log
        atexit.register(self.leave)

    def leave(self):
        if any(not w.is_completed() for w in self.works):  # gloo's: still queued or under way
            os._exit(1)

    def track(self, work, kind):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{self.group.rank()} {kind}\n")
        while self.works and self.works[0].is_completed():
            self.works.popleft()
        self.works.append(work)
        return NcclWork(work)

    def connect(self):
        if not self.connected:
            import torch

            try:  # gloo's allreduce ends once every rank has made it, and fails when one is gone
                self.group.allreduce(torch.zeros(())).wait()
            except RuntimeError:
                hang_forever()
            if self.hang:
                hang_forever()
            self.connected = True

    def broadcast(self, t, root):
        self.connect()
        return self.track(self.group.broadcast(t, root=root), "broadcast")

    def allreduce(self, t):
        self.connect()
        return self.track(self.group.allreduce(t), "allreduce")

    def __getattr__(self, name):  # size(), rank(), abort(): gloo's
        return getattr(self.group, name)


class NcclWork:
    """A gloo work as NCCL's on a GPU: wait() returns at once, and a collective broken by a dead
    peer never completes; only is_completed() says when it is done. `pending`: this process's works
    not yet seen complete (on a GPU, what may still run on the weight group's communicator)."""

    pending, made = [], 0

    def __init__(self, work):
        self.work, self.seen = work, False
        NcclWork.pending.append(self)
        NcclWork.made += 1

    def is_completed(self):
        self.seen = self.seen or (self.work.is_completed() and self.work.exception() is None)
        return self.seen

    def exception(self):  # None: a broken collective never completes, and nothing asks a work before that
        return None

    def wait(self, timeout=None):
        return True if timeout is None else self.work.wait(timeout)


class OneCommunicator:
    """Trainer rank 0's rule on a GPU, checked as it runs: no collective of the trainer ranks' group
    (FSDP2's gathers and reduce-scatters, DTensor.full_tensor) while a weight-group work is pending
    (NcclWork.pending): two NCCL communicators busy at once on one device is what NCCL does not support.
    A TorchDispatchMode sees every collective issued; one that breaks the rule raises there. What it
    checked is appended to `log` at the end (a check that saw nothing proves nothing)."""

    def __init__(self, log):
        from torch.utils._python_dispatch import TorchDispatchMode

        checked = self.checked = [0]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional") and on_trainer_group(args, kwargs):
                    NcclWork.pending = [w for w in NcclWork.pending if not w.seen]  # as the trainer knows it
                    if NcclWork.pending:
                        raise RuntimeError(
                            f"{func} on the trainer ranks' group while {len(NcclWork.pending)} weight-group "
                            "work(s) are pending: two NCCL communicators at once on this device"
                        )
                    checked[0] += 1
                return func(*args, **(kwargs or {}))

        self.mode, self.log = Mode(), log

    def __enter__(self):
        self.mode.__enter__()

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        with open(self.log, "a") as f:
            rank = os.environ.get("RANK", "-")
            f.write(
                f"{os.getpid()} rank {rank}: {self.checked[0]} trainer-group collectives, {NcclWork.made} "
                "weight-group works\n"
            )


def on_trainer_group(args, kwargs):
    """Whether a c10d op's group (a ProcessGroup, or a functional collective's group name) is the default
    group, torchrun's, on which FSDP2's mesh runs: not the weight group, nor the ranks' gloo group for objects."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.ScriptObject):
            try:
                a = dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:  # a ReduceOp
                continue
        if isinstance(a, str) and a == dist.group.WORLD.group_name:
            return True
    return False


def nccl_everywhere(setattr=setattr, hang=False, log=None):
    """Every weight group this process makes is an NcclGroup (`hang`, `log`: NcclGroup's)."""
    import system.handle
    import system.push

    make = system.push.init_weight_group
    nccl = functools.wraps(make)(lambda *a, **kw: NcclGroup(make(*a, **kw), hang, log))
    setattr(system.push, "init_weight_group", nccl)
    setattr(system.handle, "init_weight_group", nccl)


def install(faults, setattr=setattr):
    """The trainer's faults in this process (`setattr`: pytest's monkeypatch.setattr undoes them),
    and what carries the engines' to every process it spawns."""
    import system.handle

    faults = dict(FAULTS, **faults)
    if faults["nccl"]:
        nccl_everywhere(setattr, faults["hang_in_connect"], faults["log_posts"])
    if faults["first_collective_s"]:
        setattr(system.handle, "FIRST_COLLECTIVE_S", faults["first_collective_s"])
    if v := faults["die_in_push"]:
        push = system.handle.GeneratorHandle.push

        def dying_push(self, specs, tensors=None, rejected=0, wait=True):
            if self.version + 1 == v:  # the push about to be made
                if tensors is None:  # a state dict
                    from system.ranks import weight_specs

                    specs, tensors = weight_specs(specs), specs.values()
                tensors = die_halfway(tensors, len(specs))
            return push(self, specs, tensors, rejected, wait)

        setattr(system.handle.GeneratorHandle, "push", dying_push)
    carry(faults, setattr)


def carry(faults, setattr=setattr):
    """Every process this one spawns (system.handle.spawn_with_env) runs under `faults` (child)."""
    import system.handle

    spawn = system.handle.spawn_with_env

    def spawn_with_faults(ctx, env, target, args, **kw):  # functools.partial pickles: the child unpickles it
        return spawn(ctx, env, functools.partial(child, faults, target), args, **kw)

    setattr(system.handle, "spawn_with_env", spawn_with_faults)


def child(faults, target, *args):
    """What a process the trainer spawned runs: the engines' faults patched in (in engine i alone
    with `engine`; the engine's from its cfg), then `target` (generator_main, bench_sync's raw
    receiver) as it was spawned."""
    engine = args[0].get("engine") if args and isinstance(args[0], dict) else None
    if faults["nccl"]:
        nccl_everywhere(hang=faults["hang_in_connect"], log=faults["log_posts"])
    carry(faults)  # and what it spawns in turn (gpu_check's check 1, in a process of its own, spawns the engines)
    if faults["engine"] is None or engine == faults["engine"]:
        engine_faults(faults)
    return target(*args)


def engine_faults(faults):
    """Patch the generator process's classes (system.generator, system.push) with `faults`."""
    from system.generator import ProcessGenerator
    from system.push import WeightReceiver

    if n := faults["stall_at_step"]:
        step, steps = ProcessGenerator.step, [0]

        def stalling_step(self):
            steps[0] += 1
            if steps[0] == n:
                hang_forever()
            return step(self)

        ProcessGenerator.step = stalling_step
    if stall_at := faults["stall_at_push"]:
        load_weights = ProcessGenerator.load_weights

        def stalling_load(self, version, weights):  # before it says it joined (joined.value)
            if version == stall_at:
                hang_forever()
            return load_weights(self, version, weights)

        ProcessGenerator.load_weights = stalling_load
    if faults["stall_in_group"] or faults["die_in_group"]:
        init = WeightReceiver.init_weight_group

        def faulty_init(self, *args):
            if faults["stall_in_group"] == "before":
                hang_forever()
            init(self, *args)  # the rendezvous: the trainer's has returned
            if faults["die_in_group"]:
                os.kill(os.getpid(), signal.SIGKILL)
            hang_forever()

        WeightReceiver.init_weight_group = faulty_init
    if dies_at := faults["engine_dies_in_push"]:
        receive = WeightReceiver.receive_weights

        def dying_receive(self, version, specs, ahead_bytes):
            if version == dies_at:  # vLLM's loader takes the tensors as they arrive: it dies halfway
                load = self.load
                self.load = lambda tensors: load(die_halfway(tensors, len(specs)))
            return receive(self, version, specs, ahead_bytes)

        WeightReceiver.receive_weights = dying_receive


def under_faults(cmd, flags):
    """A command line that runs a Python program of this project (train.py, tools/bench_sync.py, also
    under torchrun) with this file in front of it and the same `flags`; any other as it was."""
    if not isinstance(cmd, (list, tuple)) or not cmd or cmd[0] != sys.executable:
        return cmd
    i = next((i for i, a in enumerate(cmd) if str(a).endswith(".py")), None)
    if i is None or os.path.abspath(str(cmd[i])) == os.path.abspath(__file__):
        return cmd
    return [*cmd[:i], os.path.abspath(__file__), *flags, "--", *cmd[i:]]


def parse(flags):
    import argparse

    p = argparse.ArgumentParser(prog="tests/faults.py", description="run a program of the project under faults")
    p.add_argument("--nccl", action="store_true", help="the weight group's collectives as NCCL's (NcclGroup)")
    p.add_argument("--hang-in-connect", action="store_true", help="--nccl's first collective hangs, every rank in")
    p.add_argument("--first-collective-s", type=float, default=0, help="the trainer's bound on that (if not 0)")
    p.add_argument("--one-communicator", metavar="LOG", help="check no trainer-ranks collective runs beside a push")
    p.add_argument("--stall-at-step", type=int, default=0, help="an engine hangs before its N-th engine step")
    p.add_argument("--stall-at-push", type=int, default=0, help="an engine hangs before it joins the push of V")
    p.add_argument("--stall-in-group", choices=["before", "after"], help="an engine hangs at the rendezvous")
    p.add_argument("--die-in-group", action="store_true", help="an engine dies after the rendezvous")
    p.add_argument("--engine", type=int, default=None, help="the engine faults in engine I alone")
    p.add_argument("--engine-dies-in-push", type=int, default=0, help="an engine dies halfway through push V")
    p.add_argument("--die-in-push", type=int, default=0, help="the trainer dies halfway through push V")
    return vars(p.parse_args(flags))


def main(argv):
    """`flags -- program args`: the program run in this process under the faults, as Python runs it."""
    import contextlib
    import runpy
    import subprocess

    cut = argv.index("--")
    flags, (program, *args) = argv[:cut], argv[cut + 1 :]
    install(parse(flags))

    class Popen(subprocess.Popen):  # the programs it runs (gpu_check's), under the same faults
        def __init__(self, cmd, *a, **kw):
            super().__init__(under_faults(cmd, flags), *a, **kw)

    subprocess.Popen = Popen
    sys.argv = [program, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(program)))  # as `python program` puts it first
    faults = parse(flags)
    with OneCommunicator(faults["one_communicator"]) if faults["one_communicator"] else contextlib.nullcontext():
        runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # the project's modules
    import faults  # this file under its own name: what `child` is pickled as, for the spawned processes

    faults.main(sys.argv[1:])
