"""RMSNorm, Linear and the fp32 head matmul, built from the ``rms_norm`` / ``linear`` / ``head`` backend names.

Every backend keeps the parameter name ``weight`` and its dtype, so a checkpoint loads and saves the same
whichever backend computes it.
"""

import functools

import torch
from torch import nn

from .kernels_triton import (
    cross_entropy_grad_hi_lo_triton,
    cross_entropy_rows_triton,
    inference_kernel_usable,
    rms_norm_triton,
    triton_usable,
)

try:  # optional: the `te` backends (backends.check_available names it when missing)
    import transformer_engine.pytorch as te
except ImportError:
    te = None


class RMSNorm(nn.Module):
    """``torch_fp32`` (default): upcast, x·rsqrt(mean(x²)+eps)·w in fp32, one rounding to the input dtype (on CUDA
    without autograd, e.g. a decode step, as the ``triton`` kernel: one launch instead of nine).
    ``triton``: the same in one Triton kernel each way (CUDA; fp32 sums in another order).
    ``torch``: ``F.rms_norm`` in the input dtype (faster, rounds differently)."""

    def __init__(self, dim: int, eps: float, backend: str = "torch_fp32", dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., dim] -> [..., dim]
        if self.backend == "triton" or (self.backend == "torch_fp32" and inference_kernel_usable(x, self.weight)):
            return rms_norm_triton(x, self.weight, self.eps)
        if self.backend == "torch":
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def make_rms_norm(dim: int, eps: float, backend: dict, dtype=None) -> nn.Module:
    """``te``: Transformer Engine's fused RMSNorm, whose parameter is also ``weight``."""
    if backend["rms_norm"] == "te":
        return te.RMSNorm(dim, eps=eps, params_dtype=dtype or torch.get_default_dtype())
    return RMSNorm(dim, eps, backend["rms_norm"], dtype)


def make_linear(in_features: int, out_features: int, backend: dict, bias: bool = False, dtype=None) -> nn.Module:
    """``torch``: nn.Linear.  ``te``: Transformer Engine's Linear, whose parameter is also ``weight``."""
    if backend["linear"] == "te":
        return te.Linear(in_features, out_features, bias=bias, params_dtype=dtype or torch.get_default_dtype())
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def make_fp32_linear(in_features: int, out_features: int, backend: dict) -> nn.Module:
    """An fp32 projection computed in fp32: ``Fp32Linear`` (``torch`` linear backend), or Transformer Engine's
    Linear with fp32 parameters (``te``; the caller gives it fp32 input)."""
    if backend["linear"] == "te":
        return make_linear(in_features, out_features, backend, dtype=torch.float32)
    return Fp32Linear(in_features, out_features, backend)


def is_plain_linear(module: nn.Module) -> bool:
    """True for an unwrapped ``nn.Linear`` / TE ``Linear``: the fast paths (the grouped wo_a GEMM, the bf16x3
    head) may then read its ``weight``.  Anything else (a PEFT LoRA layer, a replaced module) is called as a
    module, so whatever it adds to the product is applied."""
    if type(module) is nn.Linear:
        return module.bias is None  # the fast paths have no bias term
    return te is not None and type(module) is te.Linear


class FrozenLinear(nn.Module):
    """y = x · Wᵀ for a projection that never trains: the indexer's (hard top-k, no LM gradient;
    architecture.md §5.5).  Deliberately not an ``nn.Linear``: PEFT's ``target_modules="all-linear"`` leaves
    it out (an adapter there would never get a gradient), and naming it explicitly fails in PEFT with this
    module's description, which says what to do."""

    def __init__(self, in_features: int, out_features: int, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}: the frozen indexer's "
                "projection, which no adapter can train; leave it out with exclude_modules=r'.*\\.indexer\\..*' "
                "or a target_modules regex")


