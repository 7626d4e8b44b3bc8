"""The preallocated decode cache (``DeepseekV41StaticCache``) on CPU: its bookkeeping (window ring past the window,
compressed entries at group boundaries, the Engram look-back, left-padded rows at different positions, spare ring
slots for a later rollback), its decode against full forwards and the growing cache, ``generate`` with
``cache_implementation="static"``, a decode step with fixed shapes and no host reads that compiles as one graph,
and the torch attention backend's refusal of a prefill it cannot hold."""

import contextlib

import pytest
import torch
from conftest import golden_dir, tiny_config
from test_generation import DECODE_STEPS, PROMPT_LENGTHS, ragged_batch, without_quantization

from deepseek_v41.cache_deepseek_v41 import DeepseekV41Cache, DeepseekV41StaticCache, StaticCSA2LayerCache
from deepseek_v41.modeling_deepseek_v41 import returned_cache
from deepseek_v41.parity import logits_metrics


class Owner:  # stands in for the cache a layer's buffers belong to
    version = 0

    def buffers_changed(self):
        self.version += 1


def codes(lengths, width, dim=2):
    """[b, width, dim] fp32 of left-aligned rows: position p of row i holds 1000·i + p + 1 (0 = never written)."""
    b = len(lengths)
    pos = torch.arange(width).expand(b, -1)
    code = (1000 * torch.arange(b).unsqueeze(1) + pos + 1).float()
    return code.unsqueeze(-1).expand(-1, -1, dim).clone()


def code_of(row, p, dim=2):
    return torch.full((dim,), 1000.0 * row + p + 1)


# ---- bookkeeping, on a layer's cache alone: each slot holds the position it should ------------------------------


@pytest.mark.parametrize("spare", [0, 3])
def test_window_ring_past_the_window_with_left_padding(spare):
    window, lengths = 4, [6, 2, 1]  # rows of a left-padded prompt of 6 columns, at different positions
    layer = StaticCSA2LayerCache(window, ratio=0, full=False, spare=spare, max_cache_len=64, owner=Owner())
    layer.fill_window(codes(lengths, 6), torch.tensor(lengths))
    assert layer.window_kv.shape == (3, window + spare, 2)
    pos = torch.tensor(lengths)
    address = layer.window_kv.data_ptr()
    for _ in range(11):  # every row well past the window
        new = torch.stack([code_of(i, int(p)) for i, p in enumerate(pos)])
        ring = layer.push_window(new.unsqueeze(1), pos.unsqueeze(1))  # one token per row: [b, 1, ·]
        slots = layer.window_slots(pos.unsqueeze(1))[:, 0]  # [b, R]
        for i, p in enumerate(pos.tolist()):
            seen = sorted(int(ring[i, j, 0]) for j in slots[i].tolist() if j >= 0)
            assert seen == [1000 * i + q + 1 for q in range(max(0, p - window + 1), p + 1)], (i, p, spare)
        pos = pos + 1
    assert layer.window_kv.data_ptr() == address  # written in place


