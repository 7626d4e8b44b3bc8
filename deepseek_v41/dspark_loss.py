"""The DSpark draft stages' training loss (issue 42 item 5): a fine-tune keeps its drafts aligned with the backbone.

What a stage predicts is fixed by the drafting forward (dspark.py, the official ``forward_spec``): from an anchor
position p (the backbone's last processed position) the stages run once over the block [x(p+1), noise, ..., noise]
at positions p+1 .. p+B (B = ``dspark_block_size``); every block query sees the window of ring keys built from the
backbone's ``dspark_target_layer_ids`` inputs at positions p-W+1 .. p (W = ``sliding_window``) and all B block keys.
Block output i predicts the token at position p+2+i, with the Markov head's bias of the token before it (position
p+1+i) added to its logits.  Training runs every anchor of a sequence at once, each block as its own row.

The official code implements only that forward (no loss, no training notes), so the objective is ours:

* **drafts**: fp32 cross-entropy of block output i against the token at p+2+i, wherever that token is a supervised
  label of the main loss (``labels`` aligned with ``input_ids``, -100 = ignored, ``attention_mask`` 0 = padding);
  teacher-forced: the Markov bias comes from the true token at p+1+i (drafting chains the drafted one; the two
  agree exactly on the prefix that verification can accept);
* **confidence**: the confidence head's logit, trained with binary cross-entropy to the probability that the
  stage's draft (the argmax of the teacher-forced logits) equals the target token.  The official code only scores
  drafts with it; this target is our choice;
* the loss is the sum of both, each summed over the drafted positions; ``DSparkLoss`` keeps the sums and the count.

Gradients reach the stages only (``mtp.*``): the target layers' hidden states are detached, the shared embedding
is looked up without gradient and the shared head's weight is detached, so the drafts follow the backbone and
never steer it (the backbone's gradients are the same with and without this loss).  MTP in DeepSeek-V3
pre-training did back-propagate into the trunk; for a fine-tune whose objective is the main loss we keep the
backbone out.  A wrapped head (PEFT) is called as a module, so its adapter gets the draft gradient too.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dspark import DSparkStep
from .layers import is_plain_linear

IGNORE_INDEX = -100


@dataclass
class DSparkLoss:
    """Sums over the drafted positions (fp32 scalars): ``draft`` cross-entropy and ``confidence`` BCE (with
    gradients), ``correct`` drafts (argmax = target) and ``count`` (int64).  The means divide by ``count``."""

    draft: torch.Tensor
    confidence: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        return self.draft + self.confidence


def dspark_loss_weight(config) -> float:
    """The model config's ``text_config.dspark_loss_weight`` (0 = off; older configs lack it)."""
    return float(getattr(config.text_config, "dspark_loss_weight", 0.0) or 0.0)


def draft_targets(labels: torch.Tensor, attention_mask, block_size: int) -> torch.Tensor:
    """labels [b, s] (aligned with input_ids) -> targets [b, s, B]: the label the draft of anchor p, block output
    i predicts (column p+2+i), -100 where it is ignored, padding or past the end."""
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask.to(labels.device) == 0, IGNORE_INDEX)
    b, s = labels.shape
    padded = torch.cat([labels, labels.new_full((b, block_size + 2), IGNORE_INDEX)], 1)
    return padded.unfold(1, block_size, 1)[:, 2 : s + 2]  # [b, s, B]: columns p+2 .. p+B+1


def draft_count(labels: torch.Tensor, attention_mask, block_size: int) -> torch.Tensor:
    """The drafted positions a batch trains (int64 scalar): known before the forward (loss normalization)."""
    return (draft_targets(labels, attention_mask, block_size) != IGNORE_INDEX).sum()


class _Rings(dict):
    """The ``DSparkStep.rings`` of a training block: each stage's window keys [b·A, W, head_dim], computed when
    the stage's attention reads them (``DSparkAttention.forward``), so its FSDP unit has its weights gathered."""

    def __init__(self, stages, main_x, window_positions):
        super().__init__()
        self.attn = {stage.attn.layer: stage.attn for stage in stages}
        self.main_x, self.window_positions = main_x, window_positions  # [b, s, dim], [b, A, W] (-1: none)

    def __getitem__(self, layer):
        b, s, _ = self.main_x.shape
        keys = self.attn[layer].main_kv(self.main_x, torch.arange(s, device=self.main_x.device).expand(b, s))
        at = self.window_positions.clamp(min=0).view(b, -1, 1).expand(-1, -1, keys.shape[-1])
        return keys.gather(1, at).view(-1, self.window_positions.shape[-1], keys.shape[-1])


def _head_logits(model, x: torch.Tensor) -> torch.Tensor:
    # x [n, dim] -> fp32 [n, vocab] through the shared head with its weight detached (see the module docstring)
    if is_plain_linear(model.head):
        return model.head_matmul(x, model.head.weight.detach())
    return model.head(x.float()).float()


