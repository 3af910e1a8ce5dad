"""Text, prompts and chats to seqgrad's token data, through the user's own Hugging Face tokenizer.

    python -m seqgrad.data --tokenizer MODEL_DIR --input chats.jsonl --output train.jsonl --seq_len 4096 --pack

or in Python:

    from seqgrad import data
    tok = data.load_tokenizer("MODEL_DIR")              # transformers.AutoTokenizer (an optional dependency)
    prepared = data.prepare("chats.jsonl", tok, seq_len=4096, pack=True)   # or a `datasets` Dataset, or a list
    prepared.write("train.jsonl")                       # the JSONL that `train --data` reads
    for ids, labels in prepared.batches(4):             # or straight into a Trainer
        trainer.step(ids, labels)                       # step_dpo(batch) / step_grpo(batch) for those objectives

Input formats (TRL's), told apart by their fields (or forced with format=):
  text               {"text": str}
  prompt_completion  {"prompt": str, "completion": str}, or both lists of chat messages (conversational)
  messages           {"messages": [{"role": ..., "content": str}, ...]}: the tokenizer's chat template, loss on the
                     assistant turns only
  dpo                {"prompt", "chosen", "rejected"}: strings, or chat messages (the prompt a conversation, each
                     response the assistant's messages); optional "ref_chosen_logp"/"ref_rejected_logp" pass through
  grpo               {"prompt", "completions": [...], "advantages": [...]}: one prompt and its G sampled completions
                     (strings, or lists of assistant messages) with one advantage each
Other fields are ignored; null counts as absent.

Labels follow Hugging Face: aligned with input_ids, not shifted (the engine shifts), -100 where there is no loss.
The prompt and the response are tokenized separately (the prompt with the tokenizer's special tokens such as BOS,
the response without) and concatenated; a chat is rendered by the chat template and cut where each assistant turn
starts and ends (so the template must render every prefix of the conversation as a prefix of the whole), and each
piece is tokenized on its own. Plain-text records and plain responses end with the tokenizer's EOS (added when
missing, and learned); chat responses end with whatever the template ends a turn with.

seq_len limits the tokens per sequence (input_ids; for dpo/grpo prompt + each response). Longer records are refused
(overlong="refuse", the default: one error listing them) or cut at the end (overlong="truncate"); a record left with
nothing to learn is dropped. Counts are in Prepared.stats and printed by the command.

pack=True (SFT formats) concatenates whole records, in order, into sequences of at most seq_len tokens, each with
its "doc_lengths" (the records' lengths): the engine trains every document as if alone (attention within the
document, RoPE positions restarting at 0, no label crossing into the next; the first token of each document has
label -100). cross_document=True (--pack_cross_document) packs without doc_lengths, as before 0.8: a token then also
attends to the earlier documents of its sequence and positions run on.
"""
import argparse
import contextlib
import itertools
import json
import math
import os
import stat
import sys

from ._errors import InvalidArgumentError

FORMATS = ("text", "prompt_completion", "messages", "dpo", "grpo")
IGNORE = -100


def _error(where, field, what):
    return InvalidArgumentError("%s: field '%s' %s" % (where, field, what))


def _describe(v):
    """A value in a few words for an error message."""
    if v is None or isinstance(v, (bool, int, float)):
        return json.dumps(v)
    if isinstance(v, str):
        return "the string %s" % json.dumps(v) if len(v) <= 40 else "a string"
    return "a list" if isinstance(v, (list, tuple)) else "an object" if isinstance(v, dict) else type(v).__name__


