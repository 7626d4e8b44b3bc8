"""Bad checkpoints fail early with a message naming the tensor and the file, and leave no export behind.

Each test writes a small released-format checkpoint for a fake model whose parameter names follow the
model contract (released names, routed experts stacked per layer), breaks one thing, and checks both
`load_checkpoint_into_model` and the conversion tool (`conversion/convert_checkpoint.py`).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import add_nested_parameters
from torch import nn

from deepseek_v41.checkpoint import (
    CheckpointError,
    load_checkpoint_into_model,
    released_to_model_name,
    write_safetensors,
)
from deepseek_v41.hf_export import local_source, write_export
from deepseek_v41.release_format import encode_fp4_packed, encode_fp8_blockwise, encode_fp8_rows

REPO = Path(__file__).resolve().parents[1]
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                "weight_block_size": [32, 32], "expert_dtype": "fp4"}
TEXT_CONFIG = {"hidden_size": 32, "num_hidden_layers": 1, "n_routed_experts": 3, "moe_intermediate_size": 40}


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"conversion_{name}", REPO / "conversion" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = load_tool("convert_checkpoint").convert


def released_tensors() -> dict[str, torch.Tensor]:
    """A one-layer model in released formats, with ragged FP8 shapes (48 rows: a partial 32-row block)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g) * 0.1

    t = {"embed.weight": randn(40, 32).bfloat16(), "norm.weight": (1 + randn(32)).bfloat16()}
    t["layers.0.attn.wq_a.weight"], t["layers.0.attn.wq_a.scale"] = encode_fp8_blockwise(randn(48, 32))
    t["layers.0.attn.attn_sink"] = randn(4)
    t["layers.0.hc_attn_fn"] = randn(24, 128)
    for e in range(3):
        p = f"layers.0.ffn.experts.{e}"
        t[f"{p}.w1.weight"], t[f"{p}.w1.scale"] = encode_fp4_packed(randn(40, 32))
        t[f"{p}.w2.weight"], t[f"{p}.w2.scale"] = encode_fp4_packed(randn(32, 40))
        t[f"{p}.w3.weight"], t[f"{p}.w3.scale"] = encode_fp4_packed(randn(40, 32))
    t["layers.0.engram.embed.weight"], t["layers.0.engram.embed.scale"] = encode_fp8_rows(randn(50, 64))
    return t


# model name -> (shape, dtype), following the naming contract
MODEL_SPEC = {
    "embed.weight": ((40, 32), torch.bfloat16),
    "norm.weight": ((32,), torch.bfloat16),
    "layers.0.attn.wq_a.weight": ((48, 32), torch.bfloat16),
    "layers.0.attn.attn_sink": ((4,), torch.float32),
    "layers.0.hc_attn_fn": ((24, 128), torch.float32),
    "layers.0.ffn.experts.w1": ((3, 40, 32), torch.bfloat16),
    "layers.0.ffn.experts.w2": ((3, 32, 40), torch.bfloat16),
    "layers.0.ffn.experts.w3": ((3, 40, 32), torch.bfloat16),
    "layers.0.engram.embed.weight": ((50, 64), torch.bfloat16),
}


class FakeModel(nn.Module):
    """Parameters named like `DeepseekV41ForCausalLM`'s, nested the same way (`layers.0.attn.wq_a.weight`)."""

    def __init__(self, spec=MODEL_SPEC, text_config=None, device="cpu"):
        super().__init__()
        add_nested_parameters(self, spec, device)
        if text_config is not None:
            self.config = type("Config", (), {"text_config": type("TextConfig", (), dict(text_config))()})()


def write_checkpoint(path: Path, tensors: dict, *, config=None, shards=2, index=True) -> Path:
    """Released layout: config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json."""
    path.mkdir(parents=True)
    config = {"model_type": "deepseek_v41", "quantization_config": QUANTIZATION, "text_config": TEXT_CONFIG} \
        if config is None else config
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors" if index else "model.safetensors"
        part = names[k::shards]
        write_safetensors(path / file, {n: tensors[n] for n in part})
        weight_map.update(dict.fromkeys(part, file))
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def shard_of(checkpoint: Path, name: str) -> Path:
    weight_map = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    return checkpoint / weight_map[name]


