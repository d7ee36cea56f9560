"""
One GRPO step on a batch of finished answers, as both trainers take it: advantages, log-probabilities
over micro-batches, the off-policy-corrected loss (losses.py), the optimizer step, and what a step logs.

What it simplifies: reward 1 for a right final answer, else 0 (or --format-reward for a boxed wrong
one); advantages over groups of --group-size answers consumed whole; the ratio pi/mu, mu the engine's
probability at sampling (stale KV included: only the engine knows it), split as (pi_old/mu), the
sampler-trainer mismatch, times (pi/pi_old), the drift over --minibatches optimizer steps (verl's
ppo_mini_batch_size); the mean over tokens, answers (GRPO) or a constant (Dr. GRPO) by --loss-agg,
accumulated over micro-batches; no KL term, no entropy bonus; AdamW after a linear warmup, then a
constant or cosine learning rate.
"""

import math

import torch
from torch.utils.checkpoint import checkpoint

from losses import LOSSES, loss_settings
from reward import boxed_answer, reward

# -----------------------------------------------------------------------------
# advantages, log-probabilities over micro-batches, the loss, the schedule, the step


def advantages(rewards, group_size):
    """GRPO: each answer's reward minus its group's mean, over the group's std (+1e-4).
    rewards: (groups x group_size,) in group order -> the same shape."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def score_batch(cfg, tokenizer, batch, version=None):
    """Rewards and GRPO advantages of a batch of finished answers (whole groups of
    --group-size, in order). An answer cut at --max-new-tokens earns 0 (reward.py), and
    with --truncated filter gets no gradient either (as DAPO, a GRPO variant, filters).
    Returns (advantages (answers,), what the step logs about its answers). With
    `version` (the weights this step trains), each answer also gets "lag" per token:
    version minus the version that sampled it, which the step's diagnostics split by."""
    for s in batch if version is not None else ():
        s["lag"] = version - s["versions"]
    texts = tokenizer.batch_decode([s["token_ids"].tolist() for s in batch], skip_special_tokens=True)
    truncated = torch.tensor([s["finish_reason"] == "length" for s in batch])
    rewards = torch.tensor(
        [
            reward(t, s["answer"], cfg["dataset"], cfg["format_reward"], bool(cut))
            for t, s, cut in zip(texts, batch, truncated)
        ]
    )
    adv = advantages(rewards, cfg["group_size"])
    if cfg["truncated"] == "filter":
        adv[truncated] = 0.0
    return adv, dict(
        reward_mean=rewards.mean().item(),
        truncated_frac=truncated.float().mean().item(),
        # what --format-reward pays for: a last \boxed{} that holds an answer
        boxed_frac=sum(boxed_answer(t, cfg["dataset"]) for t in texts) / len(batch),
    )


def micro_batches(batch, budget):
    """Split `batch` (samples) into lists of indices whose padded size, rows x longest
    prompt + answer, stays within `budget` tokens. Sorted by length first, so that
    answers of similar length share a micro-batch and little of it is padding; a
    sequence longer than the budget gets a micro-batch of its own."""
    length = lambda i: len(batch[i]["prompt_ids"]) + len(batch[i]["token_ids"])
    out, width = [], 0
    for i in sorted(range(len(batch)), key=length):
        if out and max(width, length(i)) * (len(out[-1]) + 1) <= budget:
            out[-1].append(i)
            width = max(width, length(i))
        else:
            out.append([i])
            width = length(i)
    return out


LOGIT_CHUNK_BYTES = 256 << 20  # float32 logits computed at once: 441 positions of Qwen3's 151,936-token vocabulary


