"""The V4.1 decode cache: what one more token per row needs from the tokens already seen.

Per attention layer (``CSA2LayerCache``):
* every layer: ``window_kv`` [b, W, head_dim], the last W window keys (= values, post-RoPE, FP8-rounded) as a
  ring: position p lives in slot p % W;
* Full (compressor-owning) layers: ``compressed_kv`` [b, cap, head_dim] (post-RoPE, FP4-rounded) and ``index_k``
  [b, cap, index_head_dim], one entry per completed group of ``ratio`` tokens (entry j = tokens j·r .. j·r+r-1),
  plus, for ratio 2, the open group's fp32 projections ``carry_kv`` / ``carry_score`` [b, r, head_dim] (slot
  p % r): the compressor pools them once the group completes.
Reuse / Reindex layers and the candidate stage keep nothing of their own: each step their Full source
publishes its cached compressed KV and index keys, and the indexers score the new query against them.
Per model: each row's real-token count ``lengths`` (the next token's position; rows of a left-padded batch
differ), the input columns consumed (``get_seq_length``, padding included, which is what ``generate`` slices
by), and Engram's context: each row's last ``max_ngram - 1`` token ids and whether each is dead (an image
token or before the start), since an n-gram looks that far back.

Bytes per token (bf16, ``cache_bytes_per_token``): only the Full layers' entries grow with the context, by
(head_dim + index_head_dim)·2 bytes per ratio tokens.  At the released config (Full layers 2, 8, 14 at ratio 2
and 20 at ratio 1; head_dim 512, index_head_dim 128): 3·640 + 1280 = 3,200 bytes per token, plus a fixed
40·128·512·2 = 5.2 MB per sequence of window rings.  The official ``model.py`` keeps the same tensors as
module buffers sized for ``max_batch_size`` × ``max_seq_len`` up front: ``window_kv_cache`` [B, W, head_dim]
in every layer, ``compress_kv_cache`` [B, max_seq_len / r, head_dim] and the indexer's ``k_cache``
[B, max_seq_len / r, index_head_dim] in the Full layers, and the compressor's ``kv_state`` / ``score_state``
[B, r, head_dim] fp32: the same 3,200 bytes per token of capacity, allocated whether used or not.  Here the
entries grow with the sequence (capacity doubling) and the cache reorders / repeats rows for beam search.

``DeepseekV41StaticCache`` is the preallocated sibling (``cache_implementation="static"``; what ``generate`` uses on
CUDA): every tensor is sized for its batch and ``max_cache_len`` positions up front, as the official code's buffers
are, and written in place, so a decode step has the same shapes and tensor addresses every time and runs without
reading anything back to the host (it is captured once as a CUDA graph and replayed, ``decode_graph.py``): the
compressed entries are read over the whole capacity with a validity mask ((position + 1) // ratio entries per row)
instead of sliced to the longest row's count, the completed group's entry is a masked in-place write, and the Engram
look-back is a ring indexed by position like the window.  It holds the index keys in fp32 (the dtype the step's
indexer scores read them in; 128·2 more bytes per entry), so no step converts the whole capacity.  Everything a row holds is indexed by its position
(``lengths``, one counter per row): ring slot p % size, entry p // ratio.

Rollback (both caches, ``rollback_tokens=k``; transformers' ``crop``, assisted / prompt-lookup and DSpark
self-speculative decoding): the rings keep k positions more than decoding needs (the window W + k keys, the open
group's carry r + k projections, the Engram look-back n - 1 + k ids), so forgetting a row's last k tokens
(``rollback``) is only a smaller counter: what the earlier positions need is still in their slots, and the entries
past the new count are unread (masked, or past the slice) until their group completes again and rewrites them.
"""

import torch
from transformers.cache_utils import Cache


