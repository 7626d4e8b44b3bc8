"""Pure-PyTorch CPU stand-ins for the six GPU kernels of the official DeepSeek-V4.1 inference code.

The official ``inference/model.py`` does ``from kernel import act_quant, fp4_act_quant, fp8_gemm, fp4_gemm,
sparse_attn, hc_split_sinkhorn`` (TileLang kernels, CUDA only). ``install()`` registers a module named
``kernel`` holding these six functions in ``sys.modules``, so importing the official ``model.py`` afterwards
binds them instead and the official graph runs unmodified on CPU (``compare_with_official.py --cpu-kernels``).

Signatures follow the official ``kernel.py`` interface as described by the golden fixture README
(``shared/golden/v41_tiny_text/reference/README.md``, "Where the CPU kernel equivalents may round
differently") and architecture.md §5-§7, with the keyword names public descriptions of the V4 ``kernel.py``
use. The real file was not available when this was written: check every signature against it before
trusting a run (a wrong keyword fails loudly with a TypeError; a different default block size would not).

Numerics (the package's own FP8/FP4 encoders, decoders, quantize-dequantize references and sparse attention
are reused; only the mHC split is restated, since ``deepseek_v41.mhc.hc_mix`` computes it inline from the
streams, and a test holds the two bit-identical). Pure PyTorch: they run on CPU or CUDA tensors alike.

| kernel              | semantics                                                                          |
|---------------------|------------------------------------------------------------------------------------|
| `act_quant`         | FP8 e4m3 per block of 32 along the last dim, UE8M0 power-of-two scales (exact)      |
| `fp4_act_quant`     | E2M1 per 32 with UE8M0 scales, or per 16 with E4M3 value scales; ties to even code  |
| `fp8_gemm`          | dequantize both sides, fp32 partial products per 32-wide K block summed in K order |
| `fp4_gemm`          | the same with a packed E2M1 weight (per-32 UE8M0 scales)                            |
| `sparse_attn`       | gathered MQA attention with a sink; bf16 probabilities before P·V (1 bf16 ulp from  |
|                     | the kernel's online softmax over blocks of 64)                                     |
| `hc_split_sinkhorn` | mHC pre/post/comb split and Sinkhorn normalization in fp32 (architecture.md §7)     |

``CALLS`` counts the calls of each kernel (reset by ``install``), so a run can show that the official graph
really went through them.
"""

from __future__ import annotations

import math
import sys
import types
from collections import Counter

import torch

from deepseek_v41 import mhc
from deepseek_v41.quantization import (
    FP4_MAX,
    FP8_MAX,
    fp4_e4m3_scale_qdq_reference,
    fp4_qdq_reference,
    round_to_e2m1,
)
from deepseek_v41.release_format import (
    E2M1_VALUES,
    decode_fp4_packed,
    decode_fp8_blockwise,
    decode_fp8_rows,
    e8m0_to_float,
    encode_fp4_packed,
    encode_fp8_rows,
)
from deepseek_v41.sparse_attention import sparse_attention_torch

KERNELS = ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn")
CALLS: Counter = Counter()
_E2M1_MAGNITUDES = torch.tensor(E2M1_VALUES[:8])  # code k (k < 8) -> |value|, ascending


