"""The PEFT side of lora_peft_test.py, run in the venv of tests/e2e/pip_venv.sh (torch, transformers, peft from
PyPI). Prints one JSON object.

  peft_compare.py load MODEL_DIR ADAPTER_DIR MERGED_DIR BATCH_JSONL
      base: transformers' loss of the base model; peft: PeftModel.from_pretrained(base, ADAPTER_DIR)'s loss;
      merged: transformers' loss of MERGED_DIR; merge_diff: max |merge_and_unload() - MERGED_DIR's tensors|.
  peft_compare.py write MODEL_DIR OUT_DIR BATCH_JSONL R ALPHA TARGETS
      get_peft_model with LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS (comma-separated, or
      all-linear), init_lora_weights=False: random A and B), save_pretrained(OUT_DIR); peft: its loss.
The loss is the mean cross entropy over every labelled token of the batch (Hugging Face labels, shifted here), in a
float64 model.
"""
import json
import sys

import peft
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def loss(model, batch_path):
    total, count = 0.0, 0
    with torch.no_grad():
        for line in open(batch_path):
            record = json.loads(line)
            logits = model(input_ids=torch.tensor([record["input_ids"]])).logits[0]
            labels = torch.tensor(record["labels"])
            total += F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum").item()
            count += int((labels[1:] != -100).sum())
    return total / count


def main(mode, *args):
    out = {"peft_version": peft.__version__, "transformers_version": transformers.__version__}
    if mode == "load":
        model_dir, adapter_dir, merged_dir, batch = args
        out["base"] = loss(load(model_dir), batch)
        model = peft.PeftModel.from_pretrained(load(model_dir), adapter_dir).eval()
        out["peft"] = loss(model, batch)
        out["merged"] = loss(load(merged_dir), batch)
        merged = model.merge_and_unload().state_dict()
        exported = safetensors.torch.load_file(f"{merged_dir}/model.safetensors")
        out["merge_diff"] = max(float((merged[k] - v).abs().max()) for k, v in exported.items())
    elif mode == "write":
        model_dir, out_dir, batch, r, alpha, targets = args
        config = peft.LoraConfig(r=int(r), lora_alpha=int(alpha), task_type="CAUSAL_LM", init_lora_weights=False,
                                 target_modules=targets if targets == "all-linear" else targets.split(","))
        torch.manual_seed(0)
        model = peft.get_peft_model(load(model_dir), config).to(torch.float64).eval()
        model.save_pretrained(out_dir)
        out["peft"] = loss(model, batch)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
