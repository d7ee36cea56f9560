"""
The tiny preset (tools/build_tiny.py): the weights the repository ships are the ones its
recipe builds, and the recipe still builds.

    .venv/bin/python -m pytest -q tests/test_tiny.py
"""

import os

import pytest

from config import model_path


@pytest.mark.parametrize("name", ["tiny", "tiny-long"])
def test_shipped_tiny_model_is_the_recipes(name):
    """weights/<name> is what tools/build_tiny.py's recipe built (its hash), with the tokenizer the
    recipe builds now: change the recipe or the synth code and this fails until the
    weights are shipped again (python tools/build_tiny.py --rebuild NAME, then copy the build)."""
    import json
    from transformers import AutoTokenizer
    from tools import build_tiny as tiny

    with open(os.path.join("weights", name, "recipe.json")) as f:
        assert json.load(f)["recipe_hash"] == tiny.recipe_hash(name), (
            f"weights/{name} is from another recipe: ship a new build"
        )
    assert tiny.tiny_model_dir(name=name) == tiny.shipped(name) == model_path(name)  # what --model NAME loads
    assert AutoTokenizer.from_pretrained(tiny.shipped(name)).get_vocab() == tiny.build_tokenizer().get_vocab()


@pytest.mark.parametrize("name", ["tiny", "tiny-long"])
def test_tiny_recipe_builds(name, tmp_path, monkeypatch):
    """The rebuild path (python tools/build_tiny.py --rebuild NAME), shortened to 3 warm-start steps
    (tiny-long's stop_at, 2 of them): a complete cache directory that transformers loads."""
    from transformers import AutoModelForCausalLM
    from tools import build_tiny as tiny

    short = dict(tiny.RECIPES[name], sft_steps=3, warmup=1) | (
        {"stop_at": 2} if "stop_at" in tiny.RECIPES[name] else {}
    )
    monkeypatch.setitem(tiny.RECIPES, name, short)
    path = tiny.tiny_model_dir(root=str(tmp_path), rebuild=True, name=name)
    assert path.startswith(str(tmp_path)) and os.path.exists(os.path.join(path, "recipe.json"))
    assert AutoModelForCausalLM.from_pretrained(path).num_parameters() == 793_728


def test_long_preset_starts_from_tiny_long():
    """--preset long runs from the shipped tiny-long weights (config.py's PRESETS), and a
    --model given on the command line still wins over the preset's."""
    from tools import build_tiny as tiny
    from train import parse_config

    cfg = parse_config(["--preset", "long", "--out", "out/test-preset"])
    assert (cfg["model"], cfg["synth_steps"], cfg["steps"]) == ("tiny-long", "1-12", 60)
    assert model_path(cfg["model"]) == tiny.shipped("tiny-long")
    assert parse_config(["--preset", "long", "--model", "tiny", "--out", "out/test-preset"])["model"] == "tiny"
