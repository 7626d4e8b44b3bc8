"""CSA2 sparse attention on one GPU: the tilelang backend vs the PyTorch reference, forward and backward.

At head dim 512 on Hopper the backend's forward is the hand-written CUDA kernel (sparse_attention_cuda);
the row "tilelang, TileLang fwd" runs the same backend with DS41_SPARSE_FWD=tilelang (the TileLang forward),
"tilelang, atomic bwd" with DS41_SPARSE_BWD=atomic (fp32 atomics, not bit-deterministic; the default backward is),
and --kernels times both forward kernels alone, in the same run.

    python examples/benchmarks/attention.py                      # V4.1 shape: b=1 s=4096 h=64 d=512 k=640
    python examples/benchmarks/attention.py --ratio 2 --out examples/benchmarks/results/attention_h200.txt
    python examples/benchmarks/attention.py --kernels    # also the raw kernels (no padding/casts), both backward
                                                         # modes (deterministic default, atomic opt-in), the indexer
    python examples/benchmarks/attention.py --bounds     # the forward kernel vs its gather-only and math-only probes

FLOP convention: forward 4·b·s·h·k·d (QKᵀ and P·V), backward 2.5x the forward (QKᵀ recompute, dO·Vᵀ,
dS·K, dSᵀ·Q, Pᵀ·dO), with k the index slots including empty (-1) ones.  Times are CUDA-event
medians after warm-up; the backward is the whole autograd backward (Δ, dsink and casts included).
MFU is against the measured bf16 dense GEMM ceiling of the H200 (~790 TFLOP/s, --peak).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gpu_timing import report, time_ms

from deepseek_v41 import kernels_tilelang as kt
from deepseek_v41.sparse_attention import sparse_attention_torch
from deepseek_v41.sparse_attention_cuda import cuda_forward_usable, sparse_attention_forward_cuda
from deepseek_v41.sparse_attention_cuda_bwd import cuda_backward_usable

WINDOW = 128


def csa2_indices(b, s, ratio, topk, device):
    # idx [b, s, 128 + topk]: causal window, then a random top-k of the visible compressed entries
    pos = torch.arange(s, device=device)
    window = pos.view(s, 1) - torch.arange(WINDOW - 1, -1, -1, device=device).view(1, WINDOW)
    window = torch.where(window >= 0, window, torch.full_like(window, -1))
    n_comp = s // ratio
    visible = (pos + 1) // ratio
    scores = torch.rand(b, s, n_comp, device=device)
    scores = scores.masked_fill(torch.arange(n_comp, device=device).view(1, 1, -1) >= visible.view(1, s, 1), -1.0)
    k = min(topk, n_comp)
    top = scores.topk(k, dim=-1)
    comp = torch.where(top.values >= 0, top.indices + s, torch.full_like(top.indices, -1))
    comp = torch.cat([comp, comp.new_full((b, s, topk - k), -1)], dim=-1)
    return torch.cat([window.expand(b, s, WINDOW), comp], dim=-1).int().contiguous()


def measure(attn, b, s, h, d, topk, ratio, warmup, reps):
    """(forward ms, backward ms) of attn(q, kv, sink, idx, scale) at one shape."""
    torch.manual_seed(0)
    n = s + s // ratio
    q = torch.randn(b, s, h, d, device="cuda").bfloat16().requires_grad_()
    kv = torch.randn(b, n, d, device="cuda").bfloat16().requires_grad_()
    sink = torch.randn(h, device="cuda").requires_grad_()
    idx = csa2_indices(b, s, ratio, topk, "cuda")
    do = torch.randn(b, s, h, d, device="cuda").bfloat16()
    scale = d**-0.5
    with torch.no_grad():
        fwd = time_ms(lambda: attn(q, kv, sink, idx, scale), warmup, reps)
    out = attn(q, kv, sink, idx, scale)
    bwd = time_ms(lambda: torch.autograd.grad(out, (q, kv, sink), do, retain_graph=True), warmup, reps)
    return fwd, bwd


def kernel_times(b, s, h, d, topk, ratio, warmup, reps) -> str:
    """The TileLang kernels alone (no autograd, padding or casts): forward, the two backward kernels, the indexer."""
    n, k, scale = s + s // ratio, WINDOW + topk, d**-0.5
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda").bfloat16()
    kv = torch.randn(b, n, d, device="cuda").bfloat16()
    idx = csa2_indices(b, s, ratio, topk, "cuda")
    do = torch.randn_like(q)
    sink2 = torch.randn(h, device="cuda") * kt.LOG2E
    o, lse2 = torch.empty_like(q), torch.empty(b, s, h, device="cuda")
    dev = ("cuda", torch.cuda.current_device())
    fwd = kt._attn_fwd_kernel(b, s, n, h, d, k, scale, dev)
    flop = 4 * b * s * h * k * d
    lines = [f"# kernel-only, b={b} s={s} h={h} d={d} k={k} n={n}: forward FLOP 4bshkd = {flop / 1e9:.1f} G"]
    ms_tl = time_ms(lambda: fwd(q, kv, idx, sink2, o, lse2), warmup, reps)
    lines.append(f"attn_fwd     {ms_tl:.3f} ms {flop / ms_tl / 1e9:6.1f} TFLOP/s; gathers {b * s * k * d * 2 / ms_tl / 1e9:.2f} TB/s of kv rows (TileLang)")
    if cuda_forward_usable(d, k, q.device):
        ms = time_ms(lambda: sparse_attention_forward_cuda(q, kv, idx, sink2, scale), warmup, reps)
        lines.append(f"attn_fwd     {ms:.3f} ms {flop / ms / 1e9:6.1f} TFLOP/s; gathers {b * s * k * d * 2 / ms / 1e9:.2f} TB/s of kv rows "
                     f"(CUDA, outputs allocated per call; {ms_tl / ms:.2f}x the TileLang kernel)")
        o, lse2 = sparse_attention_forward_cuda(q, kv, idx, sink2, scale)  # the backward kernels read its outputs
    delta, dq = torch.empty(b, s, h, device="cuda"), torch.empty_like(q)
    # default (deterministic): one kernel for dQ and the per-slot kv gradients, then their fixed-order sum by row
    # (one batch row at a time)
    slot_kernels = kt._attn_bwd_slot_kernels(b, s, n, h, d, k, scale, dev)
    if list(slot_kernels) != [s]:
        raise SystemExit(f"s={s} runs as query chunks {sorted(slot_kernels)} (kt.SLOT_GRAD_BYTES): benchmark a shorter s")
    bwd_slots = slot_kernels[s]  # the whole row as one chunk
    slot_grads = torch.empty(1, s * h // kt.HEADS_PER_BLOCK, k, d, device="cuda", dtype=torch.bfloat16)
    dkv = torch.empty(b, n, d, device="cuda", dtype=torch.bfloat16)

    def slots():
        for r in range(b):
            sl = slice(r, r + 1)
            bwd_slots(q[sl], kv[sl], o[sl], do[sl], idx[sl], lse2[sl], delta[sl], dq[sl], slot_grads)

    def reduce():
        for r in range(b):
            kt._reduce_slot_grads(slot_grads[0], idx[r], dkv[r])

    cuda_slots = cuda_backward_usable(d, k, q.device)
    ms_slots = time_ms(slots, warmup, reps)
    lines.append(f"attn_bwd     {ms_slots:.3f} ms {2.5 * flop / ms_slots / 1e9:6.1f} TFLOP/s (10bshkd); dQ and the per-slot "
                 f"dkv, {b * s * k * d * 2 / ms_slots / 1e9:.2f} TB/s of bf16 written (deterministic, default; "
                 f"{'CUDA' if cuda_slots else 'TileLang'} slot kernel)")
    if cuda_slots:  # the TileLang kernel of the same contract on the same inputs: its time, and how far apart they are
        tl_kernel = kt._attn_bwd_slot_kernel_tilelang(s, n, h, d, k, scale, dev)
        tl_out = (torch.empty_like(delta), torch.empty_like(dq), torch.empty_like(slot_grads))

        def tl_slots():
            for r in range(b):
                sl = slice(r, r + 1)
                tl_kernel(q[sl], kv[sl], o[sl], do[sl], idx[sl], lse2[sl], tl_out[0][sl], tl_out[1][sl], tl_out[2])

        ms_tl_slots = time_ms(tl_slots, warmup, reps)
        slots()
        written = (idx[-1] >= 0).unsqueeze(1).expand(s, h // kt.HEADS_PER_BLOCK, k).reshape(1, -1, k)
        diff = {name: ((x.double() - y.double()).norm() / y.double().norm()).item()
                for name, x, y in (("dq", dq[-1], tl_out[1][-1]), ("slot dkv", slot_grads[written], tl_out[2][written]))}
        lines.append(f"attn_bwd     {ms_tl_slots:.3f} ms {2.5 * flop / ms_tl_slots / 1e9:6.1f} TFLOP/s TileLang slot kernel "
                     f"(the CUDA one is {ms_tl_slots / ms_slots:.2f}x; relative L2 difference, last batch row: "
                     + ", ".join(f"{name} {v:.1e}" for name, v in diff.items()) + ")")
    ms_red = time_ms(reduce, warmup, reps)
    lines.append(f"dkv reduce   {ms_red:.3f} ms sort + fixed-order sum by row, {b * s * k * d * 2 / ms_red / 1e9:.2f} TB/s "
                 "of per-slot rows read")
    bits = []
    for _ in range(3):  # the same inputs three times, with other work in between: bit-identical dkv and dq
        slot_grads.normal_()
        dkv.normal_()
        dq.normal_()
        slots()
        reduce()
        bits.append((dkv.clone(), dq.clone()))
    same = all(torch.equal(x[0], bits[0][0]) and torch.equal(x[1], bits[0][1]) for x in bits[1:])
    lines.append(f"deterministic dkv, dq bit-identical over 3 runs: {same}")
    total = ms_slots + ms_red
    lines.append(f"bwd kernels  {total:.3f} ms {2.5 * flop / total / 1e9:6.1f} TFLOP/s (10bshkd), deterministic (default)")
    # opt-in DS41_SPARSE_BWD=atomic: fp32 atomics into dkv, then a separate dQ kernel
    bwd_kv, bwd_q = kt._attn_bwd_atomic_kernels(b, s, n, h, d, k, scale, dev)
    ds = torch.empty(b, s, h, k, device="cuda", dtype=torch.bfloat16)
    dkv32 = torch.zeros(b, n, d, device="cuda")
    ms_kv = time_ms(lambda: bwd_kv(q, kv, o, do, idx, lse2, delta, ds, dkv32), warmup, reps)
    lines.append(f"attn_bwd_kv  {ms_kv:.3f} ms {2 * flop / ms_kv / 1e9:6.1f} TFLOP/s (8bshkd); "
                 f"{b * s * k * d * 4 / ms_kv / 1e9:.2f} TB/s of fp32 atomics (DS41_SPARSE_BWD=atomic)")
    ms_q = time_ms(lambda: bwd_q(kv, idx, ds, dq), warmup, reps)
    lines.append(f"attn_bwd_q   {ms_q:.3f} ms {flop / 2 / ms_q / 1e9:6.1f} TFLOP/s (2bshkd)")
    lines.append(f"bwd kernels  {ms_kv + ms_q:.3f} ms {2.5 * flop / (ms_kv + ms_q) / 1e9:6.1f} TFLOP/s (10bshkd), atomic")
    n_idx, heads_i, dim_i = s // ratio, 32, 128  # V4.1's indexer: 32 heads x 128
    qi = torch.randn(b, s, heads_i, dim_i, device="cuda").bfloat16()
    w, ki = torch.randn(b, s, heads_i, device="cuda"), torch.randn(b, n_idx, dim_i, device="cuda").bfloat16()
    ms = time_ms(lambda: kt.indexer_scores_tilelang(qi, w, ki, ratio), warmup, reps)
    flop_i = 2 * b * s * n_idx * heads_i * dim_i
    lines.append(f"indexer s={s} T={n_idx} ratio={ratio}: {ms:.3f} ms, {flop_i / ms / 1e9:.1f} TFLOP/s counting the full "
                 "2·s·T·H·D (the causally hidden half of the tiles is skipped)")
    return "\n".join(lines)


def forward_bounds(b, s, h, d, topk, ratio, warmup, reps) -> str:
    """The forward kernel against two probes of itself at one shape: only its gathers (with the same
    barriers), and only its math (every block computed on the first two gathered blocks).  The larger
    probe time is the part that bounds the kernel."""
    n, k, scale = s + s // ratio, WINDOW + topk, d**-0.5
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda").bfloat16()
    kv = torch.randn(b, n, d, device="cuda").bfloat16()
    idx = csa2_indices(b, s, ratio, topk, "cuda")
    sink2 = torch.randn(h, device="cuda") * kt.LOG2E
    o, lse2 = torch.empty_like(q), torch.empty(b, s, h, device="cuda")
    flop, nbytes = 4 * b * s * h * k * d, b * s * k * d * 2
    lines = [f"# forward kernel and its probes, b={b} s={s} h={h} d={d} k={k} n={n}"]
    for probe in ("", "gather", "math"):
        kernel = kt._compile(kt._build_attn_fwd(b, s, n, h, d, k, float(scale), probe=probe), fast_math=True)
        ms = time_ms(lambda kernel=kernel: kernel(q, kv, idx, sink2, o, lse2), warmup, reps)
        lines.append(f"{probe or 'full':8s} {ms:.3f} ms  {flop / ms / 1e9:6.1f} TFLOP/s-equivalent  "
                     f"{nbytes / ms / 1e9:.2f} TB/s of kv rows")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--topk", type=int, default=512, help="compressed slots; k = 128 window slots + topk")
    ap.add_argument("--ratio", type=int, default=1, help="compression ratio: n = s + s // ratio")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak", type=float, default=790.0, help="bf16 dense TFLOP/s ceiling for MFU")
    ap.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference")
    ap.add_argument("--kernels", action="store_true", help="also time the raw kernels and the indexer")
    ap.add_argument("--bounds", action="store_true", help="also time the forward kernel's gather-only and math-only probes")
    ap.add_argument("--out", type=Path, help="also append the table to this file")
    args = ap.parse_args()

    ok, reason = kt.tilelang_available()
    if not ok:
        sys.exit(reason)
    b, s, h, d, k = args.b, args.s, args.h, args.d, WINDOW + args.topk
    fwd_flop = 4 * b * s * h * k * d
    bwd_flop = 2.5 * fwd_flop

    rows = []
    dev = torch.cuda.get_device_name()
    header = (
        f"# {dev}, torch {torch.__version__}; b={b} s={s} h={h} d={d} k={k} (128 window + {args.topk}), "
        f"n={s + s // args.ratio}; fwd {fwd_flop / 1e9:.1f} GFLOP, bwd {bwd_flop / 1e9:.1f} GFLOP; "
        f"median of {args.reps} after {args.warmup} warm-up"
    )
    fwd, bwd = measure(kt.sparse_attention_tilelang, b, s, h, d, args.topk, args.ratio, args.warmup, args.reps)
    rows.append(("tilelang", s, fwd, bwd, fwd_flop, bwd_flop))
    if cuda_forward_usable(d, k, torch.device("cuda")):  # the same backend with its TileLang forward
        os.environ["DS41_SPARSE_FWD"] = "tilelang"
        fwd, bwd = measure(kt.sparse_attention_tilelang, b, s, h, d, args.topk, args.ratio, args.warmup, args.reps)
        del os.environ["DS41_SPARSE_FWD"]
        rows.append(("tilelang, TileLang fwd", s, fwd, bwd, fwd_flop, bwd_flop))
    os.environ["DS41_SPARSE_BWD"] = "atomic"  # the opt-in backward with fp32 atomics (not bit-deterministic)
    fwd, bwd = measure(kt.sparse_attention_tilelang, b, s, h, d, args.topk, args.ratio, args.warmup, args.reps)
    del os.environ["DS41_SPARSE_BWD"]
    rows.append(("tilelang, atomic bwd", s, fwd, bwd, fwd_flop, bwd_flop))

    if not args.no_reference:
        ref_s = s
        while ref_s >= 256:
            try:
                fwd, bwd = measure(sparse_attention_torch, b, ref_s, h, d, args.topk, args.ratio, 2, max(3, args.reps // 4))
                scale_flop = ref_s / s
                rows.append(("torch reference", ref_s, fwd, bwd, fwd_flop * scale_flop, bwd_flop * scale_flop))
                break
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                ref_s //= 2
        else:
            rows.append(("torch reference", 0, float("nan"), float("nan"), 1, 1))
        if ref_s != s:
            header += f"\n# torch reference ran out of memory at s={s}: measured at s={ref_s} (largest that fits)"

    columns = (
        f"{'backend':24s} {'s':>5s} {'fwd ms':>8s} {'fwd TFLOP/s':>12s} {'fwd MFU':>8s} "
        f"{'bwd ms':>8s} {'bwd TFLOP/s':>12s} {'bwd MFU':>8s}"
    )
    lines = [header, columns]
    for name, rs, fwd, bwd, ff, bf in rows:
        tf, tb = ff / fwd / 1e9, bf / bwd / 1e9
        lines.append(
            f"{name:24s} {rs:5d} {fwd:8.3f} {tf:12.1f} {100 * tf / args.peak:7.1f}% "
            f"{bwd:8.3f} {tb:12.1f} {100 * tb / args.peak:7.1f}%"
        )
    if args.kernels:
        lines.append(kernel_times(b, s, h, d, args.topk, args.ratio, 3, args.reps))
    if args.bounds:
        lines.append(forward_bounds(b, s, h, d, args.topk, args.ratio, 3, args.reps))
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
