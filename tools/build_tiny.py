"""
The tiny preset: a ~0.8M-parameter Qwen3-architecture model and a word-level
tokenizer, both built here (no hub), warm-started by a short supervised phase on
the synthetic task so that RL has signal (some answers right) and headroom (many
wrong). Saved in Hugging Face format, so vLLM and transformers load it like any
checkpoint.

    python tools/build_tiny.py            # the model's directory: weights/tiny, shipped with the repository
    python tools/build_tiny.py --rebuild  # build it yourself from the recipe (~1.5 min), print its directory
    python tools/build_tiny.py tiny-long  # the long preset's warm start (weights/tiny-long; ~6 min to rebuild)

The repository ships the warm-started weights (weights/tiny, 3 MB): the same recipe
gives a different model on a different processor, and every newcomer should start
from the README's numbers: `--model tiny` is weights/tiny (config.PRESET_MODELS).
A build is cached under out/<name>-<hash>/, where the hash covers the recipe below and
the code that makes the data and the model (train.py --model out/tiny-<hash> uses
it); a test fails while the shipped weights' hash is not the current one, so
changing either means shipping a new build (copy it to weights/<name>).

tiny-long, the long preset's warm start, is the same model taught 1-12 operations
and stopped half-way through learning to chain them: its supervised loss falls from
~0.25 to ~0.05 between steps ~350 and ~500 of a 900-step schedule, and at step 400
it chains 2 operations 90% of the time, 3 only 27% and 4 only 9% (lab/archive.md). RL then
has a half-learned skill to sharpen; from a model that has finished the jump, or has
not started it, it barely moves the long-tailed mix (step 450, the warm start until
2026-12-02, gained 6 points less).
"""

import ast
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules (data, ...), wherever this is run from

RECIPE = dict(
    hidden=128,
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=32,
    ffn=384,
    max_pos=512,
    sft_steps=300,
    batch=32,
    lr=3e-3,
    warmup=30,
    min_steps=1,
    max_steps=8,
    seed=0,
)
RECIPES = {  # --model NAME: the supervised phase of each, stop_at steps into its sft_steps-step lr schedule
    "tiny": RECIPE,
    "tiny-long": dict(RECIPE, max_steps=12, sft_steps=900, stop_at=400),  # 450 until 2026-12-02 (lab/archive.md)
}
EOS = "<|endoftext|>"


def build_tokenizer():
    """Word-level tokenizer: words keep a leading '▁' for the space before them,
    digits are single tokens (so arithmetic is learnable), punctuation and '\\n'
    are tokens. Decoding turns '▁' back into spaces, so text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, Regex
    from transformers import PreTrainedTokenizerFast
    from data import synth_split, make_prompt

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    corpus = []
    for steps in range(1, 17):  # every word the synth task can produce, at any length
        for p in synth_split("train", 200, steps):
            corpus.append(make_prompt(None, p["question"], "synth") + " " + p["solution"])
    words = sorted({w for text in corpus for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)})
    specials = [EOS, "[UNK]"]
    tok.model = models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]")
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token="[UNK]")


def build_model(vocab_size, r):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=r["hidden"],
        intermediate_size=r["ffn"],
        num_hidden_layers=r["layers"],
        num_attention_heads=r["heads"],
        num_key_value_heads=r["kv_heads"],
        head_dim=r["head_dim"],
        max_position_embeddings=r["max_pos"],
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(r["seed"])
    return Qwen3ForCausalLM(config)


def sft(model, tokenizer, r):
    """Teacher-forced cross-entropy on the worked solutions (prompt tokens masked)."""
    import torch
    from tqdm import tqdm
    from data import synth_problem, make_prompt

    rng = random.Random(r["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], weight_decay=0.01)
    model.train()
    for step in (bar := tqdm(range(r.get("stop_at", r["sft_steps"])), desc="tiny warm-start", unit="step")):
        ids, labels = [], []
        for _ in range(r["batch"]):
            p = synth_problem(rng, rng.randint(r["min_steps"], r["max_steps"]))
            prompt = tokenizer(make_prompt(None, p["question"], "synth"))["input_ids"]
            answer = tokenizer(" " + p["solution"])["input_ids"] + [tokenizer.eos_token_id]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, ids))  # right-pad to the longest sequence in the batch
        x = torch.tensor([s + [0] * (width - len(s)) for s in ids])
        y = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in ids])[:, None]).long()
        lr = r["lr"] * min(1, (step + 1) / r["warmup"]) * 0.5 * (1 + math.cos(math.pi * step / r["sft_steps"]))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def recipe_hash(name="tiny"):
    """The recipe and the code that builds the model, as parsed (ast.dump: a reformatted or
    re-commented source keeps its hash, a changed one does not)."""
    import data

    functions = (data.synth_problem, data.make_prompt, data.TASKS["synth"].prompt, build_tokenizer, build_model, sft)
    code = "".join(ast.dump(ast.parse(textwrap.dedent(inspect.getsource(f)))) for f in functions)
    return hashlib.sha256((json.dumps(RECIPES[name], sort_keys=True) + code).encode()).hexdigest()[:10]


def shipped(name="tiny"):
    """weights/<name>: the warm-started model this repository ships, so that every
    newcomer starts from the same weights. Rebuilding it from the recipe gives a
    different model on a different processor (floating point: 57-69% greedy pass@1
    on two x86-64 CPUs of the same kind, README). None if it is not this recipe's."""
    path = os.path.join(ROOT, "weights", name)
    try:
        with open(os.path.join(path, "recipe.json")) as f:
            return path if json.load(f).get("recipe_hash") == recipe_hash(name) else None
    except FileNotFoundError:
        return None


def tiny_model_dir(root="out", rebuild=False, name="tiny"):
    """Directory of the warm-started model `name` (RECIPES): the shipped weights when
    they are this recipe's, else the cached build under root, building it on first use."""
    if not rebuild and (path := shipped(name)):
        return path
    path = os.path.join(root, f"{name}-{recipe_hash(name)}")
    if os.path.exists(os.path.join(path, "recipe.json")):
        return path
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # more threads than cores crawls
    t0 = time.time()
    r = RECIPES[name]
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), r)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"building the {name} model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)} -> {path}")
    sft(model, tokenizer, r)
    tmp = f"{path}.tmp{os.getpid()}"  # write then rename: a crash never leaves a half-written cache
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, path, dict(r, params=n_params, build_s=round(time.time() - t0, 1), recipe_hash=recipe_hash(name)))
    print(f"{name} model ready in {time.time() - t0:.0f}s")
    return path


def publish(tmp, path, recipe):
    """Finish a cached build (build_tiny.py, build_smol.py): recipe.json last, then rename tmp to
    path. A cache directory with recipe.json is complete; one without is a leftover."""
    with open(os.path.join(tmp, "recipe.json"), "w") as f:
        json.dump(recipe, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)  # a leftover without recipe.json
    os.replace(tmp, path)


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["tiny"]
    if len(names) > 1 or names[0] not in RECIPES:
        sys.exit(f"usage: python tools/build_tiny.py [--rebuild] [{'|'.join(RECIPES)}]")
    print(tiny_model_dir(rebuild="--rebuild" in sys.argv, name=names[0]))
