"""Validation of a tokenizer.json before the ``tokenizers`` library sees it.

The library is Rust: some malformed files make it panic (a ``PanicException`` that
derives from ``BaseException``, after Rust prints its own message), abort the process
(``padding: {"strategy": {"Fixed": 10**12}}`` allocates at the first encode) or run
user-supplied regexes of any size. Here the file's structure is checked against what
the library reads: the model type and its vocabulary and merges, every normalizer,
pre-tokenizer, decoder and post-processor from a known list with bounded parameters,
and the padding and truncation records. Each failure is one ``CortiqError`` line.
"""

from __future__ import annotations

from typing import Any, Callable

from formats.errors import CortiqError
from formats.untrusted_json import is_int, load_object

MODEL_TYPES = ("BPE", "WordPiece", "Unigram", "WordLevel")
MAX_VOCAB = 1 << 22  # past any real vocabulary (Gemma 3: 262,144)
MAX_ID = (1 << 31) - 1
MAX_TOKEN_CHARS = 1 << 16
MAX_PATTERN = 4096  # a Split/Replace regex or string (Llama 3's split regex: ~200 characters)
MAX_CONTENT = 4096  # replacement, prefix, suffix and delimiter strings
MAX_COUNT = 1 << 16  # Strip counts, fixed lengths, padding multiples
MAX_SEQUENCE = 64  # components in one Sequence
MAX_LENGTH = 1 << 24  # padding and truncation lengths (tokens)


class _Where:
    """A path into the file for messages: ``decoder.decoders[1].pattern``."""

    def __init__(self, what: str):
        self.what = what

    def fail(self, path: str, msg: str) -> CortiqError:
        return CortiqError(f"{self.what}: {path} {msg}")


