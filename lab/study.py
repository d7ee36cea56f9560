"""
The teacher-forcing study: how much of a policy update does a stale KV cache undo,
and how many layers' KV must be recomputed to get it back?

    python lab/study.py                                           # tiny model + synth, CPU, ~20 s
    python lab/study.py --model Qwen/Qwen3-0.6B --dataset gsm8k   # one GPU (--data-file: GSM8K offline)

Not run here: the second command has never run (no GPU has run this project), and no data
file holds a Qwen3-0.6B result. This file's first version (780166e) stated figures for it with
no run behind them, kept as claims for a GPU user to check (--record puts a run on
lab/data/study.jsonl): the stale cache undoes >80% of the update over the first 8 tokens after
the switch and ~49% after token 32; one optimizer step at lr 1e-6 moves the policy ~5e-5
nats/token; recomputing the KV of the first 14 of 28 layers removes ~10% of the stale
divergence, the first 21 ~83%. Its GPU time is an estimate, not a measurement: ~3 min on one
H100/H200 plus the download, bound by latency, not FLOPs (HF `generate` of 32 x 8 answers for
up to 512 steps, then 7 forwards per answer one answer at a time: 2 full + 5 spliced).
The tiny model shows the same shape with smaller numbers and a wide spread across
--seed: few of its answers are right, so the update rests on a handful of groups.

Method. v = the model as loaded; v+1 = v after --updates AdamW steps of train.py's
GRPO loss (tis, is-cap 2) on --prompts x --group-size answers sampled from v at
temperature 1, rewarded by reward.score, group-normalised advantages, behaviour
logprobs = v's own. The same answers are then teacher-forced. For answer tokens
a_0..a_{n-1} and a switch s (1 <= s <= n-1), regimes.Stale's convention: v has
sampled a_0..a_{s-1} and written the KV of prompt + a_0..a_{s-2}; v+1 feeds a_{s-1}
onward. For each t >= s (distance d = t - s + 1), the full-vocabulary next-token
distribution that predicts a_t:

    p_old        v over the whole prefix
    p_fresh      v+1 over the whole prefix (the recompute regime)
    p_stale      v+1 reading v's KV at the prefix positions (the stale regime)
    p_partial(k) as p_stale, but layers 0..k-1 read v+1's KV at the prefix positions
                 (v+1 run over the prefix from the embeddings up); layers k..L-1 keep
                 v's KV as v wrote it: the recomputed lower layers do NOT feed the upper
                 layers' prefix KV. p_partial(0) = p_stale, p_partial(L) = p_fresh.

Reported, pooled (sum of KLs over positions, then the ratio): share undone =
KL(p_fresh||p_stale) / KL(p_fresh||p_old) per distance bin; KL(p_fresh||p_old) per
answer token (all of them) per optimizer step; share of the stale divergence removed
= 1 - KL(p_fresh||p_partial(k)) / KL(p_fresh||p_stale). The models run in float32 on
GPU too: an AdamW step at lr 1e-6 moves each weight by ~1e-6, far below bf16's spacing
(~1e-4 at a weight of 0.02), and bf16's logit noise would swamp KLs of ~5e-5 nats.
"""

import argparse
import copy
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: the course's modules

from config import model_path  # noqa: E402

PER_MODEL = {  # "tiny" vs any hub model: what a plain run uses
    "tiny": dict(lr=1e-4, max_new_tokens=128, prompts=16, threads=1),
    "hub": dict(lr=1e-6, max_new_tokens=512, prompts=32, threads=0),
}
BINS = [(1, 8), (9, 16), (17, 32), (33, None)]  # distance from the switch, 1 = first token v+1 samples


