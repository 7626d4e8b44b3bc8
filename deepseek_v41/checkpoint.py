"""Released DeepSeek-V4.1 checkpoints: read and validate them, stream them into a model, write safetensors.

A released snapshot (architecture.md §12) is `config.json` (with `quantization_config`) plus
`model.safetensors.index.json` and shards. Quantized tensors come as codes plus a `.scale` tensor
(`X.weight` + `X.scale`; Engram tables `embed.weight` + `embed.scale`), decoded by `release_format.py`.
A floating-point export has the same names, no `.scale` tensors and no `quantization_config`.

The model's parameter names equal the released names, except that routed experts are stacked per
layer: released `layers.{i}.ffn.experts.{e}.w1.weight` is row e of model `layers.{i}.ffn.experts.w1`.

Loading streams shard by shard and, inside a tensor, row block by row block, reading only the bytes it
needs, so memory beyond the model stays at a few row blocks (one shard at most). Long loads, conversions
and exports show transformers' progress bar in bytes (`progress_bar`).

Opening a checkpoint validates every safetensors header (integer offsets in range, sizes that match
shape x dtype, no two tensors sharing bytes) and each tensor's dtype against the released format for its
name. Every decoded row block is then checked finite (one extra pass over the block), so a NaN FP8 code,
a NaN/Inf in a BF16/F32 tensor or an overflowing scale fails naming the tensor, the file and the element.
Opt out for speed with `check_finite=False` (`ReleasedCheckpoint`, `load_checkpoint_into_model`) or the
environment variable `DEEPSEEK_V41_CHECK_FINITE=0` (which also covers `from_pretrained` and training).

An export of ours records each shard's checksum in the index (`metadata.checksums`, computed while the shard
was written); a shard is read whole and compared once, before the first tensor is taken from it, so bytes
changed without changing the size (a damaged disk or transfer) fail naming the shard. Opt out with
`verify_checksums=False` or `DEEPSEEK_V41_VERIFY_CHECKSUMS=0`. The release's own index records none.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checksums import HashingStream, check_enabled, file_matches
from .release_format import (
    block_pair,
    ceil_div,
    decode_fp4_packed,
    decode_fp8_row_scaled,
    decode_fp8_rows,
    take_rows,
)

logger = logging.getLogger(__name__)


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# safetensors dtype string -> torch dtype (the ones a V4.1 checkpoint or its export can hold)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "I8", "U8")
SCALE_DTYPES = ("F8_E8M0", "F32")
# Stored dtypes of unquantized tensors: the release's BF16 and F32, which exports keep (F16 appears in neither:
# an F16 header on 2-byte data is a relabelled BF16 tensor whose bytes would decode to wrong values; other
# relabels change the byte size and fail the header check). The fp32-contract tensors are F32 in the release;
# a BF16 one (from a model cast whole to bf16) loads exactly into the fp32 parameter.
PLAIN_DTYPES = ("BF16", "F32")
# Environment opt-out of the per-block finite check (`check_finite`), for speed on trusted checkpoints.
CHECK_FINITE_ENV = "DEEPSEEK_V41_CHECK_FINITE"
# Environment opt-out of the shard checksum comparison (`verify_checksums`; exports of ours record them).
VERIFY_CHECKSUMS_ENV = "DEEPSEEK_V41_VERIFY_CHECKSUMS"

# Row blocks the loader decodes at once (output bytes); bounds the memory beyond the model.
LOAD_BLOCK_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the tensor and the file."""


def progress_bar(total_bytes: int, desc: str):
    """transformers' tqdm over bytes (off after `transformers.utils.logging.disable_progress_bar()`);
    callers show the shard in the postfix. Use as a context manager; `update(nbytes)` per tensor or block."""
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                           leave=False)


# ----------------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------------

_RELEASED_EXPERT = re.compile(r"^(?P<prefix>.+\.ffn\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight$")
_MODEL_EXPERT = re.compile(r"^(?P<prefix>.+\.ffn\.experts)\.(?P<proj>w[123])$")
_ENGRAM_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")
SKIPPED_PREFIXES = ("mtp.",)  # DSpark draft stages: skipped when the model is built without them


def released_to_model_name(name: str) -> tuple[str, int | None]:
    """Released tensor name -> (model parameter name, expert row or None).

    `layers.{i}.ffn.experts.{e}.w1.weight` -> (`layers.{i}.ffn.experts.w1`, e); every other name is unchanged.
    """
    if name.endswith(".scale"):
        raise ValueError(f"{name!r} is a scale: it is consumed by decoding and has no model counterpart")
    match = _RELEASED_EXPERT.match(name)
    if match:
        return f"{match['prefix']}.{match['proj']}", int(match["expert"])
    return name, None


def model_to_released_name(model_name: str, expert_index: int | None = None) -> str:
    """Inverse of `released_to_model_name`."""
    match = _MODEL_EXPERT.match(model_name)
    if match and expert_index is not None:
        return f"{match['prefix']}.{expert_index}.{match['proj']}.weight"
    if match or expert_index is not None:
        raise ValueError(f"{model_name!r} with expert_index={expert_index}: only stacked routed experts "
                         "(`...ffn.experts.w{1,2,3}`) take an expert index, and they need one")
    return model_name