def dspark_stage_loss(model, main_hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                      attention_mask=None, return_logits: bool = False):
    """The stages' loss over every anchor of a right-padded batch.

    main_hidden [b, s, targets·dim] (the forward's ``dspark_hidden``), input_ids / labels [b, s] -> ``DSparkLoss``
    (with ``return_logits``: also (logits fp32 [n, vocab], confidence fp32 [n], targets [n]) of the n drafted
    positions, ordered by row, anchor, block output).  Anchors with nothing to predict are left out; every call
    runs at least one block, so each rank takes part in the stages' expert all-to-all."""
    text = model.config.text_config
    stages, B, W, hc = model.mtp, text.dspark_block_size, text.sliding_window, text.hc_mult
    b, s = input_ids.shape
    device = main_hidden.device
    input_ids, labels = input_ids.to(device), labels.to(device)
    targets = draft_targets(labels, attention_mask, B)  # [b, s, B]
    used = (targets != IGNORE_INDEX).any(-1)  # [b, s]
    A = max(int(used.sum(1).max()), 1)
    anchors = torch.argsort((~used).to(torch.int8), dim=1, stable=True)[:, :A]  # [b, A]: used anchors first
    targets = targets.gather(1, anchors.unsqueeze(-1).expand(-1, -1, B)).reshape(-1)  # [b·A·B]
    offsets = torch.arange(B, device=device)
    columns = (anchors.unsqueeze(-1) + 1 + offsets).clamp(max=s - 1)  # [b, A, B]: p+1+i (the block's positions)
    tokens = input_ids.gather(1, columns.view(b, -1)).view(b * A, B)  # true tokens at p+1+i: the Markov inputs
    ids = torch.full_like(tokens, text.dspark_noise_token_id)
    ids[:, 0] = tokens[:, 0]
    window = anchors.unsqueeze(-1) - (W - 1) + torch.arange(W, device=device)  # [b, A, W]: positions p-W+1 .. p
    slots = torch.where(window >= 0, torch.arange(W, device=device), -1).view(b * A, 1, W)

    main_x = stages[0].main_norm(stages[0].main_proj(main_hidden.detach()))  # [b, s, dim]
    step = DSparkStep(_Rings(stages, main_x, window), slots, (anchors.unsqueeze(-1) + 1 + offsets).view(b * A, B))
    with torch.no_grad():  # the shared embedding: no draft gradient into the backbone
        h = model.embed(ids)  # [b·A, B, dim]
    x = h.unsqueeze(2).expand(b * A, B, hc, h.shape[-1]).contiguous()
    pre = torch.zeros(b * A, B, hc, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    for stage in stages:
        x, pre = stage(x, pre, step)
    final = stages[-1]
    collapsed = model.hc_collapse(x, pre).flatten(0, 1)  # [b·A·B, dim]

    drafted = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # the rows with a target: logits only there
    target = targets[drafted]
    bias, markov_embed = final.markov_head(tokens.reshape(-1)[drafted])  # fp32 [n, vocab], [n, rank]
    logits = _head_logits(model, final.norm(collapsed[drafted])) + bias
    confidence = final.confidence_head(collapsed[drafted], markov_embed)  # fp32 [n]
    hit = (logits.detach().argmax(-1) == target).float()
    loss = DSparkLoss(
        draft=F.cross_entropy(logits, target, reduction="sum"),
        confidence=F.binary_cross_entropy_with_logits(confidence, hit, reduction="sum"),
        correct=hit.sum(), count=torch.as_tensor(target.numel(), device=device),
    )
    return (loss, (logits, confidence, target)) if return_logits else loss


def check_dspark_training(model) -> None:
    """Raise ``ValueError`` unless ``model`` has DSpark stages to train (``dspark_loss_weight`` > 0)."""
    if not hasattr(model, "mtp"):
        raise ValueError(f"text_config.dspark_loss_weight = {dspark_loss_weight(model.config)} needs the DSpark "
                         "draft stages, and this model has none (num_nextn_predict_layers or dspark_block_size is "
                         "0); set dspark_loss_weight to 0, or load a checkpoint with mtp.* stages")


def dspark_batch_loss(model, main_hidden, input_ids, labels, attention_mask=None) -> DSparkLoss:
    """``dspark_stage_loss`` for a batch in the model's input columns: left-padded rows are moved left-aligned
    first (their positions then start at 0, as the forward ran them)."""
    from .modeling_deepseek_v41 import real_lengths, roll_rows

    device = main_hidden.device
    input_ids, labels = input_ids.to(device), labels.to(device)
    mask = None if attention_mask is None else attention_mask.to(device)
    _, shift = real_lengths(mask, input_ids)
    if shift is not None:
        input_ids, labels, mask, main_hidden = (roll_rows(t, shift) for t in (input_ids, labels, mask, main_hidden))
    return dspark_stage_loss(model, main_hidden, input_ids, labels, mask)