def compiled_on_cuda(fn, **compile_options):
    """``fn`` through ``torch.compile(fullgraph=True)`` when its first argument is a CUDA tensor (compiled on
    first use), eager otherwise: elementwise chains that are one fused kernel on the GPU, plain ops on CPU.
    Inside a region that torch.compile is already tracing, ``fn`` itself is traced into that graph (no
    nested compile object is built while tracing)."""
    compiled = None

    @functools.wraps(fn)
    def run(x, *args):
        nonlocal compiled
        if not x.is_cuda or torch.compiler.is_compiling():
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True, **compile_options)
        return compiled(x, *args)

    return run


def by_positions(fn, *args, block: int):
    """fn(*args) for a per-position fn (dim 1 of every tensor arg is the position; None args pass through): without
    autograd, ``block`` positions at a time into one output, bounding fn's temporaries on a long prefill (no position
    reads another: the same values, up to the summation order a GEMM picks for fewer rows); with autograd, or no
    longer than ``block``, in one call."""
    s = args[0].shape[1]
    if s <= block or torch.is_grad_enabled():
        return fn(*args)

    def part(start):
        return fn(*(None if a is None else a[:, start : start + block] for a in args))

    first = part(0)
    out = first.new_empty(first.shape[0], s, *first.shape[2:])
    out[:, :block] = first
    for start in range(block, s, block):
        out[:, start : start + block] = part(start)
    return out


# ---- the fp32 head: logits = x · Wᵀ with fp32 x [.., D], fp32 W [V, D] -> fp32 logits [.., V] ----------------


def _round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    # fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: x.to(bfloat16).float() computed on
    # the bits, so that no compiler folds the rounding away (Inductor turns x − x.to(bf16).float() into 0 unless
    # told to emulate precision casts, which a model-wide torch.compile is not); NaN stays NaN
    bits = x.view(torch.int32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000: clear the low 16 bits
    return torch.where(x.isnan(), x, rounded.view(torch.float32))


def _split_bf16(x: torch.Tensor) -> tuple:
    # fp32 -> (hi, lo) bf16 with x ≈ hi + lo: hi keeps 8 mantissa bits, lo the next 8 (relative error ~2^-17);
    # a bf16 tensor is its own hi and has no lo (None)
    if x.dtype == torch.bfloat16:
        return x, None
    hi = _round_to_bf16(x)
    return hi.to(torch.bfloat16), (x - hi).to(torch.bfloat16)


def _mm_bf16_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # bf16 [m, k] @ bf16 [k, n] -> fp32, products of bf16 values (exact in fp32) accumulated in fp32
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)  # tensor cores, fp32 accumulator written out as is
    return torch.mm(a.float(), b.float())  # the same products on CPU (exact), fp32 accumulation


