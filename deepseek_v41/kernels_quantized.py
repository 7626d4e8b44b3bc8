"""GEMMs on the released quantized formats (Hopper, Triton): FP8 block-scaled linears and FP4 routed experts.

The release stores FP8 E4M3 linear weights with one UE8M0 scale per 32x32 block and the routed experts as packed
E2M1 codes with one UE8M0 scale per 32 inputs (``release_format.py``).  The official inference quantizes every
activation that enters such a GEMM to FP8 E4M3 in groups of 32 along K with power-of-two scales, and then runs
an FP8 x FP8 (or FP8 x FP4) GEMM that accumulates in fp32 and applies ``a_scale * w_scale`` once per 32-wide K
block (architecture.md §4, §6).  These functions do the same on the GPU without ever decoding a whole weight:

* ``act_quant_fp8(x)``: bf16 [M, K] -> (codes float8_e4m3fn [M, K], scales fp32 [M, ceil(K/32)]).  Per row and
  group of 32: ``amax = max(|x|, 1e-4)``, ``s = 2^ceil(log2(amax/448))``, ``q = e4m3_rne(clamp(x/s, ±448))``.
  The scales are powers of two (UE8M0 values held as fp32); the returned scale tensor is a transposed view of
  a [ceil(K/32), M] buffer (the layout the GEMMs read), so use it through indexing, not ``.data_ptr()``.
* ``fp8_linear(x, weight, scale)``: x [..., K] bf16, weight float8_e4m3fn [N, K], scale [ceil(N/32), ceil(K/32)]
  (float8_e8m0fnu or float32) -> bf16 [..., N] = act_quant_fp8 + the block-scaled GEMM (below).
  From ``DECODED_GEMM_ROWS`` rows on (prefill) the weight is decoded to a transient bf16 [N, K] and cuBLAS
  multiplies the quantized activations' bf16 values: the same exact products, at the bf16 GEMM's speed.
* ``fp8_block_diagonal_linear(o, weight, scale)``: attention's ``wo_a``, o bf16 [n, G, d] -> [n, G·r], group g
  through weight rows g·r..(g+1)·r, activations not quantized (the official code multiplies ``wo_a`` in bf16).
* ``decode_fp8_weight(weight, scale)``: FP8 [N, K] + 32x32 block scales -> bf16 [N, K].
* ``fp4_grouped_gemm(a, a_scale, codes, scales, counts)``: FP8 activations [m, K] (rows sorted by group,
  ``counts`` [G] rows each) times packed FP4 weights codes [G, N, K/2] (int8/uint8, low nibble = even k), scales
  [G, N, ceil(K/32)] -> bf16 [m, N].
* ``fp4_grouped_experts(x, counts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, limit)``: the routed
  experts' SwiGLU as ``moe.RoutedExperts.grouped_forward`` computes it, on the stored formats: x bf16 [m, dim]
  sorted by expert, counts int [E], routing weights fp32 [m]; w1/w3 codes [E, inter, dim/2] with scales
  [E, inter, dim/32], w2 codes [E, dim, inter/2] with scales [E, dim, inter/32] -> bf16 [m, dim].  As the
  official ``Expert.forward``: x -> FP8 (groups of 32), gate and up rounded to bf16, fp32 clamped SwiGLU times
  the routing weight, rounded to bf16, -> FP8 again, -> w2.  Gate and up come out of one kernel (both GEMMs
  share the activation tiles) with the SwiGLU in its epilogue.  On Hopper with nvcc, for 2 to 2,047 rows per expert
  (``WGMMA_EXPERT_ROWS``; one row per expert from ``WGMMA_SINGLE_ROWS`` rows routed), the three GEMMs run on the CUDA
  kernel of ``kernels_fp4_wgmma.py`` instead (codes decoded in registers into wgmma's register operand), the SwiGLU
  between them in w2's activation-quantization pass; ``KeptFp4Experts`` then quantizes its tokens before their top-k
  copy (``quantize_for_wgmma``, ``x_quantized=True``).

``quantized_gemm_usable(x)`` says whether these kernels can run for ``x`` (CUDA, Triton, FP8 tensor cores: compute
capability 8.9 or newer).  Elsewhere the callers (``kept.py``) decode one weight tile at a time instead.

How the 32-wide K blocks are honoured (``MMA`` in a kernel configuration picks the way):

* FP8 MMA: an FP8 tensor-core MMA on Hopper consumes K=32 per instruction, so each 32-block's partial product comes
  out of its own ``tl.dot`` and is promoted into the fp32 accumulator with the product of its two power-of-two
  scales: one FFMA per output element per 32 inputs, as many CUDA-core cycles as the tensor core spends on the
  block.  With the loop's other work the issue slots bound it, not the tensor core (ptxas, 128x128 tile: 153
  instructions per thread per 32-block, ~2.4x the MMA's cycles).  A hand-written CUDA kernel of this scheme (wgmma,
  TMA, warp-specialized: examples/benchmarks/variants/fp8_wgmma_kernel.py) reached 0.50-0.67x our bf16 GEMM at
  prefill on an H100, 1.09-1.14x with the promotion left out: the promotion, not the compiler, bounds it.
* bf16 MMA: every operand value is a short code times a power of two, exact in bf16 (E4M3 and E2M1
  have 3 and 1 mantissa bits).  The activations are quantized to FP8 exactly as above and stored as their bf16
  values; the weight tiles are decoded to bf16 in registers (code times scale, one multiply per weight element per
  row tile); one bf16 MMA chain accumulates in fp32 over all of K.  The products are the same exact numbers as the
  FP8 MMA's; only the fp32 summation order differs, and no promotion step stalls the tensor core.  MMA 2 (the
  default for more than 64 rows) multiplies the transposed tile, the decoded weight tile on the left: Hopper's
  wgmma takes its left operand from registers, so the decoded tile skips the trip through shared memory.
  Measured (quantized_gemm.py, H100 and H200): 0.3-0.5x our bf16 GEMMs at prefill for both formats, activation
  quantization included: Triton's path for a register-decoded operand, not the bytes, bounds them there.
* No MMA (MMA 3, up to ``GEMV_ROWS`` rows per tile): the decoded weight tile times the rows with fp32 FMAs on the
  CUDA cores.  An option for decode, not a default: slower than the bf16 MMA configurations as measured so far.
* GEMV (MMA 4, ``_gemv_kernel``, up to ``GEMV_ROWS`` rows per tile): fp32 FMAs as well, in a kernel shaped for a
  step bound by weight bytes: wide [BLOCK_N, SUB·32] weight steps in their stored bytes, FP4 low and high nibbles
  multiplied by the even and odd activations (no interleave of the decoded values), each 32-block summed and then
  scaled once, the row tile's rows reusing one decoded weight tile.

Both read the weights in their stored bytes (half or a quarter of bf16), which is what decode is bound by.
"""

from __future__ import annotations

import functools

import torch

from .cuda_module import hopper_usable
from .release_format import ceil_div

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds come without Triton
    triton = None

GROUP = 32  # quantization group along K, for activations and weights alike
FP8_MAX = 448.0


