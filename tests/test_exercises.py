"""
The exercises (tools/exercise.py, docs/course.md) grade themselves: on a copy with an
exercise's code removed (or its silent bug put in) every one of its graders fails, and
on the project's own code every grader passes.

    .venv/bin/python -m pytest -q tests/test_exercises.py
"""

import ast
import builtins
import json
import keyword
import os
import re
import shlex
import subprocess
import sys
from collections import Counter

import pytest

from exercise_mutants import ACCEPTED, CHEAP, MUTANTS
from tools.exercise import (
    EXERCISES,
    ROOT,
    SKIP,
    UNSAY,
    answer,
    check,
    check_jobs,
    copy_code,
    find,
    later,
    make,
    replace,
)


def test_every_grader_fails_on_every_exercise_and_passes_on_the_project(graded):
    """Each exercise's copy as `make` writes it fails every one of its graders, and every
    exercise's graders pass on the project's own code (the fast tier runs the cheap ones:
    test_the_cheap_graders_are_the_exercises_and_pass). Each copy, and the project, graded
    in its own pytest (the graded fixture)."""
    results, project = graded["made"]
    passing = {name: [t for t, ok in got.items() if ok] for name, got in zip(EXERCISES, results)}
    assert all(results) and not any(passing.values()), passing
    assert project and all(project.values()), [t for t, ok in project.items() if not ok]


def statements(source):
    """The statements of Python source, normalised (ast.unparse: no comments, one way to space
    and quote): every simple statement, and the header of every if, while and for."""
    out = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, (ast.If, ast.While)):
            out.append(ast.unparse(node.test))
        elif isinstance(node, ast.For):
            out.append(f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}")
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.With, ast.Try)):
            out.append(ast.unparse(node))
    return out


def answer_statements(name):
    """An exercise's answer, normalised: its function's body (the docstring left out), or a silent bug's right line."""
    ex = EXERCISES[name]
    if "silent" in ex:
        return statements(ex["silent"][1].strip())
    fn = find(ast.parse(open(os.path.join(ROOT, ex["where"][0])).read()), ex["where"][1])
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    return [x for stmt in body for x in statements(ast.Module(body=[stmt], type_ignores=[]))]


def tree_statements(root, top_only=False):
    """Counter of the normalised statements of every .py file under root (not SKIP; top_only: the root's files)."""
    counts = Counter()
    for d, dirs, files in os.walk(root):
        dirs[:] = [] if top_only else [x for x in dirs if x not in SKIP]
        for f in files:
            if f.endswith(".py"):
                counts.update(statements(open(os.path.join(d, f)).read()))
    return counts


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_copy_holds_no_answer(name, tmp_path):
    """A student's copy holds no statement of its exercise's answer, nor of a later function
    exercise's, in any file (tools included: a near-copy of Rollout.record once sat in a
    benchmark), normalised (formatting and comments aside), unless the lesson's own code has
    it elsewhere too (`import torch`, loss_ppo's call of ppo_clip); no test (the graders, the
    reference loss, the mutants) and not tools/exercise.py (the silent bugs' right lines); it
    has EXERCISE.md and a .venv."""
    copy = tmp_path / "copy"
    make(name, str(copy))
    assert not (copy / "tests").exists() and not (copy / "tools" / "exercise.py").exists()
    assert (copy / "EXERCISE.md").exists() and (copy / ".venv" / "bin" / "python").exists()
    kept, lesson = tree_statements(copy), tree_statements(ROOT, top_only=True)
    for n in [name, *later(name)]:
        answer = answer_statements(n)
        own = [x for x in answer if lesson[x] <= answer.count(x)]  # statements found nowhere else in the lesson
        assert own, f"{n}: the answer has no statement of its own: this test would check nothing"
        for x in own:
            assert not kept[x], f"the copy of {name} holds {n}'s {x!r}"


def says_something(line):
    """Whether a stripped line of an answer is more than Python's punctuation and keywords
    (`return (`, `)`, `else:`) or an import, lines that stand in any file."""
    names = [w for w in re.findall(r"[A-Za-z_]\w*", line.split("#")[0]) if not keyword.iskeyword(w)]
    return bool(names) and not line.startswith(("import ", "from "))


