"""kernels_quantized.py on the GPU: the FP8 activation quantizer, the block-scaled FP8 linear and the FP4 grouped
GEMMs against independent references built from release_format.py's decoders and plain fp64 matmuls on the same
quantized activations, and end to end against the bf16 dequantized matmul.

Gates (see the constants): fp32-output GEMMs sit at the fp32-accumulation floor of the reference; the bf16 outputs
add one bf16 rounding; end to end, the distance to the bf16 matmul is the FP8 activation rounding the official
inference applies, measured in the same test.  Every figure is printed (``-s``).  Skips without an FP8 GPU.
"""

from types import SimpleNamespace

import pytest
import torch
from gpu_metrics import gate, rel_err

from deepseek_v41 import kernels_quantized as kq
from deepseek_v41.moe import RoutedExperts, weighted_swiglu
from deepseek_v41.release_format import (
    decode_fp4_packed,
    decode_fp8_blockwise,
    encode_fp4_packed,
    encode_fp8_blockwise,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="quantized GEMM kernels need a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not kq.quantized_gemm_usable(torch.empty(0, device="cuda")),
        reason="quantized GEMM kernels need Triton and FP8 tensor cores (compute capability 8.9+)",
    ),
]

# fp32 output vs the fp64 reference on the same FP8 operands, per product kind (H100, 2026-12-07,
# results/gate_table_h100.txt): the FP8 MMA 2.0e-5..4.6e-5 (Hopper adds a 32-deep FP8 block with ~14-bit alignment,
# DeepSeek-V3 report section 3.3.2); everything else (bf16 MMA on decoded tiles, fp32 FMAs, the GEMV kernel, the
# transient-decode prefill path) 0 to 5.1e-7 (exact products, fp32 sums).  Gates ~2x and ~5x.
FP32_FLOOR = {"fp8_mma": 1e-4, "exact_products": 2.5e-6}


def fp32_floor(config, kind: str, rows: int) -> float:
    # config None: the default for this kind and rows per weight; from DECODED_GEMM_ROWS dense rows on, the transient
    # bf16 decode (exact products)
    if config is None and kind == "dense" and rows >= kq.DECODED_GEMM_ROWS:
        return FP32_FLOOR["exact_products"]
    return FP32_FLOOR["fp8_mma" if kq._config(kind, rows, config)[6] == 0 else "exact_products"]


# one bf16 rounding of the output: 1.66e-3 (L2, relative) for Gaussian values; gate 1.2x
BF16_ROUNDING = 2.0e-3


def deq_act(codes, scales):
    # act_quant_reference's output as the fp64 values the GEMM multiplies
    return codes.double() * scales.double().repeat_interleave(32, 1)[:, : codes.shape[1]]


def fp8_weight(n, k, gen):
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    return encode_fp8_blockwise(w)


def fp4_experts(e, n, k, gen):
    pairs = [encode_fp4_packed(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(e)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


@pytest.mark.parametrize("m,k", [(1, 5120), (333, 1280), (64, 200), (0, 64)])
def test_act_quant_matches_the_reference_bit_for_bit(m, k):
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, device="cuda", generator=gen) * 4).bfloat16()
    if m > 2:
        x[1, :40] = 0  # amax floor 1e-4
        x[2, :32] = 448 * 2.0**-3  # amax/448 an exact power of two: no rounding up
        x[2, 32:64] = 3e4  # large values
    codes, scales = kq.act_quant_fp8(x)
    ref_codes, ref_scales = kq.act_quant_reference(x.cpu())
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8).cpu(), ref_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), ref_scales)


# kernel configurations (BLOCK_M, BLOCK_N, SUB, warps, stages, SPLIT_K, MMA): the three MMA paths (FP8; bf16;
# bf16 with the decoded weight tile as the left operand)
FP8_MMA, BF16_MMA, SWAP_MMA = (128, 128, 2, 8, 3, 1, 0), (128, 128, 2, 8, 3, 1, 1), (128, 128, 2, 8, 3, 1, 2)


