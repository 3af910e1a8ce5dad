"""seqgrad.data: every format tokenized by a real Hugging Face tokenizer, labels checked token by token.

The tokenizer is built here with the `tokenizers` package (a word-level vocabulary, BOS added by its post-processor,
a ChatML-style chat template in tokenizer_config.json) and loaded back with transformers.AutoTokenizer, so no hub
download is needed. transformers, tokenizers, jinja2, datasets and hypothesis (the property tests over malformed
records) come from PyPI into a venv kept under ~/.cache/seqgrad-pip (built once, then reused), when the running
Python lacks them.
"""
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import unittest

import data_venv

if __name__ == "__main__":
    data_venv.run_in_venv(__file__)

# Hypothesis keeps caches in a directory, by default in the working directory (here the runfiles): the test's tmpdir.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(os.environ.get("TEST_TMPDIR", tempfile.gettempdir()), "hypothesis"))
import seqgrad  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from seqgrad import data  # noqa: E402

M = data.IGNORE
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ("user assistant system hello there how are you fine thanks what is two plus four six be brief good bad "
         "one three five seven eight nine ten yes no maybe").split()
VOCAB = {w: i for i, w in enumerate(SPECIAL + WORDS)}
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Renders the number of messages first: no prefix of a conversation renders as a prefix of the whole.
COUNTING = "{{ messages|length }} " + CHATML


def expect(spec):
    """(ids, labels) of a spec like "<s> user [six <|im_end|>]": tokens of VOCAB, labelled inside brackets."""
    ids, labels, learned = [], [], False
    for word in spec.replace("[", " [ ").replace("]", " ] ").split():
        if word in "[]":
            learned = word == "["
            continue
        ids.append(VOCAB[word])
        labels.append(VOCAB[word] if learned else M)
    return ids, labels


def ids_of(spec):
    return expect(spec)[0]


def make_tokenizer(directory, chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])])
    tok.add_special_tokens(SPECIAL)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    if chat_template:
        config["chat_template"] = chat_template
    with open(config_path, "w") as f:
        json.dump(config, f)
    return directory


def chat(*turns):
    """Messages from (role, content) pairs."""
    return [{"role": r, "content": c} for r, c in turns]


MULTI_TURN = chat(("system", "be brief"), ("user", "what is two plus four"), ("assistant", "six"),
                  ("user", "thanks"), ("assistant", "good"))


@contextlib.contextmanager
def writer_now_and_then(fifo):
    """Opens the FIFO for writing every second: code that waits for a writer (instead of refusing the FIFO) gets end
    of file and fails its test rather than hanging it."""
    stop = threading.Event()

    def open_and_close():
        while not stop.wait(1):
            with contextlib.suppress(OSError):  # ENXIO: no reader, nothing waits
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=open_and_close, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ---- records for the property tests: valid ones of each format, then one spot spoiled ----

PLAIN = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)
CHARACTER = st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # and lone surrogates
ODD_TEXT = st.one_of(PLAIN, st.text(max_size=6), st.sampled_from(SPECIAL), CHARACTER)
ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.integers(2 ** 1024, 2 ** 1100), st.floats(), ODD_TEXT),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT, inner, max_size=3), max_leaves=6)
ODD_VALUE = st.sampled_from([None, True, 0, "", [], {}, float("nan"), -float("inf"), 2 ** 1100, "yes \udfff"])
CONVERSATION = st.lists(st.tuples(PLAIN, PLAIN), min_size=1, max_size=2).map(
    lambda turns: [m for u, a in turns for m in chat(("user", u), ("assistant", a))])
NUMBER = st.floats(-10, 10)


@st.composite
def _valid_record(draw, fmt):
    conversational = draw(st.booleans())
    prompt = draw(CONVERSATION.map(lambda c: c[:1]) if conversational else PLAIN)
    response = CONVERSATION.map(lambda c: c[1:2]) if conversational else PLAIN
    if fmt == "text":
        return {"text": draw(PLAIN)}
    if fmt == "messages":
        return {"messages": draw(CONVERSATION)}
    if fmt == "prompt_completion":
        return {"prompt": prompt, "completion": draw(response)}
    if fmt == "dpo":
        record = {"prompt": prompt, "chosen": draw(response), "rejected": draw(response)}
        return dict(record, ref_chosen_logp=draw(NUMBER), ref_rejected_logp=draw(NUMBER)) if draw(st.booleans()) \
            else record
    completions = draw(st.lists(response, min_size=1, max_size=3))
    return {"prompt": prompt, "completions": completions, "advantages": [draw(NUMBER) for _ in completions]}


def _spots(value, path=()):
    """The paths (keys and indices) of value and of everything inside it."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _spots(inner, path + (key,))


@st.composite
def _malformed_record(draw, fmt):
    """A record of format fmt, valid or with one spot inside replaced by another JSON value, deleted, or a string
    with a character put in."""
    record = draw(_valid_record(fmt))
    if draw(st.booleans()):
        return record
    *path, key = draw(st.sampled_from(list(_spots(record))[1:]))
    parent = record
    for step in path:
        parent = parent[step]
    how = draw(st.sampled_from(["insert" if isinstance(parent[key], str) else "delete", "replace"]))
    if how == "insert":
        at = draw(st.integers(0, len(parent[key])))
        parent[key] = parent[key][:at] + draw(CHARACTER) + parent[key][at:]
    elif how == "delete" and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = draw(ANY_JSON | ODD_VALUE)
    return record


# Lists of records of one format (the first record's fields tell the format).
MALFORMED_RECORDS = st.sampled_from(data.FORMATS).flatmap(
    lambda fmt: st.lists(_malformed_record(fmt), min_size=1, max_size=3))


def _line(draw, record):
    """A record as a JSONL line, or JSON text that train's reader refuses, cut or with stray bytes."""
    line = json.dumps(record).encode()
    how = draw(st.sampled_from(["as is", "as is", "cut", "stray bytes", "deep", "duplicate key", "long integer"]))
    if how == "cut":
        line = line[:draw(st.integers(0, len(line)))]
    elif how == "stray bytes":
        at = draw(st.integers(0, len(line)))
        line = line[:at] + draw(st.binary(min_size=1, max_size=3)) + line[at:]
    elif how == "deep":
        depth = draw(st.integers(250, 3000))
        line = b'{"text": "yes", "x": %s%s}' % (b"[" * depth, b"]" * depth)
    elif how == "duplicate key":
        line = b'{"text": "yes", "%s": "no"}' % draw(st.sampled_from([b"text", b"prompt", b"x"]))
    elif how == "long integer":
        line = b'{"text": "yes", "n": %s}' % (b"7" * draw(st.integers(1, 6000)))
    return line.replace(b"\n", b" ")