def parse_config(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="tiny", help="'tiny', 'smol' (tools/build_smol.py), a Hub id or a directory")
    p.add_argument("--dataset", default="synth", choices=["synth", "gsm8k", "math"], help="task")
    p.add_argument("--data-file", default=None, help="local .jsonl/.parquet train split in the Hub schema (offline)")
    p.add_argument("--synth-steps", type=int, default=8, help="operations per synth problem (8: ~70-token answers)")
    p.add_argument("--prompts", type=int, default=None, help="prompts sampled from v (default: per model)")
    p.add_argument("--group-size", type=int, default=8, help="answers per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length cap (default: per model)")
    p.add_argument("--updates", type=int, default=1, help="optimizer steps from v to v+1 (on the same answers)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: per model)")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=16384,
        help="padded tokens per forward/backward in the update (train.py's flag)",
    )
    p.add_argument(
        "--switch",
        type=int,
        default=None,
        help="switch position s for every answer (default: uniform over 1..n-1 per answer)",
    )
    p.add_argument("--layers", default=None, help="comma-separated k grid (default: 0, L/4, L/2, 3L/4, L)")
    p.add_argument("--seed", type=int, default=0, help="seed for the sampled answers and switch positions")
    p.add_argument("--device", default="auto", help="auto (cuda, else cpu), cpu, cuda:N")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch, 0: torch's default (default: per model)"
    )
    p.add_argument("--out", default=None, help="output JSON (default: out/study-<model>-<dataset>/study.json)")
    p.add_argument(
        "--record", action="store_true", help="append the summary to lab/data/study.jsonl and rewrite its tables"
    )
    cfg = vars(p.parse_args(argv))
    for k, v in PER_MODEL["tiny" if cfg["model"] == "tiny" else "hub"].items():
        cfg[k] = v if cfg[k] is None else cfg[k]
    name = os.path.basename(os.path.normpath(cfg["model"]))
    cfg["out"] = cfg["out"] or os.path.join("out", f"study-{name}-{cfg['dataset']}", "study.json")
    return cfg


def sample_answers(model, tokenizer, problems, cfg, device):
    """--group-size answers per prompt from v, one batched HF generate (left-padded).
    Returns samples as train.py knows them (prompt_ids, token_ids; EOS kept, as vLLM does)
    plus the prompt index."""
    import torch
    from data import make_prompt

    prompts = [tokenizer(make_prompt(tokenizer, p["question"], cfg["dataset"]))["input_ids"] for p in problems]
    rows = [i for i in range(len(prompts)) for _ in range(cfg["group_size"])]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows], device=device)
    attn = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=device)
    # the full distribution at temperature 1: Qwen's generation_config would add top_k=20, top_p=0.95
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=cfg["max_new_tokens"],
        pad_token_id=pad,
    )[:, width:].cpu()  # (B, <=max_new)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    samples = []
    for i, row in zip(rows, out.tolist()):
        n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))  # up to and including the first EOS
        samples.append(dict(prompt=i, prompt_ids=torch.tensor(prompts[i]), token_ids=torch.tensor(row[:n])))
    return samples


