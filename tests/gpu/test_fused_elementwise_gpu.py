"""Fused elementwise functions on the GPU, against exact references.

mHC's mix-logits ``dx`` (a Triton kernel) and the head's hi/lo split of the logits gradient (compiled,
``layers.compiled_on_cuda``).  A result rounded to bf16 may differ from the correctly rounded exact value by one
bf16 step (2^-8 relative) where its fp32 value sits on a rounding boundary; the head split must be bit-exact
against the eager split (its ``lo`` is what the fp32 emulation adds).
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled elementwise GPU tests need a CUDA GPU"),
]


def test_mix_logits_dx_is_the_rounded_exact_value():
    # g_y · fn − coef·x with the 24-long product in fp32, rounded once to bf16 (kernels_triton.mix_dx_triton):
    # within one bf16 step of the exact value, beyond the fp32 summation's own error where terms cancel
    from deepseek_v41.kernels_triton import mix_dx_triton

    g = torch.Generator(device="cuda").manual_seed(2)
    m, k, n = 4100, 20480, 24  # m not a multiple of the row block
    g_y = torch.randn(m, n, device="cuda", generator=g)
    fn = torch.randn(n, k, device="cuda", generator=g) * 0.02
    coef = torch.randn(m, 1, device="cuda", generator=g) * 1e-2
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    out = mix_dx_triton(g_y, fn, coef, x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    exact = g_y.double() @ fn.double() - coef.double() * x.double()
    scale = g_y.double().abs() @ fn.double().abs() + (coef.double() * x.double()).abs()
    err = (out.double() - exact).abs()
    assert (err <= exact.abs() * 2.0**-7 + scale * 2.0**-20).all(), f"max diff {err.max().item():.3e}"
    assert (out.double() != exact.bfloat16().double()).float().mean() < 1e-3  # rounding boundaries only


def test_head_gradient_split_is_bit_exact():
    # the compiled one-pass split of the fp32 logits gradient into [g_hi; g_lo] equals the eager split
    from deepseek_v41.layers import _hi_lo_rows_into_fused, _split_bf16

    g = torch.Generator(device="cuda").manual_seed(3)
    grad = torch.randn(1000, 129280, device="cuda", generator=g) * 1e-4
    out = _hi_lo_rows_into_fused(grad, grad.new_empty((2000, 129280), dtype=torch.bfloat16))
    hi, lo = _split_bf16(grad)
    assert torch.equal(out[:1000], hi) and torch.equal(out[1000:], lo)
    assert lo.abs().max() > 0  # a split whose rounding Inductor folded away would make lo zero
