"""The decode step on CUDA as a graph: captured once per static cache and width, replayed at every later step.

An eager decode step of the 4-layer released-width proxy launches ~2,200 small kernels one by one from Python: the
GPU idles for most of the step.  With a ``DeepseekV41StaticCache`` the step has fixed shapes, fixed tensor
addresses and no host reads, so it is captured as a ``torch.cuda.CUDAGraph`` (all blocks, the final norm, the fp32
head and the cache's in-place writes) and each later step is a copy of the new token ids into the graph's input
buffer and one replay.  The graph belongs to its cache: one per (batch, max length), and ``generate`` reuses its
static caches across calls (``DeepseekV41ForCausalLM.static_cache``), so a second call of the same shape replays
without capturing again.

The same holds for a multi-token step (a speculative block's verification: n = B + 1 tokens per row in one pass,
``DeepseekV41Model.decode_widths``): a static cache holds one graph per (width, whether the DSpark stages' input is
an output), each captured at its first use, so a verification costs one replay instead of n one-token steps.

The first step of a cache (at a width) runs eagerly on a side stream (it is the real step, and the warm-up the capture needs:
Triton builds, cuBLAS workspaces), with CUDA's sync debug mode set to raise, so that anything that would read back
to the host is found before capturing; then the step is captured (capturing runs nothing).  The replay runs the
captured kernels on the same buffers: its results are those of the eager step, bit for bit.

``DeepseekV41ForCausalLM.decode_graph`` picks how a static cache's decode step runs on CUDA:
* ``"cuda_graph"`` (default): the eager step's kernels, captured as above;
* ``"compile"``: the step through ``torch.compile(fullgraph=True, dynamic=False)`` first (Inductor's fused kernels:
  fewer, larger kernels, e.g. the 20 Sinkhorn rounds of each mHC mix in one), captured the same way; its numerics
  are Inductor's, not the eager step's;
* ``"off"``: eager.
Anything that cannot be captured (a host read in the step, a model spread over several devices, expert
parallelism, gradients enabled) falls back to the eager step, with one log line saying why.
"""

import logging

import torch

logger = logging.getLogger(__name__)

MODES = ("cuda_graph", "compile", "off")
_logged = set()


def log_fallback(reason: str) -> None:
    """One line per distinct reason: the eager step runs instead of a graph."""
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("deepseek_v41: decode step not replayed as a CUDA graph (%s); decoding eagerly", reason)


def unusable_reason(model, cache, input_ids: torch.Tensor, key=(1, False)) -> str | None:
    """Why this decode step cannot run as a graph (None: it can; ``key``: its graph's (width, DSpark input)).  CPU
    tensors and ``decode_graph="off"`` are not reasons worth a log line: they return ''."""
    mode = model.decode_graph
    if mode not in MODES:
        raise ValueError(f"decode_graph={mode!r}: use one of {MODES}")
    if mode == "off" or not input_ids.is_cuda or not cache.is_static:
        return ""
    if isinstance(cache.graphs.get(key), str):
        return cache.graphs[key]
    if any(layer.engram is not None and layer.engram.embed.held_on_host for layer in model.layers):
        return "the Engram tables are in host memory (engram_device='cpu'): each step gathers its rows on the host"
    return model_capture_reason(model)


def model_capture_reason(model) -> str | None:
    """Why no call of this model can be captured now (None: it can)."""
    if torch.is_grad_enabled():
        return "gradients are enabled: a captured step runs under torch.no_grad() or torch.inference_mode()"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"the model is spread over {len(devices)} devices"
    if any(getattr(module, "dispatcher", None) is not None for module in model.modules()):
        return "expert parallelism exchanges tokens between processes"
    return None


