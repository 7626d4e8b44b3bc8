"""``RemainderAdamW``'s update of one tensor as one hand-written Triton kernel (CUDA): ``adamw_triton_``.

The same update as ``optim.fused_adamw_`` (master rebuilt from the bf16 high half and the int16 low half, or an
fp32 parameter; decoupled weight decay; Adam; master split again by truncation; moments rounded once to their
storage dtype), in one pass that reads each state tensor once and writes it once: 18 bytes an element for bf16
parameter, gradient and moments, 20 for an fp32 parameter with an fp32 gradient and bf16 moments.

Rounding: every step is the one ``RemainderAdamW._per_op_update`` performs on a CUDA tensor with eager PyTorch,
in the same order, so the kernel is meant to be bit-identical to that path (``tests/gpu/test_optim_fused_gpu.py``
checks it with ``torch.equal``).  Per element, in fp32 (``fma`` rounds once; every other operation rounds its own
result; compiled with ``enable_fp_fusion=False`` so the compiler fuses nothing else):

    master = master * decay                                  # mul_(decay)
    d = grad - exp_avg                                       # lerp_(grad, w1): ATen's lerp, which nvcc
    exp_avg = fma(w1, d, exp_avg) if |w1| < 0.5              #   contracts (CUDA builds use the default
              else fma(-d, 1 - w1, grad)                     #   --fmad=true)
    exp_avg_sq = fma(w2, grad * grad, exp_avg_sq * beta2)    # mul_(beta2).addcmul_(value=w2): explicit std::fma
                                                             #   (fma(grad, grad, .) when w2 == 1)
    denom = sqrt(exp_avg_sq) * inv_bc2_sqrt + eps            # division by a Python float: ATen multiplies by
                                                             #   its reciprocal (taken in double, rounded to
                                                             #   fp32: scalars[7]); IEEE sqrt
    master = fma(step_size, exp_avg / denom, master)         # addcdiv_(value=step_size): IEEE division

and the fp32 -> bf16 rounding of a moment is round-to-nearest-even done on the bits (as ``copy_`` into bf16),
so the result does not depend on how a Triton version lowers the cast (the interpreter truncates).  (``fused_adamw_``
groups the two scaled terms as ATen's CPU kernels do, ``(w2 * grad) * grad`` and ``(step_size * exp_avg) / denom``,
which is what makes it bit-identical to the per-op path on the CPU; the CUDA kernels group them as above.)

``scalars`` is the fp32 tensor ``[8]`` of ``optim._adamw_scalars``, read in the kernel: one compiled kernel per
dtype combination serves every step and learning rate.  Offsets are a 64-bit block base plus 32-bit lane offsets,
so tensors of 2^31 elements and more are addressed correctly; full blocks are unmasked (vectorized loads for any
numel), only the last block is masked.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds come without Triton
    triton = None

GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MOMENT_DTYPES = (torch.bfloat16, torch.float32)
# H200, 2026-12-02 (examples/benchmarks/optimizer.py, two leases): 2048 elements and 8 warps a program is the
# fastest launch over the proxy's tensors (4.1 TB/s on the large ones, against 4.2 for a plain copy)
DEFAULT_BLOCK, DEFAULT_NUM_WARPS = 2048, 8


def _unsupported(param, remainder, grad, exp_avg, exp_avg_sq):
    """None when ``adamw_triton_`` takes these tensors, else (exception type, message) naming the problem: Triton
    importable, dtypes it knows (bf16 param with an int16 remainder or fp32 param without; grad bf16/fp16/fp32;
    moments bf16/fp32), all contiguous with one numel on one device."""
    if triton is None:
        return RuntimeError, "adamw_triton_ needs the package triton (it comes with CUDA builds of PyTorch)"
    if param.dtype == torch.bfloat16:
        if remainder is None or remainder.dtype != torch.int16:
            return TypeError, "adamw_triton_: a bf16 param needs its int16 remainder"
    elif param.dtype != torch.float32 or remainder is not None:
        return TypeError, (f"adamw_triton_ takes a bf16 param with an int16 remainder or an fp32 param without one, "
                           f"got {param.dtype} with remainder {None if remainder is None else remainder.dtype}")
    if grad.dtype not in GRAD_DTYPES:
        return TypeError, f"adamw_triton_: grad dtype {grad.dtype} not in {GRAD_DTYPES}"
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype not in MOMENT_DTYPES:
            return TypeError, f"adamw_triton_: {name} dtype {t.dtype} not in {MOMENT_DTYPES}"
    tensors = [t for t in (param, remainder, grad, exp_avg, exp_avg_sq) if t is not None]
    if any(t.numel() != param.numel() or not t.is_contiguous() or t.device != param.device for t in tensors):
        return ValueError, ("adamw_triton_: param, remainder, grad and moments must be contiguous, with one numel, "
                            "on one device")
    return None


def adamw_triton_usable(param, remainder, grad, exp_avg, exp_avg_sq) -> bool:
    """Whether ``adamw_triton_`` takes these CUDA tensors (``_unsupported``)."""
    return param.is_cuda and _unsupported(param, remainder, grad, exp_avg, exp_avg_sq) is None


if triton is not None:

    @triton.jit
    def _bf16_bits_to_f32(bits):
        # int16 bit pattern of a bf16 -> the fp32 of equal value (exact)
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _f32_to_bf16_bits(x):
        # fp32 -> int16 bit pattern of bf16, round to nearest even (c10::BFloat16's rounding); NaN stays NaN
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r).to(tl.int16)

    @triton.jit
    def _load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
        if IS_BF16:  # a bf16 tensor handed over as its int16 view
            return _bf16_bits_to_f32(tl.load(ptr + offs, mask=mask))
        return tl.load(ptr + offs, mask=mask).to(tl.float32)

    @triton.jit
    def _store_f32(ptr, offs, x, mask, IS_BF16: tl.constexpr):
        if IS_BF16:
            tl.store(ptr + offs, _f32_to_bf16_bits(x), mask=mask)
        else:
            tl.store(ptr + offs, x, mask=mask)

    @triton.jit
    def _adamw_block(param_ptr, rem_ptr, grad_ptr, avg_ptr, sq_ptr, offs, mask,
                     decay, w1, one_minus_w1, small_w1, beta2, w2, eps, inv_bc2, step_size,
                     HAS_REMAINDER: tl.constexpr, GRAD_BF16: tl.constexpr, AVG_BF16: tl.constexpr,
                     SQ_BF16: tl.constexpr):
        # One block of the update; ``mask`` is None for a full block (unmasked, vectorized accesses).
        if HAS_REMAINDER:  # master = bf16 bits (high half, via its int16 view) | remainder (low half)
            high = tl.load(param_ptr + offs, mask=mask).to(tl.int32) << 16
            low = tl.load(rem_ptr + offs, mask=mask).to(tl.int32) & 0xFFFF
            master = (high | low).to(tl.float32, bitcast=True)
        else:
            master = tl.load(param_ptr + offs, mask=mask)
        grad = _load_f32(grad_ptr, offs, mask, GRAD_BF16)
        avg = _load_f32(avg_ptr, offs, mask, AVG_BF16)
        sq = _load_f32(sq_ptr, offs, mask, SQ_BF16)

        master = master * decay
        diff = grad - avg
        avg = tl.where(small_w1, tl.fma(w1, diff, avg), tl.fma(-diff, one_minus_w1, grad))
        sq = sq * beta2
        sq = tl.where(w2 == 1.0, tl.fma(grad, grad, sq), tl.fma(w2, grad * grad, sq))
        denom = tl.sqrt_rn(sq) * inv_bc2 + eps
        master = tl.fma(step_size, tl.div_rn(avg, denom), master)

        if HAS_REMAINDER:  # split: high half (arithmetic shift, then truncate) and low half (truncate)
            bits = master.to(tl.int32, bitcast=True)
            tl.store(param_ptr + offs, (bits >> 16).to(tl.int16), mask=mask)
            tl.store(rem_ptr + offs, bits.to(tl.int16), mask=mask)
        else:
            tl.store(param_ptr + offs, master, mask=mask)
        _store_f32(avg_ptr, offs, avg, mask, AVG_BF16)
        _store_f32(sq_ptr, offs, sq, mask, SQ_BF16)

    @triton.jit(do_not_specialize=["n"])
    def _adamw_kernel(param_ptr, rem_ptr, grad_ptr, avg_ptr, sq_ptr, scalars_ptr, n,
                      HAS_REMAINDER: tl.constexpr, GRAD_BF16: tl.constexpr, AVG_BF16: tl.constexpr,
                      SQ_BF16: tl.constexpr, BLOCK: tl.constexpr):
        # scalars: (decay, 1 - beta1, beta2, 1 - beta2, eps, bias_correction2_sqrt, step_size, 1 / bc2_sqrt), fp32
        decay = tl.load(scalars_ptr)
        w1 = tl.load(scalars_ptr + 1)
        beta2 = tl.load(scalars_ptr + 2)
        w2 = tl.load(scalars_ptr + 3)
        eps = tl.load(scalars_ptr + 4)
        inv_bc2 = tl.load(scalars_ptr + 7)  # the reciprocal taken in double, as ATen's division by a Python float
        step_size = tl.load(scalars_ptr + 6)
        one_minus_w1 = 1.0 - w1
        small_w1 = tl.abs(w1) < 0.5

        start = tl.program_id(0).to(tl.int64) * BLOCK  # 64-bit block base, 32-bit lane offsets
        offs = tl.arange(0, BLOCK)
        param_ptr += start
        rem_ptr += start
        grad_ptr += start
        avg_ptr += start
        sq_ptr += start
        if start + BLOCK <= n:
            _adamw_block(param_ptr, rem_ptr, grad_ptr, avg_ptr, sq_ptr, offs, None,
                         decay, w1, one_minus_w1, small_w1, beta2, w2, eps, inv_bc2, step_size,
                         HAS_REMAINDER, GRAD_BF16, AVG_BF16, SQ_BF16)
        else:
            _adamw_block(param_ptr, rem_ptr, grad_ptr, avg_ptr, sq_ptr, offs, offs < n - start,
                         decay, w1, one_minus_w1, small_w1, beta2, w2, eps, inv_bc2, step_size,
                         HAS_REMAINDER, GRAD_BF16, AVG_BF16, SQ_BF16)


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().view(-1)
    return flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat


def adamw_triton_(param, remainder, grad, exp_avg, exp_avg_sq, scalars, block=DEFAULT_BLOCK,
                  num_warps=DEFAULT_NUM_WARPS) -> None:
    """One tensor's AdamW update in place, one Triton kernel; the semantics of ``optim.fused_adamw_``, with the
    roundings of the eager CUDA per-op path (module docstring).

    ``param`` bf16 with its int16 ``remainder``, or fp32 with ``remainder=None``; ``grad`` bf16, fp16 or fp32;
    ``exp_avg`` / ``exp_avg_sq`` bf16 or fp32; all contiguous with the same numel (any shape: they are read as
    1-D).  ``scalars``: fp32 tensor ``[8]`` on the same device, ``optim._adamw_scalars(...)``.  ``block``
    (a power of two) elements per program and ``num_warps`` tune the launch.
    """
    problem = _unsupported(param, remainder, grad, exp_avg, exp_avg_sq)
    if problem is not None:
        error, message = problem
        raise error(message)
    n = param.numel()
    if scalars.dtype != torch.float32 or scalars.numel() != 8 or scalars.device != param.device:
        raise ValueError("adamw_triton_: scalars must be an fp32 tensor [8] on the param's device")
    if block & (block - 1) or block < 128:
        raise ValueError(f"adamw_triton_: block must be a power of two >= 128, got {block}")
    if n == 0:
        return
    p = _flat(param)
    _adamw_kernel[(triton.cdiv(n, block),)](
        p, p if remainder is None else remainder.detach().view(-1), _flat(grad), _flat(exp_avg), _flat(exp_avg_sq),
        scalars.contiguous(), n,
        HAS_REMAINDER=remainder is not None, GRAD_BF16=grad.dtype == torch.bfloat16,
        AVG_BF16=exp_avg.dtype == torch.bfloat16, SQ_BF16=exp_avg_sq.dtype == torch.bfloat16,
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=False,
    )
