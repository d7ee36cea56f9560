"""
The generator process: a vLLM engine driven one step at a time, so that new
weights can land between two decode steps, and the bookkeeping that says which
weights produced each token and which KV it read.

    trainer (rank 0) --- torch.distributed broadcast (nccl | gloo) ---> vLLM worker of engine i (rank 1+i)
    trainer <--------- bounded torch.multiprocessing queue ------------ generator loop of engine i

One engine by default; --engines N starts N generator processes, each its own vLLM
engine (vLLM's advice for dense models: independent instances), one weight group.

What crosses the queue is one dict per finished answer (see Rollout.to_sample).
What the regime (regimes.py) does with the answers in flight when weights arrive
is the only thing that differs between the five regimes; this file is the rest.
"""

import os
import queue
import sys
import time
import traceback

# -----------------------------------------------------------------------------
# weight sync: trainer side (rank 0) and vLLM worker side (ranks 1..N)


def weight_specs(state_dict, dtype=None):
    """(name, dtype, shape) of every tensor, in send order. We send the state_dict,
    not named_parameters(): the latter leaves out tied weights (lm_head.weight on
    Qwen3-0.6B and the tiny model), and vLLM then keeps its load-time copy."""
    return [(k, str(dtype or v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state_dict.items()]


def init_weight_group(host, port, rank, world_size, backend, listen_socket=None):
    """The group trainer (rank 0) + the vLLM worker of every engine, made with vLLM's
    stateless helper so it leaves torch.distributed's global state (vLLM's own, and the
    trainer ranks' under torchrun) alone. Rank 0 hosts the rendezvous store on a socket
    it bound itself (no race for the port, and no torchrun agent store: see
    spawn_with_env)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size=world_size, backend=backend,
                                                          listen_socket=listen_socket)


def send_weights(group, tensors, device):
    """Broadcast every tensor from rank 0, then wait for the workers' answer: the
    sum of the versions they are loading, sent once every tensor has arrived."""
    import torch
    for t in tensors:
        group.broadcast(t.to(device).contiguous(), root=0).wait()
    ack = torch.zeros((), dtype=torch.int64, device=device)
    group.allreduce(ack).wait()
    return ack.item()


def buffer_device(backend, worker_device):
    """Where the worker receives a broadcast: nccl moves GPU tensors, gloo CPU tensors
    (also for one shared GPU, where NCCL refuses two ranks on the same device). Decided
    on the backend string preflight.resolve_devices chose: torch's ProcessGroup.name()
    answers lowercase "nccl"/"gloo", so a test against "NCCL" sent CPU buffers into
    an NCCL broadcast (test_generator.py::test_buffer_device_follows_backend)."""
    return worker_device if backend == "nccl" else "cpu"


class WeightReceiver:
    """vLLM worker extension (`worker_extension_cls`): these methods run inside the
    vLLM worker, called through `engine.collective_rpc(name, args)`."""

    def init_weight_group(self, host, port, rank, world_size, backend):
        self.weight_group = init_weight_group(host, port, rank, world_size, backend)
        self.weight_backend = backend  # the string we chose, not one read back from torch (see buffer_device)

    def receive_weights(self, version, specs):
        import torch
        device = buffer_device(self.weight_backend, self.device)
        # receive everything first, acknowledge, then load: the trainer is released
        # once the bytes arrive instead of waiting, tensor by tensor, for vLLM's
        # reload (which repacks weights: most of its cost on CPU). No engine step
        # runs before this call returns, so nothing samples from a half-loaded
        # model. Costs one extra copy of the weights, kept from push to push: fresh
        # buffers each time cost a page fault per 4 KiB page they receive.
        if getattr(self, "weight_buffers", (None,))[0] != specs:
            self.weight_buffers = (specs, [(name, torch.empty(shape, dtype=getattr(torch, dtype), device=device))
                                           for name, dtype, shape in specs])
        received = self.weight_buffers[1]
        for _, t in received:
            self.weight_group.broadcast(t, root=0).wait()
        self.weight_group.allreduce(torch.tensor(version, dtype=torch.int64, device=device)).wait()
        # in-place reload: the same parameter storage, so CUDA graphs and the KV cache
        # stay valid. (model.load_weights from here fails on CPU: "'Parameter' object
        # has no attribute 'weight_loader'"; reload_weights goes through the loaders.)
        self.reload_weights(weights_iterator=iter(received))

# -----------------------------------------------------------------------------
# one answer in flight, and what the trainer gets when it finishes


class Rollout:
    """One answer being written. Per generated token: the weight version that
    sampled it, its logprob under the distribution actually sampled from, and
    whether the forward pass that produced it read KV written by older weights."""

    def __init__(self, sample_id, prompt_id, group_id, prompt_ids, max_tokens):
        self.sample_id, self.prompt_id, self.group_id = sample_id, prompt_id, group_id
        self.prompt_ids, self.max_tokens = list(prompt_ids), max_tokens
        self.tokens, self.logprobs, self.versions, self.stale = [], [], [], []
        self.kv_version = None  # weights that wrote the oldest KV this request reads (set at prefill)
        self.attempt = 0  # bumped each time the request is re-submitted to vLLM
        self.submitted = time.time()
        self.recomputed = 0  # tokens whose KV was rebuilt under newer weights
        # provenance (answers.jsonl), run-length encoded: one entry per run of engine
        # steps with the same weights, not one per token (~0.4 KB per answer in answers.jsonl)
        self.segments = []  # [t0, t1, version, n_tokens, stale]: consecutive steps that wrote tokens
        self.prefills = []  # [t0, t1, version, n_tokens, "prompt" | "recompute"]: steps that wrote KV of a prefix
        self.discarded = []  # [t, n_tokens, segments]: attempts thrown away (discard)
        self.last_step = None  # engine step that wrote the last token, to know when a run breaks

    @property
    def request_id(self):
        return f"{self.sample_id}.{self.attempt}"

    def record(self, token_ids, logprobs, version, step, t0, t1):
        """Tokens of engine step `step` (which ran from t0 to t1) under `version`. Returns
        the tokens whose KV this step rebuilt (recompute), 0 if it rebuilt none."""
        rebuilt = 0
        if self.kv_version is None:  # this step was the (unchunked) prefill
            self.kv_version = version
            kind = "recompute" if self.tokens else "prompt"
            self.prefills.append([t0, t1, version, len(self.prompt_ids) + len(self.tokens), kind])
            if self.tokens:  # counted when the prefill runs: an answer re-submitted twice before it ran, once
                rebuilt = len(self.prompt_ids) + len(self.tokens)
                self.recomputed += rebuilt
        stale, n = self.kv_version < version, len(token_ids)
        self.tokens += token_ids
        self.logprobs += logprobs
        self.versions += [version] * n
        self.stale += [stale] * n
        seg = self.segments[-1] if self.segments else None
        if seg and self.last_step == step - 1 and seg[2] == version and seg[4] == stale:
            seg[1], seg[3] = t1, seg[3] + len(token_ids)  # the run goes on: a few compares per token
        else:
            self.segments.append([t0, t1, version, len(token_ids), stale])
        self.last_step = step
        return rebuilt

    def to_sample(self, finish_reason):
        """The sample as it crosses the queue: numpy arrays, which pickle through the
        pipe; the trainer's GeneratorHandle.get makes them tensors without a copy. A
        torch tensor would cross as a shared-memory segment whose file descriptor the
        receiver fetches over a socket: ~2 ms per sample of five small tensors,
        against 0.2 ms pickled (measured), and the trainer waited on it every step."""
        import numpy as np
        finished = time.time()
        return dict(
            sample_id=self.sample_id, prompt_id=self.prompt_id, group_id=self.group_id,
            prompt_ids=np.array(self.prompt_ids, dtype=np.int32),
            token_ids=np.array(self.tokens, dtype=np.int32),
            logprobs=np.array(self.logprobs, dtype=np.float32),
            versions=np.array(self.versions, dtype=np.int32),
            stale=np.array(self.stale, dtype=bool),
            recomputed=self.recomputed, finish_reason=finish_reason,
            submitted=self.submitted, finished=finished,
            provenance=dict(admitted=self.submitted, prompt_len=len(self.prompt_ids), segments=self.segments,
                            prefills=self.prefills, discarded=self.discarded, finished=finished),
        )

    def restart(self):
        """Forget the partial answer (the discard regime); its provenance keeps what was thrown away."""
        self.discarded.append([time.time(), len(self.tokens), self.segments])
        self.tokens, self.logprobs, self.versions, self.stale = [], [], [], []
        self.segments, self.kv_version, self.last_step = [], None, None

# -----------------------------------------------------------------------------
# the engine, driven step by step


def make_engine(cfg):
    """vLLM's LLMEngine, in this process, stepped by us. Three settings make one
    step() one forward pass that has finished when step() returns, so that weights
    loaded between two step() calls are the weights of every later token:
    - VLLM_ENABLE_V1_MULTIPROCESSING=0 (set by the spawner): the engine core lives in
      this process. With the default multiprocess core, the core keeps stepping on its
      own and step() only collects outputs.
    - async_scheduling=False: on CUDA, vLLM 0.32 turns it on by default
      (vllm/config/vllm.py); the engine then keeps a queue of 2 batches and launches
      the next forward pass before step() returns, so a load between two step() calls
      would land one step late and mislabel a token's version. The CPU platform forces
      it off (vllm/platforms/cpu.py); we set it on every platform and read it back.
    - no chunked prefill: a prompt's KV is written in one step, by one version."""
    from vllm import EngineArgs, LLMEngine
    on_gpu = cfg["gen_device"].startswith("cuda")
    max_len = cfg["max_model_len"]
    args = EngineArgs(
        model=cfg["model_path"], tokenizer=cfg["model_path"], seed=cfg["seed"],
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=max_len,
        max_num_seqs=cfg["max_num_seqs"],
        async_scheduling=False,
        # prefix caching would hand KV written by old weights to *new* requests
        # (GRPO groups share prompts): off, so every request's KV is its own
        enable_prefix_caching=False,
        # unchunked prefill: a prompt's KV is written in one step, by one version. The
        # budget is tokens prefilled per step: a recompute burst re-prefills every
        # answer in flight (hundreds on GPU, where a large prefill step is cheap); on
        # CPU, what vLLM's LLM class takes there (4096; an LLMEngine's default is 2048)
        enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 16384 if on_gpu else 4096),
        # logprob of the sampled token under the distribution actually sampled
        # from (after temperature), which is the behaviour policy the trainer needs
        logprobs_mode="processed_logprobs",
        worker_extension_cls="generator.WeightReceiver",
        gpu_memory_utilization=cfg["gpu_memory_utilization"],
        num_gpu_blocks_override=cfg.get("kv_blocks_override"),  # tests: a small KV cache
        enforce_eager=not on_gpu,
        disable_log_stats=True,
    )
    engine = LLMEngine.from_engine_args(args)
    if engine.vllm_config.scheduler_config.async_scheduling is not False:
        raise RuntimeError("vLLM kept async scheduling on: weight versions would be off by one step")
    return engine


def kv_capacity(engine, max_model_len):
    """How many answers of max_model_len tokens (prompt + answer) the engine's KV cache
    holds at once. The Generator keeps at most this many requests in the engine, so
    vLLM never runs out of KV blocks and never preempts: a preempted request's KV is
    later rebuilt from scratch under whatever weights are loaded, which the per-token
    bookkeeping would not know (it is still detected: see watch_preemptions).
    Returns (answers, tokens)."""
    cache = engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks - 1  # vLLM's block pool keeps one as its null block (v1/core/block_pool.py)
    return blocks // -(-max_model_len // cache.block_size), blocks * cache.block_size


def watch_preemptions(engine, on_preempt):
    """Call on_preempt(request_id) whenever vLLM's scheduler preempts a request. The
    kv_capacity bound makes this impossible; this is the check that it stays so.
    Reaches into the in-process engine core (vLLM 0.32.0: InprocClient.engine_core
    .scheduler._preempt_request); pinned by test_generator.py::test_engine_settings_and_no_preemption."""
    scheduler = engine.engine_core.engine_core.scheduler
    preempt = scheduler._preempt_request

    def counted(request, *args, **kwargs):
        on_preempt(request.request_id)
        return preempt(request, *args, **kwargs)
    scheduler._preempt_request = counted


class Generator:
    """Owns the engine, the answers in flight and the weight version. The regime
    calls submit/abort/load_weights; everything else is bookkeeping."""

    def __init__(self, cfg, engine, problems, tokenizer, outbox):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from data import make_prompt
        self.cfg, self.engine, self.outbox = cfg, engine, outbox
        self.prompts = [tokenizer(make_prompt(tokenizer, p["question"], cfg["dataset"]),
                                  add_special_tokens=False)["input_ids"] for p in problems]
        self.answers = [p["answer"] for p in problems]  # travel with each sample, for the reward
        self.params = lambda max_tokens: SamplingParams(
            temperature=cfg["temperature"], max_tokens=max_tokens, logprobs=0,
            detokenize=False, output_kind=RequestOutputKind.DELTA)
        self.version = self.start_version = cfg["start_version"]  # > 0 when resuming
        self.inflight = {}  # request id -> Rollout
        # engine i of N writes the groups g = i mod N, from the data position on (pace.Pool.position)
        self.engine_id, engines = cfg.get("engine", 0), cfg.get("engines", 1)
        self.proc = lane(cfg)  # its lane on the timeline
        self.start_group = cfg["start_group"]
        self.next_group = self.start_group + (self.engine_id - self.start_group) % engines
        self.skip = set(cfg.get("skip_groups", ()))  # groups after it already consumed or rejected (resume)
        self.rejected = 0  # groups the trainer's pool rejected since this generator started (may_admit)
        self.admitting = True  # drain turns this off while it finishes old answers
        self.stats = dict(gen_tokens=0, gen_busy_s=0.0, gen_idle_s=0.0, discarded_tokens=0,
                          recomputed_tokens=0, loads=0, preempted=0)
        self.stats.update(cfg.get("start_stats") or {})  # resume: the run's counters at its checkpoint
        # requests in the engine at once (training + eval): at most what its KV cache holds
        self.kv_answers = min(cfg["max_num_seqs"], kv_capacity(engine, cfg["max_model_len"])[0])
        watch_preemptions(engine, self.preempted)
        self.activity = None
        self.steps = 0  # engine steps so far: a token's step number tells runs of steps apart
        self.eval_out = {}  # eval request id -> token ids (None while running)

    def set_activity(self, what):
        """Timeline entry (events.jsonl) when what the generator does changes."""
        if what != self.activity:
            self.activity = what
            self.outbox.append(("event", dict(t=time.time(), proc=self.proc, engine=self.engine_id, what=what,
                                              version=self.version)))

    def preempted(self, request_id):
        """vLLM preempted a request (see kv_capacity: it should never happen): its KV will
        be rebuilt from scratch under the weights loaded when it is rescheduled, so the
        next token's forward pass reads no older KV. Counted in metrics."""
        self.stats["preempted"] += 1
        if request_id in self.inflight:
            self.inflight[request_id].kv_version = None  # Rollout.record sets it at the rebuild

    def mark(self, kind, t0, t1, **more):
        """A moment on the timeline (events.jsonl) that is not an activity: a weight
        load from receive to loaded ("load", version = the new one), an evaluation ("eval")."""
        self.outbox.append(("event", dict(t=t1, proc=self.proc, engine=self.engine_id, mark=kind, t0=t0, t1=t1,
                                          version=self.version,
                                          **more)))

    # -- what regimes call

    def submit(self, r):
        """(Re)start a request: prompt + whatever was generated so far is prefilled."""
        r.attempt += 1
        prompt = dict(prompt_token_ids=r.prompt_ids + r.tokens)
        self.engine.add_request(r.request_id, prompt, self.params(r.max_tokens - len(r.tokens)))
        self.inflight[r.request_id] = r

    def abort_all(self):
        """Take every answer out of the engine (its KV is freed); returns them."""
        self.engine.abort_request(list(self.inflight))
        rollouts, self.inflight = list(self.inflight.values()), {}
        return rollouts

    def load_weights(self, version, specs):
        """Receive the broadcast and load it in place, between two engine steps."""
        self.set_activity("loading")
        t0 = time.time()
        self.engine.collective_rpc("receive_weights", args=(version, specs))
        t1 = time.time()
        self.version = version
        self.stats["loads"] += 1
        self.stats["load_s"] = self.stats.get("load_s", 0.0) + t1 - t0
        self.mark("load", t0, t1)

    # -- the loop's parts

    def may_admit(self):
        """AReaL's staleness bound: at most (version + max_lag + 1) batches admitted,
        not counting the groups the trainer's pool has rejected (--pool pace). The
        trainer takes groups in admission order (pace.Pool), so nothing admitted now is
        consumed more than max_lag versions after the weights that started it: this
        bounds the *generation* staleness of what is trained. A rejected group leaves
        its place to a new one, so a generator faster than the trainer keeps the pool
        above PACE's target and PACE keeps rejecting the stalest (its *waiting*
        staleness), as its abstract describes. (Counting rejected groups as admitted,
        as before, let PACE reject once and never again: after one burst the pool could
        not exceed its target; RESULTS.md, PACE.)"""
        versions = self.version - self.start_version + self.cfg["max_lag"] + 1
        budget = self.start_group + versions * self.cfg["prompts_per_step"] + self.rejected
        return (self.admitting and self.next_group < budget and len(self.outbox) < self.cfg["queue_size"]
                and len(self.inflight) + self.cfg["group_size"] <= self.kv_answers)

    def admit(self):
        while self.may_admit():
            g = self.next_group
            self.next_group += self.cfg.get("engines", 1)
            if g in self.skip:  # consumed or rejected before the run was resumed
                continue
            pid = g % len(self.prompts)  # the problem list is already shuffled
            for i in range(self.cfg["group_size"]):
                self.submit(Rollout(f"{g}-{i}", pid, g, self.prompts[pid], self.cfg["max_new_tokens"]))

    def step(self):
        """One engine step; finished answers go to the outbox."""
        t0 = time.time()
        outputs = self.engine.step()
        t1, self.steps = time.time(), self.steps + 1
        inflight, version, step = self.inflight, self.version, self.steps  # locals: this loop runs per answer per step
        tokens = rebuilt = 0
        for out in outputs:
            if out.request_id in self.eval_out:  # FINAL_ONLY: one output, when it is done
                self.eval_out[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
                continue
            r = inflight.get(out.request_id)
            if r is None:  # output of a request aborted this step
                continue
            c = out.outputs[0]
            ids = c.token_ids
            rebuilt += r.record(ids, [d[t].logprob for t, d in zip(ids, c.logprobs)], version, step, t0, t1)
            tokens += len(ids)
            if out.finished:
                del inflight[out.request_id]
                sample = r.to_sample(c.finish_reason)
                sample["answer"], sample["engine"] = self.answers[r.prompt_id], self.engine_id
                self.outbox.append(("sample", sample))
        self.stats["gen_tokens"] += tokens
        self.stats["recomputed_tokens"] += rebuilt
        self.stats["gen_busy_s"] += time.time() - t0

    def evaluate(self, prompts, max_tokens):
        """Greedy answers under the weights loaded now, as (token ids, finish reason)
        ("stop" or "length": cut at max_tokens). Training answers in flight share these
        steps; no weights load until the evaluation is done, so their bookkeeping is
        unaffected."""
        from tqdm import tqdm
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.set_activity("evaluating")
        t0 = time.time()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        ids = [f"eval{self.version}-{i}" for i in range(len(prompts))]
        todo, self.eval_out = list(zip(ids, prompts)), {}  # eval id -> (token ids, reason), None while running
        with tqdm(total=len(ids), desc=f"eval v{self.version}", leave=False) as bar:
            while todo or None in self.eval_out.values():
                # add eval requests only while the KV cache has room for them (kv_capacity)
                room = self.kv_answers - len(self.inflight) - sum(v is None for v in self.eval_out.values())
                for rid, p in todo[:max(0, room)]:
                    self.eval_out[rid] = None
                    self.engine.add_request(rid, dict(prompt_token_ids=p), params)
                todo = todo[max(0, room):]
                self.step()
                bar.update(sum(v is not None for v in self.eval_out.values()) - bar.n)
        results, self.eval_out = [self.eval_out[i] for i in ids], {}
        self.mark("eval", t0, time.time(), n=len(ids))
        return results

# -----------------------------------------------------------------------------
# the process


def keep_to_gen_cores():
    """On CPU, pin every thread of this process to the generator's cores
    (INFLIGHT_GEN_CORES, from preflight.resolve_devices). vLLM's VLLM_CPU_OMP_THREADS_BIND binds
    only the workers its multiprocess executor spawns, not an in-process engine, and
    a spawned child inherits the trainer's cores: both ran on one core."""
    if cores := os.environ.get("INFLIGHT_GEN_CORES"):
        for tid in os.listdir("/proc/self/task"):  # every thread started so far
            os.sched_setaffinity(int(tid), [int(c) for c in cores.split(",")])


def lane(cfg):
    """The engine's name in events, answers.jsonl and its files: "generator", or
    "generator<i>" when there are several."""
    return "generator" if cfg.get("engines", 1) == 1 else f"generator{cfg.get('engine', 0)}"


def stack_file(cfg):
    """Where the generator writes its Python stack when the trainer sends SIGUSR1."""
    return os.path.join(cfg["out"], f"{lane(cfg)}-stack.txt")


def generator_main(cfg, samples_q, control_q):
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
    faulthandler.register(signal.SIGUSR1, file=open(stack_file(cfg), "w"), all_threads=True)
    # tqdm's bars (vLLM's, the evaluation's) take a multiprocessing lock: a named semaphore
    # that this process, when the trainer has to kill it, would leave behind ("resource_tracker:
    # There appear to be 1 leaked semaphore objects"). A thread lock does, in one process.
    import threading
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())
    try:
        run_generator(cfg, samples_q, control_q, trainer=os.getppid())
    except KeyboardInterrupt:  # Ctrl-C reaches both processes; the trainer reports it
        samples_q.cancel_join_thread()  # exit now: the trainer may have stopped reading
    except BaseException:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)  # in the log even if the trainer is gone
        samples_q.put(("error", (cfg.get("engine", 0), tb)))
        flush(samples_q, timeout=10)
        raise SystemExit(1)


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