def mm_bf16x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [m, k] @ fp32 [k, n] -> fp32 through bf16 tensor cores: a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi.

    The three products are one GEMM over a 3k-long inner dimension (``[a_hi | a_hi | a_lo] @ [b_hi; b_lo;
    b_hi]``), accumulated in fp32.  The dropped a_lo·b_lo term and the split leave a relative error of
    ~1e-5 per dot product (a plain bf16 GEMM: ~3e-3; TF32: ~5e-4), at 3x a bf16 GEMM's cost instead of an
    fp32 GEMM's ~13x on Hopper.  An operand given in bf16 is exact (its lo part is zero), so its lo term
    is left out: two products, at 2x the cost, with the same error.  With one operand exact and a narrow
    output, the other operand's halves are stacked along the output instead (no copy of the wide exact
    operand; e.g. the mHC mix GEMM, [m, 20480] @ [20480, 24]) and the two result halves added in fp32.
    """
    return mm_bf16x3_split(_split_bf16(a), _split_bf16(b))


def mm_bf16x3_split(a_split: tuple, b_split: tuple) -> torch.Tensor:
    """``mm_bf16x3`` of operands already split into (hi, lo) by ``_split_bf16`` (lo None: an exact bf16
    operand), for a caller that uses one split in several products (a backward's grad·W and gradᵀ·x)."""
    (a_hi, a_lo), (b_hi, b_lo) = a_split, b_split
    m, k = a_hi.shape
    n = b_hi.shape[1]
    if a_lo is None and b_lo is not None and n < k:
        out = _mm_bf16_fp32_out(a_hi, torch.cat([b_hi, b_lo], dim=1))  # [m, 2n]
        return out[:, :n] + out[:, n:]
    if b_lo is None and a_lo is not None and m < k:
        out = _mm_bf16_fp32_out(torch.cat([a_hi, a_lo], dim=0), b_hi)  # [2m, n]
        return out[:m] + out[m:]
    a_parts, b_parts = [a_hi], [b_hi]
    if b_lo is not None:
        a_parts.append(a_hi)
        b_parts.append(b_lo)
    if a_lo is not None:
        a_parts.append(a_lo)
        b_parts.append(b_hi)
    if len(a_parts) == 1:
        return _mm_bf16_fp32_out(a_hi, b_hi)
    return _mm_bf16_fp32_out(torch.cat(a_parts, dim=1), torch.cat(b_parts, dim=0))


def _hi_lo_cat(x: torch.Tensor, dim: int) -> torch.Tensor:
    # fp32 -> bf16 cat([hi, lo], dim), the two halves of _split_bf16 in one buffer
    return torch.cat(_split_bf16(x), dim=dim)


# one pass over the fp32 tensor on the GPU (eager, the split and the cat are several passes over the 2.6 GB head
# weight); the head uses it along dim 1, for W2 = [W_hi | W_lo]
_hi_lo_cat_fused = compiled_on_cuda(_hi_lo_cat, dynamic=True)


def _hi_lo_rows_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # fp32 x [n, V] -> out bf16 [2n, V] = [hi; lo], written into the given buffer.  For the logits gradient
    # [4096, 129280] on the H200: 2.69 ms against 3.11 ms for the compiled dim-0 cat of the halves (both well
    # below copy bandwidth; examples/benchmarks/elementwise.py)
    n = x.shape[0]
    hi, lo = _split_bf16(x)
    out[:n].copy_(hi)
    out[n:].copy_(lo)
    return out


_hi_lo_rows_into_fused = compiled_on_cuda(_hi_lo_rows_into, dynamic=True)


def _bf16x3_head_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x [n, D] (bf16 exact, or fp32), weight fp32 [V, D] -> fp32 logits [n, V]: [x | x] · W2ᵀ, one GEMM over 2D
    d = x.shape[1]
    w2 = _hi_lo_cat_fused(weight, 1)  # [V, 2D]
    x_hi, x_lo = _split_bf16(x)
    y = _mm_bf16_fp32_out(torch.cat([x_hi, x_hi], dim=1), w2.t())
    if x_lo is not None:
        y += _mm_bf16_fp32_out(x_lo, w2[:, :d].t())
    return y


def _bf16x3_head_backward(g2: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool):
    # g2 = [g_hi; g_lo] bf16 [2n, V] (the split logits gradient), x [n, D], weight fp32 [V, D] -> (grad_x, grad_w)
    n, d = x.shape
    x_hi, x_lo = _split_bf16(x)
    grad_x = grad_w = None
    if need_x:
        w2 = _hi_lo_cat_fused(weight, 1)  # [V, 2D], split again rather than kept from the forward (2.6 GB)
        both = _mm_bf16_fp32_out(g2[:n], w2)  # [n, 2D]
        grad_x = (both[:, :d] + both[:, d:] + _mm_bf16_fp32_out(g2[n:], w2[:, :d])).to(x.dtype)
    if need_w:
        grad_w = _mm_bf16_fp32_out(g2.t(), torch.cat([x_hi, x_hi], dim=0))
        if x_lo is not None:
            grad_w += _mm_bf16_fp32_out(g2[:n].t(), x_lo)
    return grad_x, grad_w


class _LinearBf16x3(torch.autograd.Function):
    """y [n, V] = x [n, D] · W [V, D]ᵀ in fp32 on bf16 tensor cores, with both gradients (the products of
    ``mm_bf16x3``, laid out for the head's wide V so that no operand is copied besides the split).

    W is split once per pass into W2 = [W_hi | W_lo] [V, 2D]; x in bf16 (the final norm's output in bf16
    training) is exact.  Forward: [x | x] · W2ᵀ, one GEMM over 2D.  grad_w: the logits gradient g split into
    G2 = [g_hi; g_lo] [2n, V], then G2ᵀ · [x; x], one GEMM over 2n.  grad_x: g_hi · W2 -> [g_hi·W_hi | g_hi·W_lo]
    and g_lo · W_hi, summed in fp32.  An fp32 x adds its x_lo·W_hi and g_hiᵀ·x_lo products.
    """

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _bf16x3_head_forward(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float().contiguous()
        g2 = _hi_lo_rows_into_fused(g, g.new_empty((2 * x.shape[0], g.shape[1]), dtype=torch.bfloat16))
        return _bf16x3_head_backward(g2, x, weight, *ctx.needs_input_grad[:2])


class _LinearBf16x3CrossEntropy(torch.autograd.Function):
    """(logits, loss_sum): the ``_LinearBf16x3`` logits and Σ over counted rows of the cross-entropy
    ``lse(logits_i) − logits_i[target_i]`` (targets [n], −100 = not counted), with one backward for both.

    The backward writes the split logits gradient G2 = [g_hi; g_lo] straight from the logits, g =
    grad_loss·(softmax − one-hot) (+ the logits' own gradient when they are used elsewhere): one pass over
    the fp32 logits instead of log-softmax, its backward, a zero-filled one-hot gradient and the split (on
    the H200 ~7 ms of a 4096-token step), and neither the log-probabilities nor an fp32 gradient is held.
    """

    @staticmethod
    def forward(ctx, x, weight, targets):
        logits = _bf16x3_head_forward(x, weight)
        lse, loss_sum = cross_entropy_rows(logits, targets)
        ctx.save_for_backward(x, weight, logits, lse, targets)
        ctx.set_materialize_grads(False)
        return logits, loss_sum

    @staticmethod
    def backward(ctx, grad_logits, grad_loss):
        x, weight, logits, lse, targets = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=torch.float32, device=logits.device)
        g2 = logits.new_empty((2 * logits.shape[0], logits.shape[1]), dtype=torch.bfloat16)
        cross_entropy_grad_hi_lo(logits, lse, targets, grad_loss.float(), grad_logits, g2)
        return *_bf16x3_head_backward(g2, x, weight, *ctx.needs_input_grad[:2]), None


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor):
    """fp32 logits [n, V], targets [n] (< 0: not counted) -> (lse fp32 [n], Σ_counted lse − logit[target])."""
    if triton_usable(logits):
        return cross_entropy_rows_triton(logits, targets)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(targets >= 0, lse - picked, 0.0).sum()


