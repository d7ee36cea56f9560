"""
Every device layout, on faked GPU counts: 1, 2, 4 and 8 GPUs x 1-4 trainer ranks x 1-4
generator engines x automatic or explicit devices x a fresh run or its --resume. Each
cell either puts every process on a GPU of its own or stops with one line that names a
flag to change; sharing a GPU happens only when both device flags name it. Through
train.parse_config and devices.prepare, as every rank runs them.

    .venv/bin/python -m pytest -q tests/test_devices.py
"""

import json

import pytest
import torch

from system import devices
import train
from data import UsageError

pytestmark = pytest.mark.fast  # the tier to run after an edit (tests/conftest.py)


def ranks_of(flags, n_gpu, ranks, monkeypatch, resume_dir=None, visible=None):
    """Each trainer rank's parse_config + prepare, as torchrun starts them: returns
    (rank 0's cfg, the devices of every rank, the engines' environments)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpu)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    out, envs = [], None
    for r in range(ranks):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        argv = ["--resume", resume_dir, "--steps", "9"] if resume_dir else flags
        cfg = train.parse_config(argv)
        e = devices.prepare(cfg, ranks, r)
        if r == 0:
            first, envs = cfg, e
        out.append(cfg["trainer_device"])
    return first, out, envs


def saved_run(cfg, tmp_path):
    """A run directory as train.py leaves it: config.json (after prepare) and a checkpoint at step 1."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in ("config.json", "model.safetensors"):
        (ckpt / f).write_text("{}")
    torch.save(dict(step=1), ckpt / "trainer_state.pt")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


CELLS = [
    (g, k, n, how) for g in (1, 2, 4, 8) for k in (1, 2, 3, 4) for n in (1, 2, 3, 4) for how in ("auto", "explicit")
]


@pytest.mark.parametrize("n_gpu, ranks, engines, how", CELLS)
def test_every_layout_is_distinct_or_one_line(n_gpu, ranks, engines, how, tmp_path, monkeypatch, capsys):
    flags = ["--dataset", "gsm8k", "--out", str(tmp_path), "--engines", str(engines)]
    if how == "explicit":  # what a user would write: the engines first, then the ranks
        flags += [
            "--gen-device",
            ",".join(f"cuda:{i}" for i in range(engines)),
            "--train-device",
            ",".join(f"cuda:{engines + r}" for r in range(ranks)),
        ]
    fits = engines + ranks <= n_gpu
    try:
        cfg, trainers, envs = ranks_of(flags, n_gpu, ranks, monkeypatch)
    except UsageError as e:
        assert not fits, f"{engines} engines + {ranks} ranks fit {n_gpu} GPUs, yet: {e}"
        assert "\n" not in str(e) and "--" in str(e), str(e)  # one line, naming what to change
        return
    assert fits
    everyone = cfg["gen_devices"] + trainers
    assert len(set(everyone)) == len(everyone) and all(d.startswith("cuda:") for d in everyone), everyone
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [d[5:] for d in cfg["gen_devices"]]
    assert cfg["sync_backend"] == "nccl" and cfg["gen_memory_utilization"] == 0.85
    # --resume on the same machine: the saved flags, resolved again, give every rank the same devices
    assert (cfg["gen_device"], cfg["train_device"]) == (
        (flags[-3], flags[-1]) if how == "explicit" else ("auto", "auto")
    )
    again, trainers_again, _ = ranks_of(None, n_gpu, ranks, monkeypatch, resume_dir=saved_run(cfg, tmp_path))
    assert (again["gen_devices"], trainers_again) == (cfg["gen_devices"], trainers)


