"""
Several trainer ranks under torchrun: the model sharded with FSDP2, each rank its share
of the batch, the push gathered from the shards, checkpoints of sharded optimizer state.
With one process every method here is a no-op or the identity.

    torchrun --nproc_per_node 2 train.py --engines 2 ...     # 2 trainer ranks, 2 generator engines
"""

import os
import threading
import time
from datetime import timedelta


def weight_specs(state_dict, dtype=None):
    """(name, dtype, shape) of every tensor, in send order (Ranks.weights; the push sends
    these first: system.handle.GeneratorHandle.push). We send the state_dict,
    not named_parameters(): the latter leaves out tied weights (lm_head.weight on
    Qwen3-0.6B and the tiny model), and vLLM then keeps its load-time copy."""
    return [(k, str(dtype or v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state_dict.items()]


def watch_launcher():
    """torchrun starts each rank in a session of its own, so when torchrun itself is
    killed (-9: it cannot clean up) nothing stops the ranks. Each rank exits when its
    launcher is gone; rank 0's engines follow it (they watch rank 0 the same way)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-torchrun").start()


class Ranks:
    """This process's place among the trainer ranks (torchrun's environment)."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # rank 0 is train.py as a student reads it: it spawns the engines, reads the sample queue, forms
        # each batch, scores it and hands each rank its share (scatter); ranks 1..K-1 run train.follow:
        # a share, the same optimizer step, help gather
        self.is_main = self.rank == 0
        self.mesh = self.objects = None

    def start(self, device):
        """Join the trainer ranks' process group: nccl between GPUs, gloo on CPUs; and a
        gloo group for the batch's Python objects. Long timeouts: a rank waits in a
        collective while rank 0 waits for answers or evaluates (its own watchdog, the
        stall bound, ends a stuck run first)."""
        if "TORCHELASTIC_RUN_ID" in os.environ:
            watch_launcher()
        if self.world == 1:
            return
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(hours=2),
            device_id=__import__("torch").device(device) if backend == "nccl" else None,
        )
        # the mesh's device type passed explicitly: the default picks CUDA whenever one is
        # visible, and gloo then fails (pytorch issue 132471)
        self.mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (self.world,))
        self.objects = dist.new_group(backend="gloo", timeout=timedelta(hours=2))

    def shard(self, model):
        """FSDP2: each decoder layer, then the root (embeddings, final norm, the tied
        lm_head), sharded over the ranks; gradients summed, not averaged, across them."""
        if self.world == 1:
            return model
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in model.get_decoder().layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        # the loss stays the mean over the whole batch: rank 0 weighs each answer's tokens for the whole
        # batch before it splits it (scatter), and FSDP2's reduce-scatter sums the ranks' gradients (as
        # torchtitan), so the gradient does not depend on K
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # a plain sum (gloo has no PREMUL_SUM, which a
                m.set_force_sum_reduction_for_comms(True)  # factor alone would ask of NCCL)
        return model

    def reshard(self, model):
        """After forwards without autograd (grpo.old_logprobs' pi_old): FSDP2 keeps the root
        module's parameters (embeddings, final norm, the tied lm_head) gathered after a forward,
        for the backward it expects; after a step's backward, the next forward with autograd
        then ran on them and gave wrong gradients (tests/test_ranks.py: m2po's step after
        another's, 0.09 off where 1e-6 holds; every --minibatches step after a run's first).
        Put them back into their shards."""
        if self.world == 1:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def from_main(self, obj):
        """Rank 0's `obj` on every rank: what each rank decided alone before the ranks met
        (the default run directory names the second it was made in) becomes rank 0's."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        out = [obj]
        dist.broadcast_object_list(out, src=0, group=self.objects)
        return out[0]

    def scatter(self, batch=None, adv=None, weights=None, count_micro_batches=None):
        """Rank 0: split the batch across the ranks, longest answers first to the rank
        with the fewest tokens so far. Every rank returns (its answers, their advantages,
        their token weights, the micro-batches every rank must run: the most
        count_micro_batches gives any rank's answers whose advantage is not 0)."""
        if self.world == 1:
            return batch, adv, weights, 0
        import torch.distributed as dist

        parts = None
        if self.is_main:
            shares, tokens = [[] for _ in range(self.world)], [0] * self.world
            for i in sorted(range(len(batch)), key=lambda i: -len(batch[i]["token_ids"])):
                r = tokens.index(min(tokens))
                shares[r].append(i)
                tokens[r] += len(batch[i]["token_ids"])
            # FSDP2's gathers are collectives: every rank runs as many micro-batches as the busiest
            n_micro = max(count_micro_batches([batch[i] for i in idx if adv[i] != 0]) for idx in shares)
            parts = [([batch[i] for i in idx], adv[idx].cpu(), weights[idx].cpu(), n_micro) for idx in shares]
        out = [None]
        dist.scatter_object_list(out, parts, src=0, group=self.objects)
        return out[0]

    def gather(self, obj):
        """Every rank's `obj`, in rank order, on every rank (one rank: [obj])."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.objects)
        return out

    def sum(self, *values):
        """Floats summed over the ranks (the loss, logged on rank 0)."""
        if self.world == 1:
            return values
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.objects)
        return tuple(t.tolist())

    def weights(self, model, dtype):
        """What a push sends: (specs, tensors), the tensors in `dtype` one at a time, each
        gathered from the shards before it is yielded (every rank must walk them; only
        rank 0 sends them on). One rank: each tensor cast as it is sent, no copy of the
        whole model."""
        state = model.state_dict()  # DTensors under FSDP2: their shapes are the full ones

        # every rank gathers each tensor in the same order; a DTensor is all-gathered (on NCCL full_tensor
        # returns once the gather is queued; the stream orders the broadcast after it), held by the push alone.
        # Rank 0 waits for each broadcast before the next gather (send_weights(serial)) and for the whole push
        # before the next step (GeneratorHandle.push): two NCCL communicators busy at once on rank 0's GPU is
        # what NCCL does not support (interleaved, they deadlocked NCCL past two ranks: TRL issues 6797, 7103)
        def tensors():
            for t in state.values():
                yield (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to(dtype)

        return weight_specs(state, dtype), tensors()

    def full_state_dict(self, model):
        """The model's whole state dict on rank 0 (on the CPU), gathered from every rank."""
        if self.world == 1:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_optimizer(self, model, opt, path):
        """K > 1: every rank writes its optimizer shards to path/optimizer/
        (torch.distributed.checkpoint); one rank: nothing here (trainer_state.pt has it)."""
        # rank 0 writes the Hugging Face directory (checkpoint.save_checkpoint); DCP reshards on load, so
        # --resume works at any number of ranks (not across 1 and K > 1: load_optimizer refuses)
        if self.world == 1:
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(path, "optimizer"))

    def load_optimizer(self, model, opt, state, path):
        """--resume: the optimizer state that save_optimizer (or, one rank, system/checkpoint.py) wrote."""
        from data import UsageError

        saved = state.get("world", 1)
        if (saved == 1) != (self.world == 1):
            raise UsageError(
                f"--resume: the checkpoint was saved by {saved} trainer rank(s); resume with "
                + ("plain python train.py" if saved == 1 else "torchrun and more than one rank")
            )
        if self.world == 1:
            opt.load_state_dict(state["opt"])
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        loaded = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(loaded, checkpoint_id=os.path.join(path, "optimizer"))
        set_optimizer_state_dict(model, opt, loaded["optimizer"])

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.objects)

    def stop(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