def ring_of(values: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    """values [b, s, ...] over left-aligned rows (real tokens at 0 .. lengths-1) -> [b, size, ...]: positions
    lengths - size .. lengths - 1 in slots p % size (``size`` distinct slots); those before the start are zero."""
    pos = lengths.unsqueeze(1) - size + torch.arange(size, device=values.device)  # [b, size]
    tail = [1] * (values.dim() - 2)

    def spread(index):  # [b, size] -> values' shape past dim 1
        return index.view(*index.shape, *tail).expand(-1, -1, *values.shape[2:])

    rows = values.gather(1, spread(pos.clamp(min=0))).masked_fill(spread(pos < 0), 0)
    return torch.zeros_like(rows).scatter(1, spread(pos % size), rows)


def ring_slots(pos: torch.Tensor, size: int, span: int) -> torch.Tensor:
    """int64 [b, size]: for a ring of ``size`` slots holding position p in slot p % size, slot j where it holds
    one of the ``span`` positions pos - span + 1 .. pos (pos [b]) that exist (>= 0), else -1."""
    slots = torch.arange(size, device=pos.device)
    held = pos.unsqueeze(1) - (pos.unsqueeze(1) - slots) % size  # the latest position <= pos in each slot
    return torch.where((held >= 0) & (pos.unsqueeze(1) - held < span), slots, -1)


class CSA2LayerCache:
    """One attention layer's decode state (see the module docstring).  ``spare``: positions the rings keep beyond
    what decoding reads (the cache's ``rollback_tokens``)."""

    static = False

    def __init__(self, window: int, ratio: int, full: bool, spare: int = 0):
        self.window, self.ratio, self.full = window, ratio, full
        self.window_ring = window + spare  # slots of the window ring: position p in slot p % window_ring
        self.carry_ring = ratio + spare if full and ratio > 1 else 0  # slots of the open group's projections
        self.window_kv = None  # [b, window_ring, head_dim]
        self.compressed_kv = self.index_k = None  # [b, cap, ·]: entries 0 .. lengths // ratio - 1 are valid
        self.carry_kv = self.carry_score = None  # fp32 [b, carry_ring, head_dim] (ratio > 1 Full layers)

    def tensors(self) -> dict:
        return {name: value for name, value in vars(self).items() if isinstance(value, torch.Tensor)}

    def map_tensors(self, fn) -> None:
        for name, value in self.tensors().items():
            setattr(self, name, fn(value))

    def _store(self, name: str, value: torch.Tensor) -> None:
        setattr(self, name, value)

    # ---- prefill: rows left-aligned, real tokens at columns 0 .. lengths-1 -------------------------------

    def fill_window(self, kv: torch.Tensor, lengths: torch.Tensor) -> None:
        # kv [b, s, d]: the ring holds positions lengths - window_ring .. lengths - 1 (those < 0 are zero, never read)
        self._store("window_kv", ring_of(kv, lengths, self.window_ring))

    def fill_compressed(self, compressed_kv: torch.Tensor, index_k: torch.Tensor) -> None:
        # [b, T, ·] for the T = s // ratio groups of the frame; a row's entries past lengths // ratio are unused
        self.compressed_kv, self.index_k = compressed_kv.clone(), index_k.clone()

    def fill_carry(self, x: torch.Tensor, lengths: torch.Tensor, project) -> None:
        # x [b, s, dim] (the attention input), project: x rows -> fp32 (kv, score) [.., head_dim].  The ring holds
        # the projections of positions lengths - carry_ring .. lengths - 1 in slots p % carry_ring: the open group's
        # tokens among them (its slots past the row's end are rewritten before the group is pooled)
        kv, score = project(ring_of(x, lengths, self.carry_ring))  # rows in slot order
        self._store("carry_kv", kv)
        self._store("carry_score", score)

    # ---- decode: n new tokens per row at positions pos [b, n] (consecutive; n = 1 but for a multi-token step,
    # whose n - 1 <= spare extra ring slots keep what its first token reads); written in place -----------------

    def push_window(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # kv [b, n, d] -> the ring [b, window_ring, d] with position pos[:, j] in slot pos % window_ring
        slot = (pos % self.window_ring).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        return self.window_kv.scatter_(1, slot, kv.to(self.window_kv.dtype))

    def window_slots(self, pos: torch.Tensor) -> torch.Tensor:
        # int64 [b, n, window_ring]: slot ids the query at pos[:, j] reads (its last `window` positions; a slot
        # rewritten by a later token of the step is past that span), -1 elsewhere
        return ring_slots(pos.reshape(-1), self.window_ring, self.window).view(*pos.shape, self.window_ring)

    def push_carry(self, kv: torch.Tensor, score: torch.Tensor, pos: torch.Tensor):
        # fp32 [b, n, d] each at positions pos [b, n] -> each token's group's r projections [b, n, r, d] each, in
        # position order (the group's positions past the token hold stale rows: only a completed group is pooled)
        slot = (pos % self.carry_ring).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        self.carry_kv.scatter_(1, slot, kv)
        self.carry_score.scatter_(1, slot, score)
        if self.carry_ring == self.ratio and pos.shape[1] == 1:  # slot j holds the group's j-th position
            return self.carry_kv.unsqueeze(1), self.carry_score.unsqueeze(1)
        group = (pos // self.ratio * self.ratio).unsqueeze(-1) + torch.arange(self.ratio, device=pos.device)
        at = (group % self.carry_ring).flatten(1).unsqueeze(-1).expand(-1, -1, kv.shape[-1])  # [b, n·r, d]
        shape = (*pos.shape, self.ratio, kv.shape[-1])
        return self.carry_kv.gather(1, at).view(shape), self.carry_score.gather(1, at).view(shape)

    def push_entry(self, kv, key, pos: torch.Tensor, need: int | None) -> None:
        # kv [b, n, d], key [b, n, D]: the pooled entries of the tokens at positions pos [b, n]; entry p // ratio
        # takes the value of the token that completes its group (p % ratio == ratio - 1) where that token is among
        # the n, else keeps what it holds.  need = max(entry) + 1, known on the host (None: a preallocated cache,
        # which never grows).  Every token of a group writes the same value (its completing token's), so the one
        # scatter with repeated entries is deterministic
        if need is not None and need > self.compressed_kv.shape[1]:  # grow by doubling: amortized O(1) per token
            grow = max(need, 2 * self.compressed_kv.shape[1], 16) - self.compressed_kv.shape[1]
            self.compressed_kv = torch.nn.functional.pad(self.compressed_kv, (0, 0, 0, grow))
            self.index_k = torch.nn.functional.pad(self.index_k, (0, 0, 0, grow))
        n = pos.shape[1]
        entry = pos // self.ratio
        last = torch.arange(n, device=pos.device) + (self.ratio - 1 - pos % self.ratio)  # the completing token
        done = (last < n).unsqueeze(-1)  # [b, n, 1]
        source = last.clamp(max=n - 1)
        for store, new in ((self.compressed_kv, kv), (self.index_k, key)):  # in place, masked: O(n) per step
            at = entry.unsqueeze(-1).expand(-1, -1, store.shape[-1])
            completed = new.gather(1, source.unsqueeze(-1).expand(-1, -1, new.shape[-1])).to(store.dtype)
            store.scatter_(1, at, torch.where(done, completed, store.gather(1, at)))


# text_config fields that decide what a cache holds and how it is read
_STRUCTURE = ("num_hidden_layers", "sliding_window", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
              "candidate_source_layer_id", "head_dim", "index_head_dim", "hidden_size", "engram_layer_ids",
              "engram_max_ngram_size")


class StaticCSA2LayerCache(CSA2LayerCache):
    """A layer's decode state in buffers allocated once (at the first prefill, on its layer's device, in the dtypes
    the layer produces) for the batch and ``max_cache_len`` positions, and afterwards only written in place."""

    static = True

    def __init__(self, window: int, ratio: int, full: bool, spare: int, max_cache_len: int, owner):
        super().__init__(window, ratio, full, spare)
        self.entries = -(-max_cache_len // ratio) if full else 0  # entry p // ratio for every position < max_cache_len
        self.owner = owner  # the cache, told when a buffer is (re)allocated: a captured graph read the old one

    def _store(self, name: str, value: torch.Tensor) -> None:
        held = getattr(self, name)
        if held is None or held.shape != value.shape or held.dtype != value.dtype or held.device != value.device:
            setattr(self, name, torch.empty_like(value))
            self.owner.buffers_changed()
        getattr(self, name).copy_(value)

    def fill_compressed(self, compressed_kv: torch.Tensor, index_k: torch.Tensor) -> None:
        # entries 0 .. T-1 from the prefill; the rest of the capacity is rewritten before any row reads it.
        # The index keys are held in fp32, the dtype the decode step's scores read them in (exact: they are bf16
        # values): a bf16 store would be converted whole at every step (1.4 ms at batch 32 and 32k on the H200)
        b, T = compressed_kv.shape[:2]
        for name, value in (("compressed_kv", compressed_kv), ("index_k", index_k)):
            dtype = torch.float32 if name == "index_k" else value.dtype
            held = getattr(self, name)
            if held is None or held.shape != (b, self.entries, value.shape[-1]) or held.dtype != dtype \
                    or held.device != value.device:
                setattr(self, name, value.new_zeros((b, self.entries, value.shape[-1]), dtype=dtype))
                self.owner.buffers_changed()
            getattr(self, name)[:, :T].copy_(value)


# A multi-token decode step's attention gathers, for each of its b·n queries, the window ring's R slots and the
# n·k compressed entries the step picked (sparse_attention_torch: [b, n, R + n·k, head_dim] rows, bf16 then fp32,
# and [b, n, heads, R + n·k] fp32 logits): quadratic in n.  A wider forward over a cache (a long prompt continued
# through it) goes in steps of the widest n under this many bytes: exact, as every step is.
MULTI_TOKEN_STEP_BYTES = 8 << 30


def widest_step(text_config, batch: int, ring: int, cap: int) -> int:
    """The most new tokens per row (at most ``cap``, at least 1) one multi-token step over a cache of ``ring``
    window slots takes within ``MULTI_TOKEN_STEP_BYTES`` at this batch."""
    k = text_config.index_topk if any(text_config.compress_ratios) else 0
    per_slot = 6 * text_config.head_dim + 4 * text_config.num_attention_heads  # bytes per (query, slot)
    n = 1
    while n < cap and batch * (n + 1) * (ring + (n + 1) * k) * per_slot <= MULTI_TOKEN_STEP_BYTES:
        n += 1
    return n


class DeepseekV41Cache(Cache):
    """A transformers ``Cache`` for DeepSeek-V4.1 (CSA2 attention, Engram): ``use_cache=True`` returns one,
    ``past_key_values=`` / ``cache=`` takes it back; ``generate`` reorders and repeats it for beam search.

    A decode step takes one token per row, or up to ``step_width()`` (a multi-token step: a speculative block
    verified in one pass); wider inputs are decoded in steps of that width.
    ``rollback_tokens``: how many of its last positions per row it can forget (``rollback``, ``crop``)."""

    # generate's auto-compile (torch.compile of the whole forward, prefill included) stays off: the model captures
    # its own decode step as a CUDA graph (decode_graph.py)
    is_compileable = False
    is_static = False

    def __init__(self, config, batch_size: int | None = None, rollback_tokens: int = 0):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text = getattr(text, "text_config", text)
        self.text_config = text
        if rollback_tokens < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        self.rollback_tokens = rollback_tokens
        layers = [self._layer_cache(i) for i in range(text.num_hidden_layers)]
        try:
            super().__init__(layers=layers)
        except TypeError:  # an older Cache.__init__ without ``layers``
            super().__init__()
            self.layers = layers
        self.columns = 0  # input columns consumed (padding included)
        self.lengths = None  # int64 [b]: real tokens seen per row = the next token's position
        self.lengths_host = None  # the same as Python ints (sizes the decode step without a device sync)
        self.engram_ids = self.engram_dead = None  # [b, max_ngram - 1]: Engram's look-back context

    def _layer_cache(self, layer: int) -> CSA2LayerCache:
        text = self.text_config
        return CSA2LayerCache(text.sliding_window, text.compress_ratios[layer], text.attention_mode(layer) == "full",
                              self.rollback_tokens)

    # ---- what the model calls ------------------------------------------------------------------------------

    def begin_prefill(self, batch: int, columns: int) -> None:
        """Before a prefill of ``columns`` columns per row (nothing to prepare: this cache grows)."""

    def finish_prefill(self, input_ids, image_mask, lengths: torch.Tensor, columns: int) -> None:
        """After a prefill over left-aligned rows (input_ids [b, s], image_mask [b, s] or None)."""
        self.columns, self.lengths = columns, lengths.clone()
        self.lengths_host = lengths.tolist()
        n = self.text_config.engram_max_ngram_size - 1
        if self.text_config.engram_layer_ids and n > 0:  # the look-back, plus rollback_tokens older ids
            n += self.rollback_tokens
            pos = lengths.unsqueeze(1) - n + torch.arange(n, device=lengths.device)  # [b, n]
            safe = pos.clamp(min=0)
            self.engram_ids = input_ids.gather(1, safe)
            dead = pos < 0
            if image_mask is not None:
                dead = dead | image_mask.gather(1, safe)
            self.engram_dead = dead

    def check_room(self, new_columns: int) -> None:
        """Raise unless ``new_columns`` more columns fit (always: this cache grows)."""

    def entries_visible(self, ratio: int, new: int = 1) -> int | None:
        """Compressed entries a decode step of ``new`` tokens per row reads at ``ratio``: the most any row's last
        token sees (a host int, sizing the step's tensors), or None for all of a preallocated cache's capacity,
        masked per query."""
        return max((n + new) // ratio for n in self.lengths_host)

    def entries_needed(self, ratio: int, new: int = 1) -> int | None:
        """Entries the step's group-completion writes need room for (None: preallocated)."""
        return max((n + new - 1) // ratio for n in self.lengths_host) + 1

    def step_width(self) -> int:
        """The most tokens per row one step takes in one pass (a multi-token step): rollback_tokens + 1, as its
        rings keep ``rollback_tokens`` positions beyond what one token reads and the step's first token still needs
        the positions that its last n - 1 tokens overwrite in a ring of fewer spare slots; and no wider than
        ``MULTI_TOKEN_STEP_BYTES`` of attention slots at this batch."""
        text = self.text_config
        return widest_step(text, max(self.batch_size, 1), text.sliding_window + self.rollback_tokens,
                           self.rollback_tokens + 1)

    def advance(self, input_ids: torch.Tensor) -> None:
        """After a decode step of one text token per row (input_ids [b, 1])."""
        self.advance_rows(input_ids)
        self.columns += 1

    def advance_rows(self, input_ids: torch.Tensor) -> None:
        """The per-row part of ``advance`` after a step of input_ids [b, n]: each row's count and Engram context."""
        n = input_ids.shape[1]
        self.lengths = self.lengths + n
        self.lengths_host = [length + n for length in self.lengths_host]
        if self.engram_ids is not None:
            width = self.engram_ids.shape[1]
            self.engram_ids = torch.cat([self.engram_ids, input_ids], dim=1)[:, -width:]
            dead = torch.cat([self.engram_dead, self.engram_dead.new_zeros(input_ids.shape)], 1)
            self.engram_dead = dead[:, -width:]

    def engram_context(self, input_ids: torch.Tensor):
        """(ids [b, n-1+s], dead [b, n-1+s]): the look-back context followed by the new tokens [b, s]."""
        n = self.text_config.engram_max_ngram_size - 1
        ids = torch.cat([self.engram_ids[:, self.engram_ids.shape[1] - n :], input_ids], dim=1)
        dead = self.engram_dead[:, self.engram_dead.shape[1] - n :]
        return ids, torch.cat([dead, dead.new_zeros(input_ids.shape)], dim=1)

    def rollback(self, counts) -> None:
        """Forget the last ``counts`` positions of each row (an int, or int64 [b] per row), exactly: the state is then
        the one a cache that never saw them holds.  Everything is indexed by position, and the rings keep
        ``rollback_tokens`` positions more than decoding reads, so this only lowers the counts: the window keys,
        the open group's carry and the Engram look-back of the earlier positions are still in their slots; the
        compressed entries and index keys of groups that are no longer complete are past the new counts, unread
        until the group completes again and rewrites them."""
        if self.lengths is None:
            raise ValueError("rollback before a prefill: the cache holds nothing")
        counts = torch.as_tensor(counts, device=self.lengths.device).expand_as(self.lengths)
        host = counts.tolist()
        lengths_host = self.lengths.tolist()
        for row, (k, n) in enumerate(zip(host, lengths_host)):
            if not 0 <= k <= self.rollback_tokens or k > n:
                raise ValueError(
                    f"cannot roll row {row} back by {k} positions: this {type(self).__name__} keeps "
                    f"rollback_tokens={self.rollback_tokens} positions to undo (the row holds {n}); make it with "
                    "rollback_tokens >= the most positions a step may undo"
                )
        self._rollback_rows(counts)
        self.lengths_host = [n - k for n, k in zip(lengths_host, host)]
        self.columns -= min(host)  # the columns of the longest row that remain

    def _rollback_rows(self, counts: torch.Tensor) -> None:
        # the growing cache: the counts, and the Engram register shifted right by each row's count (its oldest
        # ids come back from the spare entries; what falls before the register is dead and never read)
        self.lengths = self.lengths - counts
        if self.engram_ids is not None:
            width = self.engram_ids.shape[1]
            src = torch.arange(width, device=counts.device).unsqueeze(0) - counts.unsqueeze(1)  # [b, width]
            self.engram_ids = self.engram_ids.gather(1, src.clamp(min=0))
            self.engram_dead = self.engram_dead.gather(1, src.clamp(min=0)) | (src < 0)

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (capacity included)."""
        tensors = [t for layer in self.layers for t in layer.tensors().values()]
        tensors += [t for t in (self.lengths, self.engram_ids, self.engram_dead) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_matches(self, model, batch: int | None = None) -> None:
        """``ValueError`` naming what differs unless this cache was made by a model of ``model``'s structure
        (layers, window, compression, widths) and, once filled, holds ``batch`` rows (when given) in the
        model's dtype on each block's device: another model's cache would be read at the wrong shapes or
        silently mix two models' states."""
        mine, theirs = self.text_config, model.config.text_config
        fix = "start from a fresh cache (use_cache=True, or no past_key_values) made by this model"
        for field in _STRUCTURE:
            a, b = getattr(mine, field, None), getattr(theirs, field, None)
            if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
                raise ValueError(f"the cache was made for another model: its text_config.{field} is {a!r}, this "
                                 f"model's is {b!r}; {fix}")
        if len(self.layers) != len(model.layers):
            raise ValueError(f"the cache holds {len(self.layers)} layers, this model has {len(model.layers)}; {fix}")
        if self.lengths is None:
            return
        if batch is not None and self.batch_size != batch:
            raise ValueError(f"the cache holds {self.batch_size} rows but input_ids has {batch}: give the rows the "
                             "cache was filled with (generate expands the cache itself for beams and samples)")
        dtype = model.embed.weight.dtype
        widths = {"window_kv": theirs.head_dim, "compressed_kv": theirs.head_dim, "index_k": theirs.index_head_dim,
                  "carry_kv": theirs.head_dim, "carry_score": theirs.head_dim}
        for i, (layer, block) in enumerate(zip(self.layers, model.layers)):
            device = block.hc_attn_fn.device
            for name, t in layer.tensors().items():
                where = f"the cache's layer {i} {name}"
                if t.shape[0] != self.batch_size or t.shape[-1] != widths[name]:
                    raise ValueError(f"{where} has shape {tuple(t.shape)}; this model needs [{self.batch_size}, ·, "
                                     f"{widths[name]}]; {fix}")
                # compressor carries are fp32; the static cache keeps index keys in fp32 too (its step reads them so)
                fp32 = name.startswith("carry") or (name == "index_k" and isinstance(self, DeepseekV41StaticCache))
                want = torch.float32 if fp32 else dtype
                if t.dtype != want:
                    raise ValueError(f"{where} is {t.dtype} but this model computes in {want}; {fix}, or cast the "
                                     "model back to the dtype that filled the cache")
                if t.device != device:
                    raise ValueError(f"{where} is on {t.device} but block {i} runs on {device}; {fix}, or move the "
                                     "model back to the device that filled the cache")

    # ---- the transformers Cache interface ------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    @property
    def is_initialized(self) -> bool:
        return self.lengths is not None

    @property
    def is_croppable(self) -> bool:
        return self.rollback_tokens > 0

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def batch_size(self) -> int:
        return -1 if self.lengths is None else self.lengths.shape[0]

    def _map_rows(self, fn) -> None:
        for layer in self.layers:
            layer.map_tensors(fn)
        for name in ("lengths", "engram_ids", "engram_dead"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if self.lengths is not None:
            self.lengths_host = self.lengths.tolist()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.__init__(self.text_config)

    def crop(self, max_length: int) -> None:
        """transformers' crop: keep the first ``max_length`` columns, or drop the last ``-max_length`` (negative) of
        every row (``rollback``; assisted and prompt-lookup decoding undo their rejected candidates this way)."""
        remove = -max_length if max_length < 0 else self.columns - max_length
        if remove < 0:
            raise ValueError(f"crop({max_length}) asks for more columns than the {self.columns} this cache holds")
        if remove:
            self.rollback(remove)

    def activate_past_recording(self, *args, **kwargs) -> None:  # nothing to record: the rings keep the past
        pass

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"DeepseekV41Cache(columns={self.columns}, lengths={self.lengths_host}, bytes={self.nbytes()})"


class DeepseekV41StaticCache(DeepseekV41Cache):
    """A ``DeepseekV41Cache`` preallocated for one batch and ``max_cache_len`` positions (prompt columns, padding
    included, plus the tokens to decode), written in place: its decode step has fixed shapes and reads nothing back
    to the host, so the model captures it as a CUDA graph (``decode_graph.py``).  ``generate`` builds one on CUDA
    (and anywhere with ``cache_implementation="static"``); it can also be made by hand and passed as ``cache=``.

    The buffers are allocated at the first prefill (its batch; each layer's on its device, in the dtypes the model
    computes) and reused by later prefills of the same batch.  ``rollback_tokens``: extra ring slots that keep the
    state of that many earlier positions (see the module docstring); 0 keeps exactly what decoding reads."""

    is_static = True

    def __init__(self, config, max_cache_len: int, rollback_tokens: int = 0):
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive number of positions, got {max_cache_len}")
        if rollback_tokens < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        self._max_cache_len = max_cache_len
        self.version = 0  # bumped whenever a buffer is (re)allocated: a graph captured on the old ones is stale
        super().__init__(config, rollback_tokens=rollback_tokens)
        n = self.text_config.engram_max_ngram_size - 1
        self.engram_ring = n + rollback_tokens if self.text_config.engram_layer_ids and n > 0 else 0
        # the captured decode steps by (width, DSpark input) (decode_graph.DecodeGraph) or why there is none (str)
        self.graphs = {}

    @property
    def graph(self):
        """The one-token decode step's graph (``graphs[(1, False)]``), or why there is none, or None."""
        return self.graphs.get((1, False))

    @graph.setter
    def graph(self, value) -> None:  # None: forget every graph (the next steps capture their own)
        if value is None:
            self.graphs.clear()
        else:
            self.graphs[(1, False)] = value

    def _layer_cache(self, layer: int) -> CSA2LayerCache:
        text = self.text_config
        return StaticCSA2LayerCache(text.sliding_window, text.compress_ratios[layer],
                                    text.attention_mode(layer) == "full", self.rollback_tokens, self.max_cache_len,
                                    self)

    def buffers_changed(self) -> None:
        self.version += 1

    def _buffer(self, name: str, value: torch.Tensor) -> torch.Tensor:
        # value copied into the held buffer `name`, (re)allocated when its shape, dtype or device differs
        held = getattr(self, name)
        if held is None or held.shape != value.shape or held.dtype != value.dtype or held.device != value.device:
            setattr(self, name, torch.empty_like(value))
            self.buffers_changed()
        return getattr(self, name).copy_(value)

    # ---- what the model calls ------------------------------------------------------------------------------

    def begin_prefill(self, batch: int, columns: int) -> None:
        if columns > self.max_cache_len:
            raise ValueError(
                f"a prompt of {columns} columns (padding included) does not fit this DeepseekV41StaticCache of "
                f"max_cache_len={self.max_cache_len}; make the cache with a larger max_cache_len (generate sizes it "
                "as prompt + max_new_tokens)"
            )

    def finish_prefill(self, input_ids, image_mask, lengths: torch.Tensor, columns: int) -> None:
        self.columns = columns
        self._buffer("lengths", lengths)
        if self.engram_ring:  # the ring: position p in slot p % engram_ring; before the start or an image: dead
            pos = lengths.unsqueeze(1) - self.engram_ring + torch.arange(self.engram_ring, device=lengths.device)
            safe, slots = pos.clamp(min=0), pos % self.engram_ring
            dead = pos < 0
            if image_mask is not None:
                dead = dead | image_mask.gather(1, safe)
            self._buffer("engram_ids", torch.zeros_like(safe).scatter(1, slots, input_ids.gather(1, safe)))
            self._buffer("engram_dead", torch.zeros_like(dead).scatter(1, slots, dead))

    def check_room(self, new_columns: int) -> None:
        if self.columns + new_columns > self.max_cache_len:
            raise ValueError(
                f"this DeepseekV41StaticCache holds max_cache_len={self.max_cache_len} positions and has used "
                f"{self.columns}: {new_columns} more do not fit; make the cache with a larger max_cache_len"
            )

    def entries_visible(self, ratio: int, new: int = 1) -> None:
        return None

    def entries_needed(self, ratio: int, new: int = 1) -> None:
        return None

    def advance_rows(self, input_ids: torch.Tensor) -> None:
        # in place (a captured graph replays these writes): the new tokens [b, n] into the Engram ring, the counts
        n = input_ids.shape[1]
        if self.engram_ring:
            slot = (self.lengths.unsqueeze(1) + torch.arange(n, device=self.lengths.device)) % self.engram_ring
            self.engram_ids.scatter_(1, slot, input_ids.to(self.engram_ids.dtype))
            self.engram_dead.scatter_(1, slot, torch.zeros_like(slot, dtype=torch.bool))
        self.lengths.add_(n)

    def _rollback_rows(self, counts: torch.Tensor) -> None:
        # in place (a captured graph reads these buffers): the Engram ring is indexed by position like the rest
        self.lengths.sub_(counts)

    def engram_context(self, input_ids: torch.Tensor):
        n = self.text_config.engram_max_ngram_size - 1
        pos = self.lengths.unsqueeze(1) - n + torch.arange(n, device=self.lengths.device)  # [b, n]
        slots = pos % self.engram_ring
        ids = torch.cat([self.engram_ids.gather(1, slots), input_ids.to(self.engram_ids.dtype)], dim=1)
        dead = self.engram_dead.gather(1, slots) | (pos < 0)
        return ids, torch.cat([dead, dead.new_zeros(input_ids.shape)], dim=1)

    # ---- the transformers Cache interface ------------------------------------------------------------------

    @property
    def max_cache_len(self) -> int:  # a read-only property of Cache in transformers 5.1x: ours, not deprecated
        return self._max_cache_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_cache_len

    def _map_rows(self, fn) -> None:
        # beam search's reorder keeps the batch: rows are copied in place (the buffers, and a graph on them, stay);
        # a selection or repetition changes it: new buffers
        tensors = [(layer, name, t) for layer in self.layers for name, t in layer.tensors().items()]
        tensors += [(self, name, getattr(self, name)) for name in ("lengths", "engram_ids", "engram_dead")
                    if getattr(self, name) is not None]
        for owner, name, t in tensors:
            new = fn(t)
            if new.shape == t.shape:
                t.copy_(new)
            else:
                setattr(owner, name, new)
                self.buffers_changed()

    def reset(self) -> None:
        # the buffers stay (the next prefill overwrites what it reads); so does a graph captured on them
        self.columns = 0

    def __repr__(self) -> str:
        return (f"DeepseekV41StaticCache(columns={self.columns}, max_cache_len={self.max_cache_len}, "
                f"batch={self.batch_size}, bytes={self.nbytes()})")


def cache_bytes_per_token(text_config, bytes_per_element: int = 2, static: bool = False) -> float:
    """Steady-state cache growth per token: the Full layers' compressed entries and index keys (``static``: a
    ``DeepseekV41StaticCache``'s, which holds the index keys in fp32)."""
    total = 0.0
    for layer in range(text_config.num_hidden_layers):
        if text_config.attention_mode(layer) == "full":
            index_bytes = 4 if static else bytes_per_element
            width = text_config.head_dim * bytes_per_element + text_config.index_head_dim * index_bytes
            total += width / text_config.compress_ratios[layer]
    return total
