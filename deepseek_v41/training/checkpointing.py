"""Training checkpoints through ``torch.distributed.checkpoint`` (DCP): streamed, resharded on load, atomic.

Every tensor is saved with its *global* placement, so DCP records each rank's chunk with global offsets and
a checkpoint saved at one layout (world size, EP size, Engram owners) loads at another:

* FSDP2 parameters are ``DTensor`` s already;
* routed experts (``[E_local, ...]`` per EP rank, ``[E_local / ep_shard, ...]`` at rest when FSDP2 shards the
  block over ``ep_shard``) become ``DTensor`` views on the ``("ep", "ep_shard")`` mesh
  (``expert_parallel.global_expert_view``), ``[Shard(0), Shard(0)]``, global shape ``[E, ...]``: the same
  global tensor at every EP size and ``ep_shard``;
* an Engram table's row block (``engram_owner.shard_engram_table``: ``ceil(rows / W)`` rows, zero-padded on
  the last owner) becomes a ``Shard(0)`` view of its unpadded rows, global shape ``[rows, dim]`` (DTensor's
  chunking is the same ceil split);
* ``RemainderAdamW`` state (``exp_avg``, ``exp_avg_sq`` and the int16 ``remainder``: bf16 param + remainder =
  the exact fp32 master) takes its parameter's placement and is keyed by parameter name, ``step`` is a
  scalar tensor; replicated tensors (``attn_sink``, buffers) are written once.

Layout of ``<checkpoint.dir>/step_{step:08d}/``: DCP's ``.metadata`` and ``__{rank}_*.distcp`` files,
``rng/rank{r}.json`` (Python and torch RNG states, JSON) and ``meta.json`` (step, the layout it was saved at,
what a resume must not change, the data position, every file's size and checksum).  Checksums
(``deepseek_v41.checksums``: XXH3-64) are computed from the bytes as each file is written (no second read):
every rank writes its files' checksums to ``checksums/rank{r}.json`` before DCP's commit collective, and rank 0
merges them (and ``.metadata``'s) into ``meta.json``.  A resume verifies them, each rank reading its share of
the files on helper threads while DCP loads (the reads overlap the load rather than adding a pass before it): a
file whose bytes changed without changing size (zeroed blocks, flipped bits) fails, named, on every rank once
the load is done, and ``resume_from: latest`` falls back to the previous step whose checksums all match,
loaded in full again (``checkpoint.verify_checksums: false`` skips the reads).  A save is written into
``step_{step:08d}.tmp``; once every rank's files are written and fsynced (DCP ``sync_files``), rank 0 writes
``meta.json``, fsyncs it and the folder, and renames the folder into place.  A crash or ``kill -9`` before
that rename leaves only a ``.tmp`` folder, which ``resume_from: latest`` never picks.  ``latest`` also skips
(with a message naming the folder) any ``step_*`` folder that fails ``verify_folder``: missing or unreadable
``meta.json``, a file missing or of another size than recorded, a DCP item that is not a serialized tensor
(zero-filled), or a name that is not exactly ``step_XXXXXXXX`` (a copied ``step_00000001_backup``).

Loading never unpickles arbitrary objects: DCP's ``.metadata`` pickle is read with an allow-list of DCP's own
metadata classes, tensors with ``weights_only=True`` (DCP's reader), everything else is JSON.
``checkpoint.async_save`` stages this rank's shards in host memory and writes them in a background thread
(its own gloo group) while training continues; a synchronous save streams from the live tensors.
``checkpoint.keep_last`` prunes older complete steps after each commit.

Failures say what happened: a full disk during a save names the folder, the bytes the step needs and the bytes
free, and removes the partial ``.tmp`` folder; a step folder that vanishes between its checks and its load
makes ``latest`` fall back to the previous intact step (an explicit ``resume_from`` names the folder).
"""

import base64
import dataclasses
import enum
import errno
import hashlib
import importlib
import io
import json
import os
import pathlib
import pickle
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor, Shard

