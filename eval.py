"""
pass@1 (greedy, one sample per problem) on a held-out split, through vLLM.

    python eval.py --model out/run/ckpt --dataset synth
    python eval.py --model Qwen/Qwen3-0.6B --dataset gsm8k --n 500

train.py calls the same pieces every --eval-every steps, on the generator's own
engine (so it measures exactly the weights the generator holds).
"""

import argparse
import os

import config
from config import BASE, model_path
from data import TASKS, load_problems, prompt_ids, task
from engine import vllm_env
from system.preflight import check_budget, check_model
from reward import grade


def pass_at_1(completions, problems, dataset, truncated=None):
    """Share of problems answered right (grade)."""
    return sum(grade(completions, problems, dataset, truncated)) / max(1, len(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=config.Help)
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id ('tiny', 'smol': the presets)")
    said = lambda key: config.default_text(key, presets=False)  # train.py's default on each dataset
    # fmt: off
    config.add_table(parser, [  # a row each (name, type, default, help)
        ("dataset",        list(TASKS), BASE["dataset"],     "which task's test split (data.TASKS)"),
        # the rest: what train.py evaluates with on --dataset (its task's defaults), so that the numbers compare
        ("n",              int,         None,                f"number of test problems, the first n (train.py's "
                                                             f"--eval-n: {said('eval_n')})"),
        ("data-file",      str,         None,                "local .jsonl/.parquet test split in the task's schema "
                                                             "(default: the Hub's)"),
        ("synth-steps",    str,         BASE["synth_steps"], "operations per synth problem: S or a long-tailed range "
                                                             "A-B"),
        ("max-new-tokens", int,         None,                f"answer length cap ({said('max_new_tokens')})"),
        ("max-model-len",  int,         None,                f"prompt + answer cap ({said('max_model_len')})"),
        ("temperature",    float,       0.0,                 "0: greedy (the default pass@1)"),
        ("show",           int,         0,                   "print the first N answers, how each ended and its "
                                                             "score: read what the model writes, not only the number"),
    ])
    # fmt: on
    args = parser.parse_args()
    model, defaults = model_path(args.model), task(args.dataset).defaults
    problems = load_problems(
        args.dataset, "test", n=args.n or defaults["eval_n"], data_file=args.data_file, steps=args.synth_steps
    )
    check_model(model)  # before vLLM starts: one line for a path that is not there
    max_new = args.max_new_tokens or defaults["max_new_tokens"]
    max_len = args.max_model_len or defaults["max_model_len"]
    check_budget(model, args.dataset, problems, max_new, max_len, name=args.model)  # as train.py: one line, not vLLM's
    os.environ.update(vllm_env())  # as the generator's engine: on CPU, a fixed KV cache
    from vllm import LLM, SamplingParams  # ~10 s to import: after the checks
    import torch

    # the generator's dtype (engine.make_engine says why): the weights train.py's evaluations measure
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    llm = LLM(model=model, seed=0, dtype=dtype, max_model_len=max_len)
    prompts = [dict(prompt_token_ids=ids) for ids in prompt_ids(llm.get_tokenizer(), problems, args.dataset)]
    outs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=max_new), use_tqdm=True)
    truncated = [o.outputs[0].finish_reason == "length" for o in outs]
    texts = [o.outputs[0].text for o in outs]
    acc = pass_at_1(texts, problems, args.dataset, truncated)
    from reward import score

    for text, p, cut in list(zip(texts, problems, truncated))[: args.show]:
        right = score(text, p["answer"], args.dataset) and not cut
        print(
            f"--- {'cut at the cap' if cut else 'finished'}, {'right' if right else 'wrong'} "
            f"(answer {p['answer']}): {p['question']}\n{text}"
        )
    print(
        f"pass@1 {acc:.4f} on {len(problems)} {args.dataset} test problems ({model}); "
        f"{sum(truncated)} answers cut at --max-new-tokens {max_new} (counted wrong)"
    )


if __name__ == "__main__":
    config.run(main, "eval.py")  # a user's mistake (as train.py): one line, exit code 2
