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
        "attn": "tilelang", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch_mm", "dispatcher": "torch",
        "head": "fp32", "fp32_linear": "fp32", "mhc": "tile_kernels", "engram": "tile_kernels", "quant": "tile_kernels"}
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


@pytest.mark.parametrize("key,value", [
    ("optimizer.lr", float("nan")), ("optimizer.lr", -0.5), ("optimizer.lr", "abc"), ("optimizer.lr", float("inf")),
    ("optimizer.eps", 0.0), ("optimizer.weight_decay", -0.1), ("optimizer.betas", [0.9]), ("optimizer.betas", [0.9, 1.5]),
    ("clip_grad_norm.max_norm", -1), ("step_scheduler.max_steps", -1), ("step_scheduler.max_steps", 0),
    ("dataset.max_length", 0), ("step_scheduler.global_batch_size", 0), ("step_scheduler.local_batch_size", 0),
    ("validation_dataset.local_batch_size", 0), ("distributed.ep_size", 0), ("distributed.ep_size", 1.5),
    ("distributed.ep_size", True), ("lr_scheduler.min_lr", -1e-6), ("lr_scheduler.lr_warmup_steps", -1),
    ("lr_scheduler.lr_decay_style", "cosin"), ("optimizer.impl", "adam"), ("optimizer.fused", "yes"),
    ("fsdp.activation_checkpointing", "no"), ("model.config.dtype", "fp16"), ("seed", -1),
    ("checkpoint.save_every_steps", -2), ("checkpoint.resume_from", ""), ("wandb.mode", "on"),
    ("optimizer.no_decay", "hc_*"),
])
def test_schema_rejects_bad_values_naming_the_key(key, value):
    """Each value class the schema guards (type, range, finite, enum) fails at load time with the dotted key
    and an example of a valid override."""
    with pytest.raises(RecipeError) as err:
        load_recipe(CONFIGS / "tiny_cpu.yaml", {key: value})
    assert str(err.value).startswith(f"{key}=") and f"--{key}=" in str(err.value)


def test_schema_accepts_the_edges_and_resolves_auto():
    recipe = load_recipe(CONFIGS / "tiny_cpu.yaml", {
        "clip_grad_norm.max_norm": None, "dataset.max_length": None, "optimizer.weight_decay": 0,
        "optimizer.no_decay": ["*norm*"], "optimizer.impl": "auto", "lr_scheduler.lr_warmup_steps": 0})
    assert recipe["optimizer"]["impl"] == "torch_remainder"  # what auto resolves to is what gets recorded
    assert recipe["optimizer"]["no_decay"] == ["*norm*"]


def test_schema_covers_every_key():
    import functools

    from deepseek_v41.training.recipe import DEFAULTS, OPEN_SECTIONS, SCHEMA, _flat_keys

    def default(key):
        return functools.reduce(lambda tree, part: tree[part], key.split("."), DEFAULTS)

    leaves = [k for k in _flat_keys(DEFAULTS) if k not in OPEN_SECTIONS and not isinstance(default(k), dict)]
    # checkpoint.* keys added by the checkpoint code are checked against their default's type until listed
    missing = [k for k in leaves if k not in SCHEMA and not k.startswith("checkpoint.")]
    assert not missing, f"recipe keys without a SCHEMA type: {missing}"


def test_finetune_takes_the_recipe_positionally_or_as_config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune", CONFIGS.parents[0] / "finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    rest = ["--optimizer.lr=1e-4", "--seed", "3"]
    assert finetune.split_config(["r.yaml", *rest]) == ("r.yaml", rest)
    assert finetune.split_config(["--config", "r.yaml", *rest]) == ("r.yaml", rest)
    assert finetune.split_config([*rest, "-c", "r.yaml"]) == ("r.yaml", rest)
    assert finetune.split_config(["--config=r.yaml", *rest]) == ("r.yaml", rest)
    with pytest.raises(RecipeError, match="two recipes given"):
        finetune.split_config(["a.yaml", "--config", "b.yaml"])
    with pytest.raises(RecipeError, match="no recipe given"):
        finetune.split_config(rest)
    with pytest.raises(RecipeError, match="--config needs a recipe path"):
        finetune.split_config(["--config"])


