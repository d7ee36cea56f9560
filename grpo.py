"""
One GRPO step on a batch of finished answers, as both trainers take it (lesson.py in
one process, train.py beside the generator process): advantages, log-probabilities
over micro-batches, the off-policy-corrected loss, the optimizer step, and what a
step logs about where its tokens came from.

The loss, and what it simplifies:
- Reward (reward.py): 1 for a right final answer, else 0, or --format-reward for a
  wrong answer that at least puts something in a \\boxed{} (default 0: correctness only).
- GRPO advantages: reward minus the group mean, over the group std (+1e-4); groups
  of --group-size answers to one prompt, consumed whole.
- Off-policy correction per token with the generation-time logprobs as the
  behaviour policy mu (they come from the weights that actually sampled each
  token, stale KV included: the computation that really ran, so pi/mu is exact):
    --loss tis  (default, PipelineRL-style): w = min(pi/mu, --is-cap), detached;
                loss = -w * A * log pi
    --loss ppo  (AReaL's decoupled PPO): prox = pi before this step (detached);
                loss = -(prox/mu) * min(r*A, clip(r, 1-eps, 1+eps)*A), r = pi/prox.
                With one optimizer step per batch (as here) r = 1 at the only
                step, so the clip never binds and this equals uncapped IS.
- The mean over the batch's tokens (--loss-agg token: every token counts the same),
  or over answers of each answer's mean (answer: the original GRPO), or the sum over
  tokens over answers x --max-new-tokens (constant: Dr. GRPO), accumulated over
  micro-batches of --micro-batch-tokens (train_step), no KL term, no
  entropy bonus, one optimizer step per batch, AdamW with a linear warmup
  (--warmup-steps), then a constant or cosine-decayed learning rate (--lr-schedule).
"""

import math

# -----------------------------------------------------------------------------
# advantages, log-probabilities over micro-batches, the loss, the schedule, the step



def advantages(rewards, group_size):
    """GRPO: each answer's reward minus its group's mean, over the group's std (+1e-4).
    rewards: (groups x group_size,) in group order -> the same shape."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def score_batch(cfg, tokenizer, batch):
    """Rewards and GRPO advantages of a batch of finished answers (whole groups of
    --group-size, in order). An answer cut at --max-new-tokens earns 0 (reward.py), and
    with --truncated filter gets no gradient either (DAPO's overlong filtering).
    Returns (advantages (answers,), what the step logs about its answers)."""
    import torch
    from reward import boxed_answer, reward
    texts = tokenizer.batch_decode([s["token_ids"].tolist() for s in batch], skip_special_tokens=True)
    truncated = torch.tensor([s["finish_reason"] == "length" for s in batch])
    rewards = torch.tensor([reward(t, s["answer"], cfg["dataset"], cfg["format_reward"], bool(cut))
                            for t, s, cut in zip(texts, batch, truncated)])
    adv = advantages(rewards, cfg["group_size"])
    if cfg["truncated"] == "filter":
        adv[truncated] = 0.0
    return adv, dict(reward_mean=rewards.mean().item(), truncated_frac=truncated.float().mean().item(),
                     # what --format-reward pays for: a last \boxed{} that holds an answer
                     boxed_frac=sum(boxed_answer(t, cfg["dataset"]) for t in texts) / len(batch))


def as_tensors(sample):
    """A finished answer's numpy arrays (engine.Rollout.to_sample) as torch tensors, sharing their memory."""
    import numpy as np
    import torch
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in sample.items()}


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
    logits = head(hidden).float() / temperature  # (n, V)
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def answer_logprobs(model, samples, temperature, device):
    """log pi(token) of every answer token of `samples` under `model`, concatenated
    sample by sample into one (N,) tensor (N = answer tokens). Logits exist only at
    answer positions and a chunk at a time: each chunk is checkpointed, so backward
    recomputes its logits instead of keeping all of them (at the gsm8k defaults,
    whole-batch float32 logits would be ~190 GB)."""
    import torch
    from torch.utils.checkpoint import checkpoint
    seqs = [torch.cat([s["prompt_ids"], s["token_ids"]]).long() for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)], attn[i, :len(x)] = x, 1
    # use_cache=False: a training forward needs no KV cache (made by default, it would hold
    # every layer's keys and values for the whole micro-batch: ~1.8 GB at 16k tokens on Qwen3-0.6B).
    # The model itself is called, for the last hidden states, not its decoder: under FSDP2 the
    # root's hooks gather the weights (the lm_head's too) and reduce their gradients; logits_to_keep=1
    # makes its own logits one position
    hidden = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False, logits_to_keep=1,
                   output_hidden_states=True).hidden_states[-1]  # (B, W, H), after the final norm
    # answer token j of sample i sits at position P+j and is predicted from position P+j-1
    rows = torch.cat([torch.arange(len(s["prompt_ids"]) - 1, len(x) - 1) + i * width
                      for i, (s, x) in enumerate(zip(samples, seqs))])
    h = hidden.reshape(len(seqs) * width, -1)[rows.to(device)]  # (N, H)
    targets = torch.cat([s["token_ids"] for s in samples]).long().to(device)
    head = model.get_output_embeddings()
    chunk = max(1, LOGIT_CHUNK_BYTES // (4 * head.weight.shape[0]))  # positions per chunk (read here: tests shrink it)
    return torch.cat([checkpoint(chunk_logprobs, head, h[a:a + chunk], targets[a:a + chunk], temperature,
                                 use_reentrant=False) for a in range(0, len(h), chunk)])


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


def train_step(cfg, model, batch, adv, weights, device, n_micro=0):
    """Forward and backward of the whole batch, micro-batch by micro-batch
    (--micro-batch-tokens), gradients accumulating in .grad. Every token of answer i
    counts with weights[i], which token_weights computes for the *whole* batch (more
    than `batch` holds when it is one rank's share), so the gradient is that of the
    batch's loss whatever the split. Returns the loss, and the sum of |log pi - log mu|
    over the answer tokens it ran, and their number.

    An answer whose advantage is 0 (its group's rewards all equal) adds exactly 0 to
    the loss and its gradient, so it is not run at all: the gradient is the same,
    for less work. On long-tailed tasks many groups are all right or all wrong.
    (Several ranks: every rank runs n_micro micro-batches, empty ones if it has fewer,
    since FSDP2's gathers are collective: ranks.py.)"""
    import torch
    run = [i for i, nonzero in enumerate((adv != 0).tolist()) if nonzero]
    loss_sum, gap_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    mbs = micro_batches([batch[i] for i in run], cfg["micro_batch_tokens"])
    for _ in range(n_micro - len(mbs)):  # an empty micro-batch: one token through the model, weighted 0
        empty = dict(prompt_ids=torch.zeros(1, dtype=torch.long), token_ids=torch.zeros(1, dtype=torch.long))
        (0 * answer_logprobs(model, [empty], cfg["temperature"], device).sum()).backward()
    for idx in mbs:
        idx = [run[j] for j in idx]
        mb = [batch[i] for i in idx]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logp = answer_logprobs(model, mb, cfg["temperature"], device)  # (N_mb,)
        behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)
        a = torch.cat([adv[i].expand(len(batch[i]["token_ids"])) for i in idx])
        w = torch.cat([weights[i].expand(len(batch[i]["token_ids"])) for i in idx])
        loss = grpo_loss(cfg, logp, behaviour, a, w)
        loss.backward()
        loss_sum += loss.detach()
        gap_sum += (logp.detach() - behaviour).abs().sum()
    run_tokens = sum(len(batch[i]["token_ids"]) for i in run)
    return loss_sum.item(), gap_sum.item(), run_tokens  # syncs: these, and `run` before any work is queued


