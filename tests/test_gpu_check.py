"""
What the first GPU run reads, checked where a CPU reaches it: gpu_check's tensor code on
the meta device (which refuses a device mix as CUDA does), its device check failing, the
trainer's memory plan against the state dict a push sends (Qwen3 shapes built on the meta
device: no download, no memory), the plan on a GPU shared with an engine, and the vLLM
model runner pinned and read back. The whole of gpu_check on CPU: test_train.py.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py
"""

import os

import pytest


pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)


def test_vllm_model_runner_is_pinned_and_read_back():
    """Every engine's environment asks vLLM for its V1 model runner (engine.vllm_env), and
    make_engine's read-back (engine.check_engine_config) passes a real VllmConfig for the
    tiny model made under it (EngineArgs.create_engine_config: no engine started) and
    refuses the same config once it answers V2: vLLM's use_v2_model_runner reads the
    environment when asked (a CPU config cannot be made with V2: it needs triton)."""
    import vllm.envs
    from vllm import EngineArgs
    from engine import check_engine_config, vllm_env

    assert (
        vllm_env(on_cpu=True)["VLLM_USE_V2_MODEL_RUNNER"] == vllm_env(on_cpu=False)["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    )
    cached, saved = vllm.envs._is_envs_cache_enabled(), os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    vllm.envs.disable_envs_cache()  # an engine started in this process froze vLLM's reading of the environment
    try:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = vllm_env()["VLLM_USE_V2_MODEL_RUNNER"]
        path = os.path.join("weights", "tiny")
        config = EngineArgs(model=path, dtype="float32", async_scheduling=False).create_engine_config()
        assert config.use_v2_model_runner is False
        check_engine_config(config)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        assert config.use_v2_model_runner is True
        with pytest.raises(RuntimeError, match="Model Runner V2"):
            check_engine_config(config)
    finally:
        if saved is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
        if cached:
            vllm.envs.enable_envs_cache()
