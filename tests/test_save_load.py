"""save_pretrained / from_pretrained round trips, the remote-code path (model and processor) without the package,
expert un-stacking."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open

from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype

IDS = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, v4_tokenizer):
    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16).eval()
    folder = tmp_path_factory.mktemp("export") / "tiny"
    model.save_pretrained(folder)
    return model, folder


def test_save_reload_is_exact(exported):
    model, folder = exported
    reloaded = DeepseekV41ForCausalLM.from_pretrained(folder)
    assert reloaded.config.backend == model.config.backend
    for (name, a), (name_b, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reloaded(IDS).logits)


def test_export_layout(exported):
    model, folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForImageTextToText"}
    assert config["text_config"]["rope_scaling"]["rope_type"] == "yarn"
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.3.ffn.experts.5.w2.weight" in index and "layers.3.ffn.experts.w2" not in index
    with safe_open(str(folder / index["layers.3.ffn.experts.5.w2.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("layers.3.ffn.experts.5.w2.weight"), model.layers[3].ffn.experts.w2[5])
    with safe_open(str(folder / index["head.weight"]), "pt") as f:
        assert f.get_tensor("head.weight").dtype == torch.float32
        assert f.get_tensor("layers.0.hc_attn_fn").dtype == torch.float32
    for required in ("modeling_deepseek_v41.py", "configuration_deepseek_v41.py", "attention.py", "tokenizer.json",
                     "processor_config.json", "processing_deepseek_v41.py", "image_processing_deepseek_v41.py"):
        assert (folder / required).is_file(), required


REMOTE = textwrap.dedent("""
    import sys, torch
    sys.modules["deepseek_v41"] = None  # the package must not be importable: everything comes from the folder
    from transformers import AutoModel, AutoModelForCausalLM
    folder, out = sys.argv[1], sys.argv[2]
    ids = torch.load(out + ".ids")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    backbone = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert not hasattr(backbone, "head")
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    assert type(processor).__module__.startswith("transformers_modules"), type(processor).__module__
    assert processor(text=["hello"], return_tensors="pt")["input_ids"].shape[0] == 1
    with torch.no_grad():
        torch.save(model(ids).logits, out)
""")


def test_remote_code_load_without_the_package(exported, tmp_path):
    model, folder = exported
    out = tmp_path / "logits.pt"
    torch.save(IDS, str(out) + ".ids")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", REMOTE, str(folder), str(out)], check=False, cwd=tmp_path,
                            env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(out), model(IDS).logits)


def test_remote_code_files_need_no_gpu_package():
    """Every backend's module travels with save_pretrained, and none makes transformers' remote-code import
    check demand an optional package (those imports sit in try blocks, which the check skips)."""
    from transformers.dynamic_module_utils import get_imports

    from deepseek_v41.modeling_deepseek_v41 import remote_code_files

    names = {f.name for f in remote_code_files()}
    assert {"kernels_tilelang.py", "kernels_triton.py", "mhc_tile_kernels.py", "mhc.py", "quantization.py",
            "engram.py", "sparse_attention_cuda.py", "sparse_attention_cuda_bwd.py", "cuda_module.py"} <= names
    # accelerate: only device_map="auto"/"balanced" plans with it; a plain load must not demand it
    optional = {"tilelang", "tile_kernels", "transformer_engine", "deep_ep", "triton", "accelerate"}
    for file in remote_code_files():
        assert not optional & set(get_imports(str(file))), file.name


def test_backend_override_at_load(exported):
    _, folder = exported
    model = DeepseekV41ForCausalLM.from_pretrained(folder, backend={"rms_norm": "torch", "experts": "torch"})
    assert model.config.backend["rms_norm"] == "torch" and model.config.backend["experts"] == "torch"
    assert model.norm.backend == "torch" and model.layers[0].ffn.experts.grouped is False
    with pytest.raises(ValueError, match="registered experts backends"):
        DeepseekV41ForCausalLM.from_pretrained(folder, backend={"experts": "cuda_magic"})


def test_meta_built_and_materialized_equals_eager(exported, v4_tokenizer):
    model, _ = exported
    with torch.device("meta"), default_dtype(torch.bfloat16):
        meta = DeepseekV41ForCausalLM(model.config, tokenizer=v4_tokenizer)
    meta.to_empty(device="cpu")
    meta.load_state_dict(model.state_dict())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, meta.get_buffer(name)), f"buffer {name} not restored after to_empty"
    with torch.no_grad():
        assert torch.equal(meta.eval()(IDS).logits, model(IDS).logits)


def test_ds41_checkpoint_names_the_default_snapshot(exported, monkeypatch):
    _, folder = exported
    monkeypatch.setenv("DS41_CHECKPOINT", str(folder))
    assert DeepseekV41ForCausalLM.from_pretrained().config._name_or_path == str(folder)
    monkeypatch.delenv("DS41_CHECKPOINT")
    with pytest.raises(ValueError, match="DS41_CHECKPOINT"):
        DeepseekV41ForCausalLM.from_pretrained()