from deepseek_v41.checksums import HashingStream, checksum_of_bytes, file_matches
from deepseek_v41.hf_export import fsync_path
from deepseek_v41.training.engram_owner import engram_modules
from deepseek_v41.training.expert_parallel import global_expert_view, routed_expert_modules
from deepseek_v41.training.optim import RemainderAdamW, _local
from deepseek_v41.training.recipe import RecipeError

META = "meta.json"
FORMAT = 2
STEP_NAME = re.compile(r"step_(\d{8})")
ZIP_MAGIC = b"PK\x03\x04"  # every DCP tensor item is one torch.save zip record
CHECKSUMS = "checksums"  # per-rank checksum files of a save in progress, merged into meta.json at the commit
VERIFY_THREADS = 4  # files one rank hashes at once when verifying (reads overlap on network filesystems)


def checkpoint_root(recipe: dict) -> Path:
    """``checkpoint.dir``, by default ``<output_dir>/checkpoints``."""
    return Path(recipe["checkpoint"]["dir"] or Path(recipe["output_dir"]) / "checkpoints")


def step_folder(root, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


# ---- what a resume must keep ------------------------------------------------------------------------


def recipe_identity(recipe: dict) -> dict:
    """The recipe parts a resumed run must share with the saved one (the layout may change: DCP reshards)."""
    config = {k: v for k, v in recipe["model"]["config"].items()
              if k not in ("pretrained_model_name_or_path", "name_or_path")}
    opt, ds = recipe["optimizer"], recipe["dataset"]
    model = {"config": config, "lm_head_precision": recipe["model"]["lm_head_precision"],
             "param_dtype": recipe["fsdp"]["param_dtype"],
             "optimizer state": [opt["exp_avg_dtype"], opt["exp_avg_sq_dtype"]]}
    return {
        "model": hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "seed": recipe["seed"],
        "data": {k: ds[k] for k in ("path_or_dataset", "split", "num_samples_limit", "max_length", "shuffle")}
                | {"global_batch_size": recipe["step_scheduler"]["global_batch_size"]},
    }


def check_identity(folder, meta: dict, recipe: dict) -> None:
    """Refuse a resume whose model, seed or data differ from the saved run's: its updates would be meaningless."""
    now = recipe_identity(recipe)
    changed = [f"{key} {meta['identity'].get(key)!r} (now {value!r})" if key != "model"
               else "the model config / head precision / param or optimizer-state dtypes"
               for key, value in now.items() if meta["identity"].get(key) != value]
    if changed:
        raise RecipeError(
            f"{folder} was saved by a different recipe: {'; '.join(changed)}. A resume needs the same model, "
            "seed and training data (world size, distributed.ep_size and engram_owners may change); restore "
            "those settings, or start a new run with checkpoint.resume_from: null"
        )


# ---- verification --------------------------------------------------------------------------------


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
# the path classes pickle from ``pathlib`` up to Python 3.12 and from ``pathlib._local`` from 3.13 on; both
# names resolve to this interpreter's ``pathlib`` class, so a checkpoint saved on 3.13 resumes on 3.12 too
_PATH_MODULES = ("pathlib", "pathlib._local")
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")


def _dcp_class(module: str, name: str):
    """One of DCP's own metadata dataclasses or enums (``Metadata``, ``_StorageInfo``, ``_MEM_FORMAT_ENCODING``,
    ...), looked up by its plain name, else ``None``.  A dotted name would walk the module's imports (``os``,
    ``torch``) under protocol 4, so it never matches."""
    if module not in _DCP_MODULES or "." in name or name.startswith("__"):
        return None
    cls = getattr(importlib.import_module(module), name, None)
    if isinstance(cls, type) and cls.__module__ == module and (
            dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        return cls
    return None


def _enum_member(cls, name):
    """Stands in for ``builtins.getattr``: early Python 3.11 releases (Debian 12's 3.11.2) pickle an enum member
    as ``getattr(EnumClass, "NAME")``; 3.10, later 3.11 (3.11.7) and 3.12+ write ``EnumClass(value)``.  Only
    a DCP enum and one of its member names pass."""
    if (isinstance(cls, enum.EnumMeta) and _dcp_class(cls.__module__, cls.__name__) is cls
            and isinstance(name, str) and name in cls.__members__):
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not part of DCP's metadata: only a member of "
                                 "DCP's own enums may be looked up by name")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: allow only DCP's metadata dataclasses and enums (members by value or
    by name), torch dtypes/sizes/layouts, paths and ``OrderedDict``."""

    ALLOWED = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")})

    def find_class(self, module, name):
        cls = _dcp_class(module, name)
        if cls is not None:
            return cls
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module in _PATH_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_dcp_metadata(folder) -> Metadata:
    path = Path(folder) / ".metadata"
    return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata comes through the allow-list unpickler (tensors: weights_only)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def verify_folder(folder) -> dict:
    """A complete, intact checkpoint folder -> its ``meta.json``; otherwise ``RecipeError`` saying what is wrong.

    Sizes, DCP's metadata and each tensor record's start are checked here; checksums (a read of every file)
    by ``verify_checksums``."""
    folder = Path(folder)
    try:
        return _verify_folder(folder)
    except OSError as err:  # the folder or a file vanished (or became unreadable) while it was checked
        raise RecipeError(f"{folder} could not be read while it was checked ({err}): the folder was removed or "
                          "changed meanwhile") from None


def _verify_folder(folder: Path) -> dict:
    meta_path = folder / META
    if not meta_path.is_file():
        raise RecipeError(f"{folder} has no committed {META}: the save did not finish")
    try:
        meta = json.loads(meta_path.read_text())
        files, step = meta["files"], meta["step"]
    except (ValueError, KeyError, TypeError) as err:
        raise RecipeError(f"{meta_path} is unreadable ({err}): the save did not finish or the file was damaged")
    if meta.get("format") != FORMAT:
        raise RecipeError(f"{folder} has checkpoint format {meta.get('format')}, this trainer reads {FORMAT}")
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            raise RecipeError(f"{path} is missing (recorded in {META})")
        if path.stat().st_size != size:
            raise RecipeError(f"{path} is {path.stat().st_size} bytes, {META} recorded {size}: truncated or replaced")
    try:
        storage = read_dcp_metadata(folder).storage_data
    except Exception as err:
        raise RecipeError(f"{folder / '.metadata'} is unreadable: {err}") from None
    handles = {}
    try:
        for info in storage.values():
            f = handles.get(info.relative_path) or handles.setdefault(
                info.relative_path, open(folder / info.relative_path, "rb"))
            f.seek(info.offset)
            if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                raise RecipeError(f"{folder / info.relative_path} holds no tensor at byte {info.offset}: "
                                  "the file is damaged (zero-filled or overwritten)")
    finally:
        for f in handles.values():
            f.close()
    match = STEP_NAME.fullmatch(folder.name)
    if match and int(match.group(1)) != step:
        raise RecipeError(f"{folder} records step {step} in {META}, not the step its name says")
    return meta


def checksum_share(meta: dict, rank: int, world: int) -> list:
    """The files (names in ``meta.json``) whose checksums ``rank`` of ``world`` verifies: the largest first,
    each to the rank with the fewest bytes so far, so every rank reads about the same amount."""
    sizes = meta.get("files", {})
    load, share = [0] * world, [[] for _ in range(world)]
    for name in sorted(meta.get("checksums", {}), key=lambda n: (-sizes.get(n, 0), n)):
        r = min(range(world), key=lambda i: (load[i], i))
        share[r].append(name)
        load[r] += sizes.get(name, 0)
    return share[rank]


def verify_checksums(folder, meta: dict, rank: int = 0, world: int = 1) -> list:
    """Read this rank's share of the folder's files and compare their checksums with ``meta.json``'s.

    -> a problem per file that differs (empty when all match, or when the save recorded no checksums)."""
    folder, recorded = Path(folder), meta.get("checksums", {})
    names = checksum_share(meta, rank, world)

    def check(name):
        path = folder / name
        try:
            ok, actual = file_matches(path, recorded[name])
        except OSError as err:
            return f"{path} could not be read ({err})"
        if ok:
            return None
        return (f"{path} has checksum {actual} but {META} recorded {recorded[name]}: its bytes changed after "
                "the save (same size, other content: a damaged disk, copy or transfer)")

    with ThreadPoolExecutor(max_workers=max(1, min(VERIFY_THREADS, len(names)))) as pool:
        return [problem for problem in pool.map(check, names) if problem]


def _ranks() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(problems: list) -> list:
    """Every rank's problems, on every rank (one all-gather), so that all ranks take the same decision."""
    world = _ranks()[1]
    if world == 1:
        return list(problems)
    gathered = [None] * world
    dist.all_gather_object(gathered, list(problems))
    return [p for rank_problems in gathered for p in rank_problems]


