"""Text <-> token ids with the tokenizer.json embedded in a CMF file, the chat
template of the header, and an incremental decoder for streaming.

BOS follows the header (``add_bos_token`` and ``bos_token_id``), not the
tokenizer.json post-processor: ``encode`` tokenizes without special tokens and
prepends BOS itself, so one rule holds for every model.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

from formats.errors import CortiqError

REPLACEMENT = "\ufffd"


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def header_eos_ids(header: dict[str, Any]) -> list[int]:
    """``tokenizer.eos_token_ids`` of a CMF header, checked (the header is untrusted)."""
    eos = header.get("eos_token_ids") or []
    if not isinstance(eos, list) or not all(_is_id(e) for e in eos):
        raise CortiqError(f"header tokenizer.eos_token_ids is {str(eos)[:60]}, expected a list of token ids")
    return list(eos)


class Tokenizer:
    def __init__(self, tokenizer_json: bytes, header: dict[str, Any]):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise CortiqError(f"embedded tokenizer.json does not load ({e})") from None
        self.header = header
        self.bos_id: int | None = header.get("bos_token_id")
        self.add_bos: bool = bool(header.get("add_bos_token", False))
        self.eos_ids: list[int] = header_eos_ids(header)
        self.chat_template: str | None = header.get("chat_template")
        if self.bos_id is not None and not _is_id(self.bos_id):
            raise CortiqError(f"header tokenizer.bos_token_id is {str(self.bos_id)[:40]!r}, expected a token id")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise CortiqError("header tokenizer.chat_template is not a string")
        for key in ("bos_token", "eos_token"):
            if header.get(key) is not None and not isinstance(header.get(key), str):
                raise CortiqError(f"header tokenizer.{key} is not a string")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [int(self.bos_id)] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    # ---------------------------------------------------------------- chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render the header's chat template as transformers does (sandboxed jinja2)."""
        if not self.chat_template:
            raise CortiqError("this model has no chat template (header tokenizer.chat_template is empty)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise CortiqError(f"chat template error: {message}")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.header.get("bos_token"), self.bos_id),
                eos_token=self._special_text(self.header.get("eos_token"), self.eos_ids[0] if self.eos_ids else None),
                tools=None,
                documents=None,
            )
        except jinja2.TemplateError as e:
            raise CortiqError(f"chat template error: {e}") from None

    def _special_text(self, text: str | None, tid: int | None) -> str:
        if text:
            return text
        if tid is not None:
            return self._tok.id_to_token(int(tid)) or ""
        return ""


class StreamDecoder:
    """Turns a stream of ids into text pieces whose concatenation is the decoded text.

    A token can end inside a multi-byte UTF-8 character; its decoded text then ends
    in U+FFFD, so the piece is held back until a later token completes it (the
    approach of transformers' TextStreamer and vLLM's incremental detokenizer).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids before this index are fully emitted ...
        self.read = 0  # ... and the text of ids[prefix:read] was emitted too

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        if len(now) > len(done) and not now.endswith(REPLACEMENT):
            piece = now[len(done) :]
            self.prefix = self.read
            self.read = len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        done = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(done) :]
