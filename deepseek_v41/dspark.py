"""DSpark draft stages (architecture.md §11): ``mtp.{k}``, drafting ``dspark_block_size`` tokens in one pass.

Stage k is a full block (mHC, window-only attention, an MoE with its own ``dspark_n_routed_experts``) at layer index
``num_hidden_layers + k``.  Their input is the main model's: at each position the mean over the 4 streams of the
input of every ``dspark_target_layer_ids`` block, concatenated, projected by stage 0's ``main_proj`` and normed
(``main_norm``): ``main_x`` [b, n, dim].  Each stage keeps a window ring of ``main_x``'s K = V (its own ``wkv``,
RoPE at the position, FP8-rounded) for the positions the main model has processed.

A draft from position p (the main model's last processed position, its next token t known) runs the stages once
over a block of B tokens at positions p+1 .. p+B: [t, noise, ..., noise].  Every block query sees the ring (the
last ``sliding_window`` main positions) and all B block keys (no causal mask inside the block).  Block logits i
= head(norm(collapse)) + the Markov head's bias of the token before it (``markov_head.head(markov_head.embed(·))``)
predict position p+2+i; the drafts are chained through that bias (i's token picks i+1's bias).  The confidence
head scores each drafted token from the collapsed stream and its Markov embedding.
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .attention import Attention
from .cache_deepseek_v41 import CSA2LayerCache
from .layers import make_linear, make_rms_norm
from .sparse_attention import sparse_attention_torch


def dspark_stage_count(text) -> int:
    """Stages the model builds: ``num_nextn_predict_layers`` when ``dspark_block_size`` is set, else none."""
    return text.num_nextn_predict_layers if text.dspark_block_size else 0


def check_dspark_config(text) -> None:
    """Raise ``ValueError`` naming the field unless the DSpark fields describe stages this model can build."""
    n, stages = text.num_hidden_layers, dspark_stage_count(text)
    if not stages:
        return
    fix = "or set num_nextn_predict_layers to 0 (no DSpark stages)"
    ratios = text.compress_ratios[n : n + stages]
    if len(ratios) < stages or any(ratios):
        raise ValueError(f"compress_ratios needs one 0 entry per DSpark stage after the {n} layers (the stages are "
                         f"window-only); got {text.compress_ratios[n:]}: append {stages} zeros, {fix}")
    targets = text.dspark_target_layer_ids
    if not targets or any(not 0 <= t < n for t in targets):
        raise ValueError(f"dspark_target_layer_ids = {targets} must be non-empty backbone layers (0..{n - 1}), {fix}")
    if not 1 <= text.dspark_num_experts_per_tok <= text.dspark_n_routed_experts:
        raise ValueError(f"dspark_num_experts_per_tok = {text.dspark_num_experts_per_tok} must be in 1.."
                         f"dspark_n_routed_experts ({text.dspark_n_routed_experts}), {fix}")
    if text.dspark_markov_rank < 1 or not 0 <= text.dspark_noise_token_id < text.vocab_size:
        raise ValueError(f"dspark_markov_rank = {text.dspark_markov_rank} must be >= 1 and dspark_noise_token_id = "
                         f"{text.dspark_noise_token_id} a token id below vocab_size {text.vocab_size}, {fix}")


def stage_config(text):
    """The text config a stage's block is built from: the stage's routed experts instead of the backbone's."""
    config = copy.deepcopy(text)
    config.n_routed_experts = text.dspark_n_routed_experts
    config.num_experts_per_tok = text.dspark_num_experts_per_tok
    return config


