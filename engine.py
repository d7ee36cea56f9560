"""
The generator's engine, driven one decode step at a time: what lesson.py drives in
its own process and system/generator.py drives in the generator process.

A vLLM engine in this process (make_engine), stepped by us, so that new weights can
land between two decode steps; the answers in flight, each a Rollout that records,
per token, the weights that sampled it and whether it read KV written by older
weights; admission under --max-lag; submit / abort / load for the regimes
(regimes.py). No processes, queues or clocks of its own: what the Generator finishes
goes to a list (the outbox), and the time it reads comes from a clock it is given
(WallClock in the generator process, lesson.SimClock in the lesson).
"""

import logging
import os
import time
import warnings

# quiet: two things vLLM's import prints on every CPU machine, about neither the run nor its results (its Triton
# has no CPU backend; its kernel dispatcher touches torch's deprecated reduce_op); vLLM's own loading bar: below
logging.getLogger("vllm.triton_utils.importing").addFilter(lambda r: "include CPU backend" not in r.getMessage())
warnings.filterwarnings("ignore", message=r".*\.reduce_op` is deprecated")


class WallClock:
    """Real time, for the generator process: the work itself takes the time, so spend() has
    nothing to add; it notes each engine step, with what the engine held, in `log` (the run's
    generator-steps.jsonl: what tools/clock_costs.py fits lesson.SimClock's costs to)."""

    def __init__(self, log=None):
        self.log = log

    def now(self):
        return time.time()

    def spend(self, work, t0=None, **held):
        if self.log is not None and work == "step":
            self.log.write(t0, time.time(), **held)


# -----------------------------------------------------------------------------
# one answer in flight, and what the trainer gets when it finishes


class Rollout:
    """One answer being written. Per generated token: the weight version that
    sampled it, its logprob under the distribution actually sampled from, and
    whether the forward pass that produced it read KV written by older weights."""

    def __init__(self, sample_id, prompt_id, group_id, prompt_ids, max_tokens, now):
        self.sample_id, self.prompt_id, self.group_id = sample_id, prompt_id, group_id
        self.prompt_ids, self.max_tokens = list(prompt_ids), max_tokens
        self.tokens, self.logprobs, self.versions, self.stale = [], [], [], []
        self.kv_version = None  # weights that wrote the oldest KV this request reads (set at prefill)
        self.attempt = 0  # bumped each time the request is re-submitted to vLLM
        self.submitted = now
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

    def prefill_tokens(self):
        """Tokens whose KV the request's next engine step writes in one go: its prompt +
        partial answer when that step is its (re)fill, else 0 (a decode step)."""
        return len(self.prompt_ids) + len(self.tokens) if self.kv_version is None else 0

    def record(self, token_ids, logprobs, version, step, t0, t1):
        """Tokens of engine step `step` (which ran from t0 to t1) under `version`. Returns
        the tokens whose KV this step rebuilt (recompute), 0 if it rebuilt none."""
        rebuilt = 0
        if self.kv_version is None:  # this step was the (unchunked) prefill: `version` wrote all the KV
            self.kv_version = version
            if self.tokens:  # prompt + partial answer prefilled again (counted when it runs, so once)
                rebuilt = len(self.prompt_ids) + len(self.tokens)
                self.recomputed += rebuilt
            self.note_prefill(t0, t1, version)
        # the stale flag: these tokens were sampled by `version` attending to KV that older weights wrote
        stale, n = self.kv_version < version, len(token_ids)
        self.tokens += token_ids
        self.logprobs += logprobs
        self.versions += [version] * n
        self.stale += [stale] * n
        self.note_tokens(n, version, stale, step, t0, t1)
        return rebuilt

    def note_prefill(self, t0, t1, version):
        """Provenance (answers.jsonl): a step that wrote the KV of a prefix, the prompt's or a rebuild's."""
        kind = "recompute" if self.tokens else "prompt"
        self.prefills.append([t0, t1, version, len(self.prompt_ids) + len(self.tokens), kind])

    def note_tokens(self, n, version, stale, step, t0, t1):
        """Provenance: n tokens of engine step `step`, run-length encoded: the segment goes on while
        consecutive steps write tokens of the same version and staleness (a few compares per token)."""
        seg = self.segments[-1] if self.segments else None
        if seg and self.last_step == step - 1 and seg[2] == version and seg[4] == stale:
            seg[1], seg[3] = t1, seg[3] + n
        else:
            self.segments.append([t0, t1, version, n, stale])
        self.last_step = step

    def to_sample(self, finish_reason, now):
        """The finished answer, as the trainer gets it: numpy arrays, which pickle through
        the generator process's queue (a torch tensor would cross as a shared-memory
        segment whose file descriptor the receiver fetches over a socket: ~2 ms per
        sample of five small tensors, against 0.2 ms pickled, measured). The trainer
        makes them tensors without a copy."""
        import numpy as np

        return dict(
            sample_id=self.sample_id,
            prompt_id=self.prompt_id,
            group_id=self.group_id,
            prompt_ids=np.array(self.prompt_ids, dtype=np.int32),
            token_ids=np.array(self.tokens, dtype=np.int32),
            logprobs=np.array(self.logprobs, dtype=np.float32),
            versions=np.array(self.versions, dtype=np.int32),
            stale=np.array(self.stale, dtype=bool),
            recomputed=self.recomputed,
            finish_reason=finish_reason,
            submitted=self.submitted,
            finished=now,
            provenance=dict(
                admitted=self.submitted,
                prompt_len=len(self.prompt_ids),
                segments=self.segments,
                prefills=self.prefills,
                discarded=self.discarded,
                finished=now,
            ),
        )

    def restart(self, now):
        """Forget the partial answer (the discard regime); its provenance keeps what was thrown away."""
        self.discarded.append([now, len(self.tokens), self.segments])
        self.tokens, self.logprobs, self.versions, self.stale = [], [], [], []
        self.segments, self.kv_version, self.last_step = [], None, None


