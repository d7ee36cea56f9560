"""
The trainer's step, on its own (no vLLM): micro-batched, chunked gradients against an
independent whole-batch computation; the memory it takes at Qwen3's vocabulary; and
the device plumbing a GPU run depends on, checked where a CPU can reach it.

    .venv/bin/python -m pytest -q tests/test_train.py
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import grpo
import losses
from system import checkpoint
from helpers import LOSS_CFG, ROOT, batch_of, small_model, with_logprobs


def reference_grads(cfg, model, batch, adv):
    """The loss written out independently: whole-batch full-vocabulary logits, one
    forward, a mask, then each --loss-agg's mean as its paper writes it: over the
    batch's tokens (the pre-micro-batch code), over answers of each answer's token mean
    (GRPO), or the token sum over answers x max_new_tokens (Dr. GRPO)."""
    model.zero_grad(set_to_none=True)
    seqs = [torch.cat([s["prompt_ids"], s["token_ids"]]) for s in batch]
    W = max(map(len, seqs))
    ids = torch.zeros(len(seqs), W, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], attn[i, : len(x)] = x, 1
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1] / cfg["temperature"], -1)
    logp_all = logp_all.gather(-1, ids[:, 1:, None])[..., 0]  # (B, W-1)
    T = max(len(s["token_ids"]) for s in batch)
    logp, mask, mu = (torch.zeros(len(batch), T) for _ in range(3))
    for i, s in enumerate(batch):
        P, n = len(s["prompt_ids"]), len(s["token_ids"])
        logp[i, :n], mask[i, :n], mu[i, :n] = logp_all[i, P - 1 : P - 1 + n], 1, s["logprobs"]
    A = adv[:, None]
    old = torch.zeros(len(batch), T)  # pi_old: given (several steps per batch) or pi itself, detached
    for i, s in enumerate(batch):
        old[i, : len(s["token_ids"])] = s["old_logprobs"] if "old_logprobs" in s else logp[i, : len(s["token_ids"])]
    old = old.detach()
    n = mask.sum(1, keepdim=True)
    r = torch.exp(logp - old)
    clip = lambda r: torch.min(r * A, r.clamp(0.8, 1.2) * A)  # PPO's, eps 0.2
    if cfg["loss"] == "none":
        per_token = -clip(r)
    elif cfg["loss"] == "tis":
        per_token = -torch.exp(logp.detach() - mu).clamp(max=cfg["is_cap"]) * A * logp
    elif cfg["loss"] == "ppo":
        per_token = -torch.exp(old - mu) * clip(r)
    elif cfg["loss"] == "icepop":
        k = torch.exp(old - mu)
        per_token = -k * ((k >= 0.5) & (k <= 5)) * clip(r)
    elif cfg["loss"] == "geo":
        rho = torch.exp(((old - mu) * mask).sum(1, keepdim=True) / n)
        per_token = -((rho >= 1 / cfg["geo_threshold"]) & (rho <= cfg["geo_threshold"])).float() * clip(r)
    elif cfg["loss"] == "cispo":
        per_token = -torch.exp(logp.detach() - mu).clamp(0, 5) * A * logp
    elif cfg["loss"] == "m2po":  # its mask by hand: the largest (log pi_old/mu)^2 of the trained tokens go, one at a
        m2 = ((old - mu) ** 2).detach()  # time, while the mean of the rest is >= tau
        kept = sorted(m2[(mask > 0) & (A != 0)].tolist(), reverse=True)
        while len(kept) > 1 and sum(kept) / len(kept) >= cfg["m2po_tau"]:
            kept.pop(0)
        per_token = -((m2 <= kept[0]) * torch.exp(logp - mu) * A)
    else:  # gspo, with its published clip (3e-4, 4e-4)
        s = torch.exp(((logp.detach() - mu) * mask).sum(1, keepdim=True) / n) * torch.exp(logp - logp.detach())
        per_token = -torch.min(s * A, s.clamp(1 - 3e-4, 1 + 4e-4) * A)
    agg = cfg.get("loss_agg", "token")
    if agg == "token":
        loss = (per_token * mask).sum() / mask.sum()
    elif agg == "answer":
        loss = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    else:
        loss = (per_token * mask).sum() / (len(batch) * cfg["max_new_tokens"])
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


ADVANTAGES = {
    "nonzero": [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1, -0.1],
    "some zero": [1.0, 0.0, 0.5, -0.5, 0.0, -2.0, 0.0, -0.1],
}  # train_step skips the zeros


@pytest.mark.fast
@pytest.mark.parametrize("advantages", sorted(ADVANTAGES))
@pytest.mark.parametrize(
    "loss, agg, drift",
    [(name, "token", False) for name in losses.LOSSES if name != "m2po-authors"]  # its clip is per micro-batch, by
    # design (its authors' code decides it so): no whole-batch equal; tests/test_losses.py works it by hand
    + [(name, "token", True) for name in ("none", "ppo", "geo", "gspo", "m2po")]
    + [("tis", "answer", False), ("tis", "constant", False), ("ppo", "answer", True)],
)
def test_micro_batched_gradients_equal_whole_batch(loss, agg, drift, advantages, monkeypatch):
    """Whole batch in one micro-batch, and split into many with logits in chunks of 7
    positions: the same loss and gradient as the reference, to float32 rounding
    (relative 1e-5 of the largest gradient entry; measured ~1e-7). With some advantages
    0, train_step does not run those answers: still the reference's gradient. Each of
    --loss-agg's three means, token_weights' weights against the reference's formula;
    every --loss, and with drift, a pi_old apart from pi (a later step of --minibatches),
    so that the clips bind; geo with a threshold that keeps some answers and masks others."""
    model = small_model()
    batch = batch_of([3, 150, 7, 90, 1, 40, 64, 11])
    with torch.no_grad():  # behaviour logprobs near the model's, some ratios above the cap
        for s in batch:
            s["logprobs"] = torch.randn(len(s["token_ids"]), generator=torch.Generator().manual_seed(5)) - 4.6
            if drift:  # log pi_old = log pi - noise: ratios pi/pi_old spread around 1, some past the clips
                s["old_logprobs"] = answer_logprobs_of(model, s) - 0.3 * torch.randn(
                    len(s["token_ids"]), generator=torch.Generator().manual_seed(6)
                )
    adv = torch.tensor(ADVANTAGES[advantages])
    cfg = dict(LOSS_CFG, loss=loss, temperature=0.7, loss_agg=agg, max_new_tokens=160)
    if loss == "geo":  # here the answers' geometric mean pi/mu runs 0.90-1.56: 1.2 keeps five, masks three
        cfg["geo_threshold"] = 1.2
    if loss == "m2po":  # pi_old first (drift: given), then the mask's cutoff over the batch
        cfg["m2po_tau"] = 1.0  # here (log pi_old/mu)^2 runs ~0-10: masks some tokens, keeps most
        if not drift:
            grpo.old_logprobs(dict(cfg, micro_batch_tokens=100_000), model, batch, adv, "cpu")
        cfg = losses.loss_settings(cfg, batch, adv)
        m2 = torch.cat([losses.m2po_moment(s["old_logprobs"], s["logprobs"]) for s in batch if "old_logprobs" in s])
        kept = [(m2 <= cfg["m2po_cutoff"]).float().mean()]
        assert 0 < sum(kept) / len(kept) < 1, "the mask masks nothing or everything: the test proves little"
    ref_loss, ref = reference_grads(cfg, model, batch, adv)
    monkeypatch.setattr(grpo, "LOGIT_CHUNK_BYTES", 7 * 4 * 97)  # 7 positions per logit chunk
    for budget in (100_000, 160, 40):  # one micro-batch; 4; 6 (the longest answers alone)
        model.zero_grad(set_to_none=True)
        got_loss, *_ = grpo.train_step(
            dict(cfg, micro_batch_tokens=budget), model, batch, adv, grpo.token_weights(cfg, batch), "cpu"
        )
        n_mb = len(grpo.micro_batches(batch, budget))
        assert n_mb == 1 if budget == 100_000 else n_mb >= 4
        assert abs(got_loss - ref_loss) <= 1e-5 * abs(ref_loss)
        scale = max(g.abs().max() for g in ref.values())
        for k, p in model.named_parameters():
            assert (p.grad - ref[k]).abs().max() <= 1e-5 * scale, f"{k}, budget {budget}"


def answer_logprobs_of(model, s):
    """log pi of one answer's tokens, at temperature 0.7, from the plain forward."""
    ids = torch.cat([s["prompt_ids"], s["token_ids"]])[None]
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / 0.7, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(s["prompt_ids"]) - 1 :]