def check_step_folder(folder, verify: bool = True) -> dict:
    """Collective when a process group is up: ``verify_folder`` on every rank, then (``verify``) each rank checks
    its share of the checksums; any rank's problem fails the folder on every rank (``RecipeError``)."""
    folder = Path(folder)
    meta, problems = None, []
    try:
        meta = verify_folder(folder)
    except RecipeError as err:
        problems = [str(err)]
    problems = _agree(problems)
    if problems:
        raise RecipeError(problems[0])
    if verify:
        problems = _agree(verify_checksums(folder, meta, *_ranks()))
        if problems:
            more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
            raise RecipeError(problems[0] + more)
    return meta


def _shared_listing(root: Path) -> list:
    # rank 0's view of the step folders, so every rank walks the same candidates (collective checks follow)
    names = sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
    if _ranks()[1] > 1:
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    return names


def latest_checkpoint(root, log=print, verify: bool = True) -> Path | None:
    """The intact ``step_XXXXXXXX`` folder of the highest step under ``root`` (others skipped, named), or None.

    ``verify``: also compare every file's checksum (the ranks share the reads).  Collective when a process
    group is up: every rank must call it."""
    root = Path(root)
    candidates = []
    for name in _shared_listing(root):
        path = root / name
        if name.endswith((".tmp", ".replaced")):  # an unfinished save, or a step being saved again
            continue
        match = STEP_NAME.fullmatch(name)
        if match is None:
            log(f"[finetune] resume_from=latest: skipping {path}: not a step_XXXXXXXX folder (a copy?)")
            continue
        candidates.append((int(match.group(1)), path))
    for _, path in sorted(candidates, reverse=True):
        try:
            check_step_folder(path, verify)
            return path
        except RecipeError as err:
            log(f"[finetune] resume_from=latest: skipping {path}: {err}")
    return None


