"""Engram n-gram hashing: tokenizer compression map, per-layer primes / multipliers, and the hash.

Engram looks up, for every position ``t`` and every n-gram order ``n = 2..N``, ``H`` rows of a
per-layer embedding table.  The row ids depend only on ``input_ids`` (and the image mask), so they
can be computed in a data-loader worker.  Everything here is integer-exact and reproduces the
official ``inference/engram.py`` ids (checked against the golden fixtures):

1. ``build_compression_map``: token id -> compressed id.  Tokens whose decoded text normalizes to
   the same key share a compressed id (99,092 ids for the DeepSeek-V4 tokenizer).
2. ``engram_primes`` / ``engram_offsets``: one distinct prime per (layer, order, head); the table of
   a layer is the concatenation of the ``(N-1)·H`` sub-tables, so the offsets are the exclusive
   prefix sums of its primes and the table has ``sum(primes)`` rows.
3. ``engram_multipliers``: odd per-layer multipliers drawn from numpy's PCG64.
4. ``engram_hash``: ``mix_1 = tok_0·m_0``, ``mix_n = mix_{n-1} XOR tok_{n-1}·m_{n-1}``,
   ``row = mix_n mod p + offset``.  History never reaches before the sequence start or across an
   image token; blocked slots use the compressed pad id.

Findings that the prose spec leaves open (all decided by the 99,092 count and the golden ids):

* The normalizer is the Rust ``tokenizers`` chain, whose semantics differ from a Python
  ``unicodedata`` reading: ``StripAccents`` drops every combining mark (Mn, Mc and Me, e.g. the
  Bengali vowel sign U+09BE), ``Strip`` trims Unicode White_Space only (so U+001C..U+001F stay),
  and ``Lowercase`` maps char by char.  Taking only Mn gives 99,510 ids, not 99,092.  We therefore
  build the chain with ``tokenizers.normalizers`` (always installed when a tokenizer is passed).
* A text that normalizes to "" keeps its raw decoded text as the key (without the fallback: 98,879).
* Raw token strings (used for texts containing U+FFFD) and normalized texts share one key space.
* The prime search gives the same primes whether each head restarts at ``vocab_size - 1`` or
  continues from the previous head's prime (the global seen set makes the two equivalent).
* ``mod`` convention: ``2·v + 1 < INT64_MAX // compressed_vocab`` by construction, so every
  product ``tok·m`` and every XOR of them is non-negative and no int64 wrap happens for valid
  compressed ids; floor-mod and C remainder agree.  We use ``torch.remainder`` (floor-mod).
"""

import numpy as np
import torch

_REPLACEMENT_CHAR = "\ufffd"
_SPACE_SENTINEL = "\ue000"  # protects a lone space from Strip
_INT64_MAX = np.iinfo(np.int64).max