@pytest.mark.fast
def test_a_step_with_all_advantages_zero_is_still_an_adamw_step():
    """A batch whose groups all have equal rewards: train_step runs nothing, yet the
    optimizer step is the one a run of every answer (zero gradients) would take: AdamW's
    moments decay and the weights move by momentum. Without the zero-fill every .grad
    stays None and AdamW skips every parameter."""
    import copy

    cfg = dict(loss="tis", is_cap=2.0, clip_eps=0.2, temperature=0.7, micro_batch_tokens=100_000, loss_agg="token")
    ours = small_model()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    batch = with_logprobs(batch_of([5, 9, 3, 7]))
    w = grpo.token_weights(cfg, batch)
    grpo.train_step(cfg, ours, batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), w, "cpu")  # a step with a gradient:
    grpo.optimizer_step(ours, opt, 0.0)  # momentum to move by
    ref = copy.deepcopy(ours)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: loading shares the state's tensors
    zero = torch.zeros(4)
    opt.zero_grad(set_to_none=True)
    loss, *_ = grpo.train_step(cfg, ours, batch, zero, w, "cpu")
    assert all(p.grad is None for p in ours.parameters())  # nothing ran
    grpo.optimizer_step(ours, opt, loss)
    ref_opt.zero_grad(set_to_none=True)
    reference_grads(cfg, ref, batch, zero)  # every answer run: exact zero gradients
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    before = dict(small_model().named_parameters())
    for (k, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), k
    assert any(not torch.equal(p, before[k]) for k, p in ours.named_parameters())
    assert (
        [s["step"] for s in opt.state.values()]
        == [s["step"] for s in ref_opt.state.values()]
        == [torch.tensor(2.0)] * len(opt.state)
    )


