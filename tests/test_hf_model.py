"""The model as transformers' tools use it: PEFT LoRA on any linear layer (wo_a's grouped projection, the fp32
head), dtype casts that keep the fp32 islands, resize_token_embeddings with Engram, output_hidden_states /
return_dict, transformers' checkpointing signature, the embedding accessors."""

import copy

import pytest
import torch
from conftest import tiny_model

from deepseek_v41.engram_hashing import engram_hash, engram_offsets, engram_primes
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

peft = pytest.importorskip("peft")

IDS = torch.randint(3, 1024, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(v4_tokenizer):
    return tiny_model(v4_tokenizer).eval()  # fp32, every layer kind, Engram at layers 1 and 4


@pytest.fixture
def model(base):
    return copy.deepcopy(base)


@pytest.mark.parametrize("target", ["wo_a", "head"])
def test_lora_changes_logits_like_its_merge(model, target):
    # wo_a is read as a block-diagonal grouped GEMM and the head by the fp32 head kernel: a LoRA wrapper must be
    # called, and its delta must be exactly the merged weight's (the block-diagonal part for wo_a)
    with torch.no_grad():
        plain = model(IDS).logits
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=[target], init_lora_weights=False))
        adapted = lora(input_ids=IDS).logits
        merged = lora.merge_and_unload()
        assert type(merged.layers[0].attn.wo_a) is torch.nn.Linear and type(merged.head) is torch.nn.Linear
        reference = merged(IDS).logits
    assert (adapted - plain).abs().max() > 1e-2, "the adapter changed nothing: the wrapper was bypassed"
    torch.testing.assert_close(adapted, reference, rtol=0, atol=3e-6)  # measured 7.2e-7 (1 and 2 threads); gate 4.2x


def test_all_linear_lora_tensors_all_get_gradients(model):
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    wrapped = {name.rsplit(".lora_A", 1)[0] for name, _ in lora.named_parameters() if ".lora_A." in name}
    # every trainable projection is adapted (attention, compressor, experts' shared MLP, Engram); the frozen indexer
    # (hard top-k: no LM gradient) and the output layer (get_output_embeddings) are left out, as PEFT does for heads
    assert any(n.endswith("attn.wo_a") for n in wrapped) and any(n.endswith("engram.wkv") for n in wrapped)
    assert not any(".indexer." in n for n in wrapped) and not any(n.endswith(".head") for n in wrapped)
    lora.train()
    lora(input_ids=IDS, labels=IDS).loss.backward()
    lora_params = [(n, p) for n, p in lora.named_parameters() if "lora_" in n]
    assert len(lora_params) == 2 * len(wrapped)
    missing = [n for n, p in lora_params if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"LoRA tensors without a gradient: {missing}"


def test_explicit_indexer_target_names_the_fix(model):
    with pytest.raises(ValueError, match=r"frozen indexer's projection.*exclude_modules="):
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["weights_proj"]))
    # naming a projection shared with the indexer works once the indexer is excluded
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["wq_b"], exclude_modules=r".*\.indexer\..*", init_lora_weights=False)
    )
    assert sum(".lora_A." in n for n, _ in lora.named_parameters()) == model.config.num_hidden_layers


def test_adapter_save_load_round_trip(model, base, tmp_path):
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["wo_a", "wkv", "head"],
                                                      init_lora_weights=False))
    with torch.no_grad():
        expected = lora(input_ids=IDS).logits
    lora.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=0, atol=0)
        assert not torch.equal(base(IDS).logits, expected)


