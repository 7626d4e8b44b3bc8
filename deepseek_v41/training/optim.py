"""Optimizer, learning-rate schedule and global gradient clipping (training_recipe.md §4).

``RemainderAdamW`` keeps every bf16 parameter as the high half of an exact fp32 master weight; the low half
lives in an int16 "remainder" tensor, so a master costs 2 extra bytes per parameter instead of 4:

    master_bits (32) = bf16_param_bits (high 16) | remainder_bits (low 16)

Each step rebuilds the fp32 master bit-exactly, applies decoupled-weight-decay Adam in fp32 (the same
operations in the same order as ``torch.optim.AdamW``'s single-tensor path), and splits it again, so
``bf16_param`` equals the high half of the master after every step (truncation, not rounding).  Moments may
be stored in bf16 (the recipe's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``); fp32 parameters (the mHC,
sink, compressor and head islands) are updated in place with fp32 moments of the requested dtype.

``fused_adamw_`` is the same update for one tensor written as one elementwise expression (master rebuilt
with int32 bit ops, fp32 math, results ``copy_``-ed back): the documented reference of the one-pass update and
the eager fused path on CPU, where it is bit-identical to the per-op path.  On CUDA the fused path is
``adamw_triton.adamw_triton_``, a hand-written Triton kernel that reads and writes each state tensor once (~18
bytes/element for bf16 params and moments instead of ~130 for the per-op path) with the roundings of the eager
CUDA per-op path (its FMAs, IEEE division and sqrt, the reciprocal multiply of the division by a Python float),
so it is bit-identical to ``fused=False`` on the same GPU (``tests/gpu/test_optim_fused_gpu.py``, H200).
The per-op path (``fused=False``, and the CPU default) stays bit-exact with ``torch.optim.AdamW``.

Transformer Engine's ``FusedAdam`` (``store_param_remainders``) is used instead only when the recipe names it
(``optimizer.impl: te``); ``auto`` resolves to ``torch_remainder``, the path the tests cover.

Weight decay (``param_groups``): only matrices decay.  A parameter with fewer than 2 dimensions (norm
weights, biases, attention sinks, router bias, mHC scales) never does, nor does one whose name matches a
pattern of ``optimizer.no_decay`` (``fnmatch`` on the ``named_parameters`` name; by default the mHC
``hc_*`` matrices, the Engram tables, whose rows a batch rarely touches and which decay would shrink every
update, and the Engram gate's norm scales).
"""

import fnmatch
import math
import sys
import warnings

import torch
import torch.distributed as dist

from deepseek_v41.training.adamw_triton import adamw_triton_, adamw_triton_usable

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    # The rank-local shard of a DTensor (FSDP2 parameter or gradient), else the tensor itself.
    return t.to_local() if hasattr(t, "to_local") else t