def _rows(x: torch.Tensor, block: int) -> torch.Tensor:
    # x [..., k] -> [n, k] (n may be 0: an expert no token chose), checking the block divides k
    if x.shape[-1] % block:
        raise ValueError(f"block size {block} does not divide the last dimension {x.shape[-1]}")
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _scales_as(scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    # UE8M0 scale bytes -> the requested dtype (UE8M0 kept, or its fp32 value)
    return scale if scale_dtype == torch.float8_e8m0fnu else e8m0_to_float(scale).to(scale_dtype)


def act_quant(x: torch.Tensor, block_size: int = 32, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    """x [..., k] -> (FP8 e4m3 [..., k], scale [..., k / block_size]); ``inplace``: x <- dequantized x.

    ``scale_fmt`` set (``"ue8m0"``) or a UE8M0 ``scale_dtype``: power-of-two scales 2^ceil(log2(amax / 448));
    otherwise the plain fp32 scale amax / 448. amax is floored at 1e-4.
    """
    CALLS["act_quant"] += 1
    rows = _rows(x, block_size)
    if scale_fmt is not None or scale_dtype == torch.float8_e8m0fnu:
        q, scale = encode_fp8_rows(rows, block_size)  # the checkpoint's FP8 row encoder: same rounding
        scale = _scales_as(scale, scale_dtype)
    else:
        amax = rows.float().unflatten(-1, (-1, block_size)).abs().amax(-1).clamp(min=1e-4)
        scale = (amax / FP8_MAX).to(scale_dtype)
        q = (rows.float().unflatten(-1, (-1, block_size)) / scale.float().unsqueeze(-1))
        q = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    if inplace:
        return x.copy_(decode_fp8_rows(q, scale, block_size, dtype=torch.float32).view_as(x))
    return q.view(x.shape), scale.view(*x.shape[:-1], x.shape[-1] // block_size)


def _pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    # values exactly on E2M1 levels [n, k] -> packed codes [n, k / 2] (low nibble = even column)
    code = torch.searchsorted(_E2M1_MAGNITUDES.to(values.device), values.abs().contiguous()).to(torch.uint8)
    code |= torch.signbit(values).to(torch.uint8) << 3
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.float4_e2m1fn_x2)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False,
                  scale_dtype: torch.dtype = torch.float8_e8m0fnu):
    """x [..., k] -> (packed E2M1 [..., k / 2] float4_e2m1fn_x2, scale [..., k / block_size]); ``inplace``:
    x <- dequantized x.

    ``scale_dtype`` float8_e4m3fn: E4M3 value scales e4m3(max(amax, 6·2^-9) / 6) (compressed KV, groups of
    16); otherwise UE8M0 scales 2^ceil(log2(amax / 6)) (index q/k, groups of 32).
    """
    CALLS["fp4_act_quant"] += 1
    rows = _rows(x, block_size)
    e4m3 = scale_dtype == torch.float8_e4m3fn
    if inplace:
        qdq = fp4_e4m3_scale_qdq_reference if e4m3 else fp4_qdq_reference
        return x.copy_(qdq(x, block_size))
    if not e4m3:
        packed, scale = encode_fp4_packed(rows, block_size)  # the checkpoint's FP4 encoder: same rounding
        scale = _scales_as(scale, scale_dtype).view(*x.shape[:-1], x.shape[-1] // block_size)
        return packed.view(torch.float4_e2m1fn_x2).view(*x.shape[:-1], x.shape[-1] // 2), scale
    blocks = rows.float().unflatten(-1, (-1, block_size))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-9)
    scale = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    levels = round_to_e2m1((blocks / scale.float()).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    shape = x.shape[:-1]
    return _pack_e2m1(levels).view(*shape, x.shape[-1] // 2), scale.view(*shape, x.shape[-1] // block_size)


def _blocked_matmul(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    # a [n, k] fp32, b [m, k] fp32 -> [n, m]: one fp32 partial product per K block, summed in K order
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for start in range(0, a.shape[1], block):
        out += a[:, start : start + block] @ b[:, start : start + block].T
    return out


def _dequantized_activation(a: torch.Tensor, a_s: torch.Tensor, block: int) -> torch.Tensor:
    # FP8 a [..., k] with per-block scales [..., k / block] -> fp32 [n, k]
    return decode_fp8_rows(_rows(a, block), _rows(a_s, 1), block, dtype=torch.float32)


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32, block_size: int = 32) -> torch.Tensor:
    """FP8 activation a [..., k] (scales a_s [..., k / block]) x FP8 weight b [n, k] (block scales
    b_s [ceil(n / block), ceil(k / block)]) -> a·bᵀ [..., n] in the default dtype."""
    CALLS["fp8_gemm"] += 1
    weight = decode_fp8_blockwise(b, b_s, block_size, dtype=torch.float32)
    out = _blocked_matmul(_dequantized_activation(a, a_s, block_size), weight, block_size)
    return out.to(torch.get_default_dtype()).view(*a.shape[:-1], b.shape[0])


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32, act_block_size: int = 32) -> torch.Tensor:
    """FP8 activation a [..., k] x packed E2M1 weight b [n, k / 2] (per-row scales b_s [n, k / 32])
    -> a·bᵀ [..., n] in the default dtype; K blocks of 32 (the weight's scale group)."""
    CALLS["fp4_gemm"] += 1
    weight = decode_fp4_packed(b.view(torch.uint8), b_s, 32, dtype=torch.float32)
    out = _blocked_matmul(_dequantized_activation(a, a_s, act_block_size), weight, 32)
    return out.to(torch.get_default_dtype()).view(*a.shape[:-1], b.shape[0])


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """q [b, s, h, d], kv [b, n, d] (key = value), attn_sink fp32 [h], topk_idxs [b, s, k] (-1 = empty)
    -> o [b, s, h, d]: the package's reference sparse attention."""
    CALLS["sparse_attn"] += 1
    return sparse_attention_torch(q, kv, attn_sink, topk_idxs, softmax_scale)


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int = 4,
                      sinkhorn_iters: int = 20, eps: float = 1e-6):
    """mixes fp32 [..., (2 + hc) * hc] -> pre [..., hc], post [..., hc], comb [..., hc (src), hc (dst)].

    pre = sigmoid(m·s0 + b) + eps, post = 2·sigmoid(m·s1 + b), comb = Sinkhorn(softmax(m·s2 + b) + eps)
    ending on a column normalization (architecture.md §7): ``deepseek_v41.mhc.hc_split_sinkhorn``, which
    ``hc_mix`` applies to the streams' mixes too.
    """
    CALLS["hc_split_sinkhorn"] += 1
    return mhc.hc_split_sinkhorn(mixes.float(), hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)


def install(name: str = "kernel") -> types.ModuleType:
    """Register a module ``name`` holding exactly the six stand-ins in ``sys.modules`` (before the official
    ``model.py`` is imported) and reset ``CALLS``. Returns that module."""
    module = types.ModuleType(name, "CPU stand-ins of the official DeepSeek-V4.1 kernels")
    for kernel in KERNELS:
        setattr(module, kernel, globals()[kernel])
    sys.modules[name] = module
    CALLS.clear()
    return module