def chunk_logprobs(head, hidden, targets, temperature):
    """hidden: (n, H) -> log pi(targets) (n,), through a (n, V) float32 logit tensor:
    the only full-vocabulary tensor of the step, one chunk at a time."""
    # the head's matmul in float32, autocast off for it alone: under bf16 autocast head(hidden) rounded
    # every logit to bf16, and each ratio pi/mu with it (PipelineRL needed an fp32 lm_head for logprob
    # parity with vLLM). Costs an fp32 (n, H) x (H, V) matmul on a GPU, ~0.3 GFLOP a token for Qwen3-0.6B
    with torch.autocast(hidden.device.type, enabled=False):
        logits = head(hidden.to(head.weight.dtype)).float() / temperature  # (n, V)
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def answer_logprobs(model, samples, temperature, device):
    """log pi(token) of every answer token of `samples` under `model`, concatenated
    sample by sample into one (N,) tensor (N = answer tokens). Logits exist only at
    answer positions and a chunk at a time: each chunk is checkpointed, so backward
    recomputes its logits instead of keeping all of them (at the gsm8k defaults,
    whole-batch float32 logits would be ~190 GB)."""
    seqs = [torch.cat([s["prompt_ids"], s["token_ids"]]).long() for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], attn[i, : len(x)] = x, 1
    # use_cache=False: a training forward needs no KV cache (made by default, it would hold
    # every layer's keys and values for the whole micro-batch: ~1.8 GB at 16k tokens on Qwen3-0.6B).
    # The model itself is called, for the last hidden states, not its decoder: under FSDP2 the
    # root's hooks gather the weights (the lm_head's too) and reduce their gradients; logits_to_keep=1
    # makes its own logits one position
    hidden = model(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        use_cache=False,
        logits_to_keep=1,
        output_hidden_states=True,
    ).hidden_states[-1]  # (B, W, H), after the final norm
    # answer token j of sample i sits at position P+j and is predicted from position P+j-1
    rows = torch.cat(
        [torch.arange(len(s["prompt_ids"]) - 1, len(x) - 1) + i * width for i, (s, x) in enumerate(zip(samples, seqs))]
    )
    h = hidden.reshape(len(seqs) * width, -1)[rows.to(device)]  # (N, H)
    targets = torch.cat([s["token_ids"] for s in samples]).long().to(device)
    head = model.get_output_embeddings()
    chunk = max(1, LOGIT_CHUNK_BYTES // (4 * head.weight.shape[0]))  # positions per chunk (read here: tests shrink it)
    return torch.cat(
        [
            checkpoint(chunk_logprobs, head, h[a : a + chunk], targets[a : a + chunk], temperature, use_reentrant=False)
            for a in range(0, len(h), chunk)
        ]
    )


def activation_checkpointing(model):
    """Keep only each decoder layer's input in the forward and recompute the layer in
    backward: long answers on a 0.6B model fit a 24 GB card (preflight.memory_plan).
    Non-reentrant, the form torch recommends and FSDP2 works with (Hugging Face's default,
    reentrant, runs the recomputation outside autograd, where FSDP2's hooks that gather
    each layer's weights do not see it)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def run_tokens(cfg, batch, adv):
    """The tokens a step runs through the model (train_step): each micro-batch's answers
    times its longest prompt + answer, over the answers whose advantage is not 0. What the
    step's compute grows with (padding and prompts included), unlike the answer tokens it
    consumed; lesson.py's clock charges a step by it."""
    length = lambda s: len(s["prompt_ids"]) + len(s["token_ids"])
    run = [s for s, a in zip(batch, adv.tolist()) if a != 0]
    return sum(len(mb) * max(length(run[i]) for i in mb) for mb in micro_batches(run, cfg["micro_batch_tokens"]))


def needs_pi_old(cfg):
    """Whether a step first computes pi_old (old_logprobs), before any weight moves: with several
    optimizer steps per batch (--minibatches), and for m2po, whose mask is decided over all of a
    step's tokens before any of them trains (loss_settings)."""
    return cfg.get("minibatches", 1) > 1 or cfg["loss"] == "m2po"


def minibatches(n, k):
    """The batch's n answers (whole groups, in order) cut into k parts, one optimizer step each."""
    return [list(range(n * j // k, n * (j + 1) // k)) for j in range(k)]


def old_logprobs(cfg, model, batch, adv, device, n_micro=0):
    """pi_old: log pi of every answer token under the weights before the batch's first
    optimizer step, stored in each answer as "old_logprobs" (no gradient: a forward per
    micro-batch). Needed when --minibatches > 1; with one step per batch pi_old is the
    step's own log pi, detached, and costs nothing. Answers whose advantage is 0 are
    skipped, as train_step skips them."""
    trained = [i for i, nonzero in enumerate((adv != 0).tolist()) if nonzero]
    mbs = micro_batches([batch[i] for i in trained], cfg["micro_batch_tokens"])
    with torch.no_grad():
        empty_micro_batches(cfg, model, n_micro - len(mbs), device)  # several ranks only
        for idx in mbs:
            mb = [batch[trained[j]] for j in idx]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
                logp = answer_logprobs(model, mb, cfg["temperature"], device).float().cpu()
            for s, part in zip(mb, logp.split([len(s["token_ids"]) for s in mb])):
                s["old_logprobs"] = part


def train_step(cfg, model, batch, adv, loss_weights, device, n_micro=0):
    """Forward and backward of the whole batch, micro-batch by micro-batch
    (--micro-batch-tokens), gradients accumulating in .grad. Every token of answer i
    counts with loss_weights[i], which token_weights computes for the *whole* batch (more
    than `batch` holds when it is one rank's share), so the gradient is that of the
    batch's loss whatever the split. Returns floats that add up over ranks: the loss,
    the sum of |log pi - log mu| over the answer tokens it ran and their number, then
    the off-policy sums (offpolicy_sums; offpolicy_metrics turns them into metrics).

    An answer whose advantage is 0 (its group's rewards all equal) adds exactly 0 to
    the loss and its gradient, so it is not run at all: the gradient is the same,
    for less work. On long-tailed tasks many groups are all right or all wrong."""
    trained = [i for i, nonzero in enumerate((adv != 0).tolist()) if nonzero]  # indices into batch
    loss_sum, gap_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    diag = []  # per micro-batch: (log pi - log mu, clipped or masked, stale KV, lag), detached, on `device`
    mbs = micro_batches([batch[i] for i in trained], cfg["micro_batch_tokens"])
    empty_micro_batches(cfg, model, n_micro - len(mbs), device)  # several ranks only
    for idx in mbs:
        idx = [trained[j] for j in idx]
        mb = [batch[i] for i in idx]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logp = answer_logprobs(model, mb, cfg["temperature"], device)  # (N_mb,)
        behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)
        old = (
            torch.cat([s["old_logprobs"] for s in mb]).to(device) if "old_logprobs" in mb[0] else logp.detach()
        )  # pi_old: before the batch's first step (one step per batch: this one)
        a = torch.cat([adv[i].expand(len(batch[i]["token_ids"])) for i in idx])
        w = torch.cat([loss_weights[i].expand(len(batch[i]["token_ids"])) for i in idx])
        answer = torch.cat([torch.full((len(s["token_ids"]),), j) for j, s in enumerate(mb)]).to(device)
        per_token, clipped = LOSSES[cfg["loss"]](cfg, logp, old, behaviour, a, answer)
        loss = (per_token * w).sum()
        loss.backward()
        loss_sum += loss.detach()
        gap_sum += (logp.detach() - behaviour).abs().sum()
        none = [torch.zeros(len(s["token_ids"]), dtype=torch.long) for s in mb]  # a sample without provenance
        diag.append(
            (
                logp.detach() - behaviour,
                clipped,
                torch.cat([s.get("stale", z) for s, z in zip(mb, none)]).bool().to(device),
                torch.cat([s.get("lag", z) for s, z in zip(mb, none)]).to(device),
            )
        )
    gap_tokens = sum(len(batch[i]["token_ids"]) for i in trained)
    # syncs: these, and `trained` before any work is queued
    sums = offpolicy_sums(*(torch.cat(x) for x in zip(*diag))) if diag else [0.0] * 5 * (1 + len(SPLITS))
    return (loss_sum.item(), gap_sum.item(), gap_tokens, *sums)


def empty_micro_batches(cfg, model, n, device):
    """Several ranks (not the lesson's): FSDP2's gathers are collective, so every rank runs
    as many micro-batches as the busiest (train.py's n_micro); a rank with fewer runs n
    empty ones: one token through the model, weighted 0 (a forward alone under no_grad)."""
    for _ in range(n):
        empty = dict(prompt_ids=torch.zeros(1, dtype=torch.long), token_ids=torch.zeros(1, dtype=torch.long))
        logp = answer_logprobs(model, [empty], cfg["temperature"], device)
        if logp.requires_grad:
            (0 * logp.sum()).backward()


def token_weights(cfg, batch):
    """(answers,): how much each token of each answer counts in the loss (--loss-agg).
    A token-level mean over the batch weights every token alike, so long answers
    dominate; the per-answer mean (the original GRPO) weights every answer alike, its
    tokens 1/length each; the GRPO variant Dr. GRPO's constant (answers x --max-new-tokens)
    weights every token alike but does not shrink a batch of short answers' gradient."""
    lengths = torch.tensor([len(s["token_ids"]) for s in batch], dtype=torch.float32)
    if cfg["loss_agg"] == "token":
        return torch.full_like(lengths, 1 / max(1.0, lengths.sum().item()))
    if cfg["loss_agg"] == "answer":
        return 1 / (lengths.clamp(min=1) * len(batch))
    return torch.full_like(lengths, 1 / (len(batch) * cfg["max_new_tokens"]))


def lr_at(cfg, step):
    """Linear warmup, then constant or cosine decay to 0 at the run's last step (as first
    planned: a resumed run keeps the schedule it started with)."""
    lr = cfg["lr"] * min(1.0, step / max(1, cfg["warmup_steps"]))
    if cfg["lr_schedule"] == "cosine":
        lr *= 0.5 * (1 + math.cos(math.pi * (step - 1) / cfg.get("schedule_steps", cfg["steps"])))
    return lr


class TrainingDiverged(RuntimeError):
    pass


def optimizer_step(model, opt, loss):
    """Clip the gradient to norm 1 and take one AdamW step; returns the norm before
    clipping. A parameter with no gradient (every answer's advantage was 0, so
    train_step ran nothing) gets a zero one: every step is the same AdamW step whether
    or not its answers ran (the moments decay; the weights move by momentum alone). A
    non-finite loss or gradient stops the run before the weights change or reach the
    generator."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # over every rank's shards under FSDP2
    norm = getattr(norm, "full_tensor", lambda: norm)().item()  # a CPU-GPU sync point
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise TrainingDiverged(
            f"loss {loss}, gradient norm {norm}: not finite; stopped before the optimizer "
            "step (lower --lr, or look at the step's behaviour_gap for broken logprobs)"
        )
    opt.step()
    return norm


class OneRank:
    """One trainer process (lesson.py; train.py without torchrun): system.ranks.Ranks' collectives,
    each the identity."""

    gather = staticmethod(lambda x: [x])
    sum = staticmethod(lambda *values: values)
    reshard = staticmethod(lambda model: None)


def pi_old(cfg, model, parts, device="cpu", ranks=OneRank):
    """Several steps per batch, or m2po: log pi_old of every part's answers before any weight moves
    (old_logprobs), then the ranks' FSDP2 shards put back (system.ranks.Ranks.reshard)."""
    if needs_pi_old(cfg):
        for answers, adv, _, n_micro in parts:
            old_logprobs(cfg, model, answers, adv.to(device), device, n_micro)
        ranks.reshard(model)


def step(cfg, model, opt, it, parts, device="cpu", ranks=OneRank, settle=lambda: None):
    """--minibatches AdamW steps, one per part: (answers, advantages, token weights, micro-batches).
    Both loops take it: train.py passes what only it has (its ranks' collectives; `settle`, which holds
    an optimizer step until the last push, whose tensors it overwrites, is out), lesson.py nothing. Returns what the
    steps log, summed over the ranks."""
    model.train()
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, it)
    pi_old(cfg, model, parts, device, ranks)
    total = None  # what the parts add up to: loss, |log pi - log mu|, its tokens, off-policy sums, grad norm
    for answers, adv, weights, n_micro in parts:
        opt.zero_grad(set_to_none=True)
        step_cfg = loss_settings(cfg, answers, adv, ranks.gather)  # m2po: its cutoff over every rank's tokens
        out = ranks.sum(*train_step(step_cfg, model, answers, adv.to(device), weights.to(device), device, n_micro))
        settle()  # train.py: the last push may still be reading the weights this step overwrites
        out = (*out, optimizer_step(model, opt, out[0]))
        total = [a + b for a, b in zip(total, out)] if total else list(out)
    loss, gap, gap_tokens, *sums, grad_norm = total
    return dict(
        loss=loss / len(parts),
        grad_norm=grad_norm / len(parts),
        behaviour_gap=gap / max(1, gap_tokens),
        **offpolicy_metrics(sums),
    )


# -----------------------------------------------------------------------------
# what a step logs (metrics.jsonl: the run directory's contract, system/runlog.py)


def batch_metrics(batch, adv, version):
    """Where the trained tokens came from: stale KV, how many versions old, answers
    spanning versions, over every token the step consumed (trained_tokens); and the same
    over the tokens the loss saw (loss_*: answers whose advantage is not 0). `version`:
    the weights this step trains."""
    versions = torch.cat([s["versions"] for s in batch])
    stale = torch.cat([s["stale"] for s in batch])
    in_loss = torch.cat([(a != 0).expand(len(s["versions"])) for s, a in zip(batch, adv)])
    return dict(
        trained_tokens=len(versions),
        answer_len=len(versions) / len(batch),
        stale_token_frac=stale.float().mean().item(),
        lag_mean=(version - versions.float()).mean().item(),
        lag_max=(version - versions).max().item(),
        spanning_frac=sum(int(s["versions"].min() != s["versions"].max()) for s in batch if len(s["versions"]))
        / len(batch),
        loss_tokens=int(in_loss.sum()),
        loss_stale_token_frac=stale[in_loss].float().mean().nan_to_num(0).item(),
        loss_lag_mean=(version - versions[in_loss].float()).mean().nan_to_num(0).item(),
    )


def generator_metrics(stats, prev, seconds):
    """What the generator did since the last step, from its cumulative counters."""
    prev = prev or dict.fromkeys(stats, 0)
    return dict(
        gen_tok_per_s=(stats["gen_tokens"] - prev["gen_tokens"]) / seconds,
        gen_idle_s=stats["gen_idle_s"] - prev["gen_idle_s"],
        gen_drain_s=stats.get("gen_drain_s", 0.0) - prev.get("gen_drain_s", 0.0),  # none in older checkpoints
        **{k: stats[k] - prev[k] for k in ("discarded_tokens", "recomputed_tokens", "preempted")},
    )  # preempted: kept at 0 (engine.kv_capacity)


SPLITS = ("fresh", "stale", "lag0", "lag1", "lag2")  # lag2: two versions or more
SPLITS += tuple(f"{kv}_lag{k}" for kv in ("fresh", "stale") for k in range(3))  # the cache's own share, at equal lag


def offpolicy_sums(log_ratio, clipped, stale, lag):
    """Per trained token (N,): log(pi/mu) at the moment the token trained, whether the loss
    clipped or masked it, whether it read stale KV, its lag. Returns sums that add up over
    ranks and optimizer steps: for all tokens, then each of SPLITS, (tokens, sum of the
    ratio pi/mu, of its square, of k3, clipped tokens)."""
    ratio = log_ratio.double().exp()
    k3 = ratio - 1 - log_ratio.double()  # Schulman's k3: an unbiased, never negative estimate of KL(mu || pi)
    lags = (lag == 0, lag == 1, lag >= 2)
    masks = (torch.ones_like(stale), ~stale, stale, *lags, *(kv & k for kv in (~stale, stale) for k in lags))
    only = lambda x, m: torch.where(m, x, 0.0).sum()  # on the device: no sync until .tolist()
    return torch.stack(
        [
            v.double()
            for m in masks
            for v in (m.sum(), only(ratio, m), only(ratio**2, m), only(k3, m), (clipped & m).sum())
        ]
    ).tolist()


def offpolicy_metrics(sums):
    """How off-policy the step's trained tokens were, from offpolicy_sums (added over ranks
    and steps): ess, the effective sample size of the weights pi/mu over the tokens,
    (sum w)^2 / (n sum w^2), 1 when every weight is equal, near 1/n when one dominates;
    clipped_frac, the share the loss clipped or masked; kl, the mean k3 estimate of
    KL(mu || pi) in nats per token. Then the same per split (ess_stale, ...); None where a
    split has no token."""
    out = {}
    for j, name in enumerate(("",) + tuple("_" + s for s in SPLITS)):
        n, w, w2, k3, clipped = sums[5 * j : 5 * j + 5]
        out.update(
            {
                f"ess{name}": w * w / (n * w2) if n else None,
                f"clipped_frac{name}": clipped / n if n else None,
                f"kl{name}": k3 / n if n else None,
            }
        )
    return out
