"""
What guards a run before anything expensive starts: every check here runs before the generator
(and, where it can, before torch) loads, so that a mistake costs seconds, not the minutes of a
model load and an engine start. It protects the user from a typo in a flag or a file that
surfaces ten minutes in, or as a traceback (config.check_config, check_model and
data.load_splits: one line, exit code 2, via data.UsageError); vLLM capping answers without a
word, or refusing in the generator after its start (check_budget); a trainer that runs out of
GPU memory after the model loaded (check_memory_plan); and a KV cache that cannot hold one group
(check_kv_plan). Where each process runs is system/devices.py's. train.py and lesson.py call
one of these per line of their setup; this file says how each works.
"""

import os
import sys

from data import UsageError, hub_id_shaped, hub_reachable, make_prompt


def check_model(name):
    """A directory with a config.json, or something shaped like a Hub id (org/name),
    found in the local cache when the Hub is unreachable. Without this a missing path
    reaches transformers as a Hub id and fails there with a traceback."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UsageError(f"--model {name}: a directory without config.json (not a Hugging Face checkpoint)")
        return
    if not hub_id_shaped(name):
        raise UsageError(f"--model {name}: neither a directory nor a Hub id (org/name)")
    if not hub_reachable():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise UsageError(
                f"--model {name}: no such directory, and the Hub is unreachable with no cached copy "
                "of that id: pass a local directory"
            )
        import huggingface_hub.constants  # cached: load it without five retries per file, here and

        os.environ["HF_HUB_OFFLINE"] = "1"  # in the generator (which inherits the environment)
        huggingface_hub.constants.HF_HUB_OFFLINE = True  # read at import: already imported here


def check_budget(path, dataset, problems, max_new_tokens, max_model_len, name=None):
    """The longest prompt plus --max-new-tokens must fit in --max-model-len, and that
    in the model's positions: vLLM would otherwise cap answers without a word, or
    refuse in the generator after its start. Needs the tokenizer, not the model;
    costs one batched tokenization of every prompt (~1 s for GSM8K's 7.5k)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    except OSError as e:  # not a model, or not reachable: transformers says which
        raise UsageError(f"--model {name or path}: {str(e).splitlines()[0]}") from None
    prompts = [make_prompt(tokenizer, p["question"], dataset) for p in problems]
    longest = max(map(len, tokenizer(prompts, add_special_tokens=False)["input_ids"]))
    max_model_len = max_model_len or positions  # None: the model's own (eval.py's default for synth)
    if positions and max_model_len > positions:
        raise UsageError(f"--max-model-len {max_model_len} exceeds the model's {positions} positions")
    if longest + max_new_tokens > max_model_len:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens} does not fit --max-model-len {max_model_len} after the "
            f"longest prompt ({longest} tokens): lower it to {max_model_len - longest} or raise "
            f"--max-model-len to {longest + max_new_tokens}"
        )


