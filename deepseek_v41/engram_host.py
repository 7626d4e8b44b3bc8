"""Engram tables held as stored (FP8 rows, "kept") and/or in host memory (``text_config.engram_device="cpu"``).

``EngramTable`` is the Engram module's ``embed``. By default it is the plain ``nn.Embedding`` of the dequantized
table. Two options change where and how the table is held:

* Kept (``load_kept_table``): the release's FP8 E4M3 codes [rows, d] and their scales per 32 columns
  [rows, ceil(d/32)] (UE8M0, or F32 in older releases) replace the floating-point table, under the released names
  ``embed.weight`` / ``embed.scale``. A lookup gathers the rows' codes and scales and decodes only those rows,
  to exactly the values of the dequantized table (codes times a power of two: one rounding, as
  ``release_format.decode_fp8_rows`` does). Inference only: a training forward is refused.
* Host (``engram_device="cpu"``): the table (kept or not) stays in host memory whatever the model is moved to
  (``.to``, ``.cuda()``, ``to_empty``, ``device_map``); its rows go to the layer's device at each forward.
  The rows a prefill needs depend only on the token ids, so ``prefetch_engram_rows`` (called before the first
  block) hashes them on the host, gathers each Engram layer's rows into one pinned staging buffer (codes and
  scales together) and copies it to the GPU on a side stream, all on a worker thread, while the first blocks
  run; each Engram layer waits on its copy's event. Without CUDA the same steps run in place, without streams.
  A decode step looks up only its new tokens' rows. Only the staging buffers are pinned: the copy engine reads
  from them, never from the table, so the table itself (up to ~100 GB per released layer) stays pageable.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.nn import functional as F

from .release_format import _scale_groups_, ceil_div, take_rows

SCALE_GROUP = 32  # columns per scale in a released Engram row
HOST = torch.device("cpu")
_ALIGN = 16  # bytes: the scales' offset in a packed staging buffer (an F32 view needs 4)
_CHECK_ROWS = 1 << 20  # scale rows checked per step at load (a bounded temporary)

KEPT_TRAINING_REFUSED = (
    "a training forward through an Engram table held as stored (FP8 rows with their scales, a kept format): the "
    "codes cannot be trained; load the model with from_pretrained(..., dequantize_base_checkpoint=True), which "
    "decodes the table exactly to floating point, to train or fine-tune"
)


def decode_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows codes [n, d] (E4M3 or their bytes) with scales [n, ceil(d/32)] (UE8M0 or F32) -> [n, d] in ``dtype``.

    With UE8M0 scales a bf16 / fp32 result is computed in its own dtype (code times a power of two: exact), an
    F32 scale in fp32 first, then rounded once: the arithmetic of ``release_format.decode_fp8_rows``."""
    work = dtype if scale.dtype == torch.float8_e8m0fnu and dtype in (torch.float32, torch.bfloat16) else torch.float32
    rows = codes.view(torch.float8_e4m3fn).to(work)
    _scale_groups_(rows, scale_values(scale).to(work), SCALE_GROUP)
    return rows.to(dtype)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales -> fp32 2^(e-127) from their bits (any device; byte 0 is the fp32 subnormal 2^-127); F32 as is."""
    if scale.dtype != torch.float8_e8m0fnu:
        return scale
    e = scale.view(torch.uint8).int()
    return torch.where(e == 0, 1 << 22, e << 23).view(torch.float32)


class EngramTable(nn.Embedding):
    """An Engram layer's hashed n-gram table: [rows, d], dequantized (``weight``) or kept (``weight`` E4M3 codes,
    ``scale``); on the model's device or, with ``on_host``, in host memory. ``rows_gathered`` counts the rows
    looked up (a test's window on what a forward reads)."""

    def __init__(self, rows: int, dim: int, on_host: bool = False):
        device = HOST if on_host and torch.get_default_device().type != "meta" else None
        super().__init__(rows, dim, device=device)
        self.held_on_host = on_host  # read by materialize() and the decode-graph check too
        self.compute_dtype = self.weight.dtype  # the rows' dtype (a kept table decodes to it)
        self.rows_gathered = 0

    @property
    def kept(self) -> bool:
        return "scale" in self._buffers

    # ---- holding the table as stored ----

    def keep_format(self, scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> None:
        """Hold the table as stored (empty E4M3 codes and scales in place of the floating-point weight), before it
        is loaded: called on the meta-device model, no floating-point table is ever allocated."""
        rows, dim = self.num_embeddings, self.embedding_dim
        device = self.weight.device
        self._hold(torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(rows, ceil_div(dim, SCALE_GROUP), dtype=scale_dtype, device=device))

    def load_kept_table(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Take the table as the release stores it: codes F8_E4M3 [rows, d] and scales [rows, ceil(d/32)] (F8_E8M0
        or F32). They are held as given (moved to the table's device: host memory with ``on_host``), never decoded
        as a whole; the floating-point weight, if any, is dropped."""
        rows, dim = self.num_embeddings, self.embedding_dim
        groups = ceil_div(dim, SCALE_GROUP)
        if codes.dtype != torch.float8_e4m3fn or tuple(codes.shape) != (rows, dim):
            raise ValueError(f"Engram table codes must be float8_e4m3fn [{rows}, {dim}] (the released F8_E4M3 rows), "
                             f"got {codes.dtype} {list(codes.shape)}: wrong tensor or a checkpoint of another config")
        if scale.dtype not in (torch.float8_e8m0fnu, torch.float32) or tuple(scale.shape) != (rows, groups):
            raise ValueError(f"Engram table scales must be float8_e8m0fnu or float32 [{rows}, {groups}] (one per 32 "
                             f"columns of a row), got {scale.dtype} {list(scale.shape)}")
        for start in range(0, rows, _CHECK_ROWS):  # a NaN or negative scale would decode to NaN rows, unseen
            block = scale[start:start + _CHECK_ROWS]
            if block.dtype == torch.float8_e8m0fnu:
                bad = block.view(torch.uint8) == 255
            else:
                bad = ~((block >= 0) & (block < torch.inf))
            if bool(bad.any()):
                at = [start + int(bad.nonzero()[0, 0]), int(bad.nonzero()[0, 1])]
                raise ValueError(f"Engram table scale {at} is NaN or negative: the checkpoint is corrupted "
                                 "(re-download or re-export it)")
        if self.held_on_host:
            device = HOST
        else:
            device = codes.device if self.weight.is_meta else self.weight.device
        same = self.kept and self.scale.dtype == scale.dtype and not self.weight.is_meta
        if same and codes.device != device:  # already allocated as stored (keep_format): filled in place, no 2nd copy
            self.weight.view(torch.uint8).copy_(codes.view(torch.uint8))
            self.scale.view(torch.uint8).copy_(scale.view(torch.uint8))
            return
        self._hold(codes.to(device).contiguous(), scale.to(device).contiguous())  # held as given where it already is

    def hold_on_host(self) -> None:
        """Move the table to host memory and keep it there (what ``engram_device="cpu"`` builds)."""
        self.held_on_host = False
        self.to(HOST)
        self.held_on_host = True

    def _hold(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        if not self.kept:
            self.compute_dtype = self.weight.dtype
        self._parameters.pop("weight", None)
        self.register_buffer("weight", codes)  # released names: embed.weight (codes), embed.scale
        self.register_buffer("scale", scale)

    def _apply(self, fn, recurse=True):
        # Moves and casts of the model: a host table stays on the host, kept codes and scales keep their dtypes
        # (FP8 counts as floating point: a cast to bf16 would turn the codes into numbers). A probe tells what fn
        # does (to_empty, .to(device, dtype), .cuda(), a model cast that spares fp32 islands, ...).
        if not (self.held_on_host or self.kept):
            return super()._apply(fn, recurse)
        target = fn(torch.empty(0, dtype=self.compute_dtype))
        if target.dtype.is_floating_point:
            self.compute_dtype = target.dtype

        def place(t):
            device = HOST if self.held_on_host else target.device
            dtype = t.dtype if self.kept else target.dtype
            if t.is_meta and device.type != "meta":  # to_empty / materialization
                return torch.empty_like(t, device=device, dtype=dtype)
            return t.to(device=device, dtype=dtype)

        return super()._apply(place, recurse)

    # ---- lookups ----

    def refuse_training(self) -> None:
        if self.kept and self.training and torch.is_grad_enabled():
            raise RuntimeError(KEPT_TRAINING_REFUSED)

    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and self.weight.requires_grad

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [...] (any device) -> rows [..., d] on ids' device, in compute_dtype
        if not (self.kept or self.held_on_host):
            return super().forward(ids)
        self.refuse_training()
        flat = ids.reshape(-1)
        if self.kept and not self.held_on_host:
            codes = self.weight.view(torch.uint8).index_select(0, flat)
            rows = decode_rows(codes, take_rows(self.scale, flat), self.compute_dtype)
            self.rows_gathered += flat.numel()
        elif self.needs_grad():  # a trainable host table: the gather and the copy on the autograd graph
            rows = F.embedding(flat.to(HOST), self.weight).to(ids.device)
            self.rows_gathered += flat.numel()
        else:  # host rows: gathered into one staging buffer, copied, decoded on ids' device
            staged = self.gather_packed(flat.to(HOST), pin=ids.is_cuda)
            rows = self.unpack_rows(staged.to(ids.device, non_blocking=True), flat.numel())
        return rows.view(*ids.shape, self.embedding_dim)

    def _packed_layout(self, n: int) -> tuple[int, int]:
        # (byte offset of the scales, total bytes) of n rows packed: codes [n, d] | pad | scale bytes [n, g·size]
        d = self.embedding_dim
        if not self.kept:
            return 0, n * d * self.weight.element_size()
        codes = math.ceil(n * d / _ALIGN) * _ALIGN
        return codes, codes + n * self.scale.shape[1] * self.scale.element_size()

    @torch.no_grad()
    def gather_packed(self, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows ``ids`` (1-D, on the table's device) as stored, packed in one uint8 buffer (pinned with ``pin``):
        a kept table's codes then scales, a floating-point table's rows."""
        n, d = ids.numel(), self.embedding_dim
        offset, total = self._packed_layout(n)
        packed = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        if self.kept:
            torch.index_select(self.weight.view(torch.uint8), 0, ids, out=packed[: n * d].view(n, d))
            scale = self.scale.view(torch.uint8)  # [rows, g·size]
            torch.index_select(scale, 0, ids, out=packed[offset:].view(n, scale.shape[1]))
        else:
            torch.index_select(self.weight, 0, ids, out=packed.view(self.weight.dtype).view(n, d))
        self.rows_gathered += n
        return packed

    def unpack_rows(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """``gather_packed``'s buffer (on any device) -> rows [n, d] in compute_dtype on its device."""
        d = self.embedding_dim
        if not self.kept:
            return packed.view(self.weight.dtype).view(n, d)
        offset, total = self._packed_layout(n)
        scale = packed[offset:total].view(n, -1).view(self.scale.dtype)
        return decode_rows(packed[: n * d].view(n, d), scale, self.compute_dtype)


def stored_table_tensors(model: nn.Module) -> dict:
    """{name: tensor} of the Engram tables' codes and scales held as stored (kept), for sizing at their own dtype."""
    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, EngramTable) and module.kept:
            found.update({f"{module_name}.{name}": t for name, t in module._buffers.items() if t is not None})
    return found


@contextlib.contextmanager
def tables_left_out(model: nn.Module, host_only: bool = True):
    """The Engram tables held in host memory (``held_on_host``; every Engram table with ``host_only=False``) taken
    out of ``model``'s parameters and buffers while the block runs, then put back: what a device-map plan sizes and
    places without them (they stay on the host, whatever the plan). Shared by ``from_pretrained``'s
    ``plan_device_map`` and the inference planner, so both leave the same tables out."""
    taken = []
    for module in model.modules():
        if isinstance(module, EngramTable) and (module.held_on_host or not host_only):
            taken.append((module, dict(module._parameters), dict(module._buffers)))
            module._parameters.clear()
            module._buffers.clear()
    try:
        yield
    finally:
        for module, parameters, buffers in taken:
            module._parameters.update(parameters)
            module._buffers.update(buffers)


# ----------------------------------------------------------------------------------------------------
# Prefetch: a prefill's rows from host tables, copied while the first blocks run
# ----------------------------------------------------------------------------------------------------

_worker: ThreadPoolExecutor | None = None
_side_streams: dict = {}


def _worker_pool() -> ThreadPoolExecutor:
    global _worker
    if _worker is None:  # one thread: the layers' copies go out in layer order
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-host")
    return _worker


def side_stream(device: torch.device):
    """The stream host-row copies to ``device`` run on (one per GPU, not the compute stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


class PrefetchedRows:
    """One Engram layer's rows [b, s, cols, d] for this forward, on their way from a host table to the layer's
    device. Passed to the block in place of its hash ids (``.to`` keeps it: the copy already targets the layer)."""

    def __init__(self, table: EngramTable, shape: tuple, job):
        self.table, self.shape, self._job, self._rows = table, tuple(shape), job, None
        self.stream = None  # the stream the copy ran on (None: no copy, a CPU layer)

    def to(self, *args, **kwargs):
        return self

    def wait(self) -> torch.Tensor:
        if self._rows is None:
            packed, event = self._job.result() if isinstance(self._job, Future) else self._job
            if event is not None:  # the compute stream waits for the copy; the buffer lives until its use
                current = torch.cuda.current_stream(packed.device)
                current.wait_event(event)
                packed.record_stream(current)
            rows = self.table.unpack_rows(packed, math.prod(self.shape))
            self._rows = rows.view(*self.shape, self.table.embedding_dim)
        return self._rows


def _gather_and_copy(engram, input_ids, image_mask, hash_ids, device: torch.device, stream):
    # (on the worker thread for CUDA) hash on the host, gather into a pinned buffer, copy on the side stream
    with torch.no_grad():
        if hash_ids is None:
            hash_ids = engram.hash(input_ids, image_mask, on_host=True)
        packed = engram.embed.gather_packed(hash_ids.reshape(-1).to(HOST), pin=stream is not None)
        if stream is None:
            return packed.to(device), None
        with torch.cuda.device(device), torch.cuda.stream(stream):
            dest = torch.empty_like(packed, device=device)
            dest.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return dest, event


def prefetch_engram_rows(layers, input_ids: torch.Tensor, image_mask, hash_ids: dict) -> dict:
    """Before the first block of a prefill: {layer id: PrefetchedRows} for the Engram layers whose table is in host
    memory (the rest keep their entry of ``hash_ids``, {layer id: precomputed ids or None}). Nothing is prefetched
    when a host table is being trained (its lookup then runs in the forward, on the autograd graph)."""
    engrams = [layer.engram for layer in layers if layer.engram is not None]
    host = [e for e in engrams if e.embed.held_on_host and e.table_lookup is None]
    if not host or any(e.embed.needs_grad() for e in host):
        return hash_ids
    for engram in host:
        engram.embed.refuse_training()
    ids = input_ids.to(HOST)  # [b, s]: a few bytes; the hash runs on the host
    mask = None if image_mask is None else image_mask.to(HOST)
    result = dict(hash_ids)
    for engram in host:
        device = engram.q_weight.device
        stream = side_stream(device) if device.type == "cuda" else None
        given = hash_ids.get(engram.layer)  # precomputed ids: to the host here, not behind the worker's queue
        args = (engram, ids, mask, None if given is None else given.to(HOST), device, stream)
        job = _worker_pool().submit(_gather_and_copy, *args) if stream is not None else _gather_and_copy(*args)
        cols = (engram.max_ngram - 1) * engram.n_heads
        result[engram.layer] = PrefetchedRows(engram.embed, (*ids.shape, cols), job)
        result[engram.layer].stream = stream
    return result
