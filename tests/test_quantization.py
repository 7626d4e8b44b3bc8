"""Simulated quantize→dequantize boundaries: rounding against slow element-wise references, identity backward."""

import pytest
import torch

from deepseek_v41.quantization import (
    fp4_e4m3_scale_qdq,
    fp4_e4m3_scale_qdq_reference,
    fp4_qdq,
    fp4_qdq_reference,
    fp8_qdq,
    fp8_qdq_reference,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_e2m1_slow(v: float) -> float:
    # Nearest level; on a tie the even code (codes 0..7 index E2M1) wins.
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))
    return E2M1[best] if v >= 0 else -E2M1[best]


def slow_block_qdq(x: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    out = torch.empty_like(x, dtype=torch.float32)
    flat, res = x.float().reshape(-1, block), out.view(-1, block)
    for r in range(flat.shape[0]):
        row = flat[r].tolist()
        amax = max(abs(v) for v in row)
        if kind == "fp8":
            scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(max(amax, 1e-4) / 448.0))).item()
            q = [torch.tensor(max(-448.0, min(448.0, v / scale))).to(torch.float8_e4m3fn).float().item() for v in row]
        elif kind == "fp4":
            scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(max(amax, 6 * 2.0**-126) / 6.0))).item()
            q = [nearest_e2m1_slow(v / scale) for v in row]
        else:
            scale = torch.tensor(min(max(amax, 6 * 2.0**-9) / 6.0, 448.0)).to(torch.float8_e4m3fn).float().item()
            q = [nearest_e2m1_slow(torch.tensor(v, dtype=torch.float32).div(scale).item()) for v in row]
        res[r] = torch.tensor(q) * scale
    return out


@pytest.mark.parametrize("kind,block,fn", [
    ("fp8", 32, fp8_qdq_reference), ("fp4", 32, fp4_qdq_reference), ("fp4e4m3", 16, fp4_e4m3_scale_qdq_reference)])
def test_rounding_matches_slow_reference(kind, block, fn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-6, 3, 6).unsqueeze(1)
    x[0, :block] = 0.0  # an all-zero block
    x[1, 3] = 1e4  # one outlier dominating its block
    x[2, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])  # E2M1 ties
    torch.testing.assert_close(fn(x), slow_block_qdq(x, block, kind), rtol=0, atol=0)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(fn(xb).float(), slow_block_qdq(xb, block, kind).to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("fn", [fp8_qdq, fp4_qdq, fp4_e4m3_scale_qdq])
def test_straight_through_gradient_is_identity(fn):
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 64, dtype=torch.bfloat16)
    (g * fn(x)).sum().backward()
    assert torch.equal(x.grad, g)
    assert not torch.equal(fn(x.detach()), x.detach()), "the forward must actually round"


def test_block_must_divide_the_last_dimension():
    with pytest.raises(ValueError, match="does not divide"):
        fp8_qdq_reference(torch.randn(3, 40))
