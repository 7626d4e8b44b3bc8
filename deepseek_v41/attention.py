"""CSA2 attention (architecture.md §5): sliding window + shared compressed KV chosen by an indexer.

Layer modes (from ``compress_ratios`` / ``kv_source_layer_ids`` / ``index_source_layer_ids``):
* ``window``  — ratio 0: the 128-token sliding window only.
* ``full``    — owns a compressor (publishes compressed KV and index keys) and an indexer (publishes top-k);
                the ``candidate_source_layer_id`` also publishes the candidate-block mask.
* ``reindex`` — owns an indexer (``wq_b``, ``weights_proj``) scoring the Full layer's index keys inside the
                candidate blocks; publishes its own top-k.
* ``reuse``   — reads the latest Full layer's compressed KV and the latest Full/Reindex top-k.
What sources publish lives in a per-forward ``CSA2State`` (never module globals), so activation
recomputation sees the same tensors.

With a decode cache (``cache_deepseek_v41``) a prefill also fills each layer's cache, and a decode step (one
new token per row, each row at its own position) reads it: the window ring, the Full layers' cached entries
(published to their Reuse / Reindex consumers as in a prefill) and the compressor's open group.
"""

import torch
from torch import nn

from .kept import KeptFp8Linear
from .kernels_triton import index_scores_fits, index_scores_triton, inference_kernel_usable
from .layers import Fp32Linear, FrozenLinear, is_plain_linear, make_fp32_linear, make_linear, make_rms_norm
from .quantization import quant_ops
from .rope import apply_rope, rope_cis, rope_frequencies
from .sparse_attention import indexer_scores_torch, sparse_attention_torch


class CSA2State:
    """Per-forward values published by source layers: {(layer, name): tensor}.

    Written once per forward; a second write of the same slot (activation recomputation re-running a
    source layer) keeps the first value, so consumers always see what the original forward produced.
    ``cache``: the decode cache a prefill fills (``lengths`` [b]: real tokens per left-aligned row) or a decode
    step reads (``positions`` [b, n]: each row's positions of its n new tokens); None without a cache.
    """

    def __init__(self, cache=None, lengths=None, positions=None):
        self._slots = {}
        self.cache, self.lengths, self.positions = cache, lengths, positions

    def publish(self, layer: int, name: str, value: torch.Tensor) -> None:
        self._slots.setdefault((layer, name), value)

    def to(self, device) -> "CSA2State":
        """Move the published values to ``device`` (blocks placed on several devices by a device_map)."""
        self._slots = {key: value.to(device) for key, value in self._slots.items()}
        return self

    def read(self, layer: int, name: str) -> torch.Tensor:
        if (layer, name) not in self._slots:
            raise RuntimeError(f"CSA2 state has no {name!r} from layer {layer}: source layers must run first")
        return self._slots[(layer, name)]


class _GroupedProjection(torch.autograd.Function):
    """wo_a, block-diagonal: y[t, g] = W[g] · o[t, g] for o [n, groups, d], W [groups, r, d] -> y [n, groups·r].

    Batched GEMMs over strided views, writing their outputs in the token-major layout: einsum would copy o into
    [groups, n, d] first (268 MB a 4096-token sequence at V4.1 widths) and the weight gradient out of a
    [groups, d, r] layout, and a [groups, n, ·] result would be copied again to token-major."""

    @staticmethod
    def forward(ctx, o, w):
        ctx.save_for_backward(o, w)
        n, groups, _ = o.shape
        y = o.new_empty((n, groups, w.shape[1]))
        torch.bmm(o.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))  # written as [groups, n, r] views
        return y.view(n, -1)

    @staticmethod
    def backward(ctx, dy):
        o, w = ctx.saved_tensors
        dy = dy.reshape(o.shape[0], o.shape[1], -1).transpose(0, 1)  # [groups, n, r]
        do = dw = None
        if ctx.needs_input_grad[0]:  # [n, groups, d], contiguous like o: the batched GEMM writes it in place
            do = torch.empty_like(o, memory_format=torch.contiguous_format)
            torch.bmm(dy, w, out=do.transpose(0, 1))
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(dy.transpose(1, 2), o.transpose(0, 1))  # [groups, r, d]
        return do, dw