def as_tensors(sample):
    """A finished answer's numpy arrays (Rollout.to_sample) as torch tensors, sharing their memory:
    what the trainer puts in its pool (lesson.py; system.handle.GeneratorHandle, off the queue)."""
    import numpy as np
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in sample.items()}


# -----------------------------------------------------------------------------
# the engine, driven step by step

KV_CACHE_GIB = 1  # vLLM's KV cache on CPU: plenty for the tiny models, and leaves RAM for the trainer


def vllm_env(on_cpu=True):
    """The environment every vLLM engine of this project starts with, set before vLLM is imported (lesson.py
    and eval.py in their own, devices.resolve_devices in each generator process's); one already set wins."""
    env = {
        # the engine core in this process: with its own process the core keeps stepping on its own and step()
        # only collects outputs, so weights loaded between two step() calls would not be those of every later token
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # vLLM 0.32 runs its Model Runner V2 wherever triton works (every CUDA machine) and V1 elsewhere (the CPU:
        # CPUModelRunner derives from V1's GPUModelRunner). Everything checked here on a real engine (the in-place
        # reload between two steps, a step finished when step() returns, logprobs, preemption counts) ran on V1,
        # none of it on V2: V1 on every platform, read back by check_engine_config
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),  # quiet: it logs every weight load
    }
    if on_cpu:  # without it vLLM asks for 92% of the node's memory and refuses to start when others hold some
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    return env