def memory_plan(cfg, config, logit_chunk_bytes, world=1):
    """The trainer's memory per rank (rank 0's, the most), estimated from the model's config
    before the model loads (bytes by item). AdamW with float32 master weights: 4 (weights) +
    4 (grads) + 8 (two moments) bytes per parameter, divided among the `world` ranks under
    FSDP2, which gathers a layer's float32 weights at a time (two: the next is prefetched).
    The push (push_plan): what rank 0 holds of the tensors it sent, from the push until the
    next optimizer step (so beside that step's activations), and under FSDP2 the float32
    tensor it gathers to send. On a GPU, autocast's bf16 copies of the weights. Activations, per
    token of the largest micro-batch, with or without activation checkpointing, and SDPA
    attention: each layer keeps its float32 input; the layer being recomputed holds
    its bf16 intermediates (q and k float32) and their gradients. Logits: a float32 chunk
    (grpo.LOGIT_CHUNK_BYTES) and ~4 more of its size (scaled logits, exp in logsumexp,
    their gradients)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())  # tied tensors once: what the optimizer holds
    layer_params = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    H, L, I = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    head_dim = head_size(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = 4 * H + 2 * q + 2 * kv + 4 * I  # one layer's intermediates per token (elements)
    on_gpu = cfg["trainer_device"].startswith("cuda")
    b = 2 if on_gpu else 4  # bytes of an intermediate: bf16 under autocast on a GPU, float32 on CPU
    # HF's q_norm and k_norm multiply by their float32 weights (autocast leaves mul alone): q and k leave
    # them float32, whatever b
    layer_bytes = b * layer + (4 - b) * (q + kv)
    # checkpointed (train.py --grad-checkpointing; auto: on a GPU): float32 layer inputs + one layer's
    # intermediates and their gradients; else every layer's intermediates
    per_token = 4 * H * L + 2 * layer_bytes if cfg.get("checkpointing", on_gpu) else layer_bytes * L
    plan = {"weights + grads (fp32)": 8 * n_params // world, "AdamW moments (fp32)": 8 * n_params // world}
    if world > 1:
        plan["FSDP2 gathered layers (fp32)"] = 2 * 4 * layer_params
    if on_gpu:  # autocast keeps the bf16 cast of every weight a matmul reads until its region ends (a
        # micro-batch's forward): every layer's, also under FSDP2, whose gathered weights it casts (the whole
        # model on each rank), and the head's, read by the model's own one position of logits (logits_to_keep=1)
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        plan["autocast's weight copies (bf16)"] = 2 * sum(p.numel() for m in linear for p in m.parameters())
    return {
        **plan,
        **push_plan(model.state_dict(), on_gpu, world, cfg.get("sync_backend", "nccl")),
        f"activations ({cfg['micro_batch_tokens']} tokens)": per_token * cfg["micro_batch_tokens"],
        "logit chunks": 5 * min(logit_chunk_bytes, 4 * config.vocab_size * cfg["micro_batch_tokens"]),
    }


def push_plan(state_dict, on_gpu, world=1, backend="nccl"):
    """What a push holds on trainer rank 0's device (bytes by item), read off the state dict it sends."""
    # ranks.weights sends every tensor, a tied one under each of its names: Qwen3-0.6B's lm_head.weight
    # is its embedding again, 0.31 GB of bf16 that parameters() counts once
    sizes = [t.numel() for t in state_dict.values()]
    item = 2 if on_gpu else 4  # the generator's dtype: bf16 on a GPU, float32 on CPU
    # each tensor goes out as a new tensor in that dtype, or under FSDP2 as the float32 tensor gathered
    # from the shards (DTensor.full_tensor); one float32 rank on CPU sends its parameters themselves
    copies = on_gpu or world > 1
    if not copies:
        held = 0
    elif backend != "nccl" and on_gpu:  # over gloo each tensor moves to host memory as it is posted
        held = item * max(sizes)  # the device holds one at a time
    else:
        # system.push.send_weights holds a copy until it has gone out and its checksum has been read:
        # at most PUSH_SEND_BYTES besides the next one it makes (the largest: the embedding).
        # GeneratorHandle.settle lets the rest go at the next optimizer step, so they are held through
        # that step's forward and backward (test_gpu_check runs send_weights on the meta device against this)
        held = min(PUSH_SEND_BYTES + item * max(sizes), item * sum(sizes))
    plan = {"the push's copies (until the next optimizer step)": held}
    if world > 1 and on_gpu:  # on CPU the float32 tensor gathered is the one sent: among the copies
        # while rank 0 makes the tensor it sends, the float32 one it gathered: one at a time, the largest
        # the embedding (0.62 GB for Qwen3-0.6B, 1.56 GB for Qwen3-4B)
        plan["the push's FSDP2 gather (fp32, one tensor)"] = 4 * max(sizes)
    return plan