def join_master(param_bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """fp32 tensor whose high 16 bits are ``param_bf16``'s and low 16 bits are ``remainder``'s."""
    halves = torch.stack([remainder, param_bf16.view(torch.int16)], dim=-1)  # little-endian: low half first
    return halves.view(torch.float32).squeeze(-1)


def split_master(master: torch.Tensor) -> tuple:
    """fp32 master -> (bf16 high half, int16 low half), both exact bit copies."""
    halves = master.unsqueeze(-1).view(torch.int16)  # [..., 2]
    return halves[..., 1].view(torch.bfloat16), halves[..., 0]


def _adamw_scalars(lr, beta1, beta2, eps, weight_decay, step) -> tuple:
    """This step's scalar factors, in Python double exactly as ``torch.optim.AdamW`` computes them (each op then
    rounds its scalar to fp32 once): ``(decay, 1 - beta1, beta2, 1 - beta2, eps, bias_correction2_sqrt,
    -lr / bias_correction1, 1 / bias_correction2_sqrt)``.  Shared by the per-op and fused paths so both see the
    same fp32 values.  The last is the reciprocal that eager CUDA multiplies by where the per-op path divides by
    the Python float (taken in double, then rounded: fp32 1/fp32(x) differs from it at some steps)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    return (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, bias_correction2_sqrt, -(lr / bias_correction1),
            1 / bias_correction2_sqrt)


def fused_adamw_(param, remainder, grad, exp_avg, exp_avg_sq, scalars) -> None:
    """One tensor's AdamW update in place, as one elementwise expression: the fused path on CPU (eager) and the
    reference of ``adamw_triton.adamw_triton_``, the CUDA fused path (``torch.compile`` also fuses it to one kernel).

    ``param`` is bf16 with its int16 ``remainder`` or fp32 with ``remainder=None``; ``grad`` any float dtype;
    moments bf16 or fp32 storage.  ``scalars`` is a fp32 tensor ``[8]`` on ``param``'s device holding
    ``_adamw_scalars(...)``: a tensor rather than floats, so one compiled graph serves every step and LR.
    """
    decay, weight1, beta2, weight2, eps, bias_correction2_sqrt, step_size, _ = scalars.unbind(0)
    grad = grad.float()
    if remainder is None:
        master = param.float()
    else:  # join_master without torch.stack: high half sign-extended then shifted, low half zero-extended
        high = param.view(torch.int16).to(torch.int32) << 16
        master = (high | (remainder.to(torch.int32) & 0xFFFF)).view(torch.float32)
    # The CPU kernels of lerp_ and addcmul_ use FMAs (vectorized), so separate mul/add are not bit-identical: call the
    # same ops.  addcmul(s * beta2, weight2 * g, g) == s.mul_(beta2).addcmul_(g, g, value=weight2), since the
    # kernel computes (value * t1) * t2 and multiplying by value=1 is exact; likewise for addcdiv.
    new_avg = torch.lerp(exp_avg.float(), grad, weight1)
    new_avg_sq = torch.addcmul(exp_avg_sq.float() * beta2, weight2 * grad, grad)
    denom = new_avg_sq.sqrt() / bias_correction2_sqrt + eps
    master = torch.addcdiv(master * decay, step_size * new_avg, denom)
    if remainder is None:
        param.copy_(master)
    else:  # split_master: arithmetic shift keeps the high half's sign; (b << 16) >> 16 sign-extends the low half
        bits = master.view(torch.int32)
        param.copy_((bits >> 16).to(torch.int16).view(torch.bfloat16))
        remainder.copy_(((bits << 16) >> 16).to(torch.int16))
    exp_avg.copy_(new_avg)  # rounds to bf16 storage once, like the per-op path
    exp_avg_sq.copy_(new_avg_sq)


class RemainderAdamW(torch.optim.Optimizer):
    """AdamW over bf16 params with int16-remainder fp32 masters (and plain fp32 params).

    ``fused``: ``None`` = the one-pass update for CUDA parameters, the per-op path otherwise; ``True`` = the
    one-pass update always (the Triton kernel ``adamw_triton_`` on CUDA, ``fused_adamw_`` eagerly elsewhere);
    ``False`` = the per-op path.  Tensors with fewer than 2 elements or non-contiguous ones always take the per-op
    path, and so do CUDA tensors when Triton is missing (same results, slower; ``fused=True`` warns once).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, fused=None):
        if sys.byteorder != "little":
            raise RuntimeError("RemainderAdamW splits fp32 words into int16 halves and assumes a little-endian host")
        if fused is not None and not isinstance(fused, bool):
            raise ValueError(f"RemainderAdamW(fused={fused!r}): use None (auto), True or False")
        self.fused = fused
        self._warned_no_triton = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    raise TypeError(f"RemainderAdamW takes bf16 or fp32 parameters, got {p.dtype}")

    def _state(self, p, local, group):
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros(local.shape, dtype=group["exp_avg_dtype"], device=local.device)
            state["exp_avg_sq"] = torch.zeros(local.shape, dtype=group["exp_avg_sq_dtype"], device=local.device)
            if local.dtype == torch.bfloat16:
                # The checkpoint's bf16 value is the exact starting master: remainder 0.
                state["remainder"] = torch.zeros(local.shape, dtype=torch.int16, device=local.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("RemainderAdamW does not take a closure")
        device_scalars = {}  # one host->device copy per distinct (scalars, device) per step, not per tensor
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = _local(p)
                state = self._state(p, local, group)
                state["step"] += 1
                scalars = _adamw_scalars(lr, beta1, beta2, eps, wd, float(state["step"]))
                remainder, grad = state.get("remainder"), _local(p.grad)
                tensors = [local, remainder, grad, state["exp_avg"], state["exp_avg_sq"]]
                # 0/1-element tensors (launch-bound either way) and non-contiguous ones take the per-op path, and
                # so do CUDA tensors the kernel does not take (no Triton, a grad dtype it lacks): same results.
                on_cuda = local.device.type == "cuda"
                fused = (self.fused if self.fused is not None else on_cuda) and local.numel() > 1 \
                    and all(t is None or t.is_contiguous() for t in tensors)
                if fused and on_cuda and not adamw_triton_usable(*tensors):
                    fused = False
                    if self.fused and not self._warned_no_triton:
                        warnings.warn("RemainderAdamW(fused=True): the Triton update does not take a CUDA tensor "
                                      f"(Triton missing, or grad dtype {grad.dtype}); it takes the per-op path "
                                      "(same results, slower)", stacklevel=2)
                        self._warned_no_triton = True
                if not fused:
                    self._per_op_update(local, remainder, grad.float(), state, scalars)
                    continue
                key = (scalars, local.device)
                if key not in device_scalars:
                    device_scalars[key] = torch.tensor(scalars, dtype=torch.float32)
                    if local.device.type == "cuda":  # pinned + non_blocking: a pageable copy would sync the GPU
                        device_scalars[key] = device_scalars[key].pin_memory().to(local.device, non_blocking=True)
                if on_cuda:
                    adamw_triton_(*tensors, device_scalars[key])
                else:
                    fused_adamw_(*[t if t is None else t.detach().view(-1) for t in tensors], device_scalars[key])

    @staticmethod
    def _per_op_update(local, remainder, grad, state, scalars):
        # torch.optim.AdamW's single-tensor path, op for op, on the rebuilt fp32 master.
        decay, weight1, beta2, weight2, eps, bias_correction2_sqrt, step_size, _ = scalars
        master = join_master(local, remainder) if remainder is not None else local
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()

        master.mul_(decay)
        exp_avg.lerp_(grad, weight1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=weight2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=step_size)

        if remainder is not None:
            high, low = split_master(master)
            local.copy_(high)
            remainder.copy_(low)
        if state["exp_avg"].data_ptr() != exp_avg.data_ptr():  # bf16 storage: round back once
            state["exp_avg"].copy_(exp_avg)
        if state["exp_avg_sq"].data_ptr() != exp_avg_sq.data_ptr():
            state["exp_avg_sq"].copy_(exp_avg_sq)

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The exact fp32 master of ``p`` (its local shard), for checks and export."""
        local = _local(p)
        if local.dtype != torch.bfloat16:
            return local.detach().clone()
        remainder = self.state[p]["remainder"] if p in self.state else torch.zeros_like(local, dtype=torch.int16)
        return join_master(local.detach(), remainder).clone()


# fnmatch patterns of parameters that never decay (besides every tensor with fewer than 2 dimensions)
NO_DECAY = ["*hc_*", "*engram.embed.weight", "*engram.q_weight", "*engram.k_weight"]


def param_groups(named_params, weight_decay: float, no_decay=None) -> list:
    """``[(name, param), ...]`` -> optimizer groups ``[{decay}, {no decay}]`` (empty groups dropped).

    A parameter decays when it has at least 2 dimensions and its name matches no pattern of ``no_decay``
    (default ``NO_DECAY``).  Each group keeps its parameter names under ``"names"`` for logs and checks.
    """
    patterns = NO_DECAY if no_decay is None else list(no_decay)
    decay = {"params": [], "names": [], "weight_decay": weight_decay}
    keep = {"params": [], "names": [], "weight_decay": 0.0}
    for name, p in named_params:
        group = keep if p.ndim < 2 or any(fnmatch.fnmatchcase(name, pat) for pat in patterns) else decay
        group["params"].append(p)
        group["names"].append(name)
    return [g for g in (decay, keep) if g["params"]]


def build_optimizer(named_params, cfg: dict, device_type: str):
    """``optimizer.impl``: ``te`` (Transformer Engine FusedAdam, only by name) or ``torch_remainder`` / ``auto``
    (ours); ``optimizer.fused`` (null = auto, true, false) is ``RemainderAdamW``'s ``fused``.

    ``named_params``: ``(name, param)`` pairs (or bare parameters, which group by shape alone).  The returned
    optimizer's ``impl`` attribute holds the implementation the recipe resolved to.
    """
    named = [item if isinstance(item, tuple) else (f"param{i}", item) for i, item in enumerate(named_params)]
    groups = param_groups(named, cfg["weight_decay"], cfg.get("no_decay"))
    kwargs = {"lr": cfg["lr"], "betas": tuple(cfg["betas"]), "eps": cfg["eps"]}
    moments = {"exp_avg_dtype": _DTYPES[cfg["exp_avg_dtype"]], "exp_avg_sq_dtype": _DTYPES[cfg["exp_avg_sq_dtype"]]}
    if cfg["impl"] == "te":
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam
        except ImportError as err:
            raise ImportError(
                "optimizer.impl=te needs Transformer Engine (pip install transformer-engine[pytorch]); "
                "or use optimizer.impl=torch_remainder"
            ) from err
        if device_type != "cuda":
            raise RuntimeError("optimizer.impl=te needs a CUDA device; use optimizer.impl=torch_remainder on CPU")
        te_groups = [{k: v for k, v in g.items() if k != "names"} for g in groups]
        optimizer = FusedAdam(te_groups, adam_w_mode=True, bias_correction=True, master_weights=True,
                              master_weight_dtype=torch.float32, store_param_remainders=True, **moments, **kwargs)
        optimizer.impl = "te"
        return optimizer
    optimizer = RemainderAdamW(groups, **kwargs, **moments, fused=cfg.get("fused"))
    optimizer.impl = "torch_remainder"
    return optimizer


def lr_at(step: int, cfg: dict, max_lr: float) -> float:
    """Learning rate for the update that follows ``step`` completed updates (Megatron-style, warmup from 0).

    Linear warmup ``max_lr * step / warmup`` for ``step <= warmup``, then ``cosine``/``linear`` decay to
    ``min_lr`` at ``lr_decay_steps``, ``min_lr`` afterwards.
    """
    warmup, decay, min_lr = cfg["lr_warmup_steps"], cfg["lr_decay_steps"], cfg["min_lr"]
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if cfg["lr_decay_style"] == "constant":
        return max_lr
    if step >= decay:
        return min_lr
    ratio = (step - warmup) / max(1, decay - warmup)
    if cfg["lr_decay_style"] == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def describe_schedule(cfg: dict, max_lr: float, max_steps: int) -> tuple:
    """(the learning-rate schedule as this run resolves it, one line; warnings about parts it never uses)."""
    warmup, decay, style, min_lr = cfg["lr_warmup_steps"], cfg["lr_decay_steps"], cfg["lr_decay_style"], cfg["min_lr"]
    rates = [lr_at(step, cfg, max_lr) for step in range(max_steps)]
    parts = [f"warmup 0 -> {max_lr:g} over updates 1-{warmup + 1}" if warmup else f"starts at {max_lr:g}"]
    if style == "constant":
        parts.append("then constant")
    else:
        parts.append(f"{style} decay to {min_lr:g} by update {decay + 1}, then {min_lr:g}")
    text = (f"[finetune] learning rate: {', '.join(parts)}; this run: {max_steps} updates at "
            f"{rates[0]:.3g} .. {max(rates):.3g} .. {rates[-1]:.3g} (first, peak, last)")
    warnings = []
    if warmup and max_steps <= warmup:
        warnings.append(f"the run ends during the warmup (lr_warmup_steps={warmup} >= {max_steps} updates): the peak "
                        f"lr {max_lr:g} is never reached (highest {max(rates):.3g}); lower lr_warmup_steps to train "
                        "at the peak")
    elif style != "constant" and decay >= max_steps:
        warnings.append(f"the run ends before the decay does (lr_decay_steps={decay} >= {max_steps} updates): the "
                        f"last update runs at {rates[-1]:.3g}, not min_lr {min_lr:g}")
    return text, warnings


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, group=None, replicas=None) -> torch.Tensor:
    """Global L2 clip over rank-local gradient shards; returns the fp32 norm before clipping.

    Sharded gradients (FSDP ``Shard(0)``, routed experts: EP blocks dim-0 sharded again over ``ep_shard``, Engram
    row blocks) hold each element on exactly one rank, so the global sum of squares is one all-reduce of the
    local sums.  ``replicas`` maps a replicated parameter (``attn_sink``) to how many ranks hold the same
    gradient; its squares are divided by that count.
    """
    params = [p for p in params if p.grad is not None]
    device = _local(params[0].grad).device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        g = _local(p.grad).float()
        total += g.square().sum() / (replicas.get(p, 1) if replicas else 1)
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        _local(p.grad).mul_(scale)
    return norm