def _str(w: _Where, path: str, v: Any, limit: int, *, empty: bool = True, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not isinstance(v, str):
        raise w.fail(path, f"is {type(v).__name__}, expected a string")
    if len(v) > limit:
        raise w.fail(path, f"is {len(v)} characters long (limit {limit})")
    if not empty and not v:
        raise w.fail(path, "is empty")


def _bool(w: _Where, path: str, v: Any, optional: bool = True) -> None:
    if v is None and optional:
        return
    if not isinstance(v, bool):
        raise w.fail(path, f"is {str(v)[:20]!r}, expected true or false")


def _int(w: _Where, path: str, v: Any, lo: int, hi: int, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not is_int(v) or not lo <= v <= hi:
        raise w.fail(path, f"is {str(v)[:20]!r}, expected an integer in {lo}..{hi}")


def _pattern(w: _Where, path: str, p: Any) -> None:
    """``{"String": s}`` or ``{"Regex": r}`` (an Oniguruma regex), bounded in length."""
    if not isinstance(p, dict) or len(p) != 1 or next(iter(p)) not in ("String", "Regex"):
        raise w.fail(path, 'is not {"String": ...} or {"Regex": ...}')
    kind, v = next(iter(p.items()))
    _str(w, f"{path}.{kind}", v, MAX_PATTERN, empty=kind == "Regex")


def _check_keys(w: _Where, path: str, obj: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = [k for k in obj if k not in allowed and k != "type"]
    if extra:
        raise w.fail(path, f"has unknown field {extra[0][:40]!r} for type {obj.get('type')!r}")


# Each component checker: (allowed keys, checker of the values).
_Check = Callable[[_Where, str, dict[str, Any]], None]


def _none(w: _Where, path: str, o: dict[str, Any]) -> None:
    pass


def _sequence(kind: str, key: str) -> _Check:
    def check(w: _Where, path: str, o: dict[str, Any]) -> None:
        items = o.get(key)
        if not isinstance(items, list) or len(items) > MAX_SEQUENCE:
            raise w.fail(f"{path}.{key}", f"is not a list of at most {MAX_SEQUENCE} {kind}s")
        for i, item in enumerate(items):
            _component(w, f"{path}.{key}[{i}]", item, kind)

    return check


def _replace(w: _Where, path: str, o: dict[str, Any]) -> None:
    _pattern(w, f"{path}.pattern", o.get("pattern"))
    _str(w, f"{path}.content", o.get("content"), MAX_CONTENT)


def _strip_normalizer(w: _Where, path: str, o: dict[str, Any]) -> None:
    _bool(w, f"{path}.strip_left", o.get("strip_left"))
    _bool(w, f"{path}.strip_right", o.get("strip_right"))


def _prepend(w: _Where, path: str, o: dict[str, Any]) -> None:
    _str(w, f"{path}.prepend", o.get("prepend"), MAX_CONTENT)


def _bert_normalizer(w: _Where, path: str, o: dict[str, Any]) -> None:
    for k in ("clean_text", "handle_chinese_chars", "strip_accents", "lowercase"):
        _bool(w, f"{path}.{k}", o.get(k))


def _byte_level(w: _Where, path: str, o: dict[str, Any]) -> None:
    for k in ("add_prefix_space", "trim_offsets", "use_regex"):
        _bool(w, f"{path}.{k}", o.get(k))


def _split(w: _Where, path: str, o: dict[str, Any]) -> None:
    _pattern(w, f"{path}.pattern", o.get("pattern"))
    if o.get("behavior") not in ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"):
        raise w.fail(f"{path}.behavior", f"is {str(o.get('behavior'))[:30]!r}, not a split behavior")
    _bool(w, f"{path}.invert", o.get("invert"))


def _metaspace(w: _Where, path: str, o: dict[str, Any]) -> None:
    r = o.get("replacement")
    if not isinstance(r, str) or len(r) != 1:
        raise w.fail(f"{path}.replacement", "is not one character")
    _bool(w, f"{path}.add_prefix_space", o.get("add_prefix_space"))
    _bool(w, f"{path}.split", o.get("split"))
    if o.get("prepend_scheme", "always") not in ("always", "never", "first"):
        raise w.fail(f"{path}.prepend_scheme", f"is {str(o.get('prepend_scheme'))[:20]!r}")


def _punctuation(w: _Where, path: str, o: dict[str, Any]) -> None:
    if o.get("behavior", "Isolated") not in (
        "Removed",
        "Isolated",
        "MergedWithPrevious",
        "MergedWithNext",
        "Contiguous",
    ):
        raise w.fail(f"{path}.behavior", f"is {str(o.get('behavior'))[:30]!r}, not a split behavior")


def _digits(w: _Where, path: str, o: dict[str, Any]) -> None:
    _bool(w, f"{path}.individual_digits", o.get("individual_digits"))


def _char_delimiter(w: _Where, path: str, o: dict[str, Any]) -> None:
    d = o.get("delimiter")
    if not isinstance(d, str) or len(d) != 1:
        raise w.fail(f"{path}.delimiter", "is not one character")


def _fixed_length(w: _Where, path: str, o: dict[str, Any]) -> None:
    _int(w, f"{path}.length", o.get("length"), 1, MAX_COUNT)


def _wordpiece_decoder(w: _Where, path: str, o: dict[str, Any]) -> None:
    _str(w, f"{path}.prefix", o.get("prefix"), MAX_CONTENT)
    _bool(w, f"{path}.cleanup", o.get("cleanup"))


def _bpe_decoder(w: _Where, path: str, o: dict[str, Any]) -> None:
    _str(w, f"{path}.suffix", o.get("suffix"), MAX_CONTENT)


def _strip_decoder(w: _Where, path: str, o: dict[str, Any]) -> None:
    c = o.get("content")
    if not isinstance(c, str) or len(c) != 1:
        raise w.fail(f"{path}.content", "is not one character")
    _int(w, f"{path}.start", o.get("start"), 0, MAX_COUNT)
    _int(w, f"{path}.stop", o.get("stop"), 0, MAX_COUNT)


def _ctc(w: _Where, path: str, o: dict[str, Any]) -> None:
    _str(w, f"{path}.pad_token", o.get("pad_token"), MAX_CONTENT)
    _str(w, f"{path}.word_delimiter_token", o.get("word_delimiter_token"), MAX_CONTENT)
    _bool(w, f"{path}.cleanup", o.get("cleanup"))


def _special_pair(w: _Where, path: str, v: Any) -> None:
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not isinstance(v[0], str)
        or not is_int(v[1])
        or not 0 <= v[1] <= MAX_ID
    ):
        raise w.fail(path, "is not [token, id]")
    _str(w, path, v[0], MAX_TOKEN_CHARS)


def _bert_processing(w: _Where, path: str, o: dict[str, Any]) -> None:
    _special_pair(w, f"{path}.sep", o.get("sep"))
    _special_pair(w, f"{path}.cls", o.get("cls"))
    _bool(w, f"{path}.trim_offsets", o.get("trim_offsets"))
    _bool(w, f"{path}.add_prefix_space", o.get("add_prefix_space"))


def _template_processing(w: _Where, path: str, o: dict[str, Any]) -> None:
    specials = o.get("special_tokens")
    if not isinstance(specials, dict) or len(specials) > MAX_VOCAB:
        raise w.fail(f"{path}.special_tokens", "is not an object")
    for name, sp in specials.items():
        where = f"{path}.special_tokens[{name[:40]!r}]"
        if not isinstance(sp, dict) or sp.get("id") != name:
            raise w.fail(where, "is not {id, ids, tokens} with its own name as id")
        ids, toks = sp.get("ids"), sp.get("tokens")
        if (
            not isinstance(ids, list)
            or not isinstance(toks, list)
            or len(ids) != len(toks)
            or len(ids) > MAX_SEQUENCE
            or not all(is_int(i) and 0 <= i <= MAX_ID for i in ids)
            or not all(isinstance(t, str) and len(t) <= MAX_TOKEN_CHARS for t in toks)
        ):
            raise w.fail(where, "needs lists ids (token ids) and tokens (strings) of one length")
    for key in ("single", "pair"):
        seq = o.get(key)
        if not isinstance(seq, list) or len(seq) > MAX_SEQUENCE:
            raise w.fail(f"{path}.{key}", f"is not a list of at most {MAX_SEQUENCE} pieces")
        for i, piece in enumerate(seq):
            where = f"{path}.{key}[{i}]"
            if not isinstance(piece, dict) or len(piece) != 1 or next(iter(piece)) not in ("Sequence", "SpecialToken"):
                raise w.fail(where, 'is not {"Sequence": ...} or {"SpecialToken": ...}')
            kind, body = next(iter(piece.items()))
            if not isinstance(body, dict):
                raise w.fail(where, "is not an object")
            _int(w, f"{where}.type_id", body.get("type_id"), 0, 1 << 16)
            if kind == "Sequence":
                if body.get("id") not in ("A", "B"):
                    raise w.fail(f"{where}.id", "is not A or B")
            elif (
                not isinstance(body.get("id"), str) or body["id"] not in specials
            ):  # the library panics on a name it cannot find
                raise w.fail(f"{where}.id", f"names {str(body.get('id'))[:40]!r}, which special_tokens lacks")


_NORMALIZERS: dict[str, tuple[tuple[str, ...], _Check]] = {
    "NFC": ((), _none),
    "NFD": ((), _none),
    "NFKC": ((), _none),
    "NFKD": ((), _none),
    "Lowercase": ((), _none),
    "StripAccents": ((), _none),
    "Nmt": ((), _none),
    "Strip": (("strip_left", "strip_right"), _strip_normalizer),
    "Replace": (("pattern", "content"), _replace),
    "Prepend": (("prepend",), _prepend),
    "BertNormalizer": (("clean_text", "handle_chinese_chars", "strip_accents", "lowercase"), _bert_normalizer),
    "ByteLevel": ((), _none),
    "Sequence": (("normalizers",), _sequence("normalizer", "normalizers")),
}
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], _Check]] = {
    "ByteLevel": (("add_prefix_space", "trim_offsets", "use_regex"), _byte_level),
    "Whitespace": ((), _none),
    "WhitespaceSplit": ((), _none),
    "BertPreTokenizer": ((), _none),
    "UnicodeScripts": ((), _none),
    "Split": (("pattern", "behavior", "invert"), _split),
    "Metaspace": (("replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"), _metaspace),
    "Punctuation": (("behavior",), _punctuation),
    "Digits": (("individual_digits",), _digits),
    "CharDelimiterSplit": (("delimiter",), _char_delimiter),
    "FixedLength": (("length",), _fixed_length),
    "Sequence": (("pretokenizers",), _sequence("pre_tokenizer", "pretokenizers")),
}
_DECODERS: dict[str, tuple[tuple[str, ...], _Check]] = {
    "ByteLevel": (("add_prefix_space", "trim_offsets", "use_regex"), _byte_level),
    "ByteFallback": ((), _none),
    "Fuse": ((), _none),
    "Metaspace": (("replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"), _metaspace),
    "WordPiece": (("prefix", "cleanup"), _wordpiece_decoder),
    "BPEDecoder": (("suffix",), _bpe_decoder),
    "Strip": (("content", "start", "stop"), _strip_decoder),
    "Replace": (("pattern", "content"), _replace),
    "CTC": (("pad_token", "word_delimiter_token", "cleanup"), _ctc),
    "Sequence": (("decoders",), _sequence("decoder", "decoders")),
}
_POST_PROCESSORS: dict[str, tuple[tuple[str, ...], _Check]] = {
    "ByteLevel": (("add_prefix_space", "trim_offsets", "use_regex"), _byte_level),
    "TemplateProcessing": (("single", "pair", "special_tokens"), _template_processing),
    "BertProcessing": (
        ("sep", "cls"),
        lambda w, p, o: (_special_pair(w, f"{p}.sep", o.get("sep")), _special_pair(w, f"{p}.cls", o.get("cls"))),
    ),
    "RobertaProcessing": (("sep", "cls", "trim_offsets", "add_prefix_space"), _bert_processing),
    "Sequence": (("processors",), _sequence("post_processor", "processors")),
}
_KINDS = {
    "normalizer": _NORMALIZERS,
    "pre_tokenizer": _PRE_TOKENIZERS,
    "decoder": _DECODERS,
    "post_processor": _POST_PROCESSORS,
}


