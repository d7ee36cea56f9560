"""
The exercises (tools/exercise.py, docs/course.md) grade themselves: on a copy with an
exercise's code removed (or its silent bug put in) every one of its graders fails, and
on the project's own code every grader passes.

    .venv/bin/python -m pytest -q tests/test_exercises.py
"""

import ast
import keyword
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from exercise_mutants import ACCEPTED, CHEAP, MUTANTS
from tools.exercise import EXERCISES, ROOT, SKIP, answer, check, check_jobs, copy_code, find, later, make, replace


def test_every_grader_fails_on_every_exercise_and_passes_on_the_project(tmp_path):
    """Each exercise's copy as `make` writes it fails every one of its graders, and every
    exercise's graders pass on the project's own code (the fast tier runs the cheap ones:
    test_the_cheap_graders_are_the_exercises_and_pass). Each copy, and the project, graded
    in its own pytest, forked from one process: tools/exercise.py's check_jobs."""
    for name in EXERCISES:
        make(name, str(tmp_path / name))
    graders = sorted({g for ex in EXERCISES.values() for g in ex["graders"]})
    *results, project = check_jobs(
        [(EXERCISES[name]["graders"], str(tmp_path / name), name) for name in EXERCISES] + [(graders, ROOT, None)]
    )
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
    "loss": {"ratio = torch.exp(logp.detach() - mu)": "grpo.loss_cispo"},
    "correction": {'surrogate, clipped = ppo_clip(logp, old, adv, cfg["clip_eps"])': "grpo.loss_ppo, loss_geo"},
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
    out (the exercise's, a later function exercise's) stands in any file of the copy, tools
    and docs included, as it is or within a longer statement (the generator process once
    wrote max_lag's budget and KV term again, with more terms: a superset of the answer's
    statements, not a copy, and a search for the removed lines finds it). SHARED: the lines
    the lesson has elsewhere on purpose."""
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


def test_a_written_copy_runs_its_lesson(tmp_path):
    """The copy of the first exercise (advantages: every later function exercise has its
    stand-in there, tools/exercise.py's EXERCISES), the project's answer written into it: the
    copy's own lesson.py --preset long runs 4 steps end to end with the copy's .venv, as
    EXERCISE.md tells the student (--eval-every 0: the two 512-problem evaluations would be
    most of its time). A stub left in a later exercise's place raises NotImplementedError at
    the first admission, loss or switch. The other exercises' copies run the same way (by
    hand: issue 60's note)."""
    import json

    from tools.exercise import restore

    copy, out = tmp_path / "copy", tmp_path / "run"
    make("advantages", str(copy))
    assert "lesson.py --preset long" in (copy / "EXERCISE.md").read_text()
    restore(str(copy), "advantages")  # as if the student had written it
    flags = ["--preset", "long", "--steps", "4", "--eval-every", "0", "--no-plot", "--out", str(out)]
    r = subprocess.run(
        [str(copy / ".venv" / "bin" / "python"), "lesson.py", *flags], cwd=copy, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    steps = [m["step"] for m in map(json.loads, open(out / "metrics.jsonl")) if "loss" in m]
    assert steps == [1, 2, 3, 4], steps


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


def grade_variants(tmp, variants, graders, project):
    """Each variant of `variants` ({exercise: [(label, file, old, new)]}, tests/exercise_mutants.py)
    put alone into a copy of the project and graded by graders(exercise) (with project: the
    project too, graded the same way), every copy of every exercise in one check_jobs call:
    each copy in its own pytest, all forked from one process that imported the libraries once.
    Returns {exercise: (each variant's {grader: passed}, the project's or None)}."""
    jobs, spans = [], {}  # spans: exercise -> its variants' jobs, jobs[a:b]; its project job, jobs[b]
    for name, table in variants.items():
        exercise = name if name in EXERCISES else None
        first = len(jobs)
        for i, (label, file, old, new) in enumerate(table):
            copy = str(tmp / name / str(i))
            copy_code(ROOT, copy)
            replace(os.path.join(copy, file), old, new)
            jobs.append((graders(name), copy, exercise))
        spans[name] = (first, len(jobs))
        if project:
            jobs.append((graders(name), ROOT, exercise))
    results = check_jobs(jobs)
    return {name: (results[a:b], results[b] if project else None) for name, (a, b) in spans.items()}


@pytest.fixture(scope="module")
def mutants_graded(tmp_path_factory):
    return grade_variants(
        tmp_path_factory.mktemp("mutants"), MUTANTS, lambda name: CHEAP.get(name) or EXERCISES[name]["graders"], True
    )


@pytest.fixture(scope="module")
def accepted_graded(tmp_path_factory):
    return grade_variants(tmp_path_factory.mktemp("accepted"), ACCEPTED, lambda name: EXERCISES[name]["graders"], False)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_fails_a_grader(name, mutants_graded):
    """Each wrong answer of tests/exercise_mutants.py, put alone into a copy of the
    project, fails at least one of the exercise's cheap graders (each copy graded in its
    own pytest, forked from one process: tools/exercise.py's check_jobs, by grade_variants)."""
    results, project = mutants_graded[name]
    for (label, *_), got in zip(MUTANTS[name], results):
        print(f"{name}: {label}: caught by", [g for g, ok in got.items() if not ok])
    assert len(results) == len(MUTANTS[name]) and all(results), results
    assert not [m[0] for m, got in zip(MUTANTS[name], results) if all(got.values())], "mutants no grader catches"
    assert all(project.values()), project  # and the project passes them, graded the same way


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_every_accepted_variant_passes_every_grader(name, accepted_graded):
    """The mirror of the mutants: each right answer in another form the task allows
    (tests/exercise_mutants.py's ACCEPTED), put alone into a copy, passes every grader of its
    exercise."""
    results, _ = accepted_graded[name]
    assert len(results) == len(ACCEPTED[name])
    rejected = {v[0]: [g for g, ok in got.items() if not ok] for v, got in zip(ACCEPTED[name], results)}
    assert not any(rejected.values()), f"right answers a grader rejects: {rejected}"


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