def released_items(model_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A model state item -> the released items it stands for (stacked experts [E, ...] split into E rows)."""
    if _MODEL_EXPERT.match(model_name) and tensor.dim() == 3:
        for expert in range(tensor.shape[0]):
            yield model_to_released_name(model_name, expert), tensor[expert]
    else:
        yield model_name, tensor


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.scale` (FP8/FP4 weights and Engram tables alike)."""
    return weight_name.removesuffix(".weight") + ".scale"


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRecord:
    """Where one stored tensor lives: file, safetensors dtype string, shape and absolute byte offset."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_safetensors_header(path: Path) -> dict[str, TensorRecord]:
    """Parse and check a safetensors header without reading tensor data (truncation, corruption, dtypes)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: the header claims {header_len} bytes but the file has {size} "
                                  "(truncated or not a safetensors file)")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted safetensors header ({exc}); re-download this shard") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    data_start = 8 + header_len
    records, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError) as exc:
            raise CheckpointError(f"{path}: corrupted header entry for tensor {name!r}: {info!r}") from exc
        if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2):
            raise CheckpointError(f"{path}: corrupted header entry for tensor {name!r}: shape and data_offsets "
                                  f"must be lists of non-negative integers, got {info!r}; re-download this shard")
        shape, (begin, end) = tuple(shape), offsets
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        itemsize = SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} has data_offsets "
                                  f"[{begin}, {end}] of the wrong length (corrupted header)")
        if data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has "
                                  f"{size} bytes (truncated shard; re-download it)")
        records[name] = TensorRecord(name, path, dtype, shape, data_start + begin, end - begin)
        spans.append((begin, end, name))
    spans.sort()
    for (begin, end, name), (next_begin, next_end, next_name) in itertools.pairwise(spans):
        if next_begin < end:
            raise CheckpointError(f"{path}: tensors {name!r} (bytes [{begin}, {end}]) and {next_name!r} (bytes "
                                  f"[{next_begin}, {next_end}]) overlap (corrupted header); re-download this shard")
    return records


