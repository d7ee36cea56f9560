"""
Both ends of the weight push: the trainer (rank 0) broadcasts each tensor to the vLLM worker of
every engine (ranks 1..N), which receives it and loads it in place between two engine steps.

    trainer (rank 0) --- torch.distributed broadcast (nccl | gloo) ---> vLLM worker of engine i (rank 1+i)

The group is made with vLLM's stateless helper; the worker joins it through
`worker_extension_cls` (WeightReceiver) and `collective_rpc`. No files, no HTTP.
"""

import math
import os
import queue
import threading
import time

from system.preflight import PUSH_AHEAD_BYTES, PUSH_SEND_BYTES  # how far a push runs ahead: receive, send

SYNC_HOST = "127.0.0.1"  # the weight group's rendezvous: the engines run on trainer rank 0's machine
WEIGHT_GROUP_TIMEOUT_S = 3600  # the weight group's own timeout: above every bound of ours (init_weight_group)
POLL_S = 0.001  # the longest a wait on the weight group sleeps between two looks (wait)
ABORT_S = 10  # how long a broken wait gives the group's abort before it reports (abort)


def init_weight_group(host, port, rank, world_size, backend, listen_socket=None):
    """The group trainer (rank 0) + the vLLM worker of every engine, made with vLLM's
    stateless helper so it leaves torch.distributed's global state (vLLM's own, and the
    trainer ranks' under torchrun) alone. Rank 0 hosts the rendezvous store on a socket
    it bound itself (no race for the port, and no torchrun agent store: see
    spawn_with_env). Its timeout is explicit: the helper's default is the backend's (NCCL
    10 min, gloo 30 min), and a push's join may wait as long as its stall bound (drain; 1460 s
    measured during the CPU warm-up), past which NCCL's watchdog would abort the process
    before our watchdog could name the engine. WEIGHT_GROUP_TIMEOUT_S (1 h) is above our
    bounds, so wait() reports first. On NCCL this is the rendezvous only: the communicator is
    made by the group's first collective (first_collective)."""
    from datetime import timedelta
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host,
        port,
        rank,
        world_size=world_size,
        backend=backend,
        listen_socket=listen_socket,
        timeout=timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S),
    )


def first_collective(group, device, check):
    """The weight group's first collective, an allreduce of one zero that every rank makes right
    after the rendezvous, watched: vLLM's helper gives ProcessGroupNCCL no device_id
    (vllm/platforms/cuda.py), so NCCL makes its communicator inside the first collective, and that
    call blocks its caller until every rank has made it, for ever if one never does. So it runs on a
    thread of its own (watched) while this one runs check(), and its work is waited for as any other."""
    import torch

    zero = torch.zeros((), dtype=torch.int64, device=device)
    wait(group, watched(lambda: group.allreduce(zero), check, "weight-group-first"), check)


def watched(call, check, name):
    """call(), which blocks its caller and cannot be polled, on a thread of its own, while this one
    runs check() (it raises to give up) every 10 ms. Returns what call returned, or raises what it raised."""
    out = []

    def run():
        try:
            out.append((call(), None))
        except Exception as e:  # raised below, on the watching thread
            out.append((None, e))

    caller = threading.Thread(target=run, name=name, daemon=True)
    caller.start()
    while caller.is_alive():
        check()
        caller.join(10 * POLL_S)
    result, error = out[0]
    if error is not None:
        raise error
    return result


def wait(group, work, check):
    """Hold this thread until `work`, a collective of the weight group, has completed, on every
    backend: NCCL's work.wait() only makes the current stream wait for it, and a dead peer never
    fails an NCCL collective (it hangs until the group's timeout). So: poll is_completed() and,
    between looks, check(), which raises when a peer is gone; then the group is aborted and the
    error goes to the caller. Once completed, a work that failed raises its error after abort(); else
    work.wait() orders the current stream after the collective on NCCL (docs/reliability.md says what
    each side reports)."""
    # looks 10 us apart at first, then further, up to POLL_S: vLLM's loader takes one tensor at a time,
    # and one that arrives within microseconds is taken within microseconds, not at the next millisecond
    pause = 1e-5
    while not work.is_completed():
        try:
            check()
        except RuntimeError:
            abort(group)
            raise
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    # NCCL completes a work when it records an error, and its wait() then aborts the communicator on
    # this thread, for as long as the abort takes (ProcessGroupNCCL's WorkNCCL::wait): ours is bounded.
    # (torch 2.13 prints once per process that Work.exception() is deprecated; it is NCCL's only way to ask)
    if (error := work.exception()) is not None:
        abort(group)
        raise error
    work.wait()


