"""Token dispatch + combine: ``dispatcher: hybridep`` (DeepEP HybridEP) vs ``dispatcher: torch`` (all-to-all).

    python examples/benchmarks/hybridep.py                  # one GPU (EP 1), V4.1 sizes
    torchrun --nproc-per-node 2 examples/benchmarks/hybridep.py --out examples/benchmarks/results/hybridep_h200.txt

Both dispatchers are called through their ``RoutedExperts.dispatcher`` interface with a stand-in for the
experts whose ``grouped_forward`` only scales each row by its routing weight, so what is timed is the token
path: routing layout, dispatch, permutation by local expert, unpermutation, combine (forward, and forward +
backward).  Per rank: ``--tokens`` tokens of hidden 5120 in bf16, top-6 of 384 experts split evenly over the
ranks, uniform random routing.  "GB/s" is the dispatched bf16 payload (tokens x top-k x hidden x 2 bytes) over
the forward time, the usual algorithm bandwidth of one dispatch + one combine.  CUDA-event medians.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_timing import report, time_ms

from deepseek_v41.training.expert_parallel import AllToAllDispatcher
from deepseek_v41.training.hybridep import HybridEPDispatcher


class RowScale:
    """Stands in for ``RoutedExperts``: the local expert count and a grouped_forward that scales the rows."""

    def __init__(self, n_experts, e_local):
        self.n_experts, self.w1 = n_experts, torch.empty(e_local, 0)

    def grouped_forward(self, x, counts, weights):
        return x * weights.unsqueeze(-1).to(x.dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    experts = RowScale(args.experts, args.experts // world)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    n, k = args.tokens, args.top_k
    x = torch.randn(n, args.hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    ids = torch.rand(n, args.experts, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(n, k, device="cuda", generator=gen).requires_grad_()
    dy = torch.randn(n, args.hidden, device="cuda", generator=gen)
    gbytes = n * k * args.hidden * 2 / 1e9
    lines = [
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, EP {world} (one rank a GPU); per rank {n} tokens"
        f" x top-{k} of {args.experts} experts, hidden {args.hidden} bf16; dispatch + combine through the dispatcher"
        f" interface (experts replaced by a row scaling); median of {args.reps} after 3 warm-up",
        f"{'dispatcher':<10} {'fwd ms':>8} {'fwd GB/s':>9} {'fwd+bwd ms':>11}  output vs torch: rel L2 err, max |diff|",
    ]
    outputs = {}
    for name, dispatcher in (("torch", AllToAllDispatcher(group)), ("hybridep", HybridEPDispatcher(group))):
        with torch.no_grad():
            outputs[name] = dispatcher(experts, x, ids, weights)  # first call: HybridEP JIT-compiles its kernels
            fwd = time_ms(lambda: dispatcher(experts, x, ids, weights), 3, args.reps)
        diff = outputs[name].double() - outputs["torch"].double()
        err = f"{(diff.norm() / outputs['torch'].double().norm()).item():.2e}, {diff.abs().max().item():.3g}"
        print(f"{name}: fwd {fwd:.3f} ms, output vs torch {err}", flush=True)
        both = time_ms(lambda: dispatcher(experts, x, ids, weights).backward(dy), 3, args.reps)
        lines.append(f"{name:<10} {fwd:8.3f} {gbytes / fwd * 1e3:9.1f} {both:11.3f}  {err}")
    if rank == 0:
        report("\n".join(lines), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