def attention_backend(name: str):
    """(sparse attention, indexer scores) implementations for the ``attn`` backend name."""
    if name == "tilelang":
        from .kernels_tilelang import indexer_scores_tilelang, sparse_attention_tilelang

        return sparse_attention_tilelang, indexer_scores_tilelang
    return sparse_attention_torch, indexer_scores_model_dtype


def indexer_scores_model_dtype(q, weights, index_k, ratio, visible=None, query_offset: int = 0):
    """``indexer_scores_torch`` rounded as the official Indexer rounds: per-head dot products, weighted values and
    head sum in q's dtype (bf16 in a bf16 model; an fp32 model's are unchanged).  Its top-k then picks what the
    official one picks, near-ties included (fp32 scores chose another entry for ~1.6 % of the fixture's queries)."""
    return indexer_scores_torch(q, weights, index_k, ratio, visible, query_offset, score_dtype=q.dtype)


def torch_attention_bytes(config, layer: int, batch: int, seq: int, kv_bytes: int) -> int:
    """Bytes the ``torch`` attention backend holds at once in ``layer`` for a prefill of ``seq`` columns: the larger
    of the indexer's chunk (fp32 per-head products [b, chunk, index_n_heads, T] and their ReLU, the scores and the
    candidate stage's copies; ``indexer_query_chunk`` keeps it near ``INDEXER_CHUNK_BYTES``) and the attention's
    gathered rows [b, s, k, head_dim] (k = window + top-k slots) in the KV dtype and in fp32.  The gathered rows grow
    with s (240 GiB at 128k tokens for the released widths), which is why long prefills take the TileLang kernels,
    which never form them."""
    ratio = config.compress_ratios[layer]
    slots = config.sliding_window
    indexer = 0
    if ratio:
        entries = seq // ratio
        slots += min(config.index_topk, entries)
        if config.attention_mode(layer) in ("full", "reindex"):
            products = 2 * config.index_n_heads
            chunk = indexer_query_chunk(batch, seq, entries, products)
            indexer = batch * chunk * max(entries, 1) * 4 * (3 + products)
    return max(indexer, batch * seq * slots * config.head_dim * (kv_bytes + 4))


def free_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: CUDA's free memory plus what PyTorch's caching allocator
    holds unused; the host's MemAvailable for the CPU; None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def check_attention_memory(model, batch: int, seq: int) -> None:
    """Raise ``ValueError`` before a prefill that the ``torch`` attention backend cannot hold on its devices (naming
    the backend, the bytes needed and the longest prefill that fits) rather than fail with an out-of-memory error
    part way through; other backends are not checked."""
    if model.config.backend["attn"] != "torch":
        return
    text, free = model.config.text_config, {}
    kv_bytes = model.embed.weight.element_size()
    for block in model.layers:
        device = block.attn.attn_sink.device
        need = torch_attention_bytes(text, block.layer, batch, seq, kv_bytes)
        if device not in free:
            free[device] = free_memory(device)
        if free[device] is None or need <= free[device]:
            continue
        fits, too_long = 0, seq  # the longest prefill this layer holds there, by bisection on the estimate
        while too_long - fits > 1:
            middle = (fits + too_long) // 2
            if torch_attention_bytes(text, block.layer, batch, middle, kv_bytes) <= free[device]:
                fits = middle
            else:
                too_long = middle
        raise ValueError(
            f"attn backend 'torch' cannot hold a prefill of {seq} columns (batch {batch}) on {device}: layer "
            f"{block.layer}'s indexer scores and gathered KV need at least {need / 2**30:.1f} GiB and "
            f"{free[device] / 2**30:.1f} GiB are free, enough for about {fits} columns at this batch. Use attn "
            "backend 'tilelang' (backend={'attn': 'tilelang'}; it never forms them), a shorter prompt or a smaller "
            "batch"
        )


