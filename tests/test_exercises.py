"""
The exercises (tools/exercise.py, docs/course.md) grade themselves: on a copy with an
exercise's code removed (or its silent bug put in) every one of its graders fails, and
on the project's own code every grader passes.

    .venv/bin/python -m pytest -q tests/test_exercises.py
"""

import pytest

from tools.exercise import EXERCISES, ROOT, check, make


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
