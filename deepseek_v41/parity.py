"""Parity metrics against the official implementation (training_recipe.md §8) and the golden-fixture gates.

Not part of the modeling path: used by the parity tests and ``conversion/compare_with_official.py``.
"""

from pathlib import Path

import torch

from .attention import CSA2State, candidate_mask

# Gates of the golden reference README (fixture) and of the V4.1 docs (real model, bf16).
GATES = {
    "fp32": {"mean_kl": 1e-5, "p95_kl": 1e-5, "cosine": 0.99999, "top1": 0.99, "rel_l2": 5e-3},
    "bf16": {"mean_kl": 1e-3, "p95_kl": 2e-3, "cosine": 0.999, "top1": 0.98},
}
# The fixtures' README gate (c): p90 per-token rel. L2, teacher-forced bf16.  Measured, worst layer of both fixtures
# (1 and 2 threads): attn_out 6.0e-3 (gate 3.4x), ffn_out 6.4e-3 (2.3x), block_out 1.9e-3 (2.7x); engram_out 0
# (the same bf16 ops; the README's honest variants too): its 5e-3 is the README's, at block_out's level since
# another rounding order of the Engram branch moves the same stream (the README's Engram bug errs 3.2e-2)
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


# ---- golden fixtures (tests/fixtures/<fixture>/reference/golden.safetensors) ----


def model_inputs(g) -> dict:
    """Model kwargs for the fixture's batch (image spans: the stored patches, grids and token types)."""
    inputs = {"input_ids": g["input_ids"]}
    if "token_types" in g:
        images = sorted({k.split(".")[0] for k in g if k.startswith("image") and k.endswith(".patches")})
        inputs["vision_token_types"] = g["token_types"]
        inputs["pixel_values"] = torch.cat([g[f"{im}.patches"] for im in images])
        inputs["image_grid_hws"] = torch.stack([g[f"{im}.grid"][1:3] for im in images])
    return inputs


def snapshot_head_weight(snapshot) -> torch.Tensor:
    """The snapshot's stored ``head.weight`` as fp32 [vocab, dim], read with safetensors: the official side's
    head, independent of our loader and of the head our model holds."""
    from safetensors import safe_open

    for path in sorted(Path(snapshot).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            if "head.weight" in names:
                return f.get_tensor("head.weight").float()
    raise FileNotFoundError(f"no head.weight in the safetensors files of {snapshot}")


def reference_logits(g, tag, head_weight: torch.Tensor) -> torch.Tensor:
    # The README's definition: logits = stored final_hidden (fp32) × the snapshot's head, full vocabulary.
    return g[f"{tag}.final_hidden"].float() @ head_weight.float().T


def teacher_forced(model, g) -> list[dict]:
    """Run every block from the stored stream input and pre-mix (bf16 reference run); per layer, the p90
    relative L2 of engram/attention/FFN/block outputs and the agreement of the discrete choices."""
    prefix = "bf16w_bf16"
    ids = g["input_ids"]
    image_mask = g["token_types"] >= 0 if "token_types" in g else None
    seq = ids.shape[1]
    captured, hooks = {}, []
    for layer in model.layers:
        hooks.append(layer.attn.register_forward_hook(lambda m, a, o, i=layer.layer: captured.update({(i, "attn"): o})))
        hooks.append(layer.ffn.register_forward_hook(lambda m, a, o, i=layer.layer: captured.update({(i, "ffn"): o})))
        hooks.append(layer.ffn.gate.register_forward_hook(
            lambda m, a, o, i=layer.layer: captured.update({(i, "experts"): o[1]})))
    state, rows = CSA2State(), []
    try:
        with torch.no_grad():
            stream = model.embed(ids).unsqueeze(2).expand(-1, -1, model.hc, -1)
            if image_mask is not None:  # layer 0's stored input is not kept: rebuild it with the image rows
                inputs = model_inputs(g)
                stream = model.embed_images(model.embed(ids), ids, inputs["pixel_values"], inputs["image_grid_hws"],
                                            inputs["vision_token_types"]).unsqueeze(2).expand(-1, -1, model.hc, -1)
            for layer in model.layers:
                i, row = layer.layer, {"layer": layer.layer}
                x = stream if i == 0 else g[f"{prefix}.layer{i - 1}.block_out"]
                if layer.engram is not None:
                    out = layer.engram(x, layer.engram.hash(ids, image_mask), image_mask)
                    row["engram_out"] = p90_relative_l2(out, g[f"{prefix}.layer{i}.engram_out"])
                    x = g[f"{prefix}.layer{i}.engram_out"]
                engram, layer.engram = layer.engram, None  # the block input is the stored post-Engram stream
                block_out, _ = layer(x, g[f"{prefix}.layer{i}.in_pre_mix"], state, input_ids=ids, image_mask=image_mask)
                layer.engram = engram
                row["attn_out"] = p90_relative_l2(captured[(i, "attn")], g[f"{prefix}.layer{i}.attn_out"])
                ffn_ref = g[f"{prefix}.layer{i}.ffn_out"]
                row["ffn_out"] = p90_relative_l2(captured[(i, "ffn")].view_as(ffn_ref), ffn_ref)
                row["block_out"] = p90_relative_l2(block_out, g[f"{prefix}.layer{i}.block_out"])
                row["router"] = set_agreement(captured[(i, "experts")], g[f"{prefix}.layer{i}.router_experts"])
                if f"{prefix}.layer{i}.compress_kv" in g:
                    row["compress_kv"] = p90_relative_l2(state.read(i, "compressed_kv"), g[f"{prefix}.layer{i}.compress_kv"])
                    row["index_k"] = p90_relative_l2(state.read(i, "index_k"), g[f"{prefix}.layer{i}.index_k"])
                if f"{prefix}.layer{i}.index_topk" in g:
                    topk = state.read(i, "topk")
                    row["topk"] = set_agreement(torch.where(topk >= 0, topk + seq, -1), g[f"{prefix}.layer{i}.index_topk"])
                if f"{prefix}.layer{i}.candidates" in g:
                    ref = g[f"{prefix}.layer{i}.candidates"].bool()
                    kept = candidate_mask(state.read(i, "candidates"), layer.attn.candidate_block_size, ref.shape[-1])
                    same = kept == ref
                    row["candidates"] = same.float().mean().item()
                rows.append(row)
    finally:
        for hook in hooks:
            hook.remove()
    return rows


# Discrete choices agree except at near-ties of teacher-forced inputs (README); these floors catch real bugs.
DISCRETE_FLOORS = {"router": 0.97, "topk": 0.95, "candidates": 0.99}
EXACT_FLOORS = {"compress_kv": 5e-3, "index_k": 5e-3}


def first_divergence(rows) -> str | None:
    for row in rows:
        for name, bound in {**LAYER_GATES, **EXACT_FLOORS}.items():
            if name in row and row[name] > bound:
                return f"layer {row['layer']} {name}: p90 rel. L2 {row[name]:.2e} > {bound:.1e}"
        for name, floor in DISCRETE_FLOORS.items():
            if name in row and row[name] < floor:
                return f"layer {row['layer']} {name}: agreement {row[name]:.3f} < {floor}"
    return None