def _naturals(value) -> bool:
    # a JSON list of non-negative integers (not floats, strings or booleans)
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def finite_check_enabled() -> bool:
    """Whether decoded values are checked finite by default (`DEEPSEEK_V41_CHECK_FINITE`: "1" or unset, or "0")."""
    value = os.environ.get(CHECK_FINITE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{CHECK_FINITE_ENV}={value!r}: use 1 (check decoded values are finite) or 0 (skip)")
    return value == "1"


def _read_bytes(record: TensorRecord, start: int, nbytes: int) -> torch.Tensor:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    with open(record.file, "rb") as handle:
        handle.seek(record.offset + start)
        got = handle.readinto(memoryview(buffer.numpy()))
    if got != nbytes:
        raise CheckpointError(f"{record.file}: short read of tensor {record.name!r} (file changed or truncated)")
    return buffer


@dataclass(frozen=True)
class StoredTensor:
    """One logical tensor of a checkpoint: its weight record, its scale record (quantized only) and format."""

    name: str
    record: TensorRecord
    scale: TensorRecord | None
    fmt: str  # "plain" | "fp8_block" | "fp8_rows" | "fp4"

    @property
    def shape(self) -> tuple[int, ...]:
        """Decoded shape (FP4 bytes hold two columns)."""
        if self.fmt == "fp4":
            return (self.record.shape[0], 2 * self.record.shape[1])
        return self.record.shape

    @property
    def dtype(self) -> torch.dtype:
        """Dtype `decode` returns by default: fp32 for quantized formats, else the stored dtype."""
        return torch.float32 if self.fmt != "plain" else SAFETENSORS_DTYPES[self.record.dtype]

    @property
    def where(self) -> str:
        """The file holding the tensor (and its scale's file when that differs), for messages."""
        if self.scale is not None and self.scale.file != self.record.file:
            return f"{self.record.file} (scale in {self.scale.file.name})"
        return str(self.record.file)


class ReleasedCheckpoint:
    """A released (quantized) or floating-point-export checkpoint directory, validated when opened.

    `tensors` maps every non-scale tensor name to a `StoredTensor`; `decode(name, rows)` returns
    floating-point values, checked finite unless `check_finite` is False (default: the environment
    variable DEEPSEEK_V41_CHECK_FINITE, on unless "0"). Scales may live in another shard than their weight.
    """

    def __init__(self, path: str | os.PathLike, *, group: int = 32, check_finite: bool | None = None,
                 verify_checksums: bool | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        self.check_finite = finite_check_enabled() if check_finite is None else check_finite
        self.verify_checksums = (check_enabled(VERIFY_CHECKSUMS_ENV) if verify_checksums is None
                                 else verify_checksums)
        self.checksums: dict[str, str] = {}  # shard file name -> checksum (exports of ours record them)
        self.verified: set[Path] = set()  # shards compared (or taken as compared: `mark_verified`)
        self.config = self._read_config()
        self.quantization_config = (self.config or {}).get("quantization_config")
        block = (self.quantization_config or {}).get("weight_block_size", [32, 32])
        self.block = block_pair(tuple(block))
        self.group = group
        self.records = self._read_records()
        self.tensors = self._pair_scales()
        self._check_config_against_weights()
        # a released quantized checkpoint, as opposed to a floating-point export
        self.is_quantized = self.quantization_config is not None or any(
            t.fmt != "plain" for t in self.tensors.values())

    @property
    def files(self) -> list[Path]:
        return sorted({record.file for record in self.records.values()})

    # -- opening ---------------------------------------------------------------------------------------

    def _read_config(self) -> dict | None:
        path = self.path / CONFIG_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc

    def _read_records(self) -> dict[str, TensorRecord]:
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            try:
                index = json.loads(index_path.read_text())
                weight_map = index["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path}: not a safetensors index (needs a `weight_map`): {exc}") from exc
            checksums = (index.get("metadata") or {}).get("checksums") or {}
            if not (isinstance(checksums, dict) and all(isinstance(v, str) and ":" in v for v in checksums.values())):
                raise CheckpointError(f"{index_path}: metadata.checksums must map shard files to checksum strings, "
                                      f"got {checksums!r} (corrupted index?)")
            self.checksums = checksums
            by_file = defaultdict(list)
            for name, file in weight_map.items():
                by_file[file].append(name)
            for file, names in by_file.items():
                if not (self.path / file).is_file():
                    raise CheckpointError(f"shard {self.path / file} is listed in {index_path} (tensor {names[0]!r}"
                                          f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) but does "
                                          "not exist: the download is incomplete")
        elif (self.path / SINGLE_FILE).is_file():
            index_path = self.path / SINGLE_FILE
            by_file = {SINGLE_FILE: list(read_safetensors_header(index_path))}
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self.listing = index_path  # the file that lists every tensor (index, or the single shard)
        records = {}
        for file, names in sorted(by_file.items()):
            try:
                header = read_safetensors_header(self.path / file)
            except CheckpointError as exc:  # say which tensors the broken shard should hold
                more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                raise CheckpointError(f"{exc} [{index_path.name} places tensor {names[0]!r}{more} in it]") from None
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{index_path} maps tensor {name!r} to {self.path / file}, "
                                          "which does not contain it")
                records[name] = header[name]
            unlisted = sorted(set(header) - set(names))
            if unlisted:
                raise CheckpointError(f"{self.path / file} holds tensor {unlisted[0]!r} that {index_path} does "
                                      "not list: the index and the shards are from different snapshots")
        return records

    def _pair_scales(self) -> dict[str, StoredTensor]:
        tensors = {}
        for name, record in self.records.items():
            if name.endswith(".scale"):
                weight = name.removesuffix(".scale") + ".weight"
                if weight not in self.records:
                    raise CheckpointError(f"scale {name!r} in {record.file} has no weight {weight!r}")
                continue
            scale = self.records.get(scale_name(name)) if name.endswith(".weight") else None
            tensors[name] = StoredTensor(name, record, scale, self._format(record, scale))
        return tensors

    def _format(self, record: TensorRecord, scale: TensorRecord | None) -> str:
        name, where = record.name, record.file
        if scale is None:
            if record.dtype in QUANTIZED_DTYPES:
                raise CheckpointError(f"tensor {name!r} in {where} is {record.dtype} but its scale "
                                      f"{scale_name(name)!r} is missing")
            if record.dtype not in PLAIN_DTYPES and not name.startswith(SKIPPED_PREFIXES):
                raise CheckpointError(f"tensor {name!r} in {where} is stored as {record.dtype} but unquantized "
                                      f"tensors are {' or '.join(PLAIN_DTYPES)} (in the release and in exports): "
                                      "wrong dtype (a relabelled or foreign tensor); re-download or re-export it")
            return "plain"
        if scale.dtype not in SCALE_DTYPES:
            raise CheckpointError(f"scale {scale.name!r} in {scale.file} has dtype {scale.dtype}; expected "
                                  "F8_E8M0 (UE8M0) or F32")
        if len(record.shape) != 2:
            raise CheckpointError(f"quantized tensor {name!r} in {where} must be 2-D, got {list(record.shape)}")
        rows, cols = record.shape
        if record.dtype in ("I8", "U8"):
            if not _RELEASED_EXPERT.match(name):
                raise CheckpointError(f"tensor {name!r} in {where} is packed FP4 ({record.dtype} with a scale) but "
                                      "only routed experts (`...ffn.experts.{e}.w1/w2/w3.weight`) are FP4 in the "
                                      "released format: a relabelled tensor")
            fmt, expected = "fp4", (rows, ceil_div(2 * cols, self.group))
        elif record.dtype == "F8_E4M3" and _ENGRAM_TABLE.match(name):
            fmt, expected = "fp8_rows", (rows, ceil_div(cols, self.group))
        elif record.dtype == "F8_E4M3":
            fmt, expected = "fp8_block", (ceil_div(rows, self.block[0]), ceil_div(cols, self.block[1]))
        else:
            raise CheckpointError(f"tensor {name!r} in {where} has a scale but dtype {record.dtype}; quantized "
                                  "weights are F8_E4M3 (FP8) or I8 (packed FP4)")
        if scale.shape != expected:
            raise CheckpointError(f"scale {scale.name!r} in {scale.file} has shape {list(scale.shape)} but "
                                  f"{name!r} {record.dtype}{list(record.shape)} needs {list(expected)} ({fmt})")
        return fmt

    def _check_config_against_weights(self) -> None:
        if self.config is None:
            return
        config_path = self.path / CONFIG_FILE
        quantized = [t for t in self.tensors.values() if t.fmt != "plain"]
        if self.quantization_config is None and quantized:
            t = quantized[0]
            raise CheckpointError(f"{config_path} has no quantization_config but tensor {t.name!r} in {t.where} "
                                  f"is quantized ({t.record.dtype} with a scale): config and weights disagree")
        if self.quantization_config is not None and not quantized:
            raise CheckpointError(f"{config_path} declares a quantization_config but no tensor in {self.path} "
                                  "is quantized: config and weights disagree")
        text = self.config.get("text_config", self.config)
        vision = self.config.get("vision_config") or {}
        limits = [
            (re.compile(r"^layers\.(\d+)\."), "text_config.num_hidden_layers", text.get("num_hidden_layers")),
            (re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\."), "text_config.n_routed_experts",
             text.get("n_routed_experts")),
            (re.compile(r"^mtp\.(\d+)\."), "text_config.num_nextn_predict_layers", text.get("num_nextn_predict_layers")),
            (re.compile(r"^mtp\.\d+\.ffn\.experts\.(\d+)\."), "text_config.dspark_n_routed_experts",
             text.get("dspark_n_routed_experts")),
            (re.compile(r"^vision\.blocks\.(\d+)\."), "vision_config.num_hidden_layers",
             vision.get("num_hidden_layers")),
        ]
        for pattern, key, limit in limits:
            if limit is None:
                continue
            for t in self.tensors.values():
                match = pattern.match(t.name)
                if match and int(match[1]) >= limit:
                    raise CheckpointError(f"tensor {t.name!r} in {t.where} has index {match[1]} but {config_path} "
                                          f"says {key} = {limit}: config and weights disagree")

    # -- reading ---------------------------------------------------------------------------------------

    def verify_files(self, files: Iterable[Path] | None = None) -> list[str]:
        """Compare the recorded checksum of each shard in `files` (default: all) with its bytes, once per shard
        -> a problem per shard that differs (nothing when `verify_checksums` is off or none is recorded)."""
        problems = []
        for file in sorted(self.files if files is None else files):
            if not self.verify_checksums or file in self.verified or file.name not in self.checksums:
                continue
            recorded = self.checksums[file.name]
            ok, actual = file_matches(file, recorded)
            if not ok:
                problems.append(f"shard {file} has checksum {actual} but {self.listing.name} recorded {recorded}: its "
                                "bytes changed after it was written (a damaged disk, download or copy); re-download "
                                f"or re-export it (to skip this check: verify_checksums=False or "
                                f"{VERIFY_CHECKSUMS_ENV}=0)")
            self.verified.add(file)
        return problems

    def mark_verified(self, files: Iterable[Path]) -> None:
        """Take these shards as compared (another process of the same job compared them)."""
        self.verified.update(files)

    def _verify_before_reading(self, file: Path) -> None:
        if file not in self.verified and self.verify_checksums and file.name in self.checksums:
            problems = self.verify_files([file])
            if problems:
                raise CheckpointError(problems[0])

    def read_raw(self, record: TensorRecord, rows: slice | None = None) -> torch.Tensor:
        """Stored values of rows [start, stop) (all by default), reading only those bytes."""
        self._verify_before_reading(record.file)
        dtype = SAFETENSORS_DTYPES[record.dtype]
        if rows is None or not record.shape:
            return _read_bytes(record, 0, record.nbytes).view(dtype).reshape(record.shape)
        start, stop, _ = rows.indices(record.shape[0])
        stop = max(start, stop)
        data = _read_bytes(record, start * record.row_bytes, (stop - start) * record.row_bytes)
        return data.view(dtype).reshape((stop - start, *record.shape[1:]))

    def row_slices(self, name: str, element_size: int, rows: range | None = None) -> Iterator[slice]:
        """Row blocks of tensor `name` (within `rows`) whose decoded size is about LOAD_BLOCK_BYTES."""
        t = self.tensors[name]
        rows = rows if rows is not None else range(t.shape[0] if t.shape else 1)
        step = max(1, LOAD_BLOCK_BYTES // max(1, math.prod(t.shape[1:]) * element_size))
        if t.fmt == "fp8_block":  # whole scale blocks per step: no scale row is read twice
            step = max(self.block[0], step // self.block[0] * self.block[0])
        for start in range(rows.start, rows.stop, step):
            yield slice(start, min(start + step, rows.stop))

    def read_stored(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scale) of quantized tensor `name` as stored (checked like `copy_stored`)."""
        t = self.tensors[name]
        codes, scale = self.read_raw(t.record), self.read_raw(t.scale)
        self._check_stored(t, 0, codes, None)
        self._check_stored(t, 0, None, scale)
        return codes, scale

    def copy_stored(self, name: str, target: torch.Tensor, scale_target: torch.Tensor) -> None:
        """Copy quantized tensor `name`'s codes and scale, as stored, into `target` / `scale_target` (kept formats),
        row block by row block (LOAD_BLOCK_BYTES each): nothing is decoded."""
        t = self.tensors[name]
        for record, into in ((t.record, target), (t.scale, scale_target)):
            step = max(1, LOAD_BLOCK_BYTES // max(1, record.row_bytes))
            for start in range(0, record.shape[0], step):
                rows = slice(start, min(start + step, record.shape[0]))
                value = self.read_raw(record, rows)
                self._check_stored(t, start, *((value, None) if record is t.record else (None, value)))
                into[rows].view(torch.uint8 if value.element_size() == 1 else value.dtype).copy_(
                    value.view(torch.uint8) if value.element_size() == 1 else value)

    def _check_stored(self, t: StoredTensor, first_row: int, codes: torch.Tensor | None,
                      scale: torch.Tensor | None) -> None:
        # the NaNs a stored block can hold, found without decoding: an FP8 NaN code (E4M3 S.1111.111), a UE8M0
        # NaN byte 255, a negative or non-finite F32 scale
        if not self.check_finite:
            return
        if codes is not None and t.fmt != "fp4":
            bad = (codes.view(torch.uint8) & 0x7F) == 0x7F
            what = "the NaN FP8 code {:#04x} at code"
            values = codes.view(torch.uint8)
        elif scale is not None and scale.dtype == torch.float8_e8m0fnu:
            bad, what, values = scale.view(torch.uint8) == 255, "the NaN UE8M0 scale byte {:#04x} at scale", scale.view(torch.uint8)
        elif scale is not None:
            bad, what, values = ~((scale >= 0) & (scale < torch.inf)), "the F32 scale {} at scale", scale
        else:
            return
        if not bool(bad.any()):
            return
        local = bad.nonzero()[0].tolist()
        value = values[tuple(local)].item()
        raise CheckpointError(
            f"tensor {t.name!r} in {t.where} holds {what.format(value)} element {[first_row + local[0], *local[1:]]}: "
            "the checkpoint is corrupted, re-download or re-export it (to skip this check on a trusted checkpoint: "
            f"check_finite=False or {CHECK_FINITE_ENV}=0)")

    def as_row_blocks(self, name: str, dtype: torch.dtype | None = None) -> RowBlocks:
        """Tensor `name` decoded to `dtype` lazily, row block by row block (for streaming exports)."""
        t = self.tensors[name]
        dtype = dtype or t.dtype

        def blocks() -> Iterator[torch.Tensor]:
            for block in self.row_slices(name, dtype.itemsize):
                yield self.decode(name, block, dtype=dtype)

        return RowBlocks(t.shape, dtype, blocks)

    def decode(
        self,
        name: str,
        rows: slice | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Floating-point value of tensor `name` (rows [start, stop) only, if given).

        Quantized formats decode exactly (to fp32 by default; bf16 holds every value too); plain tensors keep
        their stored dtype unless `dtype` says otherwise. With `out`, the result is written there (its dtype
        and device win) and only the bytes of the requested rows are read.
        """
        t = self.tensors[name]
        if out is not None:
            dtype, device = out.dtype, out.device
        dtype, device = dtype or t.dtype, torch.device(device)
        start, stop, _ = (rows or slice(None)).indices(t.shape[0] if t.shape else 1)
        rows = slice(start, max(start, stop))
        if t.fmt == "plain":
            value = self.read_raw(t.record, rows if t.shape else None)
            self._check_finite(t, rows.start, value)
            return out.copy_(value) if out is not None else value.to(device=device, dtype=dtype)
        q = self.read_raw(t.record, rows).to(device)
        try:
            if t.fmt == "fp4":
                scale = self.read_raw(t.scale, rows).to(device)
                value = decode_fp4_packed(q, scale, self.group, dtype=dtype, out=out)
            elif t.fmt == "fp8_rows":
                scale = self.read_raw(t.scale, rows).to(device)
                value = decode_fp8_rows(q, scale, self.group, dtype=dtype, out=out)
            else:  # fp8_block: read the scale block rows covering the rows, then one scale row per row of q
                block_rows = slice(rows.start // self.block[0], ceil_div(rows.stop, self.block[0]))
                scale = self.read_raw(t.scale, block_rows).to(device)
                row_block = torch.arange(rows.start, rows.stop, device=device) // self.block[0] - block_rows.start
                value = decode_fp8_row_scaled(q, take_rows(scale, row_block), self.block[1], dtype, out)
        except ValueError as exc:
            raise CheckpointError(f"cannot decode tensor {name!r} from {t.where}: {exc}") from exc
        self._check_finite(t, rows.start, value, q)
        return value

    def _check_finite(self, t: StoredTensor, first_row: int, value: torch.Tensor, codes=None) -> None:
        # One pass over the block (rows from `first_row`): a sum is non-finite iff an element is (NaN and inf
        # propagate) or it overflows; it is ~20x cheaper than isfinite().all() on bf16 CPU tensors (measured in
        # examples/benchmarks/finite_check.py). The element and its cause are looked up only then.
        # codes: the stored FP8/FP4 bytes of a quantized block.
        if not self.check_finite or not value.is_floating_point() or bool(torch.isfinite(value.sum())):
            return
        if bool(torch.isfinite(value).all()):  # the sum overflowed, every element is finite
            return
        local = tuple((~torch.isfinite(value)).nonzero()[0].tolist())
        at = [first_row + local[0], *local[1:]] if local else []
        if codes is None:
            cause = "a stored non-finite value"
        elif t.fmt != "fp4" and (codes.view(torch.uint8)[local] & 0x7F) == 0x7F:
            cause = f"the NaN FP8 code {int(codes.view(torch.uint8)[local]):#04x}"
        else:
            cause = f"its code times its scale overflows {value.dtype}"
        raise CheckpointError(
            f"tensor {t.name!r} in {t.where} holds {value[local].item()} at {at} ({cause}): the checkpoint is "
            f"corrupted, re-download or re-export it (to skip this check on a trusted checkpoint: "
            f"check_finite=False or {CHECK_FINITE_ENV}=0)")


# ----------------------------------------------------------------------------------------------------
# Loading into a model
# ----------------------------------------------------------------------------------------------------


def local_row_range(target: torch.Tensor) -> range:
    """Rows of the full tensor this process stores (hook for sharded targets; a plain tensor holds all)."""
    if _is_dtensor(target):
        raise NotImplementedError("loading into DTensor (sharded) parameters is not implemented yet: extend "
                                  "local_row_range/copy_rows_into for the target's placements")
    return range(target.shape[0] if target.dim() else 1)


def copy_rows_into(target: torch.Tensor, start: int, decoded: torch.Tensor) -> None:
    """Copy rows [start, start + len(decoded)) of the full decoded tensor into the part `target` stores.

    For a plain tensor that is `target[start:stop]`; a sharded target copies only its local slice.
    """
    if _is_dtensor(target):
        raise NotImplementedError("loading into DTensor (sharded) parameters is not implemented yet")
    if target.dim() == 0:
        target.copy_(decoded.reshape(()))
    else:
        target[start:start + decoded.shape[0]].copy_(decoded)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"


@dataclass
class LoadReport:
    """What `load_checkpoint_into_model` did, by released tensor name."""

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # released, deliberately unused (mtp.* of a stageless model)
    missing: list[str] = field(default_factory=list)  # expected by the model, absent (strict=False only)
    unexpected: list[str] = field(default_factory=list)  # present, unknown to the model (strict=False only)


# Config fields that decide tensor shapes; the model's config must agree with the checkpoint's.
_STRUCTURE_KEYS = {
    "text_config": (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
        "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
        "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "index_n_heads", "index_head_dim",
        "hc_mult", "engram_layer_ids", "engram_num_embeddings", "engram_n_heads", "engram_head_dim",
        "engram_max_ngram_size",
    ),
    "vision_config": ("num_hidden_layers", "hidden_size", "intermediate_size", "patch_size"),
}


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def check_model_config(model: torch.nn.Module, checkpoint: ReleasedCheckpoint) -> None:
    """Raise if the model was built from a config whose shape fields differ from the checkpoint's config.json."""
    model_config = getattr(model, "config", None)
    if model_config is None or checkpoint.config is None:
        return
    for section, keys in _STRUCTURE_KEYS.items():
        released = checkpoint.config.get(section) or {}
        built = getattr(model_config, section, None)
        for key in keys:
            if key not in released or built is None or not hasattr(built, key):
                continue
            if _plain(getattr(built, key)) != _plain(released[key]):
                raise CheckpointError(
                    f"{checkpoint.path / CONFIG_FILE} has {section}.{key} = {released[key]!r} but the model "
                    f"was built with {getattr(built, key)!r}: build the model from this checkpoint's config")


@dataclass(frozen=True)
class _Assignment:
    released: str
    target_name: str
    expert: int | None
    kept: bool = False  # the stored codes and scale are copied as they are (kept formats), not decoded
    table: bool = False  # an Engram table handed, as stored, to its module's load_kept_table


def _plan(
    model: torch.nn.Module, checkpoint: ReleasedCheckpoint, strict: bool, dequantize: bool = True
) -> tuple[dict[str, torch.Tensor], list[_Assignment], LoadReport]:
    # Match released names to model tensors and check shapes and dtypes; reads no tensor data.
    check_model_config(model, checkpoint)
    report = LoadReport()
    targets = model.state_dict(keep_vars=True)  # parameters + persistent buffers, by model name
    expected = {}
    for target_name, target in targets.items():
        if _MODEL_EXPERT.match(target_name):
            for expert in range(target.shape[0]):
                expected[model_to_released_name(target_name, expert)] = (target_name, expert)
        elif target_name.endswith(".scale") and target_name.removesuffix(".scale") + ".weight" in targets:
            continue  # a kept tensor's scale: loaded with its weight
        else:
            expected[target_name] = (target_name, None)
    has_stages = any(name.startswith(SKIPPED_PREFIXES) for name in expected)
    missing = sorted(set(expected) - set(checkpoint.tensors))
    if missing:
        if strict:
            raise CheckpointError(f"tensor {missing[0]!r} expected by the model is missing from {checkpoint.listing}"
                                  f"{f' ({len(missing) - 1} more missing)' if len(missing) > 1 else ''}")
        logger.warning("%d tensors missing from %s (left as they are): %s", len(missing), checkpoint.listing, missing)
        report.missing.extend(missing)
    plan = []
    for name, stored in checkpoint.tensors.items():
        if stored.fmt == "fp8_rows" and not dequantize and not _held_dequantized(model, name):
            plan.append(_Assignment(name, name.removesuffix(".embed.weight"), None, kept=True, table=True))
            continue
        if name not in expected:
            if name.startswith(SKIPPED_PREFIXES) and not has_stages:
                report.skipped.append(name)
            elif strict:
                raise CheckpointError(f"unexpected tensor {name!r} in {stored.where}: the model has no parameter "
                                      "for it (wrong model class or config?)")
            else:
                report.unexpected.append(name)
            continue
        target_name, expert = expected[name]
        target = targets[target_name]
        label = f"{target_name!r}" + (f"[{expert}]" if expert is not None else "")
        if _kept_target(target):
            _check_kept(stored, target, targets.get(scale_name(target_name)), label)
            plan.append(_Assignment(name, target_name, expert, kept=True))
            continue
        if stored.fmt != "plain" and not dequantize and not _held_dequantized(model, name):
            raise CheckpointError(
                f"model parameter {label} is {target.dtype} but {name!r} in {stored.where} is stored quantized "
                f"({stored.record.dtype}): to keep the stored formats, build the model's kept modules first "
                "(deepseek_v41.kept.keep_release_formats on the meta-device model, as from_pretrained does), or "
                "load with dequantize_base_checkpoint=True")
        shape = tuple(target.shape[1:] if expert is not None else target.shape)
        if stored.shape != shape:
            raise CheckpointError(f"tensor {name!r} in {stored.where} has shape {list(stored.shape)} but model "
                                  f"parameter {label} needs {list(shape)}")
        if stored.dtype.is_floating_point != target.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name!r} in {stored.where} has dtype {stored.record.dtype} but model "
                                  f"parameter {label} is {target.dtype}: wrong dtype")
        plan.append(_Assignment(name, target_name, expert))
    if report.skipped:
        logger.info("skipping %d released tensors of the DSpark draft stages (mtp.*): the model is built without "
                    "them (num_nextn_predict_layers 0)", len(report.skipped))
    return targets, plan, report


def _kept_target(target: torch.Tensor) -> bool:
    # a kept (stored-format) code tensor: FP8 E4M3 codes or packed FP4 bytes
    return target.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8)


