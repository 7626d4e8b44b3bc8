"""Mutation check of the hand-written GPU kernels: one plausible bug at a time, and the GPU tests that must fail.

    python tests/gpu/mutate_kernels.py [--only PATTERN ...] [--skip-baseline] [--out FILE]   # on a CUDA machine
    python tests/gpu/mutate_kernels.py --check                                           # anywhere: the table applies

Each mutant is one exact text substitution in one source file (a dropped term, a sign, an off-by-one in a loop
bound or a mask, a wrong scale) that must match exactly once. The script first runs every test file the mutants
use on the unmutated tree (all must pass), then per mutant: writes the mutated file, runs its tests with
``pytest -x`` in a fresh process (so Triton, TileLang and the CUDA cubin cache, all keyed on the source, compile
the mutant), and restores the file, also on an interrupt. A mutant is CAUGHT when a test fails (or the run hits
``--timeout``: a hang), SURVIVED when every test passes. The table (mutant, where, result, first failing test)
goes to stdout and ``--out`` (appended line by line, so a run cut short keeps what it measured); the exit code is
1 if any mutant survived or the baseline failed. ``--only`` takes ids or fnmatch patterns (``'cuda_*'``), to run
the table in parts (one part per device command); ``--skip-baseline`` for the parts after the first.
``--jobs N`` runs the mutants in N copies of the tree at once (dealt round-robin, so the slow attention mutants
spread over the copies; each copy is a process of this script whose imports resolve to its copy), the baseline
alongside in the unmutated tree: most of a mutant's time is compiling it on the CPU, which the copies overlap.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU = "tests/gpu"
TABLE_HEADER = f"{'mutant':36} {'file':42} {'result':9} first failing test"


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repository
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple  # pytest arguments: files, optionally "-k" and an expression
    what: str


TRITON = "deepseek_v41/kernels_triton.py"
ADAMW = "deepseek_v41/training/adamw_triton.py"
CUDA_FWD = "deepseek_v41/sparse_attention_cuda.py"
CUDA_BWD = "deepseek_v41/sparse_attention_cuda_bwd.py"
TILELANG = "deepseek_v41/kernels_tilelang.py"
LAYERS = "deepseek_v41/layers.py"
QUANTIZED = "deepseek_v41/kernels_quantized.py"
QUANTIZED_TESTS = f"{GPU}/test_quantized_kernels_gpu.py"
TRITON_TESTS = f"{GPU}/test_triton_kernels_gpu.py"
ATTENTION_TESTS = (f"{GPU}/test_tilelang_attention.py", f"{GPU}/test_gpu_model.py", f"{GPU}/test_generation_gpu.py")

MUTANTS = [
    # Triton: RoPE
    Mutant("rope_sign", TRITON, "re * sin + im * cos", "re * sin - im * cos", (TRITON_TESTS, "-k", "rope"),
           "RoPE: the imaginary part's sign"),
    Mutant("rope_position", TRITON, "pos = (rows // heads) % n_pos", "pos = rows % n_pos",
           (TRITON_TESTS, "-k", "rope"), "RoPE: the position of a row ignores the heads"),
    # Triton: RMSNorm
    Mutant("rms_mean_off_by_one", TRITON, "tl.sum(x * x, axis=0) / D + eps", "tl.sum(x * x, axis=0) / (D - 1) + eps",
           (TRITON_TESTS, "-k", "rms_norm"), "RMSNorm forward: mean over D - 1"),
    Mutant("rms_bwd_dropped_term", TRITON, "((g - xhat * c) * r)", "(g * r)", (TRITON_TESTS, "-k", "rms_norm"),
           "RMSNorm backward: the normalisation's term of dx dropped"),
    Mutant("rms_bwd_dw_short_chunk", TRITON, "dw += tl.where(live, dy * xhat, 0.0)", "dw += dy * xhat",
           (TRITON_TESTS, "-k", "rms_norm"), "RMSNorm backward: a short last chunk adds its last row again to dw"),
    # Triton: fused cross-entropy
    Mutant("ce_ignored_rows_counted", TRITON, "tl.where(t >= 0, lse - picked, 0.0)", "lse - picked",
           (TRITON_TESTS, "-k", "cross_entropy"), "cross-entropy: ignored rows (target < 0) counted"),
    Mutant("ce_grad_lo_dropped", TRITON, "(g - hi.to(tl.float32)).to(tl.bfloat16)", "(g * 0.0).to(tl.bfloat16)",
           (TRITON_TESTS, "-k", "cross_entropy"), "cross-entropy gradient: the bf16 low half dropped"),
    # Triton: MoE combine
    Mutant("combine_loop_bound", TRITON, "for j in tl.static_range(K):", "for j in tl.static_range(K - 1):",
           (TRITON_TESTS, "-k", "gather_sum"), "MoE combine: the last expert of each token left out"),
    # Triton: SwiGLU
    Mutant("swiglu_fwd_no_clamp", TRITON, "            g = tl.minimum(g, limit)\n        w = tl.load",
           "            g = g\n        w = tl.load", (TRITON_TESTS, "-k", "swiglu"),
           "SwiGLU forward: the gate not clamped"),
    Mutant("swiglu_bwd_silu_derivative", TRITON, "(s * (1.0 + gc * (1.0 - s)))", "s",
           (TRITON_TESTS, "-k", "swiglu"), "SwiGLU backward: silu' = sigmoid"),
    Mutant("swiglu_bwd_clamp_passes_gradient", TRITON, "dg = tl.where(g <= limit, dg, 0.0)", "dg = dg",
           (TRITON_TESTS, "-k", "swiglu"), "SwiGLU backward: the gradient passes the gate's clamp"),
    # Triton: mHC mix dx (bf16x3 and the coefficient term)
    Mutant("mix_dx_tf32", TRITON, 'PRECISION="tf32x3", num_warps=4', 'PRECISION="tf32", num_warps=4',
           (f"{GPU}/test_fused_elementwise_gpu.py", f"{GPU}/test_tile_kernels_gpu.py"),
           "mHC mix dx: the 24-long product in one TF32 pass instead of three (10-bit mantissas)"),
    Mutant("mix_dx_coef_sign", TRITON, "(acc - c[:, None] * x)", "(acc + c[:, None] * x)",
           (f"{GPU}/test_fused_elementwise_gpu.py", f"{GPU}/test_tile_kernels_gpu.py"),
           "mHC mix dx: the sign of coef x"),
    # torch bf16x3 head GEMM (tensor cores)
    Mutant("bf16x3_lo_half_dropped", LAYERS, "return out[:, :n] + out[:, n:]", "return out[:, :n]",
           (f"{GPU}/test_gpu_model.py", "-k", "bf16x3 or emulated"),
           "bf16x3 GEMM, one exact operand: the low half's product dropped"),
    Mutant("bf16x3_a_lo_term_dropped", LAYERS, "        a_parts.append(a_lo)\n        b_parts.append(b_hi)\n", "        pass\n",
           (f"{GPU}/test_gpu_model.py", "-k", "bf16x3 or emulated"), "bf16x3 GEMM: the a_lo x b_hi product dropped"),
    Mutant("index_scores_no_relu", TRITON, "tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)",
           "tl.sum(dots * w[:, None], axis=0)", (TRITON_TESTS, "-k", "index_scores"),
           "decode indexer: ReLU of the per-head products dropped"),
    Mutant("index_scores_visible_off_by_one", TRITON, "tl.where(t < tl.load(vis_ptr + row), scores",
           "tl.where(t <= tl.load(vis_ptr + row), scores", (TRITON_TESTS, "-k", "index_scores"),
           "decode indexer: one entry too many visible"),
    # Triton: AdamW
    Mutant("adamw_no_decay", ADAMW, "        master = master * decay\n", "", (f"{GPU}/test_optim_fused_gpu.py",),
           "AdamW: weight decay not applied"),
    Mutant("adamw_no_bias_correction", ADAMW, "denom = tl.sqrt_rn(sq) * inv_bc2 + eps", "denom = tl.sqrt_rn(sq) + eps",
           (f"{GPU}/test_optim_fused_gpu.py",), "AdamW: the second moment's bias correction dropped"),
    Mutant("adamw_remainder_shift", ADAMW, "(bits >> 16).to(tl.int16)", "(bits >> 15).to(tl.int16)",
           (f"{GPU}/test_optim_fused_gpu.py",), "AdamW: the master's high half shifted by 15"),
    # CUDA sparse attention forward
    Mutant("cuda_fwd_sink_dropped", CUDA_FWD, "const float total = l * a + exp2f(s2 - top);",
           "const float total = l * a;", ATTENTION_TESTS, "CUDA forward: the sink left out of the denominator"),
    Mutant("cuda_fwd_no_rescale", CUDA_FWD, "scale[h] = exp2f(run_max[h] - new_max[h]);", "scale[h] = 1.0f;",
           ATTENTION_TESTS, "CUDA forward: O and the sums not rescaled to a new running max"),
    Mutant("cuda_fwd_empty_slots_kept", CUDA_FWD, "& 1)) acc_s(i) = -INFINITY;", "& 1)) acc_s(i) = acc_s(i);",
           ATTENTION_TESTS, "CUDA forward: empty slots not masked"),
    Mutant("cuda_fwd_scale_without_log2e", CUDA_FWD, "ctypes.c_float(scale * LOG2E)", "ctypes.c_float(scale)",
           ATTENTION_TESTS, "CUDA forward: the softmax scale without log2 e"),
    Mutant("cuda_fwd_lse_without_sum", CUDA_FWD, "lse2[out_row + r] = top + log2f(total);", "lse2[out_row + r] = top;",
           ATTENTION_TESTS, "CUDA forward: lse2 without the log of the sum (the backward's P wrong)"),
    Mutant("cuda_fwd_pair_fix", CUDA_FWD, "fix[0] = exp2f(run_max[0] - sm.max_b[row0]);", "fix[0] = 1.0f;",
           ATTENTION_TESTS, "CUDA forward: warpgroup 0's rows not rescaled to the pair's max"),
    # CUDA sparse attention backward (slot gradients, dQ)
    Mutant("cuda_bwd_delta_dropped", CUDA_BWD, "xchg[i * 128 + t] * (acc_s(i) - delta_r[(i >> 1) & 1]) * scale",
           "xchg[i * 128 + t] * acc_s(i) * scale", ATTENTION_TESTS, "CUDA backward: dS without - Delta"),
    Mutant("cuda_bwd_pt_do_dropped", CUDA_BWD, "    wgmma(mma_kv, tP, tDO, acc, false);\n", "",
           ATTENTION_TESTS, "CUDA backward: the kv gradient's P^T dO term dropped"),
    Mutant("cuda_bwd_empty_slots_kept", CUDA_BWD, "((valid >> get<1>(coord(i))) & 1) ? exp2f", "true ? exp2f",
           ATTENTION_TESTS, "CUDA backward: P of empty slots not zeroed"),
    Mutant("cuda_bwd_ds_unscaled", CUDA_BWD, "(acc_s(i) - delta_r[(i >> 1) & 1]) * scale;",
           "(acc_s(i) - delta_r[(i >> 1) & 1]);", ATTENTION_TESTS, "CUDA backward: dS without the softmax scale"),
    # TileLang sparse attention and indexer
    Mutant("tilelang_fwd_no_rescale", TILELANG, "alpha[h] = T.exp2((m_prev[h] - m[h]) * c)",
           "alpha[h] = T.exp2((m_prev[h] - m_prev[h]) * c)", ATTENTION_TESTS,
           "TileLang forward: no rescale to a new running max"),
    Mutant("tilelang_fwd_sink_dropped", TILELANG, "l[h] = l[h] * alpha[h] + T.exp2(Sink2[h0 + h] - lse[h])",
           "l[h] = l[h] * alpha[h]", ATTENTION_TESTS, "TileLang forward: the sink left out of the denominator"),
    Mutant("tilelang_fwd_empty_slots_kept", TILELANG, "T.if_then_else(idx_s[blk * BI + r] >= 0, 0, -T.infinity(f32))",
           "T.if_then_else(idx_s[blk * BI + r] >= -1, 0, -T.infinity(f32))", ATTENTION_TESTS,
           "TileLang forward: empty slots not masked"),
    Mutant("tilelang_bwd_delta_dropped", TILELANG, "acc_s[h, r] * (acc_dp[h, r] - delta[h]) * scale",
           "acc_s[h, r] * acc_dp[h, r] * scale", ATTENTION_TESTS, "TileLang backward: dS without - Delta"),
    Mutant("tilelang_indexer_no_relu", TILELANG, "r_s[m_, t] = T.max(acc[m_, t], 0) * w_s[m_]",
           "r_s[m_, t] = acc[m_, t] * w_s[m_]", ATTENTION_TESTS, "TileLang indexer: ReLU dropped"),
    Mutant("tilelang_indexer_causal_off_by_one", TILELANG, "t0 + t < (query_offset + i0 + i + 1) // ratio",
           "t0 + t <= (query_offset + i0 + i + 1) // ratio", ATTENTION_TESTS,
           "TileLang indexer: one compressed entry too many visible"),
    # Triton: GEMMs on the released FP8/FP4 formats
    Mutant("quant_act_scale_floor", QUANTIZED, "((bits & 0x7FFFFF) != 0).to(tl.int32)",
           "0 * ((bits & 0x7FFFFF) != 0).to(tl.int32)", (QUANTIZED_TESTS,),
           "activation quantization: the UE8M0 scale rounded down (values past 448 clamp)"),
    Mutant("quant_fp4_sign_dropped", QUANTIZED, "(((nib & 7) << 22) | ((nib & 8) << 28))", "((nib & 7) << 22)",
           (QUANTIZED_TESTS,), "FP4 decode: the sign bit dropped"),
    Mutant("quant_fp4_nibble_order", QUANTIZED,
           "lo, hi = _e2m1_to_f32_scaled(packed), _e2m1_to_f32_scaled(packed >> 4)",
           "hi, lo = _e2m1_to_f32_scaled(packed), _e2m1_to_f32_scaled(packed >> 4)", (QUANTIZED_TESTS,),
           "FP4 decode: the two nibbles of a byte swapped"),
    Mutant("quant_weight_scale_k_block", QUANTIZED, "* stride_bsn + kb", "* stride_bsn + kb // 2", (QUANTIZED_TESTS,),
           "FP8/FP4 weights: the scale of K block kb read from block kb // 2"),
    Mutant("quant_swiglu_no_clamp", QUANTIZED, "up = tl.clamp(up, -limit, limit)", "up = up", (QUANTIZED_TESTS,),
           "FP4 experts' fused SwiGLU: the up projection not clamped"),
    Mutant("quant_gemv_scale_k_block", QUANTIZED, "bs_base + kb[None, :] + (offs_n", "bs_base + kb[None, :] // 2 + (offs_n",
           (QUANTIZED_TESTS, "-k", "gemv"), "GEMV (MMA 4): the scale of K block kb read from block kb // 2"),
    Mutant("quant_gemv_even_odd_swapped", QUANTIZED, "a_even, a_odd = tl.split(", "a_odd, a_even = tl.split(",
           (QUANTIZED_TESTS, "-k", "gemv"), "GEMV (MMA 4) on FP4: the even and odd activations swapped"),
]


def check_table(mutants=MUTANTS) -> list[str]:
    """Problems with the table: a substitution that does not match exactly once, or a Python file that no longer
    compiles once mutated (kernels embedded as strings compile only on the GPU machine)."""
    problems = []
    for m in mutants:
        text = (REPO / m.path).read_text()
        count = text.count(m.old)
        if count != 1:
            problems.append(f"{m.id}: {m.path} holds {count} copies of {m.old!r} (needs exactly 1)")
            continue
        try:
            compile(text.replace(m.old, m.new), m.path, "exec")
        except SyntaxError as err:
            problems.append(f"{m.id}: the mutated {m.path} does not compile: {err}")
        for arg in m.tests:
            if arg.startswith(GPU) and not (REPO / arg).is_file():
                problems.append(f"{m.id}: no test file {arg}")
    ids = [m.id for m in mutants]
    problems += [f"duplicate id {i}" for i in sorted({i for i in ids if ids.count(i) > 1})]
    return problems


def run_tests(args, timeout: float) -> tuple[str, str]:
    """pytest -x on ``args`` in a fresh process -> (PASS / FAIL / TIMEOUT, the first failing test or a tail)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line", *args]
    try:
        out = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", f"no result within {timeout:.0f} s"
    text = out.stdout + out.stderr
    if out.returncode == 0:
        summary = re.findall(r"^=* ?(\d+ passed.*?) ?=*$", text, flags=re.MULTILINE)
        return "PASS", summary[-1] if summary else "nothing passed"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.MULTILINE)
    # --tb=line prints "path:line: Error: message": the error says what caught the mutant (a gate, or e.g. an
    # out-of-memory error that would mean the run, not the test, failed)
    errors = re.findall(r"^\S+\.py:\d+: (\w+(?:Error|Exception).*)$", text, flags=re.MULTILINE)
    why = f" [{errors[0][:160]}]" if errors else ""
    return "FAIL", (failed[0] + why) if failed else text[-500:].replace("\n", " | ")


