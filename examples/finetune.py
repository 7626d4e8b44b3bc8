"""Fine-tune DeepSeek-V4.1-Flash with FSDP2 + expert parallelism on HellaSwag.

    torchrun --nproc_per_node 2 examples/finetune.py examples/configs/tiny_cpu.yaml
    torchrun ... examples/finetune.py examples/configs/deepseek_v41_flash_hellaswag.yaml \
        --model.config.pretrained_model_name_or_path=/path/to/DeepSeek-V4.1-Flash

Any recipe key can be overridden as ``--section.key=value``; see deepseek_v41/training/recipe.py.
"""

import sys

from deepseek_v41.training.loop import run
from deepseek_v41.training.recipe import RecipeError, load_recipe, parse_overrides


def main(argv):
    if not argv or argv[0].startswith("--"):
        raise SystemExit("usage: torchrun ... examples/finetune.py RECIPE.yaml [--section.key=value ...]")
    try:
        recipe = load_recipe(argv[0], parse_overrides(argv[1:]))
    except RecipeError as err:
        raise SystemExit(f"recipe error: {err}") from None
    run(recipe)


if __name__ == "__main__":
    main(sys.argv[1:])