def assert_rejected(checkpoint: Path, tmp_path: Path, *fragments: str, text_config=None) -> str:
    """Loading and converting both fail naming every fragment; the export target is left untouched."""
    with pytest.raises(CheckpointError) as loading:
        load_checkpoint_into_model(FakeModel(text_config=text_config), checkpoint)
    message = str(loading.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    # an existing export must survive a failed conversion, and no temporary directory may remain
    out = tmp_path / "export"
    write_export([local_source("previous", torch.ones(2))], out, {"previous": True})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError):
        convert(checkpoint, out, build_model=lambda src: FakeModel(text_config=text_config, device="meta"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []
    return message


@pytest.fixture
def good(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "released", released_tensors())


def test_the_good_checkpoint_loads_and_converts(good, tmp_path):
    # the baseline every case below breaks
    model = FakeModel()
    report = load_checkpoint_into_model(model, good)
    assert len(report.loaded) == len(MODEL_SPEC) - 3 + 9 and not report.missing
    assert model.get_parameter("layers.0.ffn.experts.w2").abs().sum() > 0
    convert(good, tmp_path / "export", build_model=lambda src: FakeModel(device="meta"))
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()


def test_missing_shard(good, tmp_path):
    shard = shard_of(good, "layers.0.attn.wq_a.weight")
    shard.unlink()
    assert_rejected(good, tmp_path, shard.name, "does not exist", "'")


def test_truncated_safetensors(good, tmp_path):
    shard = shard_of(good, "embed.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    message = assert_rejected(good, tmp_path, str(shard), "truncated")
    assert "'" in message  # names the tensor that runs past the end


def test_corrupted_header(good, tmp_path):
    shard = shard_of(good, "norm.weight")
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\xff" * 12
    shard.write_bytes(bytes(data))
    assert_rejected(good, tmp_path, str(shard), "corrupted safetensors header", "'layers.")


def test_index_lists_a_tensor_its_shard_lacks(good, tmp_path):
    index = good / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["layers.0.attn.ghost.weight"] = content["weight_map"]["norm.weight"]
    index.write_text(json.dumps(content))
    assert_rejected(good, tmp_path, "'layers.0.attn.ghost.weight'", shard_of(good, "norm.weight").name)


def test_missing_tensor(tmp_path):
    tensors = released_tensors()
    del tensors["layers.0.attn.attn_sink"]
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.attn_sink'", "missing", "model.safetensors.index.json")


def test_missing_expert(tmp_path):
    tensors = released_tensors()
    del tensors["layers.0.ffn.experts.1.w3.weight"], tensors["layers.0.ffn.experts.1.w3.scale"]
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.ffn.experts.1.w3.weight'", "missing")


def test_unexpected_tensor(tmp_path):
    tensors = released_tensors()
    tensors["layers.0.attn.extra.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    shard = shard_of(checkpoint, "layers.0.attn.extra.weight")
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.extra.weight'", shard.name, "unexpected")


def test_wrong_shape(tmp_path):
    tensors = released_tensors()
    tensors["norm.weight"] = torch.ones(33, dtype=torch.bfloat16)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'norm.weight'", shard_of(checkpoint, "norm.weight").name, "[33]", "[32]")


def test_wrong_shape_of_a_stacked_expert(tmp_path):
    tensors = released_tensors()
    tensors["layers.0.ffn.experts.2.w1.weight"], tensors["layers.0.ffn.experts.2.w1.scale"] = \
        encode_fp4_packed(torch.randn(40, 64))
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.ffn.experts.2.w1.weight'", "'layers.0.ffn.experts.w1'[2]",
                    "[40, 64]", "[40, 32]")


def test_wrong_scale_shape(tmp_path):
    tensors = released_tensors()
    tensors["layers.0.attn.wq_a.scale"] = torch.full((2, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.wq_a.scale'",
                    shard_of(checkpoint, "layers.0.attn.wq_a.scale").name, "[2, 2]", "[2, 1]")


def test_wrong_dtype(tmp_path):
    tensors = released_tensors()
    tensors["layers.0.attn.attn_sink"] = torch.zeros(4, dtype=torch.int32)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.attn_sink'",
                    shard_of(checkpoint, "layers.0.attn.attn_sink").name, "wrong dtype")


def test_quantized_weight_without_its_scale(tmp_path):
    tensors = released_tensors()
    del tensors["layers.0.attn.wq_a.scale"]
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.wq_a.weight'",
                    shard_of(checkpoint, "layers.0.attn.wq_a.weight").name, "'layers.0.attn.wq_a.scale' is missing")


def test_scale_with_a_wrong_dtype(tmp_path):
    tensors = released_tensors()
    tensors["layers.0.attn.wq_a.scale"] = tensors["layers.0.attn.wq_a.scale"].float().bfloat16()
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.wq_a.scale'", "BF16")


def test_config_without_quantization_config_but_quantized_weights(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "released", released_tensors(),
                                  config={"model_type": "deepseek_v41", "text_config": TEXT_CONFIG})
    assert_rejected(checkpoint, tmp_path, "config.json", "no quantization_config", "quantized")


def test_config_expert_count_disagrees_with_the_weights(tmp_path):
    config = {"quantization_config": QUANTIZATION, "text_config": dict(TEXT_CONFIG, n_routed_experts=2)}
    checkpoint = write_checkpoint(tmp_path / "released", released_tensors(), config=config)
    message = assert_rejected(checkpoint, tmp_path, "config.json", "n_routed_experts = 2", "layers.0.ffn.experts.2.")
    assert ".safetensors" in message


def test_model_config_disagrees_with_the_checkpoint_config(good, tmp_path):
    assert_rejected(good, tmp_path, str(good / "config.json"), "text_config.hidden_size = 32", "64",
                    text_config=dict(TEXT_CONFIG, hidden_size=64))


def test_nan_scale_fails_while_streaming_and_leaves_no_export(tmp_path):
    # found only when the data is read: the conversion has started writing by then
    tensors = released_tensors()
    scale = tensors["layers.0.ffn.experts.2.w2.scale"].view(torch.uint8).clone()
    scale[5, 1] = 255
    tensors["layers.0.ffn.experts.2.w2.scale"] = scale.view(torch.float8_e8m0fnu)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.ffn.experts.2.w2.weight'", "NaN", ".safetensors")


def test_meta_model_must_be_materialized_first(good):
    with pytest.raises(CheckpointError, match=r"'embed.weight' is on the meta device.*to_empty"):
        load_checkpoint_into_model(FakeModel(device="meta"), good)


def test_keeping_formats_needs_kept_modules(good):
    # dequantize_base_checkpoint=False copies codes into kept modules (kept.py); floating-point targets are refused
    with pytest.raises(CheckpointError, match=r"stored quantized.*keep_release_formats.*dequantize_base_checkpoint=True"):
        load_checkpoint_into_model(FakeModel(), good, dequantize_base_checkpoint=False)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_checkpoint_into_model(FakeModel(), tmp_path / "empty")


def test_released_name_mapping_rejects_scales():
    assert released_to_model_name("layers.3.ffn.experts.17.w2.weight") == ("layers.3.ffn.experts.w2", 17)
    with pytest.raises(ValueError, match="no model counterpart"):
        released_to_model_name("layers.3.attn.wq_a.scale")


# ---- corrupt values and headers (issue 24): found before a wrong logit, naming the tensor and the file ----


def with_code(tensors: dict, name: str, index: tuple, byte: int) -> dict:
    # set one stored byte (an FP8 code or a UE8M0 scale) of a quantized tensor
    raw = tensors[name].view(torch.uint8).clone()
    raw[index] = byte
    tensors[name] = raw.view(tensors[name].dtype)
    return tensors


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_fp8_code(tmp_path, byte):
    tensors = with_code(released_tensors(), "layers.0.attn.wq_a.weight", (40, 7), byte)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.wq_a.weight'", f"NaN FP8 code {byte:#04x}", "[40, 7]",
                    shard_of(checkpoint, "layers.0.attn.wq_a.weight").name)


def test_nan_fp8_code_in_an_engram_table(tmp_path):
    tensors = with_code(released_tensors(), "layers.0.engram.embed.weight", (49, 63), 0x7F)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.engram.embed.weight'", "NaN FP8 code", "[49, 63]")


def test_scale_that_overflows_the_decoded_dtype(tmp_path):
    # 448 * 2^127 is past fp32's range: the decoded value is inf although every byte is a valid code
    tensors = released_tensors()
    tensors["layers.0.attn.wq_a.weight"] = torch.full((48, 32), 448.0).to(torch.float8_e4m3fn)
    tensors = with_code(tensors, "layers.0.attn.wq_a.scale", (0, 0), 254)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.wq_a.weight'", "inf", "overflows")


@pytest.mark.parametrize("name,index,value", [
    ("embed.weight", (7, 3), float("nan")),               # BF16
    ("norm.weight", (31,), float("-inf")),                 # BF16, last element
    ("layers.0.attn.attn_sink", (2,), float("inf")),       # F32
    ("layers.0.hc_attn_fn", (23, 127), float("nan")),      # F32, last element
])
def test_non_finite_plain_value(tmp_path, name, index, value):
    tensors = released_tensors()
    tensors[name][index] = value
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, f"{name!r}", str(list(index)), str(value).lstrip("-"),
                    shard_of(checkpoint, name).name)


