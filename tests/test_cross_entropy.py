"""The loss's cross-entropy (deepseek_v41/cross_entropy.py) against F.cross_entropy, with gradients."""

import pytest
import torch
from torch.nn import functional as F

from deepseek_v41.cross_entropy import check_targets, cross_entropy_sum


def test_cross_entropy_sum_and_its_gradient_match_torch():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 501, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 501, (37,), generator=g)
    targets[[0, 5, 36]] = -100
    weight = torch.tensor(0.7)
    ours = cross_entropy_sum(logits, targets) * weight
    (grad,) = torch.autograd.grad(ours, logits)
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets, ignore_index=-100, reduction="sum") * weight
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    # fp32 against fp64, with room for one imprecise exp: on this CPU torch (2.13, AVX512, 2 threads), the first
    # call of exp/log/tanh in a process computes the second thread's half ~1e-4 off, now and then
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-3, atol=1e-6)
    assert grad[[0, 5, 36]].abs().max() == 0 and grad[1].abs().max() > 0  # ignored rows get no gradient


def test_cross_entropy_sum_keeps_only_the_logits_and_one_value_per_row():
    # what autograd holds for the backward: the logits themselves (no log-softmax copy) and [rows] fp32
    logits = torch.randn(8, 300, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        cross_entropy_sum(logits, torch.arange(8))
    assert sum(t.numel() for t in saved if t.is_floating_point()) == logits.numel() + 8
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)


def test_bad_targets_and_dtypes_are_named():
    with pytest.raises(ValueError, match=r"token ids in \[0, 10\).*\[10, -3\]"):
        check_targets(torch.tensor([1, 10, -100, -3]), 10)
    check_targets(torch.tensor([0, 9, -100]), 10)
    with pytest.raises(TypeError, match="fp32 logits"):
        cross_entropy_sum(torch.randn(2, 5).bfloat16(), torch.tensor([0, 1]))