def load_tokenizer(model_dir):
    """transformers.AutoTokenizer.from_pretrained(model_dir), local files only."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError("seqgrad.data needs Hugging Face transformers for the tokenizer (pip install "
                          "'seqgrad[data]'): %s" % e) from None
    if not os.path.isdir(model_dir):
        raise InvalidArgumentError("%s: not a directory (a model or tokenizer directory with tokenizer.json or "
                                   "tokenizer_config.json)" % model_dir)
    _check_files_in(model_dir)
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InvalidArgumentError("%s: cannot load a tokenizer: %s" % (model_dir, e)) from None


# ---- reading records: (where, dict) with where = "file:line" or "name[index]" ----
# The JSONL rules are train --data's (core/data.cc): regular files only, lines of at most max_line_bytes read
# without holding more, no NUL byte, strict JSON without duplicate keys nested at most MAX_JSON_DEPTH deep.

MAX_LINE_BYTES = 64 << 20  # train's --max_line_bytes default (kDefaultMaxLineBytes)
MAX_JSON_DEPTH = 256  # train's JSON nesting limit (kMaxJsonDepth)

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(path, mode):
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "not a regular file")
    return InvalidArgumentError("%s: is %s, not a regular file" % (path, kind))


def _check_files_in(directory):
    """Refuses a FIFO, socket or device among a directory's files (libraries would block on it or read forever)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                mode = entry.stat().st_mode  # follows symlinks
            except OSError:
                continue  # a dangling link: the library names it if it needs it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise _not_regular(entry.path, mode)


def _open_regular(path):
    """A regular file opened for reading; anything else is refused before a read could block or never end."""
    try:
        if not stat.S_ISREG(mode := os.stat(path).st_mode):
            raise _not_regular(path, mode)
        # O_NONBLOCK: a FIFO put there since the stat does not block the open (the fstat below refuses it).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidArgumentError("%s: no such file" % path) from None
    except OSError as e:
        raise InvalidArgumentError("%s: cannot open: %s" % (path, e.strerror)) from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
        f.close()
        raise _not_regular(path, mode)
    os.set_blocking(fd, True)
    return f


def _lines(f, path, max_line_bytes):
    """(line number, bytes without the newline) of each line; a longer line is refused having read only its start."""
    for lineno in itertools.count(1):
        try:
            raw = f.readline(max_line_bytes + 1)
        except OSError as e:
            raise OSError(e.errno, "%s:%d: read failed: %s" % (path, lineno, e.strerror)) from None
        if not raw:
            return
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        elif len(raw) > max_line_bytes:
            raise InvalidArgumentError("%s:%d: line is longer than %d bytes (--max_line_bytes)" %
                                       (path, lineno, max_line_bytes))
        yield lineno, raw


class _Refused(ValueError):
    """JSON that json.loads accepts and train's parser does not."""


def _object(pairs):
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused("duplicate JSON key %s" % json.dumps(key[:40]))
    return obj


def _constant(name):
    raise _Refused("malformed JSON: %s is not JSON (numbers must be finite)" % name)


def _integer(text):
    """An integer outside 64 bits is read as a double, as train's parser does (json.loads refuses over 4300 digits)."""
    if len(text) <= 20 and -2 ** 63 <= int(text) < 2 ** 64:
        return int(text)
    return float(text)


def _nested_deeper(obj, limit):
    """Whether objects and arrays nest more than `limit` deep (json.loads only stops near the recursion limit)."""
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _decode(where, raw):
    nul = raw.find(b"\0")
    if nul >= 0:
        raise InvalidArgumentError("%s: NUL byte at column %d" % (where, nul + 1))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError("%s: not UTF-8 text (byte %d of the line)" % (where, e.start + 1)) from None


def _parse(where, line):
    deep = InvalidArgumentError("%s: JSON nested deeper than %d levels" % (where, MAX_JSON_DEPTH))
    try:
        obj = json.loads(line, object_pairs_hook=_object, parse_constant=_constant, parse_int=_integer)
    except RecursionError:
        raise deep from None
    except json.JSONDecodeError as e:
        raise InvalidArgumentError("%s: malformed JSON at column %d: %s" % (where, e.colno, e.msg)) from None
    except ValueError as e:
        raise InvalidArgumentError("%s: %s" % (where, e)) from None
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH and _nested_deeper(obj, MAX_JSON_DEPTH):
        raise deep
    return obj


def _read_jsonl(path, max_line_bytes):
    with _open_regular(path) as f:
        for lineno, raw in _lines(f, path, max_line_bytes):
            where = "%s:%d" % (path, lineno)
            line = _decode(where, raw)
            if line.strip():
                yield where, _parse(where, line)


