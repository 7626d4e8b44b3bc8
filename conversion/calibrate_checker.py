"""Calibrate and spot-check the gates of compare_with_official.py on many prompts.

    python conversion/calibrate_checker.py --checkpoint SNAPSHOT --inference-dir OFFICIAL \\
        --official-config ARGS.json [--kernels KERNEL.py] [--prompts conversion/checker_prompts.json] \\
        [--weights released bf16] [--mode whole] [--device cpu] --out calibration.json

For every prompt of the prompts file (its text at its ``seq_len`` tokens, BOS first) and every ``--weights``
setting, runs the checker's official prefill and our model (``--mode whole`` or ``streamed``, as the checker; ours
once per prompt and mode: it reads the same exactly decoded weights in both settings), then records

* the checker's report with its default gates (``passed``, failures, every metric);
* per position: KL(official || ours), the official top-1 margin (top-1 minus runner-up logit), the largest
  change of a logit gap to the official top-1 (``gap_noise``: a top-1 flip needs ``gap_noise > margin``),
  top-1 agreement and the position's class;

and writes it as JSON, with a summary per --weights and --mode (per class: the largest mean / p95 / max KL over
the prompts; the largest ``gap_noise``; the prompts that fail their default gates). The gates in
compare_with_official.py (``TOP1_MARGIN``, ``CLASS_GATES``) state the measured figures they are a multiple of.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_with_official as tool


def per_position(reference: torch.Tensor, candidate: torch.Tensor, window: int) -> dict:
    """Per-position lists (row-major over [b, s]) of the quantities the gates are calibrated on."""
    stats = tool.position_stats(reference, candidate)
    classes = tool.position_classes(*reference.shape[:2], window)
    return {"kl": stats["kl"].tolist(), "margin": stats["margin"].tolist(), "gap_noise": stats["gap_noise"].tolist(),
            "agree": stats["agree"].tolist(), "class": [tool.CLASS_NAMES[c] for c in classes.tolist()]}


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for weights, mode in sorted({(run["weights"], run.get("mode", "whole")) for run in runs}):
        mine = [run for run in runs if (run["weights"], run.get("mode", "whole")) == (weights, mode)]
        entry = {"prompts": len(mine), "failed": [run["prompt"] for run in mine if not run["report"]["passed"]]}
        for name in tool.CLASS_NAMES:
            rows = [run["report"]["every_position"]["classes"].get(name) for run in mine]
            rows = [row for row in rows if row]
            if rows:
                entry[name] = {key: max(row[key] for row in rows) for key in ("mean_kl", "p95_kl", "max_kl")}
        noise = [g for run in mine for g in run["positions"]["gap_noise"]]
        margins = [(m, a) for run in mine for m, a in zip(run["positions"]["margin"], run["positions"]["agree"])]
        flips = [m for m, a in margins if not a]
        entry.update({
            "positions": len(noise), "max_gap_noise": max(noise),
            "p999_gap_noise": float(torch.tensor(noise).quantile(0.999)),
            "top1_flips": len(flips), "largest_margin_flipped": max(flips, default=0.0),
            "near_tie_positions": sum(m <= tool.TOP1_MARGIN for m, _ in margins),
            "cosine_min": min(run["report"]["every_position"]["all"]["cosine"] for run in mine),
        })
        summary[f"{weights} {mode}"] = entry
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--inference-dir", type=Path, required=True)
    p.add_argument("--official-config", type=Path)
    p.add_argument("--kernels", type=Path)
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parent / "checker_prompts.json")
    p.add_argument("--only", nargs="*", help="prompt names to run (default: all)")
    p.add_argument("--weights", nargs="+", choices=sorted(tool.WEIGHTS), default=sorted(tool.WEIGHTS))
    p.add_argument("--mode", choices=["whole", "streamed"], default="whole", help="how our model runs (the checker's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    opts = p.parse_args(argv)
    prompts = json.loads(opts.prompts.read_text())["prompts"]
    if opts.only:
        prompts = [prompt for prompt in prompts if prompt["name"] in opts.only]
    runs = json.loads(opts.out.read_text())["runs"] if opts.out.is_file() else []
    done = {(run["prompt"], run["weights"], run.get("mode", "whole")) for run in runs}
    for prompt in prompts:
        todo = [w for w in opts.weights if (prompt["name"], w, opts.mode) not in done]
        if not todo:
            continue
        ours = None
        for weights in todo:
            base = ["--checkpoint", str(opts.checkpoint), "--inference-dir", str(opts.inference_dir),
                    "--text", prompt["text"], "--seq-len", str(prompt["seq_len"]), "--weights", weights,
                    "--mode", opts.mode, "--device", opts.device]
            if opts.official_config:
                base += ["--official-config", str(opts.official_config)]
            if opts.kernels:
                base += ["--kernels", str(opts.kernels)]
            checker = tool.build_parser().parse_args(base)
            tool.resolve_paths(checker)
            ids, _ = tool.load_input_ids(checker, checker.checkpoint)
            start = time.monotonic()
            official = tool.run_official(checker, ids, 0, 1)
            official_s = time.monotonic() - start
            if ours is None:
                start = time.monotonic()
                run_ours = tool.run_ours_streamed if opts.mode == "streamed" else tool.run_ours_whole
                ours = run_ours(checker.checkpoint, ids, opts.device)
                ours_s = time.monotonic() - start
            report = tool.build_report(official, ours, tool.default_gates(weights), tool.CONSISTENCY_GATE,
                                       tool.sliding_window(checker.checkpoint))
            reference = official["hidden"].float().cpu() @ official["head"].T
            runs.append({"prompt": prompt["name"], "weights": weights, "mode": opts.mode, "seq_len": ids.shape[1],
                         "seconds": {"official": round(official_s, 1), "ours": round(ours_s, 1)},
                         "report": report,
                         "positions": per_position(reference, ours, tool.sliding_window(checker.checkpoint))})
            print(f"{prompt['name']:>14} {weights:>8} {opts.mode:>8} s={ids.shape[1]:>3} official {official_s:5.1f}s "
                  f"ours {ours_s:5.1f}s {'PASS' if report['passed'] else 'FAIL ' + '; '.join(report['failures'])}",
                  flush=True)
            opts.out.write_text(json.dumps({"runs": runs, "summary": summarize(runs)}, indent=1) + "\n")
    summary = summarize(runs)
    opts.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if not any(entry["failed"] for entry in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
