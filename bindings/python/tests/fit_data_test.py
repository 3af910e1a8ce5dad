"""seqgrad.fit on TRL's formats (lists of dicts, a `datasets` Dataset, JSONL) tokenized with the model directory's
tokenizer: the sequences it trains are seqgrad.data.prepare's. The tokenizer is data_test's (built offline)."""
import json
import os
import tempfile
import unittest

import data_venv

if __name__ == "__main__":
    data_venv.run_in_venv(__file__)

import numpy as np  # noqa: E402
import seqgrad  # noqa: E402
from data_test import CHATML, chat, make_tokenizer  # noqa: E402
from seqgrad import data  # noqa: E402

MESSAGES = [{"messages": chat(("user", "what is two plus four"), ("assistant", "six"))},
            {"messages": chat(("system", "be brief"), ("user", "hello"), ("assistant", "fine thanks"))},
            {"messages": chat(("user", "one two"), ("assistant", "three"), ("user", "four"), ("assistant", "five"))}]
TEXT = [{"text": "hello there how are you"}, {"text": "fine thanks"}, {"text": "one two three four five six"}]
COMPLETIONS = [{"prompt": "what is two plus four", "completion": "six"}, {"prompt": "hello", "completion": "yes"}]
PAIRS = [{"prompt": "what is two plus four", "chosen": "six", "rejected": "eight"},
         {"prompt": chat(("user", "hello")), "chosen": chat(("assistant", "good")),
          "rejected": chat(("assistant", "bad"))}]


class FitDataTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        cls.model_dir = os.path.join(cls.tmp, "model")  # a tiny model with the tokenizer beside it
        with seqgrad.Model.from_preset("tiny", dtype="f64", seed=2) as m:
            m.save(cls.model_dir)
        make_tokenizer(cls.model_dir, CHATML)
        cls.tok = data.load_tokenizer(cls.model_dir)

    def fit(self, dataset, **kw):
        args = dict(dtype="f64", progress=False, strategy="full", max_steps=1, per_device_train_batch_size=100,
                    learning_rate=1e-2, seed=0)
        args.update(kw)
        return seqgrad.fit(self.model_dir, dataset, **args)

    def tokens(self, dataset, **kw):
        return sum(len(r["input_ids"]) for r in data.prepare(dataset, self.tok, **kw).records)

    def test_sft_formats_train_what_prepare_makes(self):
        for records in (MESSAGES, TEXT, COMPLETIONS):
            with self.subTest(format=data.detect_format(records[0])):
                r = self.fit(records)
                self.assertEqual(r.objective, "sft")
                self.assertEqual(r.history[0]["tokens"], self.tokens(records))

    def test_packing_datasets_and_jsonl(self):
        import datasets
        packed = self.fit(datasets.Dataset.from_list(TEXT), packing=True, max_length=16)
        self.assertEqual(packed.history[0]["tokens"], self.tokens(TEXT, seq_len=16, pack=True))
        path = os.path.join(self.tmp, "chats.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in MESSAGES)
        out = os.path.join(self.tmp, "out")
        r = self.fit(path, output_dir=out, eval_dataset=MESSAGES[:1])
        self.assertEqual(r.history[0]["tokens"], self.tokens(MESSAGES))
        self.assertTrue(os.path.exists(os.path.join(out, "tokenizer_config.json")))  # saved with the model
        with open(path, "w") as f:
            f.write(json.dumps({"messages": chat(("user", "hello"))}) + "\n")
        with self.assertRaisesRegex(seqgrad.InvalidArgumentError, r"chats.jsonl:1: field 'messages'"):
            self.fit(path)

    def test_dpo_pairs_with_lora_against_the_base_weights(self):
        r = self.fit(PAIRS, lora={"r": 2, "lora_alpha": 4}, max_steps=2, per_device_train_batch_size=1)
        self.assertEqual(r.objective, "dpo")
        self.assertTrue(all(np.isfinite(h["loss"]) for h in r.history))
        # Without LoRA the reference is a frozen copy of the model's weights: the first loss is -log sigmoid(0).
        r = self.fit(PAIRS, max_steps=1, per_device_train_batch_size=2)
        self.assertAlmostEqual(r.history[0]["loss"], np.log(2), places=12)

    def test_a_tokenizer_given_to_a_preset(self):
        r = seqgrad.fit("tiny", TEXT, tokenizer=self.model_dir, dtype="f64", progress=False, max_steps=1,
                        strategy="full")
        self.assertEqual(r.history[0]["tokens"], self.tokens(TEXT))  # one step of all three (batch size 8)


if __name__ == "__main__":
    unittest.main()
