"""Training checkpoints: save every ``checkpoint.save_every_steps`` updates, resume bit-identically.

Per-rank files, not ``torch.distributed.checkpoint``: a rank's state mixes FSDP2 ``DTensor`` shards with
plain tensors that hold *different* rows under the same name on every rank (EP-local experts, row-owner
Engram blocks), and ``RemainderAdamW`` keeps int16 remainders that ``Optimizer.load_state_dict`` would
cast to the parameter dtype.  Each rank therefore saves exactly the local tensors it trains with, and a
checkpoint can only be resumed with the same layout (world size, EP size, Engram owners).

Layout of ``<checkpoint.dir>/step_{step:08d}/``:

* ``rank{r}-of{W}.pt``: this rank's parameter/buffer shards (by ``state_dict`` name), its optimizer state
  (by parameter name: ``step``, ``exp_avg``, ``exp_avg_sq`` and the int16 ``remainder``), its RNG states;
* ``meta.json``: step, world size, EP size, Engram owners and the recipe hash; written last.

Every rank writes into ``step_{step:08d}.tmp``; after a barrier rank 0 writes ``meta.json`` and renames the
folder into place, so a crash mid-save never leaves a folder that ``resume_from: latest`` would pick.
The learning rate and the data position are functions of the step (``lr_at``, ``UpdateSampler``), so
the step alone restores them.
"""

import hashlib
import json
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from deepseek_v41.training.optim import RemainderAdamW, _local
from deepseek_v41.training.recipe import RecipeError

META = "meta.json"
FORMAT = 1


def checkpoint_root(recipe: dict) -> Path:
    """``checkpoint.dir``, by default ``<output_dir>/checkpoints``."""
    return Path(recipe["checkpoint"]["dir"] or Path(recipe["output_dir"]) / "checkpoints")


def step_folder(root, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def rank_file(folder, rank: int, world: int) -> Path:
    return Path(folder) / f"rank{rank}-of{world}.pt"


def layout_of(recipe: dict, world: int) -> dict:
    """What a checkpoint's per-rank files depend on: the rank layout and the recipe hash."""
    config = {k: v for k, v in recipe["model"]["config"].items()
              if k not in ("pretrained_model_name_or_path", "name_or_path")}
    opt = recipe["optimizer"]
    shaping = {
        "model.config": config,
        "model.lm_head_precision": recipe["model"]["lm_head_precision"],
        "fsdp.param_dtype": recipe["fsdp"]["param_dtype"],
        "optimizer": [opt["impl"], opt["exp_avg_dtype"], opt["exp_avg_sq_dtype"]],
    }
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "world_size": world,
        "ep_size": recipe["distributed"]["ep_size"],
        "engram_owners": recipe["distributed"]["engram_owners"] or world,
        "recipe_hash": digest,
    }