def _component(w: _Where, path: str, o: Any, kind: str) -> None:
    if o is None and path == kind:
        return
    table = _KINDS[kind]
    if not isinstance(o, dict):
        raise w.fail(path, f"is {type(o).__name__}, expected a {kind} object")
    t = o.get("type")
    if not isinstance(t, str) or t not in table:  # a list or an object cannot be looked up
        raise w.fail(f"{path}.type", f"is {str(t)[:40]!r}; known {kind}s: {', '.join(table)}")
    allowed, check = table[t]
    _check_keys(w, path, o, allowed)
    check(w, path, o)


def _check_vocab(w: _Where, model: dict[str, Any]) -> dict[str, int]:
    """The model's token -> id map (Unigram's is by position), checked."""
    t = model["type"]
    vocab = model.get("vocab")
    if t == "Unigram":
        if not isinstance(vocab, list) or not 0 < len(vocab) <= MAX_VOCAB:
            raise w.fail("model.vocab", f"is not a list of 1..{MAX_VOCAB} [piece, score] pairs")
        out: dict[str, int] = {}
        for i, e in enumerate(vocab):
            if (
                not isinstance(e, list)
                or len(e) != 2
                or not isinstance(e[0], str)
                or len(e[0]) > MAX_TOKEN_CHARS
                or not isinstance(e[1], (int, float))
                or isinstance(e[1], bool)
            ):
                raise w.fail(f"model.vocab[{i}]", "is not [piece, score]")
            out.setdefault(e[0], i)
        _int(w, "model.unk_id", model.get("unk_id"), 0, len(vocab) - 1, optional=True)
        return out
    if not isinstance(vocab, dict) or not 0 < len(vocab) <= MAX_VOCAB:
        raise w.fail("model.vocab", f"is not an object of 1..{MAX_VOCAB} tokens")
    for tok, i in vocab.items():
        if not is_int(i) or not 0 <= i <= MAX_ID or len(tok) > MAX_TOKEN_CHARS:
            raise w.fail("model.vocab", f"maps {tok[:40]!r} to {str(i)[:20]!r}, expected a token id")
    unk = model.get("unk_token")
    _str(w, "model.unk_token", unk, MAX_TOKEN_CHARS, optional=t == "BPE")
    if unk is not None and unk not in vocab and not model.get("byte_fallback"):
        raise w.fail("model.unk_token", f"{unk[:40]!r} is not in the vocabulary")
    return vocab