def resolve_resume(recipe: dict, log=print, defer_checksums: bool = False) -> tuple:
    """``checkpoint.resume_from`` -> (folder, its meta.json), or (None, None) to start from the base checkpoint.

    ``defer_checksums``: check sizes and metadata now and leave the checksums to the load (``Checkpointer.load``
    with ``verify=True`` compares them while it reads); otherwise every file is read and compared now.
    Collective when a process group is up (the ranks share the checksum reads and agree on the folder)."""
    resume = recipe["checkpoint"]["resume_from"]
    verify = recipe["checkpoint"].get("verify_checksums", True)
    check_now = verify and not defer_checksums
    if resume is None:
        return None, None
    if resume == "latest":
        folder = latest_checkpoint(checkpoint_root(recipe), log, check_now)
    else:
        folder = Path(resume)
        if not folder.is_dir():
            raise RecipeError(f"checkpoint.resume_from={resume!r} is not a folder; give a step_* folder or 'latest'")
    if folder is None:
        return None, None
    try:
        meta = check_step_folder(folder, check_now and resume != "latest")  # latest: checked just now
    except RecipeError as err:
        raise RecipeError(f"checkpoint.resume_from={resume!r}: {err}. Resume from another step_* folder, or "
                          "use checkpoint.resume_from=latest (the newest intact one)") from None
    if not verify:
        log(f"[finetune] checkpoint.verify_checksums=false: {folder}'s files are checked by size only")
    elif "checksums" not in meta:
        log(f"[finetune] {folder} records no checksums (saved by an older version): checked by size only")
    check_identity(folder, meta, recipe)
    return folder, meta


class CheckpointUnusable(RecipeError):
    """The step folder being resumed from turned out unusable while it was loaded (``latest`` falls back)."""


class CheckpointVanished(CheckpointUnusable):
    """The step folder being resumed from (or a file of it) disappeared after it was checked."""


