"""Cross-entropy over the fp32 logits, with the logits as the only full-size tensor it keeps or makes.

``F.cross_entropy`` keeps a second [rows, vocab] fp32 tensor (the log-softmax) for its backward and, in the
backward, builds the gradient in several full passes.  Here the forward keeps only the per-row
log-sum-exp; the backward forms softmax − one-hot in one pass over the logits.  On CUDA each direction is
one fused kernel.
"""

import torch

from .layers import compiled_on_cuda

IGNORE_INDEX = -100


def _log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    # fp32 [rows, V] -> fp32 [rows]
    return torch.logsumexp(logits, dim=-1)


def _softmax_minus_one_hot(logits, lse, targets, grad):
    # d(Σ_counted lse − logit[target]) / d logits, times the incoming scalar gradient: fp32 [rows, V]
    probs = torch.exp(logits - lse.unsqueeze(-1))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    probs = torch.where(vocab == targets.unsqueeze(-1), probs - 1, probs)
    return probs * torch.where(targets == IGNORE_INDEX, 0.0, grad).unsqueeze(-1)


_log_sum_exp_fused = compiled_on_cuda(_log_sum_exp, dynamic=True)
_softmax_minus_one_hot_fused = compiled_on_cuda(_softmax_minus_one_hot, dynamic=True)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        lse = _log_sum_exp_fused(logits)  # [rows]
        picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, lse, targets)
        return torch.where(targets == IGNORE_INDEX, 0.0, lse - picked).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, lse, targets = ctx.saved_tensors
        return _softmax_minus_one_hot_fused(logits, lse, targets, grad), None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ over rows whose target is not -100 of −log softmax(logits)[target]: logits fp32 [rows, V] (used as
    is, no copy when contiguous), targets int [rows], each in [0, V) or -100 (``check_targets``) -> fp32 scalar."""
    if logits.dtype != torch.float32:
        raise TypeError(f"cross_entropy_sum takes fp32 logits (the head's output), got {logits.dtype}")
    return _CrossEntropySum.apply(logits.contiguous(), targets)


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Raise ``ValueError`` naming the bad values unless every target is a token id in [0, vocab) or -100."""
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        raise ValueError(
            f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored); got {targets[bad][:5].tolist()}"
        )