def copy_lines(root):
    """Every line (stripped) of every text file under root (not SKIP)."""
    lines = set()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP]
        for f in files:
            try:
                lines.update(x.strip() for x in open(os.path.join(d, f), encoding="utf-8"))
            except UnicodeDecodeError:  # weights, a tokenizer's binary files
                pass
    return lines


# Lines of an answer the lesson writes elsewhere too, on purpose, each where: a line of the
# lesson's own that a student reads anyway, not the answer's (a block written again is not
# listed here, and fails the test below). The test checks that each is still shared.
SHARED = {
    "correction": {'surrogate, clipped = ppo_clip(logp, old, adv, cfg["clip_eps"])': "losses.loss_ppo, loss_geo"},
    "recompute": {
        "aborted = gen.abort_all()": "regimes.Discard.switch",
        "gen.load_weights(version, weights)": "regimes.Discard.switch",
        "for r in aborted:": "regimes.Discard.switch",
        "gen.submit(r)": "regimes.Discard.switch",
    },
}


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_no_line_make_removes_stands_in_the_copy(name, tmp_path):
    """Beside the normalised statements above, the lines themselves: no line `make` takes
    out (the exercise's, a later function exercise's) stands as it is, stripped, in any text
    file of the copy, docs and data included (the generator process once wrote max_lag's
    budget and KV term again, with more terms: a superset of the answer's statements, not a
    copy, and a search for the removed lines finds it). Within a longer statement:
    test_no_expression_of_an_answer_stands_in_the_copy. SHARED: the lines the lesson has
    elsewhere on purpose."""
    copy = tmp_path / "copy"
    make(name, str(copy))
    lines = copy_lines(copy)
    for n in [name, *later(name)]:
        removed = [x for x in answer(n) if says_something(x)]
        shared = SHARED.get(n, {})
        assert set(shared) <= set(removed) and set(shared) <= lines, f"{n}: SHARED lists a line not shared"
        removed = [x for x in removed if x not in shared]
        assert removed, f"{n}: no line of its answer says anything: this test would check nothing"
        assert not (found := [x for x in removed if x in lines]), f"the copy of {name} holds {n}'s {found}"


@pytest.mark.fast
def test_no_task_or_hint_says_a_silent_bugs_fix():
    """A silent bug is found from a run's records, then the line: no exercise's task or hint (`list`,
    each EXERCISE.md) may hold an expression of the right line that the bug's line lacks (the record
    task once said silent_stale's fix, `kv_version < version`). `self.` and quotes are read loosely."""

    def exprs(line):
        nodes = ast.walk(ast.parse(line.strip()))
        small = (ast.Name, ast.Attribute, ast.Constant)
        said = (ast.unparse(n) for n in nodes if isinstance(n, ast.expr) and not isinstance(n, small))
        return {x.replace("self.", "").replace("'", '"') for x in said}

    texts = {n: (ex["task"] + " " + ex["hint"]).replace("'", '"') for n, ex in EXERCISES.items()}
    for name, ex in EXERCISES.items():
        if "silent" in ex:
            fixes = exprs(ex["silent"][1]) - exprs(ex["silent"][2])
            assert fixes, name
            said = [(other, f) for other, text in texts.items() for f in fixes if f in text]
            assert not said, f"{name}'s fix said in: {said}"


