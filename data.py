"""
Problems and prompts: the synthetic task, GSM8K and MATH, one record shape for all.

A problem is a dict {"question": str, "answer": str}: `answer` is the final answer
that reward.score() checks (a number for synth/gsm8k, LaTeX for math).

- synth: multi-step arithmetic word problems made here from a seed, with a worked
  solution ending in "#### N" (gsm8k's format). `steps` sets how many operations,
  hence how long the answers are -- the regimes differ only when answers are long.
- gsm8k: openai/gsm8k (config "main"), splits train/test.
- math: DigitalLearningGmbH/MATH-lighteval for train (the 7.5k MATH training
  problems; the answer is the last \\boxed{} of the solution), HuggingFaceH4/MATH-500
  for test (the 500-problem held-out split most papers report).

Offline (no Hub access): pass --data-file with local .jsonl/.parquet in the same
schema as the Hub dataset; tests use the small files in fixtures/.
"""

import os
import random

HUB = {  # dataset -> split -> (hub id, config, hub split)
    "gsm8k": {"train": ("openai/gsm8k", "main", "train"), "test": ("openai/gsm8k", "main", "test")},
    "math": {"train": ("DigitalLearningGmbH/MATH-lighteval", "default", "train"),
             "test": ("HuggingFaceH4/MATH-500", "default", "test")},
}
DATASETS = ("synth", "gsm8k", "math")

# -----------------------------------------------------------------------------
# the synthetic task

NAMES = ["Ann", "Ben", "Mia", "Tom", "Eva", "Sam", "Lia", "Max"]
THINGS = ["apples", "coins", "books", "cards", "shells", "stamps"]
SYNTH_SEEDS = {"train": 1234, "test": 5678}  # disjoint streams for the two splits


def synth_problem(rng, steps):
    """One problem with `steps` operations; every intermediate value stays in 0..99."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    x = rng.randint(2, 20)
    sentences, lines = [f"{name} has {x} {thing}."], []
    for _ in range(steps):
        if x >= 10 and rng.random() < 0.5 or x + 9 > 99:
            n = rng.randint(1, min(9, x))
            sentences.append(f"{name} gives away {n}.")
            lines.append(f"{x}-{n}={x - n}")
            x -= n
        else:
            n = rng.randint(1, 9)
            sentences.append(f"{name} finds {n} more.")
            lines.append(f"{x}+{n}={x + n}")
            x += n
    question = " ".join(sentences) + f" How many {thing} does {name} have?"
    solution = ". ".join(lines) + f". #### {x}"
    return {"question": question, "answer": str(x), "solution": solution}


def synth_split(split, n, steps):
    rng = random.Random(SYNTH_SEEDS[split] * 1000 + steps)
    return [synth_problem(rng, steps) for _ in range(n)]

# -----------------------------------------------------------------------------
# hub datasets


def last_boxed(text):
    """Content of the last \\boxed{...} in text (brace-balanced), or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed{")
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth < 0:
            return text[start:j]
    return None


def to_problem(row, dataset):
    """Map one row of the Hub schema to {"question", "answer"}."""
    if dataset == "gsm8k":
        return {"question": row["question"], "answer": row["answer"].split("####")[-1].strip()}
    answer = row.get("answer") or last_boxed(row["solution"])  # MATH-500 has `answer`, lighteval not
    return {"question": row["problem"], "answer": answer}


def load_rows(dataset, split, data_file):
    import datasets  # slow import, only for hub datasets
    if data_file:
        kind = "parquet" if data_file.endswith(".parquet") else "json"
        return datasets.load_dataset(kind, data_files=data_file, split="train")
    hub_id, config, hub_split = HUB[dataset][split]
    try:
        return datasets.load_dataset(hub_id, config, split=hub_split)
    except Exception as e:  # offline, or the hub is unreachable: say what to do
        raise SystemExit(f"could not load {hub_id} ({type(e).__name__}); pass --data-file "
                         f"with a local .jsonl/.parquet in its schema") from e


def load_problems(dataset, split, n=None, data_file=None, steps=4):
    """The first n problems of a split (all of them when n is None)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}, expected one of {DATASETS}")
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}")
    if dataset == "synth":
        return synth_split(split, n or 5000, steps)
    if data_file and not os.path.exists(data_file):
        raise SystemExit(f"--data-file {data_file} does not exist")
    rows = load_rows(dataset, split, data_file)
    rows = rows.select(range(min(n, len(rows)))) if n else rows
    return [p for p in (to_problem(r, dataset) for r in rows) if p["answer"]]

# -----------------------------------------------------------------------------
# prompts


def make_prompt(tokenizer, question, dataset):
    """Chat template when the model has one (Qwen3, thinking off), else a plain prompt."""
    if getattr(tokenizer, "chat_template", None):
        content = question + "\nPlease reason step by step, and put your final answer within \\boxed{}."
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    return f"Question: {question}\nAnswer:"
