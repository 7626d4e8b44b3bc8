"""The tile-kernels backends (``mhc``, ``engram``, ``quant``: ``tile_kernels``) against the eager functions.

mHC and the Engram gate: forward values and every gradient at V4.1's hidden size 5120, 4 streams, 20 Sinkhorn
rounds; fp32 results (coefficients and their gradients) must agree to fp32 rounding, bf16 results to bf16
rounding.  Quantize->dequantize boundaries: bit for bit (the UE8M0 ones; see quantization.quant_ops).  Skips
without CUDA/tile-kernels.
"""

import importlib.util

import pytest
import torch
from gpu_metrics import gate, rel_err

from deepseek_v41 import mhc
from deepseek_v41.engram import engram_gate, engram_gate_tile_kernels
from deepseek_v41.quantization import quant_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="mhc backend 'tile_kernels' needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("tile_kernels") is None, reason="needs the package tile_kernels"),
]

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


# Gates: ~5x the relative error measured per tensor on an H100 (2026-12-07, results/gate_table_h100.txt), rounded
# up.  A tensor measured bit-equal (0) gets 1e-6: a stray one-ulp difference passes, any real bug (>= 1e-4) fails.
EXACT = 1e-6


def compare(fn_ref, fn_new, inputs, limits, label):
    """Runs both on copies of ``inputs``; checks each output and input gradient against its limit in ``limits``
    (keys ``out<i>`` / ``grad<i>``, i the output's or input's index; gates ``<label>.<key>_<dtype>``)."""
    torch.manual_seed(1)
    a, b = leaves(*inputs), leaves(*inputs)
    out_a, out_b = fn_ref(*a), fn_new(*b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    weights = [torch.randn_like(o, dtype=torch.float32) for o in out_a]
    sum(((o.float() * w).sum() for o, w in zip(out_a, weights))).backward()
    sum(((o.float() * w).sum() for o, w in zip(out_b, weights))).backward()
    errors = [rel_err(ob, oa) for oa, ob in zip(out_a, out_b)] + [rel_err(tb.grad, ta.grad) for ta, tb in zip(a, b)]
    kinds = [o.dtype for o in out_a] + [t.dtype for t in a]
    names = [f"{label}.out{i}" for i in range(len(out_a))] + [f"{label}.grad{i}" for i in range(len(a))]
    assert len(limits) == len(names), f"{label}: limits for {sorted(limits)}, tensors {names}"
    for name, err, dtype in zip(names, errors, kinds):
        gate(f"{name}_{str(dtype).removeprefix('torch.')}", err, limits[name.rsplit(".", 1)[1]])
    assert all(tb.grad is not None and tb.grad.dtype == tb.dtype for tb in b)


def test_tile_kernels_mhc_matches_eager(dim=5120):
    from deepseek_v41 import mhc_tile_kernels as fused

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, HC, dim, device="cuda", generator=g).bfloat16()
    y = torch.randn(2, 64, dim, device="cuda", generator=g).bfloat16()
    n_mix = (2 + HC) * HC
    fn = torch.randn(n_mix, HC * dim, device="cuda", generator=g) * dim**-0.5
    base = torch.randn(n_mix, device="cuda", generator=g) * 0.1
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    pre = torch.rand(2, 64, HC, device="cuda", generator=g)
    post = 2 * torch.rand(2, 64, HC, device="cuda", generator=g)
    comb = torch.softmax(torch.randn(2, 64, HC, HC, device="cuda", generator=g), -1)

    def mix_ref(x, fn, base, scale, pre):
        return mhc.hc_mix_pre(x, fn, base, scale, pre, HC, ITERS, HC_EPS, NORM_EPS)

    def mix_new(x, fn, base, scale, pre):
        return fused.hc_mix_pre(x, fn, base, scale, pre, HC, ITERS, HC_EPS, NORM_EPS)

    # x's gradient sums the mix's and the collapse's (the collapse accumulates into the mix's dx)
    # measured: outs 1.7e-6 / 1.2e-6 / 2.3e-6 (fp32 coefficients), 0 (bf16 collapse); grads x 2.9e-3 (bf16, two
    # summed paths), fn 3.5e-6, base 1.9e-6, scale 3.1e-6, pre 1.3e-7
    compare(mix_ref, mix_new, (x, fn, base, scale, pre), {"out0": 1e-5, "out1": 6e-6, "out2": 1.2e-5, "out3": EXACT,
            "grad0": 1e-2, "grad1": 2e-5, "grad2": 1e-5, "grad3": 1.5e-5, "grad4": 7e-7}, "hc_mix_pre")
    # measured: out 0, grads x 0, pre 1.3e-7
    compare(mhc.hc_pre, fused.hc_pre, (x, pre), {"out0": EXACT, "grad0": EXACT, "grad1": 7e-7}, "hc_pre")
    # measured: out 8.3e-6, grads y 8.8e-6, x 0, post 1.2e-7, comb 1.4e-7
    compare(mhc.hc_post, fused.hc_post, (y, x, post, comb),
            {"out0": 4e-5, "grad0": 5e-5, "grad1": EXACT, "grad2": 6e-7, "grad3": 7e-7}, "hc_post")


