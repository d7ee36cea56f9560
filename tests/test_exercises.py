"""
The exercises (tools/exercise.py, docs/course.md) grade themselves: on a copy with an
exercise's code removed (or its silent bug put in) every one of its graders fails, and
on the project's own code every grader passes.

    .venv/bin/python -m pytest -q tests/test_exercises.py
"""

import os
from collections import Counter

import pytest

from exercise_mutants import CHEAP, MUTANTS
from tools.exercise import EXERCISES, KEPT_BACK, ROOT, SKIP, answer, check, check_many, copy_code, make, replace


@pytest.mark.fast
def test_every_grader_passes_on_the_project():
    graders = sorted({g for ex in EXERCISES.values() for g in ex["graders"]})
    results = check(graders, ROOT)
    assert results and all(results.values()), [t for t, ok in results.items() if not ok]


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_grader_fails_on_the_exercise(name, tmp_path):
    make(name, str(tmp_path / "copy"))
    results = check(EXERCISES[name]["graders"], str(tmp_path / "copy"))
    assert results and not any(results.values()), [t for t, ok in results.items() if ok]


def text_lines(root):
    """{stripped line: count} over the text files under `root` (not SKIP)."""
    counts = Counter()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP]
        for f in files:
            try:
                counts.update(line.strip() for line in open(os.path.join(d, f), encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                pass
    return counts


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_copy_holds_no_answer(name, tmp_path):
    """A student's copy has none of the answer's own lines (a line it shares with code that
    stays, `import torch` or loss_ppo's call of ppo_clip, may stay as often as that code
    has it), no test (the graders, tests/test_train.py's reference loss, the mutants) and
    not tools/exercise.py (the silent bugs' right lines); it has EXERCISE.md and a .venv."""
    copy = tmp_path / "copy"
    make(name, str(copy))
    assert not (copy / "tests").exists() and not (copy / "tools" / "exercise.py").exists()
    assert (copy / "EXERCISE.md").exists() and (copy / ".venv" / "bin" / "python").exists()
    lines, kept = answer(name), text_lines(copy)
    project = text_lines(ROOT)
    for d in KEPT_BACK:
        project.subtract(
            text_lines(os.path.join(ROOT, d))
            if os.path.isdir(os.path.join(ROOT, d))
            else Counter(line.strip() for line in open(os.path.join(ROOT, d)))
        )
    own = [line for line in lines if project[line] == lines.count(line)]  # in the answer only
    assert own, "the answer has no line of its own: this test would check nothing"
    for line in lines:
        assert kept[line] <= project[line] - lines.count(line), f"{name}: the copy holds {line!r}"


@pytest.mark.fast
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
    replace(str(copy / "grpo.py"), "raise NotImplementedError(", "import pytest; pytest.skip(")
    assert check(graders[:1], str(copy)) == {graders[0]: False}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_fails_a_grader(name, tmp_path):
    """Each wrong answer of tests/exercise_mutants.py, put alone into a copy of the
    project, fails at least one of the exercise's cheap graders (each copy graded in its
    own pytest, forked from one process: tools/exercise.py's check_many)."""
    copies = []
    for i, (label, file, old, new) in enumerate(MUTANTS[name]):
        copies.append(str(tmp_path / str(i)))
        copy_code(ROOT, copies[-1])
        replace(os.path.join(copies[-1], file), old, new)
    graders = CHEAP.get(name, EXERCISES[name]["graders"])
    results = check_many(graders, copies)
    for (label, *_), got in zip(MUTANTS[name], results):
        print(f"{name}: {label}: caught by", [g for g, ok in got.items() if not ok])
    assert not [m[0] for m, got in zip(MUTANTS[name], results) if all(got.values())], "mutants no grader catches"
    assert all(check(graders, ROOT).values())  # and the project passes them, graded the same way


@pytest.mark.fast
def test_the_cheap_graders_are_the_exercises_and_pass():
    assert all(set(CHEAP[name]) <= set(EXERCISES[name]["graders"]) for name in CHEAP)
    graders = sorted({g for name in MUTANTS for g in CHEAP.get(name, EXERCISES[name]["graders"])})
    assert all(check(graders, ROOT).values())