def cross_entropy_grad_hi_lo(logits, lse, targets, grad_loss, grad_logits, out) -> None:
    """Write [g_hi; g_lo] (bf16 [2n, V]) into ``out`` for g = grad_loss·(softmax − one-hot) on counted rows
    (0 elsewhere) + ``grad_logits`` (None: no such term); the split is ``_split_bf16``'s."""
    if triton_usable(logits):
        cross_entropy_grad_hi_lo_triton(logits, lse, targets, grad_loss, grad_logits, out)
        return
    counted = targets >= 0
    g = torch.exp(logits - lse.unsqueeze(1))
    g[counted, targets[counted]] -= 1.0
    g = g * torch.where(counted, grad_loss, 0.0).unsqueeze(1)
    if grad_logits is not None:
        g = g + grad_logits
    n = logits.shape[0]
    out[:n], out[n:] = _split_bf16(g)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x · Wᵀ`` of the fp32-upcast operands, an IEEE fp32 GEMM (the reference numerics): the ``fp32``
    backend of the head and of ``fp32_linear``."""
    return nn.functional.linear(x.float(), weight.float())


def head_bf16x3(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``bf16x3`` head backend: the fp32 GEMM emulated on bf16 tensor cores (``_LinearBf16x3``), fp32 logits.

    x in bf16 (bf16 training) is used as is, being exact; anything else in fp32.  The weight is fp32."""
    lead = x.shape[:-1]
    x = x if x.dtype == torch.bfloat16 else x.float()
    logits = _LinearBf16x3.apply(x.reshape(-1, x.shape[-1]), weight.float())
    return logits.view(*lead, weight.shape[0])


