"""Grouped SwiGLU experts on one GPU: the model's ``RoutedExperts`` with ``experts: torch_mm`` vs ``torch``.

    python examples/benchmarks/experts.py                         # 8192 tokens x top-6, 32 and 48 experts
    python examples/benchmarks/experts.py --out examples/benchmarks/results/experts_h200.txt

V4.1 expert shape 5120 -> 2304 -> 5120 in bf16: W1, W3 [E, 2304, 5120], W2 [E, 5120, 2304].  What is
timed is ``RoutedExperts.grouped_forward`` (tokens already sorted by expert, as the dispatcher hands
them over): three grouped GEMMs (``torch_mm``) or a per-expert loop of ``F.linear`` (``torch``), with
the fp32 clamped SwiGLU and routing weight in between.  FLOPs: forward 2·S·(3·5120·2304) for
S = tokens·top-k routed rows; forward + backward 3x that.  Routing "balanced" gives every expert S/E
rows, "zipf" gives expert r a share proportional to 1/(r+1) (a skewed router; the tail experts get
few rows).  CUDA-event medians.
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from gpu_timing import report, time_ms

from deepseek_v41.moe import RoutedExperts


def route(rows, experts, kind):
    # rows per expert, summing to `rows`
    if kind == "balanced":
        share = torch.ones(experts)
    else:
        share = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    return counts.tolist()


def bench_experts(E, S, D, I, fwd_flop, args):
    """Table rows for E local experts: grouped vs loop, balanced vs Zipf routing."""
    config = SimpleNamespace(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I, swiglu_limit=10.0)
    modules = {}
    for name, backend in (("grouped", "torch_mm"), ("loop", "torch")):
        m = RoutedExperts(config, {"experts": backend}).cuda()
        if modules:
            m.load_state_dict(modules["grouped"].state_dict())
        else:
            with torch.no_grad():
                for w, fan_in in ((m.w1, D), (m.w3, D), (m.w2, I)):
                    w.normal_(std=fan_in**-0.5)
        modules[name] = m.bfloat16()
    x = torch.randn(S, D, device="cuda").bfloat16().requires_grad_()
    weights = torch.rand(S, device="cuda")  # fp32 routing weights, as the router gives them
    dy = torch.randn(S, D, device="cuda").bfloat16()
    rows = []
    for kind in ("balanced", "zipf"):
        counts = torch.tensor(route(S, E, kind), device="cuda")
        impls = {
            name: (lambda m=m, c=counts: m.grouped_forward(x, c, weights)) for name, m in modules.items()
        }
        for name, fn in impls.items():
            with torch.no_grad():
                fwd = time_ms(fn, args.warmup, args.reps)
            m = modules[name]
            both = time_ms(
                lambda fn=fn, m=m: torch.autograd.grad(fn(), (x, m.w1, m.w3, m.w2), dy),
                args.warmup,
                args.reps,
            )
            tf, tb = fwd_flop / fwd / 1e9, 3 * fwd_flop / both / 1e9
            rows.append(
                f"{E:3d} {kind:9s} {counts.min().item():6d}/{counts.max().item():6d} {name:8s} {fwd:8.3f} {tf:12.1f} "
                f"{both:11.3f} {tb:16.1f} {100 * tf / args.peak:7.1f}%"
            )
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--experts", default="32,48")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=2304)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=790.0, help="bf16 dense TFLOP/s ceiling for MFU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("experts benchmark needs a CUDA GPU")

    D, I = args.hidden, args.inter
    S = args.tokens * args.topk
    fwd_flop = 2 * S * 3 * D * I
    lines = [
        (
            f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens x top-{args.topk} = {S} rows, "
            f"RoutedExperts.grouped_forward, SwiGLU {D}->{I}->{D} bf16; fwd {fwd_flop / 1e12:.2f} TFLOP, fwd+bwd {3 * fwd_flop / 1e12:.2f} TFLOP; "
            f"median of {args.reps} after {args.warmup} warm-up"
        ),
        (
            f"{'E':>3s} {'routing':9s} {'min/max rows':>13s} {'impl':8s} {'fwd ms':>8s} {'fwd TFLOP/s':>12s} "
            f"{'fwd+bwd ms':>11s} {'fwd+bwd TFLOP/s':>16s} {'MFU fwd':>8s}"
        ),
    ]
    torch.manual_seed(0)
    for E in [int(e) for e in args.experts.split(",")]:
        lines += bench_experts(E, S, D, I, fwd_flop, args)
        torch.cuda.empty_cache()
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
