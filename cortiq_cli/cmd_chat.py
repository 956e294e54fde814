"""``cortiq chat MODEL.cmf``: a multi-turn conversation through the model's chat template.

The KV cache stays across turns (``cortiq_engine.session``): a turn forwards only
the tokens its conversation does not share with the cache, and the stats line says
how many. Turns come from the keyboard on a terminal, else one per line of stdin
(``printf 'Hi\\nAnd then?\\n' | cortiq chat m.cmf``). Lines starting with ``/`` are
commands (``/help``). Ctrl-C stops the current answer and keeps the chat; Ctrl-D
(or ``/exit``) leaves. ``--json`` prints one JSON object per turn instead of text.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer
from rich.markup import escape

from cortiq_cli import generation as gen
from cortiq_cli import mtp_options as mtp_opt
from cortiq_cli import options as opts
from cortiq_cli.common import KvCache, err_console, handle_errors, print_json
from formats import staging, untrusted_json
from formats.errors import CortiqError
from formats.untrusted_json import read_text

TEMPLATE_MODEL = "model"
TEMPLATE_RAW = "raw"
RAW_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
COMMANDS_HELP = (
    "/reset  forget the conversation (the system prompt stays)\n"
    "/system TEXT  set the system prompt\n"
    "/save FILE  write the messages as JSON\n"
    "/load FILE  read messages from JSON (a list of {role, content})\n"
    "/exit  leave (or Ctrl-D)"
)


@dataclass
class Conversation:
    system: str | None
    messages: list[dict[str, str]] = field(default_factory=list)  # user/assistant turns

    def rendered(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def load(self, path: Path) -> None:
        # Untrusted: a regular file of bounded size (no FIFO or device), JSON parsed with
        # bounded depth and bounded integers.
        doc = untrusted_json.loads(read_text(path, 1 << 26, "chat session file"), str(path))
        if not isinstance(doc, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in doc
        ):
            raise CortiqError(f'{path}: expected a JSON list of {{"role": ..., "content": ...}} objects')
        msgs = [{"role": m["role"], "content": m["content"]} for m in doc]
        systems = [m for m in msgs if m["role"] == "system"]
        self.system = systems[0]["content"] if systems else self.system
        self.messages = [m for m in msgs if m["role"] != "system"]

    def save(self, path: Path) -> None:
        """Written beside ``path`` and renamed over it: a failed write (a full disk, Ctrl-C)
        leaves the old file or none, never half a conversation."""
        data = (json.dumps(self.rendered(), ensure_ascii=False, indent=1) + "\n").encode("utf-8")
        tmp = None
        try:
            fd, tmp = staging.new_temp(path)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            staging.place(tmp, path)
            tmp = None
        except OSError as e:
            raise CortiqError(f"{path}: cannot write ({e.strerror or e})") from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)


def raw_template(messages: list[dict[str, str]]) -> str:
    """--chat-template raw: each message as "Role: text" on its own paragraph, then
    "Assistant:" for the answer to follow: plain text any base model continues."""
    turns = [f"{RAW_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


def _turns(interactive: bool) -> Iterator[str]:
    """The user's lines: typed at a prompt, else read from stdin."""
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        while True:
            try:
                yield input(">>> ")
            except EOFError:
                sys.stdout.write("\n")
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, still chatting
                sys.stdout.write("\n")
    else:
        for line in sys.stdin:
            yield line.rstrip("\n")


def _drop_oldest_turns(conv: Conversation, ids: list[int], render, *, room: int, ctx: int, note) -> list[int]:
    """--evict before a turn: drop the oldest messages (the system prompt stays) until the
    conversation leaves ``room`` tokens of the context for the answer."""
    dropped = 0
    while len(ids) > ctx - room and len(conv.messages) > 1:
        del conv.messages[: min(2, len(conv.messages) - 1)]
        dropped += 1
        ids = render()
    if dropped:
        note(f"context full: dropped the {dropped} oldest turn(s)")
    return ids


