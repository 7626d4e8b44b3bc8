"""Write a tiny random DeepSeek-V4.1 checkpoint in the exact released (FP8/FP4) format.

The writer lives in the package (``deepseek_v41/training/tiny_checkpoint.py``, so the CPU demo creates its
checkpoint from a plain ``pip install`` too); this is the same command, kept where the conversion tools are.

    python conversion/make_tiny_checkpoint.py --out /tmp/tiny [--seed 0] [--vision-layers 0]
"""

from deepseek_v41.training.tiny_checkpoint import (  # noqa: F401  (re-exported for the tools and tests)
    TINY_CONFIG,
    main,
    make_tiny_checkpoint,
    released_tensors,
    tiny_config,
)

if __name__ == "__main__":
    main()
