"""Load an export the way a user without this package would, and try it (run by ``launch.reload_export``).

    python reload_export.py EXPORT_DIR REQUEST.json RESULT.json

Blocks ``import deepseek_v41`` first, so the model, its config and tokenizer come from the folder alone
(``trust_remote_code=True``), then greedily continues the request's prompt and scores its validation rows
(token ids the launcher prepared with the training tokenization): the same numbers as the run's validation
(``loop.score_choices``: the gold endings' summed CE over their tokens; the examples whose gold ending has the
highest mean log-likelihood per token).  Writes RESULT.json; imports nothing from the package by design.
"""

import json
import os
import sys

sys.modules["deepseek_v41"] = None  # importing the package now fails: everything must come from the folder
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]  # run by path: this folder's modules (data, export, ...) must not shadow top-level names

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE_INDEX = -100


def score(model, examples: list, pad_id: int, multiple: int) -> list:
    """``[(rows, label)]`` (rows: ``[(input_ids, labels)]``) -> [gold CE sum, gold tokens, correct, examples]."""
    rows = [row for endings, _ in examples for row in endings]
    length = -(-max(len(ids) for ids, _ in rows) // multiple) * multiple
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        ids[r, : len(row_ids)], labels[r, : len(row_labels)], mask[r, : len(row_ids)] = (
            torch.tensor(row_ids), torch.tensor(row_labels), 1)
    # the head (129,280 logits a position) only where an ending's next token is predicted: its input is the
    # output's last_hidden_state, so the forward computes logits for the last position alone
    hidden = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).last_hidden_state
    targets = labels.masked_fill(mask == 0, IGNORE_INDEX)[:, 1:]  # position t predicts token t + 1
    row, position = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    logits = model.head_logits(hidden[row, position]).float()
    token_nll = F.cross_entropy(logits, targets[row, position], reduction="none")
    nll = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, row, token_nll.double())
    count = (targets != IGNORE_INDEX).sum(1)
    mean_ll = torch.where(count > 0, -nll / count.clamp(min=1), -torch.inf)
    totals, first = [0.0, 0, 0, 0], 0
    for endings, label in examples:
        totals[0] += float(nll[first + label])
        totals[1] += int(count[first + label])
        totals[2] += int(int(torch.argmax(mean_ll[first : first + len(endings)])) == label)
        totals[3] += 1
        first += len(endings)
    return totals


def main(folder: str, request_file: str) -> dict:
    with open(request_file) as f:
        request = json.load(f)
    try:
        import deepseek_v41  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("deepseek_v41 is importable here: this check would not show that the folder stands alone")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # reads config.json's auto_map
    inputs = tokenizer(request["prompt"], return_tensors="pt")
    totals = [0.0, 0, 0, 0]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=request["max_new_tokens"], do_sample=False)
        examples = request["examples"]
        for start in range(0, len(examples), request["chunk"]):
            part = score(model, examples[start : start + request["chunk"]], model.config.pad_token_id,
                         request["multiple"])
            totals = [a + b for a, b in zip(totals, part)]
    return {
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "continuation": tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True),
        "val_loss": totals[0] / max(totals[1], 1),
        "val_accuracy": totals[2] / max(totals[3], 1),
        "val_correct": totals[2],
        "val_examples": totals[3],
    }


if __name__ == "__main__":
    with open(sys.argv[3], "w") as f:
        json.dump(main(sys.argv[1], sys.argv[2]), f)
