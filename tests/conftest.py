"""The tests import the lesson's modules (train, generator, ...) and the tools
(tools.build_tiny, ...) from the repository root, and run its programs by relative path
(train.py, fixtures/...): both hold wherever pytest is started from. What several test
files share is in tests/helpers.py (no test file imports another).

The fast tier, what a student runs after an edit (lesson.py, the regimes, the loss,
the exercises' graders): `.venv/bin/python -m pytest -q -m fast`. The pages' checks (links,
the first sitting's stated count, the marked tables against their data) are a tier of their
own, `-m prose`, which CI runs with everything else."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the tier to run after an edit (pytest -m fast)")
    config.addinivalue_line(
        "markers", "prose: the pages' checks: links, stated counts, marked tables (pytest -m prose)"
    )


@pytest.fixture(scope="session", autouse=True)
def at_the_root():
    """Every test runs in the repository root (train.py, fixtures/, out/ by relative
    path); the directory pytest started in is restored after the session. Importing
    this file changes nothing."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        yield


@pytest.fixture(autouse=True)
def cores_restored():
    """The cores this process may run on, and torch's thread count, as they were before the test:
    devices.prepare pins the trainer to its half of the cores (one core of two), and a test that
    calls it would leave every later test, and every process they start, on that one core."""
    cores = os.sched_getaffinity(0)
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    yield
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # a no-op (with vLLM's warning) once an engine is in this process
