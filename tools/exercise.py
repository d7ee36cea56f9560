"""
Exercises that grade themselves (EXERCISES below is the one place their task and hint are
written; docs/course.md says how to use them).

    .venv/bin/python tools/exercise.py list                  # the exercises: what to write, task, hint
    .venv/bin/python tools/exercise.py make recompute ~/ex   # a student's copy, that exercise's code removed
    .venv/bin/python tools/exercise.py make all ~/course     # one copy for a whole course: every exercise removed
    .venv/bin/python tools/exercise.py check recompute ~/ex  # its graders against your copy: pass/fail per test
    .venv/bin/python tools/exercise.py check recompute       # ... against this project (they pass)

`make` copies the project (not .venv, out/ or .git, and no answer: not tests/, not this
file) into DIR, replaces the body of the exercise's function with `raise
NotImplementedError(<the exercise, in one line>)`, gives each function exercise after it
in the course's order a stand-in (their answers would be in the copy; a stand-in runs, is
not the answer, and EXERCISE.md says what it does: lesson.py runs in the copy once the
exercise is written), writes EXERCISE.md and links this project's .venv into it; a "silent bug" exercise instead
changes one line, so that the copy runs and learns but is subtly wrong, to be found from
the run's own records. `check` runs the exercise's graders, tests of this project's own
suite, with this venv's Python, on DIR's code in a fresh tree that takes tests/ and tools/
from this project (not DIR's, nor any conftest.py or pytest configuration of DIR's) and
every other exercise's code from this project too, so a grade is the exercise's alone; a
grader passes only if junitxml says it ran and passed, and a failing one prints why. Each
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
        run="",
        task="GRPO's advantage: each answer's reward minus its group's mean, over its group's std + 1e-4, the "
        "unbiased std (divided by group_size - 1, torch's default); a group of equal rewards gets 0; return a tensor "
        "of rewards' shape and dtype (float32). The graders work groups of 4, 2 and 3 by hand (one of equal rewards)",
        hint="rewards arrive group after group: view them as (groups, group_size)",
        graders=[
            "tests/test_train.py::test_advantages_by_hand",
            "tests/test_graders.py::test_advantages_of_a_group_of_two_and_of_equal_rewards",
        ],
    ),
    "loss": dict(
        where=("losses.py", "loss_tis"),
        run="",
        stand_in=(
            "weights no token: -A log pi, the on-policy loss (--loss none's)",
            "return loss_none(cfg, logp, old, mu, adv, answer)",
        ),
        task="token-level truncated importance sampling: w = min(pi/mu, is_cap), detached; per-token loss "
        "-w A log pi; return it and which tokens the cap bound (pi/mu > is_cap), as a bool tensor (the caller "
        "combines it with other masks by &). The graders check the loss, its gradient and the mask on tokens worked "
        "by hand, then grpo.train_step's loss and gradient, whole and micro-batched, against a reference",
        hint="logp is log pi (with a gradient), mu is log mu (from generation); exp of their difference is pi/mu",
        graders=[
            "tests/test_losses.py::test_loss_by_hand[tis]",
            "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[tis-token-False-nonzero]",
            "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[tis-answer-False-some zero]",
        ],
    ),
    "correction": dict(
        where=("losses.py", "loss_icepop"),
        run=" --loss icepop",
        stand_in=(
            "decoupled PPO with no mismatch weight (--loss ppo's)",
            "return loss_ppo(cfg, logp, old, mu, adv, answer)",
        ),
        task="IcePop: decoupled PPO whose mismatch weight k = pi_old/mu is kept inside [icepop_low, icepop_high] "
        "and set to 0 outside; return the per-token loss and which tokens were clipped or masked. The graders check "
        "the loss, its gradient and the mask on tokens worked by hand (a token masked that PPO would not clip "
        "among them), then grpo.train_step against a reference",
        hint="ppo_clip gives PPO's surrogate against pi_old and where it binds; loss_ppo is one line away",
        graders=[
            "tests/test_losses.py::test_loss_by_hand[icepop]",
            "tests/test_graders.py::test_icepop_reports_a_masked_token_that_ppo_does_not_clip",
            "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[icepop-token-False-nonzero]",
        ],
    ),
    "m2po": dict(
        where=("losses.py", "m2po_cutoff"),
        run=" --loss m2po",
        stand_in=("masks no token (returns inf)", "import math\n\nreturn math.inf"),
        task="M2PO's mask over a step's tokens, m2 (N,) their (log pi_old/mu)^2: sorted largest first (s), mask the k "
        "largest for the least k at which the mean of the rest, s[k:], is below tau (k at most N - 1: one is kept); "
        "return s[k], the largest value kept, or inf if k is 0. Ties are read by value: the loss keeps every token at "
        "or below s[k], so a token tied with s[k] is kept even if k counted it (the mean kept can then be tau or "
        "more). The graders work six tokens by hand (tau at its edges, ties), then the loss and grpo.train_step",
        hint="sort once, largest first; the mean of what is left after masking k tokens is a mean of a suffix",
        graders=[
            "tests/test_losses.py::test_m2po_masks_the_largest_until_the_rest_is_under_tau",
            "tests/test_losses.py::test_loss_by_hand[m2po]",
            "tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[m2po-token-False-nonzero]",
        ],
    ),
    "record": dict(
        where=("engine.py", "Rollout.record"),
        run="",
        stand_in=(
            "keeps the tokens, logprobs and versions, flags no token stale, counts no rebuild and notes no provenance "
            "(answers.jsonl's segments and prefills are empty, plot.py's answer panel too)",
            "self.kv_version = version if self.kv_version is None else self.kv_version\n"
            "self.tokens.extend(token_ids)\nself.logprobs.extend(logprobs)\n"
            "self.versions.extend([version] * len(token_ids))\nself.stale.extend([False] * len(token_ids))\nreturn 0",
        ),
        task="record engine step `step`'s tokens on the answer: append their ids, logprobs, `version` and stale flag "
        "(True when `version` sampled them reading KV that older weights wrote). If this step "
        "was a (re)fill (kv_version None): set kv_version, call note_prefill (before the new tokens: it reads the "
        "partial answer), and, if the answer had tokens already (a rebuild), add prompt + partial answer to "
        "`recomputed`. Call note_tokens for every step (prefills and segments are the provenance answers.jsonl "
        "keeps; the grader checks them). Return the tokens rebuilt, prompt included, 0 if none",
        hint="kv_version is None exactly when this step was a (re)fill: then `version` wrote all of the KV",
        graders=[
            "tests/test_graders.py::test_record_by_hand",
            "tests/test_regimes.py::test_stale_reads_old_kv",
            "tests/test_regimes.py::test_recompute_rebuilds_kv",
        ],
    ),
    "recompute": dict(
        where=("regimes.py", "Recompute.switch"),
        run="",
        stand_in=(
            "keeps the answers and their KV, as --regime stale does",
            "return Stale().switch(gen, version, weights)",
        ),
        task="recompute (AReaL's): once v+1 is loaded, no token of an answer in flight may read KV that v wrote: "
        "each answer's KV (prompt + partial answer) is written again by v+1 and Rollout.record counts that as a "
        "rebuild (recomputed_tokens), while the answer keeps its tokens, logprobs and versions (v sampled them) and "
        "nothing is thrown away; use only what regimes.py's contract lists. The grader runs your switch on a "
        "stand-in generator and checks: the new weights loaded and no answer left in vLLM before any answer goes "
        "back in; each answer back once, in any order; its tokens, logprobs and versions as they were, none counted "
        "discarded; the rebuild visible to Rollout.record on each answer when switch returns; True. Then the tokens "
        "against Hugging Face's and against vLLM's own reset_prefix_cache",
        hint="vLLM cannot overwrite a running request's KV: which calls of the contract make it write an answer's KV "
        "again? Then read Rollout.record: how does it tell the step that wrote an answer's whole KV from a decode "
        "step?",
        graders=[
            "tests/test_graders.py::test_recompute_switch_by_hand",
            "tests/test_regimes.py::test_recompute_rebuilds_kv",
            "tests/test_native.py::test_our_regime_is_vllms_own_mode[recompute-recompute]",
        ],
    ),
    "max_lag": dict(
        where=("engine.py", "Generator.may_admit"),
        run="",
        stand_in=(
            "admits a group only when none is in flight: one group at a time, no KV count, and no lag bound but at "
            "--max-lag 0 (which sync forces: nothing may be in flight at its switch), one batch per version",
            'if self.cfg["max_lag"] == 0:  # sync: one batch, then nothing until the next version\n'
            "    return self.admitting and not self.inflight and self.next_group < (self.version + 1) * self.cfg["
            '"prompts_per_step"]\nreturn self.admitting and not self.inflight',
        ),
        task="admit a group only if no token of it can be trained more than max_lag versions after the weights "
        "that sampled it; only while self.admitting; and only while the KV cache, which holds self.kv_answers "
        "answers, has room for one more group (group_size answers) beside those in flight (self.inflight). "
        "What you know: self.next_group numbers groups from 0 in admission order; the pool trains them in that "
        "order, prompts_per_step groups a step; a group the pool rejects leaves its place to a new one "
        "(self.budget_offset counts them, a resumed run's too); max_lag, prompts_per_step and group_size are in "
        "self.cfg. The graders check each term by hand (the version, max_lag, prompts_per_step, budget_offset, "
        "admitting, the KV room, at the edge of each), then lesson.py runs at --max-lag 0 and 1 whose trained "
        "tokens' lag must stay within the bound",
        hint="a group admitted while version v is loaded samples no token with weights older than v. Which step "
        "trains batch b (groups b x prompts_per_step onwards), and which version does the trainer hold then? "
        "Write the lag of its worst token and keep it at most max_lag",
        graders=[
            "tests/test_graders.py::test_max_lag_admission_bound_by_hand",
            "tests/test_graders.py::test_max_lag_kv_cache_by_hand",
            "tests/test_lesson.py::test_max_lag_bounds_the_lag",
            "tests/test_generator.py::test_engine_settings_and_no_preemption",
        ],
    ),
    "pace": dict(
        where=("pool.py", "reject_stalest"),
        run=" --pool pace",
        stand_in=("rejects no group: --pool pace takes groups as fifo does", "return []"),
        task="PACE: reject up to len(pool) - target groups, highest effective staleness first (of groups tied in "
        "it, the one that completed first is rejected first), never leaving fewer than n; return the rejected groups "
        "as a list (any order), each removed from the pool dict. The graders check, by hand: the ranking (a long "
        "answer with one old token against a short old one, lam 0), the budget, the floor n, ties, and the order "
        "in which the pool replaces what it rejected",
        hint="effective_staleness and _completed are there to use",
        graders=[
            f"tests/test_pace.py::{t}"
            for t in (
                "test_long_answer_with_one_old_token_is_fresher_than_short_old_answer",
                "test_rejects_highest_effective_staleness_first",
                "test_lam_zero_ranks_by_waiting_only",
                "test_budget_is_excess_occupancy",
                "test_never_rejects_below_what_the_step_needs",
                "test_pace_pool_replaces_a_rejected_group_in_order",
            )
        ]
        + [
            "tests/test_graders.py::test_pace_breaks_ties_by_completion",
            "tests/test_graders.py::test_pace_reject_by_hand",
        ],
    ),
    "silent_behaviour": dict(
        silent=(
            "grpo.py",
            'behaviour = torch.cat([s["logprobs"] for s in mb]).float().to(device)',
            "behaviour = logp.detach()",
        ),
        run=" --regime stale",
        task="this copy runs, learns, and is wrong: find what in its metrics.jsonl no asynchronous run can show, "
        "then the line. The graders compare grpo.train_step's loss and gradient, under --loss tis, ppo and cispo, "
        "with a reference computed apart from grpo.py from the same answers",
        hint="look at behaviour_gap and kl; then at what the loss divides pi by",
        graders=[
            f"tests/test_train.py::test_micro_batched_gradients_equal_whole_batch[{loss}-token-False-nonzero]"
            for loss in ("tis", "ppo", "cispo")
        ],
    ),  # none ignores mu: it passes either way
    "silent_stale": dict(
        silent=(
            "engine.py",
            "stale, n = self.kv_version < version, len(token_ids)",
            "stale, n = self.kv_version < (self.versions[-1] if self.versions else version), len(token_ids)",
        ),
        run=" --regime stale",  # the symptom is in stale tokens: the default regime (recompute) trains none
        task="this copy runs, learns, and is wrong: its stale share is a little low; find where from answers.jsonl "
        "(a stale run's segments around a switch), then the line. The graders check one answer's record by hand, "
        "stale tokens' logprobs against Hugging Face's, and what a stale lesson run promises",
        hint="which weights wrote the KV that the first token after a switch reads?",
        graders=[
            "tests/test_graders.py::test_record_by_hand",
            "tests/test_regimes.py::test_stale_reads_old_kv",
            "tests/test_lesson.py::test_a_run_is_a_pure_function_of_its_flags[stale]",
        ],
    ),
}


def without_column(k):
    """An UNSAY rewrite (a function of the regex's match) that drops column k (from 0) of the Markdown table
    matched: for a generated table, whose rows a fixed text would outdate."""
    return lambda m: "".join(
        "|".join(c for i, c in enumerate(row.split("|")) if i != k + 1) for row in m.group(0).splitlines(True)
    )


# Prose of the copy that states an exercise's answer, said again there without the how (the project
# keeps its own, for a reader who is not doing the exercise): {exercise: [(file, where, new text)]},
# where a class's or function's qualname (its docstring is replaced) or a regex over the file (one match;
# new text, or a function of the match).
UNSAY = {
    "loss": [
        (  # CISPO's body is loss_tis's answer with another clamp
            "losses.py",
            r"^    ratio = torch\.exp\(logp\.detach\(\) - mu\)\n"
            r'    w = ratio\.clamp\(1 - cfg\["cispo_eps_low"\], .*\n.*\n',
            '    raise NotImplementedError("not in this copy: it is the answer to loss_tis with another clamp; "\n'
            '                              "write loss_tis, then this")\n',
        ),
    ],
    "recompute": [
        (
            "regimes.py",
            "Recompute",
            "As AReaL does: once v+1 is loaded, the answers in flight go on under v+1 with the KV of their prompt\n"
            "and partial answer written again by v+1, so no later token reads KV that v wrote. Their tokens keep\n"
            "their logprobs and versions (v sampled them). Cost: the KV written again (recomputed_tokens).",
        ),
        (  # the contract's entry for kv_version said what to set it to, and when
            "regimes.py",
            r"^#   rollout\.kv_version = None.*\n(?:# {10,}.*\n)*",
            "#   rollout.kv_version                  the version whose weights wrote the KV the answer reads now\n"
            "#                                       (engine.Rollout.record reads it; a regime may set it)\n",
        ),
        (
            "docs/fork.md",
            r"sets `rollout\.kv_version = None` before\s+`gen\.submit\(rollout\)`, as `Recompute` does,",
            "declares it on the answer\n  (`rollout.kv_version`, which `Rollout.record` reads),",
        ),
        (  # the memory note said how recompute goes about it
            "docs/reliability.md",
            r"`recompute` aborts every answer in flight at\s+each push and re-submits prompt \+ partial answer "
            r"as a new request;",
            "`recompute` rebuilds every answer in flight at\n  each push;",
        ),
    ],
    "max_lag": [
        (
            "engine.py",
            "Generator.may_admit",
            "AReaL's staleness bound: admit a group only if no token of it can be trained more than max_lag\n"
            "versions after the weights that sampled it (a group the pool rejected leaves its place to a new\n"
            "one: budget_offset), and only while the KV cache has room for one more group (kv_answers).",
        ),
        (
            "pool.py",
            r"generator admits group g only once g < \(versions loaded \+ max_lag \+ 1\) x prompts_per_step\n"
            r"\s+# \(engine\.Generator\.may_admit\), so g is trained at most max_lag versions after the weights\n"
            r"\s+# that started it\.",
            "generator admits a group only while it can be trained at most max_lag versions after the\n"
            "        # weights that start it (engine.Generator.may_admit).",
        ),
        (
            "docs/course.md",
            r"admits group g\s+\(numbered from 0 in admission order\) only while g < \(v \+ k \+ 1\) x P, "
            r"P = `--prompts-per-step`\s+\(`engine\.Generator\.may_admit`\)\.",
            "admits a group only while\nnone of its tokens can be trained more than k versions after the weights "
            "that sampled it\n(`engine.Generator.may_admit`; the bound in groups is the `max_lag` exercise).",
        ),
        (  # the worked example's instance of the bound
            "docs/course.md",
            r"Check it against the rule, g < \(v \+ 2 \+ 1\) x 16, that is b <= v \+ 2: holding v0",
            "Check it against the rule (the `max_lag` exercise writes it): holding v0",
        ),
        (  # and the same bound in batches, a column of the worked table, and the code that writes it
            "docs/course.md",
            r"^\| batch b \(its groups\) \| admitted at \(s\) \| generator's version then, v \| "
            r"b <= v \+ 2\? \|.*\n(?:\|.*\n)+",
            without_column(3),
        ),
        ("lab/walkthrough.py", r"\| b <= v \+ \{k\}\? \| trained by step ", "| trained by step "),
        ("lab/walkthrough.py", r" \| \{b\['batch'\]\} <= \{b\['version'\] \+ k\}", ""),
        ("lab/walkthrough.py", r'"\|---" \* 9 \+ "\|"', '"|---" * 8 + "|"'),
        (  # PACE's note gave the bound in groups
            "lab/archive.md",
            r"PACE can reject at most \(max_lag \+ 1\) x prompts_per_step -\ntarget groups in a whole run",
            "PACE can reject only a bounded number of\ngroups in a whole run",
        ),
    ],
}
SKIP = (".git", ".venv", "out", "__pycache__", ".pytest_cache", ".hypothesis", "smol")
# What `make` leaves out of the student's copy besides SKIP: the graders and every test
# (tests/test_train.py holds a reference loss; tests/exercise_mutants.py wrong answers and
# the right lines they replace) and this file (the silent bugs' right lines). `check` takes
# them from this project, never from the copy.
KEPT_BACK = ("tests", os.path.join("tools", "exercise.py"))
# What `check` takes from this project rather than from the student's copy: the tests,
# the tools they import, and anything that could change how pytest runs them.
GRADING = ("tests", "tools")
PYTEST_FILES = (
    "conftest.py",
    "pytest.ini",
    "pyproject.toml",
    "setup.cfg",
    "tox.ini",
    "sitecustomize.py",
    "usercustomize.py",
)


def find(tree, qualname):
    """The def of `qualname` ("f" or "Class.method") in a module's AST."""
    node = tree
    for name in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    return node


def body_lines(path, qualname):
    """The lines of `qualname`'s body in `path`, its docstring left out: the answer."""
    lines = open(path).read().split("\n")
    fn = find(ast.parse("\n".join(lines)), qualname)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    return body[0].lineno - 1, body[-1].end_lineno, " " * body[0].col_offset


def set_body(path, qualname, body):
    """Replace the body of `qualname` in `path` (its docstring kept) by `body` (lines, not indented)."""
    lines = open(path).read().split("\n")
    start, end, indent = body_lines(path, qualname)
    lines[start:end] = [indent + x if x else x for x in body.split("\n")]
    open(path, "w").write("\n".join(lines))


def remove(path, qualname, task):
    """Replace the body of `qualname` in `path` (its docstring kept) by a NotImplementedError."""
    set_body(path, qualname, f"raise NotImplementedError({('exercise: ' + task)!r})")


def answer(name):
    """The lines of exercise `name`'s answer in this project (stripped): what `make` takes out."""
    ex = EXERCISES[name]
    if "silent" in ex:
        return [ex["silent"][1].strip()]
    start, end, _ = body_lines(os.path.join(ROOT, ex["where"][0]), ex["where"][1])
    return [
        line.strip() for line in open(os.path.join(ROOT, ex["where"][0])).read().split("\n")[start:end] if line.strip()
    ]


def replace(path, old, new):
    """Replace the one occurrence of `old` in the file `path` by `new`."""
    text = open(path).read()
    assert text.count(old) == 1, f"{path}: {old!r} is not there once"
    open(path, "w").write(text.replace(old, new))


def copy_code(src, dest, leave_out=KEPT_BACK):
    """Copy the project at `src` into `dest`: not SKIP, not `leave_out` (paths relative to src)."""

    def ignore(d, names):
        rel = os.path.relpath(d, src)
        return [n for n in names if n in SKIP or os.path.normpath(os.path.join(rel, n)) in leave_out]

    shutil.copytree(src, dest, ignore=ignore, dirs_exist_ok=True)


def later(name):
    """The function exercises after `name` in the course's order (EXERCISES): a copy of `name`
    holds none of their answers either (make puts their stand-ins there; check grades with the
    project's)."""
    names = list(EXERCISES)
    return [n for n in names[names.index(name) + 1 :] if "where" in EXERCISES[n]]


def stub(dest, name):
    """Exercise `name` out of the copy at `dest`: its function's body removed, or its silent bug put in."""
    ex = EXERCISES[name]
    if "where" in ex:
        remove(os.path.join(dest, ex["where"][0]), ex["where"][1], ex["task"])
    else:
        replace(os.path.join(dest, ex["silent"][0]), ex["silent"][1], ex["silent"][2])


def unsay(dest, name):
    """The copy at `dest` with exercise `name`'s UNSAY rewrites made: each must find its place once."""
    for path, where, new in UNSAY.get(name, ()):
        path = os.path.join(dest, path)
        text = open(path).read()
        if re.fullmatch(r"[\w.]+", where):  # a docstring
            lines = text.split("\n")
            doc = find(ast.parse(text), where).body[0]
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{where} has no docstring"
            indent = " " * doc.col_offset
            body = [indent + x if x else x for x in new.split("\n")]
            body[0], body[-1] = indent + '"""' + body[0].lstrip(), body[-1] + '"""'
            lines[doc.lineno - 1 : doc.end_lineno] = body
            text = "\n".join(lines)
        else:
            assert len(re.findall(where, text, flags=re.M)) == 1, f"{path}: {where!r} is not there once"
            text = re.sub(where, new if callable(new) else lambda m: new, text, flags=re.M)
        open(path, "w").write(text)


def stand_in(dest, name):
    """Function exercise `name`'s stand-in in the copy at `dest`: a body that runs and is not
    the answer (EXERCISES' stand_in), so that an earlier exercise's copy runs lesson.py."""
    path, qualname = EXERCISES[name]["where"]
    set_body(os.path.join(dest, path), qualname, EXERCISES[name]["stand_in"][1])


def make(name, dest):
    """A student's copy of the project in `dest` with exercise `name` in it, and no answer:
    not the exercise's code, not a later function exercise's (each has its stand-in: code that
    runs and is not the answer, so that lesson.py runs once the exercise is written), not the
    tests (graders, references), not this file. name "all": every function exercise stubbed,
    one tree for a whole course, whose lesson runs once all are written (the silent bugs,
    which need the rest written, are handed out as their own copies after)."""
    if os.path.exists(dest) and os.listdir(dest):
        sys.exit(f"exercise.py: {dest} exists and is not empty; give a new directory")
    copy_code(ROOT, dest)
    functions = [n for n in EXERCISES if "where" in EXERCISES[n]]
    for n in functions if name == ALL else [name]:
        stub(dest, n)
        unsay(dest, n)
    for n in later(name) if name != ALL else ():
        stand_in(dest, n)
        unsay(dest, n)
    if os.path.exists(os.path.join(ROOT, ".venv")):  # the project's venv, so that .venv/bin/python runs in the copy
        os.symlink(os.path.realpath(os.path.join(ROOT, ".venv")), os.path.join(dest, ".venv"))
    which = "NAME" if name == ALL else name
    text = (
        f"# Exercise {name}\n\n{describe(name)}\n\n{run_text(name)}"
        f"The graders are not in this copy: from the project, `.venv/bin/python tools/exercise.py check {which} {dest}`"
        + (f", NAME one of {', '.join(n for n in EXERCISES if 'where' in EXERCISES[n])}" if name == ALL else "")
        + ".\n"
    )
    open(os.path.join(dest, "EXERCISE.md"), "w").write(text)
    print(
        f"{dest}: exercise {name}\n{describe(name)}\n  check (from the project): "
        f"{sys.executable} {os.path.join(ROOT, 'tools', 'exercise.py')} check {which} {dest}"
    )


ALL = "all"  # make all DIR: one course tree


def run_text(name):
    """What EXERCISE.md says of running the copy: the command, and the stand-ins it runs with."""
    if name == ALL:
        return (
            "Every function exercise is stubbed here: lesson.py runs once all are written (`.venv/bin/python "
            "lesson.py --preset long`); `check NAME` grades each alone, with the project's code for the others.\n\n"
        )
    command = f"`.venv/bin/python lesson.py --preset long{EXERCISES[name].get('run', '')}`"
    if "silent" in EXERCISES[name]:
        return f"Run it here: {command}, and look for the symptom in the run directory it names at its end.\n\n"
    text = f"Once it is written, run it here: {command}"
    if not later(name):
        return text + ".\n\n"
    ins = "".join(f"\n- `{EXERCISES[n]['where'][1]}` ({n}): {EXERCISES[n]['stand_in'][0]}" for n in later(name))
    return (
        text + ". The exercises after this one are not written here: each has a stand-in, code that runs and is "
        "not its answer, so the run's numbers are theirs too (`check` grades your answer with the project's code "
        f"in their place); every regime and pool runs with them:{ins}\n\n"
    )


def describe(name):
    """What `list` and the copy's EXERCISE.md say of an exercise: the one source of its task and hint."""
    if name == ALL:
        return "  every function exercise, in the course's order:\n" + "\n".join(
            describe(n) for n in EXERCISES if "where" in EXERCISES[n]
        )
    ex = EXERCISES[name]
    where = ": ".join(ex["where"]) if "where" in ex else f"{ex['silent'][0]} (a silent bug)"
    return f"  write: {where}\n  task: {ex['task']}\n  hint: {ex['hint']}"


def grading_tree(where, dest, exercise=None):
    """`dest`: the code of the copy `where` with this project's tests and tools (and no
    pytest configuration or conftest.py of the copy's), so that nothing edited in the copy
    but its code changes a grade; with `exercise`, every other exercise's code is the
    project's (restore), so that a grade is the exercise's alone, whatever else the copy
    holds (later exercises stubbed, a silent bug)."""

    def ignore(d, names):
        top = os.path.samefile(d, where)
        return [n for n in names if n in SKIP or n in PYTEST_FILES or (top and n in GRADING)]

    shutil.copytree(where, dest, ignore=ignore)
    for d in GRADING:
        shutil.copytree(os.path.join(ROOT, d), os.path.join(dest, d), ignore=shutil.ignore_patterns(*SKIP))
    for other in EXERCISES if exercise else ():
        if other != exercise and not overlap(other, exercise):
            restore(dest, other)


def region(name):
    """(file, first line, end line) of exercise `name`'s code in the project: its function's
    body, or a silent bug's right line."""
    ex = EXERCISES[name]
    if "silent" in ex:
        path, right, _ = ex["silent"]
        text = open(os.path.join(ROOT, path)).read()
        first = text[: text.index(right)].count("\n")
        return path, first, first + right.count("\n") + 1
    path, qualname = ex["where"]
    return (path, *body_lines(os.path.join(ROOT, path), qualname)[:2])


def overlap(a, b):
    """Whether exercises a and b touch the same lines (silent_stale's line is in Rollout.record,
    the record exercise's function): restoring one would undo the other's code."""
    (pa, a0, a1), (pb, b0, b1) = region(a), region(b)
    return pa == pb and a0 < b1 and b0 < a1


def restore(dest, name):
    """Exercise `name`'s code in the tree at `dest` as the project has it (a body the copy
    stubbed, or a silent bug's line), if the copy has its function or line at all."""
    ex = EXERCISES[name]
    if "silent" in ex:
        path, right, bug = ex["silent"]
        text = open(os.path.join(dest, path)).read()
        if text.count(bug) == 1:
            open(os.path.join(dest, path), "w").write(text.replace(bug, right))
        return
    path, qualname = ex["where"]
    try:
        start, end, _ = body_lines(os.path.join(dest, path), qualname)
    except (StopIteration, SyntaxError):  # not there, or a copy that does not parse: its graders will say
        return
    a, b, _ = body_lines(os.path.join(ROOT, path), qualname)
    lines, project = (
        open(os.path.join(dest, path)).read().split("\n"),
        open(os.path.join(ROOT, path)).read().split("\n"),
    )
    lines[start:end] = project[a:b]
    open(os.path.join(dest, path), "w").write("\n".join(lines))


PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "-c", os.devnull]
# Run each (tree, report, graders) of argv[1] in a child forked from one Python that has
# imported the libraries once (seconds each on 2 busy cores), as many children at a time as
# there are cores, each on one thread; the project's modules, the code under test, each child
# imports from its own tree.
MANY = """
import json, os, sys
import numpy, torch, pytest, hypothesis
try:
    import transformers
except ImportError:
    pass
running, at_once = 0, len(os.sched_getaffinity(0))
for tree, report, graders in json.loads(sys.argv[1]):
    if running == at_once:
        os.wait()
        running -= 1
    if os.fork() == 0:
        torch.set_num_threads(1)  # a core a child: more threads than cores crawl
        os.chdir(tree)
        sys.path.insert(0, tree)
        try:
            pytest.main(sys.argv[2:] + ["--rootdir", tree, "--confcutdir", tree, "--junitxml=" + report, *graders])
        finally:
            os._exit(0)
    running += 1
while running:
    os.wait()
    running -= 1
"""


