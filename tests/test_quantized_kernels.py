"""kernels_quantized.py on CPU: the eager FP8 activation quantizer against the official formula written out
independently (frexp for the power-of-two ceiling, a real division), and the GEMM entry points' input checks.
The Triton kernels themselves are tested on the GPU (tests/gpu/test_quantized_kernels_gpu.py)."""

import importlib.util

import pytest
import torch
from conftest import official_dir

from deepseek_v41 import kernels_quantized as kq
from deepseek_v41.release_format import encode_fp4_packed, encode_fp8_blockwise


def official_act_quant(x: torch.Tensor, block: int = 32):
    # architecture.md §6: amax = max(|block|, 1e-4), s = 2^ceil(log2(amax/448)), q = e4m3_rne(clamp(x/s, ±448))
    g = x.double().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1).clamp_min(1e-4)
    mantissa, exponent = torch.frexp(amax / 448)
    s = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).long())
    q = (g / s[..., None]).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return q.flatten(-2), s.float()


def test_act_quant_reference_matches_the_official_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-6, 4, 64)[:, None]
    x[0, :32] = 0  # the 1e-4 amax floor
    x[1, :32] = 448 * 2.0**-5  # amax/448 exactly a power of two: the scale must not round up
    x[1, 32:64] = torch.linspace(-448 * 2.0**-5, 448 * 2.0**-5, 32)
    x[2, :32] = 1e30  # a large group
    x = x.bfloat16()
    codes, scales = kq.act_quant_reference(x)
    ref_codes, ref_scales = official_act_quant(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert scales[1, 0] == 2.0**-5 and scales[0, 0] == 2.0**-22


def test_act_quant_reference_matches_the_official_kernel():
    # the official V4.1 call site: act_quant(x, fp8_block_size=32, scale_fmt="ue8m0", scale_dtype=float8_e8m0fnu);
    # DS41_OFFICIAL_DIR's kernel.py (CPU stand-ins of the official kernels), else a skip
    spec = importlib.util.spec_from_file_location("official_kernel_for_act_quant", official_dir() / "kernel.py")
    official = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(official)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(48, 320, generator=gen) * torch.logspace(-5, 3, 48)[:, None]).bfloat16()
    codes, scales = kq.act_quant_reference(x)
    ref_codes, ref_scales = official.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales, ref_scales.float())


def test_act_quant_ragged_last_group_uses_its_own_columns():
    x = torch.ones(3, 40).bfloat16()
    x[:, 32:] = 0.25
    codes, scales = kq.act_quant_reference(x)
    assert codes.shape == (3, 40) and scales.shape == (3, 2)
    padded, ref_scales = official_act_quant(torch.nn.functional.pad(x, (0, 24)))
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), padded[:, :40].view(torch.uint8))


def test_act_quant_fp8_on_cpu_is_the_reference():
    x = torch.randn(5, 64).bfloat16()
    for got, ref in zip(kq.act_quant_fp8(x), kq.act_quant_reference(x)):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got,
                           ref.view(torch.uint8) if ref.dtype != torch.float32 else ref)
    with pytest.raises(ValueError, match="2-D"):
        kq.act_quant_fp8(x.view(5, 2, 32))


def test_gemm_entry_points_check_their_inputs():
    wq, ws = encode_fp8_blockwise(torch.randn(64, 96))
    x = torch.randn(4, 96).bfloat16()
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        kq.fp8_linear(x, wq, ws[:, :2])
    with pytest.raises(ValueError, match="takes 96"):
        kq.fp8_linear(torch.randn(4, 64).bfloat16(), wq, ws)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        kq.fp8_linear(x, wq.float(), ws)
    with pytest.raises(TypeError, match="UE8M0"):
        kq.fp8_linear(x, wq, ws.bfloat16())
    with pytest.raises(RuntimeError, match="tile at a time"):
        kq.fp8_linear(x, wq, ws)  # CPU: the caller's dequantizing fallback
    codes, scales = encode_fp4_packed(torch.randn(48, 96))
    a, a_scale = kq.act_quant_fp8(x)
    with pytest.raises(ValueError, match="one per 32 inputs"):
        kq.fp4_grouped_gemm(a, a_scale, codes[None], scales[None, :, :2], torch.tensor([4]))
    with pytest.raises(ValueError, match="rows per expert"):
        kq.fp4_grouped_gemm(a, a_scale, codes[None], scales[None], torch.tensor([2, 2]))
    with pytest.raises(TypeError, match="two E2M1 codes per byte"):
        kq.fp4_grouped_gemm(a, a_scale, codes[None].float(), scales[None], torch.tensor([4]))


def test_config_tiers_follow_the_rows_per_live_expert():
    # one token's top-6 rows are one row per expert, whatever the expert count: the GEMV tier
    assert kq.rows_per_expert(6, 32) == 1 and kq.rows_per_expert(192, 384) == 1
    assert kq.rows_per_expert(192, 32) == 6 and kq.rows_per_expert(4096 * 6, 32) == 768
    assert kq.rows_per_expert(0, 8) == 0
    tiers = {rows: kq.config_tier(rows) for rows in (0, 1, 2, 16, 17, 64, 65, 512, 513)}
    assert tiers == {0: "gemv", 1: "gemv", 2: "small", 16: "small", 17: "decode", 64: "decode", 65: "medium",
                     512: "medium", 513: "prefill"}
    for kind in ("dense", "grouped", "swiglu"):
        for tier in set(tiers.values()):
            config = kq.CONFIGS[f"{kind}_{tier}"]
            assert len(config) == 7 and config[6] in (0, 1, 2, 3, 4)
            assert (config[6] == 4) == (tier == "gemv")  # the GEMV kernel at one row only (quantized_gemm.py sweeps)
