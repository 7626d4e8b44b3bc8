"""Two memory-bound pieces of the training step on one GPU, each next to the code it replaced (same run).

    python examples/benchmarks/elementwise.py

- The head backward's split of the fp32 logits gradient g [4096, 129280] into [g_hi; g_lo] bf16 [8192, 129280]:
  ``layers._hi_lo_rows_into_fused`` (both halves written from one loop) against the compiled dim-0 cat of the
  two halves (``layers._hi_lo_cat_fused(g, 0)``, the previous code).
- RoPE on q [1, 4096, 64, 512] bf16: ``rope.apply_rope`` (clone, then overwrite the 64 rotated channels)
  against the previous eager code (a strided copy of the 448 pass-through channels, then the tail).
CUDA-event medians of 20 after 3 warm-up.  Bandwidth counts one read of the input and one write of the output.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import time_ms

from deepseek_v41 import layers
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


if __name__ == "__main__":
    main()
