"""The Triton kernels (``kernels_triton``) on the GPU: RoPE bit-identical to the eager rotation, the
``rms_norm: triton`` backend against an fp64 reference, no less accurate than the eager ``torch_fp32`` norm, the
fused loss, the MoE gather-and-sum and the weighted SwiGLU against their eager forms, mHC's one-kernel Sinkhorn
against an fp64 reference, the decode indexer's scores against an fp64 reference as closely as eager."""

import pytest
import torch
from gpu_metrics import assert_bf16_backend_as_close_to_fp32, gate, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernel tests need a CUDA GPU"),
]


@pytest.mark.parametrize("shape", [(2, 300, 64, 512), (2, 300, 512), (1, 257, 32, 128)])
def test_rope_kernel_is_bit_identical_to_the_eager_rotation(shape):
    # The eager rotation on the CPU (IEEE fp32 products and sums, round-to-nearest-even to bf16) is the
    # reference; the kernel must not fuse the multiply-adds.
    from deepseek_v41.kernels_triton import rope_rotate
    from deepseek_v41.rope import _conjugate, _rotate, rope_cis, rope_frequencies

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    cs = torch.view_as_real(rope_cis(torch.arange(shape[1]) * 2, rope_frequencies(64, 160000.0, None)))
    for cos_sin in (cs, _conjugate(cs)):
        ref = _rotate(x, cos_sin)  # CPU: eager
        out = rope_rotate(x.cuda(), cos_sin.cuda())
        assert torch.equal(out.cpu(), ref)
        inplace = x.cuda()
        assert rope_rotate(inplace, cos_sin.cuda(), inplace=True) is inplace
        assert torch.equal(inplace.cpu(), ref)
        assert not torch.equal(ref[..., -64:], x[..., -64:])


def test_rope_gradients_on_cuda_match_the_cpu():
    from deepseek_v41.rope import apply_rope, rope_cis, rope_frequencies

    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(16, 4 * 128, dtype=torch.bfloat16)
    inp = torch.randn(2, 50, 16, generator=g).bfloat16()
    dy = torch.randn(2, 50, 4, 128, generator=g).bfloat16()
    cis = rope_cis(torch.arange(50), rope_frequencies(64, 10000.0, None))
    results = []
    for device in ("cpu", "cuda"):
        layer = lin.to(device)
        layer.zero_grad()
        x = layer(inp.to(device)).unflatten(-1, (4, 128))
        y = apply_rope(apply_rope(x, cis.to(device), inplace=True), cis.to(device), inverse=True)
        y.backward(dy.to(device))
        results.append((y.detach().cpu().clone(), layer.weight.grad.cpu().clone()))  # .to() moves grads in place
    (y_cpu, gw_cpu), (y_gpu, gw_gpu) = results
    # measured 0.0 on an H100 (2026-12-07): the rotations are exact; the gates leave one bf16 rounding (2^-8) for
    # the linear's GEMMs, which another GPU or CPU library may sum in another order; a wrong rotation is O(1)
    gate("y_gpu_vs_cpu", rel_err(y_gpu, y_cpu), 4e-3)
    gate("grad_w_gpu_vs_cpu", rel_err(gw_gpu, gw_cpu), 4e-3)


