"""
config.py, the one owner of the settings: what a run derives from its flags is
config.fill's, for both trainers alike (sync's --max-lag 0 among them), and --help
prints every default's real value, not the None that tells fill "not given".

    .venv/bin/python -m pytest -q tests/test_config.py
"""

import re
import subprocess
import sys

import pytest

import config
import losses
import lesson
import train

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)

PARSERS = {"train.py": train.parse_config, "lesson.py": lesson.parse_config}


def help_text(parse, capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    return re.sub(r"\s+", " ", capsys.readouterr().out)  # argparse wraps lines: one line, single spaces


@pytest.mark.parametrize("program", PARSERS)
def test_help_shows_every_default(program, capsys):
    """No flag prints a None default; those fill sets print their value per dataset and
    preset (what a plain run of that dataset or preset uses)."""
    text = help_text(PARSERS[program], capsys)
    assert "None" not in text
    for flag, says in {
        "--steps": "default: synth 150, gsm8k/math 500; --preset long: 60",
        "--max-lag": "default: 1; --preset long: 2",
        "--dataset": "default: synth",
        "--model": "default: synth tiny, gsm8k/math Qwen/Qwen3-0.6B; --preset long: tiny-long",
        "--max-num-seqs": "default: synth 256, gsm8k/math 512",
        "--pace-target": "default: synth 24, gsm8k/math 48",
    }.items():
        options = text[text.index(" options: ") :]
        assert says in options[options.index(f" {flag} ") :][:300], flag  # in its own help


@pytest.mark.parametrize("program", PARSERS)
def test_sync_runs_with_max_lag_0(program, tmp_path):
    """The config both trainers write to config.json (their parse_config: config.fill) runs
    sync at --max-lag 0, whatever --max-lag says; the other regimes keep theirs."""
    parse = PARSERS[program]
    assert parse(["--regime", "sync", "--out", str(tmp_path)])["max_lag"] == 0
    assert parse(["--regime", "sync", "--max-lag", "3", "--out", str(tmp_path)])["max_lag"] == 0
    assert parse(["--regime", "stale", "--preset", "long", "--out", str(tmp_path)])["max_lag"] == 2


def test_fill_derives_what_both_trainers_use(tmp_path):
    """The settings derived from the flags are the same in both trainers; train.py's adds the
    generator process's; a run directory is named unless --out says."""
    flags = ["--regime", "drain", "--prompts-per-step", "4", "--group-size", "4", "--pool", "pace"]
    a, b = lesson.parse_config(flags), train.parse_config(flags)
    for k in ("max_num_seqs", "pace_target", "schedule_steps", "model_path", "max_lag"):
        assert a[k] == b[k], k
    assert (a["max_num_seqs"], a["pace_target"], a["model_path"]) == (64, 6, config.PRESET_MODELS["tiny"])
    assert a["out"] == "out/lesson-drain-synth-s0" and b["out"].startswith("out/drain-synth-s0-")
    assert (b["queue_size"], b["start_version"], b["start_group"]) == (64, 0, 0) and "queue_size" not in a


def test_loss_names_are_grpos():
    """--loss's choices, spelled out in config.py (which imports no torch), are losses.LOSSES' keys,
    in its order: a loss added to losses.py is a choice only once it is added here too."""
    assert config.LOSS_NAMES == tuple(losses.LOSSES)


def test_config_imports_no_torch():
    """Neither config.py nor what it imports loads torch: eval.py checks its flags (config's
    tables and defaults) before torch and vLLM load, seconds later."""
    code = "import sys, config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=config.ROOT).returncode == 0
