"""Reference (pure PyTorch) CSA2 sparse attention with an attention sink, and indexer scoring.

These two functions are the numerics contract that every faster backend (``attn: tilelang``)
is tested against:

* ``sparse_attention_torch``: for each query ``i`` and head ``h`` attend over the gathered rows
  ``kv[idx[i, :]]`` (``-1`` = empty slot).  The same latent row is key and value (MQA, one KV
  head).  The sink adds ``exp(sink_h)`` to the softmax denominator only (no value, no scale).
  Logits and the softmax run in fp32 and round where the official kernel's do: an online softmax over
  blocks of 64 slots whose UNNORMALISED probabilities ``exp(logit - running max)`` (the max over the keys
  only, not the sink) are rounded to the KV dtype before P·V; P·V and the denominator (the unrounded
  probabilities plus ``exp(sink - max)``) accumulate in fp32, and the one division rounds to ``q.dtype``.
  (Rounding the normalised probabilities instead moves ~40 % of a bf16 output by an ulp: the whole
  attention-side difference from the official bf16 run on the golden fixtures.)
* ``indexer_scores_torch``: ``score[b, i, t] = sum_h relu(q[b,i,h] . k[b,t]) * w[b,i,h]`` in fp32,
  with causally invisible compressed entries (``t >= (i + 1) // ratio``) set to ``-inf``; with
  ``score_dtype`` (the model's torch backend passes q's dtype) the dot products, their weighted values and
  the head sum are each rounded to it, as the official Indexer's bf16 einsum and products are.
"""

import torch

# slots per online-softmax step: the official kernel's block (its probabilities round against each block's running max)
SOFTMAX_BLOCK = 64


def sparse_attention_torch(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    # q [b, s, h, d], kv [b, n, d], sink [h] fp32, idx [b, s, k] (int, -1 = none) -> o [b, s, h, d]
    b, s, h, d = q.shape
    valid = idx >= 0  # [b, s, k]
    safe = idx.clamp(min=0).long()
    rows = torch.gather(kv, 1, safe.reshape(b, -1, 1).expand(-1, -1, d)).view(b, s, -1, d).float()  # [b, s, k, d]
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if logits.shape[-1] == 0:  # no slots at all
        return q.new_zeros(b, s, h, d)
    # The official kernel's online softmax in one pass: block j's probabilities exp(logit - M_j), M_j the running
    # max over blocks <= j, rounded to the KV dtype, then rescaled by exp(M_j - M) to the final max M (what its
    # per-block corrections multiply out to).  The maxima only steady the exponentials (the result does not depend
    # on them): no gradient through them.  They start finite so that a block without keys gives exp(-inf) = 0.
    blocks = torch.nn.functional.pad(logits, (0, -logits.shape[-1] % SOFTMAX_BLOCK), value=float("-inf"))
    blocks = blocks.unflatten(-1, (-1, SOFTMAX_BLOCK))  # [b, s, h, n_blocks, 64]
    with torch.no_grad():
        running = blocks.amax(-1).clamp(min=-1e30).cummax(-1).values  # [b, s, h, n_blocks]
        m = running[..., -1]
        rescale = torch.exp(running - m.unsqueeze(-1))
    p = torch.exp(blocks - running.unsqueeze(-1))  # fp32, unnormalised
    den = (p.sum(-1) * rescale).sum(-1)  # [b, s, h]
    p = (p.to(kv.dtype).float() * rescale.unsqueeze(-1)).flatten(-2)[..., : logits.shape[-1]]
    acc = torch.einsum("bshk,bskd->bshd", p, rows)
    # The sink joins the denominator only.  A query with no key (den 0, acc 0) measures it against itself: 0 / 1
    sink = sink.float().view(1, 1, h)
    den = den + torch.exp(sink - torch.where(den == 0, sink.detach(), m))
    return (acc / den.unsqueeze(-1)).to(q.dtype)


def indexer_scores_torch(
    q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, ratio: int, visible=None, query_offset: int = 0,
    score_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    # q [b, s, H, D] (index queries), weights [b, s, H], index_k [b, T, D] -> scores [b, s, T] fp32.
    # visible [b or 1, s]: entries each query sees (default, a prefill: query i sees (query_offset + i + 1) // ratio,
    # query_offset being the first query's position when q is a chunk of a longer prefill's queries)
    s, T = q.shape[1], index_k.shape[1]
    # score_dtype: each dot product, its weighted value and the head sum rounded to it (fp32: exact products)
    if score_dtype == torch.float32:
        dots = torch.einsum("bshd,btd->bsht", q.float(), index_k.float()).relu()
        scores = torch.einsum("bsht,bsh->bst", dots, weights.float())
    else:
        dots = torch.einsum("bshd,btd->bsht", q.to(score_dtype), index_k.to(score_dtype)).relu()
        scores = (dots * weights.to(score_dtype).unsqueeze(-1)).sum(dim=2).float()
    if visible is None:
        visible = ((torch.arange(s, device=q.device) + query_offset + 1) // ratio).unsqueeze(0)
    invisible = torch.arange(T, device=q.device) >= visible.unsqueeze(-1)  # [b or 1, s, T]
    return scores.masked_fill(invisible, float("-inf"))
