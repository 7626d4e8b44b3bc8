"""One command for a run: ``python examples/finetune.py RECIPE.yaml [--section.key=value ...]``.

Started without torchrun, the script is the launcher: it checks everything a worker would refuse at start-up
once, in one process (the recipe's schema and world-size rules, the base checkpoint, creating the CPU demo's
tiny one, the tokenizer, every training and validation row), so an error is printed once and without a
traceback; then it starts ``torch.distributed.run --standalone`` with ``distributed.nproc_per_node`` workers
running the same command, and when they succeed, with ``checkpoint.reload_export``, loads the export back
the way a user would (``reload_export``).  Started by torchrun (or srun: ``RANK`` and ``WORLD_SIZE`` set), the
script is a worker and trains; workers repeat the recipe checks (cheap) and read the data as before.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepseek_v41.training import data as data_lib
from deepseek_v41.training.recipe import RecipeError, validate_world


def is_worker() -> bool:
    """Whether this process was started by torchrun / srun as one rank of a run."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def process_count(recipe: dict) -> int:
    """Processes to start on this machine: ``distributed.nproc_per_node``, else one per visible GPU (nccl)."""
    dist = recipe["distributed"]
    if dist["nproc_per_node"] is not None:
        count = dist["nproc_per_node"]
    elif dist["backend"] == "nccl":
        count = torch.cuda.device_count()
    else:
        raise RecipeError("distributed.nproc_per_node is not set: give the number of processes to start on this "
                          "machine, e.g. --distributed.nproc_per_node=2")
    if dist["backend"] == "nccl":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise RecipeError("distributed.backend=nccl needs CUDA GPUs and none is visible here; on CPU use "
                              "--distributed.backend=gloo --distributed.nproc_per_node=N")
        if count > gpus:
            raise RecipeError(f"distributed.nproc_per_node={count} but {gpus} GPU(s) are visible: one process per "
                              f"GPU; set --distributed.nproc_per_node={gpus} or fewer")
    return count


class PreflightError(Exception):
    """A check of the launcher failed; the message names what and how to fix it (printed without traceback)."""


def preflight(recipe: dict, world: int) -> None:
    """Everything the workers would refuse at start-up, checked once before any of them starts."""
    from deepseek_v41.training.model_setup import check_checkpoint

    validate_world(recipe, world)  # RecipeError: printed by the caller as a recipe error
    stages = (
        ("base checkpoint", lambda: check_checkpoint(recipe, 0, barrier=False)),
        ("tokenizer", lambda: data_lib.load_tokenizer(
            recipe["tokenizer"]["path"], recipe["model"]["config"]["pretrained_model_name_or_path"])),
        ("data", lambda: data_lib.check_datasets(recipe, world)),
    )
    for what, check in stages:
        try:
            check()
        except (ValueError, OSError, ImportError) as err:
            raise PreflightError(f"{what}: {err}") from None
    if recipe["wandb"]["enable"]:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise PreflightError("wandb.enable=true needs the wandb package: pip install wandb "
                                 "(or --wandb.enable=false)") from None