def update(model, samples, problems, tokenizer, cfg, device):
    """v -> v+1: --updates AdamW steps of train.py's GRPO loss on the samples (train.py's
    own train_step: the token-level mean over the whole batch, in micro-batches).
    Returns the rewards."""
    import torch
    from reward import score
    from grpo import advantages, answer_logprobs, micro_batches, token_weights, train_step

    texts = tokenizer.batch_decode([s["token_ids"].tolist() for s in samples], skip_special_tokens=True)
    rewards = torch.tensor([score(t, problems[s["prompt"]]["answer"], cfg["dataset"]) for t, s in zip(texts, samples)])
    adv = advantages(rewards, cfg["group_size"]).to(device)  # GRPO's, as the lesson and train.py compute them
    if not adv.any():
        print("warning: every group's answers got the same reward: the update is zero and v+1 == v")
    with torch.no_grad():  # behaviour policy mu = v itself, as if sampled on-policy by the generator
        for idx in micro_batches(samples, cfg["micro_batch_tokens"]):
            logp = answer_logprobs(model, [samples[i] for i in idx], 1.0, device).cpu()
            for i, row in zip(idx, logp.split([len(samples[i]["token_ids"]) for i in idx])):
                samples[i]["logprobs"] = row
    loss_cfg = dict(
        loss="tis", is_cap=2.0, temperature=1.0, micro_batch_tokens=cfg["micro_batch_tokens"], loss_agg="token"
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    for _ in range(cfg["updates"]):
        opt.zero_grad(set_to_none=True)
        train_step(loss_cfg, model, samples, adv, token_weights(loss_cfg, samples), device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as train.py
        opt.step()
    return rewards


def splice(old_cache, new_cache, k, m, config):
    """A cache of the first m positions: layers < k hold v+1's KV, layers >= k hold v's.
    Each layer's keys/values: (1, kv_heads, m, head_dim), keys after k_norm and RoPE."""
    from transformers import DynamicCache

    src = [new_cache.layers[i] if i < k else old_cache.layers[i] for i in range(len(old_cache.layers))]
    # DynamicCache copies on update (torch.cat), so the sliced views are never written to
    return DynamicCache([(layer.keys[:, :, :m], layer.values[:, :, :m]) for layer in src], config=config)


def switch_logprobs(old, new, prompt_ids, token_ids, s, ks, device):
    """Next-token log-probs (float64, full vocab) predicting a_s..a_{n-1}, each (n-s, V):
    {"old", "fresh", "stale", k: partial(k) for k in ks}; plus "old_all", "fresh_all"
    (n, V) over every answer token."""
    import torch

    P, n = len(prompt_ids), len(token_ids)
    ids = torch.cat([prompt_ids, token_ids]).long()[None].to(device)  # (1, P+n)
    out_old, out_new = old(ids, use_cache=True), new(ids, use_cache=True)
    # logits at position P+t-1 predict a_t. the KV at position j depends on tokens <= j only,
    # so the whole-sequence cache cut to m = P+s-1 positions is the cache of prompt + a_:s-1
    # float64 from here: KL(p||q) is second order in the logit difference, but summed from float32
    # log-probs it picks up first-order rounding (~1e-7 x |log p| per token), as big as the KLs of
    # a 1e-6 step (~5e-5 nats). out_new.logits[0, P-1:P+n-1]: (n, V)
    lp = {
        "old_all": torch.log_softmax(out_old.logits[0, P - 1 : P + n - 1].double(), -1),
        "fresh_all": torch.log_softmax(out_new.logits[0, P - 1 : P + n - 1].double(), -1),
    }
    lp["old"], lp["fresh"] = lp["old_all"][s:], lp["fresh_all"][s:]
    m, rest = P + s - 1, ids[:, P + s - 1 : P + n - 1]  # v+1 feeds a_{s-1}..a_{n-2}: (1, n-s)
    for k in sorted(set(ks) | {0}):
        cache = splice(out_old.past_key_values, out_new.past_key_values, k, m, new.config)
        lp[k] = torch.log_softmax(new(rest, past_key_values=cache, use_cache=True).logits[0].double(), -1)
    lp["stale"] = lp[0]
    return lp


def kl(p, q):
    """KL(p||q) per position from log-probs (n, V) -> (n,)."""
    return (p.exp() * (p - q)).sum(-1)


def summarise(rows, ks, cfg):
    """Pool the per-position KLs of all answers (sum over positions, then the ratio). Ratios
    are None when v+1 == v (lr 0, or every group's rewards equal): there is nothing to undo."""
    import torch

    cat = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    moved = cat["all"].sum().item() > 0
    ratio = lambda a, b: a.sum().item() / b.sum().item() if moved and b.sum() > 0 else None
    removed = lambda k: None if (r := ratio(cat[k], cat["stale"])) is None else 1 - r
    bins = []
    for lo, hi in BINS:
        sel = (cat["d"] >= lo) & (cat["d"] <= (hi or 1 << 30))
        bins.append(
            dict(
                bin=f"{lo}-{hi}" if hi else f">{lo - 1}",
                tokens=int(sel.sum()),
                kl_fresh_old=cat["old"][sel].sum().item(),
                kl_fresh_stale=cat["stale"][sel].sum().item(),
                share_undone=ratio(cat["stale"][sel], cat["old"][sel]),
            )
        )
    return dict(
        answers=len(rows),
        positions=len(cat["d"]),
        bins=bins,
        share_undone=ratio(cat["stale"], cat["old"]),
        kl_per_token_per_step=cat["all"].mean().item() / max(1, cfg["updates"]),
        partial=[dict(k=k, kl_fresh_partial=cat[k].sum().item(), share_removed=removed(k)) for k in ks],
    )


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([x["bin"] for x in res["bins"]], [100 * (x["share_undone"] or 0) for x in res["bins"]])
    a.set(
        xlabel="distance from the switch (tokens)",
        ylabel="% of the update undone",
        title="KL(fresh||stale) / KL(fresh||old)",
    )
    b.plot([x["k"] for x in res["partial"]], [100 * (x["share_removed"] or 0) for x in res["partial"]], "o-")
    b.set(
        xlabel="first k layers' prefix KV recomputed",
        ylabel="% of stale divergence removed",
        title=f"1 - KL(fresh||partial k) / KL(fresh||stale), L = {res['layers']}",
        xticks=[x["k"] for x in res["partial"]],
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    cfg = parse_config(argv)
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data import load_problems

    device = cfg["device"] if cfg["device"] != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and cfg["threads"]:
        # the tiny model's ops are too small to gain from more threads, and when other processes
        # share the cores (the trainer, vLLM) OpenMP's spinning threads make it ~10x slower
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    path = model_path(cfg["model"])  # 'tiny', 'smol' (built by tools/build_smol.py), a directory or a Hub id
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()  # float32: see docstring
    L = old.config.num_hidden_layers
    ks = [int(k) for k in cfg["layers"].split(",")] if cfg["layers"] else sorted({0, L // 4, L // 2, 3 * L // 4, L})
    assert all(0 <= k <= L for k in ks), f"--layers must lie in 0..{L}"
    print(json.dumps(cfg, indent=1))

    problems = load_problems(
        cfg["dataset"], "train", n=cfg["prompts"], data_file=cfg["data_file"], steps=cfg["synth_steps"]
    )
    with torch.no_grad():
        samples = sample_answers(old, tokenizer, problems, cfg, device)
    new = copy.deepcopy(old)
    rewards = update(new, samples, problems, tokenizer, cfg, device)
    new.eval()

    rng, rows = random.Random(cfg["seed"]), []
    with torch.no_grad():
        for smp in tqdm(samples, desc="teacher forcing", unit="answer"):
            n = len(smp["token_ids"])
            s = cfg["switch"] if cfg["switch"] is not None else rng.randint(1, max(1, n - 1))
            if not 1 <= s <= n - 1:  # no token after the switch to measure
                continue
            lp = switch_logprobs(old, new, smp["prompt_ids"], smp["token_ids"], s, ks, device)
            rows.append(
                {
                    "d": torch.arange(1, n - s + 1),
                    "old": kl(lp["fresh"], lp["old"]).cpu(),
                    "stale": kl(lp["fresh"], lp["stale"]).cpu(),
                    "all": kl(lp["fresh_all"], lp["old_all"]).cpu(),
                    **{k: kl(lp["fresh"], lp[k]).cpu() for k in ks},
                }
            )
    assert rows, "no answer has a token after its switch position"
    res = dict(
        config=cfg,
        layers=L,
        device=device,
        reward_mean=rewards.mean().item(),
        answer_len=sum(len(s["token_ids"]) for s in samples) / len(samples),
        **summarise(rows, ks, cfg),
    )
    os.makedirs(os.path.dirname(cfg["out"]) or ".", exist_ok=True)
    with open(cfg["out"], "w") as f:
        json.dump(res, f, indent=1)
    png = os.path.splitext(cfg["out"])[0] + ".png"
    plot(res, png)

    pct = lambda x: "   n/a" if x is None else f"{100 * x:5.1f}%"
    print(
        f"\n{res['answers']} answers (mean {res['answer_len']:.0f} tokens, reward {res['reward_mean']:.2f}), "
        f"{res['positions']} positions after the switch; L = {L} layers"
    )
    print(f"KL(fresh||old) per token per optimizer step: {res['kl_per_token_per_step']:.2e} nats")
    print("distance  tokens  share undone")
    for b in res["bins"]:
        print(f"{b['bin']:>8}  {b['tokens']:6d}  {pct(b['share_undone'])}")
    print(f"{'all':>8}  {res['positions']:6d}  {pct(res['share_undone'])}")
    print("k layers recomputed  share of stale divergence removed")
    for x in res["partial"]:
        print(f"{x['k']:19d}  {pct(x['share_removed'])}")
    print(f"wrote {cfg['out']} and {png}")
    if cfg["record"]:
        record(res)
    return res


# The committed record: `python lab/study.py --seed S --record` appends one line per run to
# lab/data/study.jsonl, and the pages' study table and values (TABLES, VALUES) are written from
# that file alone, between markers (lab/marked.py; tests/test_marked.py rebuilds them).
SETTINGS = ("model", "dataset", "synth_steps", "prompts", "group_size", "max_new_tokens", "updates", "lr", "seed")


def marked_tables():
    """lab/marked.py, the pages' marked tables (imported when a record is made or read)."""
    import marked

    return marked


def record(res):
    marked = marked_tables()
    first, after = res["bins"][0], res["bins"][-1]
    line = dict(
        {k: res["config"][k] for k in SETTINGS},
        layers=res["layers"],
        answers=res["answers"],
        answer_len=round(res["answer_len"], 1),
        reward_mean=round(res["reward_mean"], 4),
        undone_first8=first["share_undone"],
        undone_after32=after["share_undone"],
        kl_per_token_per_step=res["kl_per_token_per_step"],
        removed={str(x["k"]): x["share_removed"] for x in res["partial"]},
        processor=marked.processor(),
        commit=marked.commit(),
    )
    marked.record("study", line, key=[*SETTINGS, "processor"])
    for page, name in marked.write(TABLES, values=VALUES):
        print(f"wrote table {name} in {page}")


def tiny_runs():
    """The recorded runs of a plain `python lab/study.py --seed S` (tiny model, synth, its defaults)."""
    marked = marked_tables()
    plain = {k: v for k, v in parse_config([]).items() if k in SETTINGS and k != "seed"}
    runs = {}
    for r in marked.read("study"):
        if all(r[k] == v for k, v in plain.items()):
            runs[r["seed"], r["processor"]] = r  # the last line for a run
    return [runs[k] for k in sorted(runs)]


def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def table_tiny():
    rows = [
        "| `--seed` | answers: mean tokens, reward | share undone, tokens 1-8 after the switch | after token 32 "
        "| KL(fresh‖old) per token per step | stale divergence removed, first k of 4 layers: 1 / 2 / 3 | processor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tiny_runs():
        removed = " / ".join(pct(r["removed"][k]) for k in ("1", "2", "3"))
        rows.append(
            f"| {r['seed']} | {r['answers']}: {r['answer_len']:.0f}, {r['reward_mean']:.2f} "
            f"| {pct(r['undone_first8'])} | {pct(r['undone_after32'])} | {r['kl_per_token_per_step']:.2e} nats "
            f"| {removed} | {r['processor']} |"
        )
    return "\n".join(rows)


def spread_of(key):
    """The lowest and highest of one number over the recorded seeds, as the README says it: '39.2-45.0%'."""
    found = sorted(r[key] for r in tiny_runs())
    return f"{pct(found[0])[:-1]}-{pct(found[-1])}"


def seeds():
    found = sorted({r["seed"] for r in tiny_runs()})
    return f"{found[0]}-{found[-1]}"


TABLES = {"study-tiny": table_tiny}
VALUES = {  # the README's sentence: what a stale cache undid, over the seeds
    "seeds": seeds,
    "first8": lambda: spread_of("undone_first8"),  # the 8 tokens after a switch
    "after32": lambda: spread_of("undone_after32"),
}


if __name__ == "__main__":
    main()