class CheckpointDamaged(CheckpointUnusable):
    """A file of the step folder being resumed from differs from its recorded checksum."""


def load_verified(state: dict, folder, meta: dict, verify: bool, **load_kwargs) -> None:
    """``dcp.load(state)`` from ``folder``; with ``verify`` this rank's share of the recorded checksums is compared
    on helper threads meanwhile (the file reads overlap the load).  Once the load is done every rank's findings
    are gathered (collective under a process group): ``CheckpointDamaged`` naming the first damaged file, else
    DCP's own failure, if the load failed."""
    folder = Path(folder)
    verifying = None
    if verify and meta.get("checksums"):  # the same decision on every rank: meta.json is shared
        helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        verifying = helper.submit(verify_checksums, folder, meta, *_ranks())
    failure = None
    try:
        dcp.load(state, storage_reader=SafeReader(folder), **load_kwargs)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised below unless damage explains it
        failure = err
    if verifying is not None:
        try:
            problems = verifying.result()
        except Exception as err:  # noqa: BLE001 - never leave the other ranks waiting in the all-gather
            problems = [f"{folder}: its checksums could not be compared ({type(err).__name__}: {err})"]
        helper.shutdown()
        problems = _agree(problems)
        if problems:
            more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
            raise CheckpointDamaged(f"{problems[0]}{more}; the state loaded from it is discarded") from None
    if failure is not None:
        raise failure


# ---- the state DCP sees ----------------------------------------------------------------------------


def _global_views(trainer) -> dict:
    """parameter -> function(local tensor shaped like its local shard) -> tensor with global placement."""
    views = {}
    for experts in routed_expert_modules(trainer.model):
        for p in experts.parameters():
            views[p] = lambda t, n=experts.n_experts: global_expert_view(trainer.expert_global_mesh, n, t)
    for engram in engram_modules(trainer.model):
        start, rows = engram.table_rows
        weight = engram.embed.weight
        shape = (rows, weight.shape[1])
        mine = max(0, min(rows - start, weight.shape[0]))  # the last owner's padding rows are not saved
        views[weight] = lambda t, shape=shape, mine=mine: DTensor.from_local(
            t[:mine], trainer.dp_mesh, [Shard(0)], run_check=False, shape=shape, stride=(shape[1], 1))
    return views


def _placed(p, views):
    """Like ``p``'s global placement, for a tensor shaped like ``p``'s local shard (optimizer state)."""
    if p in views:
        return views[p]
    if isinstance(p, DTensor):
        return lambda t: DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
    return lambda t: t


def training_state(trainer, optimizer_keys=None) -> dict:
    """{name: tensor} of model and optimizer state with global placements; views of the live tensors.

    ``optimizer_keys``: when loading, the checkpoint's ``optim.*`` names; parameters listed there get fresh
    optimizer state to load into (parameters not listed keep none, as before their first update).
    """
    if not isinstance(trainer.optimizer, RemainderAdamW):
        raise RecipeError(f"training checkpoints hold RemainderAdamW state; {type(trainer.optimizer).__name__} "
                          "is not supported: set optimizer.impl=torch_remainder")
    views = _global_views(trainer)
    state = {}
    for name, t in trainer.model.state_dict(keep_vars=True).items():
        state[f"model.{name}"] = views[t](_local(t.detach())) if t in views else t.detach()
    groups = {p: group for group in trainer.optimizer.param_groups for p in group["params"]}
    for name, p in trainer.model.named_parameters():
        if optimizer_keys is not None and f"optim.{name}.step" in optimizer_keys:
            if p not in groups:
                raise RecipeError(f"the checkpoint has optimizer state for {name}, which this run does not train")
            trainer.optimizer._state(p, _local(p), groups[p])
        saved = trainer.optimizer.state.get(p)
        if not saved:
            continue
        place = _placed(p, views)
        for key, value in saved.items():
            state[f"optim.{name}.{key}"] = torch.tensor(value) if key == "step" else place(value)
    return state


def _rng_state(device) -> dict:
    version, words, gauss = random.getstate()
    state = {"python": [version, list(words), gauss],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict, device) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8),
                                 device)