@pytest.mark.parametrize("rows,dim", [(4096, 5120), (1000, 1280), (777, 512), (64, 128)])
def test_triton_rms_norm_is_as_accurate_as_the_eager_fp32_norm(rows, dim):
    from deepseek_v41.layers import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, dim, device="cuda", generator=g) * 2).bfloat16()
    w = (1 + 0.2 * torch.randn(dim, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(rows, dim, device="cuda", generator=g).bfloat16()

    # fp64 reference of the fp32 formula
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())

    errors = {}
    for backend in ("torch_fp32", "triton"):
        norm = RMSNorm(dim, 1e-6, backend, dtype=torch.bfloat16).cuda()
        norm.weight.data.copy_(w)
        xb = x.clone().requires_grad_()
        y = norm(xb)
        y.backward(dy)
        assert y.dtype == xb.grad.dtype == norm.weight.grad.dtype == torch.bfloat16
        errors[backend] = (rel_err(y, y64), rel_err(xb.grad, dx64), rel_err(norm.weight.grad, dw64))
    for name, eager, triton_err in zip(("y", "dx", "dw"), errors["torch_fp32"], errors["triton"]):
        gate(f"{name}_vs_fp64", triton_err, 1e-2)
        assert triton_err <= 1.1 * eager + 1e-6, (name, triton_err, eager)


def test_triton_rms_norm_in_a_whole_model():
    # every norm of a tiny bf16 model on the Triton backend: as close to the fp32 model as the eager norm is
    assert_bf16_backend_as_close_to_fp32({"rms_norm": "torch_fp32"}, {"rms_norm": "triton"})


@pytest.mark.parametrize("with_logits_grad", [False, True])
def test_fused_cross_entropy_kernels_match_eager(with_logits_grad):
    # the bf16x3 head's fused loss kernels against the eager formulas at the real vocabulary: lse to fp32
    # rounding, the split gradient g_hi + g_lo to ~1e-6 of g (both splits are _split_bf16's)
    from deepseek_v41.kernels_triton import cross_entropy_grad_hi_lo_triton, cross_entropy_rows_triton
    from deepseek_v41.layers import _split_bf16

    g = torch.Generator(device="cuda").manual_seed(7)
    n, V = 300, 129280
    logits = torch.randn(n, V, device="cuda", generator=g) * 4
    targets = torch.randint(0, V, (n,), device="cuda", generator=g)
    targets[::7] = -100
    lse, total = cross_entropy_rows_triton(logits, targets)
    lse64 = torch.logsumexp(logits.double(), -1)
    picked = logits.double().gather(1, targets.clamp(min=0)[:, None])[:, 0]
    gate("lse_vs_fp64", rel_err(lse, lse64), 1.5e-7)  # fp32 rounding: measured 2.7e-8 (H100, 2026-12-07), ~5.5x
    assert abs(total.item() - torch.where(targets >= 0, lse64 - picked, 0).sum().item()) < 1e-4 * total.item()

    grad_loss = torch.tensor(0.01, device="cuda")
    extra = torch.randn(n, V, device="cuda", generator=g) * 1e-6 if with_logits_grad else None
    out = torch.empty(2 * n, V, device="cuda", dtype=torch.bfloat16)
    cross_entropy_grad_hi_lo_triton(logits, lse, targets, grad_loss, extra, out)
    ref = torch.softmax(logits.double(), -1)
    counted = targets >= 0
    ref[counted, targets[counted]] -= 1
    ref = ref * torch.where(counted, 0.01, 0.0).double()[:, None]
    if extra is not None:
        ref = ref + extra.double()
    assert (out[:n][~counted].float().abs().max() == 0) == (extra is None)
    gate("grad_hi_plus_lo_vs_fp64", rel_err(out[:n].float() + out[n:].float(), ref), 1e-5)
    hi = _split_bf16(ref.float())[0]  # the split itself is the eager one: hi is g rounded to bf16
    assert (out[:n] != hi).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_gather_sum_kernel_matches_the_eager_combine(dtype):
    # moe._sum_slots on CUDA (the Triton gather-and-sum) against its eager form on the CPU (index_copy_, then
    # an fp32 sum over [n, k, dim]): both sum each token's k rows in choice order, so fp32 agrees to rounding
    from deepseek_v41.moe import _sum_slots

    g = torch.Generator().manual_seed(3)
    n, k, dim = 1000, 6, 5120
    y = torch.randn(n * k, dim, generator=g).bfloat16()
    order = torch.randint(0, 32, (n * k,), generator=g).argsort(stable=True)  # a routing's sort order
    out = _sum_slots(y.cuda(), order.cuda(), k, dtype)
    ref = _sum_slots(y, order, k, dtype)
    assert out.dtype == dtype and out.shape == (n, dim)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    gate("combine_vs_fp64", rel_err(out.cpu(), y.double().view(-1, dim)[torch.argsort(order)].view(n, k, dim).sum(1)), 5e-3)
    shared = torch.randn(n, dim, generator=g).bfloat16()  # the combine with the shared expert's output added
    out = _sum_slots(y.cuda(), order.cuda(), k, dtype, shared.cuda())
    torch.testing.assert_close(out.cpu(), _sum_slots(y, order, k, dtype, shared),
                               rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_weighted_swiglu_kernels_match_eager_autograd(limit):
    # the Triton weighted SwiGLU (forward, and gate / up / routing-weight gradients) against eager autograd
    # of moe.weighted_swiglu in fp64 at the experts' width, with the clamps active on part of the inputs
    from deepseek_v41.moe import fused_weighted_swiglu, weighted_swiglu

    g = torch.Generator(device="cuda").manual_seed(4)
    m, inter = 3000, 2304
    gate_in = (torch.randn(m, inter, device="cuda", generator=g) * 5).bfloat16().requires_grad_()
    up = (torch.randn(m, inter, device="cuda", generator=g) * 5).bfloat16().requires_grad_()
    weights = torch.rand(m, device="cuda", generator=g).requires_grad_()
    dh = torch.randn(m, inter, device="cuda", generator=g).bfloat16()
    out = fused_weighted_swiglu(gate_in, up, weights, limit)
    assert out.grad_fn is not None and "WeightedSwiGLU" in out.grad_fn.name()  # the Triton path ran
    grads = torch.autograd.grad(out, (gate_in, up, weights), dh)
    leaves = [t.detach().double().requires_grad_() for t in (gate_in, up, weights)]
    ref = weighted_swiglu(*leaves, limit)
    ref_grads = torch.autograd.grad(ref, leaves, dh.double())
    assert out.dtype == torch.bfloat16 and [t.dtype for t in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]
    gate("out_vs_fp64", rel_err(out, ref), 4e-3)  # one bf16 rounding
    for name, grad, ref_grad in zip(("d_gate", "d_up", "d_weights"), grads, ref_grads):
        # bf16 gradients: one bf16 rounding (measured 1.66e-3, H100 2026-12-07), 2.4x; the fp32 routing-weight
        # gradient: a sum in fp32 (measured 1.06e-7), ~5x
        gate(f"{name}_vs_fp64", rel_err(grad, ref_grad), 4e-3 if grad.dtype == torch.bfloat16 else 5e-7)
    if limit:  # the clamps took effect on both inputs, and their gradients are zero where they did
        assert (gate_in > limit).any() and (up.abs() > limit).any()
        assert (grads[0][gate_in > limit] == 0).all() and (grads[1][up.abs() > limit] == 0).all()


@pytest.mark.parametrize("rows", [1, 37, 4096])
def test_sinkhorn_kernel_matches_an_fp64_reference_as_closely_as_eager(rows):
    # mhc.hc_split_sinkhorn without autograd on CUDA is the one-kernel split_sinkhorn_triton; with autograd (and on
    # the CPU) it is the eager loop.  Both against the eager formulas in fp64 on the CPU, per output: the kernel's
    # error measured 3-10e-8 under the Triton interpreter (eager fp32: the same); gate 3e-7 (~3-5x)
    from deepseek_v41 import mhc

    g = torch.Generator().manual_seed(5)
    hc, iters, eps = 4, 20, 1e-6
    mixes = torch.randn(rows, (2 + hc) * hc, generator=g) * 4
    scale, base = torch.randn(3, generator=g), torch.randn((2 + hc) * hc, generator=g)
    reference = mhc.hc_split_sinkhorn(mixes.double(), scale.double(), base.double(), hc, iters, eps)
    with torch.no_grad():
        fused = mhc.hc_split_sinkhorn(mixes.cuda(), scale.cuda(), base.cuda(), hc, iters, eps)
    eager = mhc.hc_split_sinkhorn(mixes.cuda().requires_grad_(), scale.cuda(), base.cuda(), hc, iters, eps)
    assert eager[2].grad_fn is not None and fused[2].grad_fn is None  # the eager loop with autograd, the kernel without
    for name, out, ref, slow in zip(("pre", "post", "comb"), fused, reference, eager):
        assert out.dtype == torch.float32 and out.shape == ref.shape, name
        err, eager_err = rel_err(out.cpu(), ref), rel_err(slow.detach().cpu(), ref)
        print(f"{name}: kernel {err:.2e}, eager {eager_err:.2e}")
        assert err <= 3e-7, (name, err, eager_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qdq_kernels_are_bit_identical_to_the_references(dtype):
    # quantization's three boundaries on CUDA without autograd are qdq_triton; the references (eager, on the same
    # GPU) are what matches the official kernels.  Values over 12 decades, an all-zero block, a block of
    # subnormal-sized values and signed zeros: every output equal, zeros' signs included
    from deepseek_v41 import quantization as q

    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 7, 512, generator=g) * torch.logspace(-8, 4, 512)
    x[0, 0] = 0.0
    x[1, 1, :32] = -0.0
    x[2, 2, :64] = 1e-38
    x = x.to(dtype).cuda()
    for name, reference, boundary in (("fp8", q.fp8_qdq_reference, q.fp8_qdq), ("fp4", q.fp4_qdq_reference, q.fp4_qdq),
                                      ("fp4_e4m3_scale", q.fp4_e4m3_scale_qdq_reference, q.fp4_e4m3_scale_qdq)):
        with torch.no_grad():
            fused = boundary(x)
        ref = reference(x)
        assert fused.dtype == dtype and fused.shape == x.shape
        same = fused.view(torch.int16 if dtype == torch.bfloat16 else torch.int32) == ref.view(
            torch.int16 if dtype == torch.bfloat16 else torch.int32)
        assert bool(same.all()), (name, int((~same).sum()), x[~same][:4], fused[~same][:4], ref[~same][:4])
        grad_x = x.clone().requires_grad_()
        out = boundary(grad_x)  # with autograd: the reference with its identity backward
        out.sum().backward()
        assert torch.equal(out.detach(), ref) and torch.equal(grad_x.grad, torch.ones_like(x))


@pytest.mark.parametrize("b,n,T", [(32, 1, 32768 + 200), (3, 6, 1000)])
def test_index_scores_kernel_rounds_as_eager(b, n, T):
    # the decode indexer's scores: MXFP4-valued queries and keys (as the model feeds them: quantization.fp4_qdq),
    # bf16-valued weights (the projection's), each query with its own visible count.  The products are exact in
    # both; the fp32 summation orders differ.  A bf16 q (a bf16 model): each dot product, weighted value and the
    # head sum rounded to bf16 as eager's score_dtype=bf16 (the official Indexer's) rounds them, so a score may differ
    # by one bf16 ulp where a sum falls at a rounding boundary.  An fp32 q (an fp32 model): fp32 throughout, against
    # fp64 no further than eager
    from deepseek_v41.kernels_triton import index_scores_triton
    from deepseek_v41.quantization import fp4_qdq_reference
    from deepseek_v41.sparse_attention import indexer_scores_torch

    g = torch.Generator().manual_seed(3)
    H, D = 32, 128
    q = fp4_qdq_reference(torch.randn(b, n, H, D, generator=g)).bfloat16()
    k = fp4_qdq_reference(torch.randn(b, T, D, generator=g))  # fp32 keys, as the static cache holds them
    w = (torch.randn(b, n, H, generator=g) * (D**-0.5 * H**-0.5)).bfloat16().float()
    visible = torch.randint(0, T + 1, (b, n), generator=g)
    visible[0, 0], visible[-1, -1] = 0, T  # nothing visible, everything visible
    q, k, w, visible = q.cuda(), k.cuda(), w.cuda(), visible.cuda()

    got = index_scores_triton(q, w, k, visible)
    eager = indexer_scores_torch(q, w, k, 1, visible, score_dtype=torch.bfloat16)
    seen = torch.isfinite(eager)
    assert got.dtype == torch.float32 and torch.equal(torch.isinf(got), ~seen) and (got[~seen] < 0).all()
    assert torch.equal(got[seen].bfloat16().float(), got[seen])  # bf16 values
    diff = (got[seen] - eager[seen]).abs()
    assert (diff <= eager[seen].abs() * 2**-7).all(), diff.max()  # at most one bf16 ulp
    gate("index_scores_bf16_share_off_by_an_ulp", (diff > 0).float().mean().item(), 1e-2)

    exact = torch.einsum("bshd,btd->bsht", q.double(), k.double()).relu()
    exact = torch.einsum("bsht,bsh->bst", exact, w.double())
    exact = exact.masked_fill(torch.arange(T, device="cuda") >= visible.unsqueeze(-1), float("-inf"))
    got = index_scores_triton(q.float(), w, k, visible)
    eager = indexer_scores_torch(q.float(), w, k, 1, visible)
    assert got.dtype == torch.float32 and torch.equal(torch.isinf(got), ~seen)
    err, eager_err = ((x[seen].double() - exact[seen]).abs().max().item() for x in (got, eager))
    scale = exact[seen].abs().max().item()
    assert err <= max(2 * eager_err, 4 * 2**-24 * scale), (err, eager_err, scale)
