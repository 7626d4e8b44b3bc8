"""Write a model as a Hugging Face folder in released tensor names, streamed row block by row block.

One path for ``save_pretrained``, the trainer's export (``training/export.py``) and
``conversion/convert_checkpoint.py``:

* sources: every model tensor as this process holds it (``TensorSource``): whole, or rows of it. A
  source's ``read(start, stop)`` returns rows [start, stop) of the full tensor on the writing process
  (``None`` elsewhere); sharded sources (FSDP, EP experts, Engram row owners) assemble them collectively
  (``training/export.py``), so every rank walks the same plan in the same order.
* plan: released names (stacked experts [E, ...] split per expert), the format of each (floating point
  as held, or ``quantize="release"``: FP8 32x32 blocks, packed FP4 experts, FP8 Engram rows, BF16/F32
  elsewhere, with the released ``quantization_config``) and the shards, all from shapes alone.
* write: shard by shard, tensor by tensor, row block by row block (``BLOCK_BYTES`` of output), so no
  process ever holds more than one block (plus a quantized tensor's scales) beyond the model.
* why not ``torch.distributed.checkpoint``'s ``HuggingFaceStorageWriter``: it writes every rank's local
  shards to ``<dir>/sharded`` and consolidates them afterwards (twice the disk, a second full pass), it needs
  every tensor as a DTensor with global offsets (our EP expert blocks and Engram row blocks have none), and
  it neither splits stacked experts into released names nor re-encodes 32x32 FP8 blocks that straddle
  FSDP shard boundaries. The reduce-per-block writer here does all three in one pass.
* integrity: a tensor holding NaN or Inf is refused before anything is written, named (each process checks
  the values it holds: ``nonfinite_tensors``); while writing, every block is checked again and the release
  encoders refuse a non-finite value instead of saturating it to the FP8/FP4 maximum. Each shard's
  checksum (``deepseek_v41.checksums``), computed from the bytes as they are written, goes into the index
  (``metadata.checksums``); the loader compares it before reading the shard.
* folder safety: everything is written into a new hidden sibling folder; it then takes the destination's
  place with one atomic ``renameat2(RENAME_EXCHANGE)`` (Linux), so a SIGKILL at any moment leaves the
  old or the new export in place, never none. Only an empty folder or a previous export of ours (its
  ``EXPORT_MARKER`` lists the files it wrote, and it holds no others) is replaced; anything else is
  refused before a byte is written. Temporary folders are removed on failure, stale ones of dead
  processes on the next export.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import (
    _MODEL_EXPERT,
    CONFIG_FILE,
    INDEX_FILE,
    RowBlocks,
    model_to_released_name,
    progress_bar,
    scale_name,
    write_safetensors,
)
from .release_format import (
    RELEASED_QUANTIZATION_CONFIG,
    ceil_div,
    encode_fp4_packed,
    encode_fp8_blockwise,
    encode_fp8_rows,
    released_format,
)

logger = logging.getLogger(__name__)

EXPORT_MARKER = "deepseek_v41_export.json"  # lists the files an export of ours wrote
QUANTIZE_CHOICES = (None, "release")
BLOCK_BYTES = 64 << 20  # output bytes gathered and written at once
_QUANTIZED_TORCH_DTYPES = {
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.int8, torch.uint8
}


_WIDENED = {torch.float16: torch.float32}  # lossless; the loader refuses F16 (a relabelled BF16 looks alike)


class ExportError(ValueError):
    """An export that cannot be written as asked; the message names the problem and the fix."""


# ----------------------------------------------------------------------------------------------------
# Sources: what each process holds
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSource:
    """One model tensor (model or released name): full shape and dtype, and rows of it on demand.

    ``read(start, stop)`` -> rows [start, stop) of the full tensor (the whole tensor for 0-d), or ``None``
    on a process that does not write. It may be collective: then every process calls it in the same order.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[int, int], torch.Tensor | None]
    local: torch.Tensor | None = None  # the values this process holds (whole, or its shard): checked up front


def local_source(name: str, tensor: torch.Tensor) -> TensorSource:
    """A tensor this process holds whole."""
    tensor = tensor.detach()
    return TensorSource(name, tuple(tensor.shape), tensor.dtype,
                        lambda start, stop: tensor if tensor.dim() == 0 else tensor[start:stop], tensor)


