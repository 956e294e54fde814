"""A GGUF's tokenizer metadata -> HF ``tokenizer.json`` + ``tokenizer_config.json``.

A GGUF carries no tokenizer.json: llama.cpp keeps the vocabulary, merges, token
types and special ids as ``tokenizer.ggml.*`` metadata and picks its splitting
regex from the ``tokenizer.ggml.pre`` name. This module rebuilds the equivalent
``tokenizers`` pipeline: byte-level BPE (``tokenizer.ggml.model == "gpt2"``), and a
SentencePiece BPE with byte fallback (``"llama"``, the merges rebuilt from the
vocabulary as transformers' GGUF loader does) for the architectures whose family
declares one (``formats.gguf_spec.SentencePieceStyle``); other vocabularies are
refused with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from formats.errors import CortiqError
from formats.gguf_spec import SentencePieceStyle

# llama.cpp token types (llama_token_type): 3 = control, 4 = user-defined.
CONTROL, USER_DEFINED = 3, 4

# How llama.cpp splits text before BPE, by ``tokenizer.ggml.pre`` (llama-vocab.cpp): each
# regex in turn cuts every piece so far into matches and the text between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # look a whole piece up in the vocabulary before merging
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key
    clean_spaces: bool = True  # llama.cpp's detokenizer cleanup == HF clean_up_tokenization_spaces


_FAMILIES: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), PreTokenizer((_GPT2,))),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b"), PreTokenizer((r"\p{N}", _GPT2))),
    (("smollm", "command-r"), PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False)),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan"), PreTokenizer((_QWEN2,), clean_spaces=False)),
    (("megrez", "stablelm2"), PreTokenizer((_QWEN2,))),
    (("deepseek-v3",), PreTokenizer(_DEEPSEEK3, clean_spaces=False)),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _FAMILIES for name in names}


@dataclass
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    vocab_size: int
    merges: int
    special_tokens: int
    pre: str
    warnings: list[str] = field(default_factory=list)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes spell themselves, the
    other 68 are moved to U+0100 onwards, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    moved = [b for b in range(256) if b not in table]
    for n, b in enumerate(moved):
        table[b] = chr(256 + n)
    return dict(sorted(table.items()))


def build_tokenizer(meta: dict[str, Any], n_embd_rows: int, spm: SentencePieceStyle | None = None) -> TokenizerFiles:
    """The tokenizer files for the ``tokenizer.*`` entries of ``meta`` (a GGUF's metadata);
    ``spm``: how the architecture's SentencePiece vocabulary is rebuilt (None: it has none)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise CortiqError("GGUF has no tokenizer (tokenizer.ggml.model is missing)")
    if kind == "llama" and spm is not None:
        return _build_sentencepiece(meta, n_embd_rows, spm)
    if kind != "gpt2":
        raise CortiqError(
            f"tokenizer model {str(kind)[:40]!r} is not supported for this architecture "
            f"(supported: gpt2, i.e. byte-level BPE{'; llama, i.e. SentencePiece' if spm else ''})"
        )
    return _build_byte_level(meta, n_embd_rows)


def _build_byte_level(meta: dict[str, Any], n_embd_rows: int) -> TokenizerFiles:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens, types = _token_list(meta, n_embd_rows)
    pre_name = meta.get("tokenizer.ggml.pre")
    warnings: list[str] = []
    if not pre_name:
        warnings.append("GGUF names no tokenizer.ggml.pre; using llama.cpp's 'default' splitting as llama.cpp does")
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(str(pre_name))
    if pre is None:
        raise CortiqError(
            f"tokenizer.ggml.pre {pre_name!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )

    merges = _merges(meta.get("tokenizer.ggml.merges") or [])
    tok = Tokenizer(models.BPE(vocab=_vocab(tokens, types), merges=merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = _pre_tokenizer(pre.regexes)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(text, special=(typ == CONTROL), normalized=False)
        for text, typ in zip(tokens, types)
        if typ in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CortiqError("GGUF tokenizer: control/user-defined tokens did not keep their own ids")

    ids = _SpecialIds.read(meta, len(tokens))
    # End-of-turn / end-of-message ids also stop generation (llama-3 style chat models).
    eos_ids = ids.stops(*(_SpecialIds.get(meta, k, len(tokens)) for k in ("eot_token_id", "eom_token_id")))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tokens, ids.bos if add_bos else None, ids.eos if add_eos else None)
    tcfg = ids.config(tokens, "PreTrainedTokenizerFast", add_bos, add_eos, pre.clean_spaces)
    template = meta.get("tokenizer.chat_template")
    if template:
        tcfg["chat_template"] = template
    return ids.files(tok, tcfg, eos_ids, types, len(merges), str(pre_name), warnings)


def _token_list(meta: dict[str, Any], n_embd_rows: int) -> tuple[list[str], list[int]]:
    """The vocabulary and its token types, checked against each other and the embedding."""
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens:
        raise CortiqError("GGUF tokenizer has no tokens")
    if len(types) != len(tokens):
        raise CortiqError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    if len(tokens) > n_embd_rows:
        raise CortiqError(f"GGUF tokenizer has {len(tokens)} tokens, more than the {n_embd_rows} embedding rows")
    return tokens, types


@dataclass(frozen=True)
class _SpecialIds:
    """The special token ids a GGUF names, each checked against the vocabulary."""

    bos: int | None
    eos: int | None
    pad: int | None
    unk: int | None

    @staticmethod
    def get(meta: dict[str, Any], key: str, vocab_size: int) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not 0 <= int(v) < vocab_size:
            raise CortiqError(f"GGUF tokenizer.ggml.{key} = {v} is outside the vocabulary of {vocab_size}")
        return int(v)

    @classmethod
    def read(cls, meta: dict[str, Any], vocab_size: int) -> "_SpecialIds":
        keys = ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
        return cls(*(cls.get(meta, k, vocab_size) for k in keys))

    def stops(self, *more: int | None) -> list[int]:
        """The ids that end generation: eos, then ``more``, each once."""
        return list(dict.fromkeys(i for i in (self.eos, *more) if i is not None))

    def config(self, tokens: list[str], cls: str, add_bos: bool, add_eos: bool, clean: bool) -> dict[str, Any]:
        """tokenizer_config.json's class, special tokens and flags."""

        def text(i: int | None) -> str | None:
            return tokens[i] if i is not None else None

        return {
            "tokenizer_class": cls,
            "bos_token": text(self.bos),
            "eos_token": text(self.eos),
            "unk_token": text(self.unk),
            "pad_token": text(self.pad),
            "add_bos_token": add_bos,
            "add_eos_token": add_eos,
            "clean_up_tokenization_spaces": clean,
        }

    def files(
        self,
        tok,
        tcfg: dict[str, Any],
        eos_ids: list[int],
        types: list[int],
        merges: int,
        pre: str,
        warnings: list[str],
    ) -> TokenizerFiles:
        """The files of ``tok``, whose vocabulary has these token ``types`` (its control
        tokens are the special ones)."""
        return TokenizerFiles(
            tokenizer_json=tok.to_str(pretty=False),
            tokenizer_config=tcfg,
            bos_token_id=self.bos,
            eos_token_ids=eos_ids,
            pad_token_id=self.pad,
            vocab_size=len(types),
            merges=merges,
            special_tokens=types.count(CONTROL),
            pre=pre,
            warnings=warnings,
        )


def _vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Normal tokens spelled in the byte alphabet (a few files store raw text); control
    and user-defined tokens keep their text, so the added tokens land on their ids."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (text, typ) in enumerate(zip(tokens, types)):
        if typ not in (CONTROL, USER_DEFINED) and not set(text) <= letters:
            text = "".join(alphabet[b] for b in text.encode("utf-8"))
        if text in vocab:
            raise CortiqError(f"GGUF tokenizer lists token {text!r} twice (ids {vocab[text]} and {i})")
        vocab[text] = i
    return vocab


def _merges(lines: list[str]) -> list[tuple[str, str]]:
    out = []
    for m in lines:
        parts = m.split(" ")
        if len(parts) != 2:
            raise CortiqError(f"GGUF tokenizer merge {m!r} is not two tokens separated by a space")
        out.append((parts[0], parts[1]))
    return out


def _pre_tokenizer(regexes: tuple[str, ...]):
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


def _post_processor(tokens: list[str], bos: int | None, eos: int | None):
    """ByteLevel offsets, plus BOS/EOS around each sequence when the GGUF asks for them."""
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None and eos is None:
        return byte_level
    ends = [(i, tokens[i]) for i in (bos, eos) if i is not None]

    def seq(piece: str, type_id: int) -> list[str]:
        out = [f"{tokens[bos]}:{type_id}"] if bos is not None else []
        out.append(f"{piece}:{type_id}")
        return out + ([f"{tokens[eos]}:{type_id}"] if eos is not None else [])

    template = processors.TemplateProcessing(
        single=seq("$A", 0),
        pair=seq("$A", 0) + seq("$B", 1),
        special_tokens=list({t: i for i, t in ends}.items()),
    )
    return processors.Sequence([byte_level, template])


# ------------------------------------------------------------------ SentencePiece


def _spm_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece BPE vocabulary: every split of a token
    into two tokens, best-first by the token's position in the file (the scores
    follow that order too), ties by the shorter left piece; as transformers'
    ``generate_merges`` with the positions as scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[int, int, int, str, str]] = []
    for i, tok in enumerate(tokens):
        local = []
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        merges.extend((i, len(left), len(right), left, right) for _, _, left, right in local)
    # transformers sorts by (-position, len(left), len(right)) descending, stably.
    merges.sort(key=lambda m: (m[0], -m[1], -m[2]))
    return [(m[3], m[4]) for m in merges]


def _build_sentencepiece(meta: dict[str, Any], n_embd_rows: int, spm: SentencePieceStyle) -> TokenizerFiles:
    """A SentencePiece BPE with byte fallback over "\u2581"-for-space text, no prefix space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, types = _token_list(meta, n_embd_rows)
    # The file spells tokens of 2+ spaces with real spaces; the model's text has "\u2581"s.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise CortiqError(f"GGUF tokenizer lists token {t!r} twice (ids {vocab[t]} and {i})")
        vocab[t] = i

    ids = _SpecialIds.read(meta, len(tokens))
    unk_text = tokens[ids.unk] if ids.unk is not None else "<unk>"
    merges = _spm_merges(tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    # User-defined tokens match whole, longest first, before BPE (SentencePiece's and
    # llama.cpp's rule). The whitespace runs among them are spelled with "\u2581"s,
    # so they match the normalized text (a run of 54 spaces is 31 + 23, not 16 + 16 + 22).
    user = [
        AddedToken(t, special=False, normalized=bool(t) and set(t) == {"\u2581"})
        for t, ty in zip(tokens, types)
        if ty == USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CortiqError("GGUF tokenizer: control/user-defined tokens did not keep their own ids")

    warnings: list[str] = []
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's SentencePiece default
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    eog = [vocab[t] for t in spm.eog_texts if t in vocab]
    eos_ids = ids.stops(_SpecialIds.get(meta, "eot_token_id", len(tokens)), *eog)
    template = meta.get("tokenizer.chat_template")
    if not template and spm.chat_template:
        template = spm.chat_template
        warnings.append("GGUF has no tokenizer.chat_template; using the architecture's own chat template")

    tcfg = ids.config(tokens, spm.tokenizer_class, add_bos, add_eos, False)
    tcfg["chat_template"] = template
    return ids.files(tok, tcfg, eos_ids, types, len(merges), "sentencepiece", warnings)