def token_weights(cfg, batch):
    """(answers,): how much each token of each answer counts in the loss (--loss-agg).
    A token-level mean over the batch weights every token alike, so long answers
    dominate; the per-answer mean (the original GRPO) weights every answer alike, its
    tokens 1/length each; Dr. GRPO's constant normaliser (answers x --max-new-tokens)
    weights every token alike but does not shrink a batch of short answers' gradient."""
    import torch
    lengths = torch.tensor([len(s["token_ids"]) for s in batch], dtype=torch.float32)
    if cfg["loss_agg"] == "token":
        return torch.full_like(lengths, 1 / max(1.0, lengths.sum().item()))
    if cfg["loss_agg"] == "answer":
        return 1 / (lengths.clamp(min=1) * len(batch))
    return torch.full_like(lengths, 1 / (len(batch) * cfg["max_new_tokens"]))


def grpo_loss(cfg, logp, behaviour, adv, weight):
    """logp, behaviour, adv, weight: (N,) per answer token. Returns the weighted sum
    of the per-token surrogate (token_weights make it a mean)."""
    import torch
    if cfg["loss"] == "tis":
        w = torch.exp(logp.detach() - behaviour).clamp(max=cfg["is_cap"])
        per_token = -w * adv * logp
    else:
        prox = logp.detach()
        r = torch.exp(logp - prox)
        eps = cfg["clip_eps"]
        per_token = -torch.exp(prox - behaviour) * torch.min(r * adv, r.clamp(1 - eps, 1 + eps) * adv)
    return (per_token * weight).sum()


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
    import torch
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # over every rank's shards under FSDP2
    norm = getattr(norm, "full_tensor", lambda: norm)().item()  # a CPU-GPU sync point
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise TrainingDiverged(f"loss {loss}, gradient norm {norm}: not finite; stopped before the optimizer "
                               "step (lower --lr, or look at the step's behaviour_gap for broken logprobs)")
    opt.step()
    return norm

# -----------------------------------------------------------------------------
# what a step logs (metrics.jsonl: the run directory's contract, runlog.py)


def batch_metrics(batch, adv, version):
    """Where the trained tokens came from: stale KV, how many versions old, answers
    spanning versions, over every token the step consumed (trained_tokens); and the same
    over the tokens the loss saw (loss_*: answers whose advantage is not 0). `version`:
    the weights this step trains."""
    import torch
    versions = torch.cat([s["versions"] for s in batch])
    stale = torch.cat([s["stale"] for s in batch])
    in_loss = torch.cat([(a != 0).expand(len(s["versions"])) for s, a in zip(batch, adv)])
    return dict(trained_tokens=len(versions), answer_len=len(versions) / len(batch),
                stale_token_frac=stale.float().mean().item(),
                lag_mean=(version - versions.float()).mean().item(), lag_max=(version - versions).max().item(),
                spanning_frac=sum(int(s["versions"].min() != s["versions"].max()) for s in batch
                                  if len(s["versions"])) / len(batch),
                loss_tokens=int(in_loss.sum()), loss_stale_token_frac=stale[in_loss].float().mean().nan_to_num(0).item(),
                loss_lag_mean=(version - versions[in_loss].float()).mean().nan_to_num(0).item())


def generator_metrics(stats, prev, seconds):
    """What the generator did since the last step, from its cumulative counters."""
    prev = prev or dict.fromkeys(stats, 0)
    return dict(gen_tok_per_s=(stats["gen_tokens"] - prev["gen_tokens"]) / seconds,
                gen_idle_s=stats["gen_idle_s"] - prev["gen_idle_s"],
                **{k: stats[k] - prev[k] for k in ("discarded_tokens", "recomputed_tokens",
                                                   "preempted")})  # preempted: kept at 0 (engine.kv_capacity)