def _held_dequantized(model: torch.nn.Module, name: str) -> bool:
    from .kept import held_dequantized

    return held_dequantized(model, name)


def _check_kept(stored: StoredTensor, target: torch.Tensor, scale: torch.Tensor | None, label: str) -> None:
    # a kept target takes the stored codes and scale as they are: same dtypes, same shapes
    if stored.fmt == "plain":
        raise CheckpointError(f"model tensor {label} holds {target.dtype} codes (kept release format) but "
                              f"{stored.name!r} in {stored.where} is stored unquantized ({stored.record.dtype}): "
                              "load this checkpoint into a model without kept formats (dequantize_base_checkpoint=True)")
    pairs = [(stored.record, target, label)]
    if scale is None:
        raise CheckpointError(f"model tensor {label} holds {target.dtype} codes but has no scale tensor next to it")
    pairs.append((stored.scale, scale, f"{label} scale"))
    for record, tensor, what in pairs:
        dtype = SAFETENSORS_DTYPES[record.dtype]
        if dtype != tensor.dtype or tuple(record.shape) != tuple(tensor.shape):
            raise CheckpointError(f"tensor {record.name!r} in {record.file} is {record.dtype}{list(record.shape)} "
                                  f"but the kept model tensor {what} is {tensor.dtype}{list(tensor.shape)}: the model "
                                  "was built for another checkpoint (build it from this one's config)")