@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (300, 200, 320, None),  # ragged N (partial weight block), K not a multiple of 128
        (300, 200, 320, FP8_MMA),
        (300, 200, 320, SWAP_MMA),
        (5, 200, 320, (16, 64, 2, 4, 3, 3, 2)),  # a few rows on the narrow side, split K
        (64, 96, 200, (64, 32, 2, 4, 3, 3, 1)),  # ragged K (partial 32-group), split K
        (64, 96, 200, (64, 32, 2, 4, 3, 3, 0)),
        (256, 256, 512, BF16_MMA),  # tiles inside N and K: the unmasked weight loads
        (256, 256, 512, FP8_MMA),
        (1, 512, 5120, None),  # decode, released wkv shape, split K by default
        (1, 512, 5120, (0, 32, 8, 4, 2, 0, 3)),  # FMAs (MMA 3), one row, split K
        (3, 200, 320, (0, 32, 2, 4, 2, 3, 3)),  # FMAs: ragged N, 3 rows in a tile of 4, split K
        (8, 96, 200, (8, 32, 2, 4, 2, 1, 3)),  # FMAs: ragged K (partial 32-group)
        (32, 256, 512, (8, 64, 4, 4, 2, 0, 3)),  # FMAs: several row tiles, unmasked weight loads
        pytest.param(1, 512, 5120, (0, 32, 8, 4, 2, 0, 4), id="gemv"),  # GEMV (MMA 4): one row, split K, unmasked
        pytest.param(3, 200, 320, (0, 32, 2, 4, 2, 3, 4), id="gemv"),  # GEMV: ragged N, 3 rows in a tile of 4, split K
        pytest.param(8, 96, 200, (8, 32, 2, 4, 2, 1, 4), id="gemv"),  # GEMV: ragged K (partial 32-group)
        pytest.param(32, 256, 512, (8, 64, 4, 4, 2, 0, 4), id="gemv"),  # GEMV: several row tiles
        (32, 1280, 5120, None),  # decode at batch 32, released wq_a shape: the FP8 MMA by default, split K
        (512, 5120, 8192, None),  # released wo_b shape
        (2048, 640, 320, None),  # prefill: the weight decoded to bf16, cuBLAS (DECODED_GEMM_ROWS)
        (512, 5120, 8192, FP8_MMA),
        (512, 5120, 8192, SWAP_MMA),
    ],
)
def test_fp8_linear_against_fp64_on_the_same_fp8_operands(m, n, k, config):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    wq, ws = fp8_weight(n, k, gen)
    out32 = kq.fp8_linear(x, wq, ws, out_dtype=torch.float32, config=config)
    out = kq.fp8_linear(x.view(m, 1, k), wq, ws, config=config)
    codes, scales = kq.act_quant_reference(x)
    ref = deq_act(codes, scales) @ decode_fp8_blockwise(wq, ws).double().T
    err32, err16 = rel_err(out32, ref), rel_err(out.view(m, n), ref)
    print(f"fp8_linear {m}x{n}x{k}: fp32 out {err32:.2e}, bf16 out {err16:.2e}")
    assert out.shape == (m, 1, n) and out.dtype == torch.bfloat16
    gate("fp32_out_vs_fp64", err32, fp32_floor(config, "dense", m))
    assert err16 < BF16_ROUNDING
    # F32 scales (older releases) give the same result
    assert torch.equal(kq.fp8_linear(x, wq, ws.float(), out_dtype=torch.float32, config=config), out32)
    # end to end: as far from the bf16 dequantized matmul as the FP8 activation rounding puts the reference
    exact = x.double() @ decode_fp8_blockwise(wq, ws).double().T
    quant_err = rel_err(ref, exact)
    print(f"  vs bf16 matmul {rel_err(out.view(m, n), exact):.3e}; FP8 activation rounding alone {quant_err:.3e}")
    assert rel_err(out.view(m, n), exact) < quant_err + BF16_ROUNDING