@pytest.mark.fast
def test_a_non_finite_gradient_stops_before_the_weights_change():
    """--loss ppo weights a token by exp(log pi - log mu): a behaviour logprob of -inf
    (a token its sampler gave probability 0) makes the loss and gradient infinite. The
    step stops with the reason; the weights are untouched (before: NaN weights, pushed)."""
    cfg = dict(loss="ppo", is_cap=2.0, clip_eps=0.2, temperature=0.7, micro_batch_tokens=100_000, loss_agg="token")
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = with_logprobs(batch_of([5, 9]))
    batch[1]["logprobs"][3] = -float("inf")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss, *_ = grpo.train_step(cfg, model, batch, torch.tensor([1.0, -1.0]), grpo.token_weights(cfg, batch), "cpu")
    with pytest.raises(grpo.TrainingDiverged, match="not finite"):
        grpo.optimizer_step(model, opt, loss)
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())


@pytest.mark.fast
def test_micro_batches_group_by_length_within_budget():
    batch = batch_of([100, 3, 90, 5, 200, 4])
    mbs = grpo.micro_batches(batch, 256)
    assert sorted(i for mb in mbs for i in mb) == list(range(6))
    for mb in mbs:
        width = max(len(batch[i]["prompt_ids"]) + len(batch[i]["token_ids"]) for i in mb)
        assert len(mb) * width <= 256 or len(mb) == 1
    assert {1, 3, 5} in [set(mb) for mb in mbs]  # the three short answers share one


