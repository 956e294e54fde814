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
from typing import Any, Callable, Sequence

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
TEMPLATE_MAX_SOURCE = 1 << 20  # characters of template source (real chat templates: < 64 KiB)
TEMPLATE_MAX_INT_BITS = 4096  # integers `*` and `**` may build
TEMPLATE_MAX_LOOP = 1_000_000  # for-loop iterations over a whole render
TEMPLATE_MEMORY = 1 << 30  # bytes of address space a render may add
# Filters that run a regex or a wrapping loop over their input: bounded input length.
_TEXT_FILTERS = ("striptags", "urlize", "wordwrap")
TEMPLATE_MAX_TEXT_FILTER = 1 << 16
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


@dataclass
class TemplateLimits:
    seconds: float = TEMPLATE_SECONDS
    max_output: int = TEMPLATE_MIN_OUTPUT
    max_items: int = TEMPLATE_MAX_ITEMS


class _Budget:
    """What one render may still spend: time, range() items, loop iterations, and the
    size of any one value it builds or prints."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.items = 0
        self.loops = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise CortiqError(f"rendering took longer than {self.limits.seconds:g} s (a runaway loop?)")

    def size(self, n: int, what: str) -> None:
        if n > self.limits.max_output:
            raise CortiqError(f"{what} of {n} characters or items exceeds {self.limits.max_output}")

    def measure(self, v: Any, what: str, times: int = 1) -> None:
        """Bound the text ``str(v)`` (``times`` over) would make, walking containers with a
        cut-off: shared references make a small list print as a huge one."""
        cap, total, stack = self.limits.max_output, 0, [v]
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                total += len(x)
            elif isinstance(x, (list, tuple, set, frozenset)):
                total += 2 + len(x)
                stack.extend(x)
            elif isinstance(x, dict):
                total += 2 + len(x)
                stack.extend(x.keys())
                stack.extend(x.values())
            else:
                total += 24
            if total * times > cap:
                self.size(total * times, what)

    def width(self, n: Any, what: str) -> None:
        if isinstance(n, int) and n > self.limits.max_output:
            raise CortiqError(f"{what} {n} exceeds {self.limits.max_output}")

    def printf(self, fmt: str, args: Any) -> None:
        """``fmt % args`` prints no field wider or more precise than the output bound."""
        for m in _PRINTF.finditer(fmt):
            for g in (m.group(1), m.group(2)):
                if g == "*":
                    raise CortiqError("a '*' width or precision in a % format")
                if g is not None and len(g) > 7:
                    raise CortiqError(f"a % format width or precision of {len(g)} digits")
                if g is not None:
                    self.width(int(g), "a % format width or precision")
        self.measure(args, "% format arguments")

    def format_spec(self, fmt: str, args: tuple, kwargs: dict) -> None:
        """``fmt.format(...)``: no nested or oversized width or precision."""
        import string

        for _, _, spec, _ in string.Formatter().parse(fmt):
            if spec and "{" in spec:
                raise CortiqError("a nested {} in a format spec")
            for digits in re.findall(r"\d+", spec or ""):
                if len(digits) > 7:
                    raise CortiqError(f"a format width or precision of {len(digits)} digits")
                self.width(int(digits), "a format width or precision")
        self.measure((args, kwargs), "format arguments")


def _bounded_str_method(budget: _Budget, obj: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a str method call whose result would exceed the bounds (before it runs)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    self_ = getattr(target, "__self__", None)
    if not isinstance(self_, str):
        return
    name = getattr(target, "__name__", "")
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.width(first if first is not None else kwargs.get("width"), f"str.{name} width")
    elif name == "expandtabs":
        size = first if first is not None else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            budget.size(len(self_) + self_.count("\t") * max(size, 0), "str.expandtabs result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = self_.count(args[0]) if args[0] else len(self_) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            hits = min(hits, args[2])
        budget.size(len(self_) + hits * max(len(args[1]) - len(args[0]), 0), "str.replace result")
    elif name == "join" and args:
        budget.measure(args[0], "str.join input")
        n = len(args[0]) if hasattr(args[0], "__len__") else 0
        budget.size(len(self_) * n, "str.join separators")
    elif name in ("format", "format_map"):
        budget.format_spec(self_, args, kwargs)


def _bounded_filters(env: Any, budget: _Budget) -> None:
    """Wrap every filter: the time is checked, parameters that size the result are bounded
    before it runs, and string or list results are bounded after."""
    import functools
    import inspect

    pre: dict[str, Callable[[dict[str, Any]], None]] = {
        "center": lambda a: budget.width(a.get("width"), "center width"),
        "indent": lambda a: budget.width(a.get("width") if isinstance(a.get("width"), int) else 0, "indent width"),
        "batch": lambda a: budget.width(a.get("linecount"), "batch size"),
        "slice": lambda a: budget.width(a.get("slices"), "slice count"),
        "format": lambda a: (
            budget.measure(a.get("value"), "format input"),
            budget.printf(str(a.get("value")), (a.get("args"), a.get("kwargs"))),
        ),
        "join": lambda a: budget.measure(a.get("value"), "join input"),
        "string": lambda a: budget.measure(a.get("value"), "string input"),
        "pprint": lambda a: budget.measure(a.get("value"), "pprint input"),
        "tojson": lambda a: (
            budget.measure(a.get("x"), "tojson input"),
            budget.width(a.get("indent") if isinstance(a.get("indent"), int) else 0, "tojson indent"),
        ),
        "replace": lambda a: (
            budget.measure(a.get("s"), "replace input"),
            _bounded_str_method(
                budget, str(a.get("s")).replace, (a.get("old"), a.get("new"), a.get("count") or -1), {}
            ),
        ),
        "sum": lambda a: _numeric_start(a.get("start", 0)),
    }
    for name in _TEXT_FILTERS:
        pre[name] = lambda a: None  # the input length is bounded in ``bounded``

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        check = pre.get(name)
        text_cap = name in _TEXT_FILTERS

        @functools.wraps(fn)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            budget.check_time()
            if check is not None:
                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError:
                    bound = None
                if bound is not None:
                    a = dict(bound.arguments)
                    if text_cap:
                        v = a.get("s", a.get("value", ""))
                        budget.measure(v, f"{name} input")
                        if len(str(v)) > TEMPLATE_MAX_TEXT_FILTER:
                            raise CortiqError(f"{name} input over {TEMPLATE_MAX_TEXT_FILTER} characters")
                    else:
                        check(a)
            out = fn(*args, **kwargs)
            if isinstance(out, (str, list, tuple)):
                budget.size(len(out), f"the result of filter {name}")
            return out

        return bounded

    for name, fn in list(env.filters.items()):
        env.filters[name] = wrap(name, fn)


def _numeric_start(v: Any) -> None:
    if not isinstance(v, (int, float)):
        raise CortiqError("sum with a start that is not a number")


def _render_bounded(source: str, limits: TemplateLimits, context: dict[str, Any]) -> str:
    """Render in this process with every primitive bounded (see ``render_template``)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import generate_lorem_ipsum

    budget = _Budget(limits)

    def counted_range(*args: int) -> Any:
        for i in range(*args):
            budget.items += 1
            if budget.items > limits.max_items:
                raise CortiqError(f"loops ran over {limits.max_items} range() items")
            if not budget.items & 1023:
                budget.check_time()
            yield i

    def loop_guard(iterable: Any) -> Any:
        for x in iterable:
            budget.loops += 1
            if budget.loops > TEMPLATE_MAX_LOOP:
                raise CortiqError(f"for loops ran over {TEMPLATE_MAX_LOOP} iterations")
            if not budget.loops & 255:
                budget.check_time()
            yield x

    def concat(parts: tuple) -> str:
        texts = []
        total = 0
        for p in parts:
            budget.measure(p, "a ~ operand")
            t = str(p)
            total += len(t)
            budget.size(total, "a ~ concatenation")
            texts.append(t)
        return "".join(texts)

    def finalize(v: Any) -> Any:
        budget.measure(v, "a printed value")
        return v

    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
        for value, what in ((n, "paragraphs"), (min, "words"), (max, "words")):
            if not isinstance(value, int) or not 0 <= value <= 1000:
                raise CortiqError(f"lipsum {what} {str(value)[:20]} outside 0..1000")
        return generate_lorem_ipsum(n, html, min, max)

    class Generator(CodeGenerator):
        """Routes every for loop's iterable through ``environment.loop_guard`` and every
        ``~`` through ``environment.concat_bounded``, so no loop or join escapes the budget."""

        def visit_Template(self, node: Any, frame: Any = None) -> None:
            for loop in node.find_all(nodes.For):
                loop.iter = nodes.Call(nodes.EnvironmentAttribute("loop_guard"), [loop.iter], [], None, None)
            super().visit_Template(node, frame)

        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.concat_bounded((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Env(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget.check_time()
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise CortiqError("an exponent over 64")
            if operator == "**" and ints and left.bit_length() * max(right, 0) > TEMPLATE_MAX_INT_BITS:
                raise CortiqError(f"an integer power over {TEMPLATE_MAX_INT_BITS} bits")
            if operator == "*" and ints and left.bit_length() + right.bit_length() > TEMPLATE_MAX_INT_BITS:
                raise CortiqError(f"an integer product over {TEMPLATE_MAX_INT_BITS} bits")
            if operator == "*":
                seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > TEMPLATE_MAX_SEQUENCE:
                        raise CortiqError(f"a repeated string or list longer than {TEMPLATE_MAX_SEQUENCE}")
                    if not isinstance(seq, str) and n > 1:
                        budget.measure(seq, "a repeated list", n)
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > limits.max_output:
                    raise CortiqError(f"a string or list longer than {limits.max_output}")
            if operator == "%" and isinstance(left, str):
                budget.printf(left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget.check_time()
            _bounded_str_method(budget, __obj, args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            if isinstance(out, (str, list, tuple)):
                budget.size(len(out), "a call's result")
            return out

        def getattr(self, obj: Any, attribute: str) -> Any:
            budget.check_time()
            return super().getattr(obj, attribute)

    def raise_exception(message: str) -> None:
        raise CortiqError(f"raised: {str(message)[:200]}")

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        if len(str(fmt)) > 256:
            raise CortiqError("a strftime format over 256 characters")
        return datetime.now().strftime(fmt)

    if len(source) > TEMPLATE_MAX_SOURCE:
        raise CortiqError(f"the template has {len(source)} characters (limit {TEMPLATE_MAX_SOURCE})")
    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], finalize=finalize)
    env.loop_guard = loop_guard  # type: ignore[attr-defined]
    env.concat_bounded = concat  # type: ignore[attr-defined]
    env.filters["tojson"] = tojson
    _bounded_filters(env, budget)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["range"] = counted_range
    env.globals["lipsum"] = lipsum
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
        budget.check_time()
        out.append(chunk)
    return "".join(out)


def _template_error(e: BaseException) -> str:
    if isinstance(e, CortiqError):
        return str(e)
    detail = str(e).splitlines()[0][:200] if str(e) else ""
    return f"failed: {type(e).__name__}: {detail}"


def _lower_limit(which: int, value: int) -> None:
    """Set a resource limit to ``value`` unless one already in force is lower (a process
    may not raise its hard limit)."""
    import resource

    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    if soft == resource.RLIM_INFINITY or value < soft:
        resource.setrlimit(which, (value, value if hard == resource.RLIM_INFINITY else hard))


def render_template(source: str, limits: TemplateLimits, **context: Any) -> str:
    """Render a jinja2 chat template: untrusted code.

    It runs in jinja2's sandbox with every primitive bounded (time checked in every call,
    filter and loop iteration; range() items, loop iterations, repeated and concatenated
    strings, widths of center/format/%, lipsum, and the size of anything printed), in a
    forked child process that the parent kills at ``limits.seconds`` (plus a margin) and
    whose address space may grow by TEMPLATE_MEMORY at most: no single call can hang or
    exhaust this process. Any failure is one CortiqError.
    """
    import os
    import resource
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, write the answer, exit without running any cleanup
        code = 0
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            _lower_limit(resource.RLIMIT_AS, used + TEMPLATE_MEMORY)
            _lower_limit(resource.RLIMIT_CPU, int(limits.seconds) + 2)
            try:
                answer = b"T" + _render_bounded(source, limits, context).encode("utf-8", "surrogatepass")
            except MemoryError:
                answer = b"E" + f"used more than {TEMPLATE_MEMORY >> 20} MiB".encode()
            except BaseException as e:  # noqa: BLE001 - the template is untrusted code
                answer = b"E" + _template_error(e).encode("utf-8", "replace")
            view = memoryview(answer)
            while view:
                view = view[os.write(w, view) :]
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + limits.seconds + 1.0  # the child checks at seconds; this is the hard stop
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(left, 0.0))
            if not ready:
                raise CortiqError(f"rendering took longer than {limits.seconds:g} s (a runaway loop?)")
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    answer = b"".join(chunks)
    if not answer:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        why = f"was killed by signal {sig}" if sig is not None else "ended without an answer"
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            why = f"took longer than {limits.seconds:g} s"
        raise CortiqError(f"rendering {why}")
    text = answer[1:].decode("utf-8", "surrogatepass")
    if answer[:1] == b"E":
        raise CortiqError(text)
    return text


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