def quantized_gemm_usable(x: torch.Tensor) -> bool:
    """True where the Triton FP8/FP4 kernels run: x on a CUDA device with FP8 tensor cores (sm_89+) and Triton."""
    return triton is not None and x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def act_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager ``act_quant_fp8`` (any device): x [M, K] -> (codes float8_e4m3fn [M, K], scales fp32 [M, ceil(K/32)]).

    The scale's power-of-two ceiling is read off the fp32 bits of ``amax * fp32(1/448)`` (exponent, plus one
    when the mantissa is non-zero), as the official kernel computes it; a ragged last group is scaled by the
    columns it has."""
    m, k = x.shape
    groups = ceil_div(k, GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * GROUP - k)).view(m, groups, GROUP)
    amax = padded.abs().amax(-1).clamp_min(1e-4)
    bits = (amax * torch.tensor(1.0 / FP8_MAX)).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = ((exponent + 127) << 23).view(torch.float32)
    inverse = ((127 - exponent) << 23).view(torch.float32)  # exact 2^-e: x/s without a division
    codes = (padded * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, groups * GROUP)[:, :k], scale


if triton is not None:

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, up_ptr, w_ptr, limit, BLOCK_M: tl.constexpr,
                          GROUPS: tl.constexpr, QDQ: tl.constexpr, PERMUTE: tl.constexpr = False,
                          SWIGLU: tl.constexpr = 0):
        # x [M, K] -> q fp8 [M, K] and s fp32 [ceil(K/32), M] (scale-major: the GEMMs read a row tile per K block);
        # QDQ: q is the quantized values themselves in bf16 (code times scale: exact), no s; PERMUTE: q's columns in
        # the wgmma FP4 kernel's order, input 16t + 4s + 2h + l of each 64 at column 16s + 8h + 2t + l.
        # SWIGLU (1, 2: with the clamps): x is the gate and the quantized input weighted_swiglu_triton's output,
        # silu(min(gate, limit)) * clamp(up, +-limit) * w[row] rounded to bf16, computed here (one pass, no h)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * GROUPS * 32 + tl.arange(0, GROUPS * 32)
        live = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=live, other=0.0)
        if SWIGLU:
            g = x.to(tl.float32)
            u = tl.load(up_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=live,
                        other=0.0).to(tl.float32)
            if SWIGLU == 2:
                u = tl.minimum(tl.maximum(u, -limit), limit)
                g = tl.minimum(g, limit)
            w = tl.load(w_ptr + rows, mask=rows < M, other=0.0)
            x = (g * tl.sigmoid(g) * u * w[:, None]).to(tl.bfloat16)
        x = tl.reshape(x.to(tl.float32), (BLOCK_M, GROUPS, 32))
        amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4)
        bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
        q = tl.clamp(x * inverse[:, :, None], -448.0, 448.0).to(tl.float8e4nv)
        if QDQ:
            q = (q.to(tl.float32) * scale[:, :, None]).to(tl.bfloat16)
        if PERMUTE:  # [rows, chunk of 64, t, s, h, l] -> [rows, chunk, s, h, t, l], in registers: contiguous stores
            q = tl.permute(tl.reshape(q, (BLOCK_M, GROUPS // 2, 4, 4, 2, 2)), (0, 1, 3, 4, 2, 5))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], tl.reshape(q, (BLOCK_M, GROUPS * 32)),
                 mask=live)
        if not QDQ:
            groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
            tl.store(s_ptr + groups[None, :].to(tl.int64) * M + rows[:, None], scale,
                     mask=(rows[:, None] < M) & (groups[None, :] * 32 < K))

    @triton.jit
    def _e8m0_to_f32(e):
        # UE8M0 byte -> 2^(e-127); byte 0 is the subnormal 2^-127
        e = e.to(tl.int32)
        return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_to_e4m3(nib):
        # 4-bit E2M1 code (int32, sign in bit 3) -> the E4M3 byte of the same value: magnitudes 0 and 0.5 are
        # special (0x00, 0x30); from 1.0 on the 2-bit exponent and 1-bit mantissa shift into place, bias +6
        mag = nib & 7
        byte = tl.where(mag >= 2, (mag << 2) + 48, mag * 48) | ((nib & 8) << 4)
        return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _e2m1_to_f32_scaled(nib):
        # 4-bit E2M1 code -> its value times 2^-126 in fp32: the code's 2 exponent and 1 mantissa bits land on the
        # fp32 exponent/mantissa boundary (bias 127 instead of 1), so code 1 (0.5) becomes the subnormal 2^-127 and
        # 0 stays 0; one exact multiply by 2^126 restores the value (fp32 multiplies keep subnormals)
        return (((nib & 7) << 22) | ((nib & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _b_block(b_ptr, bs_ptr, offs_n, n_live, kb, K, stride_bn, stride_bsn, B_FP4: tl.constexpr,
                 BS_E8M0: tl.constexpr, BS_ROWS: tl.constexpr, MMA_BF16: tl.constexpr, EVEN: tl.constexpr):
        # one 32-wide K block of the weight tile [BN, 32] and its scale per output column [BN]: FP8 codes for the
        # FP8 MMA (the scale applied to its partial product), or the decoded values times the scale in bf16 (exact:
        # a code times a power of two) for the bf16 MMA.  EVEN: the tile lies inside N and K (no masks)
        k32 = tl.arange(0, 32)
        s_ptrs = bs_ptr + (offs_n // BS_ROWS) * stride_bsn + kb
        s = tl.load(s_ptrs) if EVEN else tl.load(s_ptrs, mask=n_live & (kb * 32 < K), other=0)
        if BS_E8M0:
            s = _e8m0_to_f32(s)
        if B_FP4:
            k16 = tl.arange(0, 16)
            b_ptrs = b_ptr + offs_n[:, None] * stride_bn + kb * 16 + k16[None, :]
            if EVEN:
                packed = tl.load(b_ptrs).to(tl.int32)
            else:
                packed = tl.load(b_ptrs, mask=n_live[:, None] & (kb * 32 + 2 * k16[None, :] < K), other=0).to(tl.int32)
            # low nibble is element 2i, high nibble element 2i+1
            if MMA_BF16:
                lo, hi = _e2m1_to_f32_scaled(packed), _e2m1_to_f32_scaled(packed >> 4)
            else:
                lo, hi = _e2m1_to_e4m3(packed & 15), _e2m1_to_e4m3(packed >> 4)
            b = tl.reshape(tl.join(lo, hi), (offs_n.shape[0], 32))
            if MMA_BF16:
                b = b * 8.507059173023462e37  # 2^126
        else:
            b_ptrs = b_ptr + offs_n[:, None] * stride_bn + kb * 32 + k32[None, :]
            if EVEN:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=n_live[:, None] & (kb * 32 + k32[None, :] < K), other=0.0)
        if MMA_BF16:
            b = (b.to(tl.float32) * s[:, None]).to(tl.bfloat16)
        return b, s

    @triton.jit
    def _swiglu_epilogue(gate, up, w_ptr, offs_m, m_live, limit):
        # [rows, N] fp32 sums of the gate and up projections -> the experts' clamped SwiGLU times each row's routing
        # weight, as kernels_triton.weighted_swiglu_triton: gate and up rounded to bf16 first (limit <= 0: no clamps)
        gate = gate.to(tl.bfloat16).to(tl.float32)
        up = up.to(tl.bfloat16).to(tl.float32)
        if limit > 0:
            up = tl.clamp(up, -limit, limit)
            gate = tl.minimum(gate, limit)
        w = tl.load(w_ptr + offs_m, mask=m_live, other=0.0)
        return gate * tl.sigmoid(gate) * up * w[:, None]

    @triton.jit
    def _tile(pid, M, N, n_groups, tile_start_ptr, row_start_ptr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # program id -> (group, first row, rows end, first column); grouped: tiles never straddle two groups,
        # tile_start [G+1] = first row tile of each group (cumulative), found by binary search
        tiles_n = tl.cdiv(N, BLOCK_N)
        if GROUPED:
            pid_m = pid // tiles_n
            pid_n = pid % tiles_n
            lo = pid_m * 0
            hi = pid_m * 0 + n_groups - 1
            for _ in tl.static_range(10):  # 2^10 >= any expert count (checked by the caller)
                mid = (lo + hi + 1) // 2
                go = tl.load(tile_start_ptr + mid) <= pid_m
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid - 1)
            g = lo
            row0 = tl.load(row_start_ptr + g)
            m0 = row0 + (pid_m - tl.load(tile_start_ptr + g)) * BLOCK_M
            m_end = tl.load(row_start_ptr + g + 1)
        else:
            # grouped ordering over M (L2 reuse of the weight tiles)
            tiles_m = tl.cdiv(M, BLOCK_M)
            width = GROUP_M * tiles_n
            first = (pid // width) * GROUP_M
            size = tl.minimum(tiles_m - first, GROUP_M)
            pid_m = first + (pid % width) % size
            pid_n = (pid % width) // size
            g = pid * 0
            m0 = pid_m * BLOCK_M
            m_end = M
        return g, m0, m_end, pid_n * BLOCK_N

    @triton.jit
    def _scaled_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, b2_ptr, bs2_ptr, c_ptr, w_ptr, tile_start_ptr,
                            row_start_ptr, M, N, K, n_groups, stride_bg, stride_bn, stride_bsg, stride_bsn, limit,
                            B_FP4: tl.constexpr, BS_E8M0: tl.constexpr, BS_ROWS: tl.constexpr,
                            GROUPED: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr, MMA: tl.constexpr,
                            EVEN: tl.constexpr, GROUP_M: tl.constexpr):
        """C = sum over 32-wide K blocks kb of (A_kb @ B_kb^T) * a_s[kb, m] * b_s[n // BS_ROWS, kb], in fp32.

        a fp8 [M, K], as fp32 [ceil(K/32), M]; b fp8 [N, K] (or FP4 bytes [G, N, K/2]) with scales bs
        [ceil(N/BS_ROWS), ceil(K/32)] (or [G, N, ceil(K/32)]), E8M0 bytes or fp32.  SWIGLU: b2/bs2 are the up
        projection, C = bf16(silu(min(gate, limit)) * clamp(up, ±limit) * w[m]) with gate/up rounded to bf16
        first (limit <= 0: no clamps).  SPLIT_K > 1: program axis 1 takes one slice of the K blocks and writes
        its fp32 partial sum to c[slice] ([SPLIT_K, M, N], summed by the caller: deterministic, no atomics).
        MMA 0: the FP8 MMA with a promotion per 32-block.  MMA 1 or 2 (bf16 MMA): a holds the quantized
        activations' values in bf16 (no ``as``), the weight tiles are decoded to bf16 in registers and one bf16 MMA
        chain accumulates over all of K (the same products, exact in both); MMA 2 computes the transposed tile,
        weight tile [BLOCK_N, 32] x activations^T [32, BLOCK_M], so the decoded weights are the MMA's left operand,
        which Hopper's wgmma reads from registers (no store of the decoded tile to shared memory and no fence before
        each MMA), and a few rows (decode) fill the MMA's narrow side.  MMA 3 (a few rows, BLOCK_M <= 8): no MMA,
        the same products summed with fp32 FMAs on the CUDA cores; a decode step is bound by the weight bytes.
        EVEN: K is a multiple of 32 * SUB and N of BLOCK_N, so only the rows need masks."""
        g, m0, m_end, n0 = _tile(tl.program_id(0), M, N, n_groups, tile_start_ptr, row_start_ptr, GROUPED,
                                 BLOCK_M, BLOCK_N, GROUP_M)
        if m0 < m_end:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            m_live = offs_m < m_end
            n_live = offs_n < N
            k32 = tl.arange(0, 32)
            a_rows = a_ptr + offs_m[:, None].to(tl.int64) * K
            b_base = b_ptr + g.to(tl.int64) * stride_bg
            bs_base = bs_ptr + g.to(tl.int64) * stride_bsg
            if MMA == 2:  # the transposed tile [BLOCK_N, BLOCK_M], transposed back after the K loop
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if SWIGLU:
                b2_base = b2_ptr + g.to(tl.int64) * stride_bg
                bs2_base = bs2_ptr + g.to(tl.int64) * stride_bsg
                acc2 = tl.zeros_like(acc)
            n_blocks = (K + 31) // 32
            # this program's K blocks: all of them, or one of SPLIT_K slices of whole SUB-block steps
            per_split = tl.cdiv(tl.cdiv(n_blocks, SPLIT_K), SUB) * SUB
            kb_start = tl.program_id(1) * per_split
            kb_end = tl.minimum(kb_start + per_split, n_blocks)
            # SUB 32-blocks per iteration (fewer, larger pipelined steps); blocks past the end load zeros
            for kb0 in range(kb_start, kb_end, SUB):
                for j in tl.static_range(SUB):
                    kb = kb0 + j
                    if EVEN:
                        a_mask = m_live[:, None]
                    else:
                        a_mask = m_live[:, None] & (kb < kb_end) & (kb * 32 + k32[None, :] < K)
                    a = tl.load(a_rows + kb * 32 + k32[None, :], mask=a_mask, other=0.0)
                    b, sb = _b_block(b_base, bs_base, offs_n, n_live, kb, K, stride_bn, stride_bsn, B_FP4,
                                     BS_E8M0, BS_ROWS, MMA >= 1, EVEN)
                    if MMA == 3:  # a few rows: FMAs on the CUDA cores, the weight bytes bound it
                        acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
                    elif MMA == 2:
                        acc = tl.dot(b, tl.trans(a), acc)
                    elif MMA >= 1:
                        acc = tl.dot(a, tl.trans(b), acc)
                    else:
                        sa = tl.load(as_ptr + kb.to(tl.int64) * M + offs_m, mask=m_live & (kb < kb_end), other=0.0)
                        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
                    if SWIGLU:
                        b2, sb2 = _b_block(b2_base, bs2_base, offs_n, n_live, kb, K, stride_bn, stride_bsn, B_FP4,
                                           BS_E8M0, BS_ROWS, MMA >= 1, EVEN)
                        if MMA == 3:
                            acc2 += tl.sum(a.to(tl.float32)[:, None, :] * b2.to(tl.float32)[None, :, :], axis=2)
                        elif MMA == 2:
                            acc2 = tl.dot(b2, tl.trans(a), acc2)
                        elif MMA >= 1:
                            acc2 = tl.dot(a, tl.trans(b2), acc2)
                        else:
                            acc2 += tl.dot(a, tl.trans(b2)) * (sa[:, None] * sb2[None, :])
            if MMA == 2:
                acc = tl.trans(acc)
                if SWIGLU:
                    acc2 = tl.trans(acc2)
            if SWIGLU:
                acc = _swiglu_epilogue(acc, acc2, w_ptr, offs_m, m_live, limit)
            c_ptr += tl.program_id(1).to(tl.int64) * M * N
            tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=m_live[:, None] & n_live[None, :])


    @triton.jit
    def _gemv_weight(b_base, bs_base, offs_n, n_live, kb, kb_live, K, stride_bn, stride_bsn, B_FP4: tl.constexpr,
                     BS_E8M0: tl.constexpr, BS_ROWS: tl.constexpr, EVEN: tl.constexpr):
        # the weight tile of SUB 32-blocks kb in fp32: FP8 -> [BN, SUB, 32]; FP4 -> the even and odd inputs'
        # values [BN, SUB, 16] each (low / high nibbles, never interleaved), and the block scales [BN, SUB]
        if B_FP4:
            k16 = tl.arange(0, 16)
            ptrs = b_base + offs_n[:, None, None] * stride_bn + kb[None, :, None] * 16 + k16[None, None, :]
            if EVEN:
                packed = tl.load(ptrs).to(tl.int32)
            else:
                live = (n_live[:, None, None] & kb_live[None, :, None]
                        & (kb[None, :, None] * 32 + 2 * k16[None, None, :] < K))
                packed = tl.load(ptrs, mask=live, other=0).to(tl.int32)
            lo = _e2m1_to_f32_scaled(packed) * 8.507059173023462e37  # 2^126
            hi = _e2m1_to_f32_scaled(packed >> 4) * 8.507059173023462e37
        else:
            k32 = tl.arange(0, 32)
            ptrs = b_base + offs_n[:, None, None] * stride_bn + kb[None, :, None] * 32 + k32[None, None, :]
            if EVEN:
                lo = tl.load(ptrs).to(tl.float32)
            else:
                live = n_live[:, None, None] & kb_live[None, :, None] & (kb[None, :, None] * 32 + k32[None, None, :] < K)
                lo = tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
            hi = lo  # unused
        s = tl.load(bs_base + kb[None, :] + (offs_n[:, None] // BS_ROWS) * stride_bsn,
                    mask=n_live[:, None] & kb_live[None, :], other=0)
        if BS_E8M0:
            s = _e8m0_to_f32(s)
        return lo, hi, s

    @triton.jit
    def _gemv_row(a_row, lo, hi, s, kb, kb_live, K, B_FP4: tl.constexpr):
        # one activation row (bf16 values from a_row) times the decoded tile -> [BN] fp32: each 32-block's products
        # summed, scaled once by its power of two (exact), then summed over the blocks
        k32 = tl.arange(0, 32)
        live = kb_live[:, None] & (kb[:, None] * 32 + k32[None, :] < K)
        a = tl.load(a_row + kb[:, None] * 32 + k32[None, :], mask=live, other=0.0).to(tl.float32)  # [SUB, 32]
        if B_FP4:
            a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], 16, 2)))
            sums = tl.sum(lo * a_even[None, :, :] + hi * a_odd[None, :, :], axis=2)
        else:
            sums = tl.sum(lo * a[None, :, :], axis=2)
        return tl.sum(sums * s, axis=1)

    @triton.jit
    def _gemv_kernel(a_ptr, b_ptr, bs_ptr, b2_ptr, bs2_ptr, c_ptr, w_ptr, tile_start_ptr, row_start_ptr, M, N, K,
                     n_groups, stride_bg, stride_bn, stride_bsg, stride_bsn, limit, B_FP4: tl.constexpr,
                     BS_E8M0: tl.constexpr, BS_ROWS: tl.constexpr, GROUPED: tl.constexpr, SWIGLU: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                     EVEN: tl.constexpr):
        """MMA 4: ``_scaled_gemm_kernel``'s result for a few rows per weight (decode) without the tensor cores.
        Each step reads a [BLOCK_N, SUB·32] weight tile in its stored bytes (FP8, or FP4 as [BLOCK_N, SUB, 16]
        bytes whose low and high nibbles meet the even and odd activations: no interleave), multiplies it by each of
        the tile's ROWS activation rows (the quantized values in bf16) with fp32 FMAs, sums each 32-block and
        scales it once.  Plain 2-D/3-D reductions over K (the decoded weight tile is never broadcast across rows;
        only each step's activation row passes through shared memory, under 1 KiB); wide steps keep enough weight
        bytes in flight for a step bound by them."""
        g, m0, m_end, n0 = _tile(tl.program_id(0), M, N, n_groups, tile_start_ptr, row_start_ptr, GROUPED,
                                 ROWS, BLOCK_N, 1)
        if m0 < m_end:
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_live = offs_n < N
            rows = tl.arange(0, ROWS)
            b_base = b_ptr + g.to(tl.int64) * stride_bg
            bs_base = bs_ptr + g.to(tl.int64) * stride_bsg
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            if SWIGLU:
                b2_base = b2_ptr + g.to(tl.int64) * stride_bg
                bs2_base = bs2_ptr + g.to(tl.int64) * stride_bsg
                acc2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            n_blocks = (K + 31) // 32
            per_split = tl.cdiv(tl.cdiv(n_blocks, SPLIT_K), SUB) * SUB
            kb_start = tl.program_id(1) * per_split
            kb_end = tl.minimum(kb_start + per_split, n_blocks)
            for kb0 in range(kb_start, kb_end, SUB):
                kb = kb0 + tl.arange(0, SUB)
                kb_live = kb < kb_end
                lo, hi, s = _gemv_weight(b_base, bs_base, offs_n, n_live, kb, kb_live, K, stride_bn, stride_bsn,
                                         B_FP4, BS_E8M0, BS_ROWS, EVEN)
                if SWIGLU:
                    lo2, hi2, s2 = _gemv_weight(b2_base, bs2_base, offs_n, n_live, kb, kb_live, K, stride_bn,
                                                stride_bsn, B_FP4, BS_E8M0, BS_ROWS, EVEN)
                for j in tl.static_range(ROWS):  # rows past the tile's end read zeros
                    live = kb_live & (m0 + j < m_end)
                    a_row = a_ptr + (m0 + j).to(tl.int64) * K
                    acc += tl.where(rows[:, None] == j, _gemv_row(a_row, lo, hi, s, kb, live, K, B_FP4)[None, :], 0.0)
                    if SWIGLU:
                        part = _gemv_row(a_row, lo2, hi2, s2, kb, live, K, B_FP4)
                        acc2 += tl.where(rows[:, None] == j, part[None, :], 0.0)
            offs_m = m0 + rows
            m_live = offs_m < m_end
            if SWIGLU:
                acc = _swiglu_epilogue(acc, acc2, w_ptr, offs_m, m_live, limit)
            c_ptr += tl.program_id(1).to(tl.int64) * M * N
            tl.store(c_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=m_live[:, None] & n_live[None, :])

    @triton.jit
    def _fp8_decode_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_sn, BS_E8M0: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        # FP8 weight [N, K] with 32x32 block scales -> its values in bf16 (exact: a code times a power of two)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        live = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        index = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        w = tl.load(w_ptr + index, mask=live, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (offs_n[:, None] // 32) * stride_sn + offs_k[None, :] // 32, mask=live, other=0)
        if BS_E8M0:
            s = _e8m0_to_f32(s)
        tl.store(out_ptr + index, (w * s).to(tl.bfloat16), mask=live)


    @triton.jit
    def _fp4_decode_kernel(c_ptr, s_ptr, out_ptr, R, H, stride_sr, BS_E8M0: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_H: tl.constexpr):
        # packed E2M1 rows [R, H] bytes (low nibble = even k) with per-32 scales [R, ceil(2H/32)] -> the bf16 pairs
        # of each byte as one int32 (out [R, 2H] bf16 viewed as int32 [R, H]; the low half is the even k): one
        # load, one scale (a byte's two values share it) and one 4-byte store per byte, no interleaving shuffle
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        live = (rows[:, None] < R) & (cols[None, :] < H)
        rows = rows[:, None].to(tl.int64)
        packed = tl.load(c_ptr + rows * H + cols[None, :], mask=live, other=0).to(tl.int32)
        s = tl.load(s_ptr + rows * stride_sr + cols[None, :] // 16, mask=live, other=0)
        if BS_E8M0:
            s = _e8m0_to_f32(s)
        lo = (_e2m1_to_f32_scaled(packed) * 8.507059173023462e37 * s).to(tl.bfloat16)  # 2^126 restores the value
        hi = (_e2m1_to_f32_scaled(packed >> 4) * 8.507059173023462e37 * s).to(tl.bfloat16)
        pair = (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
        tl.store(out_ptr + rows * H + cols[None, :], pair, mask=live)


# (BLOCK_M, BLOCK_N, SUB, num_warps, num_stages, SPLIT_K, MMA) per workload and rows per weight ("gemv": one row,
# "small" up to 16, "decode" up to 64, "medium" up to 512, then "prefill"); SPLIT_K 0 = as many K slices as fill the
# GPU.  MMA 0: the FP8 MMA with a promotion per 32-block, 1: the bf16 MMA on decoded tiles, 2: the same with the
# decoded weight tile as the left operand, 3: no MMA (fp32 FMAs), 4: the GEMV kernel (fp32 FMAs); for 3 and 4,
# BLOCK_M 0 = the rows per weight rounded up to a power of two, at most GEMV_ROWS.
# Prefill and medium: the fastest of quantized_gemm.py --sweep on an H100 (MMA 2 at 256x128 ahead of MMA 1 by
# 10-15 %, of the FP8 MMA by 15-40 %; examples/benchmarks/results/quantized_gemm_h100.txt).  The rest: the fastest
# of quantized_gemm.py --decode-sweep (H200 and H100, results/quantized_gemm_h*.txt).  "gemv" is the GEMV kernel
# (MMA 4) for dense, wo_a and the experts: at one row per weight it is 1.15-1.6x the best bf16-MMA configuration on
# every released shape (experts, one token: 128 vs 221 us on an H100).  Its fp32 FMAs grow with the rows while the
# MMAs do not, so from two rows on the MMAs take over: at six rows per expert (32 tokens over 32 experts) MMA 2 with
# 16-row tiles is 3x MMA 4 (783 vs 2,297 us) and 1.5x MMA 1 (1,159 us).  Dense at 32 rows: the FP8 MMA (MMA 0) at
# 32x128 is fastest on all seven shapes, 1.02-1.16x MMA 2 at 32x64 (wq_b 29.0 vs 33.6 us, H100): it reads the stored
# codes as the MMA operand, with no decode to bf16 in registers, and promotes its 32x128 partial once per 32-block.
# MMA 3 is not a default: 1.5-3.8x slower than MMA 4 at one row (H200) and, at 32 tokens, 12x the kept proxy's
# GEMM time per step (H100, results/kept_proxy_h100.txt).
CONFIGS = {
    "dense_gemv": (0, 32, 8, 4, 2, 0, 4),
    "grouped_gemv": (0, 32, 8, 4, 2, 1, 4),
    "swiglu_gemv": (0, 32, 8, 4, 2, 1, 4),
    "dense_small": (16, 64, 4, 4, 3, 0, 2),
    "grouped_small": (16, 64, 4, 4, 3, 1, 2),
    "swiglu_small": (16, 32, 4, 4, 3, 1, 2),
    "dense_decode": (32, 128, 2, 4, 4, 0, 0),
    "dense_medium": (128, 128, 2, 8, 3, 1, 2),
    "dense_prefill": (256, 128, 2, 8, 3, 1, 2),
    "grouped_decode": (64, 64, 2, 4, 6, 1, 1),
    "grouped_medium": (128, 128, 2, 8, 3, 1, 2),
    "grouped_prefill": (256, 128, 2, 8, 3, 1, 2),
    "swiglu_decode": (64, 32, 2, 4, 6, 1, 1),
    "swiglu_medium": (128, 64, 2, 4, 3, 1, 2),
    "swiglu_prefill": (128, 64, 2, 4, 3, 1, 2),
}
GEMV_ROWS = 8  # the largest BLOCK_M an MMA 3 or 4 configuration takes
# From this many rows on, fp8_linear and fp8_block_diagonal_linear decode the weight to bf16 (a transient, freed after
# the call) and multiply the (quantized) activations' bf16 values with cuBLAS: the same exact products, summed in fp32,
# at the bf16 GEMM's speed, which the register-decoding Triton kernels reach only 0.3-0.5x of (quantized_gemm.py).
DECODED_GEMM_ROWS = 1024
# The routed experts likewise from this many rows per expert on (prefill): each chunk of experts (at most
# EXPERT_SCRATCH_BYTES of bf16 weights at once) is decoded and multiplied with torch._grouped_mm.  Decoding an
# expert costs about as much as 100-200 rows of its GEMMs; the FP4 kernels run at 0.38x the bf16 grouped GEMM.
DECODED_EXPERT_ROWS = 256
EXPERT_SCRATCH_BYTES = 2 << 30
# Rows per expert in [lo, hi): the routed experts run on the CUDA wgmma kernel (kernels_fp4_wgmma.py: FP4 decoded in
# registers into the bf16 tensor cores) where it can (sm_90, nvcc, UE8M0 scales); None: never.  Measured (fp4_wgmma.py,
# kept_proxy.py, H100): ahead of the other paths from 2 rows per expert (6 rows over 32 experts: 1.43x bf16 vs the
# Triton kernel's 1.39x) to 1,536 (the whole experts block 0.81x bf16 vs 0.70x decoded + torch._grouped_mm); at 64 rows
# per expert (the released model's prefill, 384 experts) the block is 1.66x the bf16 grouped GEMMs.  At one row per
# expert only when at least WGMMA_SINGLE_ROWS rows are routed: with most of 384 experts live (192 rows) it is 1.19x the
# GEMV kernel, with 6 rows over 32 experts (one token) the GEMV's split K is ahead (kept proxy b1 3.89 vs 4.05 ms)
WGMMA_EXPERT_ROWS = (2, 2048)
WGMMA_SINGLE_ROWS = 128
# (BLOCK_R, BLOCK_H packed bytes, num_warps) of the FP4 decode kernel
FP4_DECODE_CONFIG = (16, 256, 4)


def config_tier(rows: int) -> str:
    """The CONFIGS tier for this many rows per weight."""
    if rows <= 1:
        return "gemv"
    return "small" if rows <= 16 else "decode" if rows <= 64 else "medium" if rows <= 512 else "prefill"


def rows_per_expert(m: int, n_experts: int) -> int:
    """Rows per live expert when m routed rows go to n_experts: at most min(n_experts, m) experts get any, so one
    token's top-k rows are one row per expert however many experts there are (the average over all experts, m //
    n_experts, would call 192 rows over 384 experts zero)."""
    return -(-m // max(min(n_experts, m), 1))


def _config(kind: str, rows: int, config):
    if config is None:
        config = CONFIGS[f"{kind}_{config_tier(rows)}"]
    if config[0] == 0:  # BLOCK_M from the rows: 1, 2, 4 or 8
        config = (min(triton.next_power_of_2(max(rows, 1)), GEMV_ROWS), *config[1:])
    return config


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_usable(x: torch.Tensor, what: str) -> None:
    if not quantized_gemm_usable(x):
        raise RuntimeError(
            f"{what} runs Triton FP8 kernels on a CUDA GPU with FP8 tensor cores (compute capability 8.9+); got a "
            f"tensor on {x.device}: decode one weight tile at a time there instead (quantized_gemm_usable(x) says "
            "which path to take)"
        )


def _scale_arg(scale: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    # E8M0 scales go in as their bytes, F32 (older releases) as floats
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.contiguous().view(torch.uint8), True
    if scale.dtype == torch.float32:
        return scale.contiguous(), False
    raise TypeError(f"{name} must be float8_e8m0fnu (UE8M0) or float32, got {scale.dtype}")


def _act_quant_t(x: torch.Tensor, qdq: bool = False, permute: bool = False,
                 swiglu: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # x [M, K] -> (codes fp8 [M, K], scales fp32 [ceil(K/32), M]), the FP8 MMA's layout; qdq: (the quantized values
    # in bf16 [M, K], the same tensor as an unused placeholder), what the bf16 MMA reads; permute (qdq, K a multiple
    # of 64): the columns in the wgmma FP4 kernel's order.  swiglu = (up [M, K], weights fp32 [M], limit): x is the
    # gate, and what is quantized weighted_swiglu_triton(x, up, weights, limit), in the same pass
    if permute and (not qdq or x.shape[1] % 64):
        raise ValueError(f"the permuted layout holds bf16 values (qdq) of K a multiple of 64, got K={x.shape[1]}")
    x = x.contiguous()
    m, k = x.shape
    up, weights, limit = swiglu if swiglu is not None else (x, x, 0.0)
    if swiglu is not None:
        if x.dtype != torch.bfloat16 or up.shape != x.shape or up.dtype != x.dtype or tuple(weights.shape) != (m,):
            raise ValueError(f"swiglu: gate and up bf16 [M, K] and weights [M], got {tuple(x.shape)} {x.dtype}, "
                             f"{tuple(up.shape)} {up.dtype} and {tuple(weights.shape)}")
        up, weights = up.contiguous(), weights.float().contiguous()
    codes = torch.empty(m, k, dtype=torch.bfloat16 if qdq else torch.float8_e4m3fn, device=x.device)
    scales = codes if qdq else torch.empty(ceil_div(k, GROUP), m, dtype=torch.float32, device=x.device)
    if m and k:
        block_m, groups = 32, 4
        grid = (triton.cdiv(m, block_m), triton.cdiv(k, groups * GROUP))
        _act_quant_kernel[grid](x, codes, scales, m, k, x.stride(0), up, weights, float(limit), BLOCK_M=block_m,
                                GROUPS=groups, QDQ=qdq, PERMUTE=permute,
                                SWIGLU=0 if swiglu is None else 2 if limit > 0 else 1, num_warps=4)
    return codes, scales


@torch.compiler.disable  # host-side launch code: opaque to a compiled model (a graph break per call)
def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] -> (codes float8_e4m3fn [M, K], scales fp32 [M, ceil(K/32)]), the official V4.1 activation
    quantization (groups of 32, UE8M0 scales).  GPU kernel on CUDA, ``act_quant_reference`` elsewhere."""
    if x.dim() != 2:
        raise ValueError(f"act_quant_fp8 takes a 2-D [M, K] activation, got shape {tuple(x.shape)}: flatten it first")
    if not (triton is not None and x.is_cuda):
        return act_quant_reference(x)
    codes, scales = _act_quant_t(x)
    return codes, scales.t()