def make_engine(cfg, worker_extension=None):
    """vLLM's LLMEngine in this process, stepped by us: one step() is one forward pass, finished when it returns."""
    from vllm import EngineArgs, LLMEngine

    on_gpu = cfg.get("engine_device", "cpu").startswith("cuda")  # this engine's (devices.resolve_devices)
    max_len = cfg["max_model_len"]
    args = EngineArgs(
        model=cfg["model_path"],
        tokenizer=cfg["model_path"],
        seed=cfg["seed"],
        # on CPU the trainer's float32, which vLLM's "auto" would cast to bfloat16: other weights than it trains
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=max_len,
        max_num_seqs=cfg["max_num_seqs"],
        # on CUDA vLLM 0.32 turns it on (vllm/config/vllm.py; the CPU platform forces it off, vllm/platforms/cpu.py)
        # and launches the next forward pass before step() returns: weights loaded between two step() calls would
        # land one step late and mislabel a token's version. Off on every platform, read back by check_engine_config
        async_scheduling=False,
        # prefix caching would hand KV written by old weights to *new* requests (GRPO groups share prompts)
        enable_prefix_caching=False,
        enable_chunked_prefill=False,  # a prompt's KV is written in one step, so by one version
        # tokens prefilled per step: a recompute burst re-prefills every answer in flight (hundreds on GPU, where a
        # large prefill step is cheap); on CPU what vLLM's LLM class takes (4096; an LLMEngine's default is 2048)
        max_num_batched_tokens=max(max_len, 16384 if on_gpu else 4096),
        # the logprob of the sampled token under the distribution it was sampled from (after temperature): the
        # behaviour policy the trainer's importance weights need
        logprobs_mode="processed_logprobs",
        worker_extension_cls=worker_extension or "",  # system.push.WeightReceiver receives pushed weights there
        gpu_memory_utilization=cfg.get("gen_memory_utilization") or 0.9,  # devices.resolve_devices'; unused on CPU
        enforce_eager=not on_gpu,  # on CPU the model runs uncompiled, as the sampler below: no compile at each start
        disable_log_stats=True,  # quiet: the run's own log says what a step did
        use_tqdm_on_load=False,  # and its bar for a load of weights from disk, a second at the start
    )
    if not on_gpu:
        # nothing compiled on CPU: enforce_eager leaves the model eager, and this leaves eager the
        # one function vLLM's sampler still torch.compiles (the sampled token's rank,
        # v1/sample/ops/logprobs.py), which cost 2-9 s of C++ compilation at the first step of
        # every process that starts an engine; eager counts the same integers. For the process.
        import torch

        torch.compiler.set_stance("force_eager")
    engine = LLMEngine.from_engine_args(args)
    check_engine_config(engine.vllm_config)
    return engine


def check_engine_config(vllm_config):
    """make_engine's settings, read back from the config the engine runs with: raises if vLLM
    kept async scheduling on or picked its Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER not "0"
    in the environment vLLM read: vllm_env was not applied before it started)."""
    if vllm_config.scheduler_config.async_scheduling is not False:
        raise RuntimeError("vLLM kept async scheduling on: weight versions would be off by one step")
    if vllm_config.use_v2_model_runner:
        raise RuntimeError(
            "vLLM picked its Model Runner V2, which this project has not run: start the engine "
            "with engine.vllm_env's VLLM_USE_V2_MODEL_RUNNER=0"
        )


def load_in_place(engine, version, state_dict):
    """New weights into an engine whose worker runs in this process (lesson.py): vLLM's
    in-place reload, from the trainer's state_dict (not named_parameters(): that leaves
    out the tied lm_head.weight, and vLLM would keep its load-time copy). In place: the
    same parameter storage, so the KV cache stays valid and keeps what older weights wrote."""
    engine.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(state_dict.items())))


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


def lane(engine_id=0, engines=1):
    """The engine's name in events, answers.jsonl and its files: "generator", or
    "generator<i>" when there are several."""
    return "generator" if engines == 1 else f"generator{engine_id}"


