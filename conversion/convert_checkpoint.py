"""Convert a DeepSeek-V4.1 checkpoint folder: released (FP8/FP4) to floating point, or either to the released format.

    python conversion/convert_checkpoint.py SRC DST [--max-shard-size 5GB] [--drop-mtp] [--quantize release]

Every FP8 / FP4 / Engram weight is decoded exactly to bf16 (every released value is representable in
bf16); F32 and BF16 tensors are copied as they are. Tensor names stay the released ones; the `.scale`
tensors and `quantization_config` go. With `--quantize release` (e.g. SRC = a floating-point export of a
fine-tuned model) the tensors are re-encoded to the released FP8/FP4/Engram format with its
`quantization_config`, as the official inference code, vLLM and SGLang read it. Before anything is written, names, shapes and dtypes are checked
against `DeepseekV41ForCausalLM` built on the meta device from SRC's config (no weights in memory).
Tensors then stream in row blocks, so memory stays small even for the Engram tables, and DST appears
only once complete. The modeling `.py` files (with `auto_map`) and SRC's tokenizer files are copied
next to the weights, so DST loads with `trust_remote_code=True` or `DeepseekV41ForCausalLM.from_pretrained`.
DST is replaced only if it is empty or a previous export (see `deepseek_v41.hf_export`).
"""

from __future__ import annotations

import argparse
import tempfile
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
)
from deepseek_v41.hf_export import EXPORT_MARKER, QUANTIZE_CHOICES, TensorSource, export_config, write_export
from deepseek_v41.modeling_deepseek_v41 import AUTO_MAP
from deepseek_v41.modeling_deepseek_v41 import parse_size as parse_byte_size


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

    weights = {CONFIG_FILE, INDEX_FILE, EXPORT_MARKER}
    extras = sorted(p for p in src.iterdir()
                    if p.is_file() and p.name not in weights and p.suffix not in (".safetensors", ".py"))
    return remote_code_files() + extras


def decoded_source(checkpoint: ReleasedCheckpoint, name: str) -> TensorSource:
    """Tensor `name` of SRC decoded row block by row block (quantized ones to bf16, exactly)."""
    stored = checkpoint.tensors[name]
    dtype = None if stored.fmt == "plain" else torch.bfloat16
    return TensorSource(name, stored.shape, dtype or stored.dtype,
                        lambda start, stop: checkpoint.decode(name, slice(start, stop), dtype=dtype))


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    build_model: Callable[[Path], torch.nn.Module] | None = build_meta_model,
    max_shard_bytes: int = 5 << 30,
    drop_mtp: bool = False,
    quantize: str | None = None,
) -> LoadReport | None:
    """Checkpoint SRC -> floating-point (`quantize=None`) or released-format (`quantize="release"`) DST; returns
    the model check's report.

    `build_model(src)` gives the model to check names and shapes against (meta device is fine); None skips
    that check.
    """
    from deepseek_v41.modeling_deepseek_v41 import support_files

    src, dst = Path(src), Path(dst)
    checkpoint = ReleasedCheckpoint(src)
    if checkpoint.config is None:
        raise CheckpointError(f"{src / CONFIG_FILE} is missing: the export needs the model config")
    report = check_checkpoint_matches_model(build_model(src), checkpoint) if build_model else None
    # shard by shard, so the source files are read in order
    names = sorted(checkpoint.tensors, key=lambda n: (checkpoint.tensors[n].record.file, n))
    if drop_mtp:
        names = [n for n in names if not n.startswith("mtp.")]
    config = export_config(checkpoint.config, architectures=checkpoint.config.get("architectures")
                           or ["DeepseekV41ForCausalLM"], dtype=torch.bfloat16, auto_map=AUTO_MAP, quantize=quantize)
    with tempfile.TemporaryDirectory() as scratch:
        files = files_to_copy(src)
        if (src / "tokenizer.json").is_file() and not (src / "processor_config.json").is_file():
            from tokenizers import Tokenizer

            from deepseek_v41.configuration_deepseek_v41 import DeepseekV41Config

            model_config = DeepseekV41Config.from_pretrained(src)
            model_config._name_or_path = str(src)
            files += support_files(model_config, Tokenizer.from_file(str(src / "tokenizer.json")), Path(scratch))
        write_export([decoded_source(checkpoint, n) for n in names], dst, config, files, quantize=quantize,
                     max_shard_bytes=max_shard_bytes)
    return report


def parse_size(text: str) -> int:
    """'5GB', '500MB', '4GiB' or a plain byte count -> bytes (an argparse type)."""
    try:
        return parse_byte_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 1073741824)") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="released checkpoint directory")
    parser.add_argument("dst", type=Path, help="output directory (replaced atomically if it exists)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    parser.add_argument("--drop-mtp", action="store_true", help="leave out the DSpark draft stages (mtp.*)")
    parser.add_argument("--quantize", choices=[q for q in QUANTIZE_CHOICES if q],
                        help="release: write the released FP8/FP4/Engram format (default: floating point)")
    args = parser.parse_args(argv)
    report = convert(args.src, args.dst, max_shard_bytes=args.max_shard_size, drop_mtp=args.drop_mtp,
                     quantize=args.quantize)
    skipped = f" ({len(report.skipped)} mtp.* tensors the model does not use)" if report.skipped else ""
    print(f"wrote {args.dst}{skipped}")


if __name__ == "__main__":
    main()
