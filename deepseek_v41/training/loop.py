"""The fine-tuning run: process group, sharded model, data, optimizer, prewarm, updates, validation, metrics.

Loss normalization (training_recipe.md §5): fp32 cross-entropy summed over the supervised tokens of the
whole global batch and divided by their count.  Each rank back-propagates ``local_sum * W / global_count``,
so the FSDP mean over ``W`` ranks gives exactly the global-batch gradient.  Gradients that are *sums* over
ranks instead (EP experts, filled by the all-to-all backward and, with ``ep_shard > 1``, summed by their
reduce-scatter over ``ep_shard``; Engram rows, filled by all-to-all backward; replicated ``attn_sink`` after
its all-reduce) are divided by ``W`` exactly once, before clipping.

With ``model.dspark_loss_weight`` = w > 0 the DSpark draft stages train too (``dspark_loss.py``): their loss is
normalized the same way over the global batch's drafted positions, weighted by w, and their gradients are clipped
apart from the backbone's, whose updates and logged ``loss`` / ``grad_norm`` are then exactly those of a run without.

Validation scores every ending of each validation example (``score_choices``): the validation loss is the CE of
the gold endings (summed over their tokens, divided by their count, like the training loss), the accuracy the
share of examples whose gold ending has the highest mean log-likelihood per token (HellaSwag multiple choice).
"""

import gc
import json
import math
import os
import random
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from deepseek_v41.dspark_loss import draft_count
from deepseek_v41.modeling_deepseek_v41 import causal_lm_targets
from deepseek_v41.training import checkpointing
from deepseek_v41.training import data as data_lib
from deepseek_v41.training.checkpointing import Checkpointer, CheckpointUnusable, resolve_resume
from deepseek_v41.training.engram_owner import apply_row_owner_engram, engram_modules
from deepseek_v41.training.expert_parallel import (
    apply_expert_parallel,
    expert_global_mesh,
    routed_expert_modules,
)
from deepseek_v41.training.fsdp import parallelize, trained_blocks
from deepseek_v41.training.model_setup import build_config, build_meta_model, check_checkpoint
from deepseek_v41.training.optim import build_optimizer, clip_grad_norm_, describe_schedule, lr_at
from deepseek_v41.training.plan import check_layout
from deepseek_v41.training.recipe import RecipeError, recipe_notes, validate_world
from deepseek_v41.training.sharded_load import load_sharded_checkpoint


