"""The compiled (``layers.compiled_on_cuda``) elementwise functions on the GPU, against exact references.

mHC's mix-logits ``dx`` and the head's hi/lo split of the logits gradient.  A result rounded to bf16 may differ
from the correctly rounded exact value by one bf16 step (2^-8 relative) where its fp32 value sits on a rounding
boundary; the head split must be bit-exact against the eager split (its ``lo`` is what the fp32 emulation adds).
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled elementwise GPU tests need a CUDA GPU"),
]


def assert_within_one_bf16_step(x, ref):
    x, ref = x.float(), ref.float()
    step = ref.abs().clamp(min=1e-30) * 2.0**-7  # one bf16 ulp is 2^-7 of the value at most
    assert ((x - ref).abs() <= step).all(), f"max diff {(x - ref).abs().max().item():.3e}"
    assert (x != ref).float().mean() < 1e-3  # and only where the fp32 value is a boundary case


def test_mix_logits_dx_compiled_is_the_rounded_exact_value():
    # a − coef·x in fp32, rounded once to bf16.  Eager CUDA addcmul with the bf16 x (the code before the fused
    # kernel) was up to 2 bf16 steps off at 1769 of these 84 M elements (at most 1 step where compiled).
    from deepseek_v41.mhc_tile_kernels import _subtract_scaled_rows_fused

    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(4096, 20480, device="cuda", generator=g)
    coef = torch.randn(4096, 1, device="cuda", generator=g)
    x = torch.randn(4096, 20480, device="cuda", generator=g).bfloat16()
    out = _subtract_scaled_rows_fused(a, coef, x)
    assert out.dtype == torch.bfloat16
    assert_within_one_bf16_step(out, (a.double() - coef.double() * x.double()).bfloat16())


def test_head_gradient_split_is_bit_exact():
    # the compiled one-pass split of the fp32 logits gradient into [g_hi; g_lo] equals the eager split
    from deepseek_v41.layers import _hi_lo_rows_into_fused, _split_bf16

    g = torch.Generator(device="cuda").manual_seed(3)
    grad = torch.randn(1000, 129280, device="cuda", generator=g) * 1e-4
    out = _hi_lo_rows_into_fused(grad, grad.new_empty((2000, 129280), dtype=torch.bfloat16))
    hi, lo = _split_bf16(grad)
    assert torch.equal(out[:1000], hi) and torch.equal(out[1000:], lo)
    assert lo.abs().max() > 0  # a split whose rounding Inductor folded away would make lo zero