def _check_merges(w: _Where, model: dict[str, Any], vocab: dict[str, int]) -> None:
    """Each merge is a pair of vocabulary tokens ("a b" or ["a", "b"]) whose join is one too."""
    merges = model.get("merges")
    if not isinstance(merges, list) or len(merges) > 4 * MAX_VOCAB:
        raise w.fail("model.merges", "is not a list")
    prefix = model.get("continuing_subword_prefix") or ""
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    for i, m in enumerate(pairs):  # the common case passes this line alone
        if (
            type(m) is list
            and len(m) == 2
            and type(m[0]) is str
            and type(m[1]) is str  # noqa: E721
            and m[0] in vocab
            and m[1] in vocab
            and (m[0] + m[1] in vocab or prefix)
        ):
            continue
        if not isinstance(m, list) or len(m) != 2 or not all(isinstance(x, str) for x in m):
            raise w.fail(f"model.merges[{i}]", "is not a pair of tokens")
        a, b = m
        merged = a + (b[len(prefix) :] if prefix and b.startswith(prefix) else b)
        missing = next((x for x in (a, b, merged) if x not in vocab), None)
        if missing is not None:
            raise w.fail(f"model.merges[{i}]", f"names {missing[:40]!r}, which is not in the vocabulary")


def _check_model(w: _Where, model: Any) -> dict[str, int]:
    if not isinstance(model, dict):
        raise w.fail("model", "is not an object")
    t = model.get("type")
    if t is None and isinstance(model.get("merges"), list):
        t = model["type"] = "BPE"  # files before the library wrote the type
    if t not in MODEL_TYPES:
        raise w.fail("model.type", f"is {str(t)[:40]!r}; known models: {', '.join(MODEL_TYPES)}")
    vocab = _check_vocab(w, model)
    if t == "BPE":
        _check_merges(w, model, vocab)
        d = model.get("dropout")
        if d is not None and (not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= d <= 1.0):
            raise w.fail("model.dropout", f"is {str(d)[:20]!r}, expected null or a number in [0, 1]")
        for k in ("continuing_subword_prefix", "end_of_word_suffix"):
            _str(w, f"model.{k}", model.get(k), MAX_CONTENT, optional=True)
    if t == "WordPiece":
        _str(w, "model.continuing_subword_prefix", model.get("continuing_subword_prefix"), MAX_CONTENT, optional=True)
        _int(w, "model.max_input_chars_per_word", model.get("max_input_chars_per_word"), 0, 1 << 20, optional=True)
    return vocab


