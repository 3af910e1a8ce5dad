#!/bin/bash
# docs/lora.md#end-to-end-chats-to-a-peft-adapter, command for command: a tiny Hugging Face Llama directory (with its
# tokenizer) -> python -m seqgrad.data (chats, packed to 2048 tokens) -> LoRA with seco at chunk 128 through
# cli:train and through the Java pipeline -> each adapter loaded by peft.PeftModel.from_pretrained, whose loss
# on the prepared data must equal the engine's and differ from the base model's (peft_check.py).
# usage: chat_lora_test.sh JAVA LORA_TRAIN_JAR SEQGRAD_JAR TRAIN
set -euo pipefail
java="$PWD/$1"; [[ "$1" = /* ]] && java="$1"
classpath="$PWD/$2:$PWD/$3"; train="$PWD/$4"
here="$PWD/tests/e2e"
export PYTHONPATH="$PWD/bindings/python"  # the seqgrad package (runfiles of //bindings/python:seqgrad)

# torch, transformers and peft from PyPI, in the venv that pip_venv.sh keeps.
python="$("$here/pip_venv.sh")/bin/python"

cd "$TEST_TMPDIR"
rm -rf tiny_llama adapter java_adapter
# 1. The model directory (config.json, model.safetensors, tokenizer files): stands for a downloaded one.
"$python" "$here/make_tiny_model.py" tiny_llama
# 2. Chats -> token ids and Hugging Face labels (loss on the assistant turns only), packed into 2048-token sequences.
"$python" -m seqgrad.data --tokenizer tiny_llama --input "$here/chats.jsonl" --output train.jsonl --seq_len 2048 --pack
"$python" - <<'EOF'  # several sequences, each within 2048 tokens and most of them many chunks long
import json
lengths = [len(json.loads(line)["input_ids"]) for line in open("train.jsonl")]
assert len(lengths) >= 3 and max(lengths) <= 2048 and sorted(lengths)[-2] > 1536, lengths
print("prepared sequences of", lengths, "tokens")
EOF
# 3. LoRA with seco through cli:train; the engine's loss of the trained adapter on the same data is the
#    evaluation after the last step.
"$train" --model=tiny_llama --data=train.jsonl --seq_len=2048 --strategy=seco --chunk=128 \
    --lora_rank=8 --lora_targets=all --steps=8 --lr=1e-2 --save=adapter \
    --eval_data=train.jsonl --eval_sequences=0 --report=report.json
loss="$("$python" -c 'import json; print(repr(json.load(open("report.json"))["evals"][-1]["loss"]))')"
# 4. The adapter in PEFT: the same loss as the engine's, and not the base model's.
"$python" "$here/peft_check.py" tiny_llama adapter train.jsonl "$loss"

# The same through the Java pipeline (the native library from inside the jar).
out="$("$java" -cp "$classpath" org.seqgrad.e2e.LoraTrain tiny_llama train.jsonl java_adapter \
    --steps=8 --strategy=seco --chunk=128 --lora-rank=8 --lora-targets=all --lr=1e-2)"
echo "$out"
grep -q '^step 1 loss .* chunks 16 ' <<<"$out"  # a 2048-token record in 16 chunks of 128
java_loss="$(sed -n 's/^eval loss //p' <<<"$out")"
"$python" "$here/peft_check.py" tiny_llama java_adapter train.jsonl "$java_loss"
echo "OK: both adapters load in PEFT with the engine's loss"
