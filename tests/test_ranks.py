"""
Past two processes: trainer ranks under torchrun (FSDP2, system/ranks.py) and several vLLM
engines, on CPU over gloo, the same code that runs NCCL on GPUs. One step on 2 ranks
over a split batch is the step one process takes on the whole batch; a push from 2
ranks reaches 2 engines exactly; the death of an engine or a rank ending the whole job,
and a resume after it. (train.py end to end with 2 ranks and 2 engines, checked as
test_smoke checks a run: tests/test_train.py::test_gpu_check_on_cpu.)

    .venv/bin/python -m pytest -q tests/test_ranks.py

Slow on 2 cores (4 processes + torchrun's agent): ~3 minutes in all.
"""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from helpers import ROOT, check_engines, wait_for  # wait_for: read train.py's stdout up to a line

HERE = os.path.abspath(__file__)
SMALL = [
    "--eval-every",
    "2",
    "--eval-n",
    "8",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--synth-steps",
    "6",
    "--max-new-tokens",
    "64",
    "--no-plot",
    "--engines",
    "2",
]


def torchrun(*args, timeout=900, **kw):
    """`torchrun --nproc_per_node 2 ...` (the module, as the venv has it), standalone: its
    own rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def run(cmd, timeout=900, cwd=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


# -----------------------------------------------------------------------------
# one step on 2 ranks == one step in one process


def the_batch():
    """Answers of very different lengths, some advantages 0 (not run), so that the
    ranks get uneven tokens and different numbers of micro-batches."""
    from helpers import batch_of, small_model, with_logprobs

    batch = with_logprobs(batch_of([3, 150, 7, 90, 1, 40, 64, 11, 33]))
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 0.0, 0.5, -2.0, 0.0])
    return small_model(), batch, adv


def step_cfg(loss):
    from helpers import LOSS_CFG

    return dict(
        LOSS_CFG,
        loss=loss,
        temperature=0.7,
        micro_batch_tokens=150,
        geo_threshold=1.2,  # geo: keeps some
        m2po_tau=1.0,  # m2po: the_batch's (log pi/mu)^2 run ~0-10: masks some, keeps most
        loss_agg="answer" if loss == "ppo" else "token",
        max_new_tokens=160,
    )


def grads_job(out, *cases):
    """Run by each of 2 ranks (torchrun): for each case "LOSSES:CHECKPOINTING", a fresh
    model (with activation checkpointing as train.py --grad-checkpointing on sets it up, if
    "on"), and the step of grpo.step, gradients gathered, for each of the
    comma-separated LOSSES in turn."""
    import torch.distributed as dist
    import grpo
    from losses import loss_settings
    from system.ranks import Ranks

    torch.set_num_threads(1)
    ranks = Ranks()
    ranks.start("cpu")
    results = {}
    for case in cases:
        losses, checkpointing = case.split(":")
        model, batch, adv = the_batch()
        if checkpointing == "on":
            grpo.activation_checkpointing(model)
            model.train()
        model = ranks.shard(model)
        results[case] = {}
        for loss in losses.split(","):
            cfg = step_cfg(loss)
            share, share_adv, weights, n_micro = ranks.scatter(
                batch,
                adv,
                grpo.token_weights(cfg, batch),
                lambda answers: len(grpo.micro_batches(answers, cfg["micro_batch_tokens"])),
            )
            mine = (
                sum(len(s["token_ids"]) for s in share),
                len(grpo.micro_batches([s for s, a in zip(share, share_adv) if a != 0], cfg["micro_batch_tokens"])),
            )
            grpo.pi_old(cfg, model, [(share, share_adv, weights, n_micro)], "cpu", ranks)  # m2po: then its mask
            cfg = loss_settings(cfg, share, share_adv, ranks.gather)
            model.zero_grad(set_to_none=True)
            total, gap, gap_tokens, *_ = ranks.sum(
                *grpo.train_step(cfg, model, share, share_adv, weights, "cpu", n_micro)
            )
            grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
            split = [None, None]
            dist.all_gather_object(split, mine)
            results[case][loss] = dict(loss=total, gap=gap / gap_tokens, grads=grads, split=split, n_micro=n_micro)
    if ranks.is_main:
        torch.save(results, out)
    ranks.stop()


GRAD_CASES = [("tis,ppo,none,icepop,geo,cispo,gspo,m2po", "off"), ("tis", "on")]


@pytest.fixture(scope="module")
def two_rank_grads(tmp_path_factory):
    """Every case of GRAD_CASES in one torchrun job (one start-up of 2 ranks, not one a case)."""
    out = str(tmp_path_factory.mktemp("ranks") / "grads.pt")
    run(torchrun(HERE, "grads", out, *(f"{losses}:{ckpt}" for losses, ckpt in GRAD_CASES)))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("losses, checkpointing", GRAD_CASES)
def test_two_ranks_take_the_step_one_process_takes(losses, checkpointing, two_rank_grads):
    """The loss is the token-level mean over the whole batch whatever the ranks: the
    gradient gathered from 2 FSDP2 ranks over a split batch equals one process's on the
    whole batch (float32, relative 1e-5 of the largest entry), with uneven splits (one
    rank more tokens and more micro-batches: the other runs empty ones); ppo with the
    per-answer mean (--loss-agg answer), whose weights depend on the whole batch; and
    with activation checkpointing under FSDP2 (on by default on GPUs), against one
    process without it. m2po comes after the others' steps: its pi_old (grpo.pi_old) is a
    forward without autograd after a backward, as at every step of a run but the first; before
    Ranks.reshard its gradients were 0.09 off (of 0.2) on the tied embeddings."""
    import grpo
    from losses import loss_settings, m2po_moment

    for loss, got in two_rank_grads[f"{losses}:{checkpointing}"].items():
        (tok0, mb0), (tok1, mb1) = got["split"]
        assert tok0 != tok1 and mb0 != mb1 and got["n_micro"] == max(mb0, mb1)  # uneven
        model, batch, adv = the_batch()
        cfg = step_cfg(loss)
        if grpo.needs_pi_old(cfg):
            grpo.old_logprobs(cfg, model, batch, adv, "cpu")
        cfg = loss_settings(cfg, batch, adv)
        if loss == "m2po":  # the mask binds, and not on every token
            assert (
                0
                < cfg["m2po_cutoff"]
                < max(m2po_moment(s["old_logprobs"], s["logprobs"]).max() for s in batch if "old_logprobs" in s)
            )
        ref_loss, gap, gap_tokens, *_ = grpo.train_step(cfg, model, batch, adv, grpo.token_weights(cfg, batch), "cpu")
        assert abs(got["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), loss
        assert abs(got["gap"] - gap / gap_tokens) <= 1e-5 * abs(gap / gap_tokens)
        scale = max(p.grad.abs().max() for p in model.parameters())
        assert scale > 0, f"{loss}: no gradient, the comparison proves nothing"
        for k, p in model.named_parameters():
            assert (got["grads"][k] - p.grad).abs().max() <= 1e-5 * scale, (loss, k)


# -----------------------------------------------------------------------------
# a push from 2 ranks reaches 2 engines exactly


def sync_job(out):
    """Run by each of 2 ranks: rank 0 starts 2 engines; both ranks shard perturbed
    weights and push them (rank 0 broadcasts what both gathered); rank 0 collects greedy
    answers written by them from both engines."""
    from helpers import collect, hf_logprobs, hf_model, perturbed
    from system.handle import GeneratorHandle
    from system.devices import prepare
    from system.ranks import Ranks
    from train import parse_config

    ranks = Ranks()
    cfg = dict(
        parse_config(
            [
                "--regime",
                "sync",
                "--out",
                out + ".run",
                "--prompts-per-step",
                "4",
                "--synth-steps",
                "3",
                "--max-new-tokens",
                "48",
                "--engines",
                "2",
            ]
        ),
        temperature=0.0,
        group_size=1,
    )
    envs = prepare(cfg, ranks.world, ranks.local_rank)
    ranks.start("cpu")
    model = hf_model(cfg)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(perturbed(model, seed=2))
    reference = hf_model(cfg)
    reference.load_state_dict(model.state_dict())
    model = ranks.shard(model)
    if not ranks.is_main:
        for _ in ranks.weights(model, torch.float32)[1]:
            pass
        return ranks.stop()
    gen = GeneratorHandle(cfg, envs)
    try:
        collect(gen, 4)  # version 0's batch
        assert gen.push(*ranks.weights(model, torch.float32)) == 1
        samples = collect(gen, 4)
    finally:
        gen.stop()
    eos = reference.generation_config.eos_token_id
    result = dict(engines=sorted({s["engine"] for s in samples}), versions=[], same_tokens=[], diff=[], unpushed=[])
    before = hf_model(cfg)
    before.load_state_dict(original)
    for s in samples:
        prompt, tokens = s["prompt_ids"].tolist(), s["token_ids"].tolist()
        greedy = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=48, pad_token_id=eos, eos_token_id=eos
        )[0, len(prompt) :].tolist()
        result["versions"] += s["versions"].tolist()
        result["same_tokens"].append(tokens == greedy)
        result["diff"].append((hf_logprobs(reference, prompt, tokens) - s["logprobs"]).abs().max().item())
        result["unpushed"].append((hf_logprobs(before, prompt, tokens) - s["logprobs"]).abs().max().item())
    json.dump(result, open(out, "w"))
    ranks.stop()


def test_a_push_from_two_ranks_reaches_every_engine_exactly(tmp_path):
    """After a push from 2 FSDP2 ranks, each of 2 engines writes HF's greedy tokens
    under the pushed weights, with logprobs within test_sync_is_exact's tolerance; the
    weights before the push are measurably different."""
    out = str(tmp_path / "sync.json")
    run(torchrun(HERE, "sync", out))
    r = json.load(open(out))
    assert r["engines"] == [0, 1] and set(r["versions"]) == {1}
    assert all(r["same_tokens"]) and max(r["diff"]) < 1e-3, r
    assert min(r["unpushed"]) > 1e-2, r


# -----------------------------------------------------------------------------
# train.py under torchrun, 2 ranks and 2 engines


def start(*args, cwd=None):
    return subprocess.Popen(
        torchrun(os.path.join(ROOT, "train.py"), *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=cwd,
    )


def gone(procs, timeout):
    """None of `procs` (psutil) is left within `timeout` s. torchrun starts each rank in
    a session of its own: the job's processes are torchrun's descendants, taken before."""
    deadline = time.time() + timeout
    alive = lambda: [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    return not alive()


def job(proc):
    """torchrun, its ranks and their engines."""
    return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]


def killed(proc, victim):
    """kill -9 of the job's first process for which victim(p) holds: the whole job ends,
    non-zero, within 90 s (the tests' --stall-s is 120: a death is seen at once, not waited
    out), and no process of it is left within 30 s more. Returns the job's stderr."""
    procs = job(proc)
    target = [p for p in procs if victim(p)]
    assert target, [(p.pid, p.name(), p.cmdline()[:4]) for p in procs]
    t0 = time.time()
    target[0].kill()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0 and time.time() - t0 < 90, err[-3000:]
    assert gone(procs, 30), procs
    return err


