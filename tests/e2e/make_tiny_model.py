"""Writes a tiny Hugging Face Llama model directory, the stand-in for a downloaded one: config.json and
model.safetensors from transformers (random init, seed 0) plus the files of a tokenizer built here with the
`tokenizers` package (byte-level BPE, so any text tokenizes; a ChatML chat template), whose vocabulary is the model's.

usage: make_tiny_model.py OUT_DIR      (needs torch, transformers, tokenizers)
"""
import json
import os
import sys

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What the BPE merges are learned from; other text still tokenizes, byte by byte.
CORPUS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
          "seventeen eighteen nineteen twenty plus minus is what how much tell me you are a careful calculator answer "
          "in one sentence help with sums be brief arithmetic questions words system user assistant").split()


def make_tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    sentences = [" ".join(CORPUS[i:] + CORPUS[:i]) for i in range(len(CORPUS))]
    bpe.train_from_iterator(sentences, trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        chat_template=CHATML)
    tokenizer.save_pretrained(directory)
    return tokenizer


def main(out_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = make_tokenizer(out_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    print(json.dumps({"dir": out_dir, "vocab_size": config.vocab_size}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
