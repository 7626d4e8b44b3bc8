"""Recipe parsing: YAML + dotted overrides, close-match errors, env expansion, unsupported features."""

from pathlib import Path

import pytest

from deepseek_v41.training.recipe import RecipeError, load_recipe, parse_overrides, validate_world

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def test_shipped_recipes_parse(monkeypatch):
    monkeypatch.setenv("DS41_CHECKPOINT", "/ckpt/v41")
    flash = load_recipe(CONFIGS / "deepseek_v41_flash_hellaswag.yaml")
    assert flash["model"]["config"]["pretrained_model_name_or_path"] == "/ckpt/v41"
    assert flash["distributed"]["ep_size"] == 64 and flash["distributed"]["engram_owners"] == 64
    assert flash["model"]["config"]["backend"] == {
        "attn": "tilelang", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch_mm", "dispatcher": "hybridep",
        "head": "fp32", "mhc": "tile_kernels", "engram": "tile_kernels", "quant": "tile_kernels"}
    assert flash["model"]["config"]["vision_config"] == {"num_hidden_layers": 0}
    assert flash["optimizer"]["lr"] == 1e-5 and flash["optimizer"]["betas"] == [0.9, 0.95]
    assert flash["lr_scheduler"]["lr_warmup_steps"] == 10 and flash["lr_scheduler"]["min_lr"] == 1e-6
    assert flash["step_scheduler"]["global_batch_size"] == 64 and flash["step_scheduler"]["val_every_steps"] == 50
    assert flash["wandb"]["enable"] is False and flash["seed"] == 1234
    validate_world(flash, 64)
    tiny = load_recipe(CONFIGS / "tiny_cpu.yaml")
    assert tiny["distributed"]["backend"] == "gloo" and tiny["distributed"]["ep_size"] == 2
    validate_world(tiny, 2)


def test_dotted_overrides_are_typed():
    overrides = parse_overrides(["--model.config.pretrained_model_name_or_path=/x", "--optimizer.lr", "2e-4",
                                 "--model.config.backend.attn=torch", "--wandb.enable=true"])
    recipe = load_recipe(CONFIGS / "tiny_cpu.yaml", overrides)
    assert recipe["model"]["config"]["pretrained_model_name_or_path"] == "/x"
    assert recipe["optimizer"]["lr"] == 2e-4
    assert recipe["model"]["config"]["backend"]["attn"] == "torch"
    assert recipe["model"]["config"]["backend"]["dispatcher"] == "torch"  # the rest of the section is kept
    assert recipe["wandb"]["enable"] is True


def test_unknown_key_lists_close_matches():
    with pytest.raises(RecipeError, match=r"optimizer\.weight_decay"):
        load_recipe(CONFIGS / "tiny_cpu.yaml", {"optimizer.weight_decy": 0.0})
    with pytest.raises(RecipeError, match=r"step_scheduler\.global_batch_size"):
        load_recipe(CONFIGS / "tiny_cpu.yaml", {"step_scheduler.global_batchsize": 4})


def test_unsupported_parallelism_and_packing_are_rejected():
    for key, match in (("distributed.tp_size", "tensor parallelism"), ("distributed.pp_size", "pipeline"),
                       ("distributed.cp_size", "context parallelism")):
        with pytest.raises(RecipeError, match=match):
            load_recipe(CONFIGS / "tiny_cpu.yaml", {key: 2})
    with pytest.raises(RecipeError, match="THD"):
        load_recipe(CONFIGS / "tiny_cpu.yaml", {"distributed.sequence_packing": True})


def test_world_size_checks():
    recipe = load_recipe(CONFIGS / "tiny_cpu.yaml", {"distributed.ep_size": 4, "distributed.engram_owners": None})
    with pytest.raises(RecipeError, match="not divisible by distributed.ep_size=4"):
        validate_world(recipe, 6)
    recipe = load_recipe(CONFIGS / "tiny_cpu.yaml", {"step_scheduler.global_batch_size": 3})
    with pytest.raises(RecipeError, match="global_batch_size=3"):
        validate_world(recipe, 2)


def test_missing_environment_variable_and_checkpoint(monkeypatch):
    monkeypatch.delenv("DS41_CHECKPOINT", raising=False)
    with pytest.raises(RecipeError, match="DS41_CHECKPOINT"):
        load_recipe(CONFIGS / "deepseek_v41_flash_hellaswag.yaml")
    with pytest.raises(RecipeError, match="pretrained_model_name_or_path is not set"):
        load_recipe(None)


def test_missing_checkpoint_folder_is_a_clear_error(tmp_path):
    from deepseek_v41.training.model_setup import check_checkpoint

    recipe = load_recipe(CONFIGS / "tiny_cpu.yaml", {
        "model.config.pretrained_model_name_or_path": str(tmp_path / "nope"),
        "model.make_tiny_checkpoint_if_missing": False})
    with pytest.raises(FileNotFoundError, match="pretrained_model_name_or_path"):
        check_checkpoint(recipe, 0)