def _write_synced(path: Path, text: str) -> str:
    """Write ``text`` to ``path`` and fsync it -> the checksum of the bytes written."""
    data = text.encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return checksum_of_bytes(data)


class _HashingFileSystem(FileSystem):
    """DCP's file system, with every file written through a ``HashingStream``: its checksum is known when it is
    closed, from the bytes written (``checksums``: name relative to the step folder -> checksum)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.checksums = Path(folder), {}
        self.error = None  # the OSError a write, fsync or close raised (torch.save reports it as a RuntimeError)

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = None
        try:
            with super().create_stream(path, mode) as raw:
                stream = HashingStream(raw)
                yield stream
        except BaseException as err:
            found = stream.error if stream is not None and stream.error is not None else err
            if isinstance(found, OSError) and self.error is None:
                self.error = found if found.filename else OSError(found.errno, found.strerror, str(path))
            raise
        name = str(Path(path).relative_to(self.folder))
        # DCP writes .metadata as .metadata.tmp and renames it (rank 0, after every rank's data)
        self.checksums[name.removesuffix(".tmp") if name == ".metadata.tmp" else name] = stream.checksum()


class ChecksummedWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that hashes its files as it writes them and, once this rank's data is written (before
    DCP's commit collective, so before rank 0's commit), writes ``checksums/rank{r}.json``: the checksums of this
    rank's files plus ``extra`` (this rank's RNG file)."""

    def __init__(self, path, rank: int, extra: dict, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem(Path(path))
        self.checksum_rank, self.extra = rank, extra

    def _os_error(self, err: BaseException):
        # DCP sends every rank's failure to every rank by pickling it, which drops __context__: the OSError a
        # write raised (a full disk) is re-raised as itself, or torch.save's RuntimeError would hide it
        cause = self.fs.error
        if cause is None or isinstance(err, OSError):
            return err
        return OSError(cause.errno, f"{cause.strerror or cause} (writing {cause.filename})")

    def write_data(self, plan, planner):
        try:
            written = super().write_data(plan, planner)
            written.wait()  # FileSystemWriter writes synchronously; its future is already done
        except Exception as err:
            converted = self._os_error(err)
            if converted is err:
                raise
            raise converted from err
        own = {**self.extra, **self.fs.checksums}
        folder = Path(self.path) / CHECKSUMS
        folder.mkdir(exist_ok=True)
        _write_synced(folder / f"rank{self.checksum_rank}.json", json.dumps(own, sort_keys=True))
        return written

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as err:
            converted = self._os_error(err)
            if converted is err:
                raise
            raise converted from err


def _state_bytes(state: dict) -> int:
    # bytes of tensor data a save writes: every tensor once at its global size (DCP writes replicas once)
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def _error_chain(error: BaseException):
    """``error`` and everything it wraps: causes, contexts, and each rank's failure DCP gathers."""
    seen, todo = set(), [error]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        if isinstance(err, CheckpointException):
            todo.extend(failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values())
        todo.extend((err.__cause__, err.__context__))


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps: DCP gathers every rank's failure) is a full disk or quota."""
    return any(isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT) for err in _error_chain(error))


class CheckpointSaveError(OSError):
    """A save that failed for a reason the user can fix (a full disk); the message says what to do."""


def _vanished(error: BaseException) -> bool:
    """Whether ``error`` (or a rank's failure it wraps) is a file that no longer exists."""
    return any(isinstance(err, FileNotFoundError) or "No such file or directory" in str(err)
               for err in _error_chain(error))


# ---- save ----------------------------------------------------------------------------------------


