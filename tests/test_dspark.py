"""The DSpark draft stages (deepseek_v41/dspark.py) against the official forward: the golden fixture
v41_tiny_dspark (tests/fixtures/v41_tiny_dspark/reference/README.md) holds the official drafts of 8 steps.

Teacher-forced: the stages get the official run's own input (its window of main-model positions and the step's
position) and block token; end to end: our backbone prefills, decodes the step's token with the cache and feeds the
stages itself.  fp32 against the official fp32 run (the rounding floor), bf16 against the official bf16 run (the
backbone's gates)."""

import copy
import json

import pytest
import torch
from conftest import DSPARK_FIXTURE, golden_dir
from safetensors import safe_open
from safetensors.torch import load_file

from deepseek_v41.checkpoint import (
    ReleasedCheckpoint,
    check_checkpoint_matches_model,
    load_checkpoint_into_model,
)
from deepseek_v41.dspark import DSparkState, draft_block
from deepseek_v41.modeling_deepseek_v41 import DeepseekV41ForCausalLM, default_dtype
from deepseek_v41.parity import GATES, LAYER_GATES, gate_failures, logits_metrics, p90_relative_l2

STEPS = range(49, 64, 2)  # the fixture's draft positions
TAGS = {torch.float32: "bf16w_fp32", torch.bfloat16: "bf16w_bf16"}


@pytest.fixture(scope="module")
def snapshot():
    return golden_dir(DSPARK_FIXTURE) / "snapshot"


@pytest.fixture(scope="module")
def golden():
    return load_file(str(golden_dir(DSPARK_FIXTURE) / "reference" / "golden.safetensors"))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, snapshot):  # parity with the official golden run: weights decoded exactly
    return DeepseekV41ForCausalLM.from_pretrained(snapshot, dtype=request.param, dequantize_base_checkpoint=True)


def rel(candidate, reference) -> float:
    candidate, reference = candidate.float(), reference.float()
    return float((candidate - reference).norm() / reference.norm())


def reference_logits(snapshot, golden, tag: str) -> torch.Tensor:
    """fp32 [2, steps, B, vocab]: the official head input times the snapshot's head plus the official Markov
    embeddings times the snapshot's Markov head (read here with safetensors, not through our model)."""
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    weights = {}
    for name in ("head.weight", "mtp.2.markov_head.head.weight"):
        with safe_open(str(snapshot / index[name]), "pt") as handle:
            weights[name] = handle.get_tensor(name).float()
    return (golden[f"{tag}.head_in"].float() @ weights["head.weight"].T
            + golden[f"{tag}.markov_embed"].float() @ weights["mtp.2.markov_head.head.weight"].T)


def teacher_forced(model, golden, tag: str, step: int, pos: int):
    # the stages' window from the official prefill (positions pos-16 .. pos-1; older ones never reach the ring),
    # then the official decode step's input at pos, then a draft from the official block token
    window = golden[f"{tag}.window_main_hidden"][:, step]
    seed = window.new_zeros(window.shape[0], pos, window.shape[-1])
    seed[:, -window.shape[1]:] = window
    state = DSparkState(model.mtp, model.config.text_config.sliding_window)
    state.add(model.mtp, seed.to(model.embed.weight.dtype))
    state.add(model.mtp, golden[f"{tag}.step_main_hidden"][:, step : step + 1].to(model.embed.weight.dtype))
    return draft_block(model, state, golden[f"{tag}.block_first_ids"][:, step])


def end_to_end(model, ids: torch.Tensor, pos: int):
    # our prefill of ids[:, :pos] seeds the stages; our decode step at pos gives their input and the block token
    out = model(ids[:, :pos], use_cache=True, output_dspark_hidden=True)
    state = DSparkState(model.mtp, model.config.text_config.sliding_window)
    state.add(model.mtp, out.dspark_hidden)
    step = model(ids[:, pos : pos + 1], past_key_values=out.past_key_values, use_cache=True, output_dspark_hidden=True)
    state.add(model.mtp, step.dspark_hidden)
    first = step.logits[:, -1].argmax(-1)
    return first, step.dspark_hidden[:, 0], draft_block(model, state, first)


