"""The tests import the lesson's modules (train, generator, ...) and the tools
(tools.tiny, ...) from the repository root, and run its programs by relative path
(train.py, fixtures/...): both hold wherever pytest is started from.

The fast tier, what a student runs after an edit (lesson.py, the regimes, the loss,
the exercises' graders): `.venv/bin/python -m pytest -q -m fast`."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the tier to run after an edit (pytest -m fast)")