class Trainer:
    """Everything one rank holds for a run; ``fit()`` runs the updates."""

    def __init__(self, recipe: dict):
        self.recipe = recipe
        self.rank, self.world, self.device = _init_distributed(recipe["distributed"]["backend"])
        validate_world(recipe, self.world)
        # Checked before the model is built: a changed recipe or an incomplete folder fails in seconds; the
        # files' checksums are compared while the folder loads (the reads overlap the load).
        self.resume_dir, self.resume_meta = resolve_resume(recipe, self._print, defer_checksums=True)
        _seed_everything(recipe["seed"])
        self.out_dir = Path(recipe["output_dir"])
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = check_checkpoint(recipe, self.rank)
        self.tokenizer = data_lib.load_tokenizer(recipe["tokenizer"]["path"], self.path)
        self._print(check_layout(recipe, build_config(recipe, self.path), self.world, self.device, self.tokenizer))
        self._build_model()
        self._build_data()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.dspark_weight = recipe["model"]["dspark_loss_weight"]
        self.params = [p for n, p in named if not n.startswith("mtp.")]  # the DSpark stages, when trained, apart
        self.stage_params = [p for n, p in named if n.startswith("mtp.")]
        self.optimizer = build_optimizer(named, recipe["optimizer"], self.device.type)
        self.optimizer_impl = self.optimizer.impl  # what optimizer.impl resolved to (logs, checkpoints)
        decayed = sum(len(g["params"]) for g in self.optimizer.param_groups if g["weight_decay"])
        self._print(f"[finetune] optimizer {self.optimizer_impl}: weight decay on {decayed} of "
                    f"{len(named)} parameter tensors")
        self.wandb = _init_wandb(recipe) if self.rank == 0 and recipe["wandb"]["enable"] else None
        self.checkpointer = Checkpointer(self)

    # ---- model -------------------------------------------------------------------------------------
    def _build_model(self):
        r = self.recipe
        ep = r["distributed"]["ep_size"]
        self.model = build_meta_model(r, self.path, self.tokenizer)
        self.ep_mesh = init_device_mesh(self.device.type, (self.world // ep, ep), mesh_dim_names=("ep_shard", "ep"))
        dispatcher = self.model.config.backend["dispatcher"]
        if ep > 1 and dispatcher == "local":
            raise ValueError(
                f"distributed.ep_size={ep} needs an expert-parallel dispatcher; set "
                "--model.config.backend.dispatcher=torch (all-to-all)"
            )
        expert_params = apply_expert_parallel(self.model, self.ep_mesh, dispatcher)
        self.engram_group = dist.new_group(list(range(self.world)))
        table_params = apply_row_owner_engram(self.model, self.engram_group)
        self.dp_mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        self.expert_global_mesh = expert_global_mesh(self.ep_mesh)  # the experts' [E, ...] layout (checkpoints)
        ep_shard = self.ep_mesh["ep_shard"]
        parallelize(self.model, self.dp_mesh, r["fsdp"], r["model"]["lm_head_precision"],
                    set(expert_params) | set(table_params), expert_mesh=ep_shard if ep_shard.size() > 1 else None)
        self.model.to_empty(device=self.device)
        # to_empty may replace Parameter objects: collect the special groups again from their modules.
        self.expert_params = [p for m in routed_expert_modules(self.model) for p in m.parameters()]
        self.table_params = [m.embed.weight for m in engram_modules(self.model)]
        self.replicated = [block.attn.attn_sink for block in trained_blocks(self.model)]
        load_sharded_checkpoint(self.model, self.path, dequantize=r["model"]["dequantize_base_checkpoint"])
        self.model.train()

    # ---- data --------------------------------------------------------------------------------------
    def _build_data(self):
        r = self.recipe
        ds, vs, steps = r["dataset"], r["validation_dataset"], r["step_scheduler"]
        text = self.model.config.text_config
        self.hasher = None
        if ds["precompute_engram_hashes"] and text.engram_layer_ids:
            from deepseek_v41.engram_hashing import EngramHasher

            self.hasher = EngramHasher.from_config(text, self.tokenizer)
        self.pad_id = self.model.config.pad_token_id
        rows = data_lib.read_hellaswag(ds["path_or_dataset"], ds["split"], ds["num_samples_limit"])
        self.train_set = data_lib.HellaSwagSFT(rows, self.tokenizer, ds["max_length"])
        vrows = data_lib.read_hellaswag(vs["path_or_dataset"], vs["split"], vs["num_samples_limit"])
        self.val_set = data_lib.HellaSwagChoices(vrows, self.tokenizer, ds["max_length"])
        self.sampler = data_lib.UpdateSampler(
            len(self.train_set), steps["global_batch_size"], steps["local_batch_size"], self.rank, self.world,
            r["seed"], ds["shuffle"],
        )
        available = self.sampler.updates_per_epoch * steps["num_epochs"]
        self.max_steps = min(steps["max_steps"], available)
        if self.max_steps < steps["max_steps"] and self.rank == 0:
            print(f"[finetune] the data covers {available} updates ({steps['num_epochs']} epoch(s)); "
                  f"stopping there instead of max_steps={steps['max_steps']}", flush=True)
        self.val_batches = data_lib.validation_batches(len(self.val_set), vs["local_batch_size"], self.rank, self.world)
        schedule, warnings = describe_schedule(r["lr_scheduler"], r["optimizer"]["lr"], self.max_steps)
        self._print(schedule)
        for note in warnings + recipe_notes(r, self.max_steps):
            self._print(f"[finetune] note: {note}")

    def _batch(self, dataset, indices):
        batch = data_lib.collate([dataset[i] for i in indices], self.pad_id,
                                 self.recipe["dataset"]["pad_seq_len_divisible"], self.hasher)
        return self._to_device(batch)

    def _choices_batch(self, indices):
        batch, groups = data_lib.collate_choices([self.val_set[i] for i in indices], self.pad_id,
                                                 self.recipe["dataset"]["pad_seq_len_divisible"], self.hasher)
        return self._to_device(batch), groups

    def _to_device(self, batch):
        out = {k: v.to(self.device) for k, v in batch.items() if k != "engram_hash_ids"}
        if "engram_hash_ids" in batch:
            out["engram_hash_ids"] = {k: v.to(self.device) for k, v in batch["engram_hash_ids"].items()}
        return out

    # ---- steps -------------------------------------------------------------------------------------
    def _forward(self, batch) -> tuple:
        return summed_loss(self.model, batch)

    def _all_sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().to(torch.float64).clone()
        dist.all_reduce(value)
        return value

    def compute_gradients(self, update: int) -> dict:
        """Forward/backward of every micro-batch of ``update``; gradients end as global-batch means."""
        batches = [self._batch(self.train_set, idx) for idx in self.sampler.micro_batches(update)]
        counts = torch.stack([supervised_count(b) for b in batches])
        global_count = self._all_sum(counts.sum()).clamp(min=1)
        tokens = self._all_sum(sum(b["attention_mask"].sum() for b in batches))
        if self.dspark_weight:
            return self._gradients_with_dspark(batches, global_count, tokens)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in batches:
            summed, _ = self._forward(batch)
            (summed * (self.world / global_count.float())).backward()
            loss_sum += summed.detach().double()
        self._finish_gradients()
        return {"loss": float(self._all_sum(loss_sum) / global_count), "tokens": float(tokens)}

    def _gradients_with_dspark(self, batches, global_count, tokens) -> dict:
        """``compute_gradients`` with the DSpark stages' loss (``model.dspark_loss_weight`` = w): each rank
        back-propagates ``lm_sum * W / global_count + w * stage_sum * W / global_drafted``, the stages' loss being
        normalized over the drafted positions of the global batch as the LM loss is over its labels."""
        block = self.model.config.text_config.dspark_block_size
        drafted = self._all_sum(sum(draft_count(b["labels"], b["attention_mask"], block) for b in batches))
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # LM CE, draft CE, confidence BCE, correct
        for batch in batches:
            out = self.model(**batch)
            summed = out.lm_loss * supervised_count(batch)
            n = out.dspark_positions
            draft, confidence = out.dspark_loss * n, out.dspark_confidence_loss * n
            ((summed * (self.world / global_count.float()))
             + (draft + confidence) * (self.dspark_weight * self.world / drafted.clamp(min=1).float())).backward()
            sums += torch.stack([summed, draft, confidence, out.dspark_accuracy * n]).detach().double()
        self._finish_gradients()
        sums = self._all_sum(sums)
        per = drafted.clamp(min=1)
        return {"loss": float(sums[0] / global_count), "tokens": float(tokens), "dspark_loss": float(sums[1] / per),
                "dspark_confidence_loss": float(sums[2] / per), "dspark_accuracy": float(sums[3] / per)}

    def train_step(self, update: int) -> dict:
        stats = self.compute_gradients(update)
        max_norm = self.recipe["clip_grad_norm"]["max_norm"]
        max_norm = max_norm if max_norm else math.inf
        replicas = {p: self.world for p in self.replicated}  # experts: disjoint shards, each element counted once
        # the DSpark stages are clipped on their own: their loss leaves the backbone's update exactly as without it
        grad_norm = clip_grad_norm_(self.params, max_norm, replicas=replicas)
        if self.dspark_weight:
            stats["dspark_grad_norm"] = float(clip_grad_norm_(self.stage_params, max_norm, replicas=replicas))
        lr = lr_at(update, self.recipe["lr_scheduler"], self.recipe["optimizer"]["lr"])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": float(grad_norm), "lr": lr}

    def _finish_gradients(self):
        average_summed_gradients(self.replicated, list(self.expert_params) + list(self.table_params), self.world)

    @torch.no_grad()
    def validate(self) -> dict:
        """-> {"val_loss", "val_accuracy"} over every rank's validation examples (see ``score_choices``)."""
        stats = torch.zeros(4, dtype=torch.float64, device=self.device)
        for indices in self.val_batches:
            stats += score_choices(self.model, *self._choices_batch(indices))
        return validation_record(self._all_sum(stats))

    def _validate_and_record(self, step, metrics, records):
        val = {"step": step, **self.validate()}
        records.append(val)
        self._emit(metrics, val)
        when = "before the first update" if step == 0 else f"step {step}"
        self._print(f"[finetune] {when}: validation loss {val['val_loss']:.4f}, accuracy {val['val_accuracy']:.3f} "
                    f"({val['val_correct']} of {val['val_examples']} examples: the gold ending scored best)")

    def prewarm(self):
        """Before the first timed update: build the TileLang kernels for every [batch, seq] shape the data
        can produce, then one forward+backward on the first micro-batch (EP and Engram exchanges, FSDP
        collectives, allocator and kernel caches).  Gradients are discarded; nothing is updated."""
        if self.model.config.backend["attn"] == "tilelang":
            try:
                from deepseek_v41.kernels_tilelang import tilelang_shapes_for, warmup_tilelang_kernels
            except ImportError:
                tilelang_shapes_for = None
            if tilelang_shapes_for is not None:
                multiple = self.recipe["dataset"]["pad_seq_len_divisible"]
                shapes = set()
                longest = max(len(ids) for ids, _ in self.train_set.examples)
                shapes |= {(self.sampler.lbs, s) for s in range(multiple, -(-longest // multiple) * multiple + 1,
                                                                multiple)}
                for indices in self.val_batches:  # every ending of each example: exactly the shapes it will run
                    rows = [row for i in indices for row in self.val_set[i][0]]
                    shapes.add((len(rows), -(-max(len(ids) for ids, _ in rows) // multiple) * multiple))
                text = self.model.config.text_config
                specs = [spec for b, s in sorted(shapes) for spec in tilelang_shapes_for(text, b, s)]
                built = warmup_tilelang_kernels(specs, self.device)
                self._print(f"[finetune] TileLang kernels ready for {len(shapes)} shapes ({built} kernels)")
        batch = self._batch(self.train_set, self.sampler.micro_batches(0)[0])
        summed, _ = self._forward(batch)
        (summed * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        dist.barrier()

    def fit(self) -> list:
        r = self.recipe
        val_every, log_every = r["step_scheduler"]["val_every_steps"], r["log_every_steps"]
        metrics_path = self.out_dir / "metrics.jsonl"
        records = []
        if r["prewarm"]:
            t0 = time.perf_counter()
            self.prewarm()
            self._print(f"[finetune] prewarm done in {time.perf_counter() - t0:.1f} s")
        # After prewarm, so the restored RNG states are the ones the next update would have seen.
        self.first_step = self._resume()
        save_every = r["checkpoint"]["save_every_steps"]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start, train_time, train_tokens = time.perf_counter(), 0.0, 0.0
        with _open_metrics(metrics_path, self.first_step) if self.rank == 0 else _NullFile() as metrics:
            if val_every and r["step_scheduler"]["val_at_start"] and self.first_step == 0:
                self._validate_and_record(0, metrics, records)
            for update in range(self.first_step, self.max_steps):
                t0 = time.perf_counter()
                stats = self.train_step(update)
                step_time = time.perf_counter() - t0
                train_time += step_time
                train_tokens += stats["tokens"]
                step = update + 1
                record = {"step": step, "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
                          "tokens_per_s": stats["tokens"] / step_time}
                record.update((k, v) for k, v in stats.items() if k.startswith("dspark_"))  # the stages' loss, if on
                records.append(record)
                self._emit(metrics, record)
                if step % log_every == 0 or step == self.max_steps:
                    self._progress(step, record, time.perf_counter() - start)
                if val_every and (step % val_every == 0 or step == self.max_steps):
                    self._validate_and_record(step, metrics, records)
                if save_every and (step % save_every == 0 or step == self.max_steps):
                    self.checkpointer.save(step)
                if step % 10 == 0:
                    gc.collect()
        self.checkpointer.wait()  # an async save still in flight is committed before the run reports done
        self._summary(train_tokens / max(train_time, 1e-9), time.perf_counter() - start)
        if r["checkpoint"]["export_dir"]:
            from deepseek_v41.training.export import export_model

            export_model(self, r["checkpoint"]["export_dir"], r["checkpoint"]["export_quantize"])
        return records

    def _resume(self) -> int:
        """Completed updates to continue from: 0, or the step of ``checkpoint.resume_from``."""
        if self.resume_dir is None:
            if self.recipe["checkpoint"]["resume_from"] == "latest":
                self._print("[finetune] checkpoint.resume_from=latest: no checkpoint yet, starting at step 0")
            return 0
        step = self._load_resume_folder()
        if step > self.max_steps:
            raise ValueError(f"{self.resume_dir} is at step {step}, past this run's {self.max_steps} updates; "
                             "raise step_scheduler.max_steps")
        self._print(f"[finetune] resumed from {self.resume_dir} at step {step}")
        return step

    def _load_resume_folder(self) -> int:
        """Load ``self.resume_dir``, comparing its checksums meanwhile; with ``resume_from: latest`` a folder that
        vanished since start-up or turned out damaged makes way for the newest intact one left (checked in full
        before it loads; a full load replaces whatever the first one had loaded)."""
        resume = self.recipe["checkpoint"]["resume_from"]
        verify = self.recipe["checkpoint"]["verify_checksums"]
        while True:
            try:
                return self.checkpointer.load(self.resume_dir, self.resume_meta, verify=verify)
            except CheckpointUnusable as err:
                if resume != "latest":
                    raise RecipeError(f"checkpoint.resume_from={resume!r}: {err}. Resume from another step_* "
                                      "folder, or use checkpoint.resume_from=latest (the newest intact one)") from None
                self._print(f"[finetune] resume_from=latest: {err}; falling back to the newest intact step")
                folder, meta = resolve_resume(self.recipe, self._print)
                if folder is None:
                    raise RecipeError(f"resume_from=latest: {err}, and no intact step is left under "
                                      f"{checkpointing.checkpoint_root(self.recipe)}; start again (resume_from: null starts at step "
                                      "0 from the base checkpoint)") from None
                self.resume_dir, self.resume_meta, verify = folder, meta, False  # its checksums were just compared

    # ---- reporting ---------------------------------------------------------------------------------
    def _emit(self, metrics, record):
        if self.rank == 0:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _progress(self, step, record, elapsed):
        total = self.max_steps
        width = 24
        filled = int(width * step / total)
        eta = elapsed / (step - self.first_step) * (total - step)
        self._print(
            f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} | loss {record['loss']:.4f} | "
            f"grad_norm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
            + (f"dspark {record['dspark_loss']:.4f} (acc {record['dspark_accuracy']:.3f}) | " if "dspark_loss" in record
               else "") +
            f"{record['tokens_per_s']:.0f} tok/s | {elapsed:.0f}s elapsed, eta {eta:.0f}s"
        )

    def _summary(self, tokens_per_s, wall):
        if self.device.type == "cuda":
            peak = torch.tensor(torch.cuda.max_memory_allocated(self.device) / 2**30, device=self.device)
            what = "GPU memory allocated"
        else:
            peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # KiB -> GiB
            what = "resident memory (RSS)"
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        self._print(f"[finetune] done: {self.max_steps - self.first_step} updates in {wall:.1f} s, "
                    f"{tokens_per_s:.1f} tokens/s "
                    f"(global, training steps only), peak {what} {float(peak):.2f} GiB per rank")

    def _print(self, text):
        if self.rank == 0:
            print(text, flush=True)


def supervised_count(batch: dict) -> torch.Tensor:
    """The number of predicted tokens the loss averages over: labels[:, 1:] not ignored and not padding."""
    return ((batch["labels"][:, 1:] != data_lib.IGNORE_INDEX) & (batch["attention_mask"][:, 1:] != 0)).sum()


def summed_loss(model, batch: dict) -> tuple:
    """-> (CE summed over the batch's supervised tokens, their count); the model's loss is their mean."""
    count = supervised_count(batch)
    return model(**batch).loss * count, count


def score_choices(model, batch: dict, groups: list) -> torch.Tensor:
    """One forward over every ending row of a validation batch (``data.collate_choices``) -> float64 [4]: the
    gold endings' summed CE, their token count, the examples whose gold ending has the highest mean
    log-likelihood per token, and the examples.  An ending with no token left (empty) is never chosen."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # fp32 [rows, s, vocab]
    rows, seq = batch["input_ids"].shape
    targets = causal_lm_targets(batch["labels"], batch["attention_mask"])
    scored = (targets != data_lib.IGNORE_INDEX).nonzero().squeeze(1)  # the endings' tokens: log-softmax only there
    token_nll = F.cross_entropy(logits.view(-1, logits.shape[-1])[scored], targets[scored], reduction="none")
    nll = torch.zeros(rows, dtype=torch.float64, device=logits.device).index_add_(
        0, scored // seq, token_nll.double())
    count = (targets.view(rows, seq) != data_lib.IGNORE_INDEX).sum(1)
    mean_ll = torch.where(count > 0, -nll / count.clamp(min=1), -math.inf)
    stats = torch.zeros(4, dtype=torch.float64, device=nll.device)
    for first, endings, label in groups:
        stats[0] += nll[first + label]
        stats[1] += count[first + label]
        stats[2] += int(torch.argmax(mean_ll[first : first + endings]).item() == label)
        stats[3] += 1
    return stats


def validation_record(stats: torch.Tensor) -> dict:
    """``score_choices`` sums (over batches and ranks) -> the validation metrics."""
    loss_sum, tokens, correct, examples = stats.tolist()
    return {"val_loss": loss_sum / max(tokens, 1), "val_accuracy": correct / max(examples, 1),
            "val_correct": int(correct), "val_examples": int(examples)}


def average_summed_gradients(replicated: list, summed: list, world: int) -> None:
    """Turn gradients that are sums over ranks into means over ranks, exactly once.

    ``replicated`` (e.g. ``attn_sink``) hold only their own rank's contribution: all-reduced, then / W.
    ``summed`` (EP experts, also after their ``ep_shard`` reduce-scatter; Engram owner rows) already hold the sum
    over every rank's tokens: / W.
    FSDP-managed gradients are means already and are not touched.
    """
    for p in replicated:
        if p.grad is not None:
            dist.all_reduce(p.grad)
    for p in list(replicated) + list(summed):
        if p.grad is not None:
            p.grad.div_(world)


def _open_metrics(path: Path, first_step: int):
    """metrics.jsonl for writing; on resume, keep the records up to ``first_step`` and append after them.

    A truncated last line (the run was killed mid-write) is dropped with a message; any other line that
    is not a JSON record with a ``step`` is an error naming the file and line.
    """
    if first_step == 0 or not path.is_file():
        return open(path, "w")
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError) as err:
            if number == len(lines):
                print(f"[finetune] {path} line {number} is incomplete (an interrupted write): dropped", flush=True)
                continue
            raise ValueError(f"{path} line {number} is not a metrics record ({err}): repair or delete that line, "
                             "or move the file away, then resume again") from None
        if step <= first_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))
    return open(path, "a")


class _NullFile:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _init_distributed(backend: str) -> tuple:
    if "RANK" not in os.environ:
        raise RuntimeError("launch with torchrun, e.g. torchrun --nproc_per_node 2 examples/finetune.py RECIPE.yaml")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("distributed.backend=nccl needs CUDA GPUs; on CPU use --distributed.backend=gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def _seed_everything(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


def _init_wandb(recipe):
    import wandb

    cfg = recipe["wandb"]
    run = wandb.init(project=cfg["project"], name=cfg["name"], mode=cfg["mode"], dir=cfg["dir"], config=recipe)
    return run


def run(recipe: dict) -> list:
    """Train with ``recipe`` (already parsed); returns the metric records (rank 0 writes metrics.jsonl).

    An exception on one rank must not leave the others waiting forever in a collective: with several
    ranks, the failing one prints its traceback under its rank and exits non-zero at once, and torchrun
    then stops every other rank.  A recipe error (the same on every rank) is printed once, by rank 0, without
    a traceback.  With one rank the exception goes on to the caller, the process groups freed first.
    """
    trainer = None
    try:
        trainer = Trainer(recipe)
        records = trainer.fit()
    except BaseException as exc:
        if dist.is_initialized() and dist.get_world_size() > 1:
            sys.stdout.flush()
            if isinstance(exc, RecipeError):
                if dist.get_rank() == 0:
                    sys.stderr.write(f"recipe error: {exc}\n")
            else:
                sys.stderr.write(f"[finetune] rank {dist.get_rank()} failed; stopping every rank:\n"
                                 f"{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)  # no interpreter shutdown: the live groups' gloo workers cannot abort it
        # on its way out the exception may reach interpreter shutdown, which the groups must not outlive
        trainer = None
        release_process_groups(exc)
        raise
    dist.barrier()
    trainer = None  # its model, meshes and Engram lookups hold the process groups
    release_process_groups()
    return records


def release_process_groups(failure: BaseException | None = None) -> None:
    """Destroy the process groups and free them, joining their gloo worker threads, before the interpreter
    shuts down.  Call it last, on every rank, once the caller holds no trainer, model or mesh (a test worker:
    after the function holding them returned).  A script calling init_process_group() itself imports this
    module first: torch.distributed.nn, which it pulls in, captures the default group in its functions'
    defaults when imported after the group was made.

    destroy_process_group() only unregisters the groups.  A gloo worker drops each finished collective's
    tensors itself, after the caller's wait() returned; a tensor Python has seen makes it take the GIL.  If
    that happens once interpreter shutdown has begun, the thread is unwound through a noexcept destructor and
    the rank dies with SIGABRT ("terminate called without an active exception"), its work done.  Freed here,
    the groups join their workers (their destructor releases the GIL to do so) while the interpreter is whole.

    ``failure``: the exception a one-process caller is about to re-raise (with several ranks a failed one
    exits at once instead, as ``run`` does: a group's worker may be waiting on the peer).  The finished frames
    of its traceback (and of the exceptions it chains), which hold the trainer, are cleared of their locals:
    the printed traceback is unchanged, a post-mortem debugger sees no locals there.  An error while freeing
    is then printed, not raised, and the caller re-raises ``failure``.
    """
    try:
        chained, seen = failure, set()
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)  # skips the executing ones (the caller's)
            chained = chained.__cause__ or chained.__context__
        if dist.is_initialized():
            dist.destroy_process_group()
        # torch's caches keep device meshes, and a mesh its groups, for the life of the process: DTensor's
        # sharding-propagation caches are cleared, and every mesh still alive (in redistribute planners and
        # the like) lets go of its groups (private API and field, each skipped where a torch has none).  No
        # loop variable is left bound to one of gc.get_objects(): it could be a piece of the trainer.
        try:
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        except ImportError:
            pass
        else:
            _clear_sharding_prop_cache()
        registries = [getattr(o, "_pg_registry", {}) for o in gc.get_objects() if isinstance(o, DeviceMesh)]
        for registry in registries:
            registry.clear()
        gc.collect()  # the trainer's reference cycles (its checkpointer points back at it)
    except Exception:  # after a failure, that one is raised (by the caller); this one is shown beside it
        if failure is None:
            raise
        sys.stderr.write(f"[finetune] freeing the process groups after a failure failed too:\n"
                         f"{traceback.format_exc()}")