class DecodeGraph:
    """The captured decode step of one static cache (its batch, its buffers), for one model, at one width: n new
    tokens per row (1, or a multi-token step's block), with or without the DSpark stages' input as an output."""

    def __init__(self, model, cache, mode: str, width: int = 1, dspark: bool = False):
        self.model, self.cache, self.mode, self.width, self.dspark = model, cache, mode, width, dspark
        self.key = (cache.version, model_epoch(model), mode)
        self.input_ids = None  # int64 [b, width]: the graph's input, copied in before each replay
        self.graph = self.outputs = None  # the graph and its outputs (overwritten by each replay)
        if mode == "compile":
            if getattr(model, "_compiled_decode_body", None) is None:  # one compiled function, a graph per shape
                model._compiled_decode_body = torch.compile(model._decode_outputs, fullgraph=True, dynamic=False)
            self.body = model._compiled_decode_body
        else:
            self.body = model._decode_outputs

    @property
    def hidden(self):
        return None if self.outputs is None else self.outputs[0]

    @property
    def logits(self):
        return None if self.outputs is None else self.outputs[1]

    def stale(self) -> bool:
        """True once the cache's buffers were reallocated, the model moved or cast, or the mode changed."""
        return self.key != (self.cache.version, model_epoch(self.model), self.model.decode_graph)

    def __call__(self, input_ids: torch.Tensor):
        """input_ids [b, width] -> (hidden [b, width, dim], fp32 logits [b, width, vocab], the DSpark input [b, width,
        targets·dim] or None), fresh tensors; advances the rows (not the cache's column count, the caller's).  Raises
        ``CaptureError`` when the first step cannot be captured; the step is then not done (the cache is as before),
        so the caller can run it eagerly."""
        if self.graph is None:
            return self._warm_up_and_capture(input_ids)
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        return fresh(self.outputs)

    def _run(self):
        return self.body(self.input_ids, self.cache, self.dspark)

    def _warm_up_and_capture(self, input_ids):
        self.input_ids = input_ids.to(torch.long).clone()
        check_syncs = self.mode == "cuda_graph"  # Inductor may synchronize while it compiles
        result, self.graph, self.outputs, failure = capture(self._run, input_ids.device, check_syncs)
        if failure:  # the real step was done by the warm-up: its result stands, later steps run eagerly
            reason = self.cache.graphs[(self.width, self.dspark)] = failure
            log_fallback(reason)
        return result


def capture(run, device, check_syncs: bool = True):
    """Run ``run()`` (-> a tuple of tensors or None) once eagerly on a side stream (the real call, and the warm-up
    a capture needs), with host reads raising when ``check_syncs``; then capture it as a CUDA graph (capturing
    runs nothing) -> (fresh copies of the eager outputs, the graph or None, the graph's output tensors or None,
    why capturing failed or None).  Raises ``CaptureError`` when the eager run fails; nothing it wrote counts then."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with torch.cuda.stream(side):
            if check_syncs:
                torch.cuda.set_sync_debug_mode("error")
            try:
                outputs = run()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    except Exception as error:
        current.wait_stream(side)
        raise CaptureError(f"its eager run failed: {first_line(error)}") from error
    current.wait_stream(side)
    result = fresh(outputs)  # on the current stream, after the side stream's run
    for t in outputs:
        if t is not None:
            t.record_stream(current)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = run()
    except Exception as error:  # noqa: BLE001 (any failure: the eager step stands, the reason is logged)
        return result, None, None, f"capturing failed: {first_line(error)}"
    return result, graph, captured, None


def fresh(outputs):
    return tuple(None if t is None else t.clone() for t in outputs)


class CaptureError(RuntimeError):
    pass


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def model_epoch(model) -> tuple:
    # the model's casts and moves (and remade head copies, head_logits), and the head weight's in-place changes:
    # a graph may read the weight's bf16 copy, which only an eager call remakes
    head = getattr(model, "head", None)
    weight = getattr(head, "weight", None)
    return getattr(model, "_decode_graph_epoch", 0), (weight._version if isinstance(weight, torch.Tensor) else None)


def graph_decode_step(model, cache, input_ids: torch.Tensor, dspark: bool = False):
    """One decode step of input_ids [b, n] (n = 1, or a multi-token step) through the cache's graph of that width
    (captured at its first step) -> (hidden, logits, the DSpark input or None), or None when it must run eagerly
    (the reason logged once, unless it is only CPU or "off")."""
    key = (input_ids.shape[1], dspark)
    reason = unusable_reason(model, cache, input_ids, key)
    if reason is not None:
        if reason:
            log_fallback(reason)
        return None
    graph = cache.graphs.get(key)
    if graph is None or graph.stale():
        graph = cache.graphs[key] = DecodeGraph(model, cache, model.decode_graph, *key)
    try:
        return graph(input_ids)
    except CaptureError as error:
        cache.graphs[key] = str(error)
        log_fallback(cache.graphs[key])
        return None
