"""Convert a released DeepSeek-V4.1 checkpoint (FP8/FP4) into a floating-point checkpoint folder.

    python conversion/convert_checkpoint.py SRC DST [--max-shard-size 5GB] [--drop-mtp]

Every FP8 / FP4 / Engram weight is decoded exactly to bf16 (every released value is representable in
bf16); F32 and BF16 tensors are copied as they are. Tensor names stay the released ones; the `.scale`
tensors and `quantization_config` go. Before anything is written, names, shapes and dtypes are checked
against `DeepseekV41ForCausalLM` built on the meta device from SRC's config (no weights in memory).
Tensors then stream in row blocks, so memory stays small even for the Engram tables, and DST appears
only once complete. The modeling `.py` files and SRC's tokenizer files are copied next to the weights.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import torch

import deepseek_v41.checkpoint as checkpoint_module
from deepseek_v41.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    CheckpointError,
    LoadReport,
    ReleasedCheckpoint,
    check_checkpoint_matches_model,
    save_floating_point_checkpoint,
)

AUTO_MAP = {
    "AutoConfig": "configuration_deepseek_v41.DeepseekV41Config",
    "AutoModelForCausalLM": "modeling_deepseek_v41.DeepseekV41ForCausalLM",
}


def build_meta_model(config: dict) -> torch.nn.Module:
    """`DeepseekV41ForCausalLM` for `config` on the meta device: parameter names and shapes, no memory."""
    from deepseek_v41.configuration_deepseek_v41 import DeepseekV41Config
    from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

    with torch.device("meta"):
        return DeepseekV41ForCausalLM(DeepseekV41Config.from_dict(config))


def files_to_copy(src: Path) -> tuple[list[Path], bool]:
    """The modeling `.py` files (and whether they make a loadable remote-code model) plus SRC's other files."""
    package = Path(checkpoint_module.__file__).parent  # the flat modeling path
    code = sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
    remote_code = {"configuration_deepseek_v41.py", "modeling_deepseek_v41.py"} <= {p.name for p in code}
    weights = {CONFIG_FILE, INDEX_FILE}
    extras = sorted(p for p in src.iterdir()
                    if p.is_file() and p.name not in weights and p.suffix not in (".safetensors", ".py"))
    return code + extras, remote_code


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    build_model: Callable[[dict], torch.nn.Module] | None = build_meta_model,
    max_shard_bytes: int = 5 << 30,
    drop_mtp: bool = False,
) -> LoadReport | None:
    """Released checkpoint SRC -> floating-point checkpoint DST; returns the model check's report.

    `build_model(config_dict)` gives the model to check names and shapes against (meta device is fine);
    None skips that check.
    """
    src, dst = Path(src), Path(dst)
    checkpoint = ReleasedCheckpoint(src)
    if checkpoint.config is None:
        raise CheckpointError(f"{src / CONFIG_FILE} is missing: the export needs the model config")
    report = check_checkpoint_matches_model(build_model(checkpoint.config), checkpoint) if build_model else None
    # shard by shard, so the source files are read in order
    names = sorted(checkpoint.tensors, key=lambda n: (checkpoint.tensors[n].record.file, n))
    if drop_mtp:
        names = [n for n in names if not n.startswith("mtp.")]
    items = ((name, checkpoint.as_row_blocks(name, None if checkpoint.tensors[name].fmt == "plain"
                                             else torch.bfloat16)) for name in names)
    copies, remote_code = files_to_copy(src)
    config = dict(checkpoint.config)
    if remote_code:
        config["auto_map"] = AUTO_MAP
    save_floating_point_checkpoint(items, dst, config, copies, max_shard_bytes)
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