def run_generator(cfg, samples_q, control_q, trainer):
    import collections
    import random
    import torch
    from transformers import AutoTokenizer
    from data import load_problems
    from regimes import make_regime
    torch.set_num_threads(cfg["gen_threads"])
    regime = make_regime(cfg["regime"])
    if getattr(regime, "max_lag", None) is not None:
        cfg = dict(cfg, max_lag=regime.max_lag)
    problems = load_problems(cfg["dataset"], "train", data_file=cfg.get("data_file"), steps=cfg["synth_steps"])
    random.Random(cfg["seed"]).shuffle(problems)
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    engine = make_engine(cfg)
    outbox = []
    gen = Generator(cfg, engine, problems, tokenizer, outbox)
    kv_answers, kv_tokens = kv_capacity(engine, cfg["max_model_len"])
    samples_q.put(("engine_ready", dict(engine=gen.engine_id, kv_answers=kv_answers, kv_tokens=kv_tokens,
                                        admit_at_once=gen.kv_answers)))
    engine.collective_rpc("init_weight_group", args=(cfg["sync_host"], cfg["sync_port"], 1 + gen.engine_id,
                                                     1 + cfg.get("engines", 1), cfg["sync_backend"]))
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
            outbox.append(("eval", dict(engine=gen.engine_id, version=gen.version,
                                        answers=gen.evaluate(prompts, max_tokens))))
        gen.admit()
        idle = not gen.inflight
        if idle:  # nothing to do: wait for weights (sync, max-lag) or for the trainer to drain the queue
            gen.set_activity("idle")
        else:
            gen.set_activity("draining" if not gen.admitting else "generating")
            stall_test_hook(steps := steps + 1)
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