def abort(group):
    """group.abort(), given at most ABORT_S: NCCL's aborts its communicators (which no collective
    queued on a dead peer would leave) and may itself wait up to the group's timeout for them
    (ProcessGroupNCCL::abort), and the caller has a report to make. Gloo has nothing to abort."""
    aborter = threading.Thread(target=group.abort, name="weight-group-abort", daemon=True)
    aborter.start()
    aborter.join(ABORT_S)


def checksum(t):
    """Two integers that change whenever a bit of `t` changes: t's bytes as int32 words, summed over
    its first half and its second, each wrapping mod 2^32 (exact, and order-free: the same bits give
    the same two numbers on a CPU and a GPU), as an int32 tensor of 2 on t's device. One kernel a tensor."""
    import torch

    # summed in int32, the words' own type: torch casts a whole copy first when the dtype differs.
    # A tensor that is not whole int32 words in two equal halves (an odd-length bf16 vector; none of
    # Qwen3's) is copied once, padded with zeros. On a GPU the kernels queue on the current stream.
    size = t.element_size()
    whole = t.numel() * size % 8 == 0 and t.dim() and t.shape[-1] * size % 4 == 0 and t.storage_offset() * size % 4 == 0
    if whole and t.is_contiguous():
        words = t.view(torch.int32)
    else:
        b = t.reshape(-1).view(torch.uint8)
        words = torch.cat([b, b.new_zeros(-len(b) % 8)]).view(torch.int32)
    return words.view(2, -1).sum(1, dtype=torch.int32)


def send_weights(group, tensors, device, check, budget=PUSH_SEND_BYTES, serial=False):
    """Post the push once every engine has joined it (every tensor broadcast from rank 0, then the
    engines' acknowledgement) without waiting for it; returns (done, finish): done() says whether the
    ack is in, finish() waits for it and returns (the ack: the versions and the checksums of what
    arrived, summed over the engines; the checksum of what was sent; the positions of the tensors
    that changed while the push was in flight)."""
    import collections
    import torch

    # every wait is wait()'s, with `check` (it raises when a peer is gone). "All here": an allreduce that
    # completes when the last engine joins; drain's wait (its answers in flight finish first) holds the trainer here
    wait(group, group.allreduce(torch.zeros((), dtype=torch.int64, device=device)), check)
    works, held = collections.deque(), 0  # (bytes, work) posted, oldest first; bytes not yet gone out and read
    # Every tensor sent must stay unchanged until finish(): with one trainer rank and the generator's dtype
    # they are the parameters themselves, which the next optimizer step overwrites. Two guards, neither on
    # the trainer's thread beyond a counter: `posted` sees a change, `sent` what arrived (settle raises on either)
    sent = torch.zeros(2, dtype=torch.int64, device=device)  # checksum() of every tensor, added up
    posted = []  # (position, tensor, its version counter when posted) of the tensors something else holds
    to_read, read = queue.SimpleQueue(), threading.Semaphore(0)  # the reader's tensors; one release per tensor read

    # the checksums, off the trainer's thread (torch's kernels release the GIL): one read of the model, ~0.07x
    # a raw broadcast on CPU, where gloo moves ~1.3 GB/s; on a GPU its launches
    def read_all():
        while (t := to_read.get()) is not None:
            sent.add_(checksum(t))
            del t  # let it go before saying it was read
            read.release()

    reader = threading.Thread(target=read_all, name="push-checksum", daemon=True)
    reader.start()

    # a tensor posted is held until it has gone out and its checksum has been read: past `budget` bytes held
    # (PUSH_SEND_BYTES; preflight.push_plan) the CPU waits for the oldest, so on NCCL too at most the budget
    # is queued, and the next step's forward is not queued behind the rest of the push
    def room(size):  # until `size` more bytes fit the budget: the oldest gone out, and read
        nonlocal held
        while works and held + size > budget:
            wait(group, works[0][1], check)
            while not read.acquire(timeout=1):  # the reader reads in posting order
                if not reader.is_alive():
                    raise RuntimeError("the push's checksum thread stopped")
            held -= works.popleft()[0]  # the work let go, and its tensor with it

    try:
        for i, t in enumerate(tensors):
            t = t.to(device).contiguous()
            size = t.numel() * t.element_size()
            room(size)
            # torch's version counter of a tensor something else holds (a parameter), which an in-place op on
            # it or a view of it bumps (the optimizer's step, a load_state_dict): compared in finish(). A copy
            # made for the push (bf16, gathered, on the host) is the push's alone, let go once it has gone out;
            # what bumps no counter is refused at start (check_guard)
            if shared(t):
                posted.append((i, t, t._version))
            # posted, not waited for: the group moves it on its own threads (gloo) or stream (NCCL) while the
            # trainer goes on; the work keeps its tensor until it completes
            works.append((size, group.broadcast(t, root=0)))
            # read after posting, the checksum may see the tensor before or after it went out: the same bytes
            # unless it changed in between, which its counter shows; so a push that arrives other than it was
            # sent raises in settle either way
            to_read.put(t)
            held += size
            # serial (several trainer ranks): the next tensor's gather runs on the trainer ranks' NCCL
            # communicator, and NCCL does not support two busy at once on one device (rank 0's): this one done first
            if serial:
                room(math.inf)
    finally:
        to_read.put(None)  # the reader ends: on an error too
    ack = torch.zeros(3, dtype=torch.int64, device=device)  # each engine's version and checksums, sent once all arrived
    works.append((0, group.allreduce(ack)))

    def finish():
        for _, work in works:
            wait(group, work, check)
        reader.join()
        return ack.tolist(), sent.tolist(), [i for i, t, v in posted if t._version != v]

    return works[-1][1].is_completed, finish


