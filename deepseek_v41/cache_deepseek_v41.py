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
"""

import torch
from transformers.cache_utils import Cache


class CSA2LayerCache:
    """One attention layer's decode state (see the module docstring)."""

    def __init__(self, window: int, ratio: int, full: bool):
        self.window, self.ratio, self.full = window, ratio, full
        self.window_kv = None  # [b, W, head_dim] ring, slot p % W
        self.compressed_kv = self.index_k = None  # [b, cap, ·]: entries 0 .. lengths // ratio - 1 are valid
        self.carry_kv = self.carry_score = None  # fp32 [b, r, head_dim] (ratio > 1 Full layers)

    def tensors(self) -> dict:
        return {name: value for name, value in vars(self).items() if isinstance(value, torch.Tensor)}

    def map_tensors(self, fn) -> None:
        for name, value in self.tensors().items():
            setattr(self, name, fn(value))

    # ---- prefill: rows left-aligned, real tokens at columns 0 .. lengths-1 -------------------------------

    def fill_window(self, kv: torch.Tensor, lengths: torch.Tensor) -> None:
        # kv [b, s, d]: the ring holds positions lengths - W .. lengths - 1 (those < 0 are zero, never read)
        w = self.window
        pos = lengths.unsqueeze(1) - w + torch.arange(w, device=kv.device)  # [b, W], W distinct slots mod W
        rows = kv.gather(1, pos.clamp(min=0).unsqueeze(-1).expand(-1, -1, kv.shape[-1]))
        rows = rows.masked_fill((pos < 0).unsqueeze(-1), 0)
        slots = (pos % w).unsqueeze(-1).expand_as(rows)
        self.window_kv = torch.zeros_like(rows).scatter(1, slots, rows)

    def fill_compressed(self, compressed_kv: torch.Tensor, index_k: torch.Tensor) -> None:
        # [b, T, ·] for the T = s // ratio groups of the frame; a row's entries past lengths // ratio are unused
        self.compressed_kv, self.index_k = compressed_kv.clone(), index_k.clone()

    def fill_carry(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        # fp32 [b, r, d]: slot j holds position (lengths // r)·r + j (slots past the row's end are rewritten first)
        self.carry_kv, self.carry_score = kv.clone(), score.clone()

    # ---- decode: one new token per row at positions pos [b]; written in place ------------------------------

    def push_window(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # kv [b, d] -> the ring [b, W, d] with position pos in slot pos % W
        slot = (pos % self.window).view(-1, 1, 1).expand(-1, 1, kv.shape[-1])
        return self.window_kv.scatter_(1, slot, kv.unsqueeze(1).to(self.window_kv.dtype))

    def window_slots(self, pos: torch.Tensor) -> torch.Tensor:
        # int64 [b, 1, W]: slot ids a query at pos may read (-1 while the ring is still filling)
        slots = torch.arange(self.window, device=pos.device)
        return torch.where(slots <= pos.unsqueeze(1), slots, -1).unsqueeze(1)

    def push_carry(self, kv: torch.Tensor, score: torch.Tensor, pos: torch.Tensor):
        # fp32 [b, d] each -> the open group's slots [b, r, d] with position pos in slot pos % r
        slot = (pos % self.ratio).view(-1, 1, 1).expand(-1, 1, kv.shape[-1])
        return self.carry_kv.scatter_(1, slot, kv.unsqueeze(1)), self.carry_score.scatter_(1, slot, score.unsqueeze(1))

    def push_entry(self, kv, key, entry: torch.Tensor, complete: torch.Tensor, need: int) -> None:
        # kv [b, d], key [b, D]: written at entry [b] in the rows whose group just completed (complete [b] bool);
        # need = max(entry) + 1, known on the host
        if need > self.compressed_kv.shape[1]:  # grow by doubling: amortized O(1) per token
            grow = max(need, 2 * self.compressed_kv.shape[1], 16) - self.compressed_kv.shape[1]
            self.compressed_kv = torch.nn.functional.pad(self.compressed_kv, (0, 0, 0, grow))
            self.index_k = torch.nn.functional.pad(self.index_k, (0, 0, 0, grow))
        for store, new in ((self.compressed_kv, kv), (self.index_k, key)):  # in place: O(1) per step
            at = entry.view(-1, 1, 1).expand(-1, 1, store.shape[-1])
            value = torch.where(complete.view(-1, 1, 1), new.unsqueeze(1).to(store.dtype), store.gather(1, at))
            store.scatter_(1, at, value)


# text_config fields that decide what a cache holds and how it is read
_STRUCTURE = ("num_hidden_layers", "sliding_window", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
              "candidate_source_layer_id", "head_dim", "index_head_dim", "hidden_size", "engram_layer_ids",
              "engram_max_ngram_size")


class DeepseekV41Cache(Cache):
    """A transformers ``Cache`` for DeepSeek-V4.1 (CSA2 attention, Engram): ``use_cache=True`` returns one,
    ``past_key_values=`` / ``cache=`` takes it back; ``generate`` reorders and repeats it for beam search.

    Decoding runs one token per row per step (several new columns are decoded one after the other)."""

    is_compileable = False

    def __init__(self, config, batch_size: int | None = None):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text = getattr(text, "text_config", text)
        layers = [
            CSA2LayerCache(text.sliding_window, text.compress_ratios[i], text.attention_mode(i) == "full")
            for i in range(text.num_hidden_layers)
        ]
        try:
            super().__init__(layers=layers)
        except TypeError:  # an older Cache.__init__ without ``layers``
            super().__init__()
            self.layers = layers
        self.text_config = text
        self.columns = 0  # input columns consumed (padding included)
        self.lengths = None  # int64 [b]: real tokens seen per row = the next token's position
        self.lengths_host = None  # the same as Python ints (sizes the decode step without a device sync)
        self.engram_ids = self.engram_dead = None  # [b, max_ngram - 1]: Engram's look-back context

    # ---- what the model calls ------------------------------------------------------------------------------

    def finish_prefill(self, input_ids, image_mask, lengths: torch.Tensor, columns: int) -> None:
        """After a prefill over left-aligned rows (input_ids [b, s], image_mask [b, s] or None)."""
        self.columns, self.lengths = columns, lengths.clone()
        self.lengths_host = lengths.tolist()
        n = self.text_config.engram_max_ngram_size - 1
        if self.text_config.engram_layer_ids and n > 0:
            pos = lengths.unsqueeze(1) - n + torch.arange(n, device=lengths.device)  # [b, n]
            safe = pos.clamp(min=0)
            self.engram_ids = input_ids.gather(1, safe)
            dead = pos < 0
            if image_mask is not None:
                dead = dead | image_mask.gather(1, safe)
            self.engram_dead = dead

    def advance(self, input_ids: torch.Tensor) -> None:
        """After a decode step of one text token per row (input_ids [b, 1])."""
        self.columns += 1
        self.lengths = self.lengths + 1
        self.lengths_host = [n + 1 for n in self.lengths_host]
        if self.engram_ids is not None:
            self.engram_ids = torch.cat([self.engram_ids[:, 1:], input_ids], dim=1)
            self.engram_dead = torch.cat([self.engram_dead[:, 1:], self.engram_dead.new_zeros(input_ids.shape)], 1)

    def engram_context(self, input_ids: torch.Tensor):
        """(ids [b, n-1+1], dead [b, n-1+1]): the look-back context followed by the new token [b, 1]."""
        ids = torch.cat([self.engram_ids, input_ids], dim=1)
        return ids, torch.cat([self.engram_dead, self.engram_dead.new_zeros(input_ids.shape)], dim=1)

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
                want = torch.float32 if name.startswith("carry") else dtype
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
        return False

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

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(
                "DeepseekV41Cache cannot be cropped (its compressed entries and Engram context have no undo); "
                "prefill again from the kept tokens"
            )

    def activate_past_recording(self) -> None:  # nothing to record: crop(n != 0) is refused
        pass

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"DeepseekV41Cache(columns={self.columns}, lengths={self.lengths_host}, bytes={self.nbytes()})"


def cache_bytes_per_token(text_config, bytes_per_element: int = 2) -> float:
    """Steady-state cache growth per token: the Full layers' compressed entries and index keys."""
    total = 0.0
    for layer in range(text_config.num_hidden_layers):
        if text_config.attention_mode(layer) == "full":
            width = text_config.head_dim + text_config.index_head_dim
            total += width * bytes_per_element / text_config.compress_ratios[layer]
    return total
