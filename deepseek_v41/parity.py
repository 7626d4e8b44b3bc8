"""Parity metrics against the official implementation (training_recipe.md §8) and the golden-fixture gates.

Not part of the modeling path: used by the parity tests and ``conversion/compare_with_official.py``.
"""

import torch

# Gates of the golden reference README (fixture) and of the V4.1 docs (real model, bf16).
GATES = {
    "fp32": {"mean_kl": 1e-5, "p95_kl": 1e-5, "cosine": 0.99999, "top1": 0.99, "rel_l2": 5e-3},
    "bf16": {"mean_kl": 1e-3, "p95_kl": 2e-3, "cosine": 0.999, "top1": 0.98},
}
LAYER_GATES = {"engram_out": 5e-3, "attn_out": 2e-2, "ffn_out": 1.5e-2, "block_out": 5e-3}


@torch.no_grad()
def logits_metrics(reference: torch.Tensor, candidate: torch.Tensor, chunk: int = 16) -> dict:
    """Per-token KL(reference || candidate) over the full vocabulary (fp32, chunks of ``chunk`` tokens),
    global cosine accumulated in fp64, top-1 agreement, relative L2 and max |Δ| of the logits."""
    ref = reference.reshape(-1, reference.shape[-1])
    cand = candidate.reshape(-1, candidate.shape[-1])
    if not (torch.isfinite(ref).all() and torch.isfinite(cand).all()):
        raise ValueError("non-finite logits")
    kl, dot, ref_sq, cand_sq, diff_sq, top1, max_abs = [], 0.0, 0.0, 0.0, 0.0, 0, 0.0
    for start in range(0, ref.shape[0], chunk):
        r, c = ref[start : start + chunk].float(), cand[start : start + chunk].float()
        log_r, log_c = torch.log_softmax(r, -1), torch.log_softmax(c, -1)
        kl.append((log_r.exp() * (log_r - log_c)).sum(-1))
        rd, cd = r.double(), c.double()
        dot += (rd * cd).sum().item()
        ref_sq += rd.square().sum().item()
        cand_sq += cd.square().sum().item()
        diff_sq += (rd - cd).square().sum().item()
        top1 += (r.argmax(-1) == c.argmax(-1)).sum().item()
        max_abs = max(max_abs, (r - c).abs().max().item())
    kl = torch.cat(kl)
    return {
        "mean_kl": kl.mean().item(),
        "p95_kl": torch.quantile(kl, 0.95).item(),
        "max_kl": kl.max().item(),
        "cosine": dot / (ref_sq * cand_sq) ** 0.5,
        "top1": top1 / ref.shape[0],
        "rel_l2": (diff_sq / ref_sq) ** 0.5,
        "max_abs_diff": max_abs,
        "tokens": ref.shape[0],
    }


def gate_failures(metrics: dict, gates: dict) -> list[str]:
    """Names of the gates ``metrics`` misses (upper bounds for KL / L2, lower bounds for cosine / top-1)."""
    failures = []
    for name, bound in gates.items():
        value = metrics[name]
        ok = value >= bound if name in ("cosine", "top1") else value <= bound
        if not ok:
            failures.append(f"{name} = {value:.3e} (gate {bound:.3e})")
    return failures


def p90_relative_l2(candidate: torch.Tensor, reference: torch.Tensor, token_dims: int = 2) -> float:
    """90th percentile over tokens (the first ``token_dims`` axes) of the per-token relative L2."""
    c = candidate.float().flatten(0, token_dims - 1).flatten(1)
    r = reference.float().flatten(0, token_dims - 1).flatten(1)
    per_token = (c - r).norm(dim=-1) / r.norm(dim=-1).clamp(min=1e-30)
    return torch.quantile(per_token, 0.9).item()


def set_agreement(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of rows whose integer selections (last axis) are equal as sets."""
    return (candidate.sort(-1).values == reference.sort(-1).values).all(-1).float().mean().item()