@pytest.mark.parametrize(
    "case, n_gpu, flags, visible, want",
    [
        # two GPUs, one of each: the layout of the README's GPU command
        ("default pair", 2, [], None, (["cuda:0"], ["cuda:1"], "nccl")),
        # the engines named, the trainer automatic: the first GPU no engine has
        (
            "engines named",
            4,
            ["--gen-device", "cuda:2,cuda:3", "--engines", "2"],
            None,
            (["cuda:2", "cuda:3"], ["cuda:0"], "nccl"),
        ),
        # one GPU shared on purpose: printed, gloo, vLLM's smaller share
        (
            "shared by choice",
            1,
            ["--gen-device", "cuda:0", "--train-device", "cuda:0"],
            None,
            (["cuda:0"], ["cuda:0"], "gloo"),
        ),
        ("all on CPU", 0, [], None, (["cpu"], ["cpu"], "gloo")),
        ("trainer on CPU", 1, ["--train-device", "cpu"], None, (["cuda:0"], ["cpu"], "gloo")),
        # one GPU, nothing said: a one-line error, not two processes on it
        ("one GPU, automatic", 1, [], "0", "need 2 GPUs"),
        (
            "index beyond CUDA_VISIBLE_DEVICES",
            1,
            ["--gen-device", "cuda:1", "--train-device", "cuda:0"],
            "3",
            "shows 1 GPU",
        ),
        ("more engines than GPUs", 2, ["--engines", "3"], None, "--engines 3 needs 3 GPUs"),
        (
            "an automatic engine's GPU given to the trainer",
            2,
            ["--train-device", "cuda:0"],
            None,
            "share it on purpose",
        ),
        (
            "two engines on one GPU",
            2,
            ["--engines", "2", "--gen-device", "cuda:0,cuda:0", "--train-device", "cuda:1"],
            None,
            "two generator engines on one GPU",
        ),
        ("not a device", 2, ["--gen-device", "gpu0"], None, "not cpu or cuda:N"),
    ],
)
def test_named_layouts(case, n_gpu, flags, visible, want, tmp_path, monkeypatch, capsys):
    argv = ["--dataset", "gsm8k", "--out", str(tmp_path), *flags]
    if isinstance(want, str):
        with pytest.raises(UsageError, match=want) as e:
            ranks_of(argv, n_gpu, 1, monkeypatch, visible=visible)
        assert "\n" not in str(e.value)
        return
    cfg, trainers, _ = ranks_of(argv, n_gpu, 1, monkeypatch, visible=visible)
    assert (cfg["gen_devices"], trainers, cfg["sync_backend"]) == want
    if case == "shared by choice":
        assert (
            cfg["gen_memory_utilization"] == 0.3
            and "shared by the generator and the trainer" in capsys.readouterr().out
        )


def test_generator_gpu_is_the_users_physical_gpu(monkeypatch, tmp_path):
    """CUDA_VISIBLE_DEVICES=2,3 and two GPUs visible: the generator (cuda:0 in our view)
    must be started on physical GPU 2, the trainer stays on cuda:1, weights go over nccl."""
    for visible, expect in (("2,3", "2"), (None, "0"), ("GPU-5f1c,GPU-77ab", "GPU-5f1c")):
        cfg, trainers, (env,) = ranks_of(
            ["--dataset", "gsm8k", "--out", str(tmp_path)], 2, 1, monkeypatch, visible=visible
        )
        assert env["CUDA_VISIBLE_DEVICES"] == expect
        assert (cfg["gen_devices"], trainers, cfg["sync_backend"]) == (["cuda:0"], ["cuda:1"], "nccl")


def test_a_node_without_rank_0_is_refused_in_one_line(monkeypatch, tmp_path):
    """torchrun across nodes: a rank whose node does not hold trainer rank 0 (RANK 2 as
    local rank 0) stops with one line; it got no engines and raised an IndexError
    (gens[0] of an empty list) with GPUs, and planned CPU engines it would never start
    without them."""
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for n_gpu in (2, 0):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n_gpu)
        cfg = train.parse_config(["--dataset", "gsm8k", "--out", str(tmp_path)])
        with pytest.raises(UsageError, match="its node does not hold rank 0") as e:
            devices.prepare(cfg, 4, 0)
        assert "\n" not in str(e.value)
