"""Decoders and encoders of the released FP8 / FP4 / Engram formats (architecture.md §12.1).

Compared bit for bit with slow element-wise references written here from the format definitions
(bit fields, not torch casts), on ragged shapes and scale edge cases, and on the golden tiny snapshots.
"""

import bisect
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import golden_dir

import deepseek_v41.release_format as release_format_module
from deepseek_v41.checkpoint import ReleasedCheckpoint, read_safetensors_header
from deepseek_v41.release_format import (
    decode_fp4_packed,
    decode_fp8_blockwise,
    decode_fp8_rows,
    e8m0_to_float,
    encode_fp4_packed,
    encode_fp8_blockwise,
    encode_fp8_rows,
)

GOLDEN_FIXTURES = ("v41_tiny_text", "v41_tiny_vision")


def golden_snapshot(fixture: str) -> Path:
    return golden_dir(fixture) / "snapshot"


# ---- slow references, one element at a time, from the bit layouts ------------------------------------


def ref_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    assert not (exponent == 15 and mantissa == 7), "E4M3 NaN"
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def ref_e2m1(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def ref_e8m0(byte: int) -> float:
    return 2.0 ** (byte - 127)


def ref_pow2_exponent(amax: float, level_max: float) -> int:
    mantissa, exponent = math.frexp(amax / level_max)  # exact ceil(log2(.))
    return exponent - 1 if mantissa == 0.5 else exponent


def ref_round_magnitude(x: float, magnitudes: list[float]) -> int:
    """Code of the level nearest to |x| (levels ascending, code = index); a tie goes to the even code."""
    hi = bisect.bisect_left(magnitudes, x)
    if hi == 0:
        return 0
    if hi == len(magnitudes):
        return len(magnitudes) - 1
    below, above = x - magnitudes[hi - 1], magnitudes[hi] - x
    if below == above:
        return hi if hi % 2 == 0 else hi - 1
    return hi if above < below else hi - 1


E4M3_MAGNITUDES = [ref_e4m3(c) for c in range(0x7F)]  # codes 0..126, ascending
E2M1_MAGNITUDES = [ref_e2m1(c) for c in range(8)]


def sign_bit(x: float) -> int:
    return 1 if math.copysign(1.0, x) < 0 else 0


def ref_encode_fp8(w: torch.Tensor, bo: int, bi: int) -> tuple[list[list[int]], list[list[int]]]:
    rows, cols = w.shape
    grid = [[0] * -(-cols // bi) for _ in range(-(-rows // bo))]
    q = [[0] * cols for _ in range(rows)]
    values = w.tolist()
    for br in range(len(grid)):
        for bc in range(len(grid[0])):
            cells = [(i, j) for i in range(br * bo, min(rows, br * bo + bo))
                     for j in range(bc * bi, min(cols, bc * bi + bi))]
            amax = max(max(abs(values[i][j]) for i, j in cells), 1e-4)
            exponent = ref_pow2_exponent(amax, 448.0)
            grid[br][bc] = exponent + 127
            for i, j in cells:
                x = min(max(values[i][j] / 2.0**exponent, -448.0), 448.0)
                q[i][j] = ref_round_magnitude(abs(x), E4M3_MAGNITUDES) | (sign_bit(x) << 7)
    return q, grid


def ref_encode_fp4(w: torch.Tensor, group: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    rows, cols = w.shape
    packed = [[0] * (cols // 2) for _ in range(rows)]
    scales = [[0] * -(-cols // group) for _ in range(rows)]
    values = w.tolist()
    for i in range(rows):
        codes = [0] * cols
        for g in range(len(scales[i])):
            span = range(g * group, min(cols, g * group + group))
            amax = max(max(abs(values[i][j]) for j in span), 6.0 * 2.0**-126)
            exponent = ref_pow2_exponent(amax, 6.0)
            scales[i][g] = exponent + 127
            for j in span:
                x = min(max(values[i][j] / 2.0**exponent, -6.0), 6.0)
                codes[j] = ref_round_magnitude(abs(x), E2M1_MAGNITUDES) | (sign_bit(x) << 3)
        for k in range(cols // 2):
            packed[i][k] = codes[2 * k] | (codes[2 * k + 1] << 4)
    return packed, scales


def ref_decode_fp8(q: torch.Tensor, scale: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    qb, sb = q.view(torch.uint8).tolist(), scale.view(torch.uint8).tolist()
    out = [[ref_e4m3(qb[i][j]) * ref_e8m0(sb[i // bo][j // bi]) for j in range(q.shape[1])] for i in range(q.shape[0])]
    return torch.tensor(out, dtype=torch.float64).reshape(q.shape).float()


def ref_decode_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    pb, sb = packed.view(torch.uint8).tolist(), scale.view(torch.uint8).tolist()
    rows, cols = packed.shape[0], 2 * packed.shape[1]

    def code(i, j):
        byte = pb[i][j // 2]
        return byte & 0xF if j % 2 == 0 else byte >> 4

    out = [[ref_e2m1(code(i, j)) * ref_e8m0(sb[i][j // group]) for j in range(cols)] for i in range(rows)]
    return torch.tensor(out, dtype=torch.float64).reshape(rows, cols).float()


def as_bytes(t: torch.Tensor) -> list[list[int]]:
    return t.view(torch.uint8).tolist()


# ---- weights with scale edge cases --------------------------------------------------------------------


def make_weight(shape, case: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    if case == "normal":
        return w * 0.02
    if case == "tiny":  # below the amax floor: scale 2^-22, many codes underflow to subnormals / zero
        return w * 1e-7
    if case == "huge":  # close to and at the E4M3 maximum after scaling
        w = w * 3e4
        w.view(-1)[0] = 448.0 * 2.0**10
        return w
    if case == "zeros":
        return torch.zeros(shape)
    if case == "outlier":  # one huge value: the rest of its block underflows
        w = w * 1e-3
        w.view(-1)[w.numel() // 2] = 1e4
        return w
    if case == "ties":  # exact midpoints between representable values at scale 1
        values = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0, 0.0, -0.0, 17.0, 19.0, 448.0])
        return values[torch.arange(math.prod(shape)) % len(values)].reshape(shape)
    raise ValueError(case)


CASES = ["normal", "tiny", "huge", "zeros", "outlier", "ties"]
FP8_SHAPES = [(70, 45), (33, 1), (1, 33), (64, 64)]
FP4_SHAPES = [(70, 46), (33, 2), (1, 34), (64, 64)]  # packing needs an even width


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_blockwise_round_trip_is_bit_exact(shape, case):
    w = make_weight(shape, case)
    q, scale = encode_fp8_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert tuple(scale.shape) == (math.ceil(shape[0] / 32), math.ceil(shape[1] / 32))
    ref_q, ref_scale = ref_encode_fp8(w, 32, 32)
    assert as_bytes(scale) == ref_scale
    assert as_bytes(q) == ref_q
    decoded = decode_fp8_blockwise(q, scale)
    assert decoded.dtype == torch.float32
    assert torch.equal(decoded, ref_decode_fp8(q, scale, 32, 32))
    assert torch.equal(decode_fp8_blockwise(q, scale, dtype=torch.bfloat16), decoded.bfloat16())
    # codes times a power of two: every decoded value is a bf16 value
    assert torch.equal(decoded.bfloat16().float(), decoded)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", FP4_SHAPES)
def test_fp4_packed_round_trip_is_bit_exact(shape, case):
    w = make_weight(shape, case)
    packed, scale = encode_fp4_packed(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (shape[0], shape[1] // 2)
    assert tuple(scale.shape) == (shape[0], math.ceil(shape[1] / 32))
    ref_packed, ref_scale = ref_encode_fp4(w)
    assert as_bytes(scale) == ref_scale
    assert as_bytes(packed) == ref_packed
    decoded = decode_fp4_packed(packed, scale)
    assert torch.equal(decoded, ref_decode_fp4(packed, scale))
    assert torch.equal(decode_fp4_packed(packed, scale, dtype=torch.bfloat16), decoded.bfloat16())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_rows_round_trip_and_row_ranges(shape, case):
    w = make_weight(shape, case)
    q, scale = encode_fp8_rows(w)
    assert tuple(scale.shape) == (shape[0], math.ceil(shape[1] / 32))
    ref_q, ref_scale = ref_encode_fp8(w, 1, 32)
    assert as_bytes(scale) == ref_scale and as_bytes(q) == ref_q
    full = decode_fp8_rows(q, scale)
    assert torch.equal(full, ref_decode_fp8(q, scale, 1, 32))
    rows = slice(shape[0] // 3, shape[0] // 3 + max(1, shape[0] // 2))
    assert torch.equal(decode_fp8_rows(q, scale, rows=rows), full[rows])


def test_decoded_values_are_close_to_the_weights():
    w = make_weight((96, 160), "normal")
    fp8 = decode_fp8_blockwise(*encode_fp8_blockwise(w))
    fp4 = decode_fp4_packed(*encode_fp4_packed(w))
    # the formats' rounding bounds; measured 0.045 and 0.174 of the max (1 and 2 threads): 1.4x
    assert (fp8 - w).abs().max() <= w.abs().max() * 2.0**-4
    assert (fp4 - w).abs().max() <= w.abs().max() * 0.25
    assert (fp4 - w).abs().max() > (fp8 - w).abs().max()  # FP4 is the coarser format


def test_fp4_nibble_order_and_sign():
    # byte 0x2F: low nibble 0xF (-6) is element 0, high nibble 0x2 (1.0) is element 1
    packed = torch.tensor([[0x2F, 0x98 - 256]], dtype=torch.int8)
    scale = torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    decoded = decode_fp4_packed(packed, scale)
    assert decoded.tolist() == [[-6.0, 1.0, -0.0, -0.5]]
    assert math.copysign(1.0, decoded[0, 2].item()) < 0


def test_ties_round_to_the_even_code():
    # FP4 at scale 1 (group amax 6): midpoints go to the level with the even code
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0, 0.3, -0.0]])
    decoded = decode_fp4_packed(*encode_fp4_packed(w))
    assert decoded.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, 0.5, -0.0]]
    # FP8 at scale 1 (block amax 448): 17 lies between 16 (even mantissa) and 18, 19 between 18 and 20
    w = torch.tensor([[448.0, 17.0, 19.0, -17.0, 0.0009765625 * 1.5]])
    decoded = decode_fp8_blockwise(*encode_fp8_blockwise(w))
    assert decoded.tolist() == [[448.0, 16.0, 20.0, -16.0, 0.001953125]]


def test_block_size_comes_from_the_argument_not_the_shapes():
    # 48 rows with a [2, 1] grid: a decoder inferring the block as 48 // 2 = 24 gets rows 24..31 wrong
    w = make_weight((48, 32), "normal")
    w[32:] *= 64
    q, scale = encode_fp8_blockwise(w)
    assert torch.equal(decode_fp8_blockwise(q, scale), ref_decode_fp8(q, scale, 32, 32))
    with pytest.raises(ValueError, match="ceil grid"):
        decode_fp8_blockwise(q, scale[:1])


def test_e8m0_scales_and_legacy_f32_scales():
    bytes_ = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    assert e8m0_to_float(bytes_.view(torch.float8_e8m0fnu)).tolist() == [2.0 ** (b - 127) for b in bytes_.tolist()]
    with pytest.raises(ValueError, match="NaN byte 255"):
        e8m0_to_float(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    w = make_weight((70, 45), "normal")
    q, scale = encode_fp8_blockwise(w)
    f32_scale = scale.float()  # V4-Flash-Base style: F32 scales holding the same multipliers
    assert torch.equal(decode_fp8_blockwise(q, f32_scale), decode_fp8_blockwise(q, scale))
    packed, scale4 = encode_fp4_packed(make_weight((70, 46), "normal"))
    assert torch.equal(decode_fp4_packed(packed, scale4.float()), decode_fp4_packed(packed, scale4))
    # a non-power-of-two F32 scale is applied in fp32 before any bf16 rounding
    odd = torch.full_like(f32_scale, 1.1)
    assert torch.equal(decode_fp8_blockwise(q, odd, dtype=torch.bfloat16), (q.float() * 1.1).bfloat16())


def test_decode_into_out_and_row_steps_match_the_reference_formula(monkeypatch):
    # the CPU decoder works in cache-sized row steps: make them small and ragged here (1000 = 7 x 137 + 41)
    monkeypatch.setattr(release_format_module, "_CPU_CHUNK_ELEMENTS", 137 * 1312 // torch.get_num_threads())
    w = make_weight((1000, 1312), "normal", seed=3)
    q, scale = encode_fp8_blockwise(w)
    expected = q.float() * scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)[:1000, :1312]
    out = torch.empty(1000, 1312, dtype=torch.bfloat16)
    assert decode_fp8_blockwise(q, scale, out=out) is out
    assert torch.equal(out, expected.bfloat16())
    packed, scale4 = encode_fp4_packed(w)
    lut = torch.tensor([ref_e2m1(c) for c in range(16)])
    nibbles = torch.stack([packed.view(torch.uint8) & 0xF, packed.view(torch.uint8) >> 4], -1).reshape(1000, 1312)
    expected4 = lut[nibbles.long()] * scale4.float().repeat_interleave(32, 1)[:, :1312]
    assert torch.equal(decode_fp4_packed(packed, scale4), expected4)


# ---- the golden tiny snapshots --------------------------------------------------------------------------


def expected_scale_shape(name: str, dtype: str, shape) -> list[int]:
    rows, cols = shape
    if dtype == "I8":  # packed FP4 expert: per row, per 32 unpacked columns
        return [rows, math.ceil(2 * cols / 32)]
    if name.endswith("engram.embed.weight"):  # Engram table: per row, per 32 columns
        return [rows, math.ceil(cols / 32)]
    return [math.ceil(rows / 32), math.ceil(cols / 32)]  # FP8 linear: 32x32 blocks


@pytest.mark.parametrize("fixture", GOLDEN_FIXTURES)
def test_golden_snapshot_decodes_exactly_to_bf16(fixture):
    snapshot = golden_snapshot(fixture)
    weight_map = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    headers = {}
    for file in set(weight_map.values()):
        headers.update(read_safetensors_header(snapshot / file))
    assert set(headers) == set(weight_map)
    checkpoint = ReleasedCheckpoint(snapshot)
    assert checkpoint.is_quantized
    quantized = 0
    for name, record in headers.items():
        if name.endswith(".scale"):
            continue
        stored = checkpoint.tensors[name]
        scale = headers.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            assert record.dtype in ("BF16", "F32"), name
            assert checkpoint.decode(name).dtype == {"BF16": torch.bfloat16, "F32": torch.float32}[record.dtype]
            continue
        quantized += 1
        assert record.dtype in ("F8_E4M3", "I8") and scale.dtype == "F8_E8M0", name
        assert list(scale.shape) == expected_scale_shape(name, record.dtype, record.shape), name
        decoded = checkpoint.decode(name)
        width = 2 * record.shape[1] if record.dtype == "I8" else record.shape[1]
        assert tuple(decoded.shape) == (record.shape[0], width), name
        assert torch.isfinite(decoded).all(), name
        assert torch.equal(decoded.bfloat16().float(), decoded), f"{name} is not exactly representable in bf16"
        # independent vectorised formula
        q, s = checkpoint.read_raw(record).view(torch.uint8), checkpoint.read_raw(scale).float()
        if record.dtype == "I8":
            codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(record.shape[0], width)
            lut = torch.tensor([ref_e2m1(c) for c in range(16)])
            expected = lut[codes.long()] * s.repeat_interleave(32, 1)[:, :width]
        else:
            lut = torch.tensor([ref_e4m3(c) if (c & 0x7F) != 0x7F else float("nan") for c in range(256)])
            rows = 1 if name.endswith("engram.embed.weight") else 32
            expected = lut[q.long()] * s.repeat_interleave(rows, 0).repeat_interleave(32, 1)[: q.shape[0], :width]
        assert torch.equal(decoded, expected), name
        assert stored.fmt == {"I8": "fp4"}.get(record.dtype, "fp8_rows" if rows == 1 else "fp8_block")
    assert quantized == sum(1 for n in headers if n.endswith(".scale"))


def test_reencoding_the_golden_values_reproduces_the_released_bytes():
    """Our encoders make the release's scale and rounding choices.

    Re-encoding a decoded block is byte-identical unless the block's largest code had rounded down onto
    the next power of two (FP8: |q|max = 224; FP4: |code|max <= 3), where the scale legitimately halves.
    """
    checkpoint = ReleasedCheckpoint(golden_snapshot("v41_tiny_vision"))
    compared = {"fp8_block": 0, "fp8_rows": 0, "fp4": 0}
    checked = groups = 0
    for name, stored in checkpoint.tensors.items():
        if stored.fmt == "plain":
            continue
        decoded = checkpoint.decode(name)
        q, scale = checkpoint.read_raw(stored.record), checkpoint.read_raw(stored.scale)
        encode = {"fp8_block": encode_fp8_blockwise, "fp8_rows": encode_fp8_rows, "fp4": encode_fp4_packed}[stored.fmt]
        q2, scale2 = encode(decoded)
        same_scale = scale2.view(torch.uint8) == scale.view(torch.uint8)
        if stored.fmt == "fp4":
            magnitude = torch.maximum(q.view(torch.uint8) & 7, (q.view(torch.uint8) >> 4) & 7)
            full_range = magnitude.unflatten(1, (-1, 16)).amax(-1) >= 6  # a code of 4.0 or 6.0 in the group
            same_codes = (q2.view(torch.uint8) == q.view(torch.uint8)).unflatten(1, (-1, 16)).all(-1)
        else:
            bo = 1 if stored.fmt == "fp8_rows" else 32
            padded = torch.nn.functional.pad(q.float().abs(), (0, -q.shape[1] % 32, 0, -q.shape[0] % bo))
            full_range = padded.unflatten(1, (-1, 32)).unflatten(0, (-1, bo)).amax(dim=(1, 3)) > 224
            same = torch.nn.functional.pad((q2.view(torch.uint8) == q.view(torch.uint8)).float(),
                                           (0, -q.shape[1] % 32, 0, -q.shape[0] % bo), value=1.0)
            same_codes = same.unflatten(1, (-1, 32)).unflatten(0, (-1, bo)).amin(dim=(1, 3)).bool()
        assert same_scale[full_range].all() and same_codes[full_range].all(), name
        checked += int(full_range.sum())
        groups += full_range.numel()
        decode_again = {"fp8_block": decode_fp8_blockwise, "fp8_rows": decode_fp8_rows, "fp4": decode_fp4_packed}
        assert torch.equal(decode_again[stored.fmt](q2, scale2), decoded), name
        compared[stored.fmt] += 1
    assert all(compared.values()), compared
    assert checked > 0.5 * groups, (checked, groups)  # most blocks are compared byte for byte


def test_golden_row_ranges_decode_only_those_rows():
    checkpoint = ReleasedCheckpoint(golden_snapshot("v41_tiny_text"))
    for name, rows in [("layers.4.engram.embed.weight", slice(1000, 1033)),
                       ("layers.1.attn.wq_b.weight", slice(33, 100)),
                       ("layers.5.ffn.experts.3.w2.weight", slice(3, 7)),
                       ("embed.weight", slice(129270, 129280))]:
        full = checkpoint.decode(name)
        assert torch.equal(checkpoint.decode(name, rows), full[rows]), name
