"""Loads a base model with transformers and a LoRA adapter with PEFT, and checks PEFT's loss on a seqgrad JSONL
against the loss the engine reported for the same adapter.

usage: peft_check.py MODEL_DIR ADAPTER_DIR DATA.jsonl ENGINE_LOSS   (needs torch, transformers, peft)

The loss is the engine's: the mean over every labelled token of every record (Hugging Face labels, shifted here; a
packed record's documents each alone), computed in float64. Fails unless PEFT's loss equals ENGINE_LOSS within TOLERANCE and the adapter moves the loss
away from the base model's by more than 100 times that, so a no-op adapter cannot pass.
"""
import json
import sys

import torch
import torch.nn.functional as F

# The engine trains and evaluates in float32 (its default); against this float64 evaluation its loss is off by float32
# rounding only: measured 2e-10 to 1.2e-9 relative here, against a unit roundoff of 6e-8. The test's adapter with
# lora_alpha halved in its config gives a gap of 1.4e-3.
TOLERANCE = 1e-6


def load_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def documents(record):
    """The record's documents as (input_ids, labels) slices: packed records (doc_lengths, as seqgrad.data --pack
    writes them) are evaluated document by document, which is what the engine's document masks compute."""
    ids, labels = record["input_ids"], record["labels"]
    lengths = record.get("doc_lengths") or [len(ids)]
    start = 0
    for n in lengths:
        yield ids[start:start + n], labels[start:start + n]
        start += n


def mean_loss(model, records):
    total, count = 0.0, 0
    with torch.no_grad():
        for r in records:
            for ids, doc_labels in documents(r):
                logits = model(input_ids=torch.tensor([ids])).logits[0]
                labels = torch.tensor(doc_labels)
                total += F.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=-100, reduction="sum").item()
                count += int((labels[1:] != -100).sum())
    return total / count


def main(model_dir, adapter_dir, data, engine_loss):
    import peft
    import transformers
    from peft import PeftModel
    records = load_records(data)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    base_loss = mean_loss(load(), records)
    peft_loss = mean_loss(PeftModel.from_pretrained(load(), adapter_dir).eval(), records)
    gap = abs(peft_loss - engine_loss) / abs(engine_loss)
    print("peft %s, transformers %s, torch %s: %d records, base loss %.9f; PeftModel(%s) loss %.9f; engine %.9f "
          "(relative gap %.2e, tolerance %.0e)" % (peft.__version__, transformers.__version__, torch.__version__,
                                                   len(records), base_loss, adapter_dir, peft_loss, engine_loss, gap,
                                                   TOLERANCE))
    if gap > TOLERANCE:
        sys.exit("FAIL: PEFT's loss with the adapter differs from the engine's")
    if abs(peft_loss - base_loss) <= 100 * TOLERANCE * abs(base_loss):
        sys.exit("FAIL: the adapter does not change the base model's loss")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