# Words of an answer that its copy's prose must not hold anywhere (docs, docstrings, comments): UNSAY's
# rewrites take them out of the places the project says them
SAID = {
    "loss": ("torch.exp(logp.detach() - mu)",),
    "recompute": ("kv_version = None",),
    "max_lag": ("+ max_lag + 1)", "+ k + 1)", "(v + 2 + 1)", "(max_lag + 1) x", "b <= v +", "<= {b['version'] + k}"),
}


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(UNSAY))
def test_the_copy_says_what_not_how(name, tmp_path):
    """Where the project's prose states an exercise's answer (recompute's docstring, the contract's entry
    for kv_version and docs/fork.md said what to set, and when), the copy says what the function does,
    not how: each UNSAY rewrite finds its place in the project once and leaves none of it in the copy,
    and the answer's words (SAID) stand in no text file of the copy but as the engine's own code."""
    copy = tmp_path / "copy"
    make(name, str(copy))
    for path, where, new in UNSAY[name]:
        project, mine = open(os.path.join(ROOT, path)).read(), (copy / path).read_text()
        if re.fullmatch(r"[\w.]+", where):
            assert ast.get_docstring(find(ast.parse(mine), where)) == new
            assert ast.get_docstring(find(ast.parse(project), where)) != new
        else:
            assert len(re.findall(where, project, flags=re.M)) == 1, f"{path}: {where!r} no longer in the project"
            assert not re.findall(where, mine, flags=re.M)
    engine = {x.strip() for x in open(os.path.join(ROOT, "engine.py"))}
    said = [x for x in copy_lines(copy) if any(w in x for w in SAID[name]) and x not in engine]
    assert not said, said


MIN_NODES = 8  # an expression this big says something: `b * layer * L` (7) is ordinary, `ppo_clip(...)`'s call (8) not
# Expressions of an answer the lesson writes elsewhere too, on purpose, each where (as SHARED,
# for expressions within longer statements); the test checks that each is still shared.
SHARED_EXPRESSIONS = {
    "correction": {'ppo_clip(logp, old, adv, cfg["clip_eps"])': "losses.loss_ppo, loss_geo"},
    "record": {"len(self.prompt_ids) + len(self.tokens)": "engine.Rollout.prefill_tokens"},
    "silent_behaviour": {'torch.cat([s["logprobs"] for s in mb])': "tools/gpu_check.py (the engine's mu)"},
}


def shape(node, keep, names):
    """An AST as a string, normalised: its local names renamed v0, v1, ... in order of
    appearance (so `x - x.mean()` is `r - r.mean()`); the names of `keep` (modules, builtins,
    the module's functions), attributes, keywords and constants as they are."""
    if isinstance(node, ast.Name):
        return node.id if node.id in keep else f"v{names.setdefault(node.id, len(names))}"
    if isinstance(node, ast.arg):
        return f"v{names.setdefault(node.arg, len(names))}"
    if isinstance(node, ast.AST):
        fields = (shape(getattr(node, f, None), keep, names) for f in node._fields if f != "ctx")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return f"[{','.join(shape(x, keep, names) for x in node)}]"
    return repr(node)


def big_expressions(tree):
    """Every expression of an AST with MIN_NODES nodes or more (a Load or Store not counted)."""
    size, out = {}, []
    for node in reversed(list(ast.walk(tree))):  # children before their parents
        kids = sum(size[c] for c in ast.iter_child_nodes(node))
        size[node] = kids + (not isinstance(node, ast.expr_context))
        if isinstance(node, ast.expr) and size[node] >= MIN_NODES:
            out.append(node)
    return out


