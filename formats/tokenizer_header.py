"""The ``tokenizer`` section of a CMF header, read from an HF checkpoint's files.

tokenizer.json itself is embedded verbatim as the u8 tensor TOKENIZER_TENSOR; the
header keeps what a runtime needs without parsing it: special ids, the chat
template, and a summary for ``cortiq inspect``.
"""

from __future__ import annotations

from typing import Any

from formats.errors import CortiqError
from formats.untrusted_json import load_object

TOKENIZER_TENSOR = "__tokenizer__/tokenizer.json"


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def _check_loads(tok_json: str, where: Any) -> None:
    """Refuse a tokenizer.json the tokenizers library cannot load now, not at first use:
    its structure is checked first (``formats.tokenizer_check``), then the library loads it."""
    from tokenizers import Tokenizer

    from formats.tokenizer_check import check_tokenizer_json, library_error

    try:
        check_tokenizer_json(tok_json, "tokenizer.json")
    except CortiqError as e:
        detail = str(e).removeprefix("tokenizer.json: ")
        raise CortiqError(f"{where}: the tokenizers library cannot load it safely ({detail})") from None
    try:
        Tokenizer.from_str(tok_json)
    except BaseException as e:  # the library raises plain Exceptions, and a Rust panic as a BaseException
        if not library_error(e):
            raise
        lines = str(e).splitlines()
        raise CortiqError(
            f"{where}: the tokenizers library cannot load it ({lines[0][:160] if lines else type(e).__name__})"
        ) from None


def tokenizer_header(ck) -> tuple[dict[str, Any], bytes]:
    """(header section, tokenizer.json bytes) for an ``HFCheckpoint``."""
    tok_json = ck.read_text("tokenizer.json")
    if tok_json is None:
        raise CortiqError(f"{ck.root}: missing tokenizer.json (cortiq embeds the tokenizer in the CMF file)")
    tok = load_object(tok_json, str(ck.root / "tokenizer.json"))
    tcfg = ck.read_json("tokenizer_config.json") or {}
    special = ck.read_json("special_tokens_map.json") or {}
    gen = ck.read_json("generation_config.json") or {}
    _check_loads(tok_json, ck.root / "tokenizer.json")
    added_list = tok.get("added_tokens")
    added = {
        t["content"]: t["id"]
        for t in (added_list if isinstance(added_list, list) else [])
        if isinstance(t, dict) and isinstance(t.get("content"), str) and _is_id(t.get("id"))
    }
    model = tok.get("model") if isinstance(tok.get("model"), dict) else {}
    vocab = model.get("vocab") or {}

    def tid(tok_text: str | None) -> int | None:
        if tok_text is None:
            return None
        if tok_text in added:
            return added[tok_text]
        return vocab.get(tok_text) if isinstance(vocab, dict) else None

    bos_text = _token_text(tcfg.get("bos_token")) or _token_text(special.get("bos_token"))
    eos_text = _token_text(tcfg.get("eos_token")) or _token_text(special.get("eos_token"))
    eos: list[int] = []
    for src in (gen.get("eos_token_id"), ck.config.get("eos_token_id"), tid(eos_text)):
        for e in src if isinstance(src, list) else [src]:
            if _is_id(e) and e not in eos:
                eos.append(e)
    bos = gen.get("bos_token_id", ck.config.get("bos_token_id"))
    if bos is None:
        bos = tid(bos_text)
    bos = bos if _is_id(bos) else None
    pad = gen.get("pad_token_id", ck.config.get("pad_token_id"))
    chat = tcfg.get("chat_template")
    if chat is None:
        chat = ck.read_text("chat_template.jinja")
    if chat is None:
        cj = ck.read_json("chat_template.json") or {}
        chat = cj.get("chat_template")
    if isinstance(chat, list):  # named templates: keep the default
        named = [c for c in chat if isinstance(c, dict) and isinstance(c.get("template"), str)]
        chat = next(
            (c["template"] for c in named if c.get("name") == "default"), named[0]["template"] if named else None
        )
    if chat is not None and not isinstance(chat, str):
        raise CortiqError(f"{ck.root}: chat_template is {type(chat).__name__}, expected a string")
    n_vocab = len(vocab) if isinstance(vocab, (dict, list)) else 0
    n_vocab += sum(1 for t in added if t not in vocab) if isinstance(vocab, dict) else 0
    header = {
        "tensor": TOKENIZER_TENSOR,
        "model": model.get("type"),
        "vocab_size": n_vocab,
        "bos_token_id": bos,
        "eos_token_ids": eos,
        "pad_token_id": pad if _is_id(pad) else None,
        "add_bos_token": bool(tcfg.get("add_bos_token", False)),
        "chat_template": chat,
        "bos_token": bos_text,
        "eos_token": eos_text,
    }
    return header, tok_json.encode("utf-8")
