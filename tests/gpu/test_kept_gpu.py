"""Kept release formats on GPUs (kept.py): the FP8/FP4 path against the official FP8 path stored in the golden
fixtures (``fp8w_bf16``: activations quantized per 32 with UE8M0 scales, FP8 x FP8 / FP8 x FP4 GEMMs), against our
dequantized bf16 model, the tile-by-tile fallback on CUDA (logged once), and blocks spread over two GPUs.

Every figure is printed (``-s``) so the lead can record the measured distances next to the gates."""

import functools
import json
import logging

import pytest
import torch
from conftest import GOLDEN_FIXTURES, golden_dir
from safetensors.torch import load_file

from deepseek_v41 import DeepseekV41ForCausalLM
from deepseek_v41 import kept as kept_module
from deepseek_v41.kept import is_kept
from deepseek_v41.parity import (
    GATES,
    gate_failures,
    logits_metrics,
    model_inputs,
    reference_logits,
    snapshot_head_weight,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@functools.cache
def golden(fixture):
    return load_file(str(golden_dir(fixture) / "reference" / "golden.safetensors"))


def load(fixture, dequantize, device_map="cuda:0", **kwargs):
    return DeepseekV41ForCausalLM.from_pretrained(golden_dir(fixture) / "snapshot", dtype=torch.bfloat16,
                                                  dequantize_base_checkpoint=dequantize, device_map=device_map,
                                                  **kwargs)


def logits_of(model, fixture):
    inputs = {k: v.to("cuda:0") for k, v in model_inputs(golden(fixture)).items()}
    with torch.no_grad():
        return model(**inputs).logits.float().cpu()


def show(what, metrics):
    print(what, json.dumps({k: float(f"{v:.4g}") for k, v in metrics.items()}))


# mean-KL gates of the kept model against the official FP8 run (see the test's docstring)
KEPT_VS_OFFICIAL_FP8 = {"v41_tiny_text": 1e-4, "v41_tiny_vision": 6e-4}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="the FP8/FP4 kernels need sm_89+")
@pytest.mark.parametrize("fixture", GOLDEN_FIXTURES)
def test_kept_fp8_path_against_the_official_fp8_path(fixture):
    """Issue 40's fidelity gates: kept (FP8 activations, FP8/FP4 GEMMs) against the official FP8 path, and against
    our bf16 (dequantized) path no further than the official FP8 path is from the official bf16 path (1.5x: room
    for one discrete flip on a 128-token fixture).

    Our bf16 path rounds where the official one does (the sparse attention's unnormalised block probabilities, the
    indexer's bf16 scores, the mHC softmax and stream mix): on CPU bit-identical to the official bf16 run.
    Measured on an H100 (2026-12-08), kept vs official FP8 mean KL: text 2.2e-5 (gate: the issue's 1e-4), vision
    4.0e-4 (gate 6e-4, 1.5x; one top-1 flip, max KL 1.6e-2).  Before the roundings matched, 3.0e-4 / 8.8e-4.
    On CPU the same path, activations quantized as the kernels quantize them, gives the official FP8 run's logits
    (text bit-identical, vision 9.7e-7; tests/test_kept.py): what is left here is GPU arithmetic (GEMM summation
    orders, the FP8 tensor cores' accumulation), which the vision fixture amplifies more."""
    if kept_module.quantized_kernels(torch.empty(1, device="cuda", dtype=torch.bfloat16)) is None:
        pytest.skip(f"deepseek_v41.kernels_quantized is not usable here: {kept_module._kernels_error}")
    model = load(fixture, None)
    assert is_kept(model)
    logits = logits_of(model, fixture)
    g = golden(fixture)
    head = snapshot_head_weight(golden_dir(fixture) / "snapshot")
    official_fp8, official_bf16 = reference_logits(g, "fp8w_bf16", head), reference_logits(g, "bf16w_bf16", head)
    ours_bf16 = logits_of(load(fixture, True), fixture)
    vs_official = logits_metrics(official_fp8, logits)
    vs_ours = logits_metrics(ours_bf16, logits)
    official_spread = logits_metrics(official_bf16, official_fp8)
    show(f"{fixture} kept vs official fp8", vs_official)
    show(f"{fixture} kept vs our bf16", vs_ours)
    show(f"{fixture} official fp8 vs official bf16", official_spread)
    assert vs_official["mean_kl"] <= KEPT_VS_OFFICIAL_FP8[fixture], (vs_official, official_spread)
    assert vs_official["mean_kl"] <= 1.5 * official_spread["mean_kl"], (vs_official, official_spread)
    assert not gate_failures(vs_official, GATES["bf16"]), vs_official
    # the bound is 1x the official spread; 1.5x leaves room for one discrete flip on a 128-token fixture
    assert vs_ours["mean_kl"] <= 1.5 * official_spread["mean_kl"], (vs_ours, official_spread)


