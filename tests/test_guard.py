"""
The push's guard (system.push.checksum): what it costs per tensor, and that it sees
every bit; which tensors it notes the version counter of (shared), and what it refuses at
start (check_guard). No engine: the meta device for Qwen3-0.6B's shapes, small CPU tensors for the rest.
That a push which arrives other than sent raises in settle() is test_generator.py's
test_sync_is_exact (helpers.check_sync_is_exact, part 3), with a real engine.

    .venv/bin/python -m pytest -q tests/test_guard.py
"""

import pytest
import torch

from system.push import checksum
from tools.bench_train import QWEN3
from tools.bench_sync import guard_ops  # what bench_sync.py prints per push, counted the same way

OPS_PER_TENSOR = 5  # issue 58: a few per tensor, not ~6 per 2^16 elements (~70,000 per Qwen3-0.6B push)


def qwen3_06b_state_dict():
    """Qwen3-0.6B's state_dict on the meta device (no bytes, no hub): the tensors a push sends,
    the tied lm_head.weight included, in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **QWEN3["Qwen3-0.6B"])  # its config.json (tools/bench_train.py)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).state_dict()


def test_guard_ops_per_tensor_qwen3_06b():
    """The guard of a Qwen3-0.6B push, as send_weights runs it (`sent += checksum(t)` for every
    tensor; take() runs the same per tensor that arrives): at most 5 dispatched ops per tensor,
    views included, whatever the tensor's size (the embedding's 155.6M elements as a norm's 128)."""
    sd = qwen3_06b_state_dict()
    assert len(sd) == 311 and sum(t.numel() for t in sd.values()) == 751_632_384  # 28 x 11 + embed, norm, lm_head
    per_tensor = guard_ops(sd.values())
    worst = max(per_tensor, key=lambda c: sum(c.values()))
    assert sum(worst.values()) <= OPS_PER_TENSOR, f"{sum(worst.values())} ops for one tensor: {dict(worst)}"
    kernels = [sum(n for op, n in c.items() if not op.is_view) for c in per_tensor]
    assert max(kernels) <= 2, "more than the sum and the add per tensor"  # the rest are views: no launch


def test_guard_reads_in_place():
    """A bf16 tensor's checksum allocates its 8-byte result and nothing else: no cast copy of the
    tensor (torch's sum(dtype=int64) of an int16 view would make one 4x its size first)."""
    from torch.profiler import ProfilerActivity, profile

    t = torch.randn(1024, 1024).to(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        checksum(t)
    allocated = sum(e.cpu_memory_usage for e in p.events() if e.cpu_memory_usage > 0)
    assert allocated <= 64, f"{allocated} bytes allocated to check a {t.numel() * 2}-byte tensor"


def test_guard_sees_every_bit():
    """Each of a tensor's bits, flipped alone, changes its checksum, in every dtype a push sends
    and in the shapes that take the padded path (an odd length, a scalar); the same bits give
    the same checksum whatever dtype they are viewed as."""
    g = torch.Generator().manual_seed(0)
    for shape, dtype in [
        ((4, 8), torch.float32),
        ((2, 16), torch.bfloat16),
        ((3,), torch.bfloat16),
        ((), torch.float32),
    ]:
        t = torch.randn(shape, generator=g).to(dtype)
        base = checksum(t).tolist()
        b = t.reshape(-1).view(torch.uint8)
        for i in range(len(b) * 8):
            flipped = b.clone()
            flipped[i // 8] ^= 1 << (i % 8)
            assert checksum(flipped.view(dtype).reshape(shape)).tolist() != base, f"bit {i} of a {dtype} {shape}"
    t = torch.randn(8, 16, generator=g)
    assert checksum(t).tolist() == checksum(t.view(torch.int32)).tolist() == checksum(t.view(torch.bfloat16)).tolist()


def test_the_guard_keeps_only_what_something_else_holds():
    """send_weights notes the version counter of a tensor it sends only while something besides the push
    holds its bytes (system.push.shared): a parameter sent as it is (one float32 rank on CPU), or a state
    dict's tensor; a copy made for the push (cast to bf16, as Ranks.weights makes on a GPU) is the push's
    alone and no write can reach it, so it is let go once it has gone out."""
    from helpers import small_model
    from system.push import shared
    from system.ranks import Ranks

    model = small_model()
    assert all(shared(t) for t in Ranks().weights(model, torch.float32)[1])  # the parameters themselves
    assert not any(shared(t) for t in Ranks().weights(model, torch.bfloat16)[1])  # copies
    assert all(shared(t) for t in model.state_dict().values())
    assert not shared(torch.zeros(3)) and shared(next(model.parameters()).detach())


def test_the_guard_refuses_what_it_cannot_see():
    """Where the push sends the parameters themselves (float32 on CPU), check_guard refuses at start, in one
    line, what bumps no version counter: AdamW(fused=True) (its step writes every parameter and bumps none,
    torch 2.13), and parameters made under inference_mode (they have no counter); it lets AdamW's default
    (foreach or not) through, and anything where the push sends copies (bf16), which no write can reach."""
    from data import UsageError
    from helpers import small_model
    from system.push import check_guard

    model = small_model()
    for kw in (dict(), dict(foreach=True), dict(foreach=False)):
        check_guard(model, torch.optim.AdamW(model.parameters(), **kw), torch.float32, "cpu")
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    with pytest.raises(UsageError, match=r"^AdamW \(fused=True\) writes the parameters without bumping") as e:
        check_guard(model, fused, torch.float32, "cpu")
    assert "\n" not in str(e.value)
    check_guard(model, fused, torch.bfloat16, "cpu")  # copies go out
    p = next(model.parameters())  # the fused step does write it: the guard would not see it
    before, version = p.detach().clone(), p._version
    p.grad = torch.ones_like(p)
    fused.step()
    assert not torch.equal(p.detach(), before) and p._version == version
    with torch.inference_mode():
        frozen = small_model()
    with pytest.raises(UsageError, match="inference_mode"):
        check_guard(frozen, torch.optim.AdamW(frozen.parameters()), torch.float32, "cpu")