def head_bf16x3_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """The ``bf16x3`` head with the loss fused into its backward: x [..., D], targets with one entry per row of
    x in any shape (-100: not counted) -> (fp32 logits [..., V], fp32 sum of the counted rows' cross-entropy)."""
    lead = x.shape[:-1]
    x = x if x.dtype == torch.bfloat16 else x.float()
    logits, loss_sum = _LinearBf16x3CrossEntropy.apply(
        x.reshape(-1, x.shape[-1]), weight.float(), targets.reshape(-1).contiguous()
    )
    return logits.view(*lead, weight.shape[0]), loss_sum


class _LinearFp32Emulated(torch.autograd.Function):
    # y fp32 [n, V] = x [n, D] · W [V, D]ᵀ and both gradients, each product through mm_bf16x3 (fp32 accuracy on
    # bf16 tensor cores; a bf16 operand is exact and adds no products).  Laid out for a narrow V (a router's
    # experts, a compressor's 512 channels): no copy of the wide x, unlike the head's [x | x] layout.
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return mm_bf16x3(x, weight.t())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = _split_bf16(grad.float())  # split once for both products
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = mm_bf16x3_split(g, _split_bf16(weight)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            g_t = tuple(None if part is None else part.t() for part in g)
            grad_w = mm_bf16x3_split(g_t, _split_bf16(x)).to(weight.dtype)
        return grad_x, grad_w


def linear_bf16x3(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear_fp32`` emulated on bf16 tensor cores (``mm_bf16x3``, ~1e-5 relative), gradients included:
    x [..., D] and weight [V, D] in bf16 (exact) or fp32 -> fp32 [..., V]; the gradients come back in each
    operand's dtype."""
    lead = x.shape[:-1]
    y = _LinearFp32Emulated.apply(x.reshape(-1, x.shape[-1]), weight)
    return y.view(*lead, weight.shape[0])


def make_fp32_matmul(backend: dict):
    """``(x, weight) -> fp32 x·Wᵀ`` for the fp32 GEMMs inside the blocks (the router's scores, the ratio-2
    compressor), by ``backend["fp32_linear"]``: ``fp32`` (IEEE) or ``bf16x3`` (emulated)."""
    return {"fp32": linear_fp32, "bf16x3": linear_bf16x3}[backend["fp32_linear"]]


class Fp32Linear(nn.Linear):
    """An fp32 island's projection (the ratio-2 compressor's ``wkv`` / ``wgate``): fp32 weight, input of any
    float dtype, ``x · Wᵀ`` computed and returned in fp32 by ``backend["fp32_linear"]``.  An ``nn.Linear`` (same
    parameter, same state-dict name), so FSDP, PEFT and the checkpoint code treat it as one."""

    def __init__(self, in_features: int, out_features: int, backend: dict):
        super().__init__(in_features, out_features, bias=False, dtype=torch.float32)
        self.matmul = make_fp32_matmul(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight)


def bf16_copy_if_exact(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """fp32 weight [V, D] -> its bf16 copy (written into ``out`` when given) if every value is a bf16 value, else
    None.  One host read; a slice of rows at a time, so the check needs no whole-tensor temporary."""
    out = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device) if out is None else out
    inexact = torch.zeros((), dtype=torch.bool, device=weight.device)
    for rows, copy in zip(weight.split(8192), out.split(8192)):
        copy.copy_(rows)
        inexact |= (copy.float() != rows).any()  # NaN != NaN: a NaN weight counts as inexact
    return None if inexact.item() else out


def make_head_matmul(backend: dict):
    """The head's ``(x, weight) -> fp32 logits`` function for ``backend["head"]``."""
    return {"fp32": linear_fp32, "bf16x3": head_bf16x3}[backend["head"]]


def make_head_loss(backend: dict):
    """``(x, weight, targets) -> (fp32 logits, loss sum)`` with the loss fused into the head, or None where
    the head has no fused loss (``fp32``: logits, then ``F.cross_entropy``)."""
    return {"fp32": None, "bf16x3": head_bf16x3_cross_entropy}[backend["head"]]
