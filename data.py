"""
The tasks, one row each in TASKS: where a task's problems come from, what its rows hold, how a row
becomes a problem, its prompt, how its answers are checked (reward.CHECKS) and what a run of it
defaults to. A problem is a dict {"question": str, "answer": str}: `answer` is what reward.score checks.
docs/fork.md adds a task.

- synth: multi-step arithmetic word problems made here from a seed, worked solutions ending in "#### N".
- gsm8k: openai/gsm8k. math: MATH-lighteval for train, MATH-500 for test.

Offline (no Hub access): --data-file / --eval-data-file, a local .jsonl/.json/.parquet of rows in the
task's schema; tests use the small files in fixtures/.
"""

import json
import os
import random
import re
from typing import Callable, NamedTuple

# -----------------------------------------------------------------------------
# the synthetic task: --synth-steps sets how many operations, hence how long the answers are (the
# regimes differ only when answers are long)

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


def steps_range(steps):
    """--synth-steps: 'S' (every problem S operations) or 'A-B' (A to B operations,
    long-tailed: P(s) proportional to 1/s, so most problems are short and a few long,
    like MATH's answers next to GSM8K's). Returns (A, B)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", str(steps))
    if not m:
        raise UsageError(f"--synth-steps {steps}: expected a number of operations (2) or a range (1-12)")
    lo, hi = int(m[1]), int(m[2] or m[1])
    if not 1 <= lo <= hi <= 16:
        raise UsageError(f"--synth-steps {steps}: operations must satisfy 1 <= A <= B <= 16")
    return lo, hi


def synth_split(split, n, steps):
    lo, hi = steps_range(steps)
    if lo == hi:  # the seed of the fixed-length splits since the start: their problems never change
        rng = random.Random(SYNTH_SEEDS[split] * 1000 + lo)
        return [synth_problem(rng, lo) for _ in range(n)]
    rng = random.Random(f"{SYNTH_SEEDS[split]}:{lo}-{hi}")
    sizes, weights = range(lo, hi + 1), [1 / s for s in range(lo, hi + 1)]
    return [synth_problem(rng, rng.choices(sizes, weights)[0]) for _ in range(n)]


# -----------------------------------------------------------------------------
# the Hub's datasets: how a row becomes a problem


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


def gsm8k_problem(row):
    """openai/gsm8k: the final answer is what follows "####" in the worked solution."""
    return {"question": row["question"], "answer": str(row["answer"]).split("####")[-1].strip()}


def math_problem(row):
    """MATH: MATH-500's rows have `answer`; lighteval's only the solution, whose last \\boxed{} is the answer."""
    if not row.get("answer") and "solution" not in row:
        raise ValueError("has neither 'answer' nor 'solution'")
    return {"question": row["problem"], "answer": row.get("answer") or last_boxed(row["solution"])}


# -----------------------------------------------------------------------------
# prompts


def boxed_prompt(tokenizer, question):
    """Chat template when the model has one (Qwen3, thinking off), else a plain prompt."""
    if getattr(tokenizer, "chat_template", None):
        content = question + "\nPlease reason step by step, and put your final answer within \\boxed{}."
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    return f"Question: {question}\nAnswer:"


# -----------------------------------------------------------------------------
# the tasks


class Task(NamedTuple):
    """One row of TASKS: a task, from where its problems come to how its answers are checked."""

    hub: dict | None  # split -> (Hub id, config, Hub split); None: local files only (--data-file)
    fields: tuple  # what every row must hold
    schema: str  # what a row looks like, for the errors that show it
    problem: Callable | None  # row -> {"question", "answer"}; a row it cannot read: ValueError("why")
    prompt: Callable  # (tokenizer, question) -> the prompt's text
    check: str  # how an answer is checked: a key of reward.CHECKS
    defaults: dict  # what a plain `python train.py --dataset NAME` runs (a preset or a flag given wins)
    make: Callable | None = None  # (split, n, steps) -> problems, for a task made here rather than read


# fmt: off
TINY = dict(  # the tiny model on the synthetic task: minutes on a laptop's CPU
    model="tiny", steps=150, prompts_per_step=16, group_size=8, max_new_tokens=96, lr=3e-5, temperature=0.5,
    lr_schedule="cosine", eval_every=25, eval_n=256, max_model_len=512,
)
QWEN = dict(  # Qwen3-0.6B on GPUs, with each task's lengths
    model="Qwen/Qwen3-0.6B", steps=500, prompts_per_step=32, group_size=8, lr=1e-6, temperature=1.0,
    lr_schedule="constant", eval_every=50, eval_n=500,
)
TASKS = {
    "synth": Task(hub=None, fields=(), schema="made here (synth_problem)", problem=None, prompt=boxed_prompt,
                  check="number", defaults=TINY, make=lambda split, n, steps: synth_split(split, n or 5000, steps)),
    "gsm8k": Task(hub={"train": ("openai/gsm8k", "main", "train"), "test": ("openai/gsm8k", "main", "test")},
                  fields=("question", "answer"), schema='{"question": str, "answer": str ending in "#### N"}',
                  problem=gsm8k_problem, prompt=boxed_prompt, check="number",
                  defaults=dict(QWEN, max_new_tokens=1024, max_model_len=2048)),
    "math":  Task(hub={"train": ("DigitalLearningGmbH/MATH-lighteval", "default", "train"),  # the 7.5k MATH problems
                       "test": ("HuggingFaceH4/MATH-500", "default", "test")},  # the held-out 500 most papers report
                  fields=("problem",),
                  schema='{"problem": str, "solution": str with a final \\boxed{}, "answer": str (optional)}',
                  problem=math_problem, prompt=boxed_prompt, check="latex",
                  defaults=dict(QWEN, max_new_tokens=2048, max_model_len=4096)),
}
# fmt: on
DATASETS = tuple(TASKS)  # their names (tools/gpu_check.py's --dataset); the flags read TASKS when they are made


def task(name):
    """The task called `name`, or a UsageError naming the ones there are."""
    if name not in TASKS:
        raise UsageError(f"unknown task (--dataset) {name!r}: expected one of {', '.join(TASKS)} (data.TASKS)")
    return TASKS[name]


class UsageError(Exception):
    """A user's mistake (a missing or malformed file, a bad path, flags that cannot
    work together): train.py, lesson.py and eval.py print it as one line on stderr and
    exit with code 2, no traceback (config.run). Anything else is this project's bug and keeps its
    traceback."""


def to_problem(row, dataset, where="a row"):
    """Map one row of the task's schema to {"question", "answer"} (its `problem`)."""
    t = task(dataset)
    try:
        for k in t.fields:
            if k not in row:
                raise ValueError(f"has no {k!r} field")
        return t.problem(row)
    except ValueError as e:  # a row the task cannot read: say where, and what its rows look like
        raise UsageError(f"{where} {e}; {dataset} rows look like {t.schema}") from None


