"""
Reliability, through train.py as a user runs it (CPU, the tiny model, the real
vLLM engine where one runs): a user's mistake stops the run in seconds with one
line on stderr and exit code 2, before the generator starts; a stalled generator
is caught and reported with its stack; --resume after kill -9 logs every step once
and keeps the staleness bound; a save that dies half-way leaves a checkpoint that
--resume finds. The faults are put into train.py from outside (tests/faults.py), some
with the weight group's collectives made to behave as NCCL's (--nccl; its own test here).

    .venv/bin/python -m pytest -q tests/test_reliability.py
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import read, wait_for

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "gsm8k.jsonl")


CASES = [
    "truncated line",
    "missing field",
    "missing file",
    "model path",
    "resume nothing",
    "resume no ckpt",
    "answer budget",
    "offline test split",
    "eval.py truncated line",
    "eval.py offline",
    "synth steps",
    "preset dataset",
    "max num seqs",
    "format reward",
    "json object",
    "resume done",
    "eval.py answer budget",
    "group size 1",
    "temperature 0",
    "resume past cosine",
    "pace target 0",
    "gpu on a cpu machine",
    "lesson clock",
]


def bad_input(case, tmp):
    """The command line of one mistake, and what the one stderr line must say."""
    with open(FIXTURE) as f:
        text = f.read()
    (tmp / "truncated.jsonl").write_text(text[:300])  # the file's second line is cut mid-string
    (tmp / "no_question.jsonl").write_text(text.replace('"question"', '"q"', 2).split("\n", 2)[1] + "\n")
    (tmp / "run_without_ckpt").mkdir()
    (tmp / "run_without_ckpt" / "config.json").write_text("{}")
    (tmp / "object.json").write_text(json.dumps({"question": "q", "answer": "#### 1"}))
    if case.startswith("resume "):  # a run of 10 steps whose checkpoint is at step 5 (the tiny model's weights)
        import shutil
        import torch

        shutil.copytree(os.path.join("weights", "tiny"), tmp / "run_done" / "ckpt")
        torch.save(dict(step=5), tmp / "run_done" / "ckpt" / "trainer_state.pt")
        (tmp / "run_done" / "config.json").write_text(json.dumps({"steps": 10, "lr_schedule": "cosine"}))
    gsm8k = ["--dataset", "gsm8k", "--eval-data-file", FIXTURE]
    train = ["train.py", "--out", str(tmp / "run"), "--no-plot"]
    evaluate = ["eval.py", "--model", "tiny", "--dataset", "gsm8k"]  # shares the loaders; its test flag: --data-file
    return {
        "truncated line": (
            [*train, *gsm8k, "--data-file", str(tmp / "truncated.jsonl")],
            "truncated.jsonl:2: not valid JSON",
        ),
        "missing field": ([*train, *gsm8k, "--data-file", str(tmp / "no_question.jsonl")], "no 'question' field"),
        "missing file": ([*train, *gsm8k, "--data-file", str(tmp / "nope.jsonl")], "--data-file"),
        "model path": ([*train, "--model", "/path/that/does/not/exist"], "neither a directory nor a Hub id"),
        "resume nothing": ([*train, "--resume", str(tmp / "nothing")], "not a run directory"),
        "resume no ckpt": ([*train, "--resume", str(tmp / "run_without_ckpt")], "no complete checkpoint"),
        "answer budget": ([*train, "--max-new-tokens", "600", "--max-model-len", "512"], "lower it to"),
        "offline test split": ([*train, "--dataset", "gsm8k", "--data-file", FIXTURE], "pass --eval-data-file"),
        "eval.py truncated line": ([*evaluate, "--data-file", str(tmp / "truncated.jsonl")], "truncated.jsonl:2"),
        "eval.py offline": (evaluate, "pass --data-file"),
        "synth steps": ([*train, "--synth-steps", "12-1"], "1 <= A <= B <= 16"),
        "preset dataset": ([*train, "--preset", "long", *gsm8k], "not for --dataset gsm8k"),
        "max num seqs": ([*train, "--max-num-seqs", "4"], "below --group-size 8"),
        "format reward": ([*train, "--format-reward", "1.5"], "--format-reward must be in [0, 1]"),
        "json object": ([*train, *gsm8k, "--data-file", str(tmp / "object.json")], "one array of objects"),
        "resume done": ([*train, "--resume", str(tmp / "run_done"), "--steps", "3"], "checkpoint is at step 5"),
        "resume past cosine": (
            [*train, "--resume", str(tmp / "run_done"), "--steps", "20"],
            "cosine schedule reaches lr 0 at step 10",
        ),
        "group size 1": ([*train, "--group-size", "1", "--max-num-seqs", "64"], "--group-size must be >= 2"),
        "temperature 0": ([*train, "--temperature", "0"], "--temperature must be > 0"),
        "eval.py answer budget": (["eval.py", "--model", "tiny", "--max-new-tokens", "600"], "lower it to"),
        "pace target 0": ([*train, "--pool", "pace", "--pace-target", "0"], "--pace-target must be >= 1"),
        "gpu on a cpu machine": ([*train, "--gen-device", "cuda:63"], "but this machine shows"),
        "lesson clock": (["lesson.py", "--out", str(tmp / "lesson"), "--train-s", "-1"], "--train-s must be >= 0"),
    }[case]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_one_line_exit_2(case, tmp_path):
    argv, names = bad_input(case, tmp_path)
    # offline whatever the machine: the Hub at a closed port, and an empty cache
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (out[-2000:], err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert "starting the generator" not in out  # stopped before the expensive part
    left = [p for p in psutil.process_iter() if p.pid != proc.pid and _pgid(p.pid) == proc.pid]
    assert not left, left
    print(f"{case}: {time.time() - t0:.1f}s: {lines[0]}")


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_json_array_data_file(tmp_path):
    """A .json data file holding an array of rows (what `datasets` writes and reads) is
    read as the .jsonl with the same rows."""
    from data import load_problems

    rows = [json.loads(line) for line in open(FIXTURE)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert load_problems("gsm8k", "train", data_file=str(tmp_path / "rows.json")) == load_problems(
        "gsm8k", "train", data_file=FIXTURE
    )


class Crash(Exception):
    pass


def test_crash_while_saving_leaves_a_checkpoint(tmp_path, monkeypatch):
    """A save that dies at each point of save_checkpoint (simulated by an exception
    at that point: what is on disk is what a kill would leave) leaves a checkpoint
    that loads, and recover_checkpoint (what --resume calls) finds it."""
    import shutil
    import torch
    from transformers import AutoModelForCausalLM
    from system import checkpoint
    from system.ranks import Ranks
    from tools.build_tiny import RECIPE, build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(len(tok), RECIPE)
    opt = torch.optim.AdamW(model.parameters())
    cfg = dict(out=str(tmp_path))
    for name in checkpoint.LOGS:
        (tmp_path / name).write_text("{}\n")
    ckpt = str(tmp_path / "ckpt")

    def save(step):
        checkpoint.save_checkpoint(cfg, model, tok, opt, Ranks(), dict(step=step, version=step, data_position=4 * step))

    def resumes_at(step):
        path = checkpoint.recover_checkpoint(str(tmp_path))
        assert torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)["step"] == step
        AutoModelForCausalLM.from_pretrained(path)  # loads whole

    rename, rmtree = os.rename, shutil.rmtree

    def fail_rename_into_ckpt(src, dst):  # after ckpt -> ckpt.old, before ckpt.tmp -> ckpt
        if dst == ckpt:
            raise Crash
        rename(src, dst)

    def fail_final_cleanup(path, **kw):  # ckpt is the new one; ckpt.old half deleted
        if path.endswith(".old") and not os.path.exists(ckpt + ".tmp") and os.path.exists(path):
            os.remove(os.path.join(path, "model.safetensors"))
            raise Crash
        rmtree(path, **kw)

    def fail_torch_save(*a, **kw):  # ckpt.tmp half written
        raise Crash

    save(1)
    resumes_at(1)
    crashes = [
        (torch, "save", fail_torch_save, "previous"),
        (os, "rename", fail_rename_into_ckpt, "previous"),
        (shutil, "rmtree", fail_final_cleanup, "new"),
    ]
    for step, (module, attr, failure, survivor) in enumerate(crashes, start=2):
        with monkeypatch.context() as m:
            m.setattr(module, attr, failure)
            with pytest.raises(Crash):
                save(step)
        if attr == "rename":
            assert not os.path.exists(ckpt) and os.path.exists(ckpt + ".old")  # the window it covers
        resumes_at(step - 1 if survivor == "previous" else step)
        save(step)  # the next save cleans up whatever the dead one left
        resumes_at(step)
        assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *checkpoint.LOGS])


SMALL = [
    "--eval-every",
    "0",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--synth-steps",
    "6",
    "--max-new-tokens",
    "64",
    "--no-plot",
]


def start_train(*args, faults=()):
    """train.py in its own process group (its generator joins it), stdout piped; with `faults`,
    tests/faults.py's flags, under them (the real program, the faults patched in from outside)."""
    launch = [os.path.join("tests", "faults.py"), *faults, "--"] if faults else []
    return subprocess.Popen(
        [sys.executable, *launch, "train.py", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def session_left(pgid):
    return [p for p in psutil.process_iter() if _pgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE]


LONG_TAIL = ["--regime", "stale", "--synth-steps", "1-12", "--max-new-tokens", "160", "--max-lag", "1"]


def check_groups(run, cfg, steps):
    """answers.jsonl against the pool's promises: every answer once; a step takes the
    oldest groups not yet taken, so with nothing rejected step k took groups
    (k-1)P .. kP-1, whole; lag within --max-lag. Returns the answers."""
    answers, P = read(run, "answers.jsonl"), cfg["prompts_per_step"]
    assert len({a["sample_id"] for a in answers}) == len(answers) == steps * P * cfg["group_size"]
    for k in range(1, steps + 1):
        taken = sorted({a["group_id"] for a in answers if a["step"] == k})
        assert taken == list(range((k - 1) * P, k * P)), (k, taken)
    assert all(m["lag_max"] <= cfg["max_lag"] for m in read(run, "metrics.jsonl") if "lag_max" in m)
    return answers


def first_run_transcript():
    """What docs/gpu.md says a first run prints, in its order, as line prefixes: each line it quotes cut
    where the machine's own part begins (a device, "...")."""
    text, run = " ".join(open(os.path.join("docs", "gpu.md")).read().split()), "--dataset gsm8k` prints"
    start = text.index(run) + len(run)
    said = re.findall(r"`([^`]*)`", text[start : text.index("What stops it", start)])
    return [re.split(r"cuda|\.\.\.", quoted)[0] for quoted in said]


def test_pace_keeps_rejecting_within_the_lag_bound(tmp_path):
    """--pool pace with the generator free to run ahead (--max-lag 3) of a trainer that
    waits for the oldest groups: rejected groups leave their places to new ones, so
    PACE rejects at more than one step (before: once, then never again), no rejected
    answer is trained, and no trained token is more than --max-lag versions old. Its
    stdout has the lines docs/gpu.md's first-run transcript names, in that order (an
    evaluation at step 0 included: before, the page put the config first, no devices)."""
    run = str(tmp_path / "run")
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--out",
            run,
            "--steps",
            "10",
            *SMALL,
            *LONG_TAIL,
            "--max-lag",
            "3",
            "--pool",
            "pace",
            "--eval-every",  # the step-0 evaluation a first run prints (and one at the last step)
            "100",
            "--eval-n",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines, prefixes = r.stdout.splitlines(), first_run_transcript()
    at = [next((i for i, line in enumerate(lines) if line.startswith(p)), None) for p in prefixes]
    assert len(prefixes) >= 8 and None not in at and at == sorted(at), list(zip(prefixes, at))
    metrics = [m for m in read(run, "metrics.jsonl") if "rejected_groups" in m]
    assert sum(m["rejected_groups"] > 0 for m in metrics) >= 2, [m["rejected_groups"] for m in metrics]
    assert all(m["lag_max"] <= 3 for m in metrics)
    answers = read(run, "answers.jsonl")
    rejected = {a["group_id"] for a in answers if a["fate"] == "rejected"}
    consumed = {a["group_id"] for a in answers if a["fate"] == "consumed"}
    assert rejected and not rejected & consumed
    assert len(consumed) == 10 * 4 and len({a["sample_id"] for a in answers}) == len(answers)


def test_resume_after_kill_9_loses_and_repeats_nothing(tmp_path):
    """kill -9 between two checkpoints: the orphaned generator notices its trainer is gone
    and exits, no process of the run left within 30 s; --resume: every step once, versions consecutive,
    every group consumed once and none lost (its answers once in answers.jsonl), the
    ledger's tokens agreeing with answers.jsonl and metrics.jsonl; what the dead run logged
    after its checkpoint kept in side files. The answers are long-tailed at --max-lag 1:
    groups admitted later finish before a group with a long answer (checked: it happened),
    yet no trained token is more than one version old. (Consumed by completion order, the
    same setting gave lag_max 3-4.)"""
    import torch

    run = str(tmp_path / "run")
    proc = start_train("--out", run, "--steps", "1000", "--save-every", "3", *SMALL, *LONG_TAIL)
    wait_for(proc, "step 5 ")  # the checkpoint is step 3's; steps 4 and 5 are logged, 6 is far
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while session_left(proc.pid) and time.time() < deadline:  # the orphaned generator exits by itself
        time.sleep(0.5)
    assert not session_left(proc.pid)
    state = torch.load(os.path.join(run, "ckpt", "trainer_state.pt"), weights_only=False)
    assert state["step"] == 3 and state["version"] == 3 and state["data_position"] == 12
    logged = [m["step"] for m in read(run, "metrics.jsonl")]
    assert logged[:5] == [1, 2, 3, 4, 5]  # the dead run got past its checkpoint

    r = subprocess.run(
        [sys.executable, "train.py", "--resume", run, "--steps", "8"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = read(run, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["version"] for m in metrics] == list(range(8))
    assert all(b["wall_s"] > a["wall_s"] for a, b in zip(metrics, metrics[1:]))  # the clock continues
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert (cfg["start_version"], cfg["start_group"]) == (3, 12)
    answers = check_groups(run, cfg, 8)  # lag within --max-lag 1, each step the oldest groups whole
    done = {}
    for a in answers:
        done[a["group_id"]] = max(done.get(a["group_id"], 0), a["finished"])
    assert any(done[g] > done[h] for g in done for h in done if h > g), "no group was overtaken: nothing tested"
    led = json.load(open(os.path.join(run, "ledger.json")))["tokens"]
    assert led["trained"] == sum(a["tokens"] for a in answers) == sum(m["trained_tokens"] for m in metrics)
    assert led["left_over"] >= 0
    for name in ("metrics", "events", "answers"):
        cut = [f for f in os.listdir(run) if f.startswith(f"{name}.cut-")]
        assert len(cut) == 1, (name, os.listdir(run))
    assert read(run, [f for f in os.listdir(run) if f.startswith("metrics.cut-")][0])[0]["step"] == 4
    trainer = [e["what"] for e in read(run, "events.jsonl") if e["proc"] == "trainer"]
    restart = trainer.index("starting", 1)
    assert trainer[restart - 2 : restart] == ["saving", "stopped"]  # the timeline resumes at the checkpoint


def test_stalled_generator_is_stopped_with_its_stack(tmp_path):
    """A generator alive but silent (tests/faults.py hangs it before engine step 60)
    is stopped by the trainer, which reports its last activity and Python stack."""
    # short answers (--synth-steps 2), so messages flow every few steps until the hang
    proc = start_train(
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "1000",
        "--stall-s",
        "10",
        *SMALL,
        "--synth-steps",
        "2",
        faults=["--stall-at-step", "60"],
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, (out[-2000:], err[-3000:])
    # silent while the trainer waits for answers, or not taking a push: whichever it was doing
    assert "generator stalled: alive but" in err and "for 10s" in err, err[-3000:]
    assert "last activity it reported: " in err
    assert "in hang_forever" in err  # the stack faulthandler wrote, pointing at the hang
    assert "leaked semaphore" not in err, err[-2000:]  # the killed generator leaves nothing behind
    time.sleep(1)
    assert not session_left(proc.pid)


class Work:
    """A collective's work that completes at its n-th look."""

    def __init__(self, n):
        self.looks, self.n = 0, n

    def is_completed(self):
        self.looks += 1
        return self.looks >= self.n

    def exception(self):
        return None

    def wait(self):
        return True


class Group:
    aborted = False

    def abort(self):
        self.aborted = True


class FailedWork:
    """NCCL's work once an error is recorded: completed, its exception set, and its wait() aborting the
    communicator on the caller's thread for as long as that takes (here 60 s)."""

    def is_completed(self):
        return True

    def exception(self):
        return RuntimeError("NCCL error: remote process exited or there was a network error")

    def wait(self):
        time.sleep(60)
        return True


class SlowAbortGroup(Group):
    """NCCL's abort, which may wait for its communicators up to the group's timeout (here 60 s)."""

    def abort(self):
        self.aborted = True
        time.sleep(60)


@pytest.mark.fast
def test_a_wait_looks_often_at_first_and_stops_when_a_peer_is_gone(monkeypatch):
    """system.push.wait looks at its work 10 us after it starts, then twice as long each time, up to
    POLL_S (1 ms): vLLM's loader takes one tensor at a time, and at a flat 1 ms a look each tensor
    that had not yet arrived cost a millisecond. A check that raises (a peer gone) aborts the group
    and reaches the caller. watched() runs a call that blocks on a thread of its own: its result
    or its error come back, and a check that raises while it blocks gives up on it."""
    import threading
    from system import push

    slept = []
    monkeypatch.setattr(push.time, "sleep", slept.append)
    push.wait(Group(), Work(12), lambda: None)
    assert slept == [1e-5 * 2**i for i in range(7)] + [push.POLL_S] * 4
    group = Group()

    def gone():
        raise RuntimeError("the trainer is gone")

    with pytest.raises(RuntimeError, match="the trainer is gone"):
        push.wait(group, Work(100), gone)
    assert group.aborted
    monkeypatch.undo()
    assert push.watched(lambda: 7, lambda: None, "t") == 7
    with pytest.raises(ZeroDivisionError):
        push.watched(lambda: 1 / 0, lambda: None, "t")
    never = threading.Event()
    with pytest.raises(RuntimeError, match="the trainer is gone"):
        push.watched(never.wait, gone, "t")


@pytest.mark.fast
def test_a_failed_nccl_work_is_reported_within_the_abort_bound(monkeypatch):
    """A work NCCL completed with an error (is_completed() True, exception() set), whose wait() would
    abort the communicator on the caller's thread for 60 s: system.push.wait raises its error within
    ABORT_S (1 s here), the group's abort left on a thread of its own (before: wait() called, 60 s)."""
    import threading
    from system import push

    monkeypatch.setattr(push, "ABORT_S", 1)
    group, raised = SlowAbortGroup(), []

    def call():
        try:
            push.wait(group, FailedWork(), lambda: None)
        except RuntimeError as e:
            raised.append((e, time.time() - t0))

    t0 = time.time()
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "push.wait still waiting after 10 s: it called the failed work's wait()"
    ((error, took),) = raised
    assert "remote process exited" in str(error) and group.aborted and took < 3, (error, took)


RANK_1 = """
import os, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from faults import NcclGroup
from system.push import init_weight_group

group = NcclGroup(init_weight_group("127.0.0.1", int(sys.argv[1]), 1, 2, "gloo"))
print("joined", flush=True)
if sys.argv[2] == "exits":  # gone before its first collective
    os._exit(0)
time.sleep(3)
print("first collective", time.time(), flush=True)
work = group.allreduce(torch.ones(()))
while not work.is_completed():
    time.sleep(0.01)
"""


@pytest.mark.parametrize("rank_1", ["comes late", "exits"])
def test_the_nccl_group_blocks_its_first_collective_until_every_rank_makes_one(rank_1):
    """tests/faults.py's NcclGroup, which the nccl tests run under, as ProcessGroupNCCL made lazily (vLLM's
    helper): rank 0's first collective, the call itself, does not return before rank 1 (in another process,
    in the group) makes its own, 3 s after joining; the allreduce then completes. With rank 1 gone instead,
    it never returns (gloo's would raise "Connection closed by peer")."""
    import socket
    import threading
    import torch
    from faults import NcclGroup
    from system.push import init_weight_group

    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen()
    code = RANK_1.format(root=os.getcwd(), tests=os.path.join(os.getcwd(), "tests"))
    peer = subprocess.Popen(
        [sys.executable, "-c", code, str(listen.getsockname()[1]), rank_1], stdout=subprocess.PIPE, text=True
    )
    group = NcclGroup(init_weight_group("127.0.0.1", listen.getsockname()[1], 0, 2, "gloo", listen))
    assert peer.stdout.readline() == "joined\n"
    t, returned = torch.ones(()), []
    caller = threading.Thread(target=lambda: returned.append((group.allreduce(t), time.time())), daemon=True)
    caller.start()
    if rank_1 == "exits":
        peer.wait(timeout=60)
        caller.join(10)
        assert caller.is_alive() and not returned, "the first collective returned without rank 1"
        return
    called = float(peer.stdout.readline().split()[-1])
    caller.join(60)
    assert returned and returned[0][1] >= called, "the first collective returned before rank 1 made its own"
    while not returned[0][0].is_completed():
        time.sleep(0.01)
    assert t.item() == 2.0
    peer.wait(timeout=60)


# the weight group's collectives as they are on CPU (gloo's: connected when made, wait() blocks, a dead peer
# fails the collective), and as NCCL's are on a GPU (tests/faults.py's NcclGroup: the first collective blocks
# until every rank has made one, wait() returns at once, a broken collective never completes): the same
# reports within the same bounds
WAITS = [pytest.param([], id="gloo"), pytest.param(["--nccl"], id="nccl")]


@pytest.mark.parametrize("where, waits", [("before", []), ("after", ["--nccl"])], ids=["before-gloo", "after-nccl"])
def test_an_engine_that_never_joins_the_weight_group_is_stopped(tmp_path, where, waits):
    """The engine hangs before the weight group's rendezvous, or after it (before its first collective,
    where NCCL makes its communicator: the trainer's first collective waits for it, lazily, for ever): the
    trainer, which forms the group and makes its first collective watched, stops it within the stall
    bound and reports its stack, instead of waiting out the group's 1 h timeout (or, on NCCL, for ever)."""
    proc = start_train(
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "3",
        "--stall-s",
        "10",
        *SMALL,
        faults=["--stall-in-group", where, *waits],
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, (out[-2000:], err[-3000:])
    assert "generator stalled: alive but not in the weight group for 10s" in err, err[-3000:]
    assert "in hang_forever" in err
    time.sleep(1)
    assert not session_left(proc.pid)


def test_a_first_collective_stuck_with_every_engine_in_it_is_reported_within_its_bound(tmp_path):
    """NCCL's communicator init stuck with every rank present (tests/faults.py: the NCCL-semantics group's
    first collective hangs once every rank has made it): the trainer stops the engine with its stack
    FIRST_COLLECTIVE_S after the engine came to it (5 s here; 120 s by default), not after the stall
    bound (400 s here; 3,102 s at gsm8k's defaults, before any engine step has been measured)."""
    proc = start_train(
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "3",
        "--stall-s",
        "400",
        *SMALL,
        faults=["--nccl", "--hang-in-connect", "--first-collective-s", "5"],
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:  # the stall bound's wait (before) would outlast this test: stop it, and every process it started
        if session_left(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, (out[-2000:], err[-3000:])
    said = "generator stalled: alive but in the weight group's first collective with every engine"
    assert f"{said} (NCCL's communicator init) for 5s" in err and "in hang_forever" in err, err[-3000:]
    time.sleep(1)
    assert not session_left(proc.pid)


def test_an_engine_that_dies_in_the_weight_group_is_named(tmp_path):
    """Engine 1 of 2 killed (-9) after the weight group's rendezvous, before its first collective, under
    the NCCL-semantics group (the trainer's first collective, which makes the communicator, would wait for
    it for ever): the trainer names it, dead, and the report is the last word: engine 0, healthy and
    waiting in the first collective, is stopped before it (before, it outlived the trainer and printed
    "the trainer (pid N) is gone" with its traceback after the report)."""
    t0 = time.time()
    proc = start_train(
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "3",
        "--stall-s",
        "60",  # two engines' rendezvous on two loaded cores took more than 10 s once: a death is seen at once
        "--engines",
        "2",
        *SMALL,
        faults=["--die-in-group", "--engine", "1", "--nccl"],
    )
    out, err = proc.communicate(timeout=600)  # returns once every process sharing stderr has exited
    assert proc.returncode == 1, (out[-2000:], err[-3000:])
    # named as dead, not as stalled (gloo's error, if it came first, in brackets)
    report = "train.py: generator engine 1 process died while the weight group formed"
    assert report in err, err[-3000:]
    assert "(exit code -9)" in err and "generator stalled" not in err
    assert "Traceback" not in err[err.index(report) :] and "is gone" not in err, err[-3000:]
    print(f"{time.time() - t0:.0f}s from the start")
    time.sleep(1)
    assert not session_left(proc.pid)


@pytest.mark.parametrize("waits", WAITS)
def test_a_push_cut_halfway_stops_the_engine(tmp_path, waits):
    """The trainer killed (-9) once it has sent half the tensors of the push of v1 (tests/faults.py):
    the engine, its layers half loaded (vLLM would put the old tensors back into the
    layers that got nothing), does not go back to sampling: the push fails there, says so,
    and the process ends. (An engine that took the broken push as complete would exit
    quietly once it saw its trainer gone; one that kept waiting would hold stderr open.)"""
    proc = start_train("--out", str(tmp_path / "run"), "--steps", "3", *SMALL, faults=["--die-in-push", "1", *waits])
    out, err = proc.communicate(timeout=600)  # returns once the generator, which shares stderr, has exited
    assert proc.returncode == -signal.SIGKILL, (out[-2000:], err[-3000:])
    assert "the push of v1 broke after" in err and "half loaded, so it stops" in err, err[-3000:]
    time.sleep(1)
    assert not session_left(proc.pid)


@pytest.mark.parametrize("waits", WAITS)
def test_push_watchdog_names_the_engine_that_never_joined(tmp_path, waits):
    """Two engines; engine 1 hangs before it joins the push of v1 (tests/faults.py) while
    engine 0 waits in the push for it: the watchdog stops engine 1 and names it alone. (On NCCL
    this push was the group's first collective once, which the trainer made unwatched: it waited
    for engine 1 for ever.)"""
    proc = start_train(
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "3",
        "--stall-s",
        "10",
        "--engines",
        "2",
        *SMALL,
        faults=["--stall-at-push", "1", "--engine", "1", *waits],
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, (out[-2000:], err[-3000:])
    assert "generator engine 1 stalled: alive but not taking new weights for 10s" in err, err[-3000:]
    assert "generator engine 0 stalled" not in err and "in hang_forever" in err
    time.sleep(1)
    assert not session_left(proc.pid)
