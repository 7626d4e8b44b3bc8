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


def test_dspark_arguments_point_to_generate(model):
    with pytest.raises(ValueError, match=r"generate\(\.\.\., use_dspark=True\)"):
        model(IDS, dspark=True)
    with pytest.raises(ValueError, match="needs the DSpark draft stages: this model has none"):
        model(IDS, output_dspark_hidden=True)  # the tiny model is built with num_nextn_predict_layers 0


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


@pytest.mark.parametrize("bad_id", [-1, -100, 1024, 10**6])
def test_input_ids_outside_the_vocabulary(model, bad_id):
    ids = IDS.clone()
    ids[1, 5] = bad_id
    with pytest.raises(ValueError, match=rf"input_ids must be token ids in \[0, 1024\).*\[{bad_id}\]"):
        model(ids)


def test_out_of_vocabulary_id_under_the_padding_is_refused_too(model):
    # a padded position still goes through the embedding: pad with the pad id, not -100
    ids, mask = IDS.clone(), torch.ones_like(IDS)
    ids[0, 30:], mask[0, 30:] = -100, 0
    with pytest.raises(ValueError, match="pad with the pad token id"):
        model(ids, attention_mask=mask)


@pytest.mark.parametrize("shape", [(0, 32), (2, 0), (0, 0)])
def test_empty_batch_or_sequence(model, shape):
    with pytest.raises(ValueError, match="empty batch or a length-0 sequence"):
        model(torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("value", [2, -1])
def test_attention_mask_values_other_than_0_and_1(model, value):
    mask = torch.ones_like(IDS)
    mask[1, 3] = value
    with pytest.raises(ValueError, match=rf"only 0 \(padding\) and 1 \(token\); got \[{value}\]"):
        model(IDS, attention_mask=mask)


def test_float_attention_mask(model):
    with pytest.raises(ValueError, match="bool or integers, got torch.float32"):
        model(IDS, attention_mask=torch.full(IDS.shape, 0.5))


def test_bool_and_integer_masks_agree(model):
    """Every mask dtype is applied: a left-padded row's real tokens get the logits of the row without its padding
    (an ignored mask would give the unmasked run's, which differ), the other row those of the unmasked run."""
    mask = torch.ones_like(IDS)
    mask[0, :5] = 0
    with torch.no_grad():
        alone = model(IDS[:1, 5:]).logits[0]
        unmasked = model(IDS).logits
        outputs = [model(IDS, attention_mask=m).logits for m in (mask, mask.bool(), mask.int())]
    # the padding moves row 0's real tokens by far more than the fp32 round-off of the comparison below
    assert (unmasked[0, 5:] - alone).abs().max() > 1e-2
    for logits in outputs:
        # measured 2.1e-7 each (1 and 2 threads; the second 8.9e-8 at 1 thread); gates 3.8x
        torch.testing.assert_close(logits[0, 5:], alone, rtol=0, atol=8e-7)
        torch.testing.assert_close(logits[1], unmasked[1], rtol=0, atol=8e-7)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
