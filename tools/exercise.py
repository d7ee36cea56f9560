"""
Exercises that grade themselves (docs/course.md says what each asks, with a hint).

    .venv/bin/python tools/exercise.py list                  # the exercises
    .venv/bin/python tools/exercise.py make recompute ~/ex   # a copy of the project with that exercise's code removed
    .venv/bin/python tools/exercise.py check recompute ~/ex  # its graders against your copy: pass/fail per test
    .venv/bin/python tools/exercise.py check recompute       # ... against this project (they pass)

`make` copies the project (not .venv, out/ or .git) into DIR and replaces the body of
the exercise's function with `raise NotImplementedError(<the exercise, in one line>)`;
a "silent bug" exercise instead changes one line, so that the copy runs and learns but
is subtly wrong, to be found from the run's own records. `check` runs the exercise's
graders, tests of this project's own suite, with this venv's Python, in DIR: each
takes at most about a minute on 2 cores, and none depends on timing (they run the
Generator and lesson.py, not processes that race).
"""

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXERCISES = {
    "advantages": dict(
        where=("grpo.py", "advantages"),
        task="GRPO's advantage: each answer's reward minus its group's mean, over its group's std (+1e-4)",
        hint="rewards arrive group after group: view them as (groups, group_size), use torch's std (unbiased)",
        graders=["tests/test_train.py::test_advantages_by_hand",
                 "tests/test_lesson.py::test_the_step_is_train_pys"]),
    "loss": dict(
        where=("grpo.py", "loss_tis"),
        task="token-level truncated importance sampling: w = min(pi/mu, is_cap), detached; per-token loss "
             "-w A log pi; return it and which tokens the cap bound (pi/mu > is_cap)",
        hint="logp is log pi (with a gradient), mu is log mu (from generation); exp of their difference is pi/mu",
        graders=["tests/test_losses.py::test_loss_by_hand[tis]",
                 "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[tis-token-False-nonzero]",
                 "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[tis-answer-False-some zero]"]),
    "correction": dict(
        where=("grpo.py", "loss_icepop"),
        task="IcePop: decoupled PPO whose mismatch weight k = pi_old/mu is kept inside [icepop_low, icepop_high] "
             "and set to 0 outside; return the per-token loss and which tokens were clipped or masked",
        hint="ppo_clip gives PPO's surrogate against pi_old and where it binds; loss_ppo is one line away",
        graders=["tests/test_losses.py::test_loss_by_hand[icepop]",
                 "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[icepop-token-False-nonzero]"]),
    "record": dict(
        where=("engine.py", "Rollout.record"),
        task="record a step's tokens: their version, logprobs and stale flag (sampled by `version` reading KV older "
             "weights wrote); note a prefill (kv_version, recomputed tokens); return the tokens rebuilt",
        hint="kv_version is None exactly when this step was a (re)fill: then `version` wrote all of the KV",
        graders=["tests/test_regimes.py::test_stale_reads_old_kv",
                 "tests/test_regimes.py::test_recompute_rebuilds_kv"]),
    "recompute": dict(
        where=("regimes.py", "Recompute.switch"),
        task="recompute: take the answers out of vLLM, load the new weights, submit each again so one prefill "
             "under v+1 rebuilds its KV (the partial answer keeps its tokens, logprobs and versions)",
        hint="Discard.switch is close; what must Rollout.record see to count the rebuild (kv_version)?",
        graders=["tests/test_regimes.py::test_recompute_rebuilds_kv",
                 "tests/test_native.py::test_our_regime_is_vllms_own_mode[recompute-recompute]"]),
    "max_lag": dict(
        where=("engine.py", "Generator.may_admit"),
        task="admit a group only if it is trained at most max_lag versions after the weights that start it: "
             "(versions loaded + max_lag + 1) x prompts_per_step groups, + those the pool rejected; only while "
             "admitting, while the outbox has room, while the KV cache holds one more group",
        hint="the pool trains groups in admission order; count versions from start_version (a resumed run)",
        graders=["tests/test_lesson.py::test_max_lag_bounds_the_lag",
                 "tests/test_generator.py::test_engine_settings_and_no_preemption"]),
    "pace": dict(
        where=("pace.py", "reject_stalest"),
        task="PACE: reject up to len(pool) - target groups, highest effective staleness first (ties: the group "
             "that completed first), never leaving fewer than n; return them, removed from the pool",
        hint="effective_staleness and _completed are there to use",
        graders=[f"tests/test_pace.py::{t}" for t in (
            "test_long_answer_with_one_old_token_is_fresher_than_short_old_answer",
            "test_rejects_highest_effective_staleness_first", "test_lam_zero_ranks_by_waiting_only",
            "test_budget_is_excess_occupancy", "test_never_rejects_below_what_the_step_needs",
            "test_pace_pool_replaces_a_rejected_group_in_order")]),
    "silent_behaviour": dict(
        silent=("grpo.py", 'behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)',
                "behaviour = logp.detach()"),
        task="this copy runs, learns, and is wrong: find what in its metrics.jsonl no asynchronous run can show, "
             "then the line",
        hint="look at behaviour_gap and kl; then at what the loss divides pi by",
        graders=[f"tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[{loss}-token-False-nonzero]"
                 for loss in ("tis", "ppo", "cispo")]),  # none ignores mu: it passes either way
    "silent_stale": dict(
        silent=("engine.py", "stale, n = self.kv_version < version, len(token_ids)",
                "stale, n = self.kv_version < (self.versions[-1] if self.versions else version), len(token_ids)"),
        task="this copy runs, learns, and is wrong: its stale share is a little low; find where from answers.jsonl "
             "(a stale run's segments around a switch), then the line",
        hint="which weights wrote the KV that the first token after a switch reads?",
        graders=["tests/test_regimes.py::test_stale_reads_old_kv",
                 "tests/test_lesson.py::test_a_run_is_a_pure_function_of_its_flags[stale]"]),
}
SKIP = (".git", ".venv", "out", "__pycache__", ".pytest_cache", ".hypothesis", "smol")