def stack(drafts, field: str) -> torch.Tensor:
    return torch.stack([getattr(d, field) for d in drafts], 1)  # [b, steps, ...]


@torch.no_grad()
def test_drafts_match_the_official_forward(model, snapshot, golden):
    dtype = model.embed.weight.dtype
    tag = TAGS[dtype]
    ref_logits = reference_logits(snapshot, golden, tag)
    stage_out = []
    hooks = [stage.register_forward_hook(lambda m, a, out: stage_out.append(out[0])) for stage in model.mtp]
    forced = [teacher_forced(model, golden, tag, step, pos) for step, pos in enumerate(STEPS)]
    for hook in hooks:
        hook.remove()
    runs = [end_to_end(model, golden["input_ids"], pos) for pos in STEPS]
    ends = [d for _, _, d in runs]
    first = torch.stack([f for f, _, _ in runs], 1)
    main = torch.stack([m for _, m, _ in runs], 1)
    assert torch.equal(first, golden[f"{tag}.block_first_ids"])  # the backbone's next token at every step
    for drafts, label in ((forced, "teacher-forced"), (ends, "end to end")):
        logits = stack(drafts, "logits")
        # the returned logits are the heads' inputs through our head and Markov head; the drafts their argmax
        assert torch.equal(stack(drafts, "tokens"), logits.argmax(-1)), label
        metrics = logits_metrics(ref_logits, logits)
        if dtype == torch.float32:
            # measured: head input / confidence / logits rel. L2 <= 2e-7 both ways, the stages' input 1.9e-7 (the
            # fp32 rounding floor); gates 5x.  The Markov rows are looked up exactly.  GATES["fp32"] (parity.py's
            # shared backbone gates: mean KL 1e-5 against a measured 1.6e-8) are loose here; rel. L2 is the tight one
            assert torch.equal(stack(drafts, "markov_embed"), golden[f"{tag}.markov_embed"]), label
            assert torch.equal(stack(drafts, "tokens"), golden[f"{tag}.draft_ids"]), label
            for field in ("head_in", "confidence"):
                assert rel(stack(drafts, field), golden[f"{tag}.{field}"]) < 1e-6, (label, field)
            assert metrics["rel_l2"] < 1e-6 and not gate_failures(metrics, GATES["fp32"]), (label, metrics)
        else:
            # measured: head input rel. L2 2.4e-3..4.5e-3 per step, confidence 1.8e-3..7.4e-3, the stages' input
            # 6e-3..2.7e-2 (bf16 rounding through the 9-layer backbone); the backbone's bf16 gates and
            # block_out p90 gate for each stage's output streams.  GATES["bf16"] are parity.py's shared, documented
            # backbone gates (mean KL 1e-3; measured here 1.1e-5), not ones fitted to this test
            assert not gate_failures(metrics, GATES["bf16"]), (label, metrics)
            assert rel(stack(drafts, "confidence"), golden[f"{tag}.confidence"]) < 2e-2, label
            assert p90_relative_l2(stack(drafts, "head_in"), golden[f"{tag}.head_in"], 3) < LAYER_GATES["block_out"] * 2
    if dtype == torch.float32:
        assert rel(main, golden[f"{tag}.step_main_hidden"]) < 1e-6
    else:
        # per stage, teacher-forced: the output streams [b, step, B, hc, dim] (official: bf16w_bf16.stage_out)
        ours = torch.stack(stage_out, 0).unflatten(0, (len(STEPS), len(model.mtp)))  # [step, stage, b, B, hc, d]
        ours = ours.permute(2, 0, 1, 3, 4, 5)
        for k in range(len(model.mtp)):
            p90 = p90_relative_l2(ours[:, :, k].flatten(-2), golden[f"{tag}.stage_out"][:, :, k].flatten(-2), 3)
            assert p90 < LAYER_GATES["block_out"], (k, p90)


