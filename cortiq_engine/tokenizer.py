"""Text <-> token ids with the tokenizer.json embedded in a CMF file, the chat
template of the header, and an incremental decoder for streaming.

BOS follows the header (``add_bos_token`` and ``bos_token_id``), not the
tokenizer.json post-processor: ``encode`` tokenizes without special tokens and
prepends BOS itself, so one rule holds for every model.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

from formats.errors import CortiqError
from formats.tokenizer_check import check_tokenizer_json, library_error

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate (what Python makes of bytes that are not UTF-8 in
    argv, or a JSON escape such as \\ud800) replaced by U+FFFD: the tokenizers library
    takes only text that encodes as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub(REPLACEMENT, text)
    return text


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def header_eos_ids(header: dict[str, Any]) -> list[int]:
    """``tokenizer.eos_token_ids`` of a CMF header, checked (the header is untrusted)."""
    eos = header.get("eos_token_ids") or []
    if not isinstance(eos, list) or not all(_is_id(e) for e in eos):
        raise CortiqError(f"header tokenizer.eos_token_ids is {str(eos)[:60]}, expected a list of token ids")
    return list(eos)


TEMPLATE_SECONDS = 2.0
TEMPLATE_MIN_OUTPUT = 1 << 20  # characters
TEMPLATE_MAX_ITEMS = 1_000_000  # range() items over a whole render
TEMPLATE_MAX_SEQUENCE = 1 << 20  # the longest string or list `*` may build


@dataclass
class TemplateLimits:
    seconds: float = TEMPLATE_SECONDS
    max_output: int = TEMPLATE_MIN_OUTPUT
    max_items: int = TEMPLATE_MAX_ITEMS


def render_template(source: str, limits: TemplateLimits, **context: Any) -> str:
    """Render a jinja2 chat template in a sandbox bounded in time, loop items and output."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    deadline = time.monotonic() + limits.seconds
    items = [0]

    def check_time() -> None:
        if time.monotonic() > deadline:
            raise CortiqError(f"rendering took longer than {limits.seconds:g} s (a runaway loop?)")

    def counted_range(*args: int) -> Any:
        for i in range(*args):
            items[0] += 1
            if items[0] > limits.max_items:
                raise CortiqError(f"loops ran over {limits.max_items} range() items")
            if not items[0] & 1023:
                check_time()
            yield i

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise CortiqError("an exponent over 64")
            if operator == "*":
                seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_SEQUENCE:
                    raise CortiqError(f"a repeated string or list longer than {TEMPLATE_MAX_SEQUENCE}")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > limits.max_output:
                    raise CortiqError(f"a string or list longer than {limits.max_output}")
            return super().call_binop(context, operator, left, right)

        def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            check_time()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            check_time()
            return super().getattr(obj, attribute)

    def raise_exception(message: str) -> None:
        raise CortiqError(f"raised: {str(message)[:200]}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["range"] = counted_range
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CortiqError(f"syntax error line {e.lineno}: {e.message}") from None
    out: list[str] = []
    size = 0
    for chunk in template.generate(**context):
        size += len(chunk)
        if size > limits.max_output:
            raise CortiqError(f"output over {limits.max_output} characters")
        check_time()
        out.append(chunk)
    return "".join(out)


class Tokenizer:
    def __init__(self, tokenizer_json: bytes, header: dict[str, Any], name: str = "the model"):
        from tokenizers import Tokenizer as HFTokenizer

        what = f"embedded tokenizer.json of {name}"
        text = tokenizer_json.decode("utf-8", errors="replace")
        check_tokenizer_json(text, what, header.get("vocab_size"))
        try:
            self._tok = HFTokenizer.from_str(text)
            # cortiq sizes its own inputs: a file's padding or truncation never applies.
            self._tok.no_padding()
            self._tok.no_truncation()
        except BaseException as e:  # a Rust panic is a BaseException
            if not library_error(e):
                raise
            raise CortiqError(f"{what} does not load ({_first_line(e)})") from None
        self.header = header
        self.template_name = f"chat template of {name}"
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

    def _library(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A call into the tokenizers library; whatever it raises (a Rust panic included)
        is one CortiqError."""
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            if not library_error(e):
                raise
            raise CortiqError(f"the tokenizer failed to {what} ({_first_line(e)})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise CortiqError(f"text to tokenize is {type(text).__name__}, expected a string")
        ids = self._library("encode", self._tok.encode, clean_text(text), add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [int(self.bos_id)] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._library("decode", self._tok.decode, [int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._library("look up a token", self._tok.id_to_token, int(i))

    def special_ids(self) -> list[int]:
        """Ids of the added tokens marked special (chat markers, EOS, padding), ascending."""
        return sorted(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    # ---------------------------------------------------------------- chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render the header's chat template as transformers does (sandboxed jinja2).

        The template is untrusted code: it runs in jinja2's sandbox with a time limit
        (TEMPLATE_SECONDS), a bound on loop iterations and repeated strings, and a bound
        on its output; any failure is one CortiqError naming the template.
        """
        if not self.chat_template:
            raise CortiqError("this model has no chat template (header tokenizer.chat_template is empty)")
        prompt_chars = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        limits = TemplateLimits(max_output=max(TEMPLATE_MIN_OUTPUT, 4 * prompt_chars + TEMPLATE_MIN_OUTPUT))
        try:
            return render_template(
                self.chat_template,
                limits,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.header.get("bos_token"), self.bos_id),
                eos_token=self._special_text(self.header.get("eos_token"), self.eos_ids[0] if self.eos_ids else None),
                tools=None,
                documents=None,
            )
        except CortiqError as e:
            raise CortiqError(f"{self.template_name}: {e}") from None
        except Exception as e:  # the template is untrusted code: whatever it raises is bad input
            detail = str(e).splitlines()[0][:200] if str(e) else ""
            raise CortiqError(f"{self.template_name} failed: {type(e).__name__}: {detail}") from None

    def _special_text(self, text: str | None, tid: int | None) -> str:
        if text:
            return text
        if tid is not None:
            return self._tok.id_to_token(int(tid)) or ""
        return ""


def _first_line(e: BaseException) -> str:
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


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