def find(tree, qualname):
    """The def of `qualname` ("f" or "Class.method") in a module's AST."""
    node = tree
    for name in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    return node


def remove(path, qualname, task):
    """Replace the body of `qualname` in `path` (its docstring kept) by a NotImplementedError."""
    lines = open(path).read().split("\n")
    fn = find(ast.parse("\n".join(lines)), qualname)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    indent = " " * body[0].col_offset
    stub = [f"{indent}raise NotImplementedError({('exercise: ' + task)!r})"]
    lines[body[0].lineno - 1:body[-1].end_lineno] = stub
    open(path, "w").write("\n".join(lines))


def make(name, dest):
    """A copy of the project in `dest` with exercise `name` in it."""
    ex = EXERCISES[name]
    if os.path.exists(dest) and os.listdir(dest):
        sys.exit(f"exercise.py: {dest} exists and is not empty; give a new directory")
    shutil.copytree(ROOT, dest, ignore=lambda d, names: [n for n in names if n in SKIP], dirs_exist_ok=True)
    if "where" in ex:
        remove(os.path.join(dest, ex["where"][0]), ex["where"][1], ex["task"])
    else:
        file, old, new = ex["silent"]
        path = os.path.join(dest, file)
        text = open(path).read()
        assert text.count(old) == 1, f"{file}: the line of {name} is not there once"
        open(path, "w").write(text.replace(old, new))
    print(f"{dest}: exercise {name}: {ex['task']}\n  hint: {ex['hint']}\n  check: "
          f"{sys.executable} {os.path.join(ROOT, 'tools', 'exercise.py')} check {name} {dest}")


def check(graders, where):
    """Run `graders` (test ids) in `where` with this Python; returns {test id: passed}."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:logging",
                        *graders], cwd=where, capture_output=True, text=True)
    results = {}
    for line in r.stdout.splitlines():
        if m := re.match(r"(PASSED|FAILED|ERROR) (.+?)(?: - .*)?$", line):
            results[m[2]] = m[1] == "PASSED"
    if not results:  # nothing ran: collection failed (a syntax error in the copy, say)
        results = {g: False for g in graders}
        print(r.stdout[-2000:] + r.stderr[-2000:], file=sys.stderr)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the exercises")
    m = sub.add_parser("make", help="a copy of the project with an exercise's code removed")
    m.add_argument("name", choices=sorted(EXERCISES))
    m.add_argument("dir")
    c = sub.add_parser("check", help="an exercise's graders against a copy (default: this project)")
    c.add_argument("name", choices=sorted(EXERCISES))
    c.add_argument("dir", nargs="?", default=ROOT)
    args = p.parse_args()
    if args.cmd == "list":
        for name, ex in EXERCISES.items():
            where = ".".join(ex["where"]) if "where" in ex else f"{ex['silent'][0]} (a silent bug)"
            print(f"{name:17s} {where:28s} {ex['task']}")
    elif args.cmd == "make":
        make(args.name, os.path.abspath(os.path.expanduser(args.dir)))
    else:
        results = check(EXERCISES[args.name]["graders"], os.path.abspath(os.path.expanduser(args.dir)))
        for test, ok in results.items():
            print(f"{'pass' if ok else 'FAIL'}  {test}")
        print(f"{sum(results.values())}/{len(results)} graders pass")
        sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