@pytest.mark.parametrize("n,groups,d,r,config", [
    (1, 8, 512, 128, None),  # decode
    (1, 8, 512, 128, (0, 32, 2, 4, 2, 1, 3)),  # FMAs
    pytest.param(3, 8, 512, 128, (0, 32, 4, 4, 2, 1, 4), id="gemv"),  # GEMV
    pytest.param(2, 16, 4096, 1024, (0, 32, 8, 4, 2, 1, 4), id="gemv"),  # GEMV, released wo_a
    (5, 8, 512, 128, None),
    (300, 4, 320, 96, None),  # prefill-like, ragged K
    (300, 4, 320, 96, SWAP_MMA),
    pytest.param(1100, 4, 320, 96, None, id="prefill-decoded"),  # DECODED_GEMM_ROWS: bf16 decode + torch.bmm
    (2, 16, 4096, 1024, None),  # released wo_a: 16 groups of 4096 -> 1024
])
def test_fp8_block_diagonal_linear_multiplies_bf16_activations(n, groups, d, r, config):
    # attention's wo_a as the official code computes it (bf16 activations, weight decoded), block-diagonal
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    o = torch.randn(n, groups, d, device="cuda", generator=gen).bfloat16()
    wq, ws = fp8_weight(groups * r, d, gen)
    out = kq.fp8_block_diagonal_linear(o, wq, ws, config=config)
    w = decode_fp8_blockwise(wq, ws).double().view(groups, r, d)
    ref = torch.einsum("ngd,grd->ngr", o.double(), w).reshape(n, groups * r)
    err = rel_err(out, ref)
    print(f"fp8_block_diagonal_linear n={n} {groups}x{r}x{d} {config}: bf16 out {err:.2e}")
    assert out.dtype == torch.bfloat16 and out.shape == (n, groups * r)
    assert err < BF16_ROUNDING  # one bf16 rounding of the output: the activations are not quantized
    with pytest.raises(ValueError, match="multiple of 32"):
        kq.fp8_block_diagonal_linear(o[:, :, :d], wq[: groups * 16], ws[: groups * 16 // 32 or 1], config=config)


def test_decode_fp8_weight_is_the_reference_decode():
    gen = torch.Generator(device="cuda").manual_seed(3)
    wq, ws = fp8_weight(200, 330, gen)  # ragged in both dimensions
    ref = decode_fp8_blockwise(wq, ws, dtype=torch.bfloat16)
    assert torch.equal(kq.decode_fp8_weight(wq, ws), ref)
    assert torch.equal(kq.decode_fp8_weight(wq, ws.float()), ref)


def test_decode_fp4_weights_is_the_reference_decode():
    gen = torch.Generator(device="cuda").manual_seed(4)
    codes, scales = fp4_experts(3, 40, 330, gen)  # K/32 ragged, 165 bytes per row
    ref = torch.stack([decode_fp4_packed(codes[e], scales[e]) for e in range(3)]).bfloat16()
    assert torch.equal(kq.decode_fp4_weights(codes, scales), ref)
    assert torch.equal(kq.decode_fp4_weights(codes, scales.float()), ref)
    default = kq.FP4_DECODE_CONFIG
    try:  # tiles ragged in rows (120 = 7.5 x 16) and bytes (165 against 64 to 512)
        for config in [(8, 64, 2), (64, 128, 8), (4, 512, 4)]:
            kq.FP4_DECODE_CONFIG = config
            assert torch.equal(kq.decode_fp4_weights(codes, scales), ref), config
    finally:
        kq.FP4_DECODE_CONFIG = default


def test_fp8_linear_without_rows_and_with_bad_input():
    gen = torch.Generator(device="cuda").manual_seed(0)
    wq, ws = fp8_weight(64, 96, gen)
    assert kq.fp8_linear(torch.zeros(0, 96, device="cuda").bfloat16(), wq, ws).shape == (0, 64)
    with pytest.raises(ValueError, match="expected the ceil grid|expected"):
        kq.fp8_linear(torch.zeros(4, 96, device="cuda").bfloat16(), wq, ws[:, :2])


COUNTS = [0, 37, 128, 0, 5, 200, 1, 0]  # ragged, empty experts included (first and last)


@pytest.mark.parametrize(
    "n,k,config",
    [
        (96, 160, None),  # K/32 = 5: not a multiple of 128
        (96, 160, (64, 64, 2, 4, 3, 1, 1)),
        (96, 160, FP8_MMA),
        (96, 160, (64, 64, 1, 4, 3, 1, 0)),
        (128, 256, None),  # tiles inside N and K: the unmasked weight loads
        (128, 256, (64, 64, 2, 4, 3, 1, 0)),
        (96, 160, SWAP_MMA),
        (128, 256, SWAP_MMA),
        (96, 160, (0, 32, 2, 4, 2, 1, 3)),  # FMAs (decode): one row per tile, ragged K
        (128, 256, (8, 64, 4, 4, 2, 1, 3)),  # FMAs: 8-row tiles, unmasked weight loads
        pytest.param(96, 160, (0, 32, 2, 4, 2, 1, 4), id="gemv"),  # GEMV (decode): one row per tile, ragged K and N
        pytest.param(128, 256, (8, 64, 4, 4, 2, 1, 4), id="gemv"),  # GEMV: 8-row tiles, unmasked weight loads
        pytest.param(128, 256, (2, 16, 8, 4, 2, 1, 4), id="gemv"),  # GEMV: 2-row tiles, 8 blocks per step
    ],
)
def test_fp4_grouped_gemm_against_fp64(n, k, config):
    gen = torch.Generator(device="cuda").manual_seed(1)
    codes, scales = fp4_experts(len(COUNTS), n, k, gen)
    x = torch.randn(sum(COUNTS), k, device="cuda", generator=gen).bfloat16()
    a, a_scale = kq.act_quant_fp8(x)
    counts = torch.tensor(COUNTS, device="cuda")
    out32 = kq.fp4_grouped_gemm(a, a_scale, codes, scales, counts, out_dtype=torch.float32, config=config)
    out = kq.fp4_grouped_gemm(a, a_scale, codes, scales, counts, config=config)
    rows = deq_act(a, a_scale)
    ref = torch.cat([r @ decode_fp4_packed(codes[e], scales[e]).double().T
                     for e, r in enumerate(rows.split(COUNTS))])
    err32, err16 = rel_err(out32, ref), rel_err(out, ref)
    print(f"fp4_grouped_gemm {n}x{k} {config}: fp32 out {err32:.2e}, bf16 out {err16:.2e}")
    gate("fp32_out_vs_fp64", err32, fp32_floor(config, "grouped", kq.rows_per_expert(sum(COUNTS), len(COUNTS))))
    assert err16 < BF16_ROUNDING
    assert torch.equal(kq.fp4_grouped_gemm(a, a_scale, codes, scales.float(), counts, out_dtype=torch.float32,
                                           config=config), out32)


def hopper():
    return kq.hopper_usable(torch.empty(0, device="cuda"))


@pytest.mark.parametrize("tm", [64, 128, 256])
@pytest.mark.parametrize("n,k,counts", [(200, 320, [257, 0, 64, 1]), (2304, 5120, [129, 0, 63, 300])])
def test_fp4_grouped_gemm_wgmma_against_fp64(n, k, counts, tm):
    if not hopper():
        pytest.skip("the wgmma FP4 kernel needs an sm_90 GPU and nvcc")
    from deepseek_v41 import kernels_fp4_wgmma as kw

    gen = torch.Generator(device="cuda").manual_seed(n + tm)
    codes, scales = fp4_experts(len(counts), n, k, gen)
    x = torch.randn(sum(counts) + 3, k, device="cuda", generator=gen).bfloat16()  # 3 rows past the groups'
    xq, _ = kq._act_quant_t(x, qdq=True)
    xp, _ = kq._act_quant_t(x, qdq=True, permute=True)
    assert torch.equal(xp, kw.permute_k64(xq))
    c = torch.tensor(counts, device="cuda")
    u8 = codes.view(torch.uint8), scales.view(torch.uint8)
    out32 = kw.fp4_grouped_gemm_wgmma(xp, *u8, c, tm, torch.float32)[: sum(counts)]
    out = kw.fp4_grouped_gemm_wgmma(xp, *u8, c, tm)[: sum(counts)]
    ref = torch.cat([r @ decode_fp4_packed(codes[e], scales[e]).double().T
                     for e, r in enumerate(xq[: sum(counts)].double().split(counts))])
    err32, err16 = rel_err(out32, ref), rel_err(out, ref)
    print(f"fp4_grouped_gemm_wgmma {n}x{k} TM={tm}: fp32 out {err32:.2e}, bf16 out {err16:.2e}")
    gate("fp32_out_vs_fp64", err32, FP32_FLOOR["exact_products"])
    assert err16 < BF16_ROUNDING


def reference_experts(x, counts, weights, w1, w3, w2, limit):
    # the official Expert.forward per expert on the decoded weights: FP8 activations, gate/up rounded to bf16,
    # the model's weighted_swiglu (fp32, one rounding), FP8 again, w2; fp64 matmuls
    out, start = [], 0
    for e, c in enumerate(counts):
        codes, scales = kq.act_quant_reference(x[start : start + c])
        rows = deq_act(codes, scales)
        gate = (rows @ decode_fp4_packed(*w1[e]).double().T).bfloat16()
        up = (rows @ decode_fp4_packed(*w3[e]).double().T).bfloat16()
        h = weighted_swiglu(gate, up, weights[start : start + c], limit)
        codes, scales = kq.act_quant_reference(h)
        out.append(deq_act(codes, scales) @ decode_fp4_packed(*w2[e]).double().T)
        start += c
    return torch.cat(out)


@pytest.mark.parametrize(
    "counts,dim,inter,limit,configs",
    [
        (COUNTS, 256, 160, 1.0, (None, None)),
        (COUNTS, 256, 160, 1.0, ((128, 64, 1, 8, 3, 1, 0), FP8_MMA)),
        (COUNTS, 256, 160, 1.0, ((128, 64, 2, 4, 3, 1, 2), SWAP_MMA)),
        ([150, 0, 300, 77], 5120, 2304, 10.0, ((128, 128, 2, 8, 3, 1, 2), SWAP_MMA)),
        ([150, 0, 300, 77], 5120, 2304, 10.0, (None, None)),  # released shapes
        ([0, 1, 0, 1, 1, 0, 0, 1], 5120, 2304, 10.0, (None, None)),  # decode: one row per expert
        ([0, 1, 0, 1, 1, 0, 0, 1], 5120, 2304, 10.0, ((0, 32, 8, 4, 2, 1, 3), (0, 32, 8, 4, 2, 1, 3))),  # FMAs
        (COUNTS, 256, 160, 1.0, ((8, 32, 2, 4, 2, 1, 3), (4, 64, 2, 4, 2, 1, 3))),
        pytest.param([0, 1, 0, 1, 1, 0, 0, 1], 5120, 2304, 10.0, ((0, 16, 8, 4, 2, 1, 4), (0, 32, 8, 4, 2, 1, 4)), id="gemv"),  # GEMV
        (COUNTS, 256, 160, 1.0, ((8, 32, 2, 4, 2, 1, 4), (4, 64, 2, 4, 2, 1, 4))),
        # prefill (>= DECODED_EXPERT_ROWS rows per expert): experts decoded to bf16 in chunks, torch._grouped_mm
        ([600, 0, 900, 300, 0, 500, 1, 300], 256, 160, 1.0, (None, None)),
        # the CUDA wgmma kernel (WGMMA_EXPERT_ROWS), released shapes and small ones, one to 900 rows per expert
        pytest.param([150, 0, 300, 77], 5120, 2304, 10.0, "wgmma", id="wgmma"),
        pytest.param([600, 0, 900, 300, 0, 500, 1, 300], 256, 192, 1.0, "wgmma", id="wgmma"),
        pytest.param([0, 1, 0, 1, 1, 0, 0, 1], 5120, 2304, 10.0, "wgmma", id="wgmma"),
    ],
)
def test_fp4_grouped_experts(counts, dim, inter, limit, configs, monkeypatch):
    if kq.rows_per_expert(sum(counts), len(counts)) >= kq.DECODED_EXPERT_ROWS:
        monkeypatch.setattr(kq, "EXPERT_SCRATCH_BYTES", 3 * 2 * 3 * dim * inter)  # chunks of 3 experts
    wgmma = configs == "wgmma"
    if not wgmma:  # the Triton and decoded paths, which the wgmma kernel takes over on Hopper by default
        monkeypatch.setattr(kq, "WGMMA_EXPERT_ROWS", None)
    else:
        if not hopper():
            pytest.skip("the wgmma FP4 kernel needs an sm_90 GPU and nvcc")
        from deepseek_v41 import kernels_fp4_wgmma as kw

        calls = []
        monkeypatch.setattr(kq, "WGMMA_EXPERT_ROWS", (1, 1 << 30))
        monkeypatch.setattr(kw, "fp4_grouped_gemm_wgmma",
                            lambda *a, _f=kw.fp4_grouped_gemm_wgmma, **kws: calls.append(1) or _f(*a, **kws))
        configs = (None, None)
    gen = torch.Generator(device="cuda").manual_seed(dim)
    E = len(counts)
    w1, w3, w2 = fp4_experts(E, inter, dim, gen), fp4_experts(E, inter, dim, gen), fp4_experts(E, dim, inter, gen)
    x = torch.randn(sum(counts), dim, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(sum(counts), device="cuda", generator=gen)
    out = kq.fp4_grouped_experts(x, torch.tensor(counts, device="cuda"), weights, *w1, *w3, *w2, limit,
                                 configs=configs)

    def per(w):
        return [(w[0][e], w[1][e]) for e in range(E)]

    if wgmma:
        assert len(calls) == 3  # gate, up, down through the wgmma kernel
    ref = reference_experts(x, counts, weights, per(w1), per(w3), per(w2), limit)
    err = rel_err(out, ref)
    # the same FP8 path in another summation order: gate/up bf16 roundings and then h's FP8 codes can flip
    print(f"fp4_grouped_experts E={E} {dim}->{inter}: vs reference {err:.2e}")
    assert out.dtype == torch.bfloat16 and out.shape == (sum(counts), dim)
    assert err < 4 * BF16_ROUNDING
    # end to end against the model's bf16 grouped experts on the decoded weights
    config = SimpleNamespace(n_routed_experts=E, hidden_size=dim, moe_intermediate_size=inter, swiglu_limit=limit)
    model = RoutedExperts(config, {"experts": "torch_mm"}).cuda()
    with torch.no_grad():
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            getattr(model, name).copy_(torch.stack([decode_fp4_packed(w[0][e], w[1][e]) for e in range(E)]))
        bf16 = model.bfloat16().grouped_forward(x, torch.tensor(counts, device="cuda"), weights)
    quant_err = rel_err(ref, bf16)
    print(f"  vs bf16 experts {rel_err(out, bf16):.3e}; the FP8 reference vs bf16 {quant_err:.3e}")
    assert rel_err(out, bf16) < quant_err + 4 * BF16_ROUNDING


@pytest.mark.parametrize("m,k,limit", [(333, 320, 1.0), (1, 2304, 10.0), (130, 2304, 0.0)])
def test_act_quant_with_the_swiglu_is_the_two_passes(m, k, limit):
    # the fused pass (the wgmma experts' w2 input) against weighted_swiglu_triton then the quantizer, bit for bit,
    # and against the eager SwiGLU + the reference quantizer (sigmoid's fp32 ulps may move a bf16 rounding of h)
    from deepseek_v41.kernels_fp4_wgmma import permute_k64
    from deepseek_v41.kernels_triton import weighted_swiglu_triton

    gen = torch.Generator(device="cuda").manual_seed(m + k)
    g, up = ((torch.randn(m, k, device="cuda", generator=gen) * 4).bfloat16() for _ in range(2))
    weights = torch.rand(m, device="cuda", generator=gen)
    fused, _ = kq._act_quant_t(g, qdq=True, permute=True, swiglu=(up, weights, limit))
    two_pass, _ = kq._act_quant_t(weighted_swiglu_triton(g, up, weights, limit), qdq=True, permute=True)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, two_pass)
    eager = permute_k64(deq_act(*kq.act_quant_reference(weighted_swiglu(g, up, weights, limit).cpu())).cuda())
    # sigmoid's fp32 ulps move a rare bf16 rounding of h (then its FP8 code): measured 0 / 0 / 1.07e-6 (H100,
    # 2026-12-07); gate ~5x
    gate(f"swiglu act quant m={m} k={k} limit={limit} vs eager", rel_err(fused, eager), 5e-6)


def test_experts_quantized_before_the_top_k_copy(monkeypatch):
    # KeptFp4Experts on the wgmma route quantizes the n tokens, then copies them to their experts: the same output,
    # bit for bit, as the rows copied first and quantized after (RoutedExperts.forward -> grouped_forward)
    if not hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU and nvcc")
    from deepseek_v41.kept import KeptFp4Experts

    n, k, experts, dim, inter = 97, 6, 16, 256, 192
    gen = torch.Generator(device="cuda").manual_seed(7)
    config = SimpleNamespace(n_routed_experts=experts, hidden_size=dim, moe_intermediate_size=inter, swiglu_limit=10.0)
    module = KeptFp4Experts(config, {"experts": "torch_mm"}).cuda()
    for name, (rows, cols) in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
        codes, scales = fp4_experts(experts, rows, cols, gen)
        getattr(module, name).copy_(codes)
        getattr(module, f"{name}_scale").copy_(scales)
    module.eval()
    x = torch.randn(n, dim, device="cuda", generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, device="cuda", generator=gen)
    quantized = []
    original = kq.quantize_for_wgmma
    monkeypatch.setattr(kq, "quantize_for_wgmma", lambda t: quantized.append(t.shape[0]) or original(t))
    with torch.no_grad():
        out = module(x, ids, weights)
        copied_first = RoutedExperts.forward(module, x, ids, weights)
    assert kq.fp4_experts_on_wgmma(x, n * k, module.w1, module.w1_scale, module.w2_scale) and quantized == [n]
    assert out.dtype == copied_first.dtype and torch.equal(out, copied_first)
    with pytest.raises(ValueError, match="wgmma route only"):
        monkeypatch.setattr(kq, "WGMMA_EXPERT_ROWS", None)
        monkeypatch.setattr(kq, "WGMMA_SINGLE_ROWS", 1 << 30)
        kq.fp4_grouped_experts(x, torch.tensor([n] + [0] * (experts - 1), device="cuda"), weights[:, 0],
                               module.w1, module.w1_scale, module.w3, module.w3_scale, module.w2, module.w2_scale,
                               10.0, x_quantized=True)


def test_fp4_grouped_experts_without_rows():
    gen = torch.Generator(device="cuda").manual_seed(2)
    w1, w3, w2 = fp4_experts(2, 64, 32, gen), fp4_experts(2, 64, 32, gen), fp4_experts(2, 32, 64, gen)
    x = torch.zeros(0, 32, device="cuda").bfloat16()
    out = kq.fp4_grouped_experts(x, torch.zeros(2, dtype=torch.long, device="cuda"), torch.zeros(0, device="cuda"),
                                 *w1, *w3, *w2, 10.0)
    assert out.shape == (0, 32)
