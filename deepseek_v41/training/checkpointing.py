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
what a resume must not change, the data position, and every file's size).  A save is written into
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
"""

import base64
import dataclasses
import enum
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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor, Shard

from deepseek_v41.hf_export import fsync_path
from deepseek_v41.training.engram_owner import engram_modules
from deepseek_v41.training.expert_parallel import global_expert_view, routed_expert_modules
from deepseek_v41.training.optim import RemainderAdamW, _local
from deepseek_v41.training.recipe import RecipeError

META = "meta.json"
FORMAT = 2
STEP_NAME = re.compile(r"step_(\d{8})")
ZIP_MAGIC = b"PK\x03\x04"  # every DCP tensor item is one torch.save zip record


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
    """A complete, intact checkpoint folder -> its ``meta.json``; otherwise ``RecipeError`` saying what is wrong."""
    folder = Path(folder)
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


def latest_checkpoint(root, log=print) -> Path | None:
    """The verified ``step_XXXXXXXX`` folder of the highest step under ``root`` (others skipped, named), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = []
    for path in sorted(root.glob("step_*")):
        if not path.is_dir() or path.name.endswith(".tmp"):
            continue
        match = STEP_NAME.fullmatch(path.name)
        if match is None:
            log(f"[finetune] resume_from=latest: skipping {path}: not a step_XXXXXXXX folder (a copy?)")
            continue
        candidates.append((int(match.group(1)), path))
    for _, path in sorted(candidates, reverse=True):
        try:
            verify_folder(path)
            return path
        except RecipeError as err:
            log(f"[finetune] resume_from=latest: skipping {path}: {err}")
    return None


def resolve_resume(recipe: dict, log=print) -> tuple:
    """``checkpoint.resume_from`` -> (folder, its meta.json), or (None, None) to start from the base checkpoint."""
    resume = recipe["checkpoint"]["resume_from"]
    if resume is None:
        return None, None
    if resume == "latest":
        folder = latest_checkpoint(checkpoint_root(recipe), log)
    else:
        folder = Path(resume)
        if not folder.is_dir():
            raise RecipeError(f"checkpoint.resume_from={resume!r} is not a folder; give a step_* folder or 'latest'")
    if folder is None:
        return None, None
    try:
        meta = verify_folder(folder)
    except RecipeError as err:
        raise RecipeError(f"checkpoint.resume_from={resume!r}: {err}. Resume from another step_* folder, or "
                          "use checkpoint.resume_from=latest (the newest intact one)") from None
    check_identity(folder, meta, recipe)
    return folder, meta


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


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
        _write_synced(tmp / "rng" / f"rank{t.rank}.json", json.dumps(_rng_state(t.device)))
        meta = {"format": FORMAT, "step": step, "world_size": t.world,
                "ep_size": t.recipe["distributed"]["ep_size"], "engram_owners": t.world,
                "identity": recipe_identity(t.recipe),
                "data": {"next_update": step, "examples": len(t.train_set),
                         "epoch": step // t.sampler.updates_per_epoch}}
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        state = training_state(t)
        state["step"] = torch.tensor(step)
        if self.async_save:
            written = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            self.pending = self.worker.submit(self._commit_after, written, tmp, final, meta)
        else:
            dcp.save(state, storage_writer=writer)
            if t.rank == 0:
                self.commit(tmp, final, meta)

    def _commit_after(self, written, tmp, final, meta) -> None:
        written.result()  # rank 0's write returns once every rank's files and .metadata are written
        if self.trainer.rank == 0:
            self.commit(tmp, final, meta)

    def commit(self, tmp: Path, final: Path, meta: dict) -> None:
        """Rank 0, after every rank's files are written: meta.json, fsync, atomic rename, prune."""
        meta["files"] = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
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
    def load(self, folder, meta: dict) -> int:
        """Restore model, optimizer state, RNG; reshards from the saved layout.  Returns the saved step."""
        t = self.trainer
        folder = Path(folder)
        if meta["data"]["examples"] != len(t.train_set):
            raise RecipeError(f"{folder} was saved with {meta['data']['examples']} training examples, this run has "
                              f"{len(t.train_set)}: the data changed; restore it or start with resume_from: null")
        keys = set(read_dcp_metadata(folder).state_dict_metadata)
        state = training_state(t, optimizer_keys=keys)
        state["step"] = torch.tensor(0)
        missing = sorted(k for k in state if k not in keys)
        extra = sorted(k for k in keys if k.startswith("model.") and k not in state)
        if missing or extra:
            raise RecipeError(f"{folder} does not match this model: missing {missing[:3]}, unexpected {extra[:3]}")
        dcp.load(state, storage_reader=SafeReader(folder))
        for name, p in t.model.named_parameters():
            if p in t.optimizer.state and "step" in t.optimizer.state[p]:
                t.optimizer.state[p]["step"] = int(state[f"optim.{name}.step"])
        rng = folder / "rng" / f"rank{t.rank % meta['world_size']}.json"
        _set_rng_state(json.loads(rng.read_text()), t.device)
        if int(state["step"]) != meta["step"]:
            raise RecipeError(f"{folder} holds step {int(state['step'])} but {META} says {meta['step']}")
        return meta["step"]
