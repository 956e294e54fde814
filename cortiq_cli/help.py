"""How cortiq's help reads, and ``--version`` on every command.

Typer's rich help tags every flag with its Python type (``--json <bool>``), writes
arguments as ``{model}`` and keeps the hard line breaks of a docstring inside a
sentence. The command and group classes below render help the way llama.cpp and
click users know it instead: ``Usage: cortiq generate [OPTIONS] MODEL PROMPT``,
``-n, --max-tokens N  help [default: 256]``, one section per help panel, text
reflowed to the terminal's width (80 columns when stdout is not a terminal, plain text
without colour codes), an option with fixed values listed by its values (``f32|f16``).
"""

from __future__ import annotations

import inspect as _inspect
import io
from importlib.metadata import PackageNotFoundError, version as _dist_version
from pathlib import Path
from typing import Any, get_args, get_origin

from rich.console import Console
from rich.errors import MarkupError
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup

VERSION_OPTION = "--version"
OPTIONS_PANEL = "Options"
ARGUMENTS_PANEL = "Arguments"
PIPED_HELP_WIDTH = 80  # help read from a pipe or a file: the width of a classic terminal


def cortiq_version() -> str:
    try:
        return _dist_version("cortiq")
    except PackageNotFoundError:
        return "unknown"


def _wants_version(args: list[str], *, before_first_positional: bool) -> bool:
    """``--version`` among the options (not after ``--``; for the group, not after the command name)."""
    for a in args:
        if a == "--":
            return False
        if a == VERSION_OPTION:
            return True
        if before_first_positional and not a.startswith("-"):
            return False
    return False


def _print_version(ctx: Any) -> None:
    from cortiq_cli.common import console

    console.print(f"cortiq {cortiq_version()}", highlight=False)
    ctx.exit(0)


# ---------------------------------------------------------------- text pieces
def _reflow(paragraph: str) -> str:
    """Join a docstring's hard line breaks: a sentence never breaks where the source did."""
    return " ".join(line.strip() for line in paragraph.splitlines() if line.strip())


def _markup(text: str, style: str = "") -> Text:
    try:
        return Text.from_markup(text, style=style)
    except MarkupError:
        return Text(text, style=style)


def _paragraphs(help_text: str | None) -> list[str]:
    text = _inspect.cleandoc(help_text or "").partition("\f")[0]
    return [_reflow(p) for p in text.split("\n\n") if p.strip()]


def short_help(cmd: Any) -> str:
    """The first paragraph of a command's help, on one line."""
    if cmd.short_help:
        return _reflow(cmd.short_help)
    paras = _paragraphs(cmd.help)
    return paras[0] if paras else ""


def _type_metavar(annotation: Any) -> str:
    if get_origin(annotation) is list:
        args = get_args(annotation)
        return _type_metavar(args[0]) if args else "TEXT"
    if annotation is int:
        return "N"
    if annotation is float:
        return "X"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "PATH"
    return "TEXT"


def _metavar(param: Any) -> str:
    """What follows an option: nothing for a flag, else a short word (N, X, PATH, TEXT, a|b)."""
    if param.metavar:
        return param.metavar
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    desc = getattr(param, "type_descriptor", None)
    if desc is None:
        return "VALUE"
    if desc.is_choice and desc.choices:
        return "|".join(str(getattr(c, "value", c)) for c in desc.choices)
    return _type_metavar(desc.annotation)


def _argument_name(param: Any) -> str:
    name = param.metavar or (param.name or "").upper()
    if param.nargs != 1:
        name += "..."
    return name if param.required else f"[{name}]"


def _default(param: Any) -> str:
    show = param.show_default
    if isinstance(show, str):
        return f"[default: {show}]"
    d = param.default
    if not show or d is None or callable(d) or getattr(param, "is_flag", False) and not param.secondary_opts:
        return ""
    if isinstance(d, (list, tuple)):
        if not d:
            return ""
        d = ", ".join(map(str, d))
    if isinstance(d, bool):
        d = param.opts[0] if d else param.secondary_opts[0]
    return f"[default: {d}]"