def check_checkpoint_matches_model(
    model: torch.nn.Module, checkpoint: str | os.PathLike | ReleasedCheckpoint, *, strict: bool = True
) -> LoadReport:
    """Check names, shapes, dtypes and config of a checkpoint against a model without reading tensor data.

    Works on a model built on the meta device. Raises `CheckpointError` naming the tensor and the file.
    """
    if not isinstance(checkpoint, ReleasedCheckpoint):
        checkpoint = ReleasedCheckpoint(checkpoint)
    return _plan(model, checkpoint, strict)[2]


@torch.no_grad()
def load_checkpoint_into_model(
    model: torch.nn.Module,
    path: str | os.PathLike | ReleasedCheckpoint,
    *,
    strict: bool = True,
    dequantize_base_checkpoint: bool = True,
    check_finite: bool | None = None,
    verify_checksums: bool | None = None,
) -> LoadReport:
    """Stream a released or floating-point checkpoint into `model`'s parameters and buffers in place.

    Every name, shape and dtype is checked before any data is read. Tensors are then decoded shard by
    shard, in row blocks, straight into the target's dtype and device, so memory beyond the model stays
    at a few row blocks. The model may be built on the meta device and `to_empty`'d first. `mtp.*`
    (DSpark draft stages) load into the model's stages, or are skipped by a model built without them; with
    strict=False missing/unexpected tensors are only reported.
    `dequantize_base_checkpoint=False` keeps the stored formats: FP8/FP4 codes and their scales are copied, row
    block by row block, into the kept modules that `kept.keep_release_formats` put in the meta-device model
    (a floating-point target of a quantized tensor is refused, except the Engram parts `kept.held_dequantized`
    names); an Engram table held in the stored format gets its codes and scales copied in block by block, and an
    Engram module of another kind with `load_kept_table` receives them whole, as stored.
    `check_finite` (default: on, or `DEEPSEEK_V41_CHECK_FINITE`) checks every decoded block finite (kept codes:
    no NaN FP8 code, no NaN UE8M0 scale); `verify_checksums` (default: on, or `DEEPSEEK_V41_VERIFY_CHECKSUMS`)
    compares each shard with the checksum its index records (exports of ours), before the first tensor is read.
    `path` may be an opened `ReleasedCheckpoint` (its own check/verify settings then apply).
    """
    checkpoint = path if isinstance(path, ReleasedCheckpoint) else ReleasedCheckpoint(
        path, check_finite=check_finite, verify_checksums=verify_checksums)
    dequantize = dequantize_base_checkpoint or not checkpoint.is_quantized
    targets, plan, report = _plan(model, checkpoint, strict, dequantize)
    for assignment in plan:
        if not assignment.table and targets[assignment.target_name].is_meta:
            raise CheckpointError(f"model parameter {assignment.target_name!r} is on the meta device: call "
                                  "model.to_empty(device=...) before loading the checkpoint")
    by_file = defaultdict(list)
    for assignment in plan:
        by_file[checkpoint.tensors[assignment.released].record.file].append(assignment)
    total = sum(_stored_bytes(checkpoint.tensors[a.released]) for a in plan)
    with progress_bar(total, "Loading checkpoint shards") as bar:
        for number, file in enumerate(sorted(by_file), start=1):
            bar.set_postfix_str(f"shard {number}/{len(by_file)}")
            for assignment in by_file[file]:
                stored = checkpoint.tensors[assignment.released]
                if assignment.table:
                    engram = model.get_submodule(assignment.target_name)
                    table = getattr(engram, "embed", None)
                    if _table_held_as_stored(table, stored):  # streamed into its buffers block by block
                        checkpoint.copy_stored(assignment.released, table.weight, table.scale)
                    else:  # an Engram of another kind takes the table whole, as stored
                        codes, scale = checkpoint.read_stored(assignment.released)
                        engram.load_kept_table(codes, scale)
                elif assignment.kept:
                    target = targets[assignment.target_name]
                    scale = targets[scale_name(assignment.target_name)]
                    if assignment.expert is not None:
                        target, scale = target[assignment.expert], scale[assignment.expert]
                    checkpoint.copy_stored(assignment.released, target, scale)
                else:
                    target = targets[assignment.target_name]
                    view = target[assignment.expert] if assignment.expert is not None else target
                    _load_one(checkpoint, assignment.released, view)
                report.loaded.append(assignment.released)
                bar.update(_stored_bytes(stored))
    return report


