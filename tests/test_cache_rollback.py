"""Rolling a decode cache back (``DeepseekV41Cache.rollback`` / transformers' ``crop``): after decoding n tokens and
forgetting the last k, the cache is the one that never saw them (bit for bit, in everything a later step reads), at
every offset within a compression group, for the growing and the static cache; and transformers' assisted and
prompt-lookup decoding, which undo their rejected candidates this way, give plain greedy decoding's tokens."""

import pytest
import torch
from conftest import golden_dir

from deepseek_v41.cache_deepseek_v41 import DeepseekV41Cache, DeepseekV41StaticCache
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, returned_cache

SPARE = 4  # positions the caches here can undo


@pytest.fixture(scope="module")
def model():
    return DeepseekV41ForCausalLM.from_pretrained(golden_dir("v41_tiny_text") / "snapshot", dtype=torch.float32)


@pytest.fixture(scope="module")
def ids():
    from safetensors.torch import load_file

    return load_file(str(golden_dir("v41_tiny_text") / "reference" / "golden.safetensors"))["input_ids"]  # [2, 64]


def new_cache(model, kind):
    if kind == "static":
        return DeepseekV41StaticCache(model.config, 64, rollback_tokens=SPARE)
    return DeepseekV41Cache(model.config, rollback_tokens=SPARE)