FORMATS = ".jsonl (one JSON object a line), .json (one array of objects) or .parquet"


def read_rows_file(path):
    """Rows of a local .jsonl (one JSON object a line), .json (an array of objects,
    as `datasets` also reads) or .parquet file. Read here rather than by `datasets`,
    whose error for a broken line is a traceback that names neither the file's line
    nor the problem."""
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: not a JSON array of objects ({e}); expected {FORMATS}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise UsageError(f"{path}: a .json file must hold one array of objects; expected {FORMATS}")
        if not rows:
            raise UsageError(f"{path}: no rows")
        return rows
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # ArrowInvalid, OSError: whatever the reader says is wrong with the file
            raise UsageError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(
                        f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno}); expected {FORMATS}"
                    ) from None
                if not isinstance(row, dict):
                    raise UsageError(f"{path}:{i}: a JSON {type(row).__name__}; expected {FORMATS}")
                rows.append(row)
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: not UTF-8 text ({e.reason}); expected {FORMATS}") from None
    if not rows:
        raise UsageError(f"{path}: no rows")
    return rows


def hub_id_shaped(name):
    """The Hub's rule: one or two names of letters, digits, '-', '_', '.'; not a path."""
    return (
        bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name))
        and not name.startswith((".", "-"))
        and "--" not in name
        and ".." not in name
    )


def hub_reachable(timeout=3.0):
    """One TCP connection to the Hub (or HF_ENDPOINT): milliseconds when offline,
    where `datasets` retries five times over ~25 s before it gives up."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_rows(dataset, split, data_file, flag):
    if data_file:
        return read_rows_file(data_file)
    if task(dataset).hub is None:
        raise UsageError(f"--dataset {dataset} is read from local files only: pass {flag}")
    hub_id, config, hub_split = task(dataset).hub[split]
    if not hub_reachable():  # the local cache only, without the retries; the generator inherits this
        os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported: before the import below
    import datasets  # slow import, only for hub datasets

    if os.environ.get("HF_HUB_OFFLINE") == "1":  # in case datasets was imported before the line above
        datasets.config.HF_HUB_OFFLINE = True
    try:
        return list(datasets.load_dataset(hub_id, config, split=hub_split))
    except Exception as e:  # offline, or the hub is unreachable: say what to do
        raise UsageError(
            f"could not load the {split} split of {hub_id} ({type(e).__name__}); offline? "
            f"pass {flag} with a local .jsonl/.parquet of rows like {task(dataset).schema}"
        ) from None


def load_problems(dataset, split, n=None, data_file=None, steps=4, flag="--data-file"):
    """The first n problems of a split (all of them when n is None). `flag` is the
    option that gives this split a local file: error messages name it."""
    t = task(dataset)
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}")
    if t.make:
        return t.make(split, n, steps)
    if data_file and not os.path.isfile(data_file):
        raise UsageError(f"{flag} {data_file}: no such file")
    rows = load_rows(dataset, split, data_file, flag)
    where = data_file or t.hub[split][0]
    problems = [to_problem(r, dataset, f"{where} row {i}") for i, r in enumerate(rows[:n] if n else rows, 1)]
    return [p for p in problems if p["answer"]]


def load_splits(cfg):
    """Both splits, before torch or transformers load: the generator reads the train
    split itself, but a bad file or an offline Hub should stop the run before
    anything expensive starts. The test split is the trainer's, for evaluations."""
    train = load_problems(cfg["dataset"], "train", data_file=cfg["data_file"], steps=cfg["synth_steps"])
    test = load_problems(
        cfg["dataset"],
        "test",
        n=cfg["eval_n"],
        data_file=cfg["eval_data_file"],
        steps=cfg["synth_steps"],
        flag="--eval-data-file",
    )
    return train, test


# -----------------------------------------------------------------------------
# a problem's prompt


def make_prompt(tokenizer, question, dataset):
    """The prompt of a problem of task `dataset` (its row's `prompt`)."""
    return task(dataset).prompt(tokenizer, question)


def prompt_ids(tokenizer, problems, dataset):
    """Token ids of each problem's prompt (make_prompt), no special tokens added: the one
    builder of what the engine is given, for the generator's prompts (engine.Generator)
    and for evaluations (lesson.py, train.py, eval.py)."""
    return [
        tokenizer(make_prompt(tokenizer, p["question"], dataset), add_special_tokens=False)["input_ids"]
        for p in problems
    ]