def test_export_dir_may_be_a_run_subfolder_but_never_overlaps_what_the_run_writes_or_reads(tmp_path):
    """The export replaces its whole folder: a subfolder of output_dir is fine (the tiny recipe's
    ``${output_dir}/model``), output_dir itself or a folder holding it is not, and neither is any overlap
    with the checkpoints, the base checkpoint, the step resumed from or the wandb folder."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"

    def recipe(export, **overrides):
        return load_recipe(CONFIGS / "tiny_cpu.yaml", {
            "output_dir": str(run), "model.config.pretrained_model_name_or_path": str(ckpt),
            **({} if export is None else {"checkpoint.export_dir": str(export)}), **overrides})

    assert recipe(None)["checkpoint"]["export_dir"] == str(run / "model")  # the recipe's default
    for export in (run / "model", run / "exports" / "final", tmp_path / "export"):
        assert recipe(export)["checkpoint"]["export_dir"] == str(export)
    refused = [
        (run, {}, "is or holds output_dir"),
        (tmp_path, {}, "is or holds output_dir"),
        (run / "checkpoints", {}, "overlaps checkpoint.dir"),
        (run / "checkpoints" / "x", {}, "overlaps checkpoint.dir"),
        (run / "model", {"checkpoint.dir": str(run / "model" / "ckpts")}, "overlaps checkpoint.dir"),
        (tmp_path / "export", {"checkpoint.dir": str(tmp_path)}, "overlaps checkpoint.dir"),
        (ckpt, {}, "overlaps model.config.pretrained_model_name_or_path"),
        (ckpt / "sub", {}, "overlaps model.config.pretrained_model_name_or_path"),
        (tmp_path / "old", {"checkpoint.resume_from": str(tmp_path / "old" / "step_00000002")},
         "overlaps checkpoint.resume_from"),
        (run / "model", {"wandb.dir": str(run / "model" / "wandb")}, "overlaps wandb.dir"),
    ]
    for export, overrides, message in refused:
        with pytest.raises(RecipeError, match=f"checkpoint.export_dir=.* {message}"):
            recipe(export, **overrides)
    (run / "model").mkdir(parents=True)
    (run / "model" / "notes.txt").write_text("mine")  # not an export: refused before the run, not after it
    with pytest.raises(RecipeError, match="not a deepseek_v41 export"):
        recipe(None)


def test_recipe_references_output_dir_and_its_own_folder(tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "r.yaml").write_text('output_dir: "${OUT_ROOT}/run"\n'
                                   "model: {config: {pretrained_model_name_or_path: /ckpt}}\n"
                                   'dataset: {path_or_dataset: "${recipe_dir}/../data"}\n'
                                   'checkpoint: {dir: "${output_dir}/ckpts"}\n')
    monkeypatch.setenv("OUT_ROOT", str(tmp_path / "out"))
    monkeypatch.setenv("output_dir", "/not/this")  # the recipe's own value wins over an environment variable
    recipe = load_recipe(folder / "r.yaml", {"output_dir": "${OUT_ROOT}/other"})
    assert recipe["output_dir"] == str(tmp_path / "out" / "other")
    assert recipe["checkpoint"]["dir"] == str(tmp_path / "out" / "other" / "ckpts")
    assert recipe["dataset"]["path_or_dataset"] == str(tmp_path / "data")  # found from any working directory
    with pytest.raises(RecipeError, match="output_dir cannot reference itself"):
        load_recipe(folder / "r.yaml", {"output_dir": "${output_dir}/x"})
    with pytest.raises(RecipeError, match="not read from a file"):
        load_recipe(None, {"model.config.pretrained_model_name_or_path": "/c", "dataset.path_or_dataset": "${recipe_dir}/d"})
    tiny = load_recipe(CONFIGS / "tiny_cpu.yaml")
    assert Path(tiny["dataset"]["path_or_dataset"]) == CONFIGS.parent / "data" / "hellaswag_sample"


def test_launcher_checks_once_and_starts_no_worker_on_an_error(tmp_path, capsys, monkeypatch, tiny_checkpoint):
    """The launcher's checks in-process (the subprocess runs are in test_training_run.py): a world-size error,
    a missing checkpoint, a bad data row each come back as one message and exit status 2, before any worker."""
    from deepseek_v41.training import launch

    started = []
    monkeypatch.setattr(launch, "launch_workers", lambda *args: started.append(args) or 0)
    data = tmp_path / "data"
    data.mkdir()
    good = (CONFIGS.parent / "data" / "hellaswag_sample" / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join([good[0], '{"ctx": "x", "endings": ["a"], "label": 3}', *good[2:]]))
    base = {"model.config.pretrained_model_name_or_path": str(tmp_path / "none"),
            "model.make_tiny_checkpoint_if_missing": False}
    cases = [({"distributed.ep_size": 3}, "recipe error: world size 2 is not divisible by distributed.ep_size=3"),
             ({}, "error: base checkpoint: checkpoint folder"),
             ({"distributed.nproc_per_node": None}, "recipe error: distributed.nproc_per_node is not set"),
             ({"model.config.pretrained_model_name_or_path": str(tiny_checkpoint), "dataset.path_or_dataset": str(data)},
              f"error: data: {data / 'train.jsonl'}:2: label = 3; expected an integer index into the 1 endings")]
    for overrides, message in cases:
        assert launch.main(load_recipe(CONFIGS / "tiny_cpu.yaml", {**base, **overrides}), "finetune.py", []) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err
    assert not started
