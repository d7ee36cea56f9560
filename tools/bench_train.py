"""
The trainer alone, no vLLM, no download: train.py's own train_step (micro-batches
grouped by length, logits only at answer positions and a chunk at a time, gradient
accumulation) and AdamW step, on a model built from its config with random weights,
on a batch shaped like a dataset's defaults. Prints the micro-batches it chose,
tokens/s, and peak memory beside train.py's memory plan.

    python tools/bench_train.py --shape gsm8k     # Qwen3-0.6B architecture, 32x8 answers up to 1024 tokens (a GPU)
    python tools/bench_train.py --shape math      # the same, answers up to 2048 tokens
    python tools/bench_train.py --shape small     # CPU, ~1 min: Qwen3's 151,936-token vocabulary, hidden 16 (the tests)
    python tools/bench_train.py --plan            # no run: the memory plan per trainer rank, Qwen3 0.6B-8B, 1-8 ranks

Answer lengths are drawn from a log-normal around --shape's median, capped at its
max_new_tokens (a long tail reaching the cap); --worst-case makes every answer as
long as the cap. Peak memory: torch.cuda.max_memory_allocated on a GPU; on CPU the
growth of the process's peak resident memory across the steps (ru_maxrss).
"""

import argparse
import json
import os
import random
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules (train, generator, ...), wherever this is run from

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)  # Qwen/Qwen3-0.6B's config.json
QWEN3 = {  # their config.json (Hub, 2025), as far as the memory plan reads it; 8B alone unties lm_head
    "Qwen3-0.6B": QWEN3_06B,
    "Qwen3-1.7B": dict(QWEN3_06B, hidden_size=2048, intermediate_size=6144),
    "Qwen3-4B": dict(QWEN3_06B, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    "Qwen3-8B": dict(
        QWEN3_06B,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
}
SHAPES = {  # the dataset defaults of train.py: 32 prompts x 8 answers
    "gsm8k": dict(arch=QWEN3_06B, answers=256, prompt=150, max_new_tokens=1024, median=300),
    "math": dict(arch=QWEN3_06B, answers=256, prompt=120, max_new_tokens=2048, median=600),
    # whole-batch float32 logits of 8 x ~1000 answer tokens at this vocabulary: ~5 GB
    "small": dict(
        arch=dict(
            QWEN3_06B,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=16,
        ),
        answers=8,
        prompt=24,
        max_new_tokens=1024,
        median=1024,
    ),
}


def make_batch(shape, worst_case, vocab, seed=0):
    """Samples as the generator sends them (random tokens; behaviour logprobs near
    the current policy's, so importance weights stay near 1) and their advantages."""
    import torch

    rng = random.Random(seed)
    batch = []
    for _ in range(shape["answers"]):
        n = (
            shape["max_new_tokens"]
            if worst_case
            else max(8, min(shape["max_new_tokens"], int(rng.lognormvariate(0, 0.6) * shape["median"])))
        )
        batch.append(
            dict(
                prompt_ids=torch.randint(vocab, (shape["prompt"],)),
                token_ids=torch.randint(vocab, (n,)),
                logprobs=torch.full((n,), -12.0),
            )
        )  # ~log(1/vocab): a random model's logprobs
    adv = torch.tensor([rng.choice([-1.0, 1.0]) for _ in batch])
    return batch, adv


def print_plans(micro_batch_tokens, world_sizes=(1, 2, 4, 8)):
    """The README's table: GiB per trainer rank on a GPU, by model and number of ranks."""
    from transformers import AutoConfig
    from system.preflight import memory_plan
    from grpo import LOGIT_CHUNK_BYTES

    cfg = dict(trainer_device="cuda:0", micro_batch_tokens=micro_batch_tokens)
    print(
        f"| GiB per trainer rank (--micro-batch-tokens {micro_batch_tokens}) | parameters | "
        + " | ".join(f"{k} rank{'s' * (k > 1)}" for k in world_sizes)
        + " |"
    )
    print("|---|---|" + "---|" * len(world_sizes))
    for name, arch in QWEN3.items():
        config = AutoConfig.for_model("qwen3", **arch)
        plans = [memory_plan(cfg, config, LOGIT_CHUNK_BYTES, k) for k in world_sizes]
        n = plans[0]["weights + grads (fp32)"] / 8
        print(f"| {name} | {n / 1e9:.2f}B | " + " | ".join(f"{sum(p.values()) / 2**30:.1f}" for p in plans) + " |")
    from system.preflight import engine_plan

    print(
        "\n| GiB per generator engine, beside vLLM's share of its GPU | parameters (bf16) | a push's buffers, now "
        "(a module, and the run-ahead) | before (a second copy of the model) | 80 GB card at 0.85: left outside |"
    )
    print("|---|---|---|---|---|")
    for name, arch in QWEN3.items():
        config = AutoConfig.for_model("qwen3", **arch)
        n = memory_plan(cfg, config, LOGIT_CHUNK_BYTES)["weights + grads (fp32)"] / 8
        whole = 2 * n + (2 * config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)  # + lm_head
        print(
            f"| {name} | {2 * n / 2**30:.1f} | {engine_plan(config) / 2**30:.2f} | {whole / 2**30:.1f} | "
            f"{(0.15 * 80e9 - 2**30) / 2**30:.1f} |"
        )


def peak_bytes(device):
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", choices=list(SHAPES), help="model and batch shape")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda:N")
    p.add_argument("--micro-batch-tokens", type=int, default=16384, help="train.py's flag")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first one warms up)")
    p.add_argument("--worst-case", action="store_true", help="every answer as long as max_new_tokens")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print preflight.memory_plan per trainer rank (GPU, "
        "--micro-batch-tokens) for Qwen3 0.6B-8B on 1-8 ranks, and stop",
    )
    args = p.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from system.preflight import memory_plan
    from grpo import LOGIT_CHUNK_BYTES, activation_checkpointing, micro_batches, token_weights, train_step

    if args.plan:
        return print_plans(args.micro_batch_tokens)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = "cuda:0" if device == "cuda" else device
    shape = SHAPES[args.shape]
    cfg = dict(
        micro_batch_tokens=args.micro_batch_tokens,
        temperature=1.0,
        loss="tis",
        is_cap=2.0,
        trainer_device=device,
        loss_agg="token",
    )
    config = AutoConfig.for_model("qwen3", **shape["arch"])
    plan = memory_plan(cfg, config, LOGIT_CHUNK_BYTES)
    batch, adv = make_batch(shape, args.worst_case, config.vocab_size)
    torch.manual_seed(0)
    base = peak_bytes(device)  # before the model exists
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        activation_checkpointing(model)  # as train.py on a GPU
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    mbs = micro_batches(batch, args.micro_batch_tokens)
    answer_tokens = sum(len(s["token_ids"]) for s in batch)
    padded = [len(idx) * max(len(batch[i]["prompt_ids"]) + len(batch[i]["token_ids"]) for i in idx) for idx in mbs]
    times = []
    for _ in range(args.steps):
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        loss, *_ = train_step(cfg, model, batch, adv.to(device), token_weights(cfg, batch).to(device), device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.time() - t0)
    step_s = min(times[1:] or times)
    out = dict(
        shape=args.shape,
        device=device,
        params=sum(p.numel() for p in model.parameters()),
        answers=len(batch),
        answer_tokens=answer_tokens,
        micro_batches=len(mbs),
        largest_micro_batch_tokens=max(padded),
        step_s=round(step_s, 3),
        answer_tok_per_s=round(answer_tokens / step_s),
        padded_tok_per_s=round(sum(padded) / step_s),
        peak_bytes=peak_bytes(device) - (0 if device.startswith("cuda") else base),
        plan_bytes=sum(plan.values()),
        whole_batch_logits_bytes=4 * answer_tokens * config.vocab_size,
        loss=loss,
    )
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    print(
        f"{args.shape} on {device}: {out['params'] / 1e6:.1f}M params, {len(batch)} answers, {answer_tokens} answer "
        f"tokens in {len(mbs)} micro-batches (largest {max(padded)} padded tokens, budget {args.micro_batch_tokens})"
    )
    print(f"  step {step_s:.2f}s -> {out['answer_tok_per_s']} answer tokens/s ({out['padded_tok_per_s']} padded)")
    print(
        f"  peak memory {gib(out['peak_bytes'])} (train.py's plan: {gib(out['plan_bytes'])}; whole-batch float32 "
        f"logits alone would be {gib(out['whole_batch_logits_bytes'])})"
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
