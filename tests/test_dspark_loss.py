"""The DSpark stages' training loss (deepseek_v41/dspark_loss.py) on the tiny DSpark fixture, in process (CPU, fp32).

The loss is checked against an independent computation: the inference path (``DSparkState`` seeded with the
backbone's target-layer inputs up to each anchor, ``draft_block`` teacher-forced through its ``pick``) gives the
stages' logits and confidences per anchor, and the cross-entropy / BCE are computed here by hand in float64.
"""

import copy

import pytest
import torch
from conftest import DSPARK_FIXTURE, golden_dir

from deepseek_v41.dspark import DSparkState, draft_block
from deepseek_v41.dspark_loss import draft_count, dspark_stage_loss
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM

B = 4  # the fixture's dspark_block_size

FP32_ULP = 2**-23  # one unit in the last place of an fp32 number, relative (at most)


@pytest.fixture(scope="module")
def model():
    return DeepseekV41ForCausalLM.from_pretrained(golden_dir(DSPARK_FIXTURE) / "snapshot", dtype=torch.float32,
                                                 dequantize_base_checkpoint=True)


@pytest.fixture(scope="module")
def batch():
    """Two right-padded rows of 24 columns: row 0 supervises columns 14.. (a context, then the ending), row 1 is
    13 tokens long and supervises them all but one in the middle."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    ids[1, 13:] = 2
    labels = ids.clone()
    labels[0, :14] = -100
    labels[1, 13:] = -100
    labels[1, 7] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def with_weight(model, weight):
    model.config.text_config.dspark_loss_weight = weight
    return model


def reference(model, batch):
    """float64 (draft CE sum, confidence BCE sum, correct, count) by hand from ``draft_block`` per anchor."""
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask, output_dspark_hidden=True).dspark_hidden
    ce = bce = correct = count = 0.0
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        for p in range(n - 2):
            targets = [int(labels[r, p + 2 + i]) if p + 2 + i < n else -100 for i in range(B)]
            if all(t == -100 for t in targets):
                continue
            truth = [int(ids[r, min(p + 2 + i, n - 1)]) for i in range(B)]
            state = DSparkState(model.mtp, model.config.text_config.sliding_window)
            state.add(model.mtp, hidden[r : r + 1, : p + 1])
            with torch.no_grad():  # teacher-forced: each draft's Markov bias from the true token before it
                draft = draft_block(model, state, ids[r : r + 1, p + 1], pick=lambda _, i, truth=truth: torch.tensor([truth[i]]))
            logp = torch.log_softmax(draft.logits[0].double(), -1)
            for i, t in enumerate(targets):
                if t == -100:
                    continue
                hit = float(draft.logits[0, i].argmax() == t)
                c = draft.confidence[0, i].double()
                ce -= float(logp[i, t])
                bce -= float(hit * torch.log(torch.sigmoid(c)) + (1 - hit) * torch.log(1 - torch.sigmoid(c)))
                correct += hit
                count += 1
    return ce, bce, correct, count


def test_loss_equals_the_drafting_forward_with_cross_entropy_by_hand(model, batch):
    ce, bce, correct, count = reference(model, batch)
    # a label at column t is drafted from the anchors t-2-i >= 0 (i < B): row 0 10 x 4, row 1 1+2+3+4+4 + 5 x 4
    assert count == int(draft_count(batch["labels"], batch["attention_mask"], B)) == 40 + 34
    with torch.no_grad():
        out = with_weight(model, 0.25)(**batch)
        # transformers' gradient accumulation (num_items_in_batch: the labels of all micro-batches): the stages'
        # mean is weighted by this micro-batch's share of them, like the LM loss's sum
        accumulated = model(**batch, num_items_in_batch=100)
    with_weight(model, 0.0)
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    # The losses are fp32 numbers and the references sums in fp64: one fp32 ulp (2^-23 relative) is the floor of
    # these comparisons.  Measured rel 7.4e-9, and 4.3e-8 with other package versions (the same code): gate 1 ulp
    assert float(accumulated.loss) == pytest.approx(float(out.lm_loss) * labelled / 100
                                                    + 0.25 * (ce + bce) / count * labelled / 100, rel=FP32_ULP)
    assert int(out.dspark_positions) == count
    # measured: rel. 2.7e-9 (draft CE), 1.1e-7 (BCE) against the per-anchor drafting path in fp32 (1 and 2
    # threads); gates one fp32 ulp and 3.6x
    assert float(out.dspark_loss) * count == pytest.approx(ce, rel=FP32_ULP)
    assert float(out.dspark_confidence_loss) * count == pytest.approx(bce, rel=4e-7)
    assert float(out.dspark_accuracy) * count == correct
    # measured rel 1.0e-8 (1 and 2 threads); gate one fp32 ulp
    assert float(out.loss) == pytest.approx(float(out.lm_loss) + 0.25 * (ce + bce) / count, rel=FP32_ULP)


def backbone_grads(model, batch, weight):
    model.zero_grad(set_to_none=True)
    out = with_weight(model, weight)(**batch)
    out.loss.backward()
    with_weight(model, 0.0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def test_switch_off_changes_nothing_and_on_trains_only_the_stages(model, batch):
    off, g_off = backbone_grads(model, batch, 0.0)
    assert off.lm_loss is None and off.dspark_loss is None
    stageless = copy.deepcopy(model)
    del stageless.mtp
    reference_out, g_ref = backbone_grads(stageless, batch, 0.0)
    # off: the loss and every gradient exactly as a model without stages; the stages get none
    assert torch.equal(off.loss, reference_out.loss) and g_off.keys() == g_ref.keys()
    assert all(torch.equal(g_off[n], g_ref[n]) for n in g_ref)
    on, g_on = backbone_grads(model, batch, 0.5)
    # on: the LM loss and the backbone's gradients unchanged bit for bit (the stages' inputs are detached);
    # every trainable stage parameter gets a gradient
    assert torch.equal(on.lm_loss, off.loss)
    assert all(torch.equal(g_on[n], g_ref[n]) for n in g_ref)
    stage = {n for n, p in model.named_parameters() if n.startswith("mtp.") and p.requires_grad}
    assert set(g_on) - set(g_ref) == stage
    assert all(g_on[n].abs().sum() > 0 for n in stage if ".ffn.experts." not in n)


def test_a_few_steps_reduce_the_stage_loss(model, batch):
    # Adam on the stages alone (the backbone's input to them is fixed: computed once)
    trained = copy.deepcopy(model)
    params = [p for n, p in trained.named_parameters() if n.startswith("mtp.")]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    with torch.no_grad():
        hidden = trained(batch["input_ids"], attention_mask=batch["attention_mask"], output_dspark_hidden=True).dspark_hidden
    losses = []
    for _ in range(6):
        loss = dspark_stage_loss(trained, hidden, batch["input_ids"], batch["labels"], batch["attention_mask"])
        losses.append(float(loss.total.detach()) / int(loss.count))
        optimizer.zero_grad()
        loss.total.backward()
        optimizer.step()
    assert losses[-1] < losses[0] * 0.8, losses  # measured: 13.7 -> 10.0 (random stages, 6 steps at 1e-2)


def test_bad_weights_and_missing_stages_are_named(model, batch):
    from deepseek_v41 import DeepseekV41Config

    config = copy.deepcopy(model.config)
    with pytest.raises(ValueError, match="dspark_loss_weight = -0.5: must be a finite number >= 0"):
        DeepseekV41Config(text_config={**config.text_config.to_dict(), "dspark_loss_weight": -0.5})
    stageless = copy.deepcopy(model)
    del stageless.mtp
    with pytest.raises(ValueError, match="dspark_loss_weight = 0.5 needs the DSpark draft stages"):
        with_weight(stageless, 0.5)(**batch)


def test_left_padding_gives_the_right_padded_loss(model, batch):
    # row 1 moved to the right end (left padding): the same positions, so the same loss
    shift = batch["attention_mask"].shape[1] - int(batch["attention_mask"][1].sum())
    left = {k: v.clone() for k, v in batch.items()}
    for k, value in left.items():
        value[1] = batch[k][1].roll(shift)
    with torch.no_grad():
        right_out = with_weight(model, 1.0)(**batch)
        left_out = model(**left)
    with_weight(model, 0.0)
    assert int(left_out.dspark_positions) == int(right_out.dspark_positions)
    # measured 0 (1 and 2 threads); gate ~4 fp32 ulps: the padding may regroup the sums on another CPU's kernels
    assert float(left_out.dspark_loss) == pytest.approx(float(right_out.dspark_loss), rel=5e-7)


def test_direct_call_returns_the_drafted_logits_and_scores_a_hit(model, batch):
    with torch.no_grad():
        hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"], output_dspark_hidden=True).dspark_hidden
        loss, (logits, confidence, target) = dspark_stage_loss(model, hidden, batch["input_ids"], batch["labels"],
                                                               batch["attention_mask"], return_logits=True)
        assert logits.dtype == confidence.dtype == torch.float32 and logits.shape == (74, model.config.text_config.vocab_size)
        # the same F.cross_entropy of the returned logits: measured bit-equal (1 and 2 threads)
        draft_ce = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        assert float(loss.draft) == pytest.approx(float(draft_ce), rel=0, abs=0)
        # one label, at column 2: drafted once (anchor 0, output 0); made the draft's own argmax, it is a hit and
        # the confidence is trained towards 1: BCE = softplus(-confidence)
        ids, labels = batch["input_ids"][:1], torch.full_like(batch["input_ids"][:1], -100)
        labels[0, 2] = ids[0, 2]
        _, (logits, confidence, _) = dspark_stage_loss(model, hidden[:1], ids, labels, return_logits=True)
        labels[0, 2] = logits[0].argmax()
        hit, (_, again, _) = dspark_stage_loss(model, hidden[:1], ids, labels, return_logits=True)
    assert int(hit.count) == 1 and float(hit.correct) == 1.0 and torch.equal(again, confidence)
    # measured 0 (1 and 2 threads); gate ~4 fp32 ulps: BCE-with-logits and softplus are different kernels
    assert float(hit.confidence) == pytest.approx(float(torch.nn.functional.softplus(-confidence[0])), rel=5e-7)


def test_hf_trainer_trains_the_stages_with_gradient_checkpointing(model, batch, tmp_path):
    """transformers' Trainer (gradient accumulation over 2 micro-batches, gradient checkpointing, no clipping, SGD):
    with the weight on, the stages move and the backbone lands exactly where the switch-off run puts it."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    trained = {}
    for weight in (0.0, 0.5):
        copy_ = with_weight(copy.deepcopy(model), weight)
        args = TrainingArguments(output_dir=str(tmp_path / str(weight)), max_steps=1, per_device_train_batch_size=1,
                                 gradient_accumulation_steps=2, learning_rate=0.1, optim="sgd", max_grad_norm=0.0,
                                 lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True,
                                 gradient_checkpointing=True, disable_tqdm=True)
        Trainer(model=copy_, args=args, train_dataset=rows).train()
        trained[weight] = dict(copy_.named_parameters())
    start = dict(model.named_parameters())
    for name, p in start.items():
        if name.startswith("mtp."):
            assert torch.equal(trained[0.0][name], p), name  # off: the stages are not trained
        else:
            assert torch.equal(trained[0.5][name], trained[0.0][name]), name
    moved = [n for n in start if n.startswith("mtp.") and not torch.equal(trained[0.5][n], start[n])]
    assert len(moved) > 30
