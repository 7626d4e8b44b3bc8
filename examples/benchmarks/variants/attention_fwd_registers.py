"""The CUDA sparse-attention forward with other register splits between its math warpgroups and its producer.

    python examples/benchmarks/attention_fwd_ab.py --variants examples/benchmarks/variants/attention_fwd_registers.py

setmaxnreg only moves registers within the CTA's launch allocation (384 threads x the 168 that
__launch_bounds__(384, 1) gives, 64,512), so 256 * math + 128 * producer must stay within it: a split over it
never completes its setmaxnreg.inc and the kernel hangs.
"""

from deepseek_v41.sparse_attention_cuda import _SOURCE

MATH, PRODUCER = "setmaxnreg.inc.sync.aligned.u32 224;", "setmaxnreg.dec.sync.aligned.u32 56;"  # the tree's split
assert _SOURCE.count(MATH) == 1 and _SOURCE.count(PRODUCER) == 1, "the tree's split changed: update this file"


def split(math: int, producer: int) -> str:
    assert 256 * math + 128 * producer <= 384 * 168, f"{math}/{producer} exceeds the CTA's registers"
    source = _SOURCE.replace(MATH, MATH.replace("224", str(math)))
    return source.replace(PRODUCER, PRODUCER.replace("56", str(producer)))


VARIANTS = {"math 232 / producer 40": (split(232, 40), True)}