def outcomes(report, graders, messages=None):
    """{grader: passed} from a junitxml report: passed only if it ran and neither failed,
    errored nor was skipped; a grader the report lacks (deselected, not collected) failed.
    messages, a dict, gets each grader's failure message (pytest's assertion, first lines)."""
    import xml.etree.ElementTree as ET

    ran, why = {}, {}
    if os.path.exists(report):
        for case in ET.parse(report).iter("testcase"):
            key = (tuple(case.get("classname", "").split(".")), case.get("name"))
            bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
            ran[key] = not bad
            if bad:
                why[key] = (bad[0].get("message") or bad[0].tag).strip()
    results = {}
    for g in graders:
        path, *names = g.split("::")
        cls, name = tuple(path[:-3].split("/")) + tuple(names[:-1]), names[-1]
        keys = [(c, n) for (c, n) in ran if c == cls and (n == name or n.startswith(name + "["))]
        results[g] = bool(keys) and all(ran[k] for k in keys)  # a parametrized test without its parameters: all
        if messages is not None and not results[g]:
            messages[g] = "; ".join(why[k][:600] for k in keys if k in why) or "not run (not collected: see above)"
    return results


def env():
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    return dict(e, PYTHONDONTWRITEBYTECODE="1")


def check(graders, where, exercise=None, messages=None):
    """Run `graders` (test ids) against the code in `where` with this Python; returns {test id:
    passed}. The tests are this project's (see grading_tree; with `exercise`, every other
    exercise's code is the project's too), run in a copy; a grader that does not pass
    (failed, errored, skipped, deselected, not collected) counts as failed, and `messages`
    (a dict) gets why."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="exercise-check-") as tmp:
        tree, report = os.path.join(tmp, "tree"), os.path.join(tmp, "report.xml")
        grading_tree(where, tree, exercise)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                *PYTEST_ARGS,
                "--rootdir",
                tree,
                "--confcutdir",
                tree,
                f"--junitxml={report}",
                *graders,
            ],
            cwd=tree,
            capture_output=True,
            text=True,
            env=env(),
        )
        results = outcomes(report, graders, messages)
    if not any(results.values()):
        print(r.stdout[-2000:] + r.stderr[-2000:], file=sys.stderr)
    return results


def check_jobs(todo):
    """check(graders, where, exercise) for each (graders, where, exercise) of `todo`, each in
    its own pytest forked from one Python that imported the libraries once (POSIX only)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="exercise-check-") as tmp:
        jobs = []
        for i, (graders, where, exercise) in enumerate(todo):
            grading_tree(where, os.path.join(tmp, str(i)), exercise)
            jobs.append([os.path.join(tmp, str(i)), os.path.join(tmp, f"{i}.xml"), graders])
        subprocess.run(
            [sys.executable, "-c", MANY, json.dumps(jobs), *PYTEST_ARGS],
            cwd=tmp,
            capture_output=True,
            text=True,
            env=env(),
        )
        return [outcomes(report, graders) for _, report, graders in jobs]


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the exercises")
    m = sub.add_parser("make", help="a copy of the project with an exercise's code removed (all: every one)")
    m.add_argument("name", choices=sorted(EXERCISES) + [ALL])
    m.add_argument("dir")
    c = sub.add_parser("check", help="an exercise's graders against a copy (default: this project)")
    c.add_argument("name", choices=sorted(EXERCISES))
    c.add_argument("dir", nargs="?", default=ROOT)
    args = p.parse_args()
    if args.cmd == "list":
        for name in EXERCISES:
            print(f"{name}\n{describe(name)}")
    elif args.cmd == "make":
        make(args.name, os.path.abspath(os.path.expanduser(args.dir)))
    else:
        messages = {}
        where = os.path.abspath(os.path.expanduser(args.dir))
        results = check(EXERCISES[args.name]["graders"], where, args.name, messages)
        for test, ok in results.items():
            print(f"{'pass' if ok else 'FAIL'}  {test}")
            if not ok:
                print("      " + messages[test].replace("\n", "\n      "))
        print(f"{sum(results.values())}/{len(results)} graders pass")
        sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