def launch_workers(script: str, args: list, nproc: int) -> int:
    """``torchrun --standalone --nproc_per_node nproc script *args`` -> its exit status."""
    env = dict(os.environ)
    # torchrun would set 1 with a warning; the cores shared out over the workers instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           script, *args]
    print(f"[finetune] starting {nproc} worker process(es): torchrun --standalone --nproc_per_node {nproc} "
          f"{' '.join([script, *args])}", flush=True)
    process = subprocess.Popen(cmd, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:  # the workers got the same Ctrl-C (one process group): let them stop
        process.wait()
        return 130


def validation_history(output_dir) -> list:
    """The run's validation records (``metrics.jsonl``), oldest first."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "val_accuracy" in r]


def reload_export(recipe: dict, max_new_tokens: int = 20) -> dict:
    """Load ``checkpoint.export_dir`` as a user without this package would: in a fresh process where
    ``import deepseek_v41`` fails (``reload_export.py``), ``AutoModelForCausalLM.from_pretrained(folder,
    trust_remote_code=True)`` on CPU; print a greedy continuation of the first validation prompt and the
    validation accuracy before fine-tuning, after it, and of the reloaded export -> the reload's results."""
    folder = recipe["checkpoint"]["export_dir"]
    vs, ds = recipe["validation_dataset"], recipe["dataset"]
    rows = data_lib.read_hellaswag(vs["path_or_dataset"], vs["split"], vs["num_samples_limit"])
    # the rows tokenized exactly as the run's validation tokenized them
    choices = data_lib.HellaSwagChoices(rows, data_lib.load_tokenizer(folder), ds["max_length"])
    request = {"prompt": rows[0]["ctx"], "max_new_tokens": max_new_tokens, "examples": choices.examples,
               "multiple": ds["pad_seq_len_divisible"], "chunk": 4}  # 4 examples: 16 rows of fp32 logits a forward
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        request_file, result_file = Path(scratch) / "request.json", Path(scratch) / "result.json"
        request_file.write_text(json.dumps(request))
        status = subprocess.run([sys.executable, str(Path(__file__).with_name("reload_export.py")), str(folder),
                                 str(request_file), str(result_file)], stdin=subprocess.DEVNULL, check=False).returncode
        if status:
            raise RuntimeError(f"reloading the export {folder} failed (exit status {status}); its error is above")
        reloaded = json.loads(result_file.read_text())
    print(f"[finetune] loaded {folder} in a fresh process where deepseek_v41 cannot be imported, with "
          f"AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True): {reloaded['model_class']} "
          f"(the folder's own code), {reloaded['parameters'] / 1e6:.1f} M parameters; "
          f"{time.perf_counter() - t0:.1f} s with the scoring below", flush=True)
    print(f"[finetune] greedy continuation of a validation prompt ({max_new_tokens} new tokens):\n"
          f"  prompt:     {rows[0]['ctx']}\n  generated:  {reloaded['continuation']}\n"
          f"  gold:       {rows[0]['endings'][rows[0]['label']]}", flush=True)
    history = validation_history(recipe["output_dir"])
    before = next((r for r in history if r["step"] == 0), None)
    after = history[-1] if history and history[-1]["step"] > 0 else None
    chance = sum(1 / len(r["endings"]) for r in rows) / len(rows)
    parts = [f"before fine-tuning {before['val_accuracy']:.3f}" if before else
             "before fine-tuning not measured (step_scheduler.val_at_start=false)"]
    if after:
        parts.append(f"after {after['val_accuracy']:.3f} (step {after['step']})")
    parts.append(f"the reloaded export {reloaded['val_accuracy']:.3f} ({reloaded['val_correct']} of "
                 f"{reloaded['val_examples']})")
    losses = (f"the run {after['val_loss']:.4f}, " if after else "") + f"the reloaded export {reloaded['val_loss']:.4f}"
    print(f"[finetune] validation accuracy (HellaSwag: the ending with the best mean log-likelihood per token; "
          f"chance {chance:.2f}): {', '.join(parts)}; validation loss: {losses}", flush=True)
    return {**reloaded, "before": before, "after": after}


def main(recipe: dict, script: str, args: list, check_only: bool = False) -> int:
    """The launcher: checks, workers, then the export's reload -> the exit status."""
    try:
        nproc = process_count(recipe)
        preflight(recipe, nproc)
    except RecipeError as err:
        print(f"recipe error: {err}", file=sys.stderr)
        return 2
    except PreflightError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if check_only:
        print(f"[finetune] recipe, base checkpoint, tokenizer and data are fine for {nproc} process(es)")
        return 0
    status = launch_workers(script, args, nproc)
    if status:
        print(f"[finetune] the run failed (exit status {status}); the workers' errors are above", file=sys.stderr)
        return status
    if recipe["checkpoint"]["reload_export"] and not recipe["checkpoint"]["export_dir"]:
        print("[finetune] checkpoint.reload_export: nothing to reload, checkpoint.export_dir is null")
    elif recipe["checkpoint"]["reload_export"]:
        try:
            reload_export(recipe)
        except RuntimeError as err:
            print(f"[finetune] {err}", file=sys.stderr)
            return 1
    return 0
