"""A long prefill scores its indexer queries in chunks (attention.indexer_query_chunk): the chunked torch path must
give exactly what one pass over all queries gives (every published tensor and the logits, bit for bit)."""

import pytest
import torch

from deepseek_v41 import attention
from deepseek_v41.attention import CSA2State, indexer_query_chunk
from deepseek_v41.sparse_attention import indexer_scores_torch


def published_prefill(model, ids, monkeypatch):
    # logits and every (layer, name) -> tensor the CSA2State received during one prefill
    published = {}
    publish = CSA2State.publish

    def record(self, layer, name, value):
        published[(layer, name)] = value.clone()
        publish(self, layer, name, value)

    monkeypatch.setattr(CSA2State, "publish", record)
    with torch.no_grad():
        logits = model(ids).logits
    monkeypatch.setattr(CSA2State, "publish", publish)
    return logits, published


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_chunked_prefill_indexer_equals_one_pass(v4_tokenizer, monkeypatch, chunk):
    from conftest import tiny_model

    model = tiny_model(v4_tokenizer).eval()  # index layers 2, 4 (ratio 2), 5 (candidate source, ratio 1), 7 (reindex)
    ids = torch.randint(3, 1000, (2, 80), generator=torch.Generator().manual_seed(1))
    one_logits, one = published_prefill(model, ids, monkeypatch)
    calls, scores = [], attention.Indexer.scores

    def counted(self, *args):
        calls.append(args[0].shape[1])
        return scores(self, *args)

    monkeypatch.setattr(attention, "indexer_query_chunk", lambda batch, seq, entries, per_head_products=0: chunk)
    monkeypatch.setattr(attention.Indexer, "scores", counted)
    logits, parts = published_prefill(model, ids, monkeypatch)
    # each of the 4 index layers scored its 80 queries in chunks of one length (at 7: the last chunk is 73..79,
    # overlapping the one before)
    assert calls == 4 * [chunk] * -(-80 // chunk)
    assert one.keys() == parts.keys() and (5, "candidates") in one
    for key, value in one.items():
        assert value.shape == parts[key].shape and torch.equal(value, parts[key]), key
    assert torch.equal(one_logits, logits)
    # the candidate stage prunes here (4 of 20 blocks kept), so the reindex layer's mask is exercised
    assert not one[(5, "candidates")][:, -1].all()


def test_indexer_scores_query_offset_is_the_suffix_of_one_pass():
    gen = torch.Generator().manual_seed(0)
    q, w = torch.randn(2, 24, 4, 16, generator=gen), torch.randn(2, 24, 4, generator=gen)
    k = torch.randn(2, 12, 16, generator=gen)
    full = indexer_scores_torch(q, w, k, 2)
    assert torch.equal(indexer_scores_torch(q[:, 9:], w[:, 9:], k, 2, query_offset=9), full[:, 9:])


def test_indexer_query_chunk_keeps_the_budget():
    budget = attention.INDEXER_CHUNK_BYTES
    assert indexer_query_chunk(1, 4096, 4096) == 4096  # training lengths: one pass, as before
    for batch, seq, entries, products in [(1, 131072, 131072, 0), (1, 131072, 65536, 0), (2, 32768, 32768, 64)]:
        chunk = indexer_query_chunk(batch, seq, entries, products)
        row = batch * entries * 4 * (3 + products)
        assert 1 <= chunk < seq and chunk * row <= budget + row  # within one query row of the budget
        assert chunk * row > budget // 2  # as few chunks as the budget allows