def _backend_tokenizer(tokenizer):
    # A transformers fast tokenizer wraps a ``tokenizers.Tokenizer`` in ``backend_tokenizer``.
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not (hasattr(backend, "decode_batch") and hasattr(backend, "id_to_token")):
        raise TypeError(
            f"build_compression_map needs a tokenizers.Tokenizer or a transformers fast tokenizer, got "
            f"{type(tokenizer).__name__}. Load it with tokenizers.Tokenizer.from_file('tokenizer.json') "
            "or AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    return backend


def _engram_normalizer():
    from tokenizers import Regex
    from tokenizers import normalizers as nz

    return nz.Sequence(
        [
            nz.NFKC(),
            nz.NFD(),
            nz.StripAccents(),
            nz.Lowercase(),
            nz.Replace(Regex(r"[ \t\r\n]+"), " "),
            nz.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            nz.Strip(),
            nz.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def build_compression_map(tokenizer) -> torch.Tensor:
    """Token id -> compressed id, LongTensor [vocab]; new ids in first-seen order."""
    backend = _backend_tokenizer(tokenizer)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    # Each id decoded alone by the raw backend (no special-token skipping, no clean-up).
    texts = backend.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    normalize = _engram_normalizer().normalize_str
    key_ids: dict[str, int] = {}
    cmap = np.empty(vocab, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:  # partial UTF-8 byte: the raw token string tells bytes apart
            key = backend.id_to_token(token_id)
        else:
            key = normalize(text) or text
        cmap[token_id] = key_ids.setdefault(key, len(key_ids))
    return torch.from_numpy(cmap)


def compress_ids(input_ids: torch.Tensor, cmap: torch.Tensor, map_size: int | None = None) -> torch.Tensor:
    """Token ids -> compressed ids.  An id past the tokenizer's map (a token added with
    ``resize_token_embeddings``) gets a fresh compressed id of its own after the map's, ``size + id - len(cmap)``:
    each new token is a distinct string.  Its products with the multipliers may wrap in int64, which is
    deterministic, and the floor-mod still gives a row inside the table.  ``map_size``: ``cmap.max() + 1`` when
    the caller knows it (saves a reduction over the whole map at every call, e.g. every decode step)."""
    n = cmap.shape[0]
    known = cmap[input_ids.clamp(max=n - 1)]
    size = cmap.max() + 1 if map_size is None else map_size
    return torch.where(input_ids < n, known, input_ids - n + size)


def compression_map_size(cmap: torch.Tensor) -> int:
    """Number of compressed ids (ids are dense, 0..size-1)."""
    return int(cmap.max()) + 1


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    # Deterministic Miller-Rabin for n < 3.3e24 (these bases suffice).
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41):
        if a % n == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(engram_layer_ids, max_ngram_size: int, n_heads: int, vocab_size: int) -> dict:
    """{layer_id: LongTensor [(N-1)·H]} of distinct primes, ordered order-major then head."""
    if max_ngram_size < 2 or n_heads < 1 or vocab_size < 1:
        raise ValueError(
            f"engram_primes needs max_ngram_size >= 2, n_heads >= 1, vocab_size >= 1; got "
            f"{max_ngram_size}, {n_heads}, {vocab_size}"
        )
    seen: set[int] = set()  # global over all layers: no two sub-tables share a prime
    primes = {}
    for layer_id in engram_layer_ids:
        layer_primes = []
        for _order in range(2, max_ngram_size + 1):
            candidate = vocab_size - 1
            for _head in range(n_heads):
                candidate += 1
                while candidate in seen or not _is_prime(candidate):
                    candidate += 1
                seen.add(candidate)
                layer_primes.append(candidate)
        primes[layer_id] = torch.tensor(layer_primes, dtype=torch.long)
    return primes


def engram_offsets(primes: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums: first row of each sub-table inside the layer's table."""
    return torch.cumsum(primes, 0) - primes


def engram_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """Odd multipliers [N]; the bound keeps every ``tok·m`` below INT64_MAX."""
    rng = np.random.default_rng(10007 * layer_id)
    bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    v = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return torch.from_numpy(2 * v + 1)


def engram_hash(
    input_ids: torch.Tensor,
    cmap: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_ngram_size: int,
    pad_id: int,
    image_mask: torch.Tensor | None = None,
    map_size: int | None = None,
) -> torch.Tensor:
    """Table rows [b, s, (N-1)·H] (int64), columns order-major then head.  ``map_size``: see ``compress_ids``."""
    n = max_ngram_size
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    if multipliers.shape != (n,):
        raise ValueError(
            f"multipliers must have shape [{n}] (max_ngram_size), got {tuple(multipliers.shape)}"
        )
    if primes.dim() != 1 or primes.numel() % (n - 1) or offsets.shape != primes.shape:
        raise ValueError(
            f"primes and offsets must both be [(max_ngram_size-1)·n_heads] = [{n - 1}·H], got "
            f"{tuple(primes.shape)} and {tuple(offsets.shape)}"
        )
    if image_mask is not None and image_mask.shape != input_ids.shape:
        raise ValueError(
            f"image_mask must match input_ids {tuple(input_ids.shape)}, got {tuple(image_mask.shape)}"
        )
    b, s = input_ids.shape
    n_heads = primes.numel() // (n - 1)
    dev = input_ids.device
    if s == 0:
        return torch.zeros(b, 0, (n - 1) * n_heads, dtype=torch.long, device=dev)
    cmap, multipliers = cmap.to(dev), multipliers.to(dev)
    primes, offsets = primes.to(dev), offsets.to(dev)

    pad = cmap[pad_id]
    tok = compress_ids(input_ids.long(), cmap, map_size)  # [b, s]
    dead = torch.zeros_like(tok, dtype=torch.bool) if image_mask is None else image_mask.to(dev, torch.bool)
    # Left-pad n-1 positions that count as dead: "before the start" blocks history like an image token.
    tok = torch.cat([tok.new_full((b, n - 1), 0), tok], 1)  # [b, s+n-1]
    dead = torch.cat([dead.new_ones((b, n - 1)), dead], 1)
    # Sliding windows, slot k = position t-k: [b, s, n].
    win_tok = tok.unfold(1, n, 1).flip(-1)
    win_dead = dead.unfold(1, n, 1).flip(-1)
    # Slot k is blocked when any slot 0..k is dead.
    blocked = win_dead.cumsum(-1) > 0
    win_tok = torch.where(blocked, pad, win_tok)

    terms = win_tok * multipliers  # [b, s, n]; no wrap for ids < compressed vocab (see module doc)
    mixes = []
    mix = terms[..., 0]
    for k in range(1, n):  # n-1 XOR steps over the slot axis, not over tokens
        mix = mix ^ terms[..., k]
        mixes.append(mix)
    # [b, s, n-1] -> [b, s, (n-1)·H], order-major then head (contiguous: the fastest remainder on CPU)
    mix = torch.stack(mixes, -1).unsqueeze(-1).expand(b, -1, n - 1, n_heads).flatten(2)
    return torch.remainder(mix, primes).add_(offsets)


class EngramHasher:
    """Holds the compression map and every Engram layer's multipliers / primes / offsets.

    ``hasher(input_ids, image_mask=None)`` -> ``{layer_id: LongTensor [b, s, (N-1)·H]}``.
    Plain tensors and ints only, so it pickles into DataLoader workers.
    """

    def __init__(
        self,
        cmap: torch.Tensor,
        engram_layer_ids,
        max_ngram_size: int,
        n_heads: int,
        vocab_size: int,
        pad_id: int,
        compressed_vocab_size: int | None = None,
        num_embeddings=None,
    ):
        size = compression_map_size(cmap)
        if compressed_vocab_size is not None and size != compressed_vocab_size:
            raise ValueError(
                f"the tokenizer's Engram compression map has {size} ids but the config expects "
                f"engram_compressed_vocab_size={compressed_vocab_size}; use the model's own tokenizer.json "
                "(the DeepSeek-V4 tokenizer gives 99,092)"
            )
        self.cmap = cmap
        self.layer_ids = list(engram_layer_ids)
        self.max_ngram_size = max_ngram_size
        self.pad_id = pad_id
        primes = engram_primes(self.layer_ids, max_ngram_size, n_heads, vocab_size)
        if num_embeddings is not None:
            rows = [int(primes[layer].sum()) for layer in self.layer_ids]
            if rows != list(num_embeddings):
                raise ValueError(
                    f"Engram table rows from the primes {rows} differ from engram_num_embeddings "
                    f"{list(num_embeddings)}; check engram_vocab_size / engram_n_heads / engram_max_ngram_size"
                )
        self.primes = primes
        self.offsets = {layer: engram_offsets(p) for layer, p in primes.items()}
        self.multipliers = {
            layer: engram_multipliers(layer, max_ngram_size, size) for layer in self.layer_ids
        }

    @classmethod
    def from_config(cls, config, tokenizer) -> "EngramHasher":
        """From a text config (``engram_*`` attributes) and a tokenizer (see ``build_compression_map``)."""
        return cls(
            build_compression_map(tokenizer),
            config.engram_layer_ids,
            config.engram_max_ngram_size,
            config.engram_n_heads,
            config.engram_vocab_size,
            config.engram_pad_token_id,
            compressed_vocab_size=config.engram_compressed_vocab_size,
            num_embeddings=getattr(config, "engram_num_embeddings", None),
        )

    def to(self, device) -> "EngramHasher":
        """Move the tables once (``engram_hash`` would otherwise copy them on every call)."""
        self.cmap = self.cmap.to(device)
        for table in (self.primes, self.offsets, self.multipliers):
            for layer in table:
                table[layer] = table[layer].to(device)
        return self

    def __call__(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> dict:
        return {
            layer: engram_hash(
                input_ids,
                self.cmap,
                self.multipliers[layer],
                self.primes[layer],
                self.offsets[layer],
                max_ngram_size=self.max_ngram_size,
                pad_id=self.pad_id,
                image_mask=image_mask,
            )
            for layer in self.layer_ids
        }
