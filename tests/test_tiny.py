"""
The tiny preset (tools/tiny.py): the weights the repository ships are the ones its
recipe builds, and the recipe still builds.

    .venv/bin/python -m pytest -q tests/test_tiny.py
"""

import os

from preflight import model_path


def test_shipped_tiny_model_is_the_recipes():
    """weights/tiny is what tiny.py's recipe built (its hash), with the tokenizer the
    recipe builds now: change the recipe or the synth code and this fails until the
    weights are shipped again (python tools/tiny.py --rebuild, then copy the build)."""
    import json
    from transformers import AutoTokenizer
    from tools import tiny
    with open(os.path.join("weights", "tiny", "recipe.json")) as f:
        assert json.load(f)["recipe_hash"] == tiny.recipe_hash(), "weights/tiny is from another recipe: ship a new build"
    assert tiny.tiny_model_dir() == tiny.shipped() == model_path("tiny")  # what --model tiny loads
    assert AutoTokenizer.from_pretrained(tiny.shipped()).get_vocab() == tiny.build_tokenizer().get_vocab()


def test_tiny_recipe_builds(tmp_path, monkeypatch):
    """The rebuild path (python tools/tiny.py --rebuild), shortened to 3 warm-start steps: a
    complete cache directory that transformers loads."""
    from transformers import AutoModelForCausalLM
    from tools import tiny
    monkeypatch.setattr(tiny, "RECIPE", dict(tiny.RECIPE, sft_steps=3, warmup=1))
    path = tiny.tiny_model_dir(root=str(tmp_path), rebuild=True)
    assert path.startswith(str(tmp_path)) and os.path.exists(os.path.join(path, "recipe.json"))
    assert AutoModelForCausalLM.from_pretrained(path).num_parameters() == 793_728