def test_stages_have_the_released_names_shapes_and_dtypes(snapshot, v4_tokenizer):
    from deepseek_v41 import DeepseekV41Config

    config = DeepseekV41Config.from_pretrained(snapshot)
    without = copy.deepcopy(config)
    without.text_config.num_nextn_predict_layers = 0
    with torch.device("meta"), default_dtype(torch.bfloat16):  # meta-safe; bf16 outside the fp32 islands
        model = DeepseekV41ForCausalLM(config, tokenizer=v4_tokenizer)
        stageless = DeepseekV41ForCausalLM(without, tokenizer=v4_tokenizer)
    assert len(model.mtp) == 3 and not hasattr(stageless, "mtp")
    report = check_checkpoint_matches_model(model, snapshot)  # strict: every name, shape and dtype kind
    assert not report.skipped and not report.missing and not report.unexpected
    mtp_names = sorted(n for n in ReleasedCheckpoint(snapshot).tensors if n.startswith("mtp."))
    assert len(mtp_names) == 3 * (21 + 4 * 3) + 2 + 4  # per stage 21 + 4 experts x 3; main_proj/norm; the heads
    assert check_checkpoint_matches_model(stageless, snapshot).skipped == mtp_names  # a stageless model skips them
    fp32 = {n for n, p in model.named_parameters() if n.startswith("mtp.") and p.dtype == torch.float32}
    islands = ("hc_attn_", "hc_ffn_", "attn.attn_sink", "markov_head.head.", "confidence_head.proj.")
    assert fp32 == {n for n, _ in model.named_parameters() if n.startswith("mtp.") and any(i in n for i in islands)}
    assert {n for n, _ in model.named_buffers() if n.startswith("mtp.")} == {f"mtp.{k}.ffn.gate.bias" for k in range(3)}
    assert model.mtp[0].ffn.experts.w1.shape == (4, 64, 32) and model.mtp[0].ffn.gate.top_k == 3


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1]}, "append 3 zeros"),
    ({"dspark_target_layer_ids": [7, 8, 9]}, "must be non-empty backbone layers"),
    ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok = 5"),
])
def test_inconsistent_dspark_fields_name_the_field(snapshot, v4_tokenizer, change, message):
    from deepseek_v41 import DeepseekV41Config

    config = DeepseekV41Config.from_pretrained(snapshot)
    config.text_config.update(change)
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        DeepseekV41ForCausalLM(config, tokenizer=v4_tokenizer)


@torch.no_grad()
def test_saved_and_released_again_under_the_same_names(snapshot, tmp_path):
    model = DeepseekV41ForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "release", quantize="release")
    source, release = ReleasedCheckpoint(snapshot), ReleasedCheckpoint(tmp_path / "release")
    mtp = [name for name in source.tensors if name.startswith("mtp.")]
    for name in mtp:  # FP8 main_proj / attention, FP4 experts, BF16 heads: the same format and values
        assert release.tensors[name].fmt == source.tensors[name].fmt, name
        assert release.tensors[name].record.dtype == source.tensors[name].record.dtype, name
        assert torch.equal(release.decode(name), source.decode(name)), name
    model.save_pretrained(tmp_path / "plain")
    again = DeepseekV41ForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.bfloat16)
    mine, theirs = model.state_dict(), again.state_dict()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine if n.startswith("mtp."))
    report = load_checkpoint_into_model(again, tmp_path / "release")
    assert not report.skipped and all(n in report.loaded for n in mtp)


# ---- self-speculative decoding ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_fp32(snapshot):
    return DeepseekV41ForCausalLM.from_pretrained(snapshot, dtype=torch.float32)