def run_in_copies(mutants, opts, files) -> int:
    """The table with ``opts.jobs`` tree copies at once, the baseline alongside (see the module docstring)."""
    root = Path(tempfile.mkdtemp(prefix="mutants_"))
    ignore = shutil.ignore_patterns(".git", ".gpu", ".venv", ".wt_*", "__pycache__", "*.egg-info")
    workers = []
    for i in range(min(opts.jobs, len(mutants))):
        copy = root / f"tree{i}"
        shutil.copytree(REPO, copy, ignore=ignore)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, str(copy / GPU / "mutate_kernels.py"), "--skip-baseline", "--timeout",
               str(opts.timeout), "--out", str(root / f"rows{i}.txt"), "--only", *(m.id for m in mutants[i :: opts.jobs])]
        with open(root / f"log{i}.txt", "w") as log:
            workers.append(subprocess.Popen(cmd, cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT))
    baseline = None if opts.skip_baseline else run_tests(files, opts.timeout)
    for worker in workers:
        worker.wait()
    rows = [line for i in range(len(workers)) if (root / f"rows{i}.txt").is_file()
            for line in (root / f"rows{i}.txt").read_text().splitlines() if "  # " in line]
    caught = sum(" CAUGHT " in row for row in rows)
    lines = ([] if baseline is None else [f"baseline (unmutated) {' '.join(files)}: {' '.join(baseline)}"])
    lines += [TABLE_HEADER, *rows,
              f"{caught} of {len(mutants)} caught ({len(rows)} run; logs in {root})"]
    print("\n".join(lines), flush=True)
    if opts.out:
        with open(opts.out, "a") as out:
            out.write("\n".join(lines) + "\n")
    return 0 if caught == len(mutants) and (baseline is None or baseline[0] == "PASS") else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="PATTERN", help="run these mutants only (ids or fnmatch patterns)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the unmutated tests first")
    p.add_argument("--check", action="store_true", help="check that every substitution applies, run nothing")
    p.add_argument("--list", action="store_true", help="print the mutants")
    p.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (a hang counts as caught)")
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--jobs", type=int, default=1, help="mutants at once, each in its own copy of the tree")
    opts = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not opts.only or any(fnmatch.fnmatch(m.id, pat) for pat in opts.only)]
    unknown = [pat for pat in opts.only or () if not any(fnmatch.fnmatch(m.id, pat) for m in MUTANTS)]
    if unknown:
        p.error(f"no mutant matches {unknown}; --list shows them")
    if opts.list:
        for m in mutants:
            print(f"{m.id:36} {m.path:42} {m.what}")
        return 0
    problems = check_table(mutants)
    if problems or opts.check:
        print("\n".join(problems) or f"all {len(mutants)} substitutions apply")
        return 1 if problems else 0

    import torch

    if not torch.cuda.is_available():
        p.error("the mutants run the GPU tests: this needs a CUDA GPU (--check runs anywhere)")
    def report(line: str) -> None:
        print(line, flush=True)
        if opts.out:
            with open(opts.out, "a") as out:
                out.write(line + "\n")

    files = sorted({arg for m in mutants for arg in m.tests if arg.startswith(GPU)})
    if opts.jobs > 1:
        return run_in_copies(mutants, opts, files)
    if not opts.skip_baseline:
        start = time.monotonic()
        status, detail = run_tests(files, opts.timeout)
        report(f"baseline (unmutated) {' '.join(files)}: {status} {detail} ({time.monotonic() - start:.0f} s)")
        if status != "PASS":  # skips are allowed (a skipped test catches nothing: its mutants show SURVIVED)
            report("the unmutated tree must pass first")
            return 1
    report(TABLE_HEADER)
    survived = []
    for m in mutants:
        path = REPO / m.path
        original = path.read_text()
        try:
            path.write_text(original.replace(m.old, m.new))
            start = time.monotonic()
            status, detail = run_tests(m.tests, opts.timeout)
        finally:
            path.write_text(original)
        result = {"FAIL": "CAUGHT", "TIMEOUT": "CAUGHT", "PASS": "SURVIVED"}[status]
        if status == "TIMEOUT":
            detail = f"(hang) {detail}"
        if result == "SURVIVED":
            survived.append(m.id)
        report(f"{m.id:36} {m.path:42} {result:9} {detail} ({time.monotonic() - start:.0f} s)  # {m.what}")
    report(f"{len(mutants) - len(survived)} of {len(mutants)} caught" + (f"; survived: {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