def _table_held_as_stored(table, stored: StoredTensor) -> bool:
    # an Engram table already allocated in the stored format (keep_release_formats, then to_empty; on the GPU or in
    # host memory), with the stored scale dtype: the loader copies codes and scales into it like any kept tensor
    return (getattr(table, "kept", False) and not table.weight.is_meta
            and tuple(table.weight.shape) == tuple(stored.shape)
            and table.scale.dtype == SAFETENSORS_DTYPES[stored.scale.dtype])


def _stored_bytes(stored: StoredTensor) -> int:
    return stored.record.nbytes + (stored.scale.nbytes if stored.scale is not None else 0)


def _load_one(checkpoint: ReleasedCheckpoint, name: str, target: torch.Tensor) -> None:
    # decode `name` in row blocks straight into the target's dtype and device
    rows = local_row_range(target)
    direct = not _is_dtensor(target) and target.is_contiguous()
    for block in checkpoint.row_slices(name, target.element_size(), rows):
        if direct:  # plain tensors: decode into the parameter's own memory
            checkpoint.decode(name, block, out=target[block] if target.dim() else target)
        else:
            decoded = checkpoint.decode(name, block, dtype=target.dtype, device=target.device)
            copy_rows_into(target, block.start, decoded)


# ----------------------------------------------------------------------------------------------------
# Writing safetensors (the export itself is hf_export.py)
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowBlocks:
    """A tensor produced on demand as consecutive row blocks (for writing tensors larger than memory)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_TORCH_TO_SAFETENSORS = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def _as_row_blocks(value: torch.Tensor | RowBlocks) -> RowBlocks:
    if isinstance(value, RowBlocks):
        return value
    tensor = value.detach()
    return RowBlocks(tuple(tensor.shape), tensor.dtype, lambda: (tensor,))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor | RowBlocks]) -> str:
    """Write a safetensors file, streaming `RowBlocks` so no tensor needs to be whole in memory -> the file's
    checksum (`deepseek_v41.checksums`), computed from the bytes as they are written."""
    entries = {name: _as_row_blocks(value) for name, value in tensors.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry in entries.items():
        if entry.dtype not in _TORCH_TO_SAFETENSORS:
            raise TypeError(f"tensor {name!r}: dtype {entry.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _TORCH_TO_SAFETENSORS[entry.dtype], "shape": list(entry.shape),
                        "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with HashingStream(open(path, "wb")) as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for name, entry in entries.items():
            written = 0
            for block in entry.blocks():
                data = block.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                handle.write(memoryview(data.numpy()))
                written += data.numel()
                del block, data  # not held while the next block is produced
            if written != entry.nbytes:
                raise ValueError(f"tensor {name!r}: its row blocks hold {written} bytes, its shape {entry.nbytes}")
    return handle.checksum()