@torch.no_grad()
def test_greedy_with_dspark_equals_greedy(model_fp32, golden):
    ids = golden["input_ids"]
    padded, mask = ids[:, :18].clone(), torch.ones(2, 18, dtype=torch.long)
    padded[1, :5], mask[1, :5] = 2, 0  # row 1 left-padded: its positions run 5 behind row 0's
    # one row; two rows accepting different counts; a left-padded batch
    for prompt, attention_mask in ((ids[:1, :20], None), (ids[:, :17], None), (padded, mask)):
        plain = model_fp32.generate(prompt, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)
        spec = model_fp32.generate(prompt, attention_mask=attention_mask, max_new_tokens=16, do_sample=False,
                                   use_dspark=True)
        assert torch.equal(spec, plain)
        stats = model_fp32.dspark_stats
        assert all(0 <= n <= 4 for step in stats.accepted for n in step) and stats.tokens_per_step >= 1
    sampled = model_fp32.generate(padded, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.8,
                                  use_dspark=True, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 26) and torch.equal(sampled[:, :18], padded)
    with pytest.raises(ValueError, match="does not take \\['num_beams'\\]"):
        model_fp32.generate(padded, max_new_tokens=2, num_beams=2, use_dspark=True)


@torch.no_grad()
@pytest.mark.parametrize("right", [0, 1, 2, 3, 4])
def test_greedy_verification_at_every_acceptance_length(model_fp32, golden, monkeypatch, right):
    # drafts that are the greedy continuation for their first `right` tokens, then wrong: every step accepts
    # exactly `right` (all 4 and the bonus token at right = 4), rolls the cache back over the rest and must still
    # give greedy decoding's tokens
    from deepseek_v41 import dspark

    prompt = golden["input_ids"][:1, :20]
    plain = model_fp32.generate(prompt, max_new_tokens=14, do_sample=False)
    truth = torch.cat([plain[0, 20:], plain.new_zeros(8)])
    real = dspark.draft_block

    def oracle(model, state, next_tokens, pick=None):
        draft = real(model, state, next_tokens, pick)
        at = int(state.lengths[0]) - 20 + 1  # the drafted positions' index in the generated tokens
        tokens = truth[at : at + 4].clone()
        tokens[right:] = (tokens[right:] + 1) % 1000 + 3  # wrong
        draft.tokens = tokens.unsqueeze(0)
        return draft

    monkeypatch.setattr(dspark, "draft_block", oracle)
    spec = model_fp32.generate(prompt, max_new_tokens=14, do_sample=False, use_dspark=True)
    assert torch.equal(spec, plain)
    steps = model_fp32.dspark_stats.accepted
    assert all(step == [right] for step in steps[:-1]), steps  # the last step may stop early at max_new_tokens


def test_rejection_sampling_keeps_the_target_distribution():
    # one drafted token over a 5-token vocabulary: emitted tokens follow p whatever q proposed (200k trials: the
    # frequencies' standard error is <= 1.2e-3; gate 5e-3 ~4 standard errors: measured 1.1e-3, and the acceptance
    # rate's 5.1e-4, its standard error 1.1e-3)
    from deepseek_v41.dspark import accept_sampled

    gen = torch.Generator().manual_seed(0)
    n = 200_000
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).unsqueeze(1)  # [n, 1] drawn from q
    target = p.expand(n, 2, 5)  # the target at the drafted position and after it
    accepted, nxt = accept_sampled(q.expand(n, 1, 5), drafts, target, gen)
    first = torch.where(accepted == 1, drafts[:, 0], nxt)  # the token emitted at the drafted position
    freq = torch.bincount(first, minlength=5).float() / n
    assert (freq - p).abs().max() < 5e-3, freq
    assert abs(accepted.float().mean() - torch.minimum(p, q).sum()) < 5e-3  # acceptance rate sum(min(p, q))