def group_starts(counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts int [G] rows per group -> (row_start, tile_start) int32 [G+1]: each group's first row and its first tile
    of block_m rows, cumulative, computed where counts lives (no host sync); the grouped kernels search them."""
    counts = counts.to(torch.int32)
    row_start = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, 0, out=row_start[1:])
    tile_start = torch.zeros_like(row_start)
    torch.cumsum(torch.div(counts + (block_m - 1), block_m, rounding_mode="floor"), 0, out=tile_start[1:])
    return row_start, tile_start


def _launch(a, a_scale_t, b, b_scale, out_dtype, *, n, k, b_fp4, bs_e8m0, bs_rows, config, strides, counts=None,
            swiglu=None):
    """One ``_scaled_gemm_kernel`` launch: activations from ``_act_quant_t(x, qdq=config's MMA >= 1)`` x weight
    tiles -> [m, n]."""
    block_m, block_n, sub, warps, stages, split, mma = config
    m = a.shape[0]
    stride_bg, stride_bn, stride_bsg, stride_bsn = strides
    if counts is None:
        n_groups, tiles_m = 1, triton.cdiv(m, block_m)
        tile_start = row_start = b_scale  # unused
    else:
        n_groups = counts.numel()
        row_start, tile_start = group_starts(counts, block_m)
        # an upper bound on the row tiles without a host sync: each group's tiles plus one partial tile per group,
        # and never more tiles than rows (a tile holds at least one)
        tiles_m = min(triton.cdiv(m, block_m) + n_groups, m)
    tiles = tiles_m * triton.cdiv(n, block_n)
    if split == 0:  # enough K slices for about two programs per SM (four without MMA), each >= 4 (2) steps long
        per_sm, steps = (4, 2) if mma >= 3 else (2, 4)
        split = max(1, min(per_sm * _sm_count(a.device) // tiles, triton.cdiv(k, 32 * sub * steps)))
    if split > 1 and (swiglu is not None or counts is not None):
        raise ValueError("SPLIT_K > 1 serves the dense GEMM only")
    out = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    b2, bs2, w, limit = swiglu if swiglu is not None else (b, b_scale, out, 0.0)
    common = {"B_FP4": b_fp4, "BS_E8M0": bs_e8m0, "BS_ROWS": bs_rows, "GROUPED": counts is not None,
              "SWIGLU": swiglu is not None, "BLOCK_N": block_n, "SUB": sub, "SPLIT_K": split,
              "EVEN": k % (32 * sub) == 0 and n % block_n == 0, "num_warps": warps, "num_stages": stages}
    if mma == 4:
        _gemv_kernel[(tiles, split)](
            a, b, b_scale, b2, bs2, out, w, tile_start, row_start, m, n, k, n_groups, stride_bg, stride_bn,
            stride_bsg, stride_bsn, float(limit), ROWS=block_m, **common)
    else:
        _scaled_gemm_kernel[(tiles, split)](
            a, a_scale_t, b, b_scale, b2, bs2, out, w, tile_start, row_start, m, n, k, n_groups, stride_bg,
            stride_bn, stride_bsg, stride_bsn, float(limit), BLOCK_M=block_m, MMA=int(mma), GROUP_M=8, **common)
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


@torch.compiler.disable
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, out_dtype=torch.bfloat16,
               config=None) -> torch.Tensor:
    """x [..., K] (bf16) @ FP8 weight [N, K] (32x32 block scales [ceil(N/32), ceil(K/32)], UE8M0 or F32)^T ->
    [..., N] in ``out_dtype`` (bf16; fp32 for tests), with x quantized to FP8 as the official inference does."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise TypeError(f"fp8_linear takes a float8_e4m3fn [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {tuple(weight.shape)} takes {k}")
    expected = (ceil_div(n, GROUP), ceil_div(k, GROUP))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8_linear: scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                         f"with 32x32 blocks: expected {expected}")
    b_scale, e8m0 = _scale_arg(scale, "fp8_linear scale")
    _check_usable(x, "fp8_linear")
    rows = x.reshape(-1, k)
    if not rows.shape[0]:
        return x.new_empty(*x.shape[:-1], n, dtype=out_dtype)
    if config is None and rows.shape[0] >= DECODED_GEMM_ROWS:
        a, _ = _act_quant_t(rows, qdq=True)
        w = _decode_fp8(weight, b_scale, e8m0)
        out = torch.matmul(a, w.t()) if out_dtype == torch.bfloat16 else torch.matmul(a.float(), w.float().t())
        return out.to(out_dtype).view(*x.shape[:-1], n)
    config = _config("dense", rows.shape[0], config)
    a, a_scale = _act_quant_t(rows, qdq=bool(config[6]))
    out = _launch(a, a_scale, weight.contiguous(), b_scale, out_dtype, n=n, k=k, b_fp4=False, bs_e8m0=e8m0,
                  bs_rows=GROUP, config=config, strides=(0, k, 0, b_scale.shape[1]))
    return out.view(*x.shape[:-1], n)


@torch.compiler.disable
def decode_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight [N, K] with 32x32 block scales [ceil(N/32), ceil(K/32)] (UE8M0 or F32) -> bf16 [N, K] on the GPU."""
    return _decode_fp8(weight, *_scale_arg(scale, "decode_fp8_weight scale"))


def _decode_fp8(weight: torch.Tensor, b_scale: torch.Tensor, e8m0: bool) -> torch.Tensor:
    # decode_fp8_weight on scales already through _scale_arg
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    if n and k:
        grid = (triton.cdiv(n, 32), triton.cdiv(k, 256))
        _fp8_decode_kernel[grid](weight.contiguous(), b_scale, out, n, k, b_scale.shape[1], BS_E8M0=e8m0,
                                 BLOCK_N=32, BLOCK_K=256, num_warps=4)
    return out


@torch.compiler.disable
def decode_fp4_weights(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes [..., N, K/2] (int8/uint8, low nibble = even k) with per-32 scales [..., N, ceil(K/32)]
    (UE8M0 or F32) -> bf16 [..., N, K] on the GPU."""
    k = 2 * codes.shape[-1]
    s, e8m0 = _scale_arg(scales, "decode_fp4_weights scales")
    c = codes.contiguous().view(torch.uint8)
    out = torch.empty(*codes.shape[:-1], k, dtype=torch.bfloat16, device=codes.device)
    rows = c.numel() // max(c.shape[-1], 1)
    if rows and k:
        block_r, block_h, warps = FP4_DECODE_CONFIG
        grid = (triton.cdiv(rows, block_r), triton.cdiv(k // 2, block_h))
        _fp4_decode_kernel[grid](c, s, out.view(torch.int32), rows, k // 2, s.shape[-1], BS_E8M0=e8m0,
                                 BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps)
    return out


def _decoded_grouped_experts(x, counts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, limit):
    # prefill: fp4_grouped_experts' computation with each chunk of experts decoded to bf16 and torch._grouped_mm
    # (the same products: the activations' FP8 values are exact in bf16); one host read of the row counts
    from .kernels_triton import weighted_swiglu_triton

    n_experts, inter, dim = w1.shape[0], w1.shape[1], 2 * w1.shape[2]
    a, _ = _act_quant_t(x, qdq=True)
    out = torch.empty(x.shape[0], dim, dtype=torch.bfloat16, device=x.device)
    chunk = max(1, EXPERT_SCRATCH_BYTES // (2 * 3 * inter * dim))
    ends = [0, *counts.cumsum(0).tolist()]
    for e0 in range(0, n_experts, chunk):
        e1 = min(e0 + chunk, n_experts)
        r0, r1 = ends[e0], ends[e1]
        if r1 == r0:
            continue
        offs = counts[e0:e1].cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(a[r0:r1], decode_fp4_weights(w1[e0:e1], w1_scale[e0:e1]).transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(a[r0:r1], decode_fp4_weights(w3[e0:e1], w3_scale[e0:e1]).transpose(-2, -1), offs=offs)
        h, _ = _act_quant_t(weighted_swiglu_triton(gate, up, weights[r0:r1].float(), limit), qdq=True)
        out[r0:r1] = torch._grouped_mm(h, decode_fp4_weights(w2[e0:e1], w2_scale[e0:e1]).transpose(-2, -1),
                                       offs=offs)
    return out


@torch.compiler.disable
def fp8_block_diagonal_linear(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, config=None) -> torch.Tensor:
    """Attention's ``wo_a`` on its stored FP8 weight: o bf16 [n, G, d] -> bf16 [n, G·r], group g through weight rows
    g·r..(g+1)·r (weight float8_e4m3fn [G·r, d], 32x32 block scales, r a multiple of 32).  The activations stay
    bf16: the official code decodes ``wo_a`` to bf16 at conversion and multiplies in bf16, so they are not
    quantized here (the bf16 MMA or FMAs read them as they are; the products are exact in fp32 either way)."""
    n, groups, d = o.shape
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[1] != d or weight.shape[0] % groups:
        raise ValueError(f"fp8_block_diagonal_linear: weight {weight.dtype} {tuple(weight.shape)} is not an FP8 "
                         f"[groups·r, {d}] for o {tuple(o.shape)}")
    r = weight.shape[0] // groups
    if r % GROUP or tuple(scale.shape) != (ceil_div(weight.shape[0], GROUP), ceil_div(d, GROUP)):
        raise ValueError(f"fp8_block_diagonal_linear: {groups} groups of {r} rows need r a multiple of {GROUP} and "
                         f"scales [{ceil_div(weight.shape[0], GROUP)}, {ceil_div(d, GROUP)}]; got scale "
                         f"{tuple(scale.shape)}")
    b_scale, e8m0 = _scale_arg(scale, "fp8_block_diagonal_linear scale")
    _check_usable(o, "fp8_block_diagonal_linear")
    if not n:
        return o.new_empty(0, groups * r)
    if config is None and n >= DECODED_GEMM_ROWS:  # prefill: decoded to bf16 (transient), one batched cuBLAS GEMM
        w = _decode_fp8(weight, b_scale, e8m0).view(groups, r, d)
        return torch.bmm(o.to(torch.bfloat16).transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(n, -1)
    config = _config("grouped", n, config)
    if not config[6]:
        raise ValueError("fp8_block_diagonal_linear multiplies bf16 activations: it needs a bf16 MMA or FMA "
                         f"configuration (MMA 1, 2 or 3), got {config}")
    a = o.to(torch.bfloat16).transpose(0, 1).reshape(groups * n, d)  # rows sorted by group
    counts = torch.full((groups,), n, dtype=torch.int32, device=o.device)
    blocks_k = b_scale.shape[1]
    out = _launch(a, a, weight.contiguous(), b_scale, torch.bfloat16, n=r, k=d, b_fp4=False, bs_e8m0=e8m0,
                  bs_rows=GROUP, config=config, strides=(r * d, d, (r // GROUP) * blocks_k, blocks_k), counts=counts)
    return out.view(groups, n, r).transpose(0, 1).reshape(n, groups * r)


def _check_fp4(codes: torch.Tensor, scales: torch.Tensor, k: int, name: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if codes.dtype not in (torch.int8, torch.uint8) or codes.dim() != 3:
        raise TypeError(f"{name} codes must be int8/uint8 [E, N, K/2] (two E2M1 codes per byte), got {codes.dtype} "
                        f"{tuple(codes.shape)}")
    if codes.shape[2] * 2 != k:
        raise ValueError(f"{name} codes {tuple(codes.shape)} hold {2 * codes.shape[2]} inputs per row, the "
                         f"activations have {k}")
    expected = (codes.shape[0], codes.shape[1], ceil_div(k, GROUP))
    if tuple(scales.shape) != expected:
        raise ValueError(f"{name} scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)}: expected "
                         f"{expected} (one per 32 inputs)")
    s, e8m0 = _scale_arg(scales, f"{name} scales")
    return codes.contiguous().view(torch.uint8), s, e8m0


def _fp4_strides(codes: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int, int]:
    return codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1)


def _check_counts(counts: torch.Tensor, groups: int) -> torch.Tensor:
    if counts.dim() != 1 or counts.numel() != groups:
        raise ValueError(f"counts must be [{groups}] (rows per expert), got shape {tuple(counts.shape)}")
    if groups > 1024:
        raise ValueError(f"{groups} experts on one GPU: the grouped kernel's tile search covers at most 1024")
    return counts.to(torch.int32)


@torch.compiler.disable
def fp4_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     counts: torch.Tensor, *, out_dtype=torch.bfloat16, config=None) -> torch.Tensor:
    """FP8 rows a [m, K] with scales [m, ceil(K/32)] (``act_quant_fp8``), sorted by group with ``counts`` [G] rows
    each (the rows past sum(counts) are left unwritten), times packed FP4 weights codes [G, N, K/2] with scales
    [G, N, ceil(K/32)] -> [m, N] in ``out_dtype``."""
    m, k = a.shape
    codes, s, e8m0 = _check_fp4(codes, scales, k, "fp4_grouped_gemm")
    counts = _check_counts(counts, codes.shape[0])
    _check_usable(a, "fp4_grouped_gemm")
    n = codes.shape[1]
    if not m:
        return a.new_empty(0, n, dtype=out_dtype)
    config = _config("grouped", rows_per_expert(m, codes.shape[0]), config)
    if config[6]:  # the bf16 MMA reads the activations' values
        a = (a.float() * a_scale.repeat_interleave(GROUP, 1)[:, :k]).bfloat16()
    return _launch(a.contiguous(), a_scale.t().contiguous(), codes, s, out_dtype, n=n, k=k, b_fp4=True,
                   bs_e8m0=e8m0, bs_rows=1, config=config, strides=_fp4_strides(codes, s), counts=counts.to(a.device))


@torch.compiler.disable
def fp4_experts_on_wgmma(x: torch.Tensor, m: int, w1: torch.Tensor, w1_scale: torch.Tensor,
                         w2_scale: torch.Tensor) -> bool:
    """Whether ``fp4_grouped_experts`` of m routed rows (on x's device, the default configs) runs on the wgmma kernel
    (``WGMMA_EXPERT_ROWS``, ``WGMMA_SINGLE_ROWS``; Hopper with nvcc; UE8M0 scales; dim and inter multiples of 64),
    which can then take activations quantized before the top-k copy (``x_quantized``)."""
    n_experts, inter, dim = w1.shape[0], w1.shape[1], 2 * w1.shape[2]
    rows = rows_per_expert(m, n_experts)
    lo, hi = WGMMA_EXPERT_ROWS or (0, 0)
    e8m0 = w1_scale.dtype == w2_scale.dtype == torch.float8_e8m0fnu
    return ((rows >= lo or m >= WGMMA_SINGLE_ROWS) and rows < hi and e8m0 and dim % 64 == 0 and inter % 64 == 0
            and hopper_usable(x))


@torch.compiler.disable
def quantize_for_wgmma(x: torch.Tensor) -> torch.Tensor:
    """x bf16 [n, K] -> its FP8 values (per-32 UE8M0 groups, the official activation quantization) as bf16 in the
    wgmma kernel's column order: what ``fp4_grouped_experts(..., x_quantized=True)`` takes, after the rows are
    copied to their experts (a token's copies are the same values, so quantizing before the copy is k times less
    work than after)."""
    return _act_quant_t(x, qdq=True, permute=True)[0]


@torch.compiler.disable
def fp4_grouped_experts(x, counts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, limit: float, *,
                        configs=(None, None), x_quantized: bool = False) -> torch.Tensor:
    """The routed experts' clamped SwiGLU on the stored FP4 weights (see the module docstring): x bf16 [m, dim]
    sorted by expert, counts [E], routing weights fp32 [m] -> bf16 [m, dim].  x_quantized: x is
    ``quantize_for_wgmma``'s output (on the wgmma route only, ``fp4_experts_on_wgmma``)."""
    m, dim = x.shape
    w1c, w1s, e8m0 = _check_fp4(w1, w1_scale, dim, "w1")
    w3c, w3s, e8m0_3 = _check_fp4(w3, w3_scale, dim, "w3")
    if w1.shape != w3.shape or w1_scale.shape != w3_scale.shape or e8m0 != e8m0_3:
        raise ValueError(f"w1 {tuple(w1.shape)} and w3 {tuple(w3.shape)} (and their scales) must match")
    n_experts, inter = w1.shape[0], w1.shape[1]
    w2c, w2s, e8m0_2 = _check_fp4(w2, w2_scale, inter, "w2")
    if tuple(w2.shape[:2]) != (n_experts, dim):
        raise ValueError(f"w2 codes {tuple(w2.shape)} must be [{n_experts}, {dim}, {inter // 2}]")
    counts = _check_counts(counts, n_experts)
    if tuple(weights.shape) != (m,):
        raise ValueError(f"weights must be [{m}] (one routing weight per row), got {tuple(weights.shape)}")
    _check_usable(x, "fp4_grouped_experts")
    if not m:
        return x.new_empty(0, dim, dtype=torch.bfloat16)
    counts = counts.to(x.device)
    rows = rows_per_expert(m, n_experts)
    if configs == (None, None) and fp4_experts_on_wgmma(x, m, w1, w1_scale, w2_scale):
        from .kernels_fp4_wgmma import fp4_grouped_experts_wgmma

        return fp4_grouped_experts_wgmma(x, counts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, limit,
                                         x_quantized=x_quantized)
    if x_quantized:
        raise ValueError("fp4_grouped_experts: x_quantized=True is for the wgmma route only (check it with "
                         "fp4_experts_on_wgmma); pass the bf16 activations")
    if (configs == (None, None) and rows >= DECODED_EXPERT_ROWS
            and not torch.cuda.is_current_stream_capturing()):
        return _decoded_grouped_experts(x, counts, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, limit)
    up_config = _config("swiglu", rows, configs[0])
    down_config = _config("grouped", rows, configs[1])
    a, a_scale = _act_quant_t(x, qdq=bool(up_config[6]))
    h = _launch(a, a_scale, w1c, w1s, torch.bfloat16, n=inter, k=dim, b_fp4=True, bs_e8m0=e8m0, bs_rows=1,
                config=up_config, strides=_fp4_strides(w1c, w1s), counts=counts,
                swiglu=(w3c, w3s, weights.float().contiguous(), limit))
    a, a_scale = _act_quant_t(h, qdq=bool(down_config[6]))
    return _launch(a, a_scale, w2c, w2s, torch.bfloat16, n=dim, k=inter, b_fp4=True, bs_e8m0=e8m0_2, bs_rows=1,
                   config=down_config, strides=_fp4_strides(w2c, w2s), counts=counts)
