"""Memory-bound pieces of the training step on one GPU, each next to the code it replaced (same run).

    python examples/benchmarks/elementwise.py

- The head backward's split of the fp32 logits gradient g [4096, 129280] into [g_hi; g_lo] bf16 [8192, 129280]:
  ``layers._hi_lo_rows_into_fused`` (both halves written from one loop) against the compiled dim-0 cat of the
  two halves (``layers._hi_lo_cat_fused(g, 0)``, the previous code).
- RoPE on q [1, 4096, 64, 512] bf16: ``rope.apply_rope`` (clone, then overwrite the 64 rotated channels)
  against the previous eager code (a strided copy of the 448 pass-through channels, then the tail).
- The experts' weighted SwiGLU at [24576, 2304] bf16 (one 4096-token sequence, top-6): the Triton kernels
  (``moe.fused_weighted_swiglu``) against the torch.compile'd ``weighted_swiglu`` (the previous code), forward
  and forward + backward.
- The MoE combine / dispatch adjoint ``moe._sum_slots`` at [24576, 5120] -> [4096, 5120]: the Triton
  gather-and-sum against the previous ``index_copy_`` + fp32 sum over [n, k, dim].
- The attention q projection's in-place RoPE, backward included: on the flat [1, 4096, 64·512] output (now)
  against on its [1, 4096, 64, 512] view (before: autograd's CopySlices / AsStrided backward).
CUDA-event medians of 20 after 3 warm-up.  Bandwidth counts one read of the input and one write of the output.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import time_ms

from deepseek_v41 import layers, moe
from deepseek_v41.rope import apply_rope, rope_cis, rope_frequencies


def previous_rope(x, cis):
    # the code before: empty output, strided copy of the pass-through channels, eager pair arithmetic
    cs = torch.view_as_real(cis).view(1, cis.shape[0], 1, cis.shape[1], 2)
    out = torch.empty_like(x)
    out[..., :-64] = x[..., :-64]
    pairs = x[..., -64:].float().unflatten(-1, (-1, 2))
    re, im, cos, sin = pairs[..., 0], pairs[..., 1], cs[..., 0], cs[..., 1]
    out[..., -64:] = torch.stack([re * cos - im * sin, re * sin + im * cos], -1).flatten(-2)
    return out


def main():
    if not torch.cuda.is_available():
        sys.exit("elementwise.py needs a CUDA GPU")
    g = torch.randn(4096, 129280, device="cuda") * 1e-4
    out = torch.empty(8192, 129280, device="cuda", dtype=torch.bfloat16)
    gb = (g.numel() * 4 + out.numel() * 2) / 1e9
    for name, fn in [("cat dim0 (old)", lambda: layers._hi_lo_cat_fused(g, 0)),
                     ("rows_into (new)", lambda: layers._hi_lo_rows_into_fused(g, out))]:
        fn()
        torch.cuda.synchronize()
        ms = time_ms(fn, 3, 20)
        print(f"{name:18s} {ms:.3f} ms  {gb / ms:.2f} TB/s counting one read + one write", flush=True)
    print("equal:", torch.equal(layers._hi_lo_cat_fused(g, 0), layers._hi_lo_rows_into_fused(g, out)))
    x = torch.randn(1, 4096, 64, 512, device="cuda").bfloat16()
    cis = rope_cis(torch.arange(4096, device="cuda"), rope_frequencies(64, 10000.0, None))
    ms = time_ms(lambda: apply_rope(x, cis), 3, 20)
    print(f"rope q [1,4096,64,512] bf16: {ms:.3f} ms {2 * x.numel() * 2 / ms / 1e9:.2f} TB/s")
    ms = time_ms(lambda: previous_rope(x, cis), 3, 20)
    diff = (previous_rope(x, cis).float() - apply_rope(x, cis).float()).abs().max().item()
    print(f"old eager rope: {ms:.3f} ms; max diff new vs old {diff:.3e}")

    experts_and_rope()


def experts_and_rope():
    g = torch.Generator(device="cuda").manual_seed(0)
    m, inter, n, k, dim = 24576, 2304, 4096, 6, 5120
    gate, up = ((torch.randn(m, inter, device="cuda", generator=g) * 3).bfloat16().requires_grad_() for _ in range(2))
    weights = torch.rand(m, device="cuda", generator=g).requires_grad_()
    dh = torch.randn(m, inter, device="cuda", generator=g).bfloat16()
    compiled = layers.compiled_on_cuda(moe.weighted_swiglu, dynamic=True)  # the previous code
    gb = 3 * gate.numel() * 2 / 1e9  # forward: read gate and up, write h
    for name, fn in [("compiled (old)", compiled), ("triton (new)", moe.fused_weighted_swiglu)]:
        fwd = time_ms(lambda fn=fn: fn(gate, up, weights, 7.0), 3, 20)
        both = time_ms(lambda fn=fn: torch.autograd.grad(fn(gate, up, weights, 7.0), (gate, up, weights), dh), 3, 20)
        print(f"weighted swiglu {name:15s} forward {fwd:.3f} ms ({gb / fwd:.2f} TB/s), forward + backward {both:.3f} ms")
    diff = (compiled(gate, up, weights, 7.0).float() - moe.fused_weighted_swiglu(gate, up, weights, 7.0).float())
    print(f"weighted swiglu max |new - old| {diff.abs().max().item():.3e}")

    y = torch.randn(n * k, dim, device="cuda", generator=g).bfloat16()
    order = torch.randint(0, 32, (n * k,), device="cuda", generator=g).argsort(stable=True)

    def previous_sum_slots():
        return y.new_empty(y.shape).index_copy_(0, order, y).view(n, k, dim).sum(1, dtype=torch.float32)

    gb = (y.numel() * 2 + n * dim * 4) / 1e9
    for name, fn in [("index_copy + sum (old)", previous_sum_slots),
                     ("gather-sum (new)", lambda: moe._sum_slots(y, order, k, torch.float32))]:
        ms = time_ms(fn, 3, 20)
        print(f"moe sum_slots {name:24s} {ms:.3f} ms ({gb / ms:.2f} TB/s counting one read + one write)")
    print("moe sum_slots max |new - old|", (previous_sum_slots() - moe._sum_slots(y, order, k, torch.float32)).abs().max().item())

    wq_b = torch.nn.Linear(1280, 64 * 512, bias=False, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(1, 4096, 1280, device="cuda", generator=g).bfloat16()
    cis = rope_cis(torch.arange(4096, device="cuda"), rope_frequencies(64, 10000.0, None))
    dq = torch.randn(1, 4096, 64, 512, device="cuda", generator=g).bfloat16()

    def q_rope(flat):
        q = wq_b(qr)
        q = apply_rope(q, cis, inplace=True, head_dim=512).unflatten(-1, (64, 512)) if flat else \
            apply_rope(q.unflatten(-1, (64, 512)), cis, inplace=True)
        torch.autograd.grad(q, wq_b.weight, dq)

    for name, flat in [("on the view (old)", False), ("flat (new)", True)]:
        print(f"q projection + in-place rope, forward + backward, {name:18s} {time_ms(lambda flat=flat: q_rope(flat), 3, 20):.3f} ms")


if __name__ == "__main__":
    main()