def test_step_memory_at_qwen3_vocabulary():
    """tools/bench_train.py's small shape in its own process: Qwen3's 151,936-token
    vocabulary, 8 answers of ~900 tokens, whose whole-batch float32 logits would take
    ~4 GB. The step's peak resident memory growth must stay within train.py's memory
    plan (16 bytes a parameter + activations + 5 float32 logit chunks of 256 MiB:
    ~1.5 GiB), which is itself under half of those logits."""
    r = subprocess.run(
        [sys.executable, "tools/bench_train.py", "--shape", "small", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["whole_batch_logits_bytes"] > 3.5 * 2**30
    assert out["plan_bytes"] < out["whole_batch_logits_bytes"] / 2
    assert out["peak_bytes"] < out["plan_bytes"], out


@pytest.mark.fast
def test_logits_are_float32_under_autocast():
    """The trainer's forward runs under bf16 autocast on a GPU; its logits must still be float32, the
    head's matmul included (vLLM's logprobs are compared with these, and every ratio pi/mu carries
    what they round: PipelineRL needed an fp32 lm_head for logprob parity). Under CPU autocast
    (bf16, as CUDA's), the head of grpo.answer_logprobs gives float32 logits, and its logprobs equal
    an fp32 reference from the same hidden states (before: head(hidden) in bf16, cast after)."""
    model, batch = small_model(), with_logprobs(batch_of([7, 30, 12]))
    head = model.get_output_embeddings()
    seen = []
    # the chunks' calls, (n, H); not the model's own (logits_to_keep=1: (B, 1, H)), whose logits go unused
    head.register_forward_hook(lambda m, args, out: seen.append((args[0], out.dtype)) if args[0].dim() == 2 else None)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp = grpo.answer_logprobs(model, batch, 0.7, "cpu")
    assert seen and all(dtype == torch.float32 for _, dtype in seen), [d for _, d in seen]
    hidden = torch.cat([h for h, _ in seen]).float()  # what the model gave the head (bf16 under autocast)
    targets = torch.cat([s["token_ids"] for s in batch])
    reference = torch.log_softmax(hidden @ head.weight.T / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, reference, rtol=0, atol=1e-5)


@pytest.mark.fast
def test_buffer_device_follows_backend():
    """torch names backends in lowercase: the receive buffers must not depend on "NCCL"."""
    import tempfile
    import torch.distributed as dist
    from system.push import buffer_device

    assert dist.ProcessGroupGloo(dist.FileStore(tempfile.mktemp(), 1), 0, 1).name() == "gloo"
    assert buffer_device("nccl", "cuda:0") == "cuda:0"
    assert buffer_device("gloo", "cuda:0") == "cpu"


def test_optimizer_state_saved_on_a_gpu_resumes_on_cpu(tmp_path, monkeypatch):
    """A trainer_state.pt whose tensors are tagged cuda:1 (as saved by the trainer on GPU 1)
    loads on this CPU-only machine, and the optimizer steps with it."""
    import torch.serialization

    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    os.makedirs(tmp_path / "ckpt")
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
        torch.save(dict(opt=opt.state_dict(), step=3), tmp_path / "ckpt" / "trainer_state.pt")
    with pytest.raises(RuntimeError, match="CUDA"):  # what --resume did before map_location
        torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)
    state = checkpoint.load_trainer_state(str(tmp_path))
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(state["opt"])
    opt2.step()
    assert all(v.device.type == "cpu" for st in opt2.state.values() for v in st.values() if torch.is_tensor(v))


def test_gpu_check_on_cpu(tmp_path):
    """tools/gpu_check.py, the GPU user's first command, run here with the tiny model and
    its multi-GPU checks, every check it has: the device layout, the sync check to 2
    engines, a regime under torchrun with 2 trainer ranks and 2 engines, and the push
    against a raw broadcast (bench_sync.py --only sync, 3 rounds: its memory against the plan
    checked, its ms ratio printed, not checked, as every timing in the suite), pass, within
    their deadline, with every weight group's collectives as NCCL's on a GPU (tests/faults.py
    --nccl, in every process: the first collective blocks until every rank has made one, wait()
    returns at once; bench_sync's raw receiver left once its receives were queued, and its
    trainer's last round waited for ever; and trainer rank 0 issues no collective of the ranks' group while
    a weight-group work is pending: NCCL does not support two communicators busy at once on one GPU;
    tests/faults.py --one-communicator). That regime's run directory
    is then checked as test_smoke.py checks a run (tests/helpers.py's check_run): train.py
    end to end with 2 ranks and 2 engines (the other regimes and a resume under torchrun:
    test_smoke.py, tests/test_ranks.py). Its checks' tensor code on faked devices:
    tests/test_gpu_check.py."""
    from helpers import check_run

    one = tmp_path / "one-communicator.log"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "faults.py"),
            "--nccl",
            "--one-communicator",  # in every process: no trainer-ranks collective beside a pending weight-group work
            str(one),
            "--",
            os.path.join(ROOT, "tools", "gpu_check.py"),
            "--model",
            "tiny",
            "--dataset",
            "synth",
            "--steps",
            "3",
            "--regimes",
            "stale",
            "--engines",
            "2",
            "--ranks",
            "2",
            "--bench-rounds",
            "3",
            "--sync-target",  # the tiny model's push takes ms: timed here, a loaded machine decides the ratio
            "inf",  # (CI missed 1.2x once, 0.020 s vs 0.015 s); bench_sync.py alone checks it
            "--deadline-s",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("[PASS]") == 4 and "4/4 checks passed" in r.stdout
    assert "[PASS] devices: generator cpu, cpu; trainer ranks cpu, cpu" in r.stdout
    push = next(x for x in r.stdout.splitlines() if x.startswith("[PASS] push vs raw broadcast: the trainer blocked"))
    assert re.search(r"-> \d+\.\d\dx; not checked \(--sync-target inf\); push memory", push), push
    assert "live peak" in push and "the plan's" in push  # memory within its plan is still checked
    # checked where it applies: trainer rank 0, collectives of both groups (a line a process)
    checked = [re.search(r"rank (\S+): (\d+) trainer-group collectives, (\d+) weight-group", x) for x in one.open()]
    assert any(m[1] == "0" and int(m[2]) and int(m[3]) for m in checked), one.read_text()
    run = tmp_path / "out" / "gpu_check" / "stale"
    check_run(str(run), "stale", steps=3)
    assert os.path.isdir(run / "ckpt" / "optimizer")  # the ranks' optimizer shards