def visible_state(cache) -> dict:
    """What a later decode step can read, by position: per layer the window keys of the last W positions, the
    complete groups' compressed entries and index keys, the open group's carried projections; the row counts and
    the Engram look-back (ids where not dead, and the dead flags)."""
    lengths = cache.lengths.tolist()
    state = {"lengths": cache.lengths.clone()}
    for i, layer in enumerate(cache.layers):
        for row, n in enumerate(lengths):
            ring = layer.window_kv.shape[1]
            window = [p % ring for p in range(max(0, n - layer.window), n)]
            state[i, row, "window"] = layer.window_kv[row, window]
            if layer.full:
                state[i, row, "entries"] = layer.compressed_kv[row, : n // layer.ratio]
                state[i, row, "index_k"] = layer.index_k[row, : n // layer.ratio]
            if layer.carry_kv is not None:
                slots = [p % layer.carry_ring for p in range(n // layer.ratio * layer.ratio, n)]
                state[i, row, "carry"] = torch.cat([layer.carry_kv[row, slots], layer.carry_score[row, slots]])
    if cache.engram_ids is not None:
        context, dead = cache.engram_context(cache.lengths.new_zeros(len(lengths), 1))
        state["engram"] = (context.masked_fill(dead, -1), dead)
    return state


def assert_same_state(got: dict, expected: dict, label) -> None:
    assert got.keys() == expected.keys(), label
    for key, value in expected.items():
        if isinstance(value, tuple):
            assert all(torch.equal(a, b) for a, b in zip(got[key], value)), (label, key)
        else:
            assert torch.equal(got[key], value), (label, key)


def decode(model, cache, tokens):
    # tokens [b, m] one column at a time -> fp32 logits [b, m, vocab] (None for m = 0)
    steps = [model(tokens[:, t : t + 1], cache=cache).logits for t in range(tokens.shape[1])]
    return torch.cat(steps, 1) if steps else None


@torch.no_grad()
@pytest.mark.parametrize("kind", ["growing", "static"])
def test_rollback_equals_a_cache_that_never_saw_the_tokens(model, ids, kind):
    # prompts of 6 and 7 tokens, n = 1..4 decoded tokens, the last k = 1..n forgotten, then 3 more: the kept count
    # takes both parities (a ratio-2 group closed or open) and k crosses group boundaries, up to the limit SPARE.
    # The cache that never saw them decodes the same kept tokens the same way: bit-identical state and logits
    wrong = (ids[:, 40:48] + 7) % 1000 + 3  # the forgotten tokens: not the ones decoded afterwards
    for prompt in (6, 7):
        for n in range(1, SPARE + 1):
            for k in range(1, n + 1):
                label, kept = (kind, prompt, n, k), prompt + n - k
                rolled, fresh = new_cache(model, kind), new_cache(model, kind)
                for cache in (rolled, fresh):
                    model(ids[:, :prompt], cache=cache)
                    decode(model, cache, ids[:, prompt:kept])
                decode(model, rolled, wrong[:, :k])
                rolled.rollback(k)
                assert rolled.columns == fresh.columns == kept, label
                assert_same_state(visible_state(rolled), visible_state(fresh), label)
                after = ids[:, kept : kept + 3]
                assert torch.equal(decode(model, rolled, after), decode(model, fresh, after)), label
                assert_same_state(visible_state(rolled), visible_state(fresh), label)


@torch.no_grad()
def test_rollback_into_the_prompt(model, ids):
    # forgetting prompt positions too: the state equals a shorter prefill's up to the GEMMs' summation order (a
    # prefill of another length; measured <= 2e-7 relative), and decoding continues the same.  Per element: |err|
    # 1.4e-6 (1 thread) / 1.9e-6 (2 threads), 71 % of the old atol 1e-6 + rtol 1e-5 gate; atol 5e-6: 15 % (~6.5x)
    for prompt, k in ((6, 1), (7, 2), (8, SPARE)):
        rolled, fresh = new_cache(model, "growing"), new_cache(model, "growing")
        model(ids[:, :prompt], cache=rolled)
        rolled.rollback(k)
        model(ids[:, : prompt - k], cache=fresh)
        got, expected = visible_state(rolled), visible_state(fresh)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            pairs = zip(got[key], value) if isinstance(value, tuple) else [(got[key], value)]
            for a, b in pairs:
                assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=5e-6), (prompt, k, key)
        after = ids[:, prompt - k : prompt - k + 3]
        # measured 0 (1 and 2 threads); the slack is for the state's round-off above reaching the logits
        assert torch.allclose(decode(model, rolled, after), decode(model, fresh, after), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_rows_roll_back_by_their_own_counts(model, ids):
    rolled, fresh = new_cache(model, "growing"), new_cache(model, "growing")
    model(ids[:, :9], cache=rolled)
    decode(model, rolled, ids[:, 9:13])
    rolled.rollback(torch.tensor([3, 1]))  # row 0 keeps 10 positions, row 1 keeps 12
    model(ids[:, :9], cache=fresh)
    decode(model, fresh, ids[:, 9:13])
    assert rolled.lengths.tolist() == [10, 12]
    for row, n in enumerate((10, 12)):
        single = new_cache(model, "growing")
        model(ids[row : row + 1, :n], cache=single)
        step = model(ids[row : row + 1, n : n + 1], cache=single).logits
        ours = model(ids[row : row + 1, n : n + 1], cache=_row(rolled, row)).logits
        # measured 0 (1 and 2 threads); the slack is for a batch of 2 rows blocking the GEMMs differently from 1
        assert torch.allclose(ours, step, rtol=0, atol=1e-5), row


def _row(cache, row):
    import copy

    single = copy.deepcopy(cache)
    single.batch_select_indices(torch.tensor([row]))
    single.columns = single.lengths_host[0]
    return single


@torch.no_grad()
def test_rollback_errors_name_the_limit(model, ids):
    cache = new_cache(model, "growing")
    with pytest.raises(ValueError, match="before a prefill"):
        cache.rollback(1)
    model(ids[:, :6], cache=cache)
    with pytest.raises(ValueError, match=f"rollback_tokens={SPARE} positions to undo"):
        cache.rollback(SPARE + 1)
    plain = returned_cache(model(ids[:, :6], use_cache=True))
    assert not plain.is_croppable and cache.is_croppable
    with pytest.raises(ValueError, match="rollback_tokens=0"):
        plain.crop(-1)
    cache.crop(5)  # transformers' form: keep the first 5 columns
    assert cache.columns == 5 and cache.lengths.tolist() == [5, 5]


@torch.no_grad()
@pytest.mark.parametrize("how", [{"prompt_lookup_num_tokens": 3}, "assistant"])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(model, ids, how):
    prompt = torch.cat([ids[:1, :20], ids[:1, 5:15]], 1)  # a repeat, so prompt lookup finds candidates
    greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
    extra = {"assistant_model": model} if how == "assistant" else how
    assisted = model.generate(prompt, max_new_tokens=12, do_sample=False, **extra)
    assert torch.equal(assisted, greedy)
