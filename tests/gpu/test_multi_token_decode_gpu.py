"""The multi-token decode step replayed as a CUDA graph (decode_graph.py, one graph per block width), on the GPU:

    python -m pytest -q tests/gpu/test_multi_token_decode_gpu.py

* graph = eager for blocks of 5 tokens per row with rollbacks between them (bf16, a left-padded batch of 3): the
  replay runs the eager step's kernels, so its logits, DSpark input and cache are the eager step's bit for bit; the
  eager multi-token step against the same tokens fed column by column within the static cache's bf16 gates;
* each width gets its own graph, captured once and replayed;
* the greedy draft (``dspark.DraftGraph``) replayed = the eager draft, bit for bit, across drafts and a row reorder;
* ``generate(use_dspark=True)`` on the DSpark fixture (bf16, static cache, graphs) gives plain greedy decoding's
  tokens, its verifications through the (B + 1)-token graph.
Needs a CUDA GPU; skips otherwise.
"""

import copy

import pytest
import torch
from conftest import DSPARK_FIXTURE, golden_dir, tiny_model
from gpu_metrics import gate
from test_decode_graph_gpu import left_padded

from deepseek_v41.cache_deepseek_v41 import DeepseekV41StaticCache
from deepseek_v41.decode_graph import DecodeGraph
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM
from deepseek_v41.parity import logits_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPARE, WIDTH = 4, 5


@pytest.fixture(scope="module")
def model(v4_tokenizer):
    return tiny_model(v4_tokenizer, dtype=torch.bfloat16).cuda().eval()


def prefilled(model, lengths, seed=0):
    """A static cache that can undo SPARE positions, after a left-padded prefill of random prompts of ``lengths``;
    and each row's continuation ids [b, 64]."""
    ids, mask = left_padded(lengths, seed)
    cache = DeepseekV41StaticCache(model.config, ids.shape[1] + 80, rollback_tokens=SPARE)
    model(ids, attention_mask=mask, cache=cache)
    g = torch.Generator().manual_seed(seed + 1)
    return cache, torch.randint(3, 1000, (len(lengths), 64), generator=g).cuda()


@torch.no_grad()
def test_multi_token_graph_equals_eager_and_columns(model):
    graph_cache, rest = prefilled(model, [37, 5, 21])
    eager_cache = copy.deepcopy(graph_cache)
    at = torch.zeros(3, dtype=torch.long)
    graph_logits, eager_logits, column_logits = [], [], []
    for back in ([4, 0, 2], [1, 3, 0], [0, 0, 4], [2, 4, 1], [3, 1, 0]):
        block = torch.stack([rest[i, int(at[i]) : int(at[i]) + WIDTH] for i in range(3)])
        model.decode_graph = "cuda_graph"
        graph = model(block, cache=graph_cache)
        model.decode_graph = "off"
        columns = copy.deepcopy(eager_cache)
        eager = model(block, cache=eager_cache)
        model.decode_at_once = False
        column_logits.append(model(block, cache=columns).logits)
        model.decode_at_once = True
        graph_logits.append(graph.logits)
        eager_logits.append(eager.logits)
        for cache in (graph_cache, eager_cache):
            cache.rollback(torch.tensor(back))
        at += WIDTH - torch.tensor(back)
    model.decode_graph = "cuda_graph"
    captured = graph_cache.graphs[(WIDTH, False)]
    assert isinstance(captured, DecodeGraph) and captured.graph is not None  # captured once, then replayed
    for got, expected in zip(graph_logits, eager_logits):
        assert torch.equal(got, expected)
    for mine, theirs in zip(graph_cache.layers, eager_cache.layers):
        for name, tensor in mine.tensors().items():
            assert torch.equal(tensor, theirs.tensors()[name]), name
    eager, columns = torch.cat(eager_logits, 1).flatten(0, 1), torch.cat(column_logits, 1).flatten(0, 1)
    assert torch.equal(eager.argmax(-1), columns.argmax(-1))
    # test_static_cache's bf16 gate; measured 0.0 on an H100 (2026-12-07): six columns and one column ran the same
    # kernels here; the gate leaves room for GEMMs of 6 rows summing in another order than those of 1 (cuBLAS picks
    # by shape), at 1/10 of the 1e-3 bf16 gate of the decode paths
    gate("mean_kl_columns_vs_one_step", logits_metrics(columns.float(), eager.float())["mean_kl"], 1e-4, inclusive=True)


