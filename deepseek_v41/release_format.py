"""The released checkpoint's quantized weight formats: decode to floating point, and encode (for tests and tiny
checkpoints).  All three are "codes times a power-of-two scale per group of 32 along a row":

- FP8 linear weight F8_E4M3 [out, in] with UE8M0 scales per 32x32 block [ceil(out/32), ceil(in/32)];
- FP4 routed expert I8 [out, in/2] (two E2M1 codes per byte, low nibble first) with scales [out, ceil(in/32)];
- FP8 Engram table rows F8_E4M3 [rows, d] with scales [rows, ceil(d/32)].

Scales are F8_E8M0 (2^(e-127)) or, in some older releases, F32: decoding branches on the scale dtype.
`released_format(name)` says which format the release stores each tensor in (F32 for the fp32 islands,
BF16 for the rest), for re-encoding a fine-tuned model (`save_pretrained(..., quantize="release")`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# E2M1 code -> value; bit 3 is the sign (code 8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Output elements per thread per CPU decode step: the gather, its index and the scaling stay in cache
# (measured: 2^18 decodes ~2x faster per core than whole-tensor passes, and than 2^14).
_CPU_CHUNK_ELEMENTS = 1 << 18


# The release's config.json quantization_config (what the official code, vLLM and SGLang read).
RELEASED_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "scale_fmt": "ue8m0",
    "weight_block_size": [32, 32],
    "expert_dtype": "fp4",
}
_FP8_LINEARS = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                          r"|engram\.wkv|main_proj)\.weight$")  # main_proj: DSpark stage 0's input projection
_FP4_EXPERTS = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP8_TABLES = re.compile(r"\.engram\.embed\.weight$")
_F32_NAMES = re.compile(r"(\.attn_sink|\.hc_(attn|ffn)_(fn|base|scale)|\.ffn\.gate\.bias(_vl)?)$")


def released_format(name: str, shape: tuple[int, ...] = ()) -> tuple[str, torch.dtype]:
    """(format, dtype) the release stores tensor `name` (released name) in: "fp8_block" (32x32 UE8M0 blocks),
    "fp4" (packed experts), "fp8_rows" (Engram tables) with codes in `dtype`, or "plain" in BF16 / F32."""
    if _FP4_EXPERTS.search(name):
        if len(shape) == 2 and shape[1] % 2:
            raise ValueError(f"{name!r} has shape {list(shape)}: FP4 packing needs an even number of columns")
        return "fp4", torch.int8
    if _FP8_TABLES.search(name):
        return "fp8_rows", torch.float8_e4m3fn
    if _FP8_LINEARS.search("." + name):
        return "fp8_block", torch.float8_e4m3fn
    if _F32_NAMES.search("." + name):
        return "plain", torch.float32
    return "plain", torch.bfloat16


def e8m0_to_float(scale: torch.Tensor, check: bool = True) -> torch.Tensor:
    """UE8M0 scale bytes -> fp32 multipliers 2^(e-127); F32 scales (older releases) pass through.  ``check``:
    refuse NaN / negative / infinite scales, a read back to the host; kept weights, whose scales the loader checked
    once, pass False on their hot path (a decode step captured as a CUDA graph cannot read back)."""
    if scale.dtype == torch.float32:
        if not check:
            return scale
        valid = (scale >= 0) & (scale < torch.inf)  # NaN fails both comparisons
        if not bool(valid.all()):
            raise ValueError(f"F32 scale holds {scale[~valid][:3].tolist()}: scales are non-negative and finite; "
                             "the checkpoint is corrupted")
        return scale
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scale dtype {scale.dtype} is neither float8_e8m0fnu (UE8M0) nor float32")
    if check and bool((scale.view(torch.uint8) == 255).any()):
        raise ValueError("UE8M0 scale contains the NaN byte 255: the checkpoint is corrupted")
    return scale.float()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_pair(block: int | tuple[int, int]) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def _work_dtype(dtype: torch.dtype, scale: torch.Tensor) -> torch.dtype:
    # Codes times a power of two are exact in fp32 and bf16 (same exponent range), so an E8M0-scaled
    # decode can run in bf16 with one rounding; an F32 scale needs the product in fp32 first.
    if scale.dtype == torch.float8_e8m0fnu and dtype in (torch.float32, torch.bfloat16):
        return dtype
    return torch.float32


_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _code_table(kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256] value of each code byte in `dtype`.

    kind "e4m3": the E4M3 value of the byte. kind "e2m1x2": both E2M1 values of a packed byte (low
    nibble first) as one int32 (bf16 pair) or int64 (fp32 pair), so one gather writes two outputs.
    """
    key = (kind, dtype, device)
    if key not in _TABLES:
        byte = torch.arange(256)
        if kind == "e4m3":
            table = byte.to(torch.uint8).view(torch.float8_e4m3fn).float().to(dtype)
        else:
            values = torch.tensor(E2M1_VALUES, dtype=dtype)
            pairs = torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1).contiguous()  # [256, 2]
            table = pairs.view({torch.float32: torch.int64, torch.bfloat16: torch.int32}[dtype]).reshape(256)
        _TABLES[key] = table.to(device)
    return _TABLES[key]


