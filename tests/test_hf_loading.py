"""from_pretrained as transformers users call it: backend overrides merged with the defaults (also through the
Auto classes), device / device_map placements, the Hub download options, unknown keywords; the config's
top-level attributes."""

import pytest
import torch
from conftest import golden_dir, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from deepseek_v41 import DeepseekV41Config
from deepseek_v41.backends import DEFAULT_BACKEND
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype, resolve_device_map

IDS = torch.randint(3, 1024, (1, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def snapshot():
    return golden_dir("v41_tiny_text") / "snapshot"


@pytest.fixture(scope="module")
def reference(snapshot):
    model = DeepseekV41ForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    with torch.no_grad():
        return model(IDS).logits


def test_partial_backend_through_the_auto_class(snapshot, reference):
    model = AutoModelForCausalLM.from_pretrained(snapshot, backend={"experts": "torch"}, dtype=torch.float32)
    assert model.config.backend == {**DEFAULT_BACKEND, "experts": "torch"}
    assert not model.layers[0].ffn.experts.grouped
    with torch.no_grad():
        # measured 0 (1 and 2 threads); gate 4 fp32 ulps of the largest logit (8.2): another experts backend
        torch.testing.assert_close(model(IDS).logits, reference, rtol=0, atol=4e-6)


def test_misspelt_backend_is_a_value_error_on_every_path(snapshot):
    for load in (AutoModelForCausalLM.from_pretrained, DeepseekV41ForCausalLM.from_pretrained,
                 AutoConfig.from_pretrained):
        with pytest.raises(ValueError, match=r"unknown experts backend 'bogus'; registered experts backends"):
            load(snapshot, backend={"experts": "bogus"})
    config = tiny_config()
    with pytest.raises(ValueError, match="unknown backend kind"):
        config.backend = {"expert": "torch"}
    config.backend = {"head": "bf16x3"}  # any assignment is merged with the defaults
    assert config.backend == {**DEFAULT_BACKEND, "head": "bf16x3"}
    assert DeepseekV41Config.from_dict(config.to_dict()).backend == config.backend


def test_top_level_attributes_come_from_the_text_config():
    config = tiny_config()
    text = config.text_config
    assert config.get_text_config() is text
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                 "rms_norm_eps"):
        assert getattr(config, name) == getattr(text, name), name
    config.vocab_size = 2048
    assert text.vocab_size == 2048
    assert "vocab_size" not in config.to_dict()  # serialized once, inside text_config
    assert config.to_dict()["text_config"]["vocab_size"] == 2048


def test_device_map_dict_on_cpu_matches(snapshot, reference):
    layers = {f"layers.{i}": "cpu" for i in range(9)}
    model = DeepseekV41ForCausalLM.from_pretrained(
        snapshot, dtype=torch.float32, device_map={"embed": "cpu", **layers, "norm": "cpu", "head": "cpu"}
    )
    assert model.hf_device_map["layers.3"] == "cpu"
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, reference, rtol=0, atol=0)


def test_device_map_validation():
    config = tiny_config(text={"engram_layer_ids": [], "engram_num_embeddings": []})
    with torch.device("meta"), default_dtype(torch.float32):
        model = DeepseekV41ForCausalLM(config)
    assert resolve_device_map(model, "cpu", torch.float32) == {"": torch.device("cpu")}
    assert resolve_device_map(model, 0, torch.float32) == {"": torch.device("cuda:0")}
    planned = resolve_device_map(model, "auto", torch.float32)  # accelerate's planner: CPU only here
    assert {d.type for d in planned.values()} == {"cpu"}
    with pytest.raises(ValueError, match=r"splits block 'layers.3' \(DeepseekV41Block is in _no_split_modules\)"):
        resolve_device_map(model, {"": "cpu", "layers.3.attn": "cpu"}, torch.float32)
    with pytest.raises(ValueError, match=r"places no device for \['head.weight'\]"):
        resolve_device_map(model, {"embed": "cpu", "layers": "cpu", "norm": "cpu"}, torch.float32)
    with pytest.raises(ValueError, match="names no module or parameter"):
        resolve_device_map(model, {"": "cpu", "blocks.0": "cpu"}, torch.float32)
    with pytest.raises(ValueError, match="offloading is out of scope"):
        resolve_device_map(model, {"": "cpu", "head": "disk"}, torch.float32)


def test_hub_options_reach_the_download(snapshot, monkeypatch):
    import huggingface_hub

    seen = {}

    def fake_download(repo_id, **options):
        seen.update(options, repo_id=repo_id)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    options = {"revision": "v1", "cache_dir": "/tmp/hub-cache", "local_files_only": True, "token": "hf_x",
               "force_download": False}
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bogus_option'\]"):
        DeepseekV41ForCausalLM.from_pretrained("deepseek-ai/some-repo", bogus_option=1, **options)
    assert seen == {"repo_id": "deepseek-ai/some-repo", **options}


def test_unsupported_options_are_clear_errors(snapshot):
    with pytest.raises(ValueError, match="safetensors files only"):
        DeepseekV41ForCausalLM.from_pretrained(snapshot, use_safetensors=False)
    with pytest.raises(ValueError, match="not both"):
        DeepseekV41ForCausalLM.from_pretrained(snapshot, device="cpu", device_map="cpu")
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['devicemap'\]"):
        AutoModelForCausalLM.from_pretrained(snapshot, devicemap="cpu")