def sliding_window_indices(s: int, window: int, device) -> torch.Tensor:
    # [s, window]: query i sees positions max(0, i - window + 1) .. i; -1 pads the start
    idx = torch.arange(s, device=device).unsqueeze(1) - (window - 1) + torch.arange(window, device=device)
    return idx.masked_fill(idx < 0, -1)


def layer_rope_frequencies(config, layer: int) -> torch.Tensor:
    if config.compress_ratios[layer] == 0:
        return rope_frequencies(config.qk_rope_head_dim, config.rope_theta, None)
    return rope_frequencies(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)


class Compressor(nn.Module):
    """Full layers: one latent per group of ``ratio`` tokens (per-channel softmax pooling for ratio 2)."""

    def __init__(self, config, ratio: int, backend: dict):
        super().__init__()
        self.ratio = ratio
        # Ratio 2 holds and computes wkv/wgate in fp32 (an fp32 island); ratio 1 keeps wkv in the model dtype.
        if ratio == 2:
            self.wkv = make_fp32_linear(config.hidden_size, config.head_dim, backend)
            self.wgate = make_fp32_linear(config.hidden_size, config.head_dim, backend)
        else:
            self.wkv = make_linear(config.hidden_size, config.head_dim, backend)
        self.norm = make_rms_norm(config.head_dim, config.rms_norm_eps, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [b, s, dim] -> pre-RoPE latent [b, s // ratio, head_dim]; a trailing partial group is dropped
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        T = x.shape[1] // self.ratio
        kv, score = self.project(x[:, : T * self.ratio])
        return self.pool(kv.unflatten(1, (T, self.ratio)), score.unflatten(1, (T, self.ratio)), x.dtype)

    def project(self, x: torch.Tensor):
        # x [..., dim] -> fp32 (kv, gate score) [..., head_dim] (ratio > 1).  Fp32Linear takes x as it is (bf16
        # is exact, and its emulated GEMM then needs fewer products); anything else (TE, a PEFT wrapper) gets fp32
        if type(self.wkv) is Fp32Linear and type(self.wgate) is Fp32Linear:
            return self.wkv(x), self.wgate(x)
        x32 = x.float()
        return self.wkv(x32), self.wgate(x32)

    def pool(self, kv: torch.Tensor, score: torch.Tensor, dtype) -> torch.Tensor:
        # fp32 [..., r, head_dim] each -> latent [..., head_dim]: per-channel softmax over the group's r tokens
        return self.norm((torch.softmax(score, dim=-2) * kv).sum(-2).to(dtype))


class Indexer(nn.Module):
    """Scores compressed entries for each query and keeps the top ``index_topk`` (frozen: no LM gradient)."""

    def __init__(self, config, owns_keys: bool, backend: dict):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = FrozenLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = FrozenLinear(config.hidden_size, self.n_heads)
        self.fp4_qdq = quant_ops(backend)[1]  # the MXFP4-like boundary of index queries and keys
        if owns_keys:
            self.wk = FrozenLinear(config.head_dim, self.head_dim)
            self.k_norm = make_rms_norm(self.head_dim, config.rms_norm_eps, backend)

    def keys(self, latent: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        # pre-RoPE latent [b, T, head_dim] -> index keys [b, T, index_head_dim] (RoPE at j·r, MXFP4 boundary)
        return self.fp4_qdq(apply_rope(self.k_norm(self.wk(latent)), cis))

    def scores(self, x, qr, cis, index_k, ratio, score_fn, query_offset: int = 0) -> torch.Tensor:
        # x [b, s, dim], qr [b, s, q_lora] -> fp32 [b, s, T], causally invisible entries at -inf
        # (query_offset: the position of x's first query when x is a chunk of a prefill)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = self.fp4_qdq(apply_rope(q, cis, inplace=True))
        # scaled in the projection's dtype, then fp32 (the official rounding: bf16 weights in a bf16 model)
        weights = (self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)).float()
        return score_fn(q, weights, index_k, ratio, query_offset=query_offset)


def candidate_blocks(scores: torch.Tensor, ratio: int, block: int, topk_blocks: int, visible=None) -> torch.Tensor:
    """Stage 1 of the two-level top-k (§5.5): bool [b, s, ceil(T / block)], True for the kept blocks of each query
    (``candidate_mask`` spreads it over the entries).  ``visible`` [b or 1, s]: entries each query sees (default:
    query i of a prefill sees (i + 1) // ratio)."""
    s, T = scores.shape[1:]
    n_blocks = -(-T // block)
    padded = nn.functional.pad(scores, (0, n_blocks * block - T), value=float("-inf"))
    block_scores = padded.unflatten(-1, (n_blocks, block)).amax(-1)  # [b, s, n_blocks]
    # The block holding the newest visible entry is always kept: it is partly filled and could lose.
    if visible is None:
        visible = ((torch.arange(s, device=scores.device) + 1) // ratio).unsqueeze(0)
    newest = ((visible - 1) // block).clamp(min=0)
    force = (torch.arange(n_blocks, device=scores.device) == newest.unsqueeze(-1)) & (visible > 0).unsqueeze(-1)
    block_scores = block_scores.masked_fill(force, float("inf"))
    top, chosen = block_scores.topk(min(topk_blocks, n_blocks), dim=-1)
    return torch.zeros_like(block_scores, dtype=torch.bool).scatter(-1, chosen, top > float("-inf"))


def candidate_mask(kept_blocks: torch.Tensor, block: int, entries: int) -> torch.Tensor:
    # bool [b, s, n_blocks] -> [b, s, entries]: True inside the kept blocks
    return kept_blocks.repeat_interleave(block, dim=-1)[..., :entries]


# A prefill scores its queries against the entries in chunks whose fp32 scores [b, chunk, T] (and the candidate
# stage's copies of them) stay under this budget: the whole [b, s, T] would be 64 GiB at 128k tokens and ratio 1.
INDEXER_CHUNK_BYTES = 2 * 2**30


def indexer_query_chunk(batch: int, seq: int, entries: int, per_head_products: int = 0) -> int:
    """Queries per chunk of a prefill's indexer: ``seq`` when one chunk fits ``INDEXER_CHUNK_BYTES``, otherwise
    the length of the fewest equal chunks that do (the last chunk ends at ``seq``, overlapping the one before).  Per query and entry it counts the fp32 scores, the candidate
    stage's padded copy and mask, and ``per_head_products`` fp32 per-head products (the torch score path's
    [b, s, H, T] products and their ReLU: 2·H; 0 for a kernel that never forms them)."""
    row_bytes = batch * max(entries, 1) * (4 * (3 + per_head_products))
    n_chunks = -(-seq * row_bytes // INDEXER_CHUNK_BYTES)
    return max(1, -(-seq // max(n_chunks, 1)))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    # fp32 [b, s, T] -> int64 [b, s, min(k, T)] in position order; picks with score -inf become -1
    top, idx = scores.topk(min(k, scores.shape[-1]), dim=-1)
    idx = idx.masked_fill(top == float("-inf"), -1)
    return idx.sort(dim=-1).values


class Attention(nn.Module):
    def __init__(self, config, layer: int, backend: dict):
        super().__init__()
        self.layer = layer
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.window = config.sliding_window
        self.o_groups, self.o_lora_rank = config.o_groups, config.o_lora_rank
        self.eps = config.rms_norm_eps
        self.q_head_rescale = config.q_head_rescale
        self.ratio = config.compress_ratios[layer]
        self.mode = config.attention_mode(layer)
        self.kv_source = config.kv_source_of(layer)
        self.index_source = config.index_source_of(layer)
        self.candidate_source = config.candidate_source_layer_id
        self.index_topk = config.index_topk
        self.candidate_block_size = config.candidate_block_size
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.sparse_attention, self.indexer_scores = attention_backend(backend["attn"])
        self.decode_index_kernel = backend["decode_indexer"] != "torch"  # "auto" / "triton": where it runs
        self.fp8_qdq, _, self.fp4_e4m3_scale_qdq = quant_ops(backend)  # backend "quant": torch or tile_kernels

        dim = config.hidden_size
        self.wq_a = make_linear(dim, config.q_lora_rank, backend)
        self.q_norm = make_rms_norm(config.q_lora_rank, self.eps, backend)
        self.wq_b = make_linear(config.q_lora_rank, self.n_heads * self.head_dim, backend)
        self.wkv = make_linear(dim, self.head_dim, backend)
        self.kv_norm = make_rms_norm(self.head_dim, self.eps, backend)
        # wo_a is block-diagonal: group g maps its n_heads/o_groups heads to o_lora_rank channels.
        self.wo_a = make_linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank, backend)
        self.wo_b = make_linear(self.o_groups * self.o_lora_rank, dim, backend)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        if self.mode == "full":
            self.compressor = Compressor(config, self.ratio, backend)
        if self.mode in ("full", "reindex"):
            self.indexer = Indexer(config, owns_keys=self.mode == "full", backend=backend)
        # fp32 [rope_dim / 2] on the host; a plain attribute, not a buffer, so meta-device init has nothing to restore
        with torch.device("cpu"):
            self.rope_freqs = layer_rope_frequencies(config, layer)
        self._rope_freqs_on = {}  # device -> rope_freqs there, copied once

    def _rope_cis(self, positions: torch.Tensor) -> torch.Tensor:
        # complex64 [n, rope_dim / 2] for integer positions [n].  The frequencies go to the device once: a blocking
        # copy from pageable host memory at every call would wait for the GPU to drain its queue (six a forward)
        freqs = self._rope_freqs_on.get(positions.device)
        if freqs is None:
            freqs = self._rope_freqs_on[positions.device] = self.rope_freqs.to(positions.device)
        return rope_cis(positions, freqs)

    def forward(self, x: torch.Tensor, state: CSA2State) -> torch.Tensor:
        # x [b, s, dim] (normed attention input) -> [b, s, dim]
        if state.positions is not None:
            return self._decode_step(x, state)
        b, s, _ = x.shape
        positions = torch.arange(s, device=x.device)
        cis = self._rope_cis(positions)  # [s, rope_dim / 2]
        qr, q = self._queries(x, cis)
        window_kv = self._window_kv(x, cis)  # [b, s, head_dim]
        idx = sliding_window_indices(s, self.window, x.device).expand(b, s, -1)

        kv = window_kv
        if self.ratio:
            compressed_kv = self._compressed_branch(x, qr, cis, positions, state)  # [b, T, head_dim]
            topk = state.read(self.index_source, "topk")  # [b, s, k] entry ids, -1 = none
            kv = torch.cat([window_kv, compressed_kv], dim=1)
            idx = torch.cat([idx, torch.where(topk >= 0, topk + s, -1)], dim=-1)
        if state.cache is not None:
            self._fill_cache(state, x, window_kv)

        o = self.sparse_attention(q, kv, self.attn_sink, idx, self.head_dim**-0.5)  # [b, s, h, head_dim]
        return self._output(o, cis)

    def _queries(self, x, cis):
        # x [b, s, dim], cis [s, rope_dim / 2] -> qr [b, s, q_lora], q [b, s, h, head_dim] (RoPE'd)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr)  # [b, s, h·head_dim]
        if self.q_head_rescale:  # V4's per-head q RMS; absent from the official V4.1 code (off by default)
            qh = q.float().unflatten(-1, (self.n_heads, self.head_dim))
            q = (qh * torch.rsqrt(qh.square().mean(-1, keepdim=True) + self.eps)).flatten(2).to(q.dtype)
        # q is fresh (not a view, not saved by another op): rotate each head's tail in place.  Its one consumer
        # is the sparse attention, whose backward returns a fresh dq: rotated back in place too
        q = apply_rope(q, cis, inplace=True, head_dim=self.head_dim, grad_inplace=True)
        q = q.unflatten(-1, (self.n_heads, self.head_dim))
        return qr, q

    def _window_kv(self, x, cis):
        # x [b, s, dim] -> the window's K = V [b, s, head_dim]: post-RoPE, FP8-rounded
        return self.fp8_qdq(apply_rope(self.kv_norm(self.wkv(x)), cis))

    def _output(self, o, cis):
        # o [b, s, h, head_dim] -> [b, s, dim]
        b, s = o.shape[:2]
        # K = V carries rotated channels: undo at the query position.  The one consumer is wo_a (a GEMM, or a
        # wrapped module's GEMMs whose input gradients autograd sums into a new buffer): a fresh gradient
        o = apply_rope(o, cis, inverse=True, grad_inplace=True)
        o = self._grouped_wo_a(o.reshape(b * s, self.o_groups, -1))  # [b·s, groups·o_lora]
        return self.wo_b(o.view(b, s, -1))

    def _grouped_wo_a(self, o: torch.Tensor) -> torch.Tensor:
        # o [n, groups, d] -> [n, groups·o_lora]: group g through rows g·o_lora..(g+1)·o_lora of wo_a
        if isinstance(self.wo_a, KeptFp8Linear):  # the release's FP8 wo_a, held as stored (kept.py)
            return self.wo_a.grouped_forward(o, self.o_groups)
        if is_plain_linear(self.wo_a):
            wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1).to(o.dtype)
            if torch.compiler.is_compiling():  # Dynamo takes no strided out=: the same product, then token-major
                return torch.bmm(o.transpose(0, 1), wo_a.transpose(1, 2)).transpose(0, 1).reshape(o.shape[0], -1)
            return _GroupedProjection.apply(o, wo_a)
        # a wrapped wo_a (PEFT LoRA, ...) is called as a module, every group through all rows [n, groups, groups·r],
        # and each group keeps its own block (the diagonal): exactly the merged weight's block-diagonal product
        y = self.wo_a(o).unflatten(-1, (self.o_groups, self.o_lora_rank))  # [n, groups, groups, r]
        return y.diagonal(dim1=1, dim2=2).transpose(1, 2).flatten(1)

    def _compressed_branch(self, x, qr, cis, positions, state):
        # Publishes (as a source) and returns the shared compressed KV [b, T, head_dim].
        r = self.ratio
        if self.mode == "full":
            latent = self.compressor(x)  # pre-RoPE [b, T, head_dim]
            T = latent.shape[1]
            entry_cis = self._rope_cis(positions[:T] * r)  # entry j sits at its first token j·r
            self._publish_entries(state, latent, entry_cis)
        if self.mode in ("full", "reindex"):
            self._publish_topk(state, x, qr, cis, self.indexer_scores, None)
        return state.read(self.kv_source, "compressed_kv")

    def _publish_entries(self, state, latent, entry_cis):
        # pre-RoPE latent [b, T, head_dim] -> published index keys and compressed KV (post-RoPE, FP4-rounded)
        with torch.no_grad():  # index keys only feed the hard top-k
            state.publish(self.layer, "index_k", self.indexer.keys(latent, entry_cis))
        state.publish(self.layer, "compressed_kv", self.fp4_e4m3_scale_qdq(apply_rope(latent, entry_cis)))

    def _publish_topk(self, state, x, qr, cis, score_fn, visible):
        # visible: None (a prefill: query i sees (i + 1) // ratio entries) or [b, 1] for a decode step.
        # A long prefill goes through its queries in chunks (indexer_query_chunk): no [b, s, T] tensor at once.
        index_k = state.read(self.kv_source, "index_k")
        b, s = x.shape[:2]
        chunk = s
        if visible is None:
            products = 2 * self.indexer.n_heads if score_fn is indexer_scores_model_dtype else 0
            chunk = min(indexer_query_chunk(b, s, index_k.shape[1], products), s)
        topk, kept_blocks = [], []
        with torch.no_grad():  # hard top-k: the indexer gets no LM gradient
            for q0 in range(0, max(s, 1), max(chunk, 1)):
                # the last chunk ends at s and overlaps the one before: every chunk has one length (one kernel
                # build); its first q0 - start rows, already scored, are dropped
                start = max(min(q0, s - chunk), 0)
                part = slice(start, start + chunk)
                xc, qrc, cisc = (x, qr, cis) if chunk == s else (x[:, part], qr[:, part], cis[part])
                scores = self.indexer.scores(xc, qrc, cisc, index_k, self.ratio, score_fn, start)  # [b, chunk, T]
                seen = visible
                if seen is None:  # query start + i sees (start + i + 1) // ratio entries
                    seen = ((torch.arange(start, start + scores.shape[1], device=x.device) + 1) // self.ratio)[None]
                if self.layer == self.candidate_source:
                    kept_blocks.append(candidate_blocks(
                        scores, self.ratio, self.candidate_block_size, self.candidate_topk_blocks, seen)[:, q0 - start:])
                elif 0 <= self.candidate_source < self.layer:
                    kept = state.read(self.candidate_source, "candidates")
                    kept = kept if chunk == s else kept[:, part]
                    candidates = candidate_mask(kept, self.candidate_block_size, scores.shape[-1])
                    scores = scores.masked_fill(~candidates, float("-inf"))
                topk.append(select_topk(scores, self.index_topk)[:, q0 - start:])
            if kept_blocks:  # bool [b, s, n_blocks]
                state.publish(self.layer, "candidates", kept_blocks[0] if chunk == s else torch.cat(kept_blocks, 1))
            state.publish(self.layer, "topk", topk[0] if chunk == s else torch.cat(topk, 1))

    # ---- the decode cache ----------------------------------------------------------------------------------

    def _fill_cache(self, state, x, window_kv):
        # After a prefill over left-aligned rows (real tokens at 0 .. lengths-1): this layer's decode state.
        layer_cache = state.cache.layers[self.layer]
        layer_cache.fill_window(window_kv, state.lengths)
        if self.mode != "full":
            return
        layer_cache.fill_compressed(state.read(self.layer, "compressed_kv"), state.read(self.layer, "index_k"))
        if self.ratio > 1:  # the open group's fp32 projections
            layer_cache.fill_carry(x, state.lengths, self.compressor.project)

    def _decode_step(self, x, state):
        # x [b, n, dim]: n new tokens per row, row i's at positions state.positions[i] [n] (consecutive) -> [b, n, dim].
        # The projections run on the batch as one sequence [1, b·n, ·] (one RoPE position per token); the
        # attention gathers per query from the cached window ring (the step's own keys written first: query j sees
        # the step's tokens up to j) and the compressed entries its indexer picked.
        pos = state.positions  # [b, n]
        b, n = pos.shape
        layer_cache = state.cache.layers[self.layer]
        xt = x.reshape(1, b * n, x.shape[-1])
        cis = self._rope_cis(pos.reshape(-1))  # [b·n, rope_dim / 2]
        qr, q = self._queries(xt, cis)  # q [1, b·n, h, head_dim]
        window_kv = self._window_kv(xt, cis).view(b, n, -1)
        ring = layer_cache.push_window(window_kv, pos)  # [b, R, head_dim], R >= W + n - 1 ring slots
        kv, idx = ring, layer_cache.window_slots(pos)  # idx [b, n, R]: each query's last W positions' slots, else -1
        if self.ratio:
            compressed_kv = self._compressed_decode(xt, qr, cis, state)  # [b, T, head_dim]
            topk = state.read(self.index_source, "topk")  # [b, n, k]
            k = topk.shape[-1]
            picked = compressed_kv.gather(1, topk.clamp(min=0).reshape(b, n * k, 1).expand(-1, -1, kv.shape[-1]))
            slots = torch.arange(n * k, device=x.device).view(n, k) + ring.shape[1]  # query j's picks: rows j·k ..
            kv = torch.cat([ring, picked.to(ring.dtype)], dim=1)  # [b, R + n·k, head_dim]
            idx = torch.cat([idx, torch.where(topk >= 0, slots, -1)], dim=-1)
        o = sparse_attention_torch(q.reshape(b, n, *q.shape[2:]), kv, self.attn_sink, idx, self.head_dim**-0.5)
        return self._output(o.reshape(1, b * n, *o.shape[2:]), cis).view(b, n, -1)

    def _compressed_decode(self, xt, qr, cis, state):
        # Full: the new tokens join their groups (a new entry where one completes); publishes like a prefill.
        # The entries read: as many as the furthest row's last token sees (a growing cache), or a preallocated
        # cache's whole capacity (n_visible None: fixed shapes, no host value), those a query does not see yet
        # masked in scoring.  xt [1, b·n, dim], qr [1, b·n, q_lora], cis [b·n, ·]
        r, pos = self.ratio, state.positions  # pos [b, n]
        b, n = pos.shape
        n_visible = state.cache.entries_visible(r, n)
        if self.mode == "full":
            layer_cache = state.cache.layers[self.layer]
            if r == 1:
                latent = self.compressor(xt)  # [1, b·n, head_dim]
            else:
                kv, score = self.compressor.project(xt[0].view(b, n, -1))  # fp32 [b, n, head_dim] each
                kv, score = layer_cache.push_carry(kv, score, pos)  # each token's group [b, n, r, head_dim]
                latent = self.compressor.pool(kv, score, xt.dtype).view(1, b * n, -1)
            scratch = CSA2State()
            self._publish_entries(scratch, latent, self._rope_cis((pos // r * r).reshape(-1)))  # entry at j·r
            layer_cache.push_entry(
                scratch.read(self.layer, "compressed_kv").view(b, n, -1), scratch.read(self.layer, "index_k").view(b, n, -1),
                pos, state.cache.entries_needed(r, n),
            )
            state.publish(self.layer, "index_k", layer_cache.index_k[:, :n_visible])
            state.publish(self.layer, "compressed_kv", layer_cache.compressed_kv[:, :n_visible])
        if self.mode in ("full", "reindex"):
            visible = (pos + 1) // r  # [b, n]
            if n_visible == 0:  # nothing compressed yet in any row
                state.publish(self.layer, "topk", pos.new_empty((b, n, 0)))
            else:  # queries [1, b·n, ·] (the batch as the sequence) against each row's own keys -> [b, n, T]
                def score_fn(q, w, k, ratio, query_offset):  # q [1, b·n, H, D] -> [b, n, T]
                    q, w = q.reshape(b, n, *q.shape[2:]), w.reshape(b, n, -1)
                    if self.decode_index_kernel and inference_kernel_usable(q) and index_scores_fits(q):
                        return index_scores_triton(q, w, k, visible)
                    return indexer_scores_model_dtype(q, w, k, ratio, visible)
                self._publish_topk(state, xt, qr, cis, score_fn, visible)
        return state.read(self.kv_source, "compressed_kv")
