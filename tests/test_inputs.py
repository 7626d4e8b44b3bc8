"""Every input the model cannot compute correctly is rejected with an error that says what to do."""

import pytest
import torch
from conftest import tiny_model


@pytest.fixture(scope="module")
def model(v4_tokenizer):
    return tiny_model(v4_tokenizer).eval()


IDS = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(0))


def test_holes_in_the_attention_mask(model):  # left and right padding are supported (test_generation.py)
    mask = torch.ones_like(IDS)
    mask[0, 4:8] = 0
    with pytest.raises(ValueError, match="holes"):
        model(IDS, attention_mask=mask)


def test_non_zero_based_positions(model):
    with pytest.raises(ValueError, match="zero-based and contiguous"):
        model(IDS, position_ids=torch.arange(1, 33).expand(2, -1))


def test_non_contiguous_positions(model):
    positions = torch.arange(32).expand(2, -1).clone()
    positions[:, 16:] = torch.arange(16)  # two packed sequences
    with pytest.raises(ValueError, match="zero-based and contiguous"):
        model(IDS, position_ids=positions)


def test_packed_thd_inputs(model):
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(IDS.flatten())
    with pytest.raises(ValueError, match="packed"):
        model(IDS, cu_seqlens=torch.tensor([0, 16, 32]))


def test_attention_mask_shape_mismatch(model):
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(IDS, attention_mask=torch.ones(2, 31, dtype=torch.long))


def test_input_ids_dtype(model):
    with pytest.raises(ValueError, match="integer tensor"):
        model(IDS.float())


def test_labels_of_the_wrong_shape(model):
    with pytest.raises(ValueError, match="labels have shape"):
        model(IDS, labels=IDS[:, :-1])


def test_sequence_longer_than_configured(v4_tokenizer):
    short = tiny_model(v4_tokenizer, text={"max_position_embeddings": 16})
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=16"):
        short(IDS)


def test_million_token_training_is_out_of_scope(v4_tokenizer):
    model = tiny_model(v4_tokenizer, text={"rope_scaling": {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 16}})
    with pytest.raises(NotImplementedError, match="context parallelism"):
        model(IDS)


def test_a_foreign_cache_is_refused(model):  # use_cache=True returns a DeepseekV41Cache (test_generation.py)
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="DeepseekV41Cache"):
        model(IDS, past_key_values=DynamicCache())


def test_dspark_is_not_implemented(model):
    with pytest.raises(NotImplementedError, match="DSpark"):
        model(IDS, dspark=True)


def test_tensor_parallel_loading_is_not_implemented(tmp_path):
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    with pytest.raises(NotImplementedError, match="tensor/pipeline/context parallelism"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path, tp_plan="auto")


def test_vision_tokens_without_a_tower(model):
    types = torch.full_like(IDS, -1)
    types[0, 3:8] = 1
    with pytest.raises(ValueError, match="no vision tower"):
        model(IDS, vision_token_types=types)


def test_vision_token_types_shape(model):
    with pytest.raises(ValueError, match="vision_token_types has shape"):
        model(IDS, vision_token_types=torch.full((2, 31), -1))


def test_engram_without_tokenizer_is_a_clear_error():
    from conftest import tiny_config

    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    with pytest.raises(ValueError, match="pass tokenizer="):
        DeepseekV41ForCausalLM(tiny_config())