def latest_checkpoint(root) -> Path | None:
    """The complete ``step_*`` folder (one with ``meta.json``) of the highest step under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / META).is_file()]
    return max(done, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def resolve_resume(recipe: dict) -> Path | None:
    """``checkpoint.resume_from`` -> the folder to resume from (None: start from the base checkpoint)."""
    resume = recipe["checkpoint"]["resume_from"]
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(checkpoint_root(recipe))
    folder = Path(resume)
    if not folder.is_dir():
        raise RecipeError(f"checkpoint.resume_from={resume!r} is not a folder; give a step_* folder or 'latest'")
    return folder


def verify_checkpoint(folder, layout: dict) -> dict:
    """Refuse an incomplete checkpoint or one saved with another layout; returns its ``meta.json``."""
    folder = Path(folder)
    if not (folder / META).is_file():
        raise RecipeError(f"{folder} has no {META}: the save did not finish; resume from an earlier step_* folder")
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise RecipeError(f"{folder} has checkpoint format {meta.get('format')}, this trainer reads {FORMAT}")
    different = [f"{key} {meta.get(key)} (now {value})" for key, value in layout.items() if meta.get(key) != value]
    if different:
        raise RecipeError(
            f"{folder} was saved with a different layout: {', '.join(different)}. Per-rank checkpoints resume "
            "only with the same world size, distributed.ep_size, distributed.engram_owners and model/optimizer "
            "recipe; relaunch with those, or start from the base checkpoint (checkpoint.resume_from: null)"
        )
    missing = [rank_file(folder, r, meta["world_size"]).name for r in range(meta["world_size"])
               if not rank_file(folder, r, meta["world_size"]).is_file()]
    if missing:
        raise RecipeError(f"{folder} is incomplete: {', '.join(missing)} missing; resume from another step_* folder")
    return meta


def _rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _optimizer_state(optimizer, names: dict) -> dict:
    if not isinstance(optimizer, RemainderAdamW):
        return {"state_dict": optimizer.state_dict()}  # e.g. TE FusedAdam: its own (de)serialization
    return {"by_name": {names[p]: {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                                   for k, v in state.items()}
                        for p, state in optimizer.state.items() if state}}


def _load_optimizer_state(optimizer, saved: dict, params: dict, where: Path) -> None:
    if "state_dict" in saved:
        optimizer.load_state_dict(saved["state_dict"])
        return
    for name, state in saved["by_name"].items():
        if name not in params:
            raise RecipeError(f"{where}: optimizer state for {name!r}, which this model does not train")
        p = params[name]
        local = _local(p)
        restored = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                if tuple(value.shape) != tuple(local.shape):
                    raise RecipeError(f"{where}: optimizer {key} of {name} has shape {list(value.shape)}, "
                                      f"the local shard has {list(local.shape)}")
                value = value.to(local.device)  # dtype kept: bf16 moments, int16 remainders
            restored[key] = value
        optimizer.state[p] = restored


@torch.no_grad()
def save_checkpoint(trainer, step: int) -> Path:
    """Collective: every rank writes its file, rank 0 finalizes; returns the step folder."""
    root = checkpoint_root(trainer.recipe)
    final = step_folder(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if trainer.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save
        tmp.mkdir(parents=True)
    dist.barrier()
    names = {p: n for n, p in trainer.model.named_parameters()}
    payload = {
        "step": step,
        "rank": trainer.rank,
        "world_size": trainer.world,
        "model": {n: _local(t.detach()).to("cpu", copy=True)
                  for n, t in trainer.model.state_dict(keep_vars=True).items()},
        "optimizer": _optimizer_state(trainer.optimizer, names),
        "rng": _rng_state(trainer.device),
    }
    torch.save(payload, rank_file(tmp, trainer.rank, trainer.world))
    dist.barrier()
    if trainer.rank == 0:
        meta = {"format": FORMAT, "step": step, **layout_of(trainer.recipe, trainer.world)}
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        if final.exists():  # saved again (a rerun into the same folder): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        print(f"[finetune] step {step}: checkpoint saved to {final}", flush=True)
    dist.barrier()
    return final


@torch.no_grad()
def load_checkpoint(trainer, folder) -> int:
    """Restore this rank's shards, optimizer state and RNG from ``folder``; returns the step reached there."""
    folder = Path(folder)
    meta = verify_checkpoint(folder, layout_of(trainer.recipe, trainer.world))
    path = rank_file(folder, trainer.rank, trainer.world)
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload["rank"] != trainer.rank or payload["step"] != meta["step"]:
        raise RecipeError(f"{path} holds rank {payload['rank']} step {payload['step']}, expected rank "
                          f"{trainer.rank} step {meta['step']}: the folder mixes two saves")
    targets = trainer.model.state_dict(keep_vars=True)
    if set(targets) != set(payload["model"]):
        extra, missing = set(payload["model"]) - set(targets), set(targets) - set(payload["model"])
        raise RecipeError(f"{path} does not match the model: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
    for name, target in targets.items():
        local, saved = _local(target.detach()), payload["model"][name]
        if tuple(local.shape) != tuple(saved.shape) or local.dtype != saved.dtype:
            raise RecipeError(f"{path}: {name} is {saved.dtype} {list(saved.shape)}, the model's local shard is "
                              f"{local.dtype} {list(local.shape)}")
        local.copy_(saved)
    params = {n: p for n, p in trainer.model.named_parameters()}
    _load_optimizer_state(trainer.optimizer, payload["optimizer"], params, path)
    _set_rng_state(payload["rng"], trainer.device)
    dist.barrier()
    return meta["step"]
