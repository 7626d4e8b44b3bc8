"""The CUDA sparse-attention forward with other settings: the register split between its math warpgroups and its
producer, and the L2 prefetch hint of its cp.async copies.

    python examples/benchmarks/attention_fwd_ab.py --variants examples/benchmarks/variants/attention_fwd_tuning.py

setmaxnreg only moves registers within the CTA's launch allocation (384 threads x the 168 that
__launch_bounds__(384, 1) gives, 64,512), so 256 * math + 128 * producer must stay within it: a split over it
never completes its setmaxnreg.inc and the kernel hangs.
"""

from deepseek_v41.sparse_attention_cuda import _SOURCE

MATH, PRODUCER = "setmaxnreg.inc.sync.aligned.u32 224;", "setmaxnreg.dec.sync.aligned.u32 56;"  # the tree's split
COPY = "cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"  # every gather and Q copy
for _text in (MATH, PRODUCER, COPY):
    assert _SOURCE.count(_text) == 1, f"the tree's kernel changed: update this file ({_text})"


def split(math: int, producer: int) -> str:
    assert 256 * math + 128 * producer <= 384 * 168, f"{math}/{producer} exceeds the CTA's registers"
    source = _SOURCE.replace(MATH, MATH.replace("224", str(math)))
    return source.replace(PRODUCER, PRODUCER.replace("56", str(producer)))


VARIANTS = {
    "math 232 / producer 40": (split(232, 40), True),
    "L2::256B prefetch": (_SOURCE.replace(COPY, COPY.replace("L2::128B", "L2::256B")), True),
    "no L2 prefetch": (_SOURCE.replace(COPY, COPY.replace(".L2::128B", "")), True),
}