def test_large_finite_values_whose_sum_overflows_still_load(tmp_path):
    # the fast check sums each block; an overflowing sum of finite values must not be reported as corruption
    tensors = released_tensors()
    tensors["embed.weight"][0, :4] = 3e38
    model = FakeModel()
    load_checkpoint_into_model(model, write_checkpoint(tmp_path / "released", tensors))
    assert model.get_parameter("embed.weight")[0, :4].isfinite().all()


@pytest.mark.parametrize("value", [-2.0**-10, float("nan"), float("inf")])
def test_bad_f32_scale(tmp_path, value):
    tensors = released_tensors()
    scale = tensors["layers.0.ffn.experts.1.w2.scale"].float()
    scale[3, 1] = value
    tensors["layers.0.ffn.experts.1.w2.scale"] = scale  # older releases' F32 scales
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.ffn.experts.1.w2.weight'", "F32 scale", str(value).lstrip("-"))


def test_legacy_f32_scales_still_load(tmp_path):
    tensors = released_tensors()
    for name in [n for n in tensors if n.endswith(".scale")]:
        tensors[name] = tensors[name].float()
    load_checkpoint_into_model(FakeModel(), write_checkpoint(tmp_path / "released", tensors))


def test_finite_check_opt_out(tmp_path, monkeypatch):
    tensors = released_tensors()
    tensors["embed.weight"][1, 1] = float("nan")
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    model = FakeModel()
    load_checkpoint_into_model(model, checkpoint, check_finite=False)
    assert model.get_parameter("embed.weight")[1, 1].isnan()
    monkeypatch.setenv("DEEPSEEK_V41_CHECK_FINITE", "0")
    load_checkpoint_into_model(FakeModel(), checkpoint)
    with pytest.raises(CheckpointError, match="holds nan"):  # the keyword wins over the environment
        load_checkpoint_into_model(FakeModel(), checkpoint, check_finite=True)
    monkeypatch.setenv("DEEPSEEK_V41_CHECK_FINITE", "no")
    with pytest.raises(ValueError, match="DEEPSEEK_V41_CHECK_FINITE='no'"):
        load_checkpoint_into_model(FakeModel(), checkpoint)


