"""Convert a released DeepSeek-V4.1 checkpoint (FP8/FP4) into a floating-point checkpoint folder.

    python conversion/convert_checkpoint.py SRC DST [--max-shard-size 5GB] [--drop-mtp]

Every FP8 / FP4 / Engram weight is decoded exactly to bf16 (every released value is representable in
bf16); F32 and BF16 tensors are copied as they are. Tensor names stay the released ones; the `.scale`
tensors and `quantization_config` go. Before anything is written, names, shapes and dtypes are checked
against `DeepseekV41ForCausalLM` built on the meta device from SRC's config (no weights in memory).
Tensors then stream in row blocks, so memory stays small even for the Engram tables, and DST appears
only once complete. The modeling `.py` files (with `auto_map`) and SRC's tokenizer files are copied
next to the weights, so DST loads with `trust_remote_code=True` or `DeepseekV41ForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import torch

from deepseek_v41.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    CheckpointError,
    LoadReport,
    ReleasedCheckpoint,
    check_checkpoint_matches_model,
    save_floating_point_checkpoint,
)
from deepseek_v41.modeling_deepseek_v41 import AUTO_MAP


def build_meta_model(src: Path) -> torch.nn.Module:
    """`DeepseekV41ForCausalLM` for SRC's config on the meta device: parameter names and shapes, no memory."""
    from deepseek_v41.configuration_deepseek_v41 import DeepseekV41Config
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    config = DeepseekV41Config.from_pretrained(src)
    config._name_or_path = str(src)  # Engram builds its hash map from SRC's tokenizer
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(config)


def files_to_copy(src: Path) -> list[Path]:
    """The modeling files a remote-code checkpoint needs, plus SRC's other files (tokenizer, ...)."""
    from deepseek_v41.modeling_deepseek_v41 import remote_code_files

    weights = {CONFIG_FILE, INDEX_FILE}
    extras = sorted(p for p in src.iterdir()
                    if p.is_file() and p.name not in weights and p.suffix not in (".safetensors", ".py"))
    return remote_code_files() + extras


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    build_model: Callable[[Path], torch.nn.Module] | None = build_meta_model,
    max_shard_bytes: int = 5 << 30,
    drop_mtp: bool = False,
) -> LoadReport | None:
    """Released checkpoint SRC -> floating-point checkpoint DST; returns the model check's report.

    `build_model(src)` gives the model to check names and shapes against (meta device is fine); None skips
    that check.
    """
    src, dst = Path(src), Path(dst)
    checkpoint = ReleasedCheckpoint(src)
    if checkpoint.config is None:
        raise CheckpointError(f"{src / CONFIG_FILE} is missing: the export needs the model config")
    report = check_checkpoint_matches_model(build_model(src), checkpoint) if build_model else None
    # shard by shard, so the source files are read in order
    names = sorted(checkpoint.tensors, key=lambda n: (checkpoint.tensors[n].record.file, n))
    if drop_mtp:
        names = [n for n in names if not n.startswith("mtp.")]
    items = ((name, checkpoint.as_row_blocks(name, None if checkpoint.tensors[name].fmt == "plain"
                                             else torch.bfloat16)) for name in names)
    config = dict(checkpoint.config, auto_map=AUTO_MAP)
    save_floating_point_checkpoint(items, dst, config, files_to_copy(src), max_shard_bytes)
    return report


def parse_size(text: str) -> int:
    """'5GB', '500MB', '4GiB' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 1073741824)")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="released checkpoint directory")
    parser.add_argument("dst", type=Path, help="output directory (replaced atomically if it exists)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    parser.add_argument("--drop-mtp", action="store_true", help="leave out the DSpark draft stages (mtp.*)")
    args = parser.parse_args(argv)
    report = convert(args.src, args.dst, max_shard_bytes=args.max_shard_size, drop_mtp=args.drop_mtp)
    skipped = f" ({len(report.skipped)} mtp.* tensors the model does not use)" if report.skipped else ""
    print(f"wrote {args.dst}{skipped}")


if __name__ == "__main__":
    main()