class DSparkAttention(Attention):
    """Window-only attention of a stage: block queries over the ring of main-model keys and the block's own keys."""

    def main_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # main_x [b, n, dim] at positions [b, n] -> the ring's K = V [b, n, head_dim] (post-RoPE, FP8-rounded)
        b, n, _ = main_x.shape
        return self._window_kv(main_x.reshape(1, b * n, -1), self._rope_cis(positions.reshape(-1))).view(b, n, -1)

    def forward(self, x: torch.Tensor, state: "DSparkStep") -> torch.Tensor:
        # x [b, B, dim] (normed block) -> [b, B, dim].  The batch runs as one sequence [1, b·B, ·] (a RoPE
        # position per token); the attention gathers per row from [ring ; block keys]
        b, B, _ = x.shape
        cis = self._rope_cis(state.positions.reshape(-1))
        xt = x.reshape(1, b * B, -1)
        _, q = self._queries(xt, cis)  # [1, b·B, h, head_dim]
        ring = state.rings[self.layer]  # [b, W, head_dim]
        keys = torch.cat([ring, self._window_kv(xt, cis).view(b, B, -1).to(ring.dtype)], dim=1)
        block = torch.arange(B, device=x.device) + ring.shape[1]
        idx = torch.cat([state.ring_slots.expand(b, B, -1), block.expand(b, B, B)], dim=-1)  # [b, B, W + B]
        o = sparse_attention_torch(q.view(b, B, self.n_heads, self.head_dim), keys, self.attn_sink, idx,
                                   self.head_dim**-0.5)
        return self._output(o.reshape(1, b * B, self.n_heads, self.head_dim), cis).view(b, B, -1)


class DSparkMarkovHead(nn.Module):
    """A low-rank bigram bias: the previous token's ``embed`` row (rank r) times ``head`` (fp32, like the LM head)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False, dtype=torch.float32)

    def forward(self, token_ids: torch.Tensor):
        # token_ids [b] -> (fp32 logit bias [b, vocab], embedding [b, rank])
        embed = self.embed(token_ids)
        return nn.functional.linear(embed.float(), self.head.weight.float()), embed


class DSparkConfidenceHead(nn.Module):
    """One fp32 logit per drafted token from [collapsed stream ; Markov embedding] (held fp32; BF16 on disk)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        # hidden [b, B, dim], markov_embed [b, B, rank] -> fp32 [b, B]
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1).float()
        return nn.functional.linear(x, self.proj.weight.float()).squeeze(-1)


def build_stages(text, backend: dict, block_cls, has_image_bias: bool) -> nn.ModuleList:
    """The ``mtp`` ModuleList: ``block_cls`` blocks (the backbone's) with a ``DSparkAttention`` and the stage
    extras (stage 0: ``main_proj``, ``main_norm``; the last: ``norm``, ``markov_head``, ``confidence_head``).
    With a vision tower the stages' routers hold ``bias_vl`` too, as released (drafts are text)."""
    check_dspark_config(text)
    stages, config, n = nn.ModuleList(), stage_config(text), dspark_stage_count(text)
    dim = text.hidden_size
    for k in range(n):
        layer = text.num_hidden_layers + k
        stage = block_cls(config, layer, backend, has_image_bias, None)
        stage.attn = DSparkAttention(config, layer, backend)
        if k == 0:
            stage.main_proj = make_linear(dim * len(text.dspark_target_layer_ids), dim, backend)
            stage.main_norm = make_rms_norm(dim, text.rms_norm_eps, backend)
        if k == n - 1:
            stage.norm = make_rms_norm(dim, text.rms_norm_eps, backend)
            stage.markov_head = DSparkMarkovHead(text.vocab_size, text.dspark_markov_rank)
            stage.confidence_head = DSparkConfidenceHead(dim + text.dspark_markov_rank)
        stages.append(stage)
    return stages