@pytest.mark.fast
def test_advantages_by_hand():
    """GRPO's advantage on rewards worked by hand: a group of 1, 0, 0, 1 (mean 0.5, unbiased
    std sqrt(1/3)) and a group all wrong, whose advantages are 0 (nothing to learn from it); in
    the rewards' dtype, float32."""
    adv = grpo.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 4)
    a = 0.5 / (3**-0.5 + 1e-4)
    assert adv.dtype == torch.float32, f"advantages in {adv.dtype}: the task asks for the rewards' dtype, float32"
    assert adv.shape == (8,) and torch.allclose(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)


@pytest.mark.fast
def test_boxed_frac_counts_what_the_format_reward_pays():
    """boxed_frac is the share of answers whose last \\boxed{} holds a number (synth): what
    --format-reward pays for. Empty and number-less boxes, and an earlier box followed by
    an empty one, do not count (they did until the metric was tied to reward.boxed_answer)."""
    texts = ["so \\boxed{42}", "\\boxed{}", "\\boxed{x}", "\\boxed{7} then \\boxed{}"]

    class Texts:  # the tiny model's tokenizer has no backslash or braces: answer i decodes to texts[i]
        def batch_decode(self, ids, skip_special_tokens):
            return [texts[i[0]] for i in ids]

    batch = [dict(token_ids=torch.tensor([i]), finish_reason="stop", answer="42") for i in range(4)]
    cfg = dict(dataset="synth", format_reward=0.1, group_size=4, truncated="zero")
    adv, scores = grpo.score_batch(cfg, Texts(), batch)
    assert scores["boxed_frac"] == 0.25 and scores["reward_mean"] == pytest.approx(0.25)