def test_resume_two_ranks_after_a_dead_engine(tmp_path):
    """recompute, 2 ranks and 2 engines, no --out: each rank names the default run
    directory after the second it starts in, and rank 1 starting a second later must still
    write its optimizer shard into rank 0's directory (one directory). kill -9 of generator
    engine 1 after a checkpoint: the whole job ends, non-zero, naming it, well within the
    stall bound (a death is seen at once, not waited out), no process left. The checkpoint
    left as ckpt.old/ alone (a save that died between its two renames), --resume under
    torchrun: rank 0 recovers it while rank 1 waits; each step once, versions consecutive,
    the optimizer's shards reloaded, each engine's groups its own."""
    proc = start(
        "--regime",
        "recompute",
        "--steps",
        "1000",
        "--save-every",
        "2",
        *SMALL,
        "--eval-every",
        "0",
        "--stall-s",
        "120",
        cwd=tmp_path,
    )
    wait_for(proc, "step 3 ", timeout=600)
    made = os.listdir(tmp_path / "out")
    assert len(made) == 1, made
    run_dir = str(tmp_path / "out" / made[0])
    err = killed(proc, lambda p: "inflight-generator1" in " ".join(p.cmdline()))
    assert "generator engine 1 process died" in err, err[-3000:]
    assert os.path.isdir(os.path.join(run_dir, "ckpt", "optimizer"))  # the ranks' optimizer shards
    saved = torch.load(os.path.join(run_dir, "ckpt", "trainer_state.pt"), weights_only=False)
    assert saved["world"] == 2 and saved["step"] >= 2
    steps = saved["step"] + 2
    os.rename(os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "ckpt.old"))  # as a save dying between its renames
    run(torchrun("train.py", "--resume", run_dir, "--steps", str(steps)))  # rank 0 alone puts it back
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["version"] for m in metrics] == list(range(steps))
    assert all(m["recomputed_tokens"] >= 0 and m["stale_token_frac"] == 0 for m in metrics)
    check_engines(run_dir, 2)


def test_a_dead_rank_ends_the_job(tmp_path):
    """kill -9 of trainer rank 1: the whole job ends, non-zero, with a message naming it,
    well within the stall bound (torchrun sees the death), no process left. (An engine's
    death: test_resume_two_ranks_after_a_dead_engine.)"""
    proc = start("--out", str(tmp_path / "run"), "--steps", "1000", *SMALL, "--eval-every", "0", "--stall-s", "120")
    wait_for(proc, "step 1 ", timeout=600)
    err = killed(proc, lambda p: p.environ().get("RANK") == "1")
    assert "rank: 1" in err or "local_rank: 1" in err, err[-3000:]


if __name__ == "__main__":  # the jobs torchrun runs in each rank
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    {"grads": grads_job, "sync": sync_job}[sys.argv[1]](*sys.argv[2:])
