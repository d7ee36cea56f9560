"""The tests import the lesson's modules (train, generator, ...) and the tools
(tools.tiny, ...) from the repository root, and run its programs by relative path
(train.py, fixtures/...): both hold wherever pytest is started from."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