def _option_row(param: Any, hidden: frozenset[str] = frozenset()) -> tuple[Text, Text]:
    shorts = [o for o in param.opts if not o.startswith("--") and o not in hidden]
    longs = [o for o in param.opts if o.startswith("--") and o not in hidden]
    names = ", ".join(shorts + longs)
    if param.secondary_opts:
        names += " / " + ", ".join(param.secondary_opts)
    left = Text(names, style="bold cyan")
    mv = _metavar(param)
    if mv:
        left.append(" " + mv, style="yellow")
    right = _markup(_reflow(param.help or ""))
    tail = _default(param)
    if tail:
        right.append((" " if right.plain else "") + tail, style="dim")
    return left, right


def _section(title: str, rows: list[tuple[Text, Text]]) -> list[Any]:
    grid = Table.grid(padding=(0, 3))
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1, overflow="fold")
    for left, right in rows:
        grid.add_row(left, right)
    return [Text(f"{title}:", style="bold"), Padding(grid, (0, 0, 0, 2), expand=False), Text("")]


def _header(ctx: Any, cmd: Any) -> list[Any]:
    out: list[Any] = [Text.assemble(("Usage: ", "bold"), cmd.get_usage(ctx).removeprefix("Usage: ")), Text("")]
    paras = _paragraphs(cmd.help)
    if paras:
        out.append(Padding(_markup(paras[0], "bold"), (0, 0, 0, 2), expand=False))
        out.extend(Padding(_markup(p, "dim"), (1, 0, 0, 2), expand=False) for p in paras[1:])
        out.append(Text(""))
    return out


def _render(renderables: list[Any], formatter: Any) -> None:
    """Into click's help text (which click prints): at the terminal's width with its
    colours, or into a pipe or a file as plain text at 80 columns (rich writes no colour
    codes there), without the padding spaces at line ends."""
    terminal = Console()  # the stdout of the moment (a test's capture too)
    out = Console(
        file=io.StringIO(),
        width=terminal.width if terminal.is_terminal else PIPED_HELP_WIDTH,
        color_system=terminal.color_system if terminal.is_terminal else None,
    )
    for r in renderables:
        out.print(r, highlight=False)
    formatter.write("".join(line.rstrip() + "\n" for line in out.file.getvalue().splitlines()))


def _option_sections(ctx: Any, cmd: Any) -> list[Any]:
    from cortiq_cli.options import HIDDEN_ALIASES

    hidden = HIDDEN_ALIASES.get(cmd.name or "", frozenset())
    panels: dict[str, list[tuple[Text, Text]]] = {ARGUMENTS_PANEL: [], OPTIONS_PANEL: []}
    help_option = cmd.get_help_option(ctx)
    for p in cmd.get_params(ctx):
        if getattr(p, "hidden", False) or p is help_option:
            continue
        if isinstance(p, TyperArgument):
            panels[ARGUMENTS_PANEL].append((Text(_argument_name(p), style="bold cyan"), _markup(_reflow(p.help or ""))))
        else:
            panels.setdefault(getattr(p, "rich_help_panel", None) or OPTIONS_PANEL, []).append(_option_row(p, hidden))
    panels[OPTIONS_PANEL].append((Text(VERSION_OPTION, style="bold cyan"), Text("Show the version and exit.")))
    if help_option is not None:
        panels[OPTIONS_PANEL].append(_option_row(help_option))
    out: list[Any] = []
    for title, rows in panels.items():
        if rows:
            out.extend(_section(title, rows))
    return out


# ---------------------------------------------------------------- the classes
class CortiqCommand(TyperCommand):
    """A command with ``--version``, llama.cpp-style usage and plain help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if isinstance(p, TyperArgument) and p.metavar is None and p.name:
                p.metavar = p.name.upper()  # MODEL in usage, help and "Missing argument 'MODEL'"

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if _wants_version(args, before_first_positional=False):
            _print_version(ctx)
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        args = [_argument_name(p) for p in self.get_params(ctx) if isinstance(p, TyperArgument) and not p.hidden]
        return ["[OPTIONS]", *args]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _render(_header(ctx, self) + _option_sections(ctx, self), formatter)


class CortiqGroup(TyperGroup):
    """The ``cortiq`` group: ``--version``, and a command list one line per command."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if _wants_version(args, before_first_positional=True):
            _print_version(ctx)
        return super().parse_args(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((Text(name, style="bold cyan"), _markup(short_help(cmd))))
        _render(_header(ctx, self) + _section("Commands", rows) + _option_sections(ctx, self), formatter)