@pytest.mark.parametrize("name,stored", [
    ("norm.weight", torch.float16),                  # a BF16 tensor relabelled F16: same bytes, other values
    ("embed.weight", torch.float64),
    ("layers.0.attn.attn_sink", torch.float16),
    ("layers.0.hc_attn_fn", torch.int32),            # F32 bytes relabelled I32
])
def test_dtype_the_released_format_does_not_allow(tmp_path, name, stored):
    tensors = released_tensors()
    tensors[name] = tensors[name].to(stored)
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, f"{name!r}", shard_of(checkpoint, name).name, "BF16 or F32", "wrong dtype")


def test_fp4_is_only_for_routed_experts(tmp_path):
    tensors = released_tensors()
    tensors["layers.0.attn.wq_a.weight"], tensors["layers.0.attn.wq_a.scale"] = encode_fp4_packed(torch.randn(48, 32))
    checkpoint = write_checkpoint(tmp_path / "released", tensors)
    assert_rejected(checkpoint, tmp_path, "'layers.0.attn.wq_a.weight'", "packed FP4", "routed experts")


def edit_header(shard: Path, edit) -> None:
    """Rewrite a shard's safetensors header with `edit(header)`; the data bytes stay as they are."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])


def test_overlapping_byte_ranges(good, tmp_path):
    # two tensors of one size made to share bytes: each would read the other's values
    shard = shard_of(good, "layers.0.ffn.experts.0.w1.weight")
    names = [n for n, f in json.loads((good / "model.safetensors.index.json").read_text())["weight_map"].items()
             if f == shard.name and n.startswith("layers.0.ffn.experts.") and n.endswith(".w1.weight")]

    def overlap(header):
        header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])

    edit_header(shard, overlap)
    assert_rejected(good, tmp_path, str(shard), "overlap", names[0], names[1])


@pytest.mark.parametrize("offsets,shape,fragment", [
    ([0.0, 80.0], [40], "non-negative integers"),                # floats
    (["0", "80"], [40], "non-negative integers"),                # strings
    ([0, 80, 160], [40], "non-negative integers"),               # three offsets
    ([0, 80], [40.5], "non-negative integers"),                  # a float dimension
    ([0, 80], [-40], "non-negative integers"),
    ([0, 78], [40], "wrong length"),                             # size != shape x dtype
    ([1 << 40, (1 << 40) + 80], [40], "truncated"),              # past the end of the file
])
def test_corrupted_header_entry(good, tmp_path, offsets, shape, fragment):
    # norm.weight is BF16 [32]; its entry replaced by a broken one
    shard = shard_of(good, "norm.weight")

    def corrupt(header):
        header["norm.weight"]["data_offsets"] = offsets
        header["norm.weight"]["shape"] = shape

    edit_header(shard, corrupt)
    assert_rejected(good, tmp_path, str(shard), "'norm.weight'", fragment)