def test_embedding_accessors(model):
    assert model.get_input_embeddings() is model.embed
    assert model.get_output_embeddings() is model.head
    replacement = torch.nn.Linear(32, 1024, bias=False)
    model.set_output_embeddings(replacement)
    assert model.head is replacement and model.get_output_embeddings() is replacement
    with torch.no_grad():  # a replaced head is called, not read through the fp32 kernel: its bias counts
        model.set_output_embeddings(torch.nn.Linear(32, 1024, bias=True))
        torch.nn.init.constant_(model.head.bias, 5.0)
        with_bias = model(IDS).logits
        model.head.bias.zero_()
        # measured 0 (1 and 2 threads); gate 4 fp32 ulps of 5.0: (x + 5) - x may round on another CPU's kernels
        torch.testing.assert_close(with_bias - model(IDS).logits, torch.full_like(with_bias, 5.0), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_cast_keeps_fp32_islands(model, v4_tokenizer, dtype):
    built = tiny_model(v4_tokenizer, dtype=dtype, text={"engram_layer_ids": [], "engram_num_embeddings": []})
    expected = {n: t.dtype for n, t in [*built.named_parameters(), *built.named_buffers()]}
    cast = model.half() if dtype == torch.float16 else model.to(dtype)
    got = {n: t.dtype for n, t in [*cast.named_parameters(), *cast.named_buffers()] if ".engram." not in n}
    assert got == expected, {n: (got[n], expected[n]) for n in got if got[n] != expected.get(n)}
    assert cast.head.weight.dtype == torch.float32 and cast.layers[2].attn.compressor.wkv.weight.dtype == torch.float32
    with torch.no_grad():
        logits = cast(IDS).logits
    assert logits.dtype == torch.float32 and logits.isfinite().all()
    assert {t.dtype for t in cast.float().parameters()} == {torch.float32}


def test_islands_are_not_rounded_by_a_cast(model):
    fn = model.layers[3].hc_attn_fn.detach().clone()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["head", "wo_a"]))
    lora.to(torch.bfloat16)  # through the PEFT wrapper
    assert torch.equal(model.layers[3].hc_attn_fn, fn), "an fp32 island went through bf16"
    assert model.head.lora_A["default"].weight.dtype == torch.float32  # the head's adapter is part of the island
    assert model.layers[0].attn.wo_a.lora_A["default"].weight.dtype == torch.bfloat16


def test_resize_token_embeddings_resizes_the_head_and_engram_hashes_new_ids(model, v4_tokenizer):
    old = model.config.vocab_size
    tokenizer_vocab = v4_tokenizer.get_vocab_size(with_added_tokens=True)
    new = tokenizer_vocab + 20  # ids past the tokenizer: Engram's compression map has no entry for them
    model.resize_token_embeddings(new, mean_resizing=False)
    assert model.embed.weight.shape[0] == model.head.weight.shape[0] == new
    assert model.head.weight.dtype == torch.float32
    assert model.config.vocab_size == model.config.text_config.vocab_size == new
    ids = IDS.clone()
    ids[0, 3], ids[1, 7] = new - 1, tokenizer_vocab
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.shape[-1] == new and out.loss.isfinite()
    assert old != new


def test_engram_hash_gives_new_ids_their_own_rows():
    cmap = torch.tensor([0, 1, 1, 2, 3])  # 5 known ids, 4 compressed ids
    primes = engram_primes([1], 3, 2, 97)[1]
    hash_of = lambda ids: engram_hash(
        torch.tensor([ids]), cmap, torch.tensor([3, 5, 7]), primes, engram_offsets(primes), max_ngram_size=3, pad_id=0
    )
    known = hash_of([4, 3, 2])
    assert torch.equal(hash_of([4, 3, 2, 5])[:, :3], known), "known ids hash as before"
    new_a, new_b = hash_of([4, 3, 5]), hash_of([4, 3, 6])
    assert not torch.equal(new_a[:, 2], new_b[:, 2]), "two new ids share rows"
    assert not torch.equal(new_a[:, 2], known[:, 2])
    rows = torch.cat([new_a, new_b]).flatten()
    assert (rows >= 0).all() and (rows < int(primes.sum())).all()


