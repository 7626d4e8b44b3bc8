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
        self.graph = None  # the greedy draft's DraftGraph on CUDA, or why it cannot be captured

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
    at temperature 0); its choice selects the next position's Markov bias.  On CUDA the default (greedy) draft
    runs as the state's CUDA graph (``DraftGraph``, per ``model.decode_graph``; not "off")."""
    if pick is None:
        from .decode_graph import log_fallback, model_capture_reason

        reason = "" if model.decode_graph == "off" or not next_tokens.is_cuda else model_capture_reason(model)
        if reason is None and isinstance(state.graph, str):
            reason = state.graph
        if reason is None:
            if not isinstance(state.graph, DraftGraph) or state.graph.stale():
                state.graph = DraftGraph(model, state)
            graph = state.graph
            draft = graph(next_tokens)  # None: its eager run failed, the draft is made below
            if graph.failure:  # this state drafts eagerly from now on (logged once per reason)
                reason = state.graph = graph.failure
            if draft is not None:
                if reason:
                    log_fallback(f"DSpark draft: {reason}")
                return draft
        if reason:
            log_fallback(f"DSpark draft: {reason}")
    return DSparkDraft(*_draft(model, state.rings, state.window, state.lengths, next_tokens, pick))


def _draft(model, rings: dict, window: int, lengths: torch.Tensor, next_tokens: torch.Tensor, pick=None):
    # draft_block's work on tensors -> (tokens, logits, confidence, head_in, markov_embed), DSparkDraft's fields
    text = model.config.text_config
    stages, B, hc = model.mtp, text.dspark_block_size, text.hc_mult
    b = next_tokens.shape[0]
    ids = next_tokens.new_full((b, B), text.dspark_noise_token_id)
    ids[:, 0] = next_tokens
    h = model.embed(ids)  # [b, B, dim]
    x = h.unsqueeze(2).expand(b, B, hc, h.shape[-1]).contiguous()
    pre = torch.zeros(b, B, hc, dtype=torch.float32, device=h.device)
    pre[..., 0] = 1.0
    last = lengths - 1  # each row's newest main position: the ring's slots up to it are filled
    ring_slots = CSA2LayerCache(window, 0, False).window_slots(last.unsqueeze(1))  # [b, 1, W]
    step = DSparkStep({layer: ring.window_kv for layer, ring in rings.items()}, ring_slots,
                      lengths.unsqueeze(1) + torch.arange(B, device=h.device))
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
    return torch.stack(tokens, 1), logits, confidence, head_in, markov_embed


class DraftGraph:
    """A greedy ``draft_block`` of one ``DSparkState`` as a CUDA graph: the stages' few thousand small kernels in
    one replay.  Captured at the first call (after an eager run that is the real draft); later calls copy the next
    tokens and the state's lengths into the graph's input buffers and replay.  The rings are read where they are:
    their buffers' addresses are part of the key, so a reallocation (``map_rows``), a batch of another size, a
    moved or cast model or another ``decode_graph`` mode makes it stale (a new one is captured)."""

    def __init__(self, model, state: DSparkState):
        self.model, self.state = model, state
        self.key = self._key()
        self.next_tokens = self.lengths = self.graph = self.outputs = None
        self.failure = None  # why capturing failed (then the caller drafts eagerly from now on)

    def _key(self):
        from .decode_graph import model_epoch

        rings = tuple(ring.window_kv.data_ptr() for ring in self.state.rings.values())
        return rings, tuple(self.state.lengths.shape), model_epoch(self.model), self.model.decode_graph

    def stale(self) -> bool:
        return self.key != self._key()

    def _run(self):
        return _draft(self.model, self.state.rings, self.state.window, self.lengths, self.next_tokens)

    def __call__(self, next_tokens: torch.Tensor):
        """next_tokens [b] -> DSparkDraft of fresh tensors, or None when the first call could not be captured
        (``failure`` says why; the draft is then not made)."""
        from .decode_graph import CaptureError, capture, fresh

        if self.graph is not None:
            self.next_tokens.copy_(next_tokens)
            self.lengths.copy_(self.state.lengths)
            self.graph.replay()
            return DSparkDraft(*fresh(self.outputs))
        self.next_tokens, self.lengths = next_tokens.clone(), self.state.lengths.clone()
        try:
            result, self.graph, self.outputs, self.failure = capture(self._run, next_tokens.device)
        except CaptureError as error:
            self.failure = str(error)
            return None
        return DSparkDraft(*result)


@dataclass
class DSparkStats:
    """Self-speculative decoding's bookkeeping: ``accepted`` [steps][b] drafted tokens taken per verification step
    (each step also adds the verifier's own token); ``tokens_per_step`` = mean(accepted) + 1."""

    accepted: list

    @property
    def tokens_per_step(self) -> float:
        counts = [n for step in self.accepted for n in step]
        return 1.0 + sum(counts) / max(len(counts), 1)


def accept_greedy(draft: DSparkDraft, target_logits: torch.Tensor):
    """Greedy verification. target_logits fp32 [b, B+1, V] (position j: the token after block token j) ->
    (accepted [b], the verifier's token after them [b]): drafts are kept while they equal the target's argmax."""
    target = target_logits.argmax(-1)  # [b, B+1]
    same = (draft.tokens == target[:, :-1]).long()
    accepted = same.cumprod(-1).sum(-1)  # leading matches
    return accepted, target.gather(1, accepted.unsqueeze(1)).squeeze(1)