class DSparkState:
    """What drafting needs from the positions already processed: per stage the window ring of ``main_x`` keys
    [b, W, head_dim] (position p in slot p % W) and each row's count of positions seen (``lengths`` [b])."""

    def __init__(self, stages: nn.ModuleList, window: int):
        self.rings = {stage.attn.layer: CSA2LayerCache(window, 0, False) for stage in stages}
        self.window, self.lengths = window, None

    def add(self, stages: nn.ModuleList, main_hidden: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """Record main_hidden [b, n, targets·dim]: the first call seeds positions 0 .. n-1 (``lengths`` [b]: how many
        of each left-aligned row's columns are real, default all), later ones add n positions to every row."""
        if self.lengths is None:
            lengths = torch.full(main_hidden.shape[:1], main_hidden.shape[1], device=main_hidden.device) \
                if lengths is None else lengths
            positions = torch.arange(main_hidden.shape[1], device=main_hidden.device).expand(len(lengths), -1)
            for stage, kv in self._keys(stages, main_hidden, positions):
                self.rings[stage.attn.layer].fill_window(kv, lengths)
            self.lengths = lengths.clone()
        else:
            self.add_rows(stages, main_hidden, torch.full_like(self.lengths, main_hidden.shape[1]))

    def add_rows(self, stages: nn.ModuleList, main_hidden: torch.Tensor, counts: torch.Tensor) -> None:
        """Record the first counts[i] of row i's n new positions (main_hidden [b, n, targets·dim], at lengths ..)."""
        b, n, _ = main_hidden.shape
        positions = self.lengths.unsqueeze(1) + torch.arange(n, device=main_hidden.device)  # [b, n]
        rows = torch.arange(b, device=main_hidden.device)
        for stage, kv in self._keys(stages, main_hidden, positions):
            ring = self.rings[stage.attn.layer].window_kv  # [b, slots, head_dim]
            for j in range(n):  # a row's slot is rewritten only when the row keeps that position
                slot = positions[:, j] % ring.shape[1]
                ring[rows, slot] = torch.where((j < counts).unsqueeze(1), kv[:, j].to(ring.dtype), ring[rows, slot])
        self.lengths = self.lengths + counts

    @staticmethod
    def _keys(stages, main_hidden, positions):
        # (stage, its ring keys [b, n, head_dim]) for main_hidden at positions [b, n]
        main_x = stages[0].main_norm(stages[0].main_proj(main_hidden))  # [b, n, dim], shared by the stages
        return [(stage, stage.attn.main_kv(main_x, positions)) for stage in stages]

    def map_rows(self, fn) -> None:
        """Apply ``fn`` to every row-indexed tensor (beam reorder, batch selection)."""
        for ring in self.rings.values():
            ring.map_tensors(fn)
        self.lengths = fn(self.lengths)


@dataclass
class DSparkStep:
    """The attention inputs of one draft: rings by stage layer, ring slots a query may read [b, 1, W], block
    positions [b, B]."""

    rings: dict
    ring_slots: torch.Tensor
    positions: torch.Tensor


@dataclass
class DSparkDraft:
    """One drafted block: ``tokens`` [b, B] (for positions p+2 .. p+B+1), their fp32 ``logits`` [b, B, vocab]
    (head + Markov bias) and ``confidence`` fp32 [b, B]; ``head_in`` [b, B, dim] and ``markov_embed`` [b, B, r]
    are the heads' inputs."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    head_in: torch.Tensor
    markov_embed: torch.Tensor


def draft_block(model, state: DSparkState, next_tokens: torch.Tensor, pick=None) -> DSparkDraft:
    """Draft ``dspark_block_size`` tokens after ``next_tokens`` [b] (each row's token at position ``state.lengths``).

    ``pick(logits [b, vocab], i) -> tokens [b]`` chooses each drafted token (default: argmax, as the official code
    at temperature 0); its choice selects the next position's Markov bias."""
    text = model.config.text_config
    stages, B, hc = model.mtp, text.dspark_block_size, text.hc_mult
    b = next_tokens.shape[0]
    ids = next_tokens.new_full((b, B), text.dspark_noise_token_id)
    ids[:, 0] = next_tokens
    h = model.embed(ids)  # [b, B, dim]
    x = h.unsqueeze(2).expand(b, B, hc, h.shape[-1]).contiguous()
    pre = torch.zeros(b, B, hc, dtype=torch.float32, device=h.device)
    pre[..., 0] = 1.0
    last = state.lengths - 1  # each row's newest main position: the ring's slots up to it are filled
    ring_slots = CSA2LayerCache(state.window, 0, False).window_slots(last)
    step = DSparkStep({layer: ring.window_kv for layer, ring in state.rings.items()}, ring_slots,
                      state.lengths.unsqueeze(1) + torch.arange(B, device=h.device))
    for stage in stages:
        x, pre = stage(x, pre, step)
    final = stages[-1]
    collapsed = model.hc_collapse(x, pre)  # [b, B, dim]
    head_in = final.norm(collapsed)
    logits = model.head_logits(head_in)  # fp32 [b, B, vocab]
    tokens, embeds, previous = [], [], next_tokens
    for i in range(B):
        bias, embed = final.markov_head(previous)
        logits[:, i] += bias
        previous = logits[:, i].argmax(-1) if pick is None else pick(logits[:, i], i)
        tokens.append(previous)
        embeds.append(embed)
    markov_embed = torch.stack(embeds, 1)
    confidence = final.confidence_head(collapsed, markov_embed)
    return DSparkDraft(torch.stack(tokens, 1), logits, confidence, head_in, markov_embed)