def _records(source, name, max_line_bytes):
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):  # a dataset saved with Dataset.save_to_disk
            try:
                import datasets
            except ImportError:
                raise ImportError("%s is a directory: reading a saved dataset needs Hugging Face datasets "
                                  "(pip install 'seqgrad[data]')" % path) from None
            _check_files_in(path)
            yield from _records(datasets.load_from_disk(path), path, max_line_bytes)
            return
        yield from _read_jsonl(path, max_line_bytes)
        return
    if isinstance(source, dict):  # datasets.DatasetDict too
        keys = ", ".join(map(repr, source.keys()))
        raise InvalidArgumentError("%s is a dict of splits (%s): pass one split, e.g. %s['train']" % (name, keys, name))
    for i, obj in enumerate(source):
        yield "%s[%d]" % (name, i), obj


def detect_format(record):
    """The TRL format a record's fields say, or None."""
    has = lambda k: isinstance(record, dict) and record.get(k) is not None
    if has("chosen") or has("rejected"):
        return "dpo"
    if has("completions"):
        return "grpo"
    if has("messages"):
        return "messages"
    if has("completion"):
        return "prompt_completion"
    if has("text"):
        return "text"
    return None


# ---- one record's fields, checked ----

class _Record:
    def __init__(self, where, obj):
        self.where, self.obj = where, obj

    def error(self, field, what):
        return _error(self.where, field, what)

    def field(self, name, fmt):
        v = self.obj.get(name)
        if v is None:
            raise self.error(name, "is %s (format %s needs %s)" % (
                "missing" if name not in self.obj else "null", fmt, _FIELDS[fmt]))
        return v

    def string(self, v, name):
        """A str the tokenizer takes: no lone surrogate (JSON's "\\ud800" escapes decode to one)."""
        if not isinstance(v, str):
            raise self.error(name, "must be a string, got %s" % _describe(v))
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise self.error(name, "is not Unicode text: a lone surrogate \\u%04x at character %d" %
                             (ord(v[e.start]), e.start + 1)) from None
        return v

    def text(self, v, name):
        if not self.string(v, name):
            raise self.error(name, "is empty")
        return v

    def messages(self, v, name):
        if not isinstance(v, (list, tuple)):
            raise self.error(name, "must be a list of chat messages ({\"role\": ..., \"content\": ...}), got %s" %
                             _describe(v))
        if not v:
            raise self.error(name, "is an empty list of messages")
        for i, m in enumerate(v):
            at = "%s[%d]" % (name, i)
            if not isinstance(m, dict):
                raise self.error(at, "must be a message object with 'role' and 'content', got %s" % _describe(m))
            for key in ("role", "content"):
                if key not in m:
                    raise self.error("%s.%s" % (at, key), "must be a string, got nothing (missing)")
                self.string(m[key], "%s.%s" % (at, key))
        return list(v)

    def text_or_messages(self, v, name, conversational=None):
        """(value, is_conversational); conversational=True/False asks for that kind (as the prompt is)."""
        if conversational is None:
            conversational = isinstance(v, (list, tuple))
        if conversational:
            return self.messages(v, name), True
        if isinstance(v, (list, tuple)):
            raise self.error(name, "must be a string like 'prompt', got a list")
        return self.text(v, name), False

    def number(self, v, name):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(name, "must be a number, got %s" % _describe(v))
        try:
            x = float(v)
        except OverflowError:  # an integer beyond a double's range
            x = math.inf if v > 0 else -math.inf
        if not math.isfinite(x):
            raise self.error(name, "is not finite (%s)" % x)
        return x


_FIELDS = {
    "text": "'text'",
    "prompt_completion": "'prompt' and 'completion'",
    "messages": "'messages'",
    "dpo": "'prompt', 'chosen' and 'rejected'",
    "grpo": "'prompt', 'completions' and 'advantages'",
}


# ---- tokenizing ----

