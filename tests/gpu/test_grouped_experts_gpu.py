"""``torch._grouped_mm`` (the grouped-experts GEMM) in bf16 on CUDA against a per-expert F.linear loop.

SwiGLU experts: h = x·W13ᵀ (gate and up stacked), a = silu(h_gate)·h_up, y = a·W2ᵀ, tokens sorted by
expert with int32 cumulative offsets; empty experts included.  Skips without a CUDA GPU.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="grouped experts GPU test needs a CUDA GPU"),
    pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"),
]


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def swiglu_grouped(x, w13, w2, offs):
    # x [S, D] sorted by expert, w13 [E, 2I, D], w2 [E, D, I], offs [E] int32 cumsum -> [S, D]
    h = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)


def swiglu_loop(x, w13, w2, counts):
    out, start = [], 0
    for e, c in enumerate(counts):
        xe = x[start : start + c]
        gate, up = F.linear(xe, w13[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, w2[e]))
        start += c
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[0, 37, 128, 0, 5, 200, 1, 0], [64] * 8, [0] * 7 + [300]])
def test_grouped_mm_matches_expert_loop(counts):
    gen = torch.Generator(device="cuda").manual_seed(sum(counts))
    E, D, I = len(counts), 256, 128
    S = sum(counts)
    x = torch.randn(S, D, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, D, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
    offs = torch.tensor(counts, device="cuda").cumsum(0).int()
    dy = torch.randn(S, D, device="cuda", generator=gen).bfloat16()

    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = swiglu_grouped(*leaves, offs)
    y.backward(dy)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = swiglu_loop(*ref_leaves, counts)
    y_ref.backward(dy)

    assert y.dtype == torch.bfloat16 and y.shape == (S, D)
    assert rel_err(y, y_ref) < 1e-2
    for name, a, r in zip(("dx", "dw13", "dw2"), leaves, ref_leaves):
        assert rel_err(a.grad, r.grad) < 1e-2, name
    # experts that got no token get exactly zero weight gradient
    for e, c in enumerate(counts):
        if c == 0:
            assert leaves[1].grad[e].abs().max().item() == 0.0
            assert leaves[2].grad[e].abs().max().item() == 0.0