def _check_padding(w: _Where, pad: Any) -> None:
    if pad is None:
        return
    if not isinstance(pad, dict):
        raise w.fail("padding", "is not null or an object")
    strategy = pad.get("strategy")
    if isinstance(strategy, dict):
        if list(strategy) != ["Fixed"]:
            raise w.fail("padding.strategy", "is not BatchLongest or {Fixed: n}")
        _int(w, "padding.strategy.Fixed", strategy["Fixed"], 0, MAX_LENGTH)
    elif strategy != "BatchLongest":
        raise w.fail("padding.strategy", "is not BatchLongest or {Fixed: n}")
    _int(w, "padding.pad_to_multiple_of", pad.get("pad_to_multiple_of"), 1, MAX_COUNT, optional=True)
    _int(w, "padding.pad_id", pad.get("pad_id"), 0, MAX_ID)
    _int(w, "padding.pad_type_id", pad.get("pad_type_id"), 0, 1 << 16)
    _str(w, "padding.pad_token", pad.get("pad_token"), MAX_TOKEN_CHARS)


def _check_truncation(w: _Where, tr: Any) -> None:
    if tr is None:
        return
    if not isinstance(tr, dict):
        raise w.fail("truncation", "is not null or an object")
    _int(w, "truncation.max_length", tr.get("max_length"), 0, MAX_LENGTH)
    _int(w, "truncation.stride", tr.get("stride"), 0, MAX_LENGTH)