def _scale_groups_(out: torch.Tensor, row_scale: torch.Tensor, group: int) -> None:
    # out [r, c] *= row_scale [r, ceil(c/group)] broadcast over each group of `group` columns
    cols = out.shape[1]
    full = cols // group
    if full:
        out[:, : full * group].unflatten(1, (full, group)).mul_(row_scale[:, :full, None])
    if cols % group:
        out[:, full * group:].mul_(row_scale[:, full:full + 1])


def _row_steps(rows: int, cols: int, device: torch.device) -> Iterator[tuple[int, int]]:
    # CPU: row blocks of _CPU_CHUNK_ELEMENTS outputs per thread, so each step stays in cache; GPU: one step
    if device.type == "cpu":
        step = max(1, _CPU_CHUNK_ELEMENTS * torch.get_num_threads() // max(cols, 1))
    else:
        step = max(rows, 1)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _decode_codes(
    codes: torch.Tensor,
    kind: str,
    row_scale: torch.Tensor,
    group: int,
    shape: tuple[int, int],
    dtype: torch.dtype,
    out: torch.Tensor | None,
    check: bool = True,
) -> torch.Tensor:
    """Gather the `kind` table (see `_code_table`) at codes, then scale each group of `group` columns.

    codes [r, k] uint8 (k = c, or c/2 for packed pairs); row_scale
    [r, ceil(c/group)] fp32/UE8M0, one scale row per output row; result [r, c] = `shape`.
    Writes into `out` when given (dtype taken from it).  `check`: see `e8m0_to_float`.
    """
    if out is not None and tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, the decoded tensor {tuple(shape)}")
    dtype = out.dtype if out is not None else dtype
    work = _work_dtype(dtype, row_scale)
    scale = e8m0_to_float(row_scale, check).to(device=codes.device, dtype=work)
    direct = out is not None and out.dtype == work and out.device == codes.device and out.is_contiguous()
    dest = out if direct else torch.empty(shape, dtype=work, device=codes.device)
    table = _code_table(kind, work, codes.device)
    entries = dest.view(table.dtype)  # [r, k]: one table entry per code
    for start, stop in _row_steps(shape[0], shape[1], codes.device):
        index = codes[start:stop].reshape(-1).to(torch.int32)
        torch.index_select(table, 0, index, out=entries[start:stop].view(-1))
        _scale_groups_(dest[start:stop], scale[start:stop], group)
    if out is None:
        return dest.to(dtype)
    if not direct:
        out.copy_(dest)
    return out


def decode_fp8_row_scaled(
    q: torch.Tensor, row_scale: torch.Tensor, group: int, dtype: torch.dtype, out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    # q [r, c] E4M3, row_scale [r, ceil(c/group)] (one scale row per q row) -> [r, c]
    return _decode_codes(q.view(torch.uint8), "e4m3", row_scale, group, tuple(q.shape), dtype, out, check)


def take_rows(scale: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # scale rows by index; UE8M0 goes through its bytes (not every device indexes float8 directly)
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8).index_select(0, index).view(scale.dtype)
    return scale.index_select(0, index)


def _check_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")


def decode_fp8_blockwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: int | tuple[int, int] = 32,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 weight q [out, in] E4M3 with block scales [ceil(out/bo), ceil(in/bi)] -> W [out, in] in `dtype`.

    W[i, j] = float(q[i, j]) * S[i // bo, j // bi]; edge blocks are partial (ceil grid). The block size is
    given, never inferred from the shapes. `out` (optional) receives the result in its own dtype.
    """
    bo, bi = block_pair(block)
    _check_2d("FP8 weight", q)
    expected = (ceil_div(q.shape[0], bo), ceil_div(q.shape[1], bi))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} with {bo}x{bi} "
            f"blocks: expected the ceil grid {expected}"
        )
    row_block = torch.arange(q.shape[0], device=scale.device) // bo
    return decode_fp8_row_scaled(q, take_rows(scale, row_block), bi, dtype, out)


def decode_fp8_rows(
    q: torch.Tensor,
    scale: torch.Tensor,
    group: int = 32,
    rows: slice | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 table q [rows, d] E4M3 with per-row scales [rows, ceil(d/group)] -> E[rows, d] (or E[rows_slice]).

    E[r, c] = float(q[r, c]) * S[r, c // group]. `rows` decodes only a row range (row-owner sharding).
    """
    _check_2d("FP8 table", q)
    expected = (q.shape[0], ceil_div(q.shape[1], group))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 row scale shape {tuple(scale.shape)} does not match table {tuple(q.shape)}: "
                         f"expected {expected}")
    if rows is not None:
        q, scale = q[rows], scale[rows]
    return decode_fp8_row_scaled(q, scale, group, dtype, out)


def decode_fp4_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int = 32,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """FP4 expert weight packed [out, in/2] I8/U8 with scales [out, ceil(in/group)] -> W [out, in] in `dtype`.

    Byte k of a row holds element 2k in its low nibble and 2k+1 in its high nibble (E2M1 codes);
    W[i, j] = E2M1[code] * S[i, j // group].
    """
    _check_2d("FP4 packed weight", packed)
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"FP4 packed weight must be int8/uint8 bytes, got {packed.dtype}")
    shape = (packed.shape[0], 2 * packed.shape[1])
    expected = (shape[0], ceil_div(shape[1], group))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not match packed weight "
                         f"{tuple(packed.shape)} (unpacked {list(shape)}): expected {expected}")
    return _decode_codes(packed.view(torch.uint8), "e2m1x2", scale, group, shape, dtype, out, check)