@torch.no_grad()
def test_speculative_greedy_through_the_block_graph_equals_greedy():
    # bf16 and dequantized, the configuration whose steps are captured: in fp32, torch 2.11's _grouped_mm reads its
    # offsets back to the host (seen on an H100 and traced to the experts on an H200: "called a synchronizing CUDA operation"), and
    # the kept formats' tile fallback reads its expert counts, so those steps run eagerly (logged); kept models are
    # covered by test_kept_gpu.  The multi-token step equals the columns' argmax in bf16 (test above)
    model = DeepseekV41ForCausalLM.from_pretrained(golden_dir(DSPARK_FIXTURE) / "snapshot", dtype=torch.bfloat16,
                                                   dequantize_base_checkpoint=True)
    model = model.cuda().eval()
    B = model.config.text_config.dspark_block_size
    from safetensors.torch import load_file

    ids = load_file(str(golden_dir(DSPARK_FIXTURE) / "reference" / "golden.safetensors"))["input_ids"].cuda()
    model.release_static_caches()
    plain = model.generate(ids[:, :20], max_new_tokens=24, do_sample=False)
    spec = model.generate(ids[:, :20], max_new_tokens=24, do_sample=False, use_dspark=True)
    assert torch.equal(spec, plain)
    caches = list(model.__dict__["_static_caches"].values())
    verify = [c.graphs.get((B + 1, True)) for c in caches]
    assert any(isinstance(g, DecodeGraph) and g.graph is not None for g in verify), verify


@torch.no_grad()
def test_greedy_draft_graph_equals_eager_draft():
    # draft_block's CUDA graph (dspark.DraftGraph) replays the eager draft's kernels: every output bit for bit, at
    # each of several drafts with the state advanced between them by different counts per row (the rings written
    # in place, the lengths copied in at each replay); map_rows reallocates the rings: a new graph is captured
    from deepseek_v41.dspark import DraftGraph, DSparkState, draft_block

    model = DeepseekV41ForCausalLM.from_pretrained(golden_dir(DSPARK_FIXTURE) / "snapshot", dtype=torch.bfloat16,
                                                   dequantize_base_checkpoint=True).cuda().eval()
    text = model.config.text_config
    B, width = text.dspark_block_size, len(text.dspark_target_layer_ids) * text.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    state = DSparkState(model.mtp, text.sliding_window)
    state.add(model.mtp, torch.randn(3, 40, width, device="cuda", generator=g, dtype=torch.bfloat16),
              torch.tensor([40, 13, 27], device="cuda"))
    tokens = torch.tensor([5, 900, 77], device="cuda")
    graphs = []
    for keep in ([1, 6, 3], [6, 2, 4], [2, 2, 6], [5, 1, 1]):
        model.decode_graph = "off"
        eager = draft_block(model, state, tokens)
        model.decode_graph = "cuda_graph"
        graph = draft_block(model, state, tokens)
        graphs.append(state.graph)
        for name in ("tokens", "logits", "confidence", "head_in", "markov_embed"):
            assert torch.equal(getattr(graph, name), getattr(eager, name)), name
        state.add_rows(model.mtp, torch.randn(3, B + 1, width, device="cuda", generator=g, dtype=torch.bfloat16),
                       torch.tensor(keep, device="cuda"))
        tokens = graph.tokens[:, -1]
    assert all(isinstance(x, DraftGraph) and x.graph is not None for x in graphs)
    assert all(x is graphs[0] for x in graphs)  # captured once, then replayed
    state.map_rows(lambda t: t[[2, 0]])
    assert state.graph.stale()
    model.decode_graph = "off"
    eager = draft_block(model, state, tokens[[2, 0]])
    model.decode_graph = "cuda_graph"
    again = draft_block(model, state, tokens[[2, 0]])
    assert state.graph is not graphs[0] and state.graph.graph is not None
    assert torch.equal(again.logits, eager.logits) and torch.equal(again.tokens, eager.tokens)