class Generator:
    """Owns the engine, the answers in flight and the weight version. The regime
    calls submit/abort_all/load_weights; everything else is bookkeeping.

    cfg: the run's settings (config.fill): the task, sampling, the batch, --max-lag.
    outbox: a list the Generator appends to, ("sample", finished answer) and ("event",
    timeline entry); whoever drives it empties it. clock: what it reads the time from
    (WallClock by default). receive(engine, version, weights): how new weights get into
    the engine (load_in_place by default; the generator process receives a broadcast).
    What only the generator process needs (a resumed run, several engines, the pool's
    rejected groups, its queue's bound) is system.generator.ProcessGenerator's."""

    proc, engine_id = "generator", 0  # its lane on the timeline (engine.lane), and which engine it is

    def __init__(self, cfg, engine, problems, tokenizer, outbox, clock=None, receive=load_in_place):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from data import prompt_ids

        self.cfg, self.engine, self.outbox = cfg, engine, outbox
        self.clock, self.receive = clock or WallClock(), receive
        self.prompts = prompt_ids(tokenizer, problems, cfg["dataset"])
        self.answers = [p["answer"] for p in problems]  # travel with each sample, for the reward
        self.params = lambda max_tokens: SamplingParams(
            temperature=cfg["temperature"],
            max_tokens=max_tokens,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        self.inflight = {}  # request id -> Rollout
        self.admitting = True  # drain turns this off while it finishes old answers
        self.version = 0  # the weights loaded
        self.next_group = 0  # groups are numbered in admission order (pool.Pool trains them in that order)
        self.stats = dict(
            gen_tokens=0, gen_idle_s=0.0, gen_drain_s=0.0, discarded_tokens=0, recomputed_tokens=0, loads=0, preempted=0
        )
        # requests in the engine at once (training + eval): at most what its KV cache holds
        self.kv_answers = min(cfg["max_num_seqs"], kv_capacity(engine, cfg["max_model_len"])[0])
        watch_preemptions(engine, self.preempted)
        self.activity = None
        self.steps = 0  # engine steps so far: a token's step number tells runs of steps apart
        self.eval_out = {}  # eval request id -> dict(prompt=its length, ids=tokens so far, reason=None until done)

    def set_activity(self, what, t=None):
        """Timeline entry (events.jsonl) when what the generator does changes (at t: now by default)."""
        if what != self.activity:
            self.activity = what
            self.outbox.append(
                (
                    "event",
                    dict(
                        t=self.clock.now() if t is None else t,
                        proc=self.proc,
                        engine=self.engine_id,
                        what=what,
                        version=self.version,
                    ),
                )
            )

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
        self.outbox.append(
            (
                "event",
                dict(
                    t=t1, proc=self.proc, engine=self.engine_id, mark=kind, t0=t0, t1=t1, version=self.version, **more
                ),
            )
        )

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

    def load_weights(self, version, weights):
        """Load new weights in place, between two engine steps (receive: a state dict
        loaded in this process, or a broadcast received in the generator process)."""
        t0 = self.clock.now()
        self.receive(self.engine, version, weights)
        self.loaded(version, t0)

    def loaded(self, version, t0):
        """The load that began at t0 is done: the time it cost, the new version."""
        self.set_activity("loading", t0)
        self.clock.spend("load")
        t1 = self.clock.now()
        self.version = version
        self.stats["loads"] += 1
        self.stats["load_s"] = self.stats.get("load_s", 0.0) + t1 - t0
        self.mark("load", t0, t1)

    def idle_until(self, t):
        """Nothing in flight and nothing to admit until new weights come at t: idle (the
        lesson's clock jumps there; the generator process waits on its queue instead)."""
        self.set_activity("idle")
        self.stats["gen_idle_s"] += self.clock.wait_until(t)

    # -- the loop's parts

    budget_offset = 0  # groups the bound admits beyond its count: the pool's rejected (set at each push), a resume's

    def may_admit(self):
        """AReaL's staleness bound: at most (version + max_lag + 1) batches of --prompts-per-step groups
        admitted, + budget_offset (the groups the pool rejected, each leaving its place to a new one).
        Taken in admission order (pool.Pool), nothing admitted now trains more than max_lag versions
        after the weights that started it. And room in the KV cache for one more group (kv_answers)."""
        budget = (self.version + self.cfg["max_lag"] + 1) * self.cfg["prompts_per_step"] + self.budget_offset
        return (
            self.admitting
            and self.next_group < budget
            and len(self.inflight) + self.cfg["group_size"] <= self.kv_answers
        )

    def admit(self):
        """Start the next groups while may_admit says so."""
        while self.may_admit():
            self.submit_group(self.next_group)
            self.next_group += 1

    def submit_group(self, g):
        """Group g: --group-size answers to one problem (the problem list is already shuffled)."""
        pid = g % len(self.prompts)
        for i in range(self.cfg["group_size"]):
            self.submit(Rollout(f"{g}-{i}", pid, g, self.prompts[pid], self.cfg["max_new_tokens"], self.clock.now()))

    def held(self):
        """What the engine holds before a step: (answers, tokens in their KV), evaluations' included."""
        evals = [ev for ev in self.eval_out.values() if ev["reason"] is None]
        kv = sum(len(r.prompt_ids) + len(r.tokens) for r in self.inflight.values())
        return len(self.inflight) + len(evals), kv + sum(ev["prompt"] + len(ev["ids"]) for ev in evals)

    def step(self):
        """One engine step; finished answers go to the outbox."""
        answers, kv = self.held()  # a step costs more the more it holds (SimClock)
        t0 = self.clock.now()
        outputs = self.engine.step()
        # the KV this step wrote in one go (a request's first output comes from its prefill):
        # the simulated clock charges for it; on the wall clock the step has taken its time
        prefilled = 0
        for out in outputs:
            if (r := self.inflight.get(out.request_id)) is not None:
                prefilled += r.prefill_tokens()
            elif (ev := self.eval_out.get(out.request_id)) is not None and not ev["ids"]:
                prefilled += ev["prompt"]
        self.clock.spend("step", t0, answers=answers, kv=kv, prefilled=prefilled)
        t1, self.steps = self.clock.now(), self.steps + 1
        inflight, version, step = self.inflight, self.version, self.steps  # locals: this loop runs per answer per step
        tokens = rebuilt = 0
        for out in outputs:
            c = out.outputs[0]
            if (ev := self.eval_out.get(out.request_id)) is not None:
                ev["ids"] += c.token_ids
                ev["reason"] = c.finish_reason if out.finished else None
                continue
            r = inflight.get(out.request_id)
            if r is None:  # output of a request aborted this step
                continue
            ids = c.token_ids
            rebuilt += r.record(ids, [d[t].logprob for t, d in zip(ids, c.logprobs)], version, step, t0, t1)
            tokens += len(ids)
            if out.finished:
                del inflight[out.request_id]
                sample = r.to_sample(c.finish_reason, t1)
                sample["answer"], sample["engine"] = self.answers[r.prompt_id], self.engine_id
                self.outbox.append(("sample", sample))
        self.stats["gen_tokens"] += tokens
        self.stats["recomputed_tokens"] += rebuilt

    def evaluate(self, prompts, max_tokens):
        """Greedy answers under the weights loaded now, as (token ids, finish reason)
        ("stop" or "length": cut at max_tokens). Training answers in flight share these
        steps; no weights load until the evaluation is done, so their bookkeeping is
        unaffected."""
        from tqdm import tqdm
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.set_activity("evaluating")
        t0 = self.clock.now()
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, detokenize=False, output_kind=RequestOutputKind.DELTA
        )
        ids = [f"eval{self.version}-{i}" for i in range(len(prompts))]
        todo, self.eval_out = list(zip(ids, prompts)), {}
        running = lambda: sum(ev["reason"] is None for ev in self.eval_out.values())
        with tqdm(total=len(ids), desc=f"eval v{self.version}", leave=False) as bar:
            while todo or running():
                # add eval requests only while the KV cache has room for them (kv_capacity)
                room = max(0, self.kv_answers - len(self.inflight) - running())
                for rid, p in todo[:room]:
                    self.eval_out[rid] = dict(prompt=len(p), ids=[], reason=None)
                    self.engine.add_request(rid, dict(prompt_token_ids=p), params)
                todo = todo[room:]
                self.step()
                bar.update(len(self.eval_out) - running() - bar.n)
        results, self.eval_out = [(self.eval_out[i]["ids"], self.eval_out[i]["reason"]) for i in ids], {}
        self.mark("eval", t0, self.clock.now(), n=len(ids))
        return results