@pytest.mark.parametrize("used", ["mix", "collapse"])
def test_tile_kernels_mix_pre_with_one_output_unused(used, dim=1024):
    # only one of (the mix coefficients, the collapsed input) reaches the loss: the streams' gradient is that
    # output's alone (the other arrives as None, not as zeros), and the unused side's parameters get none
    from deepseek_v41 import mhc_tile_kernels as fused

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 32, HC, dim, device="cuda", generator=g).bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * dim, device="cuda", generator=g) * dim**-0.5
    base = torch.randn((2 + HC) * HC, device="cuda", generator=g) * 0.1
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    pre = torch.rand(2, 32, HC, device="cuda", generator=g)
    grads = []
    for impl in (mhc.hc_mix_pre, fused.hc_mix_pre):
        leaves_ = [t.clone().requires_grad_() for t in (x, fn, base, scale, pre)]
        _, post, comb, collapsed = impl(*leaves_, HC, ITERS, HC_EPS, NORM_EPS)
        loss = (post.sum() + comb.square().sum()) if used == "mix" else collapsed.float().square().sum()
        loss.backward()
        grads.append([t.grad for t in leaves_])
    (ref_x, ref_fn, _, _, ref_pre), (new_x, new_fn, _, _, new_pre) = grads
    gate("dx", rel_err(new_x, ref_x), 5e-4)  # measured 9.9e-5 (the worse of the two cases)
    if used == "mix":
        assert new_pre is None
        gate("dfn", rel_err(new_fn, ref_fn), 2e-5)  # measured 3.8e-6
    else:
        assert new_fn is None
        gate("dpre", rel_err(new_pre, ref_pre), 4e-7)  # measured 6.4e-8


def test_tile_kernels_mhc_refuses_what_it_cannot_compute():
    from deepseek_v41 import mhc_tile_kernels as fused

    with pytest.raises(TypeError, match="needs bf16 CUDA streams"):
        fused.hc_pre(torch.randn(1, 4, HC, 256, device="cuda"), torch.rand(1, 4, HC, device="cuda"))
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.hc_pre(torch.randn(1, 4, HC, 96, device="cuda").bfloat16(), torch.rand(1, 4, HC, device="cuda"))


def test_tile_kernels_engram_gate_matches_eager(dim=5120):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, HC, dim, device="cuda", generator=g).bfloat16()
    kv = torch.randn(2, 64, (HC + 1) * dim, device="cuda", generator=g).bfloat16()
    q_weight = (1 + 0.1 * torch.randn(HC, dim, device="cuda", generator=g)).bfloat16()
    k_weight = (1 + 0.1 * torch.randn(HC, dim, device="cuda", generator=g)).bfloat16()
    image_mask = torch.zeros(2, 64, dtype=torch.bool, device="cuda")
    image_mask[1, 10:20] = True  # the gate is closed there
    # measured (worse of the two masks): out 1.5e-5; grads x 1.8e-4, kv 3.3e-4, q_weight 5.9e-4, k_weight 5.7e-4
    limits = {"out0": 8e-5, "grad0": 1e-3, "grad1": 2e-3, "grad2": 3e-3, "grad3": 3e-3}
    for mask in (None, image_mask):
        compare(
            lambda *t, m=mask: engram_gate(*t, NORM_EPS, m),
            lambda *t, m=mask: engram_gate_tile_kernels(*t, NORM_EPS, m),
            (x, kv, q_weight, k_weight), limits, "engram_gate" if mask is None else "engram_gate_masked",
        )


def test_tile_kernels_quant_boundaries_are_bit_exact():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, device="cuda", generator=g)
    x = x * torch.exp2(torch.randint(-20, 12, (4096, 1), device="cuda", generator=g).float())  # rows of every scale
    x[0, :64] = 0  # all-zero blocks
    x[1, :32] = 1e-30  # tiny blocks: the scale floors
    x = x.bfloat16()
    ref_ops, new_ops = quant_ops({"quant": "torch"}), quant_ops({"quant": "tile_kernels"})
    # the E4M3-scale boundary stays on the reference (tile-kernels differs there in 435 of 2,097,152 values)
    assert new_ops[2] is ref_ops[2]
    for name, ref, new in zip(("fp8 e4m3 / 32 / ue8m0", "fp4 e2m1 / 32 / ue8m0"), ref_ops, new_ops):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, out_b = ref(a), new(b)
        differ = (out_a != out_b).sum().item()
        print(f"{name}: {differ} of {x.numel()} values differ")
        assert differ == 0, name
        out_b.backward(torch.ones_like(out_b))
        assert torch.equal(b.grad, torch.ones_like(b))  # straight through
        assert torch.equal(b, x)  # the input is left alone (the kernel works in place on a copy)
