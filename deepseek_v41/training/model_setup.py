"""The base checkpoint and the meta-device model the trainer shards.

``check_checkpoint`` resolves ``model.config.pretrained_model_name_or_path`` (optionally creating the tiny
CPU-demo checkpoint there with ``training/tiny_checkpoint.py``); ``build_meta_model`` builds
``DeepseekV41ForCausalLM`` on the meta device from the checkpoint's config plus the recipe's
``text_config`` / ``vision_config`` / ``backend`` overrides (unknown fields are errors with close matches).
"""

import difflib
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from deepseek_v41.backends import resolve_backend
from deepseek_v41.configuration_deepseek_v41 import DeepseekV41Config
from deepseek_v41.dspark import dspark_stage_count
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype
from deepseek_v41.training.recipe import RecipeError


def check_checkpoint(recipe: dict, rank: int, barrier: bool = True) -> Path:
    """The checkpoint folder; with ``model.make_tiny_checkpoint_if_missing`` rank 0 creates it first (the
    launcher calls this with ``barrier=False`` before any worker starts)."""
    path = Path(str(recipe["model"]["config"]["pretrained_model_name_or_path"])).expanduser()
    if not (path / "config.json").is_file() and recipe["model"]["make_tiny_checkpoint_if_missing"]:
        if rank == 0:
            make_tiny_checkpoint_at(path)
        if barrier:
            dist.barrier()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"checkpoint folder {path} does not exist or has no config.json; download DeepSeek-V4.1-Flash there "
            "(or export DS41_CHECKPOINT) and pass --model.config.pretrained_model_name_or_path=/path/to/checkpoint"
        )
    return path


def make_tiny_checkpoint_at(path: Path) -> None:
    """The CPU demo's tiny released-format checkpoint, written beside ``path`` and renamed into place when
    complete (an interrupted write is never taken for a checkpoint)."""
    from deepseek_v41.training.tiny_checkpoint import make_tiny_checkpoint

    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists but holds no config.json: it is not a checkpoint, and "
                              "model.make_tiny_checkpoint_if_missing writes only a new or empty folder; remove it "
                              "or point model.config.pretrained_model_name_or_path elsewhere")
    print(f"[finetune] creating the tiny checkpoint in {path}", flush=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        make_tiny_checkpoint(partial)
        try:
            if path.is_dir():
                path.rmdir()  # empty (checked above)
            partial.rename(path)
        except OSError:
            if not (path / "config.json").is_file():  # else another process finished the same checkpoint first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _apply_overrides(sub_config, overrides: dict, section: str) -> None:
    for key, value in overrides.items():
        if not hasattr(sub_config, key):
            known = [k for k in vars(sub_config) if not k.startswith("_")]
            close = difflib.get_close_matches(key, known, n=5, cutoff=0.6)
            raise ValueError(
                f"model.config.{section}.{key} is not a {section} field"
                + (f"; did you mean {', '.join(close)}?" if close else "")
            )
        setattr(sub_config, key, value)


def build_config(recipe: dict, path: Path) -> DeepseekV41Config:
    cfg = recipe["model"]["config"]
    config = DeepseekV41Config.from_pretrained(path)
    _apply_overrides(config.text_config, cfg["text_config"], "text_config")
    _apply_overrides(config.vision_config, cfg["vision_config"], "vision_config")
    set_dspark_training(config, recipe)
    config.text_config.validate_layout()
    config.backend = resolve_backend({**config.backend, **cfg["backend"]})
    config._name_or_path = str(cfg["name_or_path"] or path)
    return config


def set_dspark_training(config: DeepseekV41Config, recipe: dict) -> None:
    """``model.dspark_loss_weight`` 0: the training model builds no DSpark draft stages (sharded_load skips
    ``mtp.*``); > 0: it keeps the checkpoint's stages and trains them beside the backbone (dspark_loss.py)."""
    weight = recipe["model"]["dspark_loss_weight"]
    if "dspark_loss_weight" in recipe["model"]["config"]["text_config"]:
        raise RecipeError("model.config.text_config.dspark_loss_weight: set model.dspark_loss_weight instead (the "
                          "recipe's switch for the DSpark stages' loss)")
    text = config.text_config
    if weight and not dspark_stage_count(text):
        raise RecipeError(
            f"model.dspark_loss_weight={weight} trains the DSpark draft stages, but the checkpoint's config has none "
            f"(num_nextn_predict_layers {text.num_nextn_predict_layers}, dspark_block_size {text.dspark_block_size}"
            "); use a checkpoint with mtp.* stages, or set model.dspark_loss_weight=0")
    text.dspark_loss_weight = float(weight)
    if not weight:
        text.num_nextn_predict_layers = 0


def build_meta_model(recipe: dict, path: Path, tokenizer) -> torch.nn.Module:
    """``DeepseekV41ForCausalLM`` with every parameter on the meta device (Engram constants on the host)."""
    config = build_config(recipe, path)
    dtype = getattr(torch, recipe["model"]["config"]["dtype"])
    with torch.device("meta"), default_dtype(dtype):
        return DeepseekV41ForCausalLM(config, tokenizer=tokenizer)