class _Tokenize:
    """The user's tokenizer, used the same way by every format."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id

    def ids(self, text, special):
        return list(self.tok(text, add_special_tokens=special)["input_ids"]) if text else []

    def with_eos(self, ids):
        return ids + [self.eos] if self.eos is not None and (not ids or ids[-1] != self.eos) else ids

    def render(self, rec, messages, generation_prompt):
        if not getattr(self.tok, "chat_template", None):
            raise InvalidArgumentError(
                "%s: a conversational record needs a chat template, and the tokenizer (%s) has none (set "
                "'chat_template' in tokenizer_config.json or add chat_template.jinja)" %
                (rec.where, getattr(self.tok, "name_or_path", "") or type(self.tok).__name__))
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except ImportError as e:  # transformers renders templates with jinja2, an optional dependency of its own
            raise ImportError("seqgrad.data needs jinja2 for chat templates (pip install 'seqgrad[data]'): %s" % e) \
                from None
        except Exception as e:  # template errors (jinja's raise_exception, missing keys) name no record
            raise InvalidArgumentError("%s: the chat template failed on this conversation: %s: %s" %
                                       (rec.where, type(e).__name__, e)) from None

    def chat_pieces(self, rec, messages, field, learned):
        """[(text, learned?)]: the rendered conversation cut around the messages whose index is in `learned`."""
        full = self.render(rec, messages, False)
        pieces, pos = [], 0
        for i in learned:
            if i == 0:  # transformers renders no empty conversation, so the turn's header cannot be told apart
                raise rec.error("%s[0]" % field, "is an assistant turn: a conversation must not start with one (put "
                                "a system or user message first)")
            start_text = self.render(rec, messages[:i], True)
            end_text = self.render(rec, messages[:i + 1], False)
            if not (full.startswith(end_text) and end_text.startswith(start_text) and len(start_text) >= pos):
                raise rec.error("%s[%d]" % (field, i), "cannot be located: the chat template does not render the "
                                "conversation up to this message as a prefix of the whole conversation")
            pieces += [(full[pos:len(start_text)], False), (full[len(start_text):len(end_text)], True)]
            pos = len(end_text)
        return pieces + [(full[pos:], False)]

    def tokens(self, pieces, special_first):
        """input_ids and labels of [(text, learned?)]; the first piece gets the special tokens when asked."""
        ids, labels = [], []
        for k, (text, learned) in enumerate(pieces):
            t = self.ids(text, special_first and k == 0)
            ids += t
            labels += t if learned else [IGNORE] * len(t)
        return ids, labels

    def split_response(self, rec, prompt, response, field):
        """(prompt text with the generation prompt, response text) of a conversational prompt and response."""
        prefix = self.render(rec, prompt, True)
        full = self.render(rec, prompt + response, False)
        if not full.startswith(prefix):
            raise rec.error(field, "cannot be located: the chat template does not render the prompt (with its "
                            "generation prompt) as a prefix of prompt + response")
        return prefix, full[len(prefix):]

    def response(self, rec, prompt, response, field):
        """Token ids of a response to a prompt, rendered (conversational) or plain (+ EOS)."""
        if isinstance(prompt, list):
            ids = self.ids(self.split_response(rec, prompt, response, field)[1], False)
        else:
            ids = self.with_eos(self.ids(response, False))
        if not ids:
            raise rec.error(field, "has no tokens")
        return ids

    def prompt(self, rec, prompt):
        return (self.ids(self.render(rec, prompt, True), False) if isinstance(prompt, list)
                else self.ids(prompt, True))

    def record(self, rec, fmt):
        """One record of format fmt tokenized."""
        if fmt == "dpo":
            return _dpo(self, rec)
        if fmt == "grpo":
            return _grpo(self, rec)
        ids, labels = _sft(self, rec, fmt)
        return {"input_ids": ids, "labels": labels}


def _assistant_turns(rec, messages, field):
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise rec.error(field, "has no assistant turn, so nothing to learn (roles: %s)" %
                        ", ".join(m["role"] for m in messages))
    return turns


def _sft(tk, rec, fmt):
    """input_ids, labels of one text / prompt_completion / messages record."""
    if fmt == "text":
        ids = tk.with_eos(tk.ids(rec.text(rec.field("text", fmt), "text"), True))
        labels = list(ids)
    elif fmt == "messages":
        msgs = rec.messages(rec.field("messages", fmt), "messages")
        ids, labels = tk.tokens(tk.chat_pieces(rec, msgs, "messages", _assistant_turns(rec, msgs, "messages")), False)
    else:
        prompt, chat = rec.text_or_messages(rec.field("prompt", fmt), "prompt")
        completion, _ = rec.text_or_messages(rec.field("completion", fmt), "completion", chat)
        if chat:
            prefix, response = tk.split_response(rec, prompt, completion, "completion")
            ids, labels = tk.tokens([(prefix, False), (response, True)], False)
        else:
            p = tk.ids(prompt, True)
            c = tk.with_eos(tk.ids(completion, False))
            ids, labels = p + c, [IGNORE] * len(p) + c
    if len(ids) < 2 or all(l == IGNORE for l in labels[1:]):
        raise InvalidArgumentError("%s: the record has %d token(s) and nothing to learn after the first token" %
                                   (rec.where, len(ids)))
    return ids, labels


def _dpo(tk, rec):
    fmt = "dpo"
    prompt, chat = rec.text_or_messages(rec.field("prompt", fmt), "prompt")
    out = {"prompt": tk.prompt(rec, prompt)}
    for key in ("chosen", "rejected"):
        response, _ = rec.text_or_messages(rec.field(key, fmt), key, chat)
        if chat:
            _assistant_turns(rec, response, key)
        out[key] = tk.response(rec, prompt, response, key)
    refs = [rec.obj.get(k) for k in ("ref_chosen_logp", "ref_rejected_logp")]
    if (refs[0] is None) != (refs[1] is None):
        missing = "ref_chosen_logp" if refs[0] is None else "ref_rejected_logp"
        raise rec.error(missing, "is missing while the other reference log-prob is given: give both or neither")
    if refs[0] is not None:
        out["ref_chosen_logp"] = rec.number(refs[0], "ref_chosen_logp")
        out["ref_rejected_logp"] = rec.number(refs[1], "ref_rejected_logp")
    return out


def _grpo(tk, rec):
    fmt = "grpo"
    prompt, chat = rec.text_or_messages(rec.field("prompt", fmt), "prompt")
    completions = rec.field("completions", fmt)
    if not isinstance(completions, (list, tuple)):
        raise rec.error("completions", "must be a list of completions, got %s" % _describe(completions))
    if not completions:
        raise rec.error("completions", "is empty: a group needs at least one completion")
    advantages = rec.field("advantages", fmt)
    if not isinstance(advantages, (list, tuple)):
        raise rec.error("advantages", "must be a list of numbers, got %s" % _describe(advantages))
    if len(advantages) != len(completions):
        raise rec.error("advantages", "has %d entries for %d completions" % (len(advantages), len(completions)))
    out = {"prompt": tk.prompt(rec, prompt), "completions": [],
           "advantages": [rec.number(a, "advantages[%d]" % i) for i, a in enumerate(advantages)]}
    for i, c in enumerate(completions):
        name = "completions[%d]" % i
        c, _ = rec.text_or_messages(c, name, chat)
        if chat:
            _assistant_turns(rec, c, name)
        out["completions"].append(tk.response(rec, prompt, c, name))
    return out


# ---- lengths, packing, the result ----

class Prepared:
    """Prepared records in seqgrad's JSONL form. kind: "sft" ({"input_ids", "labels"}), "dpo" ({"prompt", "chosen",
    "rejected"[, "ref_chosen_logp", "ref_rejected_logp"]}) or "grpo" ({"prompt", "completions", "advantages"}), all
    token ids. stats: records, sequences, truncated, tokens_cut, dropped."""

    def __init__(self, fmt, records, stats):
        self.format, self.kind, self.records, self.stats = fmt, _kind(fmt), records, stats

    def __len__(self):
        return len(self.records)

    def write(self, path):
        """Writes the JSONL file `train --data` reads (--objective=sft/dpo/grpo as kind says) into a new file beside
        it, renamed over it once complete (over the file a symlink names); an existing FIFO or device is refused."""
        _check_output(path)
        target = os.path.realpath(path)
        tmp = None
        try:
            fd, tmp = _new_file_beside(target)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in self.records:
                    f.write(json.dumps(r) + "\n")
            os.replace(tmp, target)
            tmp = None
        except OSError as e:
            raise OSError(e.errno, "%s: cannot write: %s" % (path, e.strerror)) from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)

    def batches(self, batch_size):
        """Batches for a Trainer, in order (the last may be smaller): sft (ids, labels), or (ids, labels,
        doc_lengths) when packed with documents, for step(*batch); dpo a list of pairs for step_dpo(); grpo a list of
        groups for step_grpo()."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError("batch_size must be a positive integer, got %r" % (batch_size,))
        for b in range(0, len(self.records), batch_size):
            chunk = self.records[b:b + batch_size]
            if self.kind == "sft":
                yield sft_batch(chunk)
            elif self.kind == "dpo":
                yield [_trainer_pair(r) for r in chunk]
            else:
                yield [_trainer_group(r) for r in chunk]


