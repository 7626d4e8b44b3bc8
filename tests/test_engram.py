"""Engram in the model: table selection, gate formula, tokenizer resolution, materialization."""

import torch
from conftest import tiny_model

IDS = torch.randint(3, 1024, (2, 32), generator=torch.Generator().manual_seed(0))


def test_disabling_a_table_changes_the_model_and_is_recorded(v4_tokenizer, tmp_path):
    both = tiny_model(v4_tokenizer).eval()
    only_first = tiny_model(v4_tokenizer, text={"engram_layer_ids": [1], "engram_num_embeddings": [1464]}).eval()
    missing, unexpected = only_first.load_state_dict(both.state_dict(), strict=False)
    assert not missing and all(k.startswith("layers.4.engram.") for k in unexpected)
    assert only_first.layers[4].engram is None
    with torch.no_grad():
        assert not torch.allclose(both(IDS).logits, only_first(IDS).logits)
    only_first.save_pretrained(tmp_path / "one_table")
    assert '"engram_layer_ids": [\n      1\n    ]' in (tmp_path / "one_table" / "config.json").read_text()


def test_gate_is_the_signed_square_root_sigmoid(v4_tokenizer):
    model = tiny_model(v4_tokenizer)
    engram = model.layers[1].engram
    x = torch.randn(2, 32, 4, 32)
    hash_ids = engram.hash(IDS, None)
    out = engram(x, hash_ids, None)
    # Independent restatement of architecture.md §9.3 for stream 2 of token (0, 5).
    kv = engram.wkv(engram.embed(hash_ids[0, 5]).flatten())
    key, value = kv[: 4 * 32].view(4, 32)[2], kv[4 * 32 :]
    h = x[0, 5, 2]
    dot = (h * engram.q_weight[2] * engram.k_weight[2] * key).sum()
    dot = dot / h.square().mean().add(1e-20).sqrt() / key.square().mean().add(1e-20).sqrt() / 32**0.5
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())
    # measured 3.7e-9 (1 and 2 threads); gate 4x
    torch.testing.assert_close(out[0, 5, 2], h + gate * value, rtol=0, atol=1.5e-8)


def test_precomputed_hash_ids_equal_in_model_hashing(v4_tokenizer):
    model = tiny_model(v4_tokenizer).eval()
    hashes = {layer: model.layers[layer].engram.hash(IDS, None) for layer in (1, 4)}
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, model(IDS, engram_hash_ids=hashes).logits)
        hashes[4] = (hashes[4] + 1) % model.layers[4].engram.embed.num_embeddings
        assert not torch.equal(model(IDS).logits, model(IDS, engram_hash_ids=hashes).logits)


def test_tokenizer_is_resolved_from_the_checkpoint_folder(v4_tokenizer, tmp_path):
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    model = tiny_model(v4_tokenizer, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")
    reloaded = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "ckpt")  # no tokenizer= given
    assert torch.equal(reloaded.layers[1].engram.cmap, model.layers[1].engram.cmap)


def test_engram_off_builds_without_a_tokenizer_and_runs():
    """``engram_layer_ids=[]`` alone: no table sizes to give, no tokenizer needed (nothing to hash)."""
    from conftest import TINY_TEXT, TINY_VISION

    from deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM

    text = {k: v for k, v in TINY_TEXT.items() if k != "engram_num_embeddings"} | {"engram_layer_ids": []}
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(DeepseekV41Config(text_config=text, vision_config=TINY_VISION)).eval()
    assert model.engram_tokenizer is None and all(layer.engram is None for layer in model.layers)
    assert not any(".engram." in name for name, _ in model.named_parameters())
    with torch.no_grad():
        logits = model(IDS).logits
    assert logits.shape == (2, 32, 1024) and logits.isfinite().all()


def test_the_gate_without_autograd_goes_a_block_of_positions_at_a_time(monkeypatch):
    # a long prefill's gate in blocks of GATE_POSITIONS (bounded fp32 temporaries): the same values as in one
    # pass, the image mask's closed positions included; with autograd on it stays one pass
    from deepseek_v41 import engram

    g = torch.Generator().manual_seed(0)
    hc, dim, s = 4, 64, 37
    x = torch.randn(2, s, hc, dim, generator=g).bfloat16()
    kv = torch.randn(2, s, (hc + 1) * dim, generator=g).bfloat16()
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, hc, dim, generator=g)).bfloat16()
    mask = torch.zeros(2, s, dtype=torch.bool)
    mask[1, 10:20] = True
    whole = engram.engram_gate(x, kv, q_weight, k_weight, 1e-6, mask)
    calls = []
    inner = engram._engram_gate
    monkeypatch.setattr(engram, "_engram_gate", lambda *a: calls.append(a[0].shape[1]) or inner(*a))
    monkeypatch.setattr(engram, "GATE_POSITIONS", 16)
    with torch.no_grad():
        blocks = engram.engram_gate(x, kv, q_weight, k_weight, 1e-6, mask)
    assert calls == [16, 16, 5] and torch.equal(blocks, whole)
    calls.clear()
    engram.engram_gate(x, kv, q_weight, k_weight, 1e-6, mask)
    assert calls == [s]