@pytest.mark.parametrize("spare", [0, 3])
def test_compressed_entries_and_carry_at_group_boundaries(spare):
    ratio, lengths, width = 2, [7, 4, 1], 7
    layer = StaticCSA2LayerCache(4, ratio, full=True, spare=spare, max_cache_len=32, owner=Owner())
    x = codes(lengths, width)
    layer.fill_carry(x, torch.tensor(lengths), lambda rows: (rows.float(), -rows.float()))
    assert layer.carry_kv.shape == (3, ratio + spare, 2)
    entry_codes = codes(lengths, width // ratio)  # the prefill's entries, the row's valid ones first
    layer.fill_compressed(entry_codes, entry_codes[..., :1])
    assert layer.compressed_kv.shape == (3, 16, 2) and layer.index_k.shape == (3, 16, 1)
    pos = torch.tensor(lengths)
    for _ in range(9):
        new = torch.stack([code_of(i, int(p)) for i, p in enumerate(pos)])
        kv, score = layer.push_carry(new[:, None], -new[:, None], pos[:, None])  # the group's r projections
        kv, score = kv[:, 0], score[:, 0]  # in position order
        for i, p in enumerate(pos.tolist()):
            start = p // ratio * ratio
            for j in range(p - start + 1):  # the group's positions seen so far
                assert torch.equal(kv[i, j], code_of(i, start + j)) and torch.equal(score[i, j], -code_of(i, start + j))
        layer.push_entry(10_000 + new[:, None], 10_000 + new[:, None, :1], pos[:, None], None)
        pos = pos + 1
        for i, n in enumerate(pos.tolist()):  # every entry a row sees: its prefill's, then the decoded groups'
            for j in range(n // ratio):
                expected = code_of(i, j) if j < lengths[i] // ratio else 10_000 + code_of(i, j * ratio + ratio - 1)
                assert torch.equal(layer.compressed_kv[i, j], expected), (i, j)
                assert torch.equal(layer.index_k[i, j], expected[:1])


@pytest.mark.parametrize("spare", [0, 2])
def test_engram_ring_matches_the_growing_cache(spare):
    config = tiny_config()
    lengths, width = torch.tensor([6, 3, 1]), 6
    ids = torch.randint(3, 1000, (3, width), generator=torch.Generator().manual_seed(0))
    image = torch.zeros(3, width, dtype=torch.bool)
    image[0, 3] = True  # an image token in the look-back of row 0
    static = DeepseekV41StaticCache(config, max_cache_len=32, rollback_tokens=spare)
    growing = DeepseekV41Cache(config)
    for cache in (static, growing):
        cache.finish_prefill(ids, image, lengths, width)
    assert static.engram_ids.shape == (3, config.text_config.engram_max_ngram_size - 1 + spare)
    for step in range(8):
        new = torch.randint(3, 1000, (3, 1), generator=torch.Generator().manual_seed(step + 1))
        expected, got = growing.engram_context(new), static.engram_context(new)
        assert torch.equal(got[0][~got[1]], expected[0][~expected[1]]) and torch.equal(got[1], expected[1]), step
        for cache in (static, growing):
            cache.advance_rows(new)
    assert torch.equal(static.lengths, lengths + 8)


def test_static_cache_errors_and_pool(v4_tokenizer):
    from conftest import tiny_model

    config = tiny_config()
    with pytest.raises(ValueError, match="max_cache_len must be a positive"):
        DeepseekV41StaticCache(config, 0)
    model = tiny_model(v4_tokenizer).eval()
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(ValueError, match="does not fit this DeepseekV41StaticCache"):
        model(ids, cache=DeepseekV41StaticCache(config, 8))
    cache = DeepseekV41StaticCache(config, 13)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
        with pytest.raises(ValueError, match="13 positions and has used 13"):
            model(ids[:, :1], cache=cache)
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported"):
        model.generate(ids, max_new_tokens=2, cache_implementation="offloaded")
    # generate's caches: one per (batch, length rounded up), reused (reset) by a later call of the same shape
    first = model.static_cache(2, 100)
    assert first is model.static_cache(2, 200) and first.max_cache_len == 256 and first.columns == 0
    assert model.static_cache(3, 100) is not first and model.static_cache(2, 300).max_cache_len == 512
    for batch in range(4, 4 + model.static_cache_pool_size):
        model.static_cache(batch, 1)
    assert model.static_cache(2, 100) is not first  # pushed out of the pool by more recent shapes
    model.release_static_caches()


# ---- the model with a static cache --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot():
    return golden_dir("v41_tiny_text") / "snapshot"


@pytest.fixture(scope="module")
def golden_ids(snapshot):
    from safetensors.torch import load_file

    return load_file(str(snapshot.parent / "reference" / "golden.safetensors"))["input_ids"]  # [2, 64]


def load(snapshot, dtype, **options):
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    return DeepseekV41ForCausalLM.from_pretrained(snapshot, dtype=dtype, **options)


@pytest.fixture(scope="module")
def model_fp32(snapshot):
    return load(snapshot, torch.float32)


@pytest.fixture(scope="module")
def model_bf16(snapshot):
    return load(snapshot, torch.bfloat16)


@pytest.fixture(scope="module")
def model_bf16_dequantized(snapshot):
    # for the graph-replayability checks: the kept formats' CPU fallback decodes only the experts that got tokens,
    # reading their counts on the host, so its step is not one a CUDA graph can replay; the dequantized model's is
    return load(snapshot, torch.bfloat16, dequantize_base_checkpoint=True)


def decode_logits(model, golden_ids, cache):
    """(rows, prompt lengths, logits [rows, steps + 1, vocab]): a left-padded prefill of PROMPT_LENGTHS into
    ``cache`` (None: the growing one the prefill returns), then DECODE_STEPS decode steps that read only it."""
    width = max(PROMPT_LENGTHS)
    rows, ids, mask = ragged_batch(golden_ids, PROMPT_LENGTHS, width + DECODE_STEPS)
    out = model(ids[:, :width], attention_mask=mask[:, :width], use_cache=True, cache=cache)
    cache, steps = returned_cache(out), [out.logits[:, -1]]
    for t in range(width, ids.shape[1]):
        steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits[:, -1])
    return rows, cache, torch.stack(steps, 1)


@torch.no_grad()
@pytest.mark.parametrize("spare", [0, 3])
def test_static_decode_equals_full_forward_fp32(model_fp32, golden_ids, monkeypatch, spare):
    without_quantization(model_fp32, monkeypatch)
    capacity = max(PROMPT_LENGTHS) + DECODE_STEPS
    static = DeepseekV41StaticCache(model_fp32.config, capacity, rollback_tokens=spare)
    rows, cache, cached = decode_logits(model_fp32, golden_ids, static)
    assert cache is static and static.columns == capacity
    for i, (row, n) in enumerate(zip(rows, PROMPT_LENGTHS)):
        full = model_fp32(row[None]).logits[0, n - 1 :]
        rel = (cached[i] - full).norm(dim=-1) / full.norm(dim=-1)
        assert rel.max() <= 1e-6, (i, rel)  # measured <= 3.0e-7 (1 and 2 threads); gate ~3x


@torch.no_grad()
def test_static_decode_equals_growing_cache_bf16(model_bf16, golden_ids):
    capacity = max(PROMPT_LENGTHS) + DECODE_STEPS
    _, _, growing = decode_logits(model_bf16, golden_ids, None)
    _, static, fixed = decode_logits(model_bf16, golden_ids, DeepseekV41StaticCache(model_bf16.config, capacity))
    assert static.lengths_host is None  # nothing is kept on (or read back to) the host per row
    assert torch.equal(fixed.argmax(-1), growing.argmax(-1))
    # measured 0 here; the slack is for bf16 near-ties that round the other way under another GEMM blocking (the
    # multi-token step, which blocks differently, measures 3.5e-6 against this gate)
    assert logits_metrics(growing.flatten(0, 1), fixed.flatten(0, 1))["mean_kl"] <= 1e-4


@torch.no_grad()
def test_generate_with_a_static_cache(model_bf16, model_fp32, golden_ids):
    prompt = golden_ids[1:, :9]
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None}
    out = model_bf16.generate(prompt, cache_implementation="static", return_dict_in_generate=True, **kwargs)
    assert isinstance(returned_cache(out), DeepseekV41StaticCache)
    assert returned_cache(out) is model_bf16.static_cache(1, 20)  # generate's cache comes from the pool
    tokens = prompt
    for _ in range(12):
        tokens = torch.cat([tokens, model_bf16(tokens).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, tokens)
    # a left-padded batch: each row as when generated alone
    prompts = [golden_ids[0, :5], golden_ids[1, :13], golden_ids[0, 30:52]]
    width, pad = max(p.numel() for p in prompts), model_bf16.config.pad_token_id
    ids = torch.full((3, width), pad)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel() :], mask[row, width - p.numel() :] = p, 1
    kwargs["max_new_tokens"] = 6
    batch = model_bf16.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)
    growing = model_bf16.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(batch, growing)
    for row, p in enumerate(prompts):
        alone = model_bf16.generate(p[None], cache_implementation="static", **kwargs)[0]
        assert torch.equal(batch[row, width - p.numel() :], alone), row
    # beam search reorders the cache's rows in place; sampling runs
    beams = {"max_new_tokens": 8, "num_beams": 3, "num_return_sequences": 2, "do_sample": False, "eos_token_id": None}
    static = model_fp32.generate(golden_ids[:1, :11], cache_implementation="static", **beams)
    assert torch.equal(static, model_fp32.generate(golden_ids[:1, :11], use_cache=False, **beams))
    torch.manual_seed(0)
    sampled = model_bf16.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, cache_implementation="static")
    assert sampled.shape == (1, 15)


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op of a region with its output shapes, and the ones that read a value back to the host."""

    READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose"}

    def __init__(self):
        super().__init__()
        self.ops, self.reads = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.READS:
            self.reads.append(name)
        shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                  if isinstance(t, torch.Tensor)]
        self.ops.append((name, shapes))
        return out


def step_ops(model, cache, token, record=True):
    with OpRecorder() if record else contextlib.nullcontext() as recorder:
        model._decode_body(token, cache, head=True)
    cache.columns += 1
    return recorder


@torch.no_grad()
@pytest.mark.parametrize("static", [True, False])
def test_static_decode_step_has_fixed_shapes_and_no_host_reads(model_bf16_dequantized, golden_ids, static):
    # A step that a CUDA graph can replay: the same ops on the same shapes at every position (past the window, across
    # group completions, while rows see different numbers of entries), nothing read back, buffers written in place.
    # The growing cache is the counterpart: its step is sized by host-side counts, so its shapes change.
    model = model_bf16_dequantized
    width = max(PROMPT_LENGTHS)
    _, ids, mask = ragged_batch(golden_ids, PROMPT_LENGTHS, width + DECODE_STEPS)
    cache = DeepseekV41StaticCache(model.config, ids.shape[1]) if static else None
    cache = returned_cache(model(ids[:, :width], attention_mask=mask[:, :width], use_cache=True, cache=cache))
    buffers = [t.data_ptr() for layer in cache.layers for t in layer.tensors().values()]
    recorded = {0, 1, 2, DECODE_STEPS - 2, DECODE_STEPS - 1}  # the row at position 1 passes the window of 16
    steps = [step_ops(model, cache, ids[:, t : t + 1], t - width in recorded) for t in range(width, ids.shape[1])]
    steps = [steps[i] for i in sorted(recorded)]
    assert not any(step.reads for step in steps)
    changed = sum(step.ops != steps[0].ops for step in steps[1:])
    if static:
        assert changed == 0 and buffers == [t.data_ptr() for layer in cache.layers for t in layer.tensors().values()]
    else:
        assert changed == len(steps) - 1


@pytest.mark.slow
@torch.no_grad()
def test_static_decode_step_compiles_as_one_graph(model_bf16_dequantized, golden_ids):
    # torch.compile(fullgraph=True) refuses a graph break: a host read or a data-dependent shape in the step would
    # fail here, as it would fail CUDA graph capture; error_on_recompile: one graph serves every position (fixed
    # shapes, dynamic=False).  AOTAutograd's graph (functionalized in-place cache writes included) runs the same ops
    # as the eager step; Inductor's kernels are the GPU tests' (decode_graph="compile").
    model = model_bf16_dequantized
    torch._dynamo.reset()
    width = max(PROMPT_LENGTHS)
    _, ids, mask = ragged_batch(golden_ids, PROMPT_LENGTHS, width + 4)
    caches = [DeepseekV41StaticCache(model.config, ids.shape[1]) for _ in range(2)]
    for cache in caches:
        model(ids[:, :width], attention_mask=mask[:, :width], cache=cache)
    compiled = torch.compile(model._decode_body, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(width, ids.shape[1]):
            token = ids[:, t : t + 1]
            eager = model._decode_body(token, caches[0], head=True)
            graph = compiled(token, caches[1], head=True)
            assert torch.equal(eager[0], graph[0]) and torch.equal(eager[1], graph[1]), t
    for mine, theirs in zip(caches[0].layers, caches[1].layers):
        for name, tensor in mine.tensors().items():
            assert torch.equal(tensor, theirs.tensors()[name]), name
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    torch._dynamo.reset()


# ---- the torch attention backend refuses a prefill it cannot hold -----------------------------------------------


def test_torch_attention_refuses_a_prefill_it_cannot_hold(v4_tokenizer, monkeypatch):
    from conftest import tiny_model

    from deepseek_v41 import attention
    from deepseek_v41.configuration_deepseek_v41 import DeepseekV41TextConfig

    released = DeepseekV41TextConfig()
    layer = released.kv_source_layer_ids[-1]  # a ratio-1 Full layer: 32 index heads over every token
    # the gathered rows [1, 128k, 640, 512] in bf16 and fp32 (the indexer goes in chunks of ~2 GiB)
    assert attention.torch_attention_bytes(released, layer, 1, 131072, 2) >= 128 * 640 * 512 * 6 * 2**10
    model = tiny_model(v4_tokenizer).eval()
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    need = max(attention.torch_attention_bytes(model.config.text_config, i, 1, 40, 4) for i in range(9))
    limit = max(attention.torch_attention_bytes(model.config.text_config, i, 1, 30, 4) for i in range(9))
    monkeypatch.setattr(attention, "free_memory", lambda device: limit)
    with torch.no_grad():
        model(ids[:, :30])  # fits exactly
        with pytest.raises(ValueError, match=r"attn backend 'torch' cannot hold a prefill of 40 columns .*"
                                             r"enough for about 30 columns") as error:
            model(ids)
    assert f"{need / 2**30:.1f} GiB" in str(error.value)