def _check_output(path):
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)


def _new_file_beside(path):
    """(fd, name) of a file made for writing next to path, under a name no one else uses (O_EXCL: not through a
    symlink someone left there)."""
    tmp = "%s.%s.tmp" % (path, os.urandom(6).hex())
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp


def response_sequence(prompt, response):
    """(ids, labels) of prompt + response, labelled on the response only."""
    return prompt + response, [IGNORE] * len(prompt) + response


def _kind(fmt):
    """The objective a format trains: sft, dpo or grpo."""
    return fmt if fmt in ("dpo", "grpo") else "sft"


def _trainer_pair(r):
    pair = {k: response_sequence(r["prompt"], r[k]) for k in ("chosen", "rejected")}
    for k in ("ref_chosen_logp", "ref_rejected_logp"):
        if k in r:
            pair[k] = r[k]
    return pair


def _trainer_group(r):
    group = []
    for completion, advantage in zip(r["completions"], r["advantages"]):
        ids, labels = response_sequence(r["prompt"], completion)
        group.append({"ids": ids, "labels": labels, "advantage": advantage})
    return group


def _fit(kind, rec, where, seq_len, overlong, stats, too_long):
    """The record cut to seq_len tokens (or None: dropped); over-long ones are listed in too_long when refusing."""
    if kind == "sft":
        n = len(rec["input_ids"])
    else:
        responses = [rec["chosen"], rec["rejected"]] if kind == "dpo" else rec["completions"]
        n = len(rec["prompt"]) + max(map(len, responses))
    if seq_len is None or n <= seq_len:
        return rec
    if overlong == "refuse":
        too_long.append((where, n))
        return rec
    stats["truncated"] += 1
    if kind == "sft":
        stats["tokens_cut"] += n - seq_len
        ids, labels = rec["input_ids"][:seq_len], rec["labels"][:seq_len]
        if all(l == IGNORE for l in labels[1:]):
            stats["dropped"] += 1
            return None
        return {"input_ids": ids, "labels": labels}
    room = seq_len - len(rec["prompt"])  # for each response
    stats["tokens_cut"] += sum(len(r) - max(0, min(len(r), room)) for r in responses)
    if room < 1:
        stats["dropped"] += 1
        return None
    out = dict(rec)
    if kind == "dpo":
        out["chosen"], out["rejected"] = rec["chosen"][:room], rec["rejected"][:room]
    else:
        out["completions"] = [c[:room] for c in rec["completions"]]
    return out


