"""The tests import the lesson's modules (train, generator, ...) and the tools
(tools.build_tiny, ...) from the repository root, and run its programs by relative path
(train.py, fixtures/...): both hold wherever pytest is started from. What several test
files share is in tests/helpers.py (no test file imports another).

The fast tier, what a student runs after an edit (lesson.py, the regimes, the loss,
the exercises' graders): `.venv/bin/python -m pytest -q -m fast` (one process: two
workers would each start their own engine and import everything). The whole suite,
as CI runs it: `.venv/bin/python -m pytest -q -n 2 --maxschedchunk 1`: two pytest-xdist
workers take the tests one at a time from one queue, the `slow` ones (each over ~20 s
alone: whole runs, torchrun jobs, a 30-layer model) first, so that neither worker is left
with a long test after the other has finished."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the tier to run after an edit (pytest -m fast)")
    config.addinivalue_line("markers", "slow: over ~20 s alone; run first")


def pytest_collection_modifyitems(items):
    """The slow tests first, each group in the order collected (a stable sort)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def at_the_root():
    """Every test runs in the repository root (train.py, fixtures/, out/ by relative
    path); the directory pytest started in is restored after the session. Importing
    this file changes nothing."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        yield