_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # codes (FP8...) are refused elsewhere


def _first_nonfinite(name: str, tensor: torch.Tensor) -> str | None:
    # One pass (a sum is non-finite iff an element is, or it overflows); the element is looked up only then.
    if tensor.dtype not in _CHECKED_DTYPES or tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return None
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):  # the sum overflowed; every element is finite
        return None
    at = tuple(bad.nonzero()[0].tolist())
    return (f"tensor {name!r} holds {tensor[at].item()} at {list(at)} ({int(bad.sum())} non-finite of "
            f"{tensor.numel()} values)")


def nonfinite_tensors(sources: Iterable[TensorSource]) -> list[str]:
    """A description per source whose locally held values (``TensorSource.local``) include NaN or Inf."""
    found = []
    for source in sources:
        if source.local is not None:
            problem = _first_nonfinite(source.name, source.local.detach())
            if problem:
                found.append(problem)
    return found


def nonfinite_error(problems: list[str]) -> ExportError:
    more = f" (and {len(problems) - 1} more tensors)" if len(problems) > 1 else ""
    return ExportError(f"{problems[0]}{more}: an export of non-finite weights would not load (the loader refuses "
                       "them); nothing was written. Find where training diverged (the loss, grad_norm) and export "
                       "from an earlier checkpoint")