def sft_batch(records):
    """A Trainer's sft arguments for these records: (ids, labels), and doc_lengths when any is packed documents."""
    batch = ([r["input_ids"] for r in records], [r["labels"] for r in records])
    if any("doc_lengths" in r for r in records):
        batch += ([r.get("doc_lengths") for r in records],)
    return batch


def _pack(records, seq_len, documents):
    """Whole records concatenated in order into sequences of <= seq_len tokens; each document's first label -100;
    documents: with each sequence's doc_lengths."""
    packed = []
    for r in records:
        if not packed or len(packed[-1]["input_ids"]) + len(r["input_ids"]) > seq_len:
            packed.append({"input_ids": [], "labels": []})
            if documents:
                packed[-1]["doc_lengths"] = []
        p = packed[-1]
        p["input_ids"].extend(r["input_ids"])
        p["labels"].append(IGNORE)
        p["labels"].extend(r["labels"][1:])
        if documents:
            p["doc_lengths"].append(len(r["input_ids"]))
    return packed


def prepare(source, tokenizer, format="auto", seq_len=None, pack=False, overlong="refuse", name="dataset",
            max_line_bytes=MAX_LINE_BYTES, cross_document=False):
    """Tokenizes a dataset into a Prepared. source: a JSONL path (a regular file, read as train --data reads JSONL),
    a directory saved by datasets' save_to_disk, a `datasets` Dataset or any sequence of dicts (errors name records
    as file:line or name[index]); tokenizer: a transformers tokenizer (load_tokenizer); format: "auto" (from the
    first record's fields) or one of FORMATS; seq_len: max tokens per sequence (None: no limit); pack: concatenate
    SFT records up to seq_len, each sequence with its doc_lengths (cross_document=True: without, attending across
    documents); overlong: "refuse" or "truncate" records longer than seq_len; max_line_bytes: the longest JSONL line
    read."""
    if format != "auto" and format not in FORMATS:
        raise InvalidArgumentError("format must be 'auto' or one of %s, got %r" % (", ".join(FORMATS), format))
    if overlong not in ("refuse", "truncate"):
        raise InvalidArgumentError("overlong must be 'refuse' or 'truncate', got %r" % (overlong,))
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2):
        raise InvalidArgumentError("seq_len must be an integer >= 2 or None, got %r" % (seq_len,))
    if pack and seq_len is None:
        raise InvalidArgumentError("pack needs seq_len (the length of the packed sequences)")
    if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or max_line_bytes < 1:
        raise InvalidArgumentError("max_line_bytes must be a positive integer, got %r" % (max_line_bytes,))
    if not callable(tokenizer) or not hasattr(tokenizer, "eos_token_id"):
        raise InvalidArgumentError("tokenizer must be a Hugging Face transformers tokenizer (data.load_tokenizer), "
                                   "got %s" % type(tokenizer).__name__)
    return _convert(source, name, max_line_bytes, format, _detect_or_refuse, _Tokenize(tokenizer).record, seq_len,
                    pack, overlong, not cross_document)