def test_fallback_on_cuda_is_logged_once_and_matches_the_dequantized_model(monkeypatch, caplog):
    """Without usable kernels (as on a GPU without FP8) the kept model decodes tile by tile on the GPU: the
    dequantized model's numerics up to cuBLAS's choice of kernel per tile shape (bf16 gates), one warning."""
    monkeypatch.setattr(kept_module, "_kernels", False)
    monkeypatch.setattr(kept_module, "_kernels_error", "kernels disabled by the test")
    monkeypatch.setattr(kept_module, "_fallback_logged", False)
    fixture = "v41_tiny_text"
    model = load(fixture, None)
    with caplog.at_level(logging.WARNING, logger="deepseek_v41.kept"):
        logits = logits_of(model, fixture)
        logits_of(model, fixture)
    warnings = [r for r in caplog.records if r.name == "deepseek_v41.kept"]
    assert len(warnings) == 1 and "tile-by-tile fallback" in warnings[0].getMessage()
    metrics = logits_metrics(logits_of(load(fixture, True), fixture), logits)
    show("cuda fallback vs dequantized", metrics)
    assert not gate_failures(metrics, GATES["bf16"]), metrics


def test_kept_weights_on_the_gpu_are_the_snapshot_bytes():
    model = load("v41_tiny_text", None)
    from deepseek_v41.checkpoint import ReleasedCheckpoint

    checkpoint = ReleasedCheckpoint(golden_dir("v41_tiny_text") / "snapshot")
    state = model.state_dict()
    for t in checkpoint.tensors.values():  # FP8 linears, FP4 experts and the Engram tables, codes and scales
        if t.fmt != "plain":
            for record in (t.record, t.scale):
                assert state[record.name].is_cuda, record.name
                assert torch.equal(state[record.name].cpu().view(torch.uint8),
                                   checkpoint.read_raw(record).view(torch.uint8)), record.name


SPLIT = {"embed": 0, **{f"layers.{i}": 0 if i < 4 else 1 for i in range(9)}, "norm": 1, "head": 1}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("device_map", ["split", "auto"])
def test_blocks_over_two_gpus_generate_what_one_gpu_does(device_map):
    """Kept blocks spread over two GPUs (whole blocks: an explicit split, and accelerate's "auto" plan, which
    counts the kept bytes) generate the single-GPU model's greedy tokens with the decode cache."""
    ids = golden("v41_tiny_text")["input_ids"][:, :24]
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    with torch.no_grad():
        one = load("v41_tiny_text", None).generate(ids.to("cuda:0"), **kwargs).cpu()
        model = load("v41_tiny_text", None, device_map=SPLIT if device_map == "split" else "auto")
        print(device_map, model.hf_device_map)
        if device_map == "split":
            assert {b.attn.wq_a.weight.device.index for b in model.layers} == {0, 1}
            assert {b.ffn.experts.w1.device.index for b in model.layers} == {0, 1}
        two = model.generate(ids.to("cuda:0"), **kwargs).cpu()
    assert torch.equal(one, two)
