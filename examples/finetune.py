"""Fine-tune DeepSeek-V4.1-Flash with FSDP2 + expert parallelism on HellaSwag.

    python examples/finetune.py examples/configs/tiny_cpu.yaml [--section.key=value ...] [--check]
    torchrun --nproc_per_node 2 examples/finetune.py examples/configs/tiny_cpu.yaml
    torchrun ... examples/finetune.py --config examples/configs/deepseek_v41_flash_hellaswag.yaml \
        --model.config.pretrained_model_name_or_path=/path/to/DeepSeek-V4.1-Flash

Run with ``python``, the script checks the recipe and the data once (an error is printed once, without a
traceback), starts ``distributed.nproc_per_node`` workers with torchrun itself and, with
``checkpoint.reload_export``, loads the export back at the end; ``--check`` stops after the checks.  Run by
torchrun (or srun), it is one worker.  See deepseek_v41/training/launch.py.

The recipe is the first argument or ``--config RECIPE.yaml`` (``-c``, ``--config=RECIPE.yaml``), not both.
Any recipe key can be overridden as ``--section.key=value``; see deepseek_v41/training/recipe.py.
"""

import os
import sys
from pathlib import Path

from deepseek_v41.training import launch
from deepseek_v41.training.recipe import RecipeError, load_recipe, parse_overrides

USAGE = ("usage: python examples/finetune.py [--config] RECIPE.yaml [--section.key=value ...] [--check]\n"
         "       torchrun ... examples/finetune.py [--config] RECIPE.yaml [--section.key=value ...]")


def split_config(argv: list) -> tuple:
    """-> (recipe path, override arguments), from the positional form or ``--config`` / ``-c``."""
    paths, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise RecipeError(f"{arg} needs a recipe path: {arg} RECIPE.yaml")
            paths.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
        elif i == 0 and not arg.startswith("-"):
            paths.append(arg)
        else:
            rest.append(arg)
        i += 1
    if not paths:
        raise RecipeError(f"no recipe given\n{USAGE}")
    if len(paths) > 1:
        raise RecipeError(f"two recipes given ({', '.join(paths)}); pass one, positionally or as --config")
    return paths[0], rest


def main(argv):
    worker = launch.is_worker()
    check_only = "--check" in argv
    args = [a for a in argv if a != "--check"]
    try:
        if check_only and worker:
            raise RecipeError("--check runs the launcher's checks: use python examples/finetune.py ... --check, "
                              "without torchrun")
        path, rest = split_config(args)
        recipe = load_recipe(path, parse_overrides(rest))
    except RecipeError as err:
        if worker and os.environ["RANK"] != "0":
            raise SystemExit(1) from None  # rank 0 says it; once is enough
        print(f"recipe error: {err}", file=sys.stderr)
        raise SystemExit(1 if worker else 2) from None  # 2: the launcher's checks (launch.main) refused it
    if worker:
        from deepseek_v41.training.loop import run

        run(recipe)
        return
    sys.exit(launch.main(recipe, str(Path(__file__).resolve()), args, check_only))


if __name__ == "__main__":
    main(sys.argv[1:])