@st.composite
def malformed_lines(draw):
    return [_line(draw, record) for record in draw(MALFORMED_RECORDS)]


# Fixed examples (derandomize, no example database written), few and each bounded in time: a test of seconds.
PROPERTY_SETTINGS = settings(max_examples=150, deadline=5000, derandomize=True, database=None)


class DataTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        cls.chat_dir = make_tokenizer(os.path.join(cls.tmp, "chat"), CHATML)
        cls.tok = data.load_tokenizer(cls.chat_dir)
        cls.plain_tok = data.load_tokenizer(make_tokenizer(os.path.join(cls.tmp, "plain"), None))
        cls.counting_tok = data.load_tokenizer(make_tokenizer(os.path.join(cls.tmp, "counting"), COUNTING))

    def jsonl(self, name, records):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            for r in records:
                f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
        return path

    def sft(self, records, **kw):
        p = data.prepare(records, self.tok, **kw)
        self.assertEqual(p.kind, "sft")
        return [(r["input_ids"], r["labels"]) for r in p.records]

    def assertError(self, message_parts, fn, *args, **kw):
        with self.assertRaises(seqgrad.InvalidArgumentError) as cm:
            fn(*args, **kw)
        for part in message_parts:
            self.assertIn(part, str(cm.exception))
        return str(cm.exception)

    # ---- formats ----

    def test_text_is_learned_whole_with_bos_and_eos(self):
        self.assertEqual(self.sft([{"text": "hello there"}, {"text": "how are you </s>"}]),
                         [expect("[<s> hello there </s>]"), expect("[<s> how are you </s>]")])  # EOS not doubled

    def test_prompt_completion_masks_the_prompt(self):
        self.assertEqual(self.sft([{"prompt": "what is two plus four", "completion": "six"}]),
                         [expect("<s> what is two plus four [six </s>]")])

    def test_conversational_prompt_completion(self):
        got = self.sft([{"prompt": chat(("system", "be brief"), ("user", "what is two plus four")),
                         "completion": chat(("assistant", "six"))}])
        self.assertEqual(got, [expect("<s> <|im_start|> system be brief <|im_end|> <|im_start|> user what is two "
                                      "plus four <|im_end|> <|im_start|> assistant [six <|im_end|>]")])

    def test_messages_learn_only_assistant_turns(self):
        got = self.sft([{"messages": MULTI_TURN}])
        self.assertEqual(got, [expect(
            "<s> <|im_start|> system be brief <|im_end|> <|im_start|> user what is two plus four <|im_end|> "
            "<|im_start|> assistant [six <|im_end|>] <|im_start|> user thanks <|im_end|> "
            "<|im_start|> assistant [good <|im_end|>]")])
        # The ids are exactly what the template + tokenizer give for the whole conversation.
        whole = self.tok.apply_chat_template(MULTI_TURN, tokenize=False)
        self.assertEqual(got[0][0], self.tok(whole, add_special_tokens=False)["input_ids"])

    def test_messages_with_a_byte_level_bpe(self):
        """A trained byte-level BPE: cutting the chat into pieces gives the ids of the whole conversation, and the
        learned tokens spell exactly the assistant turns with their end of turn."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(["what is two plus four? six.", "Thanks, that is good!", "Be brief, please."] * 20,
                                trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        directory = os.path.join(self.tmp, "bpe")
        PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                chat_template=CHATML).save_pretrained(directory)
        tok = AutoTokenizer.from_pretrained(directory)
        conversation = chat(("system", "Be brief."), ("user", "what is two plus four?"), ("assistant", "six."),
                            ("user", "Thanks!"), ("assistant", "That is good, thanks."))
        (r,) = data.prepare([{"messages": conversation}], tok).records
        whole = tok.apply_chat_template(conversation, tokenize=False)
        self.assertEqual(r["input_ids"], tok(whole, add_special_tokens=False)["input_ids"])
        runs, run = [], []
        for token, label in zip(r["input_ids"], r["labels"]):
            if label != M:
                self.assertEqual(label, token)
                run.append(token)
            elif run:
                runs, run = runs + [run], []
        self.assertEqual([tok.decode(run) for run in runs + [run]],
                         ["six.<|im_end|>\n", "That is good, thanks.<|im_end|>\n"])

    def test_messages_ending_with_a_user_turn(self):
        got = self.sft([{"messages": chat(("user", "hello"), ("assistant", "yes"), ("user", "no"))}])
        self.assertEqual(got, [expect("<s> <|im_start|> user hello <|im_end|> <|im_start|> assistant [yes <|im_end|>] "
                                      "<|im_start|> user no <|im_end|>")])

    def test_dpo_plain(self):
        p = data.prepare([{"prompt": "what is two plus four", "chosen": "six", "rejected": "five seven",
                           "ref_chosen_logp": -1.5, "ref_rejected_logp": -2}], self.tok)
        self.assertEqual(p.kind, "dpo")
        self.assertEqual(p.records, [{"prompt": ids_of("<s> what is two plus four"), "chosen": ids_of("six </s>"),
                                      "rejected": ids_of("five seven </s>"), "ref_chosen_logp": -1.5,
                                      "ref_rejected_logp": -2.0}])
        (pair,), = list(p.batches(8))
        self.assertEqual(pair["chosen"], expect("<s> what is two plus four [six </s>]"))
        self.assertEqual(pair["rejected"], expect("<s> what is two plus four [five seven </s>]"))
        self.assertEqual((pair["ref_chosen_logp"], pair["ref_rejected_logp"]), (-1.5, -2.0))

    def test_dpo_conversational(self):
        p = data.prepare([{"prompt": chat(("user", "what is two plus four")),
                           "chosen": chat(("assistant", "six")), "rejected": chat(("assistant", "ten"))}], self.tok)
        prompt = "<s> <|im_start|> user what is two plus four <|im_end|> <|im_start|> assistant"
        self.assertEqual(p.records, [{"prompt": ids_of(prompt), "chosen": ids_of("six <|im_end|>"),
                                      "rejected": ids_of("ten <|im_end|>")}])
        (pair,), = list(p.batches(1))
        self.assertEqual(pair, {"chosen": expect(prompt + " [six <|im_end|>]"),
                                "rejected": expect(prompt + " [ten <|im_end|>]")})

    def test_grpo_groups(self):
        p = data.prepare([{"prompt": "two plus four", "completions": ["six", "five", "six yes"],
                           "advantages": [1, -1.5, 0.5]},
                          {"prompt": "one plus one", "completions": ["two"], "advantages": [0.0]}], self.tok)
        self.assertEqual(p.kind, "grpo")
        self.assertEqual(p.records[0], {"prompt": ids_of("<s> two plus four"),
                                        "completions": [ids_of("six </s>"), ids_of("five </s>"), ids_of("six yes </s>")],
                                        "advantages": [1.0, -1.5, 0.5]})
        groups, = list(p.batches(2))
        self.assertEqual(len(groups), 2)
        got = [(c["ids"], c["labels"], c["advantage"]) for c in groups[0]]
        self.assertEqual(got, [expect("<s> two plus four [six </s>]") + (1.0,),
                               expect("<s> two plus four [five </s>]") + (-1.5,),
                               expect("<s> two plus four [six yes </s>]") + (0.5,)])
        self.assertEqual((groups[1][0]["ids"], groups[1][0]["labels"]), expect("<s> one plus one [two </s>]"))

    def test_grpo_conversational(self):
        p = data.prepare([{"prompt": chat(("user", "yes no")), "completions": [chat(("assistant", "yes")),
                                                                                  chat(("assistant", "maybe"))],
                           "advantages": [0.5, -0.5]}], self.tok)
        self.assertEqual(p.records[0]["completions"], [ids_of("yes <|im_end|>"), ids_of("maybe <|im_end|>")])
        self.assertEqual(p.records[0]["prompt"], ids_of("<s> <|im_start|> user yes no <|im_end|> "
                                                        "<|im_start|> assistant"))

    def test_datasets_dataset_and_batches(self):
        import datasets
        ds = datasets.Dataset.from_list([{"messages": MULTI_TURN}, {"messages": chat(("user", "hello"),
                                                                                      ("assistant", "hello"))}])
        p = data.prepare(ds, self.tok)
        self.assertEqual(p.records, data.prepare(list(ds), self.tok).records)
        ids, labels = next(p.batches(2))
        self.assertEqual((ids[1], labels[1]), expect("<s> <|im_start|> user hello <|im_end|> <|im_start|> assistant "
                                                     "[hello <|im_end|>]"))
        self.assertError(["dataset[1]: field 'messages' has no assistant turn"], data.prepare,
                         datasets.Dataset.from_list([{"messages": MULTI_TURN}, {"messages": chat(("user", "hi"))}]),
                         self.tok)
        self.assertError(["is a dict of splits ('train'): pass one split"], data.prepare,
                         datasets.DatasetDict({"train": ds}), self.tok)
        saved = os.path.join(self.tmp, "saved")
        ds.save_to_disk(saved)
        self.assertEqual(data.prepare(saved, self.tok).records, p.records)

    # ---- packing and lengths ----

    def test_packing_keeps_documents_whole_and_apart(self):
        records = [{"text": "hello there"}, {"text": "how are you"}, {"text": "yes"}, {"text": "one three five seven"}]
        p = data.prepare(records, self.tok, seq_len=9, pack=True)
        # 4 + 5 = 9 fits; + 3 would not; 3 + 6 = 9 fits.
        self.assertEqual([(r["input_ids"], r["labels"]) for r in p.records], [
            expect("<s> [hello there </s>] <s> [how are you </s>]"),
            expect("<s> [yes </s>] <s> [one three five seven </s>]")])
        self.assertEqual(p.stats, {"records": 4, "sequences": 2, "truncated": 0, "tokens_cut": 0, "dropped": 0})
        self.assertEqual([r["doc_lengths"] for r in p.records], [[4, 5], [3, 6]])
        across = data.prepare(records, self.tok, seq_len=9, pack=True, cross_document=True)
        self.assertEqual(across.records, [{k: r[k] for k in ("input_ids", "labels")} for r in p.records])
        chats = data.prepare([{"messages": chat(("user", "hello"), ("assistant", "yes"))}] * 3, self.tok,
                             seq_len=24, pack=True)
        one = "<|im_start|> user hello <|im_end|> <|im_start|> assistant [yes <|im_end|>]"
        self.assertEqual([(r["input_ids"], r["labels"]) for r in chats.records],
                         [expect("<s> %s <s> %s" % (one, one)), expect("<s> " + one)])

    def test_truncation_counts(self):
        records = [{"text": "one three five seven eight nine"},                 # 8 tokens: cut 3
                   {"text": "yes"},                                             # fits
                   {"text": "hello there how are"}]                             # 6 tokens: cut 1
        p = data.prepare(records, self.tok, seq_len=5, overlong="truncate")
        self.assertEqual([(r["input_ids"], r["labels"]) for r in p.records],
                         [expect("[<s> one three five seven]"), expect("[<s> yes </s>]"),
                          expect("[<s> hello there how are]")])
        self.assertEqual(p.stats, {"records": 3, "sequences": 3, "truncated": 2, "tokens_cut": 3 + 1, "dropped": 0})
        records = [{"prompt": "one three five seven", "completion": "yes"},     # prompt 5 tokens: nothing left
                   {"prompt": "one three", "completion": "five seven"}]         # 6 tokens: cut 1
        p = data.prepare(records, self.tok, seq_len=5, overlong="truncate")
        self.assertEqual([(r["input_ids"], r["labels"]) for r in p.records], [expect("<s> one three [five seven]")])
        self.assertEqual(p.stats, {"records": 2, "sequences": 1, "truncated": 2, "tokens_cut": 2 + 1, "dropped": 1})

    def test_truncation_of_pairs_and_groups(self):
        p = data.prepare([{"prompt": "one plus", "chosen": "two three five", "rejected": "two"},
                          {"prompt": "one three five seven eight", "chosen": "yes", "rejected": "no"}],
                         self.tok, seq_len=5, overlong="truncate")
        self.assertEqual(p.records, [{"prompt": ids_of("<s> one plus"), "chosen": ids_of("two three"),
                                      "rejected": ids_of("two </s>")}])
        self.assertEqual(p.stats, {"records": 2, "sequences": 1, "truncated": 2, "tokens_cut": 2 + 4,
                                   "dropped": 1})
        g = data.prepare([{"prompt": "one", "completions": ["two three five", "yes"], "advantages": [1, 2]}],
                         self.tok, seq_len=4, overlong="truncate")
        self.assertEqual(g.records[0]["completions"], [ids_of("two three"), ids_of("yes </s>")])
        self.assertEqual((g.stats["truncated"], g.stats["tokens_cut"]), (1, 2))

    def test_overlong_refused_with_count_and_records(self):
        path = self.jsonl("long.jsonl", [{"text": "yes"}, {"text": "one three five seven"}, {"text": "no"},
                                         {"text": "one three five"}])
        self.assertError(["2 of 4 records are longer than seq_len 4 tokens: %s:2 (6 tokens), %s:4 (5 tokens)" %
                          (path, path), "overlong='truncate'"], data.prepare, path, self.tok, seq_len=4)

    # ---- bad input ----

    def test_bad_records_name_the_record_and_field(self):
        cases = [
            ({"messages": chat(("system", "be"), ("user", "hello"))},
             "x.jsonl:2: field 'messages' has no assistant turn, so nothing to learn (roles: system, user)"),
            ({"text": 5}, "x.jsonl:2: field 'text' must be a string, got 5"),
            ({"text": ""}, "x.jsonl:2: field 'text' is empty"),
            ({"prompt": "hello", "completion": ["yes"]}, "x.jsonl:2: field 'completion' must be a string like "
                                                         "'prompt', got a list"),
            ({"prompt": chat(("user", "hello")), "completion": "yes"},
             "x.jsonl:2: field 'completion' must be a list of chat messages"),
            ({"messages": "hello"}, "x.jsonl:2: field 'messages' must be a list of chat messages"),
            ({"messages": [{"role": "user", "content": 3}]},
             "x.jsonl:2: field 'messages[0].content' must be a string, got 3"),
            ({"messages": [{"content": "hi"}]},
             "x.jsonl:2: field 'messages[0].role' must be a string, got nothing (missing)"),
            ({"messages": ["hello"]}, "x.jsonl:2: field 'messages[0]' must be a message object with 'role' and "
                                      "'content', got the string \"hello\""),
            ({"messages": []}, "x.jsonl:2: field 'messages' is an empty list of messages"),
            ({"messages": chat(("assistant", "hello"), ("user", "yes"), ("assistant", "no"))},
             "x.jsonl:2: field 'messages[0]' is an assistant turn: a conversation must not start with one"),
        ]
        for bad, message in cases:
            with self.subTest(bad=bad):
                path = self.jsonl("x.jsonl", [{"messages": MULTI_TURN} if "messages" in bad else
                                              {"prompt": "yes", "completion": "no"} if "prompt" in bad else
                                              {"text": "yes"}, bad])
                self.assertError([message.replace("x.jsonl", path)], data.prepare, path, self.tok)

    def test_missing_and_wrong_fields_per_format(self):
        cases = [
            ("text", {"txt": "hello"}, "field 'text' is missing (format text needs 'text')"),
            ("prompt_completion", {"prompt": "hello", "completion": None},
             "field 'completion' is null (format prompt_completion needs 'prompt' and 'completion')"),
            ("dpo", {"chosen": "yes", "rejected": "no"},
             "field 'prompt' is missing (format dpo needs 'prompt', 'chosen' and 'rejected')"),
            ("dpo", {"prompt": "hello", "chosen": "yes", "rejected": "no", "ref_chosen_logp": -1},
             "field 'ref_rejected_logp' is missing while the other reference log-prob is given"),
            ("dpo", {"prompt": "hello", "chosen": "yes", "rejected": "no", "ref_chosen_logp": "x",
                     "ref_rejected_logp": 1}, "field 'ref_chosen_logp' must be a number, got the string \"x\""),
            ("dpo", {"prompt": chat(("user", "hi")), "chosen": chat(("user", "yes")), "rejected": chat(("assistant", "no"))},
             "field 'chosen' has no assistant turn"),
            ("grpo", {"prompt": "hello", "completions": ["yes", "no"], "advantages": [1]},
             "field 'advantages' has 1 entries for 2 completions"),
            ("grpo", {"prompt": "hello", "completions": ["yes"], "advantages": [True]},
             "field 'advantages[0]' must be a number, got true"),
            ("grpo", {"prompt": "hello", "completions": ["yes"], "advantages": [float("nan")]},
             "field 'advantages[0]' is not finite (nan)"),
            ("grpo", {"prompt": "hello", "completions": [], "advantages": []},
             "field 'completions' is empty: a group needs at least one completion"),
            ("grpo", {"prompt": "hello", "completions": "yes", "advantages": [1]},
             "field 'completions' must be a list of completions, got the string \"yes\""),
            ("grpo", {"prompt": "hello", "completions": [5], "advantages": [1]},
             "field 'completions[0]' must be a string, got 5"),
            ("grpo", {"prompt": "hello", "completions": ["yes"]},
             "field 'advantages' is missing (format grpo needs 'prompt', 'completions' and 'advantages')"),
        ]
        for fmt, bad, message in cases:
            with self.subTest(bad=bad):
                self.assertError(["data[0]: " + message], data.prepare, [bad], self.tok, format=fmt, name="data")

    def test_bad_files_and_arguments(self):
        self.assertError(["malformed.jsonl:2: malformed JSON at column 10"], data.prepare,
                         self.jsonl("malformed.jsonl", [{"text": "yes"}, '{"text": yes}']), self.tok)
        self.assertError(["list.jsonl:1: expected a JSON object (a record), got a list"], data.prepare,
                         self.jsonl("list.jsonl", ["[1, 2]"]), self.tok)
        self.assertError(["odd.jsonl:1: cannot tell the format from the fields ('input_ids')"], data.prepare,
                         self.jsonl("odd.jsonl", [{"input_ids": [1, 2]}]), self.tok)
        self.assertError(["empty.jsonl: no records"], data.prepare, self.jsonl("empty.jsonl", ["", " "]), self.tok)
        self.assertError(["nothing.jsonl: no such file"], data.prepare, os.path.join(self.tmp, "nothing.jsonl"),
                         self.tok)
        self.assertError(["pack needs seq_len"], data.prepare, [{"text": "yes"}], self.tok, pack=True)
        self.assertError(["pack applies to text, prompt_completion and messages, not dpo"], data.prepare,
                         [{"prompt": "a", "chosen": "b", "rejected": "c"}], self.tok, seq_len=8, pack=True)
        self.assertError(["overlong must be 'refuse' or 'truncate', got 'cut'"], data.prepare, [{"text": "yes"}],
                         self.tok, overlong="cut")
        self.assertError(["format must be 'auto' or one of"], data.prepare, [{"text": "yes"}], self.tok,
                         format="chat")
        no_eos = data.load_tokenizer(self.plain_dir())
        no_eos.eos_token = None
        self.assertError(["data[0]: the record has 1 token(s) and nothing to learn after the first token"],
                         data.prepare, [{"text": "  "}], no_eos, name="data")
        self.assertError(["batch_size must be a positive integer"], lambda: next(
            data.prepare([{"text": "yes"}], self.tok).batches(0)))
        self.assertError(["not a directory"], data.load_tokenizer, os.path.join(self.tmp, "nowhere"))
        os.makedirs(os.path.join(self.tmp, "no_tokenizer"), exist_ok=True)
        self.assertError(["no_tokenizer: cannot load a tokenizer: "], data.load_tokenizer,
                         os.path.join(self.tmp, "no_tokenizer"))
        self.assertError(["tokenizer must be a Hugging Face transformers tokenizer (data.load_tokenizer), got str"],
                         data.prepare, [{"text": "yes"}], "gpt2")
        latin1 = os.path.join(self.tmp, "latin1.jsonl")
        with open(latin1, "wb") as f:
            f.write(b'{"text": "yes"}\n{"text": "caf\xe9"}\n')
        self.assertError(["latin1.jsonl:2: not UTF-8 text (byte 14 of the line)"], data.prepare, latin1, self.tok)
        with self.assertRaises(OSError) as cm:
            data.prepare([{"text": "yes"}], self.tok).write(os.path.join(self.tmp, "no_dir", "out.jsonl"))
        self.assertIn("no_dir/out.jsonl: cannot write: No such file or directory", str(cm.exception))

    def test_tokenizer_without_chat_template(self):
        self.assertError(["data[0]: a conversational record needs a chat template, and the tokenizer",
                          "has none"], data.prepare, [{"messages": MULTI_TURN}], self.plain_tok, name="data")
        # Plain records need none.
        self.assertEqual(data.prepare([{"text": "yes"}], self.plain_tok).records[0]["input_ids"],
                         ids_of("<s> yes </s>"))

    def test_template_without_prefix_property_is_refused(self):
        self.assertError(["data[0]: field 'messages[2]' cannot be located: the chat template does not render the "
                          "conversation up to this message as a prefix"], data.prepare, [{"messages": MULTI_TURN}],
                         self.counting_tok, name="data")

    # ---- files: the rules of train --data's JSONL reader ----

    def test_files_that_are_not_regular_are_refused_unread(self):
        fifo = os.path.join(self.tmp, "records.fifo")
        os.mkfifo(fifo)
        with writer_now_and_then(fifo):
            self.assertError(["records.fifo: is a FIFO (named pipe), not a regular file"], data.prepare, fifo, self.tok)
        self.assertError(["/dev/null: is a character device, not a regular file"], data.prepare, "/dev/null", self.tok)
        # The files the libraries read: a tokenizer's, a saved dataset's.
        import datasets
        saved = os.path.join(self.tmp, "saved")
        datasets.Dataset.from_list([{"text": "yes"}]).save_to_disk(saved)
        tokenizer = os.path.join(self.tmp, "fifo_tokenizer")
        make_tokenizer(tokenizer, CHATML)
        for directory, name, load in ((saved, "state.json", lambda: data.prepare(saved, self.tok)),
                                      (tokenizer, "tokenizer_config.json", lambda: data.load_tokenizer(tokenizer))):
            with self.subTest(name=name):
                fifo = os.path.join(directory, name)
                os.remove(fifo)
                os.mkfifo(fifo)
                with writer_now_and_then(fifo):
                    self.assertError(["%s: is a FIFO (named pipe), not a regular file" % fifo], load)

    def test_lines_longer_than_max_line_bytes_are_refused(self):
        record = '{"text": "yes"}'
        path = self.jsonl("lines.jsonl", [record.ljust(40), record + " " * 41])  # 40 bytes, then 56
        self.assertEqual(len(data.prepare(path, self.tok, max_line_bytes=56).records), 2)
        self.assertError(["lines.jsonl:2: line is longer than 55 bytes (--max_line_bytes)"], data.prepare, path,
                         self.tok, max_line_bytes=55)
        with open(path, "a") as f:
            f.write(record + " " * 100)  # no newline at the end
        self.assertError(["lines.jsonl:3: line is longer than 56 bytes (--max_line_bytes)"], data.prepare, path,
                         self.tok, max_line_bytes=56)
        self.assertEqual(data.MAX_LINE_BYTES, 64 << 20)  # train's default
        for bad in (0, -1, 1.5, True):
            self.assertError(["max_line_bytes must be a positive integer, got %r" % bad], data.prepare, path,
                             self.tok, max_line_bytes=bad)

    def test_a_huge_line_is_refused_having_read_at_most_max_line_bytes(self):
        """A 512 MiB line of zeros (sparse: no disk) with the default 64 MiB cap: refused at line 1, and the reader's
        peak memory grows by far less than the line."""
        path = os.path.join(self.tmp, "zeros.jsonl")
        with open(path, "wb") as f:
            f.truncate(512 << 20)
        script = ("import resource, sys\n"
                  "from seqgrad import data\n"
                  "class Tokenizer:\n"
                  "    eos_token_id = 0\n"
                  "    def __call__(self, *args, **kwargs): raise AssertionError('no record gets here')\n"
                  "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10\n"
                  "before = peak()\n"
                  "try:\n"
                  "    data.prepare(sys.argv[1], Tokenizer())\n"
                  "except data.InvalidArgumentError as e:\n"
                  "    print(e)\n"
                  "print(peak() - before)\n")
        r = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        message, grown = r.stdout.splitlines()
        self.assertEqual(message, "%s:1: line is longer than %d bytes (--max_line_bytes)" % (path, 64 << 20))
        self.assertLess(int(grown), 3 * (64 << 20))

    def test_json_that_train_refuses_is_refused(self):
        def nested(depth):  # the record is one level, "x" the others
            return '{"text": "yes", "x": %s%s}' % ("[" * (depth - 1), "]" * (depth - 1))
        self.assertEqual(len(data.prepare(self.jsonl("deep.jsonl", [nested(256)]), self.tok).records), 1)
        cases = [
            (nested(257), "JSON nested deeper than 256 levels"),
            (nested(100000), "JSON nested deeper than 256 levels"),  # json.loads: RecursionError
            ('{"text": "yes", "text": "no"}', 'duplicate JSON key "text"'),
            ('{"text": NaN}', "malformed JSON: NaN is not JSON (numbers must be finite)"),
            ('{"text": "yes\0"}', "NUL byte at column 14"),
            ('{"text": "\\ud800 yes"}', "field 'text' is not Unicode text: a lone surrogate \\ud800 at character 1"),
            ('{"messages": [{"role": "user", "content": "hello \\udfff"}, {"role": "assistant", "content": "yes"}]}',
             "field 'messages[0].content' is not Unicode text: a lone surrogate \\udfff at character 7"),
            ('{"prompt": "yes", "completions": ["no"], "advantages": [%s]}' % ("9" * 400),
             "field 'advantages[0]' is not finite (inf)"),
        ]
        for line, message in cases:
            with self.subTest(message=message):
                path = self.jsonl("refused.jsonl", ["", line])
                self.assertError(["%s:2: %s" % (path, message)], data.prepare, path, self.tok)
        # An integer of 6000 digits (json.loads refuses over 4300) where nothing reads it, as train's parser: a double.
        self.assertEqual(len(data.prepare(self.jsonl("long_int.jsonl", ['{"text": "yes", "n": %s}' % ("7" * 6000)]),
                                          self.tok).records), 1)
        self.assertError(["data[0]: field 'advantages[0]' is not finite (inf)"], data.prepare,
                         [{"prompt": "yes", "completions": ["no"], "advantages": [10 ** 400]}], self.tok, name="data")

    def test_write_goes_through_a_new_file(self):
        prepared = data.prepare([{"text": "yes"}], self.tok)
        out = os.path.join(self.tmp, "written.jsonl")
        # A symlink left under a name a temporary file could have (that of the code before): never followed.
        victim = self.jsonl("victim.jsonl", ["keep me"])
        os.symlink(victim, "%s.tmp%d" % (out, os.getpid()))
        prepared.write(out)
        with open(victim) as f:
            self.assertEqual(f.read(), "keep me\n")
        with open(out) as f:
            self.assertEqual([json.loads(line) for line in f], prepared.records)
        # Through a symlink: the file it names is replaced, the link stays.
        link = os.path.join(self.tmp, "link.jsonl")
        target = self.jsonl("target.jsonl", ["old"])
        os.symlink(target, link)
        prepared.write(link)
        self.assertTrue(os.path.islink(link))
        with open(target) as f:
            self.assertEqual(json.loads(f.read()), prepared.records[0])
        fifo = os.path.join(self.tmp, "out.fifo")
        os.mkfifo(fifo)
        self.assertError(["out.fifo: is a FIFO (named pipe), not a regular file"], prepared.write, fifo)
        self.assertTrue(os.path.exists(fifo) and not os.path.isfile(fifo))
        # A write that fails leaves the old file and no temporary file.
        class Failing(list):
            def __iter__(self):
                yield {"input_ids": [1]}
                raise OSError(28, "No space left on device")
        before = sorted(os.listdir(self.tmp))
        with self.assertRaises(OSError) as cm:
            data.Prepared("text", Failing(), prepared.stats).write(out)
        self.assertIn("written.jsonl: cannot write: No space left on device", str(cm.exception))
        self.assertEqual(sorted(os.listdir(self.tmp)), before)
        with open(out) as f:
            self.assertEqual([json.loads(line) for line in f], prepared.records)

    @PROPERTY_SETTINGS
    @given(malformed_lines())
    def test_malformed_lines_fail_at_their_file_and_line(self, lines):
        """Whatever the lines: records, or an InvalidArgumentError naming the first line that is wrong."""
        path = os.path.join(self.tmp, "property.jsonl")
        message = self.prepare_lines(path, lines)
        if message is None or message == "%s: no records" % path:
            return
        where = re.match(re.escape(path) + r":(\d+): ", message)
        self.assertIsNotNone(where, message)
        line = int(where.group(1))
        self.assertLessEqual(line, len(lines))
        self.assertIn(self.prepare_lines(path, lines[:line - 1]), (None, "%s: no records" % path))

    def prepare_lines(self, path, lines):
        """None, or the message of the InvalidArgumentError that prepare raises on a file of these lines."""
        with open(path, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))
        try:
            data.prepare(path, self.tok)
        except seqgrad.InvalidArgumentError as e:
            return str(e)
        return None

    @PROPERTY_SETTINGS
    @given(MALFORMED_RECORDS)
    def test_malformed_records_fail_at_their_index(self, records):
        """The same for records in memory (a list of dicts): errors name the record as data[i]."""
        try:
            data.prepare(records, self.tok, name="data")
        except seqgrad.InvalidArgumentError as e:
            self.assertRegex(str(e), r"^data\[\d+\]: ")

    # ---- the command and the trainer ----

    def run_cli(self, *args, python=sys.executable, env=None):
        return subprocess.run([python, "-m", "seqgrad.data"] + list(args), capture_output=True, text=True,
                              env=env, timeout=120)

    def test_command_writes_the_same_jsonl(self):
        records = [{"messages": MULTI_TURN}, {"messages": chat(("user", "hello"), ("assistant", "yes"))}]
        src, out = self.jsonl("chats.jsonl", records), os.path.join(self.tmp, "out.jsonl")
        r = self.run_cli("--tokenizer", self.chat_dir, "--input", src, "--output", out, "--seq_len", "64", "--pack")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("2 messages records -> 1 sequences packed to <= 64 tokens; 0 truncated (0 tokens cut), "
                      "0 dropped; wrote %s (train --objective=sft)" % out, r.stderr)
        with open(out) as f:
            written = [json.loads(line) for line in f]
        self.assertEqual(written, data.prepare(src, self.tok, seq_len=64, pack=True).records)
        self.assertEqual(len(written[0]["input_ids"]), 26 + 9)
        self.assertEqual(written[0]["doc_lengths"], [26, 9])
        r = self.run_cli("--tokenizer", self.chat_dir, "--input", src, "--output", out, "--seq_len", "64", "--pack",
                         "--pack_cross_document")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out) as f:
            self.assertEqual([json.loads(line) for line in f],
                             [{k: w[k] for k in ("input_ids", "labels")} for w in written])
        r = self.run_cli("--tokenizer", self.chat_dir, "--input", src, "--output", out, "--pack_cross_document")
        self.assertEqual(r.returncode, 1)
        self.assertIn("seqgrad.data: error: --pack_cross_document needs --pack", r.stderr)

        r = self.run_cli("--tokenizer", self.plain_dir(), "--input", src, "--output", out)
        self.assertEqual(r.returncode, 1)
        self.assertIn("seqgrad.data: error: %s:1: a conversational record needs a chat template" % src, r.stderr)
        r = self.run_cli("--tokenizer", self.chat_dir, "--input", src, "--output", out, "--seq_len", "20")
        self.assertIn("1 of 2 records are longer than seq_len 20 tokens: %s:1 (26 tokens)" % src, r.stderr)

    def plain_dir(self):
        return os.path.join(self.tmp, "plain")

    def test_command_checks_its_files_before_any_work(self):
        src = self.jsonl("source.jsonl", [{"text": "yes"}, {"text": "no " * 30}])  # line 2: 104 bytes
        with open(src) as f:
            original = f.read()
        link, hard = os.path.join(self.tmp, "source_link.jsonl"), os.path.join(self.tmp, "source_hard.jsonl")
        os.symlink(src, link)
        os.link(src, hard)
        fifo, nowhere = os.path.join(self.tmp, "cli_out.fifo"), os.path.join(self.tmp, "nowhere", "out.jsonl")
        os.mkfifo(fifo)
        same = "--output %s is the --input file " + src + ": it would be overwritten; write elsewhere"
        cases = [
            (src, src, same % src),
            (src, link, same % link),
            (src, hard, same % hard),
            (src, fifo, "%s: is a FIFO (named pipe), not a regular file" % fifo),
            (src, nowhere, "%s: cannot write: no directory %s" % (nowhere, os.path.dirname(nowhere))),
            # With a line cap, which the code before refused as an unknown flag instead of reading /dev/zero forever.
            ("/dev/zero", os.path.join(self.tmp, "zero.jsonl"), "/dev/zero: is a character device, not a regular file",
             "--max_line_bytes=100"),
            (src, os.path.join(self.tmp, "capped.jsonl"), "%s:2: line is longer than 100 bytes (--max_line_bytes)" %
             src, "--max_line_bytes=100"),
        ]
        for input_path, output_path, message, *flags in cases:
            with self.subTest(output=output_path):
                r = self.run_cli("--tokenizer", self.chat_dir, "--input", input_path, "--output", output_path, *flags)
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertEqual(r.stderr.splitlines()[-1], "seqgrad.data: error: " + message)  # no traceback
        with open(src) as f:
            self.assertEqual(f.read(), original)
        r = self.run_cli("--tokenizer", self.chat_dir, "--input", src, "--output", "x", "--max_line_bytes", "0")
        self.assertEqual(r.returncode, 2)
        self.assertIn("argument --max_line_bytes: must be a positive integer, got '0'", r.stderr)

    def test_command_without_transformers_says_so(self):
        script = ("import sys; sys.modules['transformers'] = None; from seqgrad import data; "
                  "sys.exit(data.main(sys.argv[1:]))")
        r = subprocess.run([sys.executable, "-c", script, "--tokenizer", self.chat_dir, "--input",
                            self.jsonl("one.jsonl", [{"text": "yes"}]), "--output", os.path.join(self.tmp, "y")],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 1)
        self.assertIn("seqgrad.data needs Hugging Face transformers for the tokenizer (pip install 'seqgrad[data]')",
                      r.stderr)

    def test_chat_without_jinja2_says_so(self):
        # Blocked, submodules too, after transformers is imported: its chat templates import jinja2 when they render.
        script = ("import sys; from seqgrad import data; import transformers\n"
                  "for m in [m for m in sys.modules if m.split('.')[0] == 'jinja2'] + ['jinja2']:\n"
                  "    sys.modules[m] = None\n"
                  "sys.exit(data.main(sys.argv[1:]))")
        chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}]
        r = subprocess.run([sys.executable, "-c", script, "--tokenizer", self.chat_dir, "--input",
                            self.jsonl("chat.jsonl", chat), "--output", os.path.join(self.tmp, "z")],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 1)
        self.assertIn("seqgrad.data needs jinja2 for chat templates (pip install 'seqgrad[data]')", r.stderr)

    def test_written_files_train_with_the_cli(self):
        """What write() produces is what `train --data` reads, for each objective."""
        train = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "cli", "train")
        cases = [
            ("sft", data.prepare([{"messages": MULTI_TURN}] * 3, self.tok, seq_len=64, pack=True), []),
            ("dpo", data.prepare([{"prompt": chat(("user", "two plus four")), "chosen": chat(("assistant", "six")),
                                   "rejected": chat(("assistant", "five")), "ref_chosen_logp": -4.5,
                                   "ref_rejected_logp": -4.6}], self.tok), []),
            ("grpo", data.prepare([{"prompt": "two plus four", "completions": ["six", "five seven"],
                                    "advantages": [1, -1]}], self.tok), ["--grpo_kl_beta=0"]),
        ]
        for objective, prepared, flags in cases:
            with self.subTest(objective=objective):
                path, report = (os.path.join(self.tmp, "%s.%s" % (objective, ext)) for ext in ("jsonl", "json"))
                prepared.write(path)
                r = subprocess.run([train, "--model=tiny", "--objective=" + objective, "--data=" + path,
                                    "--seq_len=64", "--steps=2", "--batch=1", "--report=" + report] + flags,
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                with open(report) as f:
                    losses = json.load(f)["losses"]
                self.assertEqual(len(losses), 2)
                self.assertTrue(all(math.isfinite(loss) for loss in losses), losses)

    def test_batches_go_to_a_trainer(self):
        sft = data.prepare([{"messages": MULTI_TURN}, {"messages": chat(("user", "hello"), ("assistant", "yes"))}],
                           self.tok)
        dpo = data.prepare([{"prompt": "two plus four", "chosen": "six", "rejected": "five",
                             "ref_chosen_logp": -3.0, "ref_rejected_logp": -3.5}], self.tok)
        grpo = data.prepare([{"prompt": "two plus four", "completions": ["six", "five"], "advantages": [1, -1]}],
                            self.tok)
        with seqgrad.Model.from_preset("tiny", seed=0) as model:
            self.assertGreater(model.vocab_size, max(VOCAB.values()))
            with seqgrad.Trainer(model, lr=1e-3) as t:
                for ids, labels in sft.batches(2):
                    self.assertGreater(t.step(ids, labels)["loss"], 0)
        # Packed with documents: each record trains as alone, so the packed batch's loss is the records'.
        records = [{"messages": MULTI_TURN}, {"messages": chat(("user", "hello"), ("assistant", "yes"))}]
        packed = data.prepare(records, self.tok, seq_len=64, pack=True)
        with seqgrad.Model.from_preset("tiny", dtype="f64", seed=0) as model, seqgrad.Trainer(model) as t:
            (batch,) = packed.batches(2)
            self.assertEqual(len(batch), 3)
            alone = t.evaluate(*data.prepare(records, self.tok).batches(2).__next__())
            together = t.evaluate(*batch)
            self.assertEqual(together["tokens"], alone["tokens"])
            self.assertAlmostEqual(together["loss"], alone["loss"], delta=1e-12 * alone["loss"])
            with seqgrad.Trainer(model, objective="dpo", lr=1e-3) as t:
                for pairs in dpo.batches(1):
                    self.assertGreater(t.step_dpo(pairs)["loss"], 0)
            with seqgrad.Trainer(model, objective="grpo", grpo_kl_beta=0.0, lr=1e-3) as t:
                for groups in grpo.batches(1):
                    t.step_grpo(groups)


if __name__ == "__main__":
    unittest.main()