class Checkpointer:
    """Saves (sync or async), commits, prunes and loads one run's training checkpoints."""

    def __init__(self, trainer):
        self.trainer = trainer
        cfg = trainer.recipe["checkpoint"]
        self.root = checkpoint_root(trainer.recipe)
        self.async_save, self.keep_last = cfg["async_save"], cfg["keep_last"]
        self.pending = None  # the async save in flight: its write, then (rank 0) its commit
        # Background saves run their collectives on their own group, never interleaved with training's,
        # and on one worker thread, so the commit of step N always precedes the write of step N + 1.
        self.group = dist.new_group(backend="gloo") if self.async_save else None
        self.worker = ThreadPoolExecutor(max_workers=1) if self.async_save else None

    def save(self, step: int) -> None:
        """Collective.  Returns once this step's write has started (async) or is committed (sync)."""
        t = self.trainer
        self.wait()
        final = step_folder(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if t.rank == 0:
            for stale in self.root.glob("step_*.tmp"):  # left by a crashed save
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        state = training_state(t)
        state["step"] = torch.tensor(step)
        needed = _state_bytes(state)
        with self._explained(tmp, step, needed):
            rng = f"rng/rank{t.rank}.json"
            extra = {rng: _write_synced(tmp / rng, json.dumps(_rng_state(t.device)))}
            meta = {"format": FORMAT, "step": step, "world_size": t.world,
                    "ep_size": t.recipe["distributed"]["ep_size"], "engram_owners": t.world,
                    "identity": recipe_identity(t.recipe),
                    "data": {"next_update": step, "examples": len(t.train_set),
                             "epoch": step // t.sampler.updates_per_epoch}}
            writer = ChecksummedWriter(tmp, t.rank, extra, sync_files=True)
            if self.async_save:
                written = dcp.async_save(state, storage_writer=writer, process_group=self.group)
                self.pending = self.worker.submit(self._commit_after, written, tmp, final, meta, writer, needed)
            else:
                dcp.save(state, storage_writer=writer)
                if t.rank == 0:
                    self.commit(tmp, final, meta, writer)

    @contextmanager
    def _explained(self, tmp: Path, step: int, needed: int):
        """A full disk (on any rank: DCP shares every rank's failure) -> ``CheckpointSaveError`` naming the folder,
        the bytes this step needs and the bytes free, with the partial ``.tmp`` folder removed."""
        try:
            yield
        except (Exception, CheckpointException) as err:
            if not _disk_full(err):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # every rank may: the folder is ours and unfinished
            try:
                free = shutil.disk_usage(self.root).free
            except OSError:
                free = None
            have = f"{free:,} bytes ({free / 2**30:.2f} GiB) are free there now" if free is not None else ""
            raise CheckpointSaveError(
                errno.ENOSPC,
                f"checkpoint of step {step}: the disk holding {self.root} is full (no space left while writing "
                f"{tmp}). This step needs about {needed:,} bytes ({needed / 2**30:.2f} GiB) of tensor data; {have}. "
                f"The partial folder {tmp} was removed. Free space, point checkpoint.dir at a larger disk, or keep "
                "fewer steps (checkpoint.keep_last)") from None

    def _commit_after(self, written, tmp, final, meta, writer, needed) -> None:
        with self._explained(tmp, meta["step"], needed):
            written.result()  # rank 0's write returns once every rank's files and .metadata are written
            if self.trainer.rank == 0:
                self.commit(tmp, final, meta, writer)

    def commit(self, tmp: Path, final: Path, meta: dict, writer=None) -> None:
        """Rank 0, after every rank's files are written: checksums and meta.json, fsync, atomic rename, prune."""
        if writer is not None:
            meta["checksums"] = self._merged_checksums(tmp, writer)
        meta["files"] = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        unchecked = sorted(set(meta["files"]) - set(meta.get("checksums", meta["files"])))
        if unchecked:  # every file of a step is checked on resume; one DCP wrote past our writer would not be
            raise RuntimeError(f"no checksum was recorded for {unchecked[:3]} in {tmp}: the save is incomplete")
        _write_synced(tmp / META, json.dumps(meta, indent=1) + "\n")
        fsync_path(tmp / "rng")
        fsync_path(tmp)
        if final.exists():  # saved again at this step (a rerun): move the old one aside first, never lose both
            old = final.with_name(final.name + ".replaced")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        fsync_path(final.parent)
        print(f"[finetune] step {meta['step']}: checkpoint saved to {final}", flush=True)
        self.prune(keep={final, self.trainer.resume_dir})

    def _merged_checksums(self, tmp: Path, writer) -> dict:
        """Every rank's ``checksums/rank{r}.json`` and rank 0's ``.metadata`` -> {file: checksum}; the per-rank
        files are removed (``meta.json`` holds their content)."""
        merged = {}
        folder = tmp / CHECKSUMS
        for rank in range(self.trainer.world):
            path = folder / f"rank{rank}.json"
            try:
                merged.update(json.loads(path.read_text()))
            except (OSError, ValueError) as err:
                raise RuntimeError(f"rank {rank}'s checksums {path} are unreadable ({err}): the save is incomplete")
        merged.update({k: v for k, v in writer.fs.checksums.items() if k == ".metadata"})
        shutil.rmtree(folder)
        return merged

    def prune(self, keep: set) -> None:
        """Delete complete step folders beyond the newest ``keep_last`` (never one in ``keep``)."""
        if not self.keep_last:
            return
        steps = sorted((p for p in self.root.iterdir() if STEP_NAME.fullmatch(p.name) and (p / META).is_file()),
                       key=lambda p: p.name, reverse=True)
        keep = {Path(p).resolve() for p in keep if p is not None}
        for old in steps[self.keep_last:]:
            if old.resolve() not in keep:
                shutil.rmtree(old)

    def wait(self) -> None:
        """Block until the async save in flight is written and committed; re-raise its failure."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
            dist.barrier()  # rank 0's commit is done before any rank starts the next save or exits

    # ---- load --------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, folder, meta: dict, verify: bool = False) -> int:
        """Restore model, optimizer state, RNG; reshards from the saved layout.  Returns the saved step.

        ``verify``: compare the files' checksums while loading (``load_verified``).  Collective.
        ``CheckpointVanished`` / ``CheckpointDamaged`` (on every rank) when the folder or a file of it is gone
        or changed: nothing after the tensors (optimizer steps, RNG) is restored then."""
        t = self.trainer
        folder = Path(folder)
        if meta["data"]["examples"] != len(t.train_set):
            raise RecipeError(f"{folder} was saved with {meta['data']['examples']} training examples, this run has "
                              f"{len(t.train_set)}: the data changed; restore it or start with resume_from: null")
        # Everything this rank reads outside DCP is read now, and the ranks agree it is there: a folder removed
        # since the checks at start-up fails on every rank at once, before any tensor is overwritten.
        problems, keys, rng = [], None, None
        try:
            if not (folder / META).is_file():
                raise FileNotFoundError(errno.ENOENT, "no such file", str(folder / META))
            keys = set(read_dcp_metadata(folder).state_dict_metadata)
            rng = json.loads((folder / "rng" / f"rank{t.rank % meta['world_size']}.json").read_text())
        except OSError as err:
            problems = [f"{err.filename or folder}: {err.strerror or err}"]
        problems = _agree(problems)
        if problems:
            raise CheckpointVanished(f"{folder} is gone or incomplete since it was checked at start-up "
                                     f"({problems[0]}): it was removed or replaced meanwhile")
        state = training_state(t, optimizer_keys=keys)
        state["step"] = torch.tensor(0)
        missing = sorted(k for k in state if k not in keys)
        extra = sorted(k for k in keys if k.startswith("model.") and k not in state)
        if missing or extra:
            raise RecipeError(f"{folder} does not match this model: missing {missing[:3]}, unexpected {extra[:3]}")
        try:
            load_verified(state, folder, meta, verify)
        except CheckpointDamaged:
            raise
        except (Exception, CheckpointException) as err:  # DCP raises every rank's failure on every rank
            if not _vanished(err):
                raise
            raise CheckpointVanished(f"{folder} lost files while it was being loaded ({_first_line(err)}): it was "
                                     "removed or replaced meanwhile; the model state is partly loaded") from None
        for name, p in t.model.named_parameters():
            if p in t.optimizer.state and "step" in t.optimizer.state[p]:
                t.optimizer.state[p]["step"] = int(state[f"optim.{name}.step"])
        _set_rng_state(rng, t.device)
        if int(state["step"]) != meta["step"]:
            raise RecipeError(f"{folder} holds step {int(state['step'])} but {META} says {meta['step']}")
        return meta["step"]


def _first_line(error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            return f"{type(exc).__name__}: {exc}"
    return f"{type(error).__name__}: {error}"