# ----------------------------------------------------------------------------------------------------
# Plan: released items, formats, shards
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One released tensor: rows of a source (one expert of a stacked source), in one output format."""

    name: str
    source: TensorSource
    expert: int | None  # row `expert` of a stacked [E, ...] source, squeezed
    fmt: str  # "plain" | "fp8_block" | "fp4" | "fp8_rows"
    dtype: torch.dtype  # "plain": the written dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape[1:] if self.expert is not None else self.source.shape

    def entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) written for this item: the tensor, then its scale when quantized."""
        if self.fmt == "plain":
            return [(self.name, self.shape, self.dtype)]
        rows, cols = self.shape
        if self.fmt == "fp4":
            return [(self.name, (rows, cols // 2), torch.int8),
                    (scale_name(self.name), (rows, ceil_div(cols, 32)), torch.float8_e8m0fnu)]
        grid = (ceil_div(rows, 32), ceil_div(cols, 32)) if self.fmt == "fp8_block" else (rows, ceil_div(cols, 32))
        return [(self.name, (rows, cols), torch.float8_e4m3fn), (scale_name(self.name), grid, torch.float8_e8m0fnu)]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.entries())


def plan_items(sources: Iterable[TensorSource], quantize: str | None) -> list[_Item]:
    """Released items of `sources` in order; checks names (each once) and dtypes."""
    if quantize not in QUANTIZE_CHOICES:
        raise ExportError(f"quantize={quantize!r} is not a known export format; use None (floating point, as "
                          "trained) or 'release' (the released FP8/FP4 format)")
    items, seen = [], set()
    sources = list(sources)
    given = {source.name for source in sources}
    for source in sources:
        if source.dtype in _QUANTIZED_TORCH_DTYPES:
            # a kept model's stored codes and scales (kept.py): written as held, byte for byte
            weight = source.name.removesuffix(".scale") + ".weight"
            if not (source.name.endswith(".scale") and weight in given or scale_name(source.name) in given):
                raise NotImplementedError(f"tensor {source.name!r} is {source.dtype} without a scale tensor next to "
                                          "it: only released FP8/FP4 codes with their scales (a kept model's) are "
                                          "written as stored; export floating-point parameters")
            if source.name in seen:
                raise ValueError(f"tensor {source.name!r} is given twice")
            seen.add(source.name)
            items.append(_Item(source.name, source, None, "plain", source.dtype))
            continue
        stacked = _MODEL_EXPERT.match(source.name) and len(source.shape) == 3
        names = ([(model_to_released_name(source.name, e), e) for e in range(source.shape[0])]
                 if stacked else [(source.name, None)])
        for name, expert in names:
            if name in seen:
                raise ValueError(f"tensor {name!r} is given twice")
            seen.add(name)
            item_shape = source.shape[1:] if expert is not None else source.shape
            if quantize == "release":
                fmt, dtype = released_format(name, item_shape)
            elif source.dtype in _WIDENED:  # the checkpoint format holds BF16 / F32 floating point only
                fmt, dtype = "plain", _WIDENED[source.dtype]
            else:
                fmt, dtype = "plain", source.dtype
            items.append(_Item(name, source, expert, fmt, dtype))
    return items


def plan_shards(items: list[_Item], max_shard_bytes: int) -> list[list[_Item]]:
    """Items in order, a new shard whenever the next one would pass `max_shard_bytes` (a larger item
    gets a shard of its own); a tensor and its scale stay together."""
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ExportError(f"max_shard_size must be a positive number of bytes, got {max_shard_bytes!r}")
    shards, current, size = [], [], 0
    for item in items:
        if current and size + item.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    return shards + [current] if current or not shards else shards


# ----------------------------------------------------------------------------------------------------
# Row blocks of each written tensor
# ----------------------------------------------------------------------------------------------------


def _block_rows(item: _Item) -> int:
    rows = item.shape[0] if item.shape else 1
    row_bytes = math.prod(item.shape[1:]) * max(item.source.dtype.itemsize, item.dtype.itemsize)
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    if item.fmt == "fp8_block":  # whole 32-row scale blocks per step
        step = max(32, step // 32 * 32)
    return min(step, max(rows, 1))


def _source_rows(item: _Item) -> Iterator[torch.Tensor | None]:
    # the item's rows block by block, as read from the source (None on processes that do not write)
    if item.expert is not None:
        value = item.source.read(item.expert, item.expert + 1)
        yield None if value is None else value[0]
        return
    if not item.shape:
        yield item.source.read(0, 1)
        return
    step = _block_rows(item)
    for start in range(0, item.shape[0], step):
        yield item.source.read(start, min(start + step, item.shape[0]))


def _check_block(item: _Item, rows: torch.Tensor) -> None:
    problem = _first_nonfinite(item.name, rows)
    if problem:
        raise ExportError(f"{problem.replace(' at [', ' at block-relative [', 1)}: an export of non-finite weights "
                          "would not load; export from an earlier checkpoint")


def item_row_blocks(item: _Item) -> list[RowBlocks]:
    """The RowBlocks written for `item` (tensor, then scale). The scale's blocks are the ones collected while
    the tensor's were produced, so they must be consumed in that order (as `write_safetensors` does)."""
    specs = item.entries()
    if item.fmt == "plain":
        def plain():
            for rows in _source_rows(item):
                if rows is not None:
                    _check_block(item, rows)
                    block, rows = rows.to(item.dtype), None
                    yield block
                    del block
        return [RowBlocks(specs[0][1], specs[0][2], plain)]

    scales: list[torch.Tensor] = []
    encode = {"fp8_block": encode_fp8_blockwise, "fp4": encode_fp4_packed, "fp8_rows": encode_fp8_rows}[item.fmt]

    def codes():
        scales.clear()
        for rows in _source_rows(item):
            if rows is not None:
                try:
                    q, scale = encode(rows.float())
                except ValueError as exc:  # a value the format cannot hold: never saturated silently
                    raise ExportError(f"tensor {item.name!r} cannot be encoded as {item.fmt}: {exc}") from None
                rows = None
                scales.append(scale)
                yield q
                del q

    def scale_blocks():
        yield from scales
        scales.clear()

    return [RowBlocks(specs[0][1], specs[0][2], codes), RowBlocks(specs[1][1], specs[1][2], scale_blocks)]


# ----------------------------------------------------------------------------------------------------
# config.json of an export
# ----------------------------------------------------------------------------------------------------


def export_config(config: dict, *, architectures: list[str], dtype: torch.dtype, auto_map: dict,
                  quantize: str | None) -> dict:
    """The config.json of an export: released spelling, `auto_map`, and the quantization_config of the format."""
    config = copy.deepcopy(config)
    config.pop("quantization_config", None)
    config["architectures"] = architectures
    config["auto_map"] = auto_map
    config["dtype"] = "bfloat16" if quantize == "release" else str(dtype).removeprefix("torch.")
    text = config.get("text_config") or {}
    if "rope_parameters" in text:  # transformers >= 5.2x renames it; the release spells it rope_scaling
        text["rope_scaling"] = {k: v for k, v in text.pop("rope_parameters").items() if k != "rope_theta"}
    if quantize == "release":
        config["quantization_config"] = copy.deepcopy(RELEASED_QUANTIZATION_CONFIG)
    return config


# ----------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------


def _shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def _counted(blocks: RowBlocks, bar) -> RowBlocks:
    # one iterator for the entry's lifetime: draining after a failed write continues where writing stopped
    def counted():
        for block in blocks.blocks():
            nbytes = block.numel() * block.element_size()
            yield block
            del block  # not held while the next block is read
            bar.update(nbytes)
    iterator = counted()
    return RowBlocks(blocks.shape, blocks.dtype, lambda: iterator)


def _drain(entries: Iterable[RowBlocks]) -> None:
    # take part in every collective read of these blocks without writing anything
    for entry in entries:
        for _ in entry.blocks():
            pass


def write_export(
    sources: Iterable[TensorSource],
    out_dir: str | os.PathLike,
    config: dict,
    files: Iterable[str | os.PathLike] = (),
    *,
    quantize: str | None = None,
    max_shard_bytes: int = 5 << 30,
    writer: bool = True,
    sync: Callable[[str | None], str | None] | None = None,
    check_finite: bool = True,
) -> dict[str, str] | None:
    """Write `sources` as a Hugging Face folder at `out_dir`; returns the weight map (name -> shard) on the writer.

    `config` is written as config.json as given (see `export_config`); `files` (modeling code, tokenizer,
    processor files) are copied next to the weights. With several processes, every one calls this with the
    same sources in the same order; only `writer` touches the disk. `sync(message)` shares the writer's
    error message (or None) with every process and returns it, so a refused folder or a failed write ends
    every process with the same error instead of leaving some waiting in a collective.
    `check_finite`: refuse, before writing, a source whose values this process holds (``TensorSource.local``)
    with a NaN or Inf (the trainer's export checks every rank's shards itself and passes False).
    """
    out_dir = Path(out_dir)
    sync = sync or (lambda message: message)
    sources = list(sources)
    items = plan_items(sources, quantize)
    if check_finite and writer:
        problems = nonfinite_tensors(sources)
        if problems:
            raise nonfinite_error(problems)
    shards = plan_shards(items, max_shard_bytes)
    files = [Path(f) for f in files]
    problem = None
    if writer:
        try:
            _check_destination(out_dir)
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"file to copy into the export does not exist: {missing[0]}")
        except (OSError, ExportError) as exc:
            problem = exc
    message = sync(None if problem is None else f"{type(problem).__name__}: {problem}")
    if problem is not None:
        raise problem
    if message is not None:
        raise ExportError(f"the writing rank refused the export: {message}")

    if not writer:
        for shard in shards:
            _drain(entry for item in shard for entry in item_row_blocks(item))
        message = sync(None)
        if message is not None:
            raise ExportError(f"the export failed on the writing rank: {message}")
        return None

    staging = _new_sibling(out_dir, "tmp")
    try:
        weight_map, total, checksums = _write_shards(shards, staging, out_dir.name)
        _finish(staging, out_dir, weight_map, total, config, files, checksums)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        sync(f"{type(exc).__name__}: {exc}")
        raise
    sync(None)
    return weight_map


def _write_shards(shards: list[list[_Item]], staging: Path, label: str) -> tuple[dict[str, str], int, dict]:
    # After a failed write the remaining blocks are still produced (other ranks wait in their collective
    # reads), then the failure is raised.
    weight_map, checksums, failure = {}, {}, None
    total = sum(item.nbytes for shard in shards for item in shard)
    with progress_bar(total, f"Writing {label}") as bar:
        for index, shard in enumerate(shards, start=1):
            entries = {}
            for item in shard:
                for (name, _, _), blocks in zip(item.entries(), item_row_blocks(item)):
                    entries[name] = _counted(blocks, bar)
            file = _shard_name(index, len(shards))
            bar.set_postfix_str(f"shard {index}/{len(shards)}")
            if failure is None:
                try:
                    checksums[file] = write_safetensors(staging / file, entries)
                    fsync_path(staging / file)
                    weight_map.update(dict.fromkeys(entries, file))
                    continue
                except Exception as exc:  # noqa: BLE001 (any write error: re-raised after the drain)
                    failure = exc
            try:
                _drain(entries.values())
            except Exception:  # noqa: BLE001 (the drain failed too: report the first error)
                raise failure from None
    if failure is not None:
        raise failure
    return weight_map, total, checksums


def _finish(staging: Path, out_dir: Path, weight_map: dict, total: int, config: dict, files: list[Path],
            checksums: dict | None = None) -> None:
    metadata = {"total_size": total, "checksums": dict(sorted((checksums or {}).items()))}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for f in files:
        if not (staging / f.name).exists():  # the first of two same-named files wins
            shutil.copyfile(f, staging / f.name)
    written = sorted(p.name for p in staging.iterdir())
    (staging / EXPORT_MARKER).write_text(json.dumps({"written_by": "deepseek_v41", "files": written}, indent=1) + "\n")
    for name in (INDEX_FILE, CONFIG_FILE, EXPORT_MARKER):
        fsync_path(staging / name)
    fsync_path(staging)
    _swap_into_place(staging, out_dir)


# ----------------------------------------------------------------------------------------------------
# Folder safety
# ----------------------------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sibling_pattern(out_dir: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(out_dir.name)}\.deepseek_v41-(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]+$")


def _new_sibling(out_dir: Path, kind: str) -> Path:
    path = out_dir.parent / f".{out_dir.name}.deepseek_v41-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_our_export(folder: Path) -> bool:
    """A folder holding our marker and no file the marker does not list."""
    marker = folder / EXPORT_MARKER
    try:
        listed = set(json.loads(marker.read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return {p.name for p in folder.iterdir()} - {EXPORT_MARKER} <= listed


def _check_destination(out_dir: Path) -> None:
    # clean stale temporaries (restoring a previous export left aside), then check
    _clean_stale_siblings(out_dir)
    check_export_destination(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)


def check_export_destination(out_dir: str | os.PathLike) -> None:
    """Raise `ExportError` unless `out_dir` is missing, an empty folder or a previous export of ours (changes
    nothing; the trainer calls it before training, so a refused folder fails in seconds, not after the run)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        raise ExportError(f"export destination {out_dir} is a symbolic link: give the folder it points to, "
                          "or a new path")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"export destination {out_dir} exists and is not a folder: nothing was written; "
                          "choose a folder path (a new or empty folder, or a previous export)")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return
    marker = out_dir / EXPORT_MARKER
    if not marker.is_file():
        raise ExportError(f"export destination {out_dir} is not empty and not a deepseek_v41 export (it holds "
                          f"{', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}): nothing was written; "
                          "export into a new or empty folder (e.g. a subfolder), or remove those files")
    if not is_our_export(out_dir):
        listed = set(json.loads(marker.read_text()).get("files", [])) if _readable_marker(marker) else set()
        extra = [e for e in entries if e not in listed and e != EXPORT_MARKER]
        raise ExportError(f"export destination {out_dir} is a previous export plus files it did not write "
                          f"({', '.join(extra[:5])}): nothing was written; move those files out first")


def _readable_marker(marker: Path) -> bool:
    try:
        return isinstance(json.loads(marker.read_text()).get("files"), list)
    except (OSError, ValueError, AttributeError):
        return False


def _clean_stale_siblings(out_dir: Path) -> None:
    # Temporaries of processes that died mid-export: a "tmp" is an unfinished or replaced export (removed);
    # an "old" is the previous export moved aside by the fallback swap (restored if the destination is gone).
    if not out_dir.parent.is_dir():
        return
    pattern = _sibling_pattern(out_dir)
    for path in sorted(out_dir.parent.iterdir()):
        match = pattern.match(path.name)
        if not match or _alive(int(match["pid"])):  # a live process may still be writing it
            continue
        if match["kind"] == "old" and not out_dir.exists() and not out_dir.is_symlink():
            logger.warning("restoring the previous export %s, left aside by an interrupted export", out_dir)
            path.rename(out_dir)
            continue
        logger.info("removing %s, left by an interrupted export", path)
        shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"swapping {a} and {b}: {os.strerror(code)}")


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(staging, out_dir)  # refuses, rather than merges, if out_dir appeared meanwhile
    elif _exchange(staging, out_dir):
        shutil.rmtree(staging)  # now the previous export
    else:
        # No atomic exchange here: the previous export moves aside first and is restored by the next
        # export if a kill lands between the two renames.
        aside = out_dir.parent / staging.name.replace("-tmp-", "-old-")
        os.rename(out_dir, aside)
        os.rename(staging, out_dir)
        shutil.rmtree(aside)
    fsync_path(out_dir.parent)