def _check_added(w: _Where, added: Any) -> list[dict[str, Any]]:
    if added is None:
        return []
    if not isinstance(added, list) or len(added) > MAX_VOCAB:
        raise w.fail("added_tokens", "is not a list")
    for i, t in enumerate(added):
        if not isinstance(t, dict) or not isinstance(t.get("content"), str) or not t["content"]:
            raise w.fail(f"added_tokens[{i}]", "has no content string")
        _str(w, f"added_tokens[{i}].content", t["content"], MAX_TOKEN_CHARS)
        _int(w, f"added_tokens[{i}].id", t.get("id"), 0, MAX_ID)
        for k in ("single_word", "lstrip", "rstrip", "normalized", "special"):
            _bool(w, f"added_tokens[{i}].{k}", t.get(k))
    return added


def vocab_size_of(tok: dict[str, Any]) -> int:
    """Tokens of a checked tokenizer.json: its vocabulary and the added tokens not in it
    (what the tokenizer header's ``vocab_size`` records)."""
    model = tok["model"]
    vocab = model["vocab"]
    if isinstance(vocab, list):  # Unigram: the header counts its pieces alone
        return len(vocab)
    added = {t["content"] for t in tok.get("added_tokens") or []}
    return len(vocab) + sum(1 for t in added if t not in vocab)


def check_tokenizer(tok: dict[str, Any], what: str, vocab_size: Any = None) -> dict[str, Any]:
    """Raise a one-line ``CortiqError`` unless ``tok`` (a parsed tokenizer.json) is one the
    ``tokenizers`` library loads and runs safely; ``vocab_size``: the header's count to
    match. Returns ``tok``."""
    w = _Where(what)
    _check_model(w, tok.get("model"))
    _check_added(w, tok.get("added_tokens"))
    for kind in _KINDS:
        _component(w, kind, tok.get(kind), kind)
    _check_padding(w, tok.get("padding"))
    _check_truncation(w, tok.get("truncation"))
    if vocab_size is not None:
        have = vocab_size_of(tok)
        if not is_int(vocab_size) or vocab_size != have:
            raise CortiqError(f"{what}: {have} tokens, the header says {str(vocab_size)[:20]}")
    return tok


def check_tokenizer_json(raw: bytes | str, what: str, vocab_size: Any = None) -> dict[str, Any]:
    """``check_tokenizer`` on JSON text (parsed with ``formats.untrusted_json``)."""
    return check_tokenizer(load_object(raw, what), what, vocab_size)


def library_error(e: BaseException) -> bool:
    """Whether ``e`` is something the ``tokenizers`` library raised for bad input: a plain
    Exception, or pyo3's ``PanicException`` (a BaseException) from a Rust panic.
    KeyboardInterrupt and SystemExit are not."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"