def _detect_or_refuse(where, obj):
    fmt = detect_format(obj)
    if fmt is None:
        raise InvalidArgumentError(
            "%s: cannot tell the format from the fields (%s): expected 'text', 'prompt' + 'completion', "
            "'messages', 'prompt' + 'chosen' + 'rejected' (dpo) or 'prompt' + 'completions' (grpo)" %
            (where, ", ".join(map(repr, obj)) or "none"))
    return fmt


def _convert(source, name, max_line_bytes, format, detect, record, seq_len, pack, overlong, documents=True):
    """prepare()'s reading, cutting and packing around a converter: record(_Record, format) gives one record's
    output (sft {"input_ids", "labels"}, dpo, grpo); detect(where, obj) the format when it is "auto". Also what
    seqgrad.fit reads already tokenized records with."""
    stats = {"records": 0, "sequences": 0, "truncated": 0, "tokens_cut": 0, "dropped": 0}
    records, too_long = [], []
    for where, obj in _records(source, name, max_line_bytes):
        if not isinstance(obj, dict):
            raise InvalidArgumentError("%s: expected a JSON object (a record), got %s" % (where, _describe(obj)))
        if format == "auto":
            format = detect(where, obj)
        if pack and format in ("dpo", "grpo"):
            raise InvalidArgumentError("pack applies to text, prompt_completion and messages, not %s" % format)
        out = record(_Record(where, obj), format)
        stats["records"] += 1
        out = _fit(_kind(format), out, where, seq_len, overlong, stats, too_long)
        if out is not None:
            records.append(out)
    if not stats["records"]:
        raise InvalidArgumentError("%s: no records" % (os.fspath(source) if isinstance(source, (str, os.PathLike))
                                                       else name))
    if too_long:
        listed = ", ".join("%s (%d tokens)" % w for w in too_long[:5]) + (", ..." if len(too_long) > 5 else "")
        raise InvalidArgumentError("%d of %d records are longer than seq_len %d tokens: %s; truncate them with "
                                   "overlong='truncate' (--overlong=truncate) or raise seq_len" %
                                   (len(too_long), stats["records"], seq_len, listed))
    if pack:
        records = _pack(records, seq_len, documents)
    stats["sequences"] = len(records)
    return Prepared(format, records, stats)