def head_size(config):
    """Per attention head: the config's head_dim where it has one (Qwen3), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# How far an engine's receiving runs ahead of vLLM's loader: bytes received and not yet
# loaded, beyond the module vLLM is building. The trainer waits for the load only when the
# engine is this far behind; the engine holds this much more memory during a push
# (engine_plan). See system.push.WeightReceiver.receive_weights. Here, with the plan, so that
# the plan's readers (lesson.py among them) need not import the generator process.
PUSH_AHEAD_BYTES = 64 * 2**20
PUSH_SMALL_BYTES = 2**20  # what a push holds besides modules and the run-ahead (measured ~0.5 MiB: engine_plan)
# The trainer's side: a push posts its broadcasts without waiting for them (the next step's
# forward and backward go on meanwhile), holding what it sent until it has gone out, at most
# this many bytes (system.push.send_weights): all of Qwen3-0.6B in bf16; a larger model waits
# for the engine past it
PUSH_SEND_BYTES = 2 * 2**30


def engine_plan(config, dtype_bytes=2, ahead_bytes=PUSH_AHEAD_BYTES, on_cpu=False):
    """A generator engine's memory outside vLLM's budget (its weights, KV cache, activations), in
    bytes: a push. Two of the largest module at once (vLLM's layerwise reload holds a module's
    received tensors until it is complete, then the layer it builds from them), the run-ahead of
    received buffers (ahead_bytes), on CPU a third module (oneDNN's new packing beside the old),
    and PUSH_SMALL_BYTES. Measured against it: docs/gpu.md, "The engine's memory during a push"."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = head_size(config)
    qkv = H * head_dim * (config.num_attention_heads + 2 * config.num_key_value_heads)
    return (3 if on_cpu else 2) * max(V * H, qkv, 2 * I * H) * dtype_bytes + ahead_bytes + PUSH_SMALL_BYTES


def check_memory_plan(cfg, logit_chunk_bytes, world=1):
    """Print the trainer's memory plan (per rank) and the generator's (per engine); on a GPU,
    stop before loading anything when either cannot fit."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg["model_path"])
    plan = memory_plan(cfg, config, logit_chunk_bytes, world)
    need = sum(plan.values())
    print(
        "trainer memory plan: "
        + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.items())
        + f" -> {need / 2**30:.1f} GiB",
        flush=True,
    )
    on_gpu = cfg["gen_devices"][0].startswith("cuda")
    push = engine_plan(config, 2 if on_gpu else 4, on_cpu=not on_gpu)
    from engine import vllm_env

    share = (
        f"vLLM's share of its GPU ({cfg['gen_memory_utilization']})"
        if on_gpu
        else f"vLLM's KV cache on the CPU ({vllm_env(on_cpu=True)['VLLM_CPU_KVCACHE_SPACE']} GiB)"
    )
    print(
        f"generator memory plan, per engine: {share} + a push's buffers outside it, {push / 2**30:.2f} GiB", flush=True
    )
    for device in sorted({d for d in cfg["gen_devices"] if d.startswith("cuda")} - {cfg["trainer_device"]}):
        left = (1 - cfg["gen_memory_utilization"]) * torch.cuda.get_device_properties(device).total_memory - 2**30
        if push > left:  # 1 GiB kept for the CUDA context and NCCL's buffers
            sys.exit(
                f"train.py: a weight push needs ~{push / 2**30:.1f} GiB on {device} outside vLLM's share, and "
                f"{max(0, left) / 2**30:.1f} GiB are left: lower --gpu-memory-utilization "
                f"(now {cfg['gen_memory_utilization']})"
            )
    train = cfg["trainer_device"]
    if train.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(train)
        # a GPU shared with an engine (system/devices.py: named in both flags) is read before vLLM has started
        # on it: vLLM's share of the card and a push's buffers beside it are not the trainer's
        engine = cfg["gen_memory_utilization"] * total + push if train in cfg["gen_devices"] else 0
        if need > 0.9 * free - engine:  # 10% for the CUDA context and the allocator's fragmentation
            sys.exit(
                f"train.py: the trainer needs ~{need / 2**30:.1f} GiB and {train} has {free / 2**30:.1f} GiB free"
                + (f", {engine / 2**30:.1f} of them the engine's that shares it" if engine else "")
                + f": lower --micro-batch-tokens (now {cfg['micro_batch_tokens']})"
                + (f" or --gpu-memory-utilization (now {cfg['gen_memory_utilization']})" if engine else "")
            )


def check_kv_plan(cfg, info):
    """The generator's KV cache against what may be admitted. Requests in the engine are
    capped at what it holds (engine.kv_capacity), so vLLM never preempts; a cache that
    cannot hold one group stops the run (returns the message)."""
    batch = cfg["prompts_per_step"] * cfg["group_size"]
    print(
        f"vLLM KV cache: {info['kv_tokens']} tokens = {info['kv_answers']} answers of --max-model-len "
        f"{cfg['max_model_len']}; at most {info['admit_at_once']} in the engine at once (a step trains {batch})",
        flush=True,
    )
    if info["admit_at_once"] < cfg["group_size"]:
        return (
            f"train.py: vLLM's KV cache holds {info['kv_answers']} answers of {cfg['max_model_len']} tokens, "
            f"fewer than one group ({cfg['group_size']}): raise --gpu-memory-utilization or lower --max-model-len"
        )