def _pow2_scale_exponent(amax: torch.Tensor, level_max: float) -> torch.Tensor:
    # exact ceil(log2(amax / level_max)) as int32 (frexp avoids log2 rounding at powers of two)
    mantissa, exponent = torch.frexp(amax / level_max)  # x = m * 2^e, m in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp(-127, 127)


def _exponent_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _blocked_amax(w: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    # max |w| over each bo x bi block, zero-padded at the ragged edges -> [ceil(out/bo), ceil(in/bi)]
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.abs(), (0, -cols % bi, 0, -rows % bo))
    return padded.unflatten(1, (-1, bi)).unflatten(0, (-1, bo)).amax(dim=(1, 3))


def _check_encodable(w: torch.Tensor, amax: torch.Tensor, fmt: str) -> None:
    # A finite fp32 value always fits (its power-of-two scale stays inside E8M0's range): only NaN and Inf
    # would be clamped to the format's maximum, so they are refused instead (amax is small: one pass over it).
    if bool(torch.isfinite(amax).all()):
        return
    bad = ~torch.isfinite(w)
    at = tuple(bad.nonzero()[0].tolist())
    raise ValueError(f"it holds {w[at].item()} at {list(at)} ({int(bad.sum())} non-finite values): {fmt} would "
                     "store it as its largest finite value; fix the weights (NaN/Inf) before encoding")


def _encode_fp8(w: torch.Tensor, bo: int, bi: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d("weight", w)
    w = w.float()
    amax = _blocked_amax(w, bo, bi)
    _check_encodable(w, amax, f"FP8 E4M3 (max {E4M3_MAX:g})")
    exponent = _pow2_scale_exponent(amax.clamp_min(1e-4), E4M3_MAX)  # [gr, gc]
    inverse = torch.ldexp(torch.ones_like(w), -exponent.repeat_interleave(bo, 0)[: w.shape[0]]
                          .repeat_interleave(bi, 1)[:, : w.shape[1]])
    q = (w * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # RNE
    return q, _exponent_to_e8m0(exponent)


def encode_fp8_blockwise(w: torch.Tensor, block: int | tuple[int, int] = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q E4M3 [out, in], scale UE8M0 [ceil(out/bo), ceil(in/bi)]), scale = 2^ceil(log2(amax/448)).

    ``ValueError`` for NaN / Inf (they would saturate to 448); every finite fp32 value fits."""
    return _encode_fp8(w, *block_pair(block))


def encode_fp8_rows(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Table [rows, d] -> (q E4M3 [rows, d], scale UE8M0 [rows, ceil(d/group)]), one scale per row and group."""
    return _encode_fp8(w, 1, group)


def encode_fp4_packed(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] (in even) -> (packed I8 [out, in/2], scale UE8M0 [out, ceil(in/group)]).

    scale = 2^ceil(log2(amax/6)) per group (amax floored at 6 * 2^-126); each element becomes the nearest
    E2M1 level of clamp(w/scale, +-6), ties to the even code; low nibble = even column.
    """
    _check_2d("weight", w)
    if w.shape[1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got shape {tuple(w.shape)}")
    w = w.float()
    amax = _blocked_amax(w, 1, group)
    _check_encodable(w, amax, f"FP4 E2M1 (max {E2M1_MAX:g})")
    exponent = _pow2_scale_exponent(amax.clamp_min(E2M1_MAX * 2.0**-126), E2M1_MAX)
    inverse = torch.ldexp(torch.ones_like(w), -exponent.repeat_interleave(group, 1)[:, : w.shape[1]])
    x = (w * inverse).clamp(-E2M1_MAX, E2M1_MAX)
    magnitude = x.abs()
    # count the midpoints between levels k and k+1 that |x| passes; a tie goes to the even code, so it
    # rounds up only from an odd k
    code = torch.zeros(w.shape, dtype=torch.uint8, device=w.device)
    for k, midpoint in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)):
        code += (magnitude >= midpoint) if k % 2 else (magnitude > midpoint)
    code |= torch.signbit(x).to(torch.uint8) << 3
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), _exponent_to_e8m0(exponent)