def shared(t):
    """Whether something besides `t` holds its bytes (a parameter, the caller's state dict), which may
    then change before the push is settled. torch counts a storage's owners: t, and the Python object
    that asks (inductor's cudagraph trees read the same count)."""
    import torch

    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2


def check_guard(model, opt, dtype, device):
    """The push's guard sees a write to a tensor in flight by its version counter (send_weights), where
    the push sends the parameters themselves (`dtype` and `device` are theirs: one float32 trainer rank on
    CPU); elsewhere it sends copies, which nothing writes. There, refuse in one line what bumps no counter:
    parameters made under inference_mode (they have none), and an optimizer whose step bumps none
    (AdamW(fused=True) in torch 2.13, one that writes through .data), tried on a probe of its own."""
    import inspect
    import torch
    from data import UsageError

    p = next(model.parameters())
    if hasattr(p, "full_tensor") or p.to(dtype=dtype, device=device) is not p:
        return  # FSDP2 or another dtype or device: the push sends copies
    if any(q.is_inference() for q in model.parameters()):
        raise UsageError("the model's parameters were made under torch.inference_mode: they cannot be trained")
    probe = torch.nn.Parameter(torch.zeros(2, device=p.device))
    kwargs = inspect.signature(type(opt)).parameters  # its settings, as its constructor takes them
    probe_opt = type(opt)([probe], **{k: v for k, v in opt.defaults.items() if k in kwargs})
    probe.grad, before = torch.ones_like(probe), probe._version
    probe_opt.step()
    if probe._version == before:
        raise UsageError(
            f"{type(opt).__name__}{' (fused=True)' if opt.defaults.get('fused') else ''} writes the parameters "
            "without bumping their version counters, so the weight push's guard could not see a step taken "
            "before settle(): use one that writes them in place (AdamW's default)"
        )


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
        """Join the weight group's rendezvous; `trainer`, the trainer's pid, is this process's parent (the
        worker runs in the generator process: VLLM_ENABLE_V1_MULTIPROCESSING=0, one device per
        engine), which the waits watch (wait)."""
        if os.getppid() != trainer:
            raise RuntimeError(f"vLLM's worker runs outside the generator process (its parent {os.getppid()})")
        self.weight_group = init_weight_group(host, port, rank, world_size, backend)
        self.weight_backend = backend  # the string we chose, not one read back from torch (see buffer_device)
        self.trainer = trainer

    def first_collective(self):
        """This engine's part of the weight group's first collective (first_collective: where NCCL
        makes its communicator), watching its trainer."""
        first_collective(self.weight_group, buffer_device(self.weight_backend, self.device), self.check_trainer)

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
        # No second copy of the model: vLLM's layerwise reload keeps a received tensor only until its
        # module is complete, then copies it in place (vllm/model_executor/model_loader/reload/layerwise.py).
        # A fresh buffer per tensor: a reused one would be overwritten while vLLM still holds it. Posted and
        # not yet taken: at most `ahead_bytes`, or one larger tensor (preflight.engine_plan). Posted here, on
        # the loader's thread: a receiving thread of our own needed the GIL after every tensor (lab/archive.md).
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

        self.load(received())
        if done < len(specs):  # vLLM's loader stopped taking tensors: some layers were not loaded
            raise RuntimeError(f"vLLM loaded {done} of the {len(specs)} tensors of v{version}; this engine stops")
        wait(group, ack[0], check)
        return joined

    def load(self, tensors):
        """vLLM's in-place reload from `tensors`, (name, tensor) pairs taken as they arrive: the same
        parameter storage, so CUDA graphs and the KV cache stay valid. (model.load_weights from here
        fails on CPU: "'Parameter' object has no attribute 'weight_loader'"; reload_weights goes
        through the loaders.)"""
        self.reload_weights(weights_iterator=tensors)