def stall_test_hook(step):
    """TEST HOOK (test_reliability.py): with INFLIGHT_TEST_STALL_AT_STEP=N in the
    environment, the generator hangs forever before its N-th engine step, alive and
    silent, as a stuck engine or a deadlocked worker would."""
    if step == int(os.environ.get("INFLIGHT_TEST_STALL_AT_STEP", 0)):
        while True:
            time.sleep(3600)

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
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class GeneratorHandle:
    """Trainer side: spawns the generator engines (one by default), pushes weights to
    all of them at once, receives their samples and events on one queue, and turns any
    death of an engine into an exception that carries its own traceback."""

    def __init__(self, cfg, envs):
        """envs: one environment per engine (preflight.resolve_devices)."""
        import socket
        import torch.multiprocessing as mp
        self.n = len(envs)
        listen = socket.socket()  # the weight group's store: this port, bound here, handed to vLLM's helper
        listen.bind((cfg["sync_host"], 0))
        listen.listen()
        cfg = dict(cfg, sync_port=listen.getsockname()[1], engines=self.n)
        ctx = mp.get_context("spawn")  # vLLM and CUDA do not survive fork
        self.samples_q = ctx.Queue(maxsize=cfg["queue_size"])  # bounded: back-pressure; one for all engines
        self.control_qs = [ctx.Queue() for _ in envs]
        self.procs = [spawn_with_env(ctx, {**dict.fromkeys(TORCHRUN_ENV), **env}, generator_main,
                                     (dict(cfg, engine=i, start_stats=cfg.get("start_stats") if i == 0 else None),
                                      self.samples_q, self.control_qs[i]),
                                     daemon=True, name=f"inflight-generator{i}")
                      for i, env in enumerate(envs)]
        self.cfg, self.version = cfg, cfg["start_version"]
        self.stats = dict(cfg.get("start_stats") or {})  # the generators' counters (summed), as samples carry them
        self.engine_stats = [dict(self.stats) if i == 0 else {} for i in range(self.n)]
        self.transfer_device = cfg["train_device"] if cfg["sync_backend"] == "nccl" else "cpu"
        self.last_seen = [time.time()] * self.n  # when each engine last sent anything (stall watchdog)
        self.last_msg, self.last_event = [(time.time(), "nothing yet")] * self.n, [None] * self.n
        self.stall_report = None
        infos = {}
        while len(infos) < self.n:
            if (msg := self.get(timeout=cfg["start_timeout"])) is None:
                self.stalled(cfg["start_timeout"], [i for i in range(self.n) if i not in infos])
            assert msg[0] == "engine_ready", msg[0]
            infos[msg[1]["engine"]] = msg[1]
        # the KV cache's size (preflight.check_kv_plan): the smallest engine's
        self.engine_info = min(infos.values(), key=lambda info: info["admit_at_once"])
        self.group = init_weight_group(cfg["sync_host"], cfg["sync_port"], 0, 1 + self.n, cfg["sync_backend"],
                                       listen_socket=listen)

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
        chunks = [prompts[i * size:(i + 1) * size] for i in range(self.n)]
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
        import numpy as np
        import torch
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
                self.died(next((i for i, p in enumerate(self.procs) if not p.is_alive()), 0),
                          f" ({type(e).__name__} reading its queue)")
            if kind == "error":
                raise GeneratorDied(f"{self.name(item[0])} process failed:\n" + item[1])
            i = item if kind == "alive" else item.get("engine", 0)
            self.last_seen[i] = time.time()
            if kind == "alive":
                continue
            self.last_msg[i] = (time.time(), kind)
            if kind == "event":
                self.last_event[i] = item
            if kind == "sample":  # numpy arrays (Rollout.to_sample) -> tensors, sharing their memory
                item = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in item.items()}
                self.engine_stats[i] = item["gen_stats"]
                self.stats = {k: sum(s.get(k, 0) for s in self.engine_stats) for k in item["gen_stats"]
                              if k not in ("version", "max_step_s")}
                self.stats["max_step_s"] = max(s.get("max_step_s", 0.0) for s in self.engine_stats)
            return kind, item

    def died(self, i, how):
        """Raise GeneratorDied with the engine's own traceback when it sent one."""
        self.procs[i].join(timeout=5)
        while True:
            try:
                kind, item = self.samples_q.get(timeout=0.5)
            except queue.Empty:
                break
            except (EOFError, OSError):
                continue
            if kind == "error":
                raise GeneratorDied(f"{self.name(item[0])} process failed:\n" + item[1])
        raise GeneratorDied(f"{self.name(i)} process died{how} (exit code {self.procs[i].exitcode})")

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
            last = (f"{e['what']} under v{e['version']}, {now - e['t']:.0f}s ago" if e else "no activity reported")
            reports.append(f"{self.name(i)} stalled: alive but {how} for {silent_s:.0f}s (last message, "
                           f"{self.last_msg[i][1]}: {now - self.last_msg[i][0]:.0f}s ago; last activity it "
                           f"reported: {last}); stopped it. Its Python stack ({path}):\n{stack}")
        self.stall_report = "\n".join(reports)
        return self.stall_report

    def push(self, specs, tensors=None, rejected=0):
        """Broadcast new weights to every engine: `specs` (weight_specs) first, then the
        tensors, in that order (or a state dict alone, both at once), and how many
        groups the trainer's pool has rejected (they no longer count as admitted); returns once every engine has received them (each loads
        them before its next engine step). Blocks while a regime makes its engine wait
        (drain: until its answers in flight finish: the broadcast is collective, so every
        engine waits for the one with the longest tail) -- that wait is part of the sync
        time the trainer reports. A push not acknowledged within stall_bound() seconds
        means a stuck engine: a watchdog thread stops them, which breaks the broadcast,
        and the stall report is raised."""
        import threading
        if tensors is None:
            specs, tensors = weight_specs(specs), specs.values()
        timeout = self.stall_bound()
        self.version += 1
        for q in self.control_qs:
            q.put(("weights", self.version, specs, rejected))
        watchdog = threading.Timer(timeout, self.stop_stalled, (timeout, "not taking new weights"))
        watchdog.daemon = True
        watchdog.start()
        try:
            held = send_weights(self.group, tensors, self.transfer_device)
        except RuntimeError as e:  # a dead peer breaks the broadcast: say why it died
            watchdog.cancel()
            watchdog.join()  # a report being written: wait for it
            if self.stall_report:
                raise GeneratorDied(self.stall_report) from None
            dead = next((i for i, p in enumerate(self.procs) if not p.is_alive()), 0)
            self.died(dead, f" during the weight broadcast ({str(e).splitlines()[0][:200]})")
        watchdog.cancel()
        if held != self.n * self.version:
            raise RuntimeError(f"weight sync: the engines acknowledged versions summing to {held}, "
                               f"not {self.n} x v{self.version}")
        return self.version

    def stop(self):
        for q, proc in zip(self.control_qs, self.procs):
            if proc.is_alive():
                q.put(("stop",))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
