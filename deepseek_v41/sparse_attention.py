"""Reference (pure PyTorch) CSA2 sparse attention with an attention sink, and indexer scoring.

These two functions are the numerics contract that every faster backend (``attn: tilelang``)
is tested against:

* ``sparse_attention_torch``: for each query ``i`` and head ``h`` attend over the gathered rows
  ``kv[idx[i, :]]`` (``-1`` = empty slot).  The same latent row is key and value (MQA, one KV
  head).  The sink adds ``exp(sink_h)`` to the softmax denominator only (no value, no scale).
  Logits and the softmax run in fp32; probabilities are rounded to the KV dtype before P·V
  (as the official kernel does), P·V accumulates in fp32 and is rounded once to ``q.dtype``.
* ``indexer_scores_torch``: ``score[b, i, t] = sum_h relu(q[b,i,h] . k[b,t]) * w[b,i,h]`` in fp32,
  with causally invisible compressed entries (``t >= (i + 1) // ratio``) set to ``-inf``.
"""

import torch


def sparse_attention_torch(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    # q [b, s, h, d], kv [b, n, d], sink [h] fp32, idx [b, s, k] (int, -1 = none) -> o [b, s, h, d]
    b, s, h, d = q.shape
    valid = idx >= 0  # [b, s, k]
    safe = idx.clamp(min=0).long()
    rows = torch.gather(kv, 1, safe.reshape(b, -1, 1).expand(-1, -1, d)).view(b, s, -1, d)  # [b, s, k, d]
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows.float()) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink_logit = sink.float().view(1, 1, h, 1).expand(b, s, h, 1)
    # Softmax over [selected keys ; sink]; the sink column is then dropped (it carries no value).
    probs = torch.softmax(torch.cat([logits, sink_logit], dim=-1), dim=-1)[..., :-1]
    probs = probs.to(kv.dtype).float()
    out = torch.einsum("bshk,bskd->bshd", probs, rows.float())
    return out.to(q.dtype)


def indexer_scores_torch(
    q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, ratio: int, visible=None, query_offset: int = 0
) -> torch.Tensor:
    # q [b, s, H, D] (index queries), weights [b, s, H], index_k [b, T, D] -> scores [b, s, T] fp32.
    # visible [b or 1, s]: entries each query sees (default, a prefill: query i sees (query_offset + i + 1) // ratio,
    # query_offset being the first query's position when q is a chunk of a longer prefill's queries)
    s, T = q.shape[1], index_k.shape[1]
    dots = torch.einsum("bshd,btd->bsht", q.float(), index_k.float()).relu()
    scores = torch.einsum("bsht,bsh->bst", dots, weights.float())
    if visible is None:
        visible = ((torch.arange(s, device=q.device) + query_offset + 1) // ratio).unsqueeze(0)
    invisible = torch.arange(T, device=q.device) >= visible.unsqueeze(-1)  # [b or 1, s, T]
    return scores.masked_fill(invisible, float("-inf"))