def test_output_hidden_states_and_return_dict(model):
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True)
        plain = model(IDS)
        as_tuple = model(IDS, labels=IDS, return_dict=False)
        backbone_tuple = DeepseekV41ForCausalLM.__mro__[1].forward(model, IDS, return_dict=False)
    hidden = out.hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1
    assert all(h.shape == (2, 24, 32) for h in hidden)
    torch.testing.assert_close(hidden[0], model.embed(IDS), rtol=0, atol=0)  # the same lookup: measured bit-equal
    # the last entry is the head's input; measured 0 (1 and 2 threads): nn.Linear vs the fp32 head kernel, so
    # 4 fp32 ulps of the largest logit (0.49) are left for another CPU's kernels
    torch.testing.assert_close(model.head(hidden[-1]), plain.logits, rtol=0, atol=1.2e-7)
    assert plain.hidden_states is None
    assert isinstance(as_tuple, tuple) and as_tuple[0].dim() == 0  # (loss, logits, last_hidden_state)
    torch.testing.assert_close(as_tuple[1], plain.logits, rtol=0, atol=0)  # the same forward: measured bit-equal
    torch.testing.assert_close(as_tuple[2], hidden[-1], rtol=0, atol=0)
    assert isinstance(backbone_tuple, tuple) and torch.equal(backbone_tuple[0], hidden[-1])


def test_output_attentions_is_a_clear_error(model):
    with pytest.raises(NotImplementedError, match="sparse attention never forms a dense attention matrix"):
        model(IDS, output_attentions=True)


def test_num_items_in_batch_normalises_the_summed_loss(model):
    labels = IDS.clone()
    labels[0, 10:] = -100
    with torch.no_grad():
        mean = model(IDS, labels=labels).loss
        counted = (labels[:, 1:] != -100).sum()
        for total in (counted, 3 * counted):  # 3x: the tokens of three accumulated micro-batches
            scaled = model(IDS, labels=labels, num_items_in_batch=total).loss
            # measured 0 (1 and 2 threads); gate ~4 fp32 ulps for the other division order
            torch.testing.assert_close(scaled, mean * counted / total, rtol=5e-7, atol=0)


def test_checkpointing_takes_transformers_signature(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    flags = [layer.gradient_checkpointing for layer in model.layers]
    assert flags == [i % 2 == 0 for i in range(len(flags))]
    # what the Trainer calls: activation_checkpointing_enable from transformers 5.2x on, before it this method
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    assert all(layer.gradient_checkpointing for layer in model.layers)
    model.train()
    model(IDS, labels=IDS).loss.backward()
    assert model.layers[2].attn.compressor.wkv.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="use_reentrant=True"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


@pytest.mark.parametrize(("experts", "dtype"), [("torch_mm", torch.float32), ("torch", torch.float32),
                                                 ("torch_mm", torch.bfloat16)])
def test_compiled_moe_runs_without_recompiling(experts, dtype):
    # torch.compile traces _grouped_mm only in bf16 (fp32 falls back to the loop), and the per-expert loop runs
    # eagerly inside the compiled graph: a new split of tokens over the experts is no new graph
    from conftest import tiny_config
    from torch._dynamo.utils import counters

    from deepseek_v41.backends import resolve_backend
    from deepseek_v41.modeling_deepseek_v41 import default_dtype
    from deepseek_v41.moe import MoE

    torch.manual_seed(0)
    with default_dtype(dtype):
        moe = MoE(tiny_config().text_config, resolve_backend({"experts": experts}), False)
    for weight in (moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.gate.weight):
        torch.nn.init.normal_(weight, std=0.2)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(moe, backend="aot_eager")
    graphs, splits = [], set()
    for _ in range(4):  # same shape, other tokens: the routing (rows per expert) changes
        x = torch.randn(40, 32, dtype=dtype, requires_grad=True)
        out = compiled(x, None)
        out.float().square().sum().backward()
        torch.testing.assert_close(out, moe(x, None), rtol=0, atol=0)
        graphs.append(counters["stats"]["unique_graphs"])
        splits.add(tuple(moe.gate(x, None)[1].flatten().bincount(minlength=8).tolist()))
    assert len(splits) > 1 and graphs[0] > 0 and graphs[1:] == graphs[:1] * 3, graphs
    assert moe.experts.w1.grad.abs().sum() > 0