def kept_names():
    """What shape() keeps: builtins and the top-level names of every module an exercise is in."""
    names = set(dir(builtins))
    for path in {ex["where"][0] if "where" in ex else ex["silent"][0] for ex in EXERCISES.values()}:
        for node in ast.parse(open(os.path.join(ROOT, path)).read()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {x.id for x in ast.walk(target) if isinstance(x, ast.Name)}
    return frozenset(names)


def answer_tree(name):
    """An exercise's answer as an AST: its function's body (the docstring left out), or a silent bug's right line."""
    ex = EXERCISES[name]
    if "silent" in ex:
        return ast.parse(ex["silent"][1].strip())
    fn = find(ast.parse(open(os.path.join(ROOT, ex["where"][0])).read()), ex["where"][1])
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    return ast.Module(body=body, type_ignores=[])


def leaks(copy, name):
    """Where the copy of exercise `name` holds an expression of MIN_NODES nodes or more of its
    answer or a later function exercise's, in any .py file, whatever statement it stands in and
    whatever its local names (SHARED_EXPRESSIONS aside): [(exercise, expression, file:line)].
    Checks that each shared expression is still an answer's and still in the copy."""
    keep, found = kept_names(), {}
    for d, dirs, files in os.walk(copy):
        dirs[:] = [x for x in dirs if x not in SKIP]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                for node in big_expressions(ast.parse(open(path).read())):
                    found.setdefault(shape(node, keep, {}), f"{os.path.relpath(path, copy)}:{node.lineno}")
    out = []
    for n in [name, *later(name)]:
        answer = {shape(node, keep, {}): node for node in big_expressions(answer_tree(n))}
        shared = {shape(ast.parse(x, mode="eval").body, keep, {}) for x in SHARED_EXPRESSIONS.get(n, {})}
        assert shared <= set(answer) and shared <= set(found), f"{n}: SHARED_EXPRESSIONS lists one not shared"
        out += [(n, ast.unparse(node), found[k]) for k, node in answer.items() if k in found and k not in shared]
    return out


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_no_expression_of_an_answer_stands_in_the_copy(name, tmp_path):
    """No expression of the answer (its exercise's, a later function exercise's) stands in
    any .py file of the copy within a longer statement, by its AST: an expression of eight
    nodes or more, its local names renamed (lab/study.py once computed GRPO's advantages
    with the `advantages` answer's expression, then `.to(device)`, a line no line search
    finds: test_the_leak_test_finds_an_answer_in_a_longer_statement)."""
    copy = tmp_path / "copy"
    make(name, str(copy))
    assert not (found := leaks(str(copy), name)), f"the copy of {name} holds {found}"


@pytest.mark.fast
def test_the_leak_test_finds_an_answer_in_a_longer_statement(tmp_path):
    """lab/study.py's old advantages, put back into a copy of the `advantages` exercise: the
    answer's expression with .to(device) after it, which no removed line matches; and again
    with other names, inside a sum."""
    copy = tmp_path / "copy"
    make("advantages", str(copy))
    study = str(copy / "lab" / "study.py")
    now = 'adv = advantages(rewards, cfg["group_size"]).to(device)'
    old = (
        'r = rewards.view(-1, cfg["group_size"])\n'
        "    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1).to(device)"
    )
    renamed = (
        "x = rewards.view(4, -1)\n    t = 2 * ((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-4)).sum()"
    )
    assert not leaks(str(copy), "advantages")
    replace(study, now, old)
    assert not set(answer("advantages")) & copy_lines(copy)  # the line test passes it
    assert {(n, where.split(":")[0]) for n, _, where in leaks(str(copy), "advantages")} == {
        ("advantages", "lab/study.py")
    }
    replace(study, old, now + "\n    " + renamed)
    assert {(n, where.split(":")[0]) for n, _, where in leaks(str(copy), "advantages")} == {
        ("advantages", "lab/study.py")
    }


# a short lesson run, to see that a command runs: one step, so one push, which costs time (on
# two-operation problems some groups hold right and wrong answers, so the step trains tokens: a
# push that costs nothing lands before the generator admits more, and sync's switch passes
# whatever the bound); and a run long enough for a silent bug's symptom (advantages, stale tokens)
SHORT = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--synth-steps", "2"]
SHORT += ["--eval-every", "0", "--no-plot"]
SYMPTOM = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0", "--no-plot"]
# lesson.main for each (tree, flags) of argv[1], in one Python that made one engine for all
# (lesson.main's `engine`: each run loads its own starting weights; the runs' settings give
# one engine's): each run imports its tree's modules (those of the last tree dropped from
# sys.modules), the libraries once. Writes each run's traceback, or None, to argv[2].
RUNS = """
import json, os, sys, traceback
jobs, engine, results = json.loads(sys.argv[1]), None, []
for tree, flags in jobs:
    own = {f[:-3] for f in os.listdir(tree) if f.endswith(".py")} | {"system", "tools", "lab"}
    for m in [m for m in sys.modules if m.split(".")[0] in own]:
        del sys.modules[m]
    os.chdir(tree)
    sys.path[0] = tree
    try:
        import lesson
        if engine is None:
            from engine import make_engine
            engine = make_engine(lesson.parse_config(flags))
        lesson.main(flags, engine=engine)
        results.append(None)
    except BaseException:
        results.append(traceback.format_exc()[-2000:])
json.dump(results, open(sys.argv[2], "w"))
"""


def exercise_md_commands(copy):
    """The commands a copy's EXERCISE.md gives, split as a shell would: [argv]."""
    return [shlex.split(c) for c in re.findall(r"`(\.venv/bin/python [^`]*)`", (copy / "EXERCISE.md").read_text())]


def lesson_runs(flags):
    """The runs that show a copy runs every regime and pool: its command's flags as they are,
    then with each other regime, and with the other pool: [(label, flags)]."""
    import argparse

    import config

    p = argparse.ArgumentParser()
    config.add_flags(p, "lesson")
    cfg = vars(p.parse_known_args(flags)[0])
    runs = [("EXERCISE.md", flags)] + [(r, [*flags, "--regime", r]) for r in config.REGIMES if r != cfg["regime"]]
    return runs + [(f"--pool {x}", [*flags, "--pool", x]) for x in ("fifo", "pace") if x != cfg["pool"]]


def test_every_copy_runs_its_exercise_md_and_every_regime(tmp_path):
    """Each exercise's copy, its answer written in (restore; a silent bug's copy as made): the
    lesson command its EXERCISE.md gives runs, and so does each regime and the other pool
    with its flags (each a short run, SHORT after them: the max_lag stand-in once crashed
    sync at its first push that cost time; each sync run's push here does). A silent bug's
    command shows its symptom (a longer run, SYMPTOM): against the same run of the project,
    silent_stale's stale share is lower (under the default regime, recompute, both would be
    0) and silent_behaviour's behaviour_gap is 0. Each EXERCISE.md's check command names its
    exercise and its copy, and the pace copy's, run from the project as given, passes every
    grader. The runs in a process a core, one engine each (RUNS)."""
    from tools.exercise import restore

    jobs, labels = [], []
    for name in EXERCISES:
        copy = tmp_path / name
        make(name, str(copy))
        commands = exercise_md_commands(copy)
        runs = [argv[2:] for argv in commands if argv[:2] == [".venv/bin/python", "lesson.py"]]
        checks = [argv for argv in commands if argv[:2] == [".venv/bin/python", "tools/exercise.py"]]
        assert len(runs) == 1 and len(commands) == 2, commands
        assert checks == [[".venv/bin/python", "tools/exercise.py", "check", name, str(copy)]], checks
        if "where" in EXERCISES[name]:
            restore(str(copy), name)  # as if the student had written it
        silent = "silent" in EXERCISES[name]
        for label, flags in lesson_runs(runs[0]):
            short = SYMPTOM if silent and label == "EXERCISE.md" else SHORT
            jobs.append((str(copy), [*flags, *short, "--out", str(tmp_path / "runs" / str(len(jobs)))]))
            labels.append((name, label))
        if silent:  # the same run of the project's code
            jobs.append((ROOT, [*runs[0], *SYMPTOM, "--out", str(tmp_path / "runs" / str(len(jobs)))]))
            labels.append((name, "the project"))
    # as many processes as cores, each one thread, one engine, every n-th run (output to a file:
    # a full pipe would stall one while the test waits on the other)
    n, results = len(os.sched_getaffinity(0)), [None] * len(jobs)
    reports, logs = [tmp_path / f"runs{k}.json" for k in range(n)], [tmp_path / f"runs{k}.log" for k in range(n)]
    outs = [open(log, "w") for log in logs]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RUNS, json.dumps(jobs[k::n]), str(reports[k])],
            stdout=outs[k],
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        for k in range(n)
    ]
    for k, proc in enumerate(procs):
        proc.wait()
        outs[k].close()
        assert proc.returncode == 0 and reports[k].exists(), logs[k].read_text()[-5000:]
        results[k::n] = json.loads(reports[k].read_text())
    failed = {labels[i]: why for i, why in enumerate(results) if why}
    assert not failed, "\n".join(f"{name}, {label}:\n{why}" for (name, label), why in failed.items())

    def metrics(name, label):
        out = jobs[labels.index((name, label))][1][-1]
        return [m for m in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in m]

    costly = {name: metrics(name, "sync")[0]["run_tokens"] for name in EXERCISES}
    assert all(costly.values()), f"a sync run whose push cost no time shows nothing: {costly}"

    def stale(name, label):
        return sum(m["stale_token_frac"] * m["trained_tokens"] for m in metrics(name, label))

    assert 0 < stale("silent_stale", "EXERCISE.md") < stale("silent_stale", "the project")
    assert all(m["behaviour_gap"] == 0 for m in metrics("silent_behaviour", "EXERCISE.md"))
    assert sum(m["behaviour_gap"] for m in metrics("silent_behaviour", "the project")) > 0
    check_pace = subprocess.run(
        exercise_md_commands(tmp_path / "pace")[-1], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    n = len(EXERCISES["pace"]["graders"])
    assert check_pace.returncode == 0 and f"{n}/{n} graders pass" in check_pace.stdout, check_pace.stdout


def test_a_course_copy_stubs_every_exercise_and_grades_each_alone(tmp_path):
    """make all: every function exercise stubbed, each graded alone (the others' code is the
    project's during grading): an answer written in it passes its own cheap graders while
    the others still fail."""
    copy = tmp_path / "course"
    make("all", str(copy))
    functions = [n for n in EXERCISES if "where" in EXERCISES[n]]
    for n in functions:
        path, qualname = EXERCISES[n]["where"]
        assert "NotImplementedError" in ast.unparse(find(ast.parse(open(copy / path).read()), qualname))
    from tools.exercise import restore

    restore(str(copy), "advantages")  # as if the student had written it
    assert all(check(CHEAP["advantages"], str(copy), "advantages").values())
    assert not any(check(CHEAP["loss"], str(copy), "loss").values())


def test_check_ignores_the_copys_tests_and_counts_a_skip_as_a_fail(tmp_path):
    """A conftest.py that passes every test, dropped into the copy and into its tests/,
    and tests/ edited to pass: `check` still runs the project's graders, which fail. A
    grader that skips (here: the student's code skips it) or is not there fails too."""
    copy = tmp_path / "copy"
    make("advantages", str(copy))
    cheat = "import pytest\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n    return True\n"
    cheat += "def pytest_collection_modifyitems(items):\n    items[:] = []\n"
    (copy / "conftest.py").write_text(cheat)
    (copy / "tests").mkdir()
    (copy / "tests" / "conftest.py").write_text(cheat)
    (copy / "tests" / "test_train.py").write_text("def test_advantages_by_hand():\n    pass\n")
    (copy / "pytest.ini").write_text("[pytest]\naddopts = -p no:junitxml\n")
    graders = ["tests/test_train.py::test_advantages_by_hand", "tests/test_train.py::test_no_such_grader"]
    assert check(graders, str(copy)) == {g: False for g in graders}
    task = repr("exercise: " + EXERCISES["advantages"]["task"])
    replace(str(copy / "grpo.py"), "raise NotImplementedError(" + task, "import pytest; pytest.skip(" + task)
    assert check(graders[:1], str(copy)) == {graders[0]: False}


def variant_jobs(tmp, variants, graders):
    """Each variant of `variants` ({exercise: [(label, file, old, new)]}, tests/exercise_mutants.py)
    put alone into a copy of the project, to be graded by graders(exercise): ({exercise: (a, b)}, the
    check_jobs jobs, its variants' jobs[a:b])."""
    jobs, spans = [], {}
    for name, table in variants.items():
        exercise = name if name in EXERCISES else None
        first = len(jobs)
        for i, (label, file, old, new) in enumerate(table):
            copy = str(tmp / name / str(i))
            copy_code(ROOT, copy)
            replace(os.path.join(copy, file), old, new)
            jobs.append((graders(name), copy, exercise))
        spans[name] = (first, len(jobs))
    return spans, jobs


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Every grade this file's three proofs read, in one check_jobs call (tools/exercise.py: each copy in
    its own pytest, all forked from one process that imported the libraries once; as many at a time as
    there are cores, the slow graders' copies first, so that no core waits alone at the end): each
    exercise's copy as `make` writes it and the project under every grader ("made"); each wrong answer
    under its exercise's cheap graders ("mutants"); each right answer in another form under all its
    exercise's graders ("accepted"). {kind: ...} as the tests below read it."""
    tmp = tmp_path_factory.mktemp("graded")
    for name in EXERCISES:
        make(name, str(tmp / "made" / name))
    graders = sorted({g for ex in EXERCISES.values() for g in ex["graders"]})
    made = [(graders, ROOT, None)]  # the project under every grader: the longest job, so it goes first
    made += [(EXERCISES[name]["graders"], str(tmp / "made" / name), name) for name in EXERCISES]
    accepted, a_jobs = variant_jobs(tmp / "accepted", ACCEPTED, lambda name: EXERCISES[name]["graders"])
    mutants, m_jobs = variant_jobs(tmp / "mutants", MUTANTS, lambda name: CHEAP.get(name) or EXERCISES[name]["graders"])
    results = check_jobs(made + a_jobs + m_jobs)
    a_res, m_res = results[len(made) : len(made) + len(a_jobs)], results[len(made) + len(a_jobs) :]
    return dict(
        made=(results[1 : len(made)], results[0]),
        accepted={name: a_res[a:b] for name, (a, b) in accepted.items()},
        mutants={name: m_res[a:b] for name, (a, b) in mutants.items()},
    )


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_fails_a_grader(name, graded):
    """Each wrong answer of tests/exercise_mutants.py, put alone into a copy of the
    project, fails at least one of the exercise's cheap graders (each copy graded in its
    own pytest: the graded fixture). That the
    project passes the same graders, graded the same way (a grading tree, tools/exercise.py's check), is
    test_the_cheap_graders_are_the_exercises_and_pass."""
    results = graded["mutants"][name]
    for (label, *_), got in zip(MUTANTS[name], results):
        print(f"{name}: {label}: caught by", [g for g, ok in got.items() if not ok])
    assert len(results) == len(MUTANTS[name]) and all(results), results
    assert not [m[0] for m, got in zip(MUTANTS[name], results) if all(got.values())], "mutants no grader catches"


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_every_accepted_variant_passes_every_grader(name, graded):
    """The mirror of the mutants: each right answer in another form the task allows
    (tests/exercise_mutants.py's ACCEPTED), put alone into a copy, passes every grader of its
    exercise."""
    results = graded["accepted"][name]
    assert len(results) == len(ACCEPTED[name])
    rejected = {v[0]: [g for g, ok in got.items() if not ok] for v, got in zip(ACCEPTED[name], results)}
    assert not any(rejected.values()), f"right answers a grader rejects: {rejected}"


@pytest.mark.fast
def test_every_grader_is_a_test_of_the_suite():
    """Each grader an exercise lists (and each cheap one) names a test function of its file: a
    test renamed or removed is found here in a second, not as every grade failing (the
    advantages exercise once listed a test of lesson.py's step that had gone)."""
    graders = {g for ex in EXERCISES.values() for g in ex["graders"]} | {g for gs in CHEAP.values() for g in gs}
    for g in sorted(graders):
        path, *names = g.split("::")
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        assert names[-1].split("[")[0] in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, g


@pytest.mark.fast
def test_the_cheap_graders_are_the_exercises_and_pass():
    """CHEAP: for each exercise, graders of its own; for code beside the exercises (the
    generator process's bound), its by-hand test. All pass on the project."""
    assert all(set(CHEAP[name]) <= set(EXERCISES[name]["graders"]) for name in CHEAP if name in EXERCISES)
    assert all(name in CHEAP for name in MUTANTS if name not in EXERCISES)
    graders = sorted({g for name in MUTANTS for g in CHEAP.get(name) or EXERCISES[name]["graders"]})
    assert all(check(graders, ROOT).values())


def test_check_prints_why_a_grader_fails(tmp_path):
    """`check` on a copy where one grader of several fails prints that grader's assertion, so
    a student who has no tests in the copy can act on it."""
    copy = tmp_path / "copy"
    copy_code(ROOT, str(copy))
    replace(str(copy / "pool.py"), "(-eff[g], _completed(pool[g]))", "(-eff[g], -_completed(pool[g]))")  # ties
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "exercise.py"), "check", "pace", str(copy)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and "1/8 graders pass" not in r.stdout
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert failed and len(failed) < 8, r.stdout
    assert "assert" in r.stdout.split(failed[0], 1)[1].splitlines()[1], r.stdout