def summary(prepared, seq_len, pack):
    s = prepared.stats
    unit = {"sft": "sequences", "dpo": "pairs", "grpo": "groups"}[prepared.kind]
    return ("%d %s records -> %d %s%s; %d truncated (%d tokens cut), %d dropped" % (
        s["records"], prepared.format, s["sequences"], unit,
        " packed to <= %d tokens" % seq_len if pack else "", s["truncated"], s["tokens_cut"], s["dropped"]))


def _check_command_files(input_path, output_path):
    """The command's input and output, checked before any work."""
    if not os.path.isdir(input_path):
        _open_regular(input_path).close()
    _check_output(output_path)
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise InvalidArgumentError("--output %s is the --input file %s: it would be overwritten; write elsewhere" %
                                   (output_path, input_path))
    directory = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(directory):
        raise InvalidArgumentError("%s: cannot write: no directory %s" % (output_path, directory))


def _positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("must be a positive integer, got %r" % text)
    return int(text)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m seqgrad.data",
        description="Tokenizes text, prompt/completion, chat, DPO or GRPO records (JSONL or a saved `datasets` "
                    "directory) with a Hugging Face tokenizer into the JSONL that seqgrad's train --data reads.")
    p.add_argument("--tokenizer", required=True, help="model or tokenizer directory (transformers.AutoTokenizer)")
    p.add_argument("--input", required=True, help="JSONL file, one record per line, or a save_to_disk directory")
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--format", default="auto", choices=("auto",) + FORMATS,
                   help="input format (auto: from the first record's fields)")
    p.add_argument("--seq_len", type=int, default=None, help="max tokens per sequence (default: no limit)")
    p.add_argument("--pack", action="store_true",
                   help="concatenate SFT records into sequences of <= seq_len, each with its doc_lengths: every record "
                        "trains as if alone")
    p.add_argument("--pack_cross_document", action="store_true",
                   help="with --pack: write no doc_lengths, so a record also attends to the earlier records of its "
                        "sequence (the packing before 0.8)")
    p.add_argument("--overlong", default="refuse", choices=("refuse", "truncate"),
                   help="records longer than --seq_len: refuse (error listing them) or truncate (cut the end)")
    p.add_argument("--max_line_bytes", type=_positive, default=MAX_LINE_BYTES,
                   help="longest --input line read, in bytes; a longer one is refused (default 64 MiB, as train's). "
                        "Tokenizing a long text can take 100 times its size in memory: lower this to bound it")
    args = p.parse_args(argv)
    try:
        _check_command_files(args.input, args.output)
        if args.pack_cross_document and not args.pack:
            raise InvalidArgumentError("--pack_cross_document needs --pack")
        prepared = prepare(args.input, load_tokenizer(args.tokenizer), args.format, args.seq_len, args.pack,
                           args.overlong, max_line_bytes=args.max_line_bytes, cross_document=args.pack_cross_document)
        prepared.write(args.output)
    except (InvalidArgumentError, ImportError, OSError) as e:
        print("seqgrad.data: error: %s" % e, file=sys.stderr)
        return 1
    print("%s: %s; wrote %s (train --objective=%s)" % (args.input, summary(prepared, args.seq_len, args.pack),
                                                        args.output, prepared.kind), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