def accept_sampled(draft_probs: torch.Tensor, tokens: torch.Tensor, target_probs: torch.Tensor, generator=None):
    """Speculative sampling's rejection rule (Leviathan et al. 2023; Chen et al. 2023): draft token j, drawn from
    q_j, is kept with probability min(1, p_j / q_j); the first rejected one is replaced by a draw from
    norm(max(p_j - q_j, 0)); when all B are kept a bonus token comes from p_B.  Every emitted token is then
    distributed as the target's p.  draft_probs [b, B, V], tokens [b, B], target_probs [b, B+1, V] ->
    (accepted [b], next token [b])."""
    b, B = tokens.shape
    p = target_probs[:, :B].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(p.shape, device=p.device, generator=generator)
    keep = (u * q <= p).long()  # u < p / q without dividing by a zero q
    accepted = keep.cumprod(-1).sum(-1)  # [b]
    row = torch.arange(b, device=p.device)
    at = accepted.clamp(max=B - 1)
    residual = (target_probs[row, at] - draft_probs[row, at]).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[row, at])
    fallback = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator).squeeze(1)
    bonus = torch.multinomial(target_probs[:, B], 1, generator=generator).squeeze(1)
    return accepted, torch.where(accepted == B, bonus, fallback)


@torch.no_grad()
def speculative_generate(model, input_ids, attention_mask=None, max_new_tokens: int = 32, do_sample: bool = False,
                         temperature: float = 1.0, eos_token_id=None, pad_token_id=None, generator=None):
    """Self-speculative decoding with the DSpark stages: each step drafts ``dspark_block_size`` tokens, verifies
    them with the backbone in one forward over the B + 1 block (the last token and the drafts), keeps the accepted
    prefix plus the verifier's own next token and rolls the cache back over the rest.  Greedy (``do_sample``
    False) gives exactly plain greedy decoding's tokens; sampling keeps the target distribution (rejection rule).

    input_ids [b, s] (left padding by ``attention_mask``) -> (sequences [b, s + new], ``DSparkStats``); rows that end
    (``eos_token_id``) or run short are padded with ``pad_token_id``."""
    from .modeling_deepseek_v41 import real_lengths, roll_rows

    text = model.config.text_config
    B = text.dspark_block_size
    if not hasattr(model, "mtp"):
        raise ValueError("use_dspark=True needs the DSpark draft stages (num_nextn_predict_layers > 0 and "
                         "dspark_block_size > 0 in the config, mtp.* weights in the checkpoint)")
    if do_sample and not temperature > 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
    eos = set() if eos_token_id is None else set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    b = input_ids.shape[0]
    cache = model.dspark_cache(b, input_ids.shape[1] + max_new_tokens + B + 1, B)
    out = model(input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                output_dspark_hidden=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") and out.past_key_values is not None else cache
    lengths, shift = real_lengths(attention_mask, input_ids)
    hidden = out.dspark_hidden if shift is None else roll_rows(out.dspark_hidden, shift)  # rows left-aligned
    state = DSparkState(model.mtp, text.sliding_window)
    state.add(model.mtp, hidden, lengths.to(hidden.device))

    def choose(logits):  # fp32 [b, V] -> (token [b], probabilities or None)
        if not do_sample:
            return logits.argmax(-1), None
        probs = torch.softmax(logits / temperature, -1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1), probs

    last = out.logits[:, -1]
    nxt, _ = choose(last)
    produced = [[t] for t in nxt.tolist()]
    done = [t in eos for t in nxt.tolist()]
    stats = DSparkStats([])
    def picker(store):  # draft_block's choice of each drafted token, its distribution kept in store
        def pick(logits, i):
            token, probs = choose(logits)
            store.append(probs)
            return token

        return pick

    while not all(done) and min(len(p) for p in produced) < max_new_tokens:
        draft_probs = []
        draft = draft_block(model, state, nxt, picker(draft_probs) if do_sample else None)  # greedy: a graph
        block = torch.cat([nxt.unsqueeze(1), draft.tokens], 1)  # [b, B+1] at each row's positions lengths..
        # the block's ids come from the model (its draft and its pick): no value checks, whose host reads would
        # idle the GPU before every verification (the name is modeling's GENERATE_DECODE_STEP)
        verify = model(block, past_key_values=cache, use_cache=True, output_dspark_hidden=True,
                       _generate_decode_step=True)
        if do_sample:
            target = torch.softmax(verify.logits / temperature, -1)
            accepted, nxt = accept_sampled(torch.stack(draft_probs, 1), draft.tokens, target, generator)
        else:
            accepted, nxt = accept_greedy(draft, verify.logits)
        cache.rollback(B - accepted)  # keep the block's first accepted + 1 positions
        keep = accepted + 1
        state.add_rows(model.mtp, verify.dspark_hidden, keep)
        stats.accepted.append(accepted.tolist())
        for i, (n, row) in enumerate(zip(keep.tolist(), block.tolist())):
            if done[i]:
                continue
            for token in row[1:n] + [int(nxt[i])]:
                if len(produced[i]) < max_new_tokens and not done[i]:
                    produced[i].append(token)
                    done[i] = token in eos
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    width = max(len(p) for p in produced)
    new = torch.tensor([p + [pad] * (width - len(p)) for p in produced], device=input_ids.device)
    return torch.cat([input_ids, new], 1), stats