class _Interrupt:
    """Ctrl-C during an answer sets a flag the token callback reads: the answer stops
    after the current token, the cache stays consistent and the chat goes on."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.previous: Any = None

    def __enter__(self) -> "_Interrupt":
        self.flag.clear()
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, lambda *_: self.flag.set())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None


@handle_errors
@opts.option_groups
def chat(
    model: Annotated[
        Optional[str],
        typer.Argument(help="Model file (.cmf) with a chat template; or give -m/--model.", show_default=False),
    ] = None,
    model_opt: opts.ModelOption = None,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")] = None,
    load: Annotated[
        Optional[Path], typer.Option("--load", help="Start from the messages in this JSON file (as /load).")
    ] = None,
    chat_template: Annotated[
        str,
        typer.Option(
            "--chat-template",
            metavar="model|raw",
            help="model: the model's own chat template (a model without one is refused); raw: plain 'Role: text' turns, for a model without one.",
        ),
    ] = TEMPLATE_MODEL,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", min=1, help="At most this many tokens per answer.")
    ] = 512,
    sampling: opts.SamplingArgs = opts.SamplingArgs(),
    ctx: opts.Ctx = None,
    kv_cache: KvCache = "f32",
    evict: Annotated[
        bool,
        opts.evict_option(
            "When the context is full: drop the oldest turns before a turn, the oldest half of the cache during an answer."
        ),
    ] = False,
    threads: opts.Threads = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON object per turn (JSON lines) instead of streamed text.")
    ] = False,
    logprobs: Annotated[
        int,
        gen.logprobs_option(
            "Each step's N most likely tokens and log-probabilities (in --json; else listed after each answer)."
        ),
    ] = 0,
    spec: mtp_opt.SpecArgs = mtp_opt.SpecArgs(),
) -> None:
    """Chat with a model: multi-turn, streaming, the KV cache kept across turns.

    Commands: /reset, /system TEXT, /save FILE, /load FILE, /help, /exit. When stdin is
    not a terminal, each of its lines is a turn (or a command). Ctrl-C stops an answer.
    """
    from cortiq_engine.session import ChatSession

    model, _ = opts.model_and_prompt(model, None, model_opt, None, takes_prompt=False)
    if chat_template not in (TEMPLATE_MODEL, TEMPLATE_RAW):
        raise CortiqError(f"unknown --chat-template {chat_template!r}; choose {TEMPLATE_MODEL} or {TEMPLATE_RAW}")
    config = sampling.config()
    conv = Conversation(system)
    if load is not None:
        conv.load(load)
    eng = spec.load_engine(model, threads=threads, ctx=ctx, quiet=json_out, kv_cache=kv_cache)
    if not json_out:
        gen.print_compile_note(eng.compile_report)  # kernel compilation at load, kept apart from every turn's speeds
    tok = eng.tokenizer
    if chat_template == TEMPLATE_RAW:
        err_console.print(
            f"[yellow]warning:[/] --chat-template raw: plain 'User: ... Assistant:' turns, not a format "
            f"{escape(model.name)} was trained on; expect weaker answers",
            highlight=False,
            soft_wrap=True,
        )
    elif not tok.chat_template:
        raise CortiqError(
            f"{model}: no chat template in the header; use cortiq generate for plain text, "
            f"or --chat-template {TEMPLATE_RAW} for plain 'User: ... Assistant:' turns"
        )

    # raw turns end where the model starts the user's next one
    stops = [f"\n{RAW_ROLES['user']}:"] if chat_template == TEMPLATE_RAW else []

    def render() -> list[int]:
        """The conversation as token ids, through the model's template or the raw one."""
        if chat_template == TEMPLATE_RAW:
            return tok.encode(raw_template(conv.rendered()))
        return tok.encode(tok.apply_chat_template(conv.rendered()), add_bos=False)

    # The conversation keeps one drafter (its rows of the cached prefix) across turns.
    drafter, mtp_note = eng.drafter(
        spec.speculative(),
        config,
        evict=evict,
    )
    session = ChatSession(eng, drafter)
    interactive = sys.stdin.isatty() and not json_out
    if interactive:
        how = (
            f"speculative decoding ({mtp_opt.describe(drafter.describe())})"
            if drafter is not None
            else (mtp_note or "")
        )
        err_console.print(
            f"[dim]{escape(model.name)} · ctx {eng.ctx} · {eng.threads} threads{' · ' + escape(how) if how else ''} · "
            f"/help for commands, Ctrl-C stops an answer, Ctrl-D leaves[/]",
            highlight=False,
        )
    elif mtp_note and not json_out:
        err_console.print(f"[dim]{escape(mtp_note)}[/]", highlight=False)

    def note(message: str) -> None:
        err_console.print(f"[dim]{escape(message)}[/]", highlight=False)

    def error(message: str) -> None:
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)

    failed = 0
    turn_no = 0
    for line in _turns(interactive):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            arg = arg.strip()
            try:
                if cmd in ("/exit", "/quit", "/bye"):
                    break
                elif cmd == "/help":
                    note(COMMANDS_HELP)
                elif cmd == "/reset":
                    conv.messages.clear()
                    session.reset()
                    note("conversation cleared")
                elif cmd == "/system":
                    conv.system = arg or None
                    note(f"system prompt {'set' if arg else 'cleared'}")
                elif cmd in ("/save", "/load") and not arg:
                    raise CortiqError(f"{cmd} needs a FILE")
                elif cmd == "/save":
                    conv.save(Path(arg))
                    note(f"saved {len(conv.rendered())} messages to {arg}")
                elif cmd == "/load":
                    conv.load(Path(arg))
                    note(f"loaded {len(conv.rendered())} messages from {arg}")
                else:
                    raise CortiqError(f"unknown command {cmd} (/help lists them)")
            except CortiqError as e:
                error(str(e))
                failed += 1
            continue

        conv.messages.append({"role": "user", "content": line})
        try:
            ids = render()
            if evict:
                ids = _drop_oldest_turns(conv, ids, render, room=min(max_tokens, eng.ctx // 2), ctx=eng.ctx, note=note)
            with _Interrupt() as stop:
                turn = session.generate(
                    ids,
                    config,
                    max_tokens=max_tokens,
                    evict=evict,
                    logprobs=logprobs,
                    stop=stops,
                    on_token=lambda _ev: not stop.flag.is_set(),
                    on_text=None if json_out else gen.write_stdout,
                )
        except CortiqError as e:
            conv.messages.pop()  # the turn did not happen: the conversation stays as it was
            error(f"{e}" + ("; /reset starts a fresh conversation" if "context" in str(e) else ""))
            failed += 1
            continue
        turn_no += 1
        res = turn.result
        conv.messages.append({"role": "assistant", "content": res.text})
        if json_out:
            print_json(
                {
                    "turn": turn_no,
                    "user": line,
                    **turn.to_json(),
                    **gen.costs_json(eng.compile_report),
                    **({"mtp_note": mtp_note} if mtp_note else {}),
                }
            )
            continue
        gen.write_stdout("\n")
        spec_part = ""
        if "mtp" in res.extra:
            spec_part = f" · [dim]drafts accepted[/] {res.extra['mtp']['acceptance']:.0%}"
        ended = {"length": "[bold yellow]context full[/] (/reset)", "cancelled": "[yellow]stopped[/]"}.get(
            res.finish_reason, res.finish_reason
        )
        err_console.print(
            f"[dim]cached[/] {turn.reused_tokens} · [dim]new[/] {turn.forwarded_tokens} tok, {res.prefill_tok_s:.1f} tok/s · "
            f"[dim]answer[/] {len(res.token_ids)} tok, {res.decode_tok_s:.1f} tok/s{spec_part} · "
            f"[dim]context[/] {session.state.length}/{eng.ctx} · [dim]peak RSS[/] {gen.peak_rss()} · {ended}",
            highlight=False,
        )
        if logprobs:
            gen.print_logprobs(res.tokens)
        gen.print_decision(res.extra)
    if failed and not interactive:
        raise typer.Exit(1)
