"""Options as llama.cpp and MLX-LM users type them, with one meaning in every command.

``-m/--model`` the model (also the first positional argument), ``-p/--prompt`` the
prompt, ``-n/--max-tokens`` how many tokens to generate, ``-c/--ctx`` the context,
``-t/--threads`` the compute threads, and the sampling flags ``--temp``, ``--top-k``,
``--top-p``, ``--min-p``, ``--repeat-penalty``, ``--seed``. Flags that once meant
something else in one command are refused there with a line naming the new spelling
(``RENAMED``), never silently read with another meaning.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from typer._click import exceptions as click_exc

from cortiq_cli.common import EXIT_BAD_INPUT
from formats.errors import CortiqError

SAMPLING = "Sampling"
CONTEXT = "Context"

ModelOption = Annotated[
    Optional[Path],
    typer.Option("--model", "-m", help="Model file (.cmf), instead of the MODEL argument.", show_default=False),
]
PromptOption = Annotated[
    Optional[str],
    typer.Option(
        "--prompt", "-p", help="Prompt text, instead of the PROMPT argument; '-' reads stdin.", show_default=False
    ),
]
Ctx = Annotated[
    Optional[int],
    typer.Option(
        "--ctx",
        "-c",
        min=1,
        help="Context length (default: min(max_position_embeddings, 4096)).",
        rich_help_panel=CONTEXT,
    ),
]


def threads_option(help: str) -> Any:
    """``-t/--threads N``; ``help`` says how the command uses them by default."""
    return typer.Option("--threads", "-t", min=1, help=help)


def evict_option(help: str) -> Any:
    """``--evict``; ``help`` says what the command drops when the context is full."""
    return typer.Option("--evict", help=help, rich_help_panel=CONTEXT)


Threads = Annotated[
    Optional[int],
    threads_option(
        "Compute threads, fixed (default: all cores for the prompt; each decode step runs on 1 or all cores, whichever measures faster)."
    ),
]
Temp = Annotated[
    float,
    typer.Option(
        "--temp",
        "--temperature",
        min=0.0,
        help="0 = greedy (the default, reproducible); > 0 samples.",
        rich_help_panel=SAMPLING,
    ),
]
TopK = Annotated[
    int, typer.Option("--top-k", min=0, help="Keep the k most likely tokens (0 = off).", rich_help_panel=SAMPLING)
]
TopP = Annotated[
    float,
    typer.Option("--top-p", help="Nucleus: keep the smallest set with this mass (1 = off).", rich_help_panel=SAMPLING),
]
MinP = Annotated[
    float,
    typer.Option("--min-p", help="Drop tokens below min_p x the top probability (0 = off).", rich_help_panel=SAMPLING),
]
RepeatPenalty = Annotated[
    float,
    typer.Option(
        "--repeat-penalty",
        "--repetition-penalty",
        help="Divide positive / multiply negative logits of seen tokens (1 = off).",
        rich_help_panel=SAMPLING,
    ),
]
Seed = Annotated[
    Optional[int], typer.Option("--seed", help="Sampling seed: same seed, same output.", rich_help_panel=SAMPLING)
]

# "At most N tokens of the text" (the eval commands) is --text-tokens, since --max-tokens
# is the number of tokens to generate; --max-tokens still reads there, out of the help.
TEXT_TOKENS = "--text-tokens"
TEXT_COMMANDS = ("ppl", "calibrate", "imatrix", "quant-sweep", "mtp-probe", "mtp-vocab", "mtp-train")
HIDDEN_ALIASES: dict[str, frozenset[str]] = {cmd: frozenset({"--max-tokens"}) for cmd in TEXT_COMMANDS}

# command -> {retired flag: what to type instead}: -n is the number of tokens to generate.
RENAMED: dict[str, dict[str, str]] = {
    "mtp-vocab": {"-n": "the draft vocabulary's size as --size N"},
    "mtp-train": {"-n": "its optimizer steps as --steps N"},
}

# Commands whose path arguments are CMF files to read (not a source folder to convert).
READS_CMF = frozenset(
    {
        "inspect",
        "verify",
        "generate",
        "chat",
        "bench",
        "ppl",
        "calibrate",
        "mtp-probe",
        "mtp-train",
        "mtp-vocab",
        "imatrix",
    }
)
CMF_PARAMS = ("model", "models", "model_opt", "model_opts", "file")


class BadInput(click_exc.ClickException):
    """A one-line usage error (exit 2) without the "see --help" tail: the line says it all."""

    exit_code = EXIT_BAD_INPUT


def _given(flag: str, args: list[str]) -> bool:
    for a in args:
        if a == "--":
            return False
        if a == flag or (flag.startswith("--") and a.startswith(flag + "=")):
            return True
        if not flag.startswith("--") and not a.startswith("--") and a.startswith(flag):  # -n8192
            return True
    return False


def check_renamed(command: str, args: list[str]) -> None:
    """A retired flag -> one line naming its new spelling (exit 2)."""
    for flag, instead in RENAMED.get(command, {}).items():
        if _given(flag, args):
            raise BadInput(f"{flag} is the number of tokens to generate in cortiq; cortiq {command} takes {instead}")


def folder_message(path: Path) -> str:
    return f'{path} is a folder: did you mean "cortiq convert {path} OUT.cmf"?'


def check_cmf_paths(command: str, params: dict[str, Any]) -> None:
    """A folder where a CMF file is expected: say how a folder becomes one (exit 2)."""
    if command not in READS_CMF:
        return
    for name in CMF_PARAMS:
        value = params.get(name)
        for p in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(p, (str, Path)) and str(p) and Path(p).is_dir():
                raise BadInput(folder_message(Path(p)))


def model_and_prompt(
    model: str | None, prompt: str | None, model_opt: Path | None, prompt_opt: str | None, *, takes_prompt: bool = True
) -> tuple[Path, str | None]:
    """The model and prompt from positionals or -m/-p in any mix: with -m the first
    positional is the prompt (``cortiq generate -m M.cmf "Hi"``)."""
    positional = [a for a in (model, prompt) if a is not None]
    if model_opt is not None:
        positional.insert(0, str(model_opt))
    if not positional:
        raise CortiqError("no model: give MODEL or -m/--model PATH")
    model_path = Path(positional.pop(0))
    if prompt_opt is not None:
        positional.append(prompt_opt)
    if len(positional) > (1 if takes_prompt else 0):
        extra = positional[-1] if takes_prompt else positional[0]
        raise CortiqError(
            f"unexpected extra argument {extra!r}: give the model once (MODEL or -m) and the prompt once (PROMPT or -p)"
            if takes_prompt
            else f"unexpected extra argument {extra!r}: give the model once (MODEL or -m)"
        )
    return model_path, (positional[0] if positional else None)


class OptionGroup:
    """A dataclass whose fields are typer options, taken by a command as one parameter."""


@dataclasses.dataclass(frozen=True)
class SamplingArgs(OptionGroup):
    """How each next token is chosen: greedy by default; the fields are ``SamplingConfig``'s."""

    temperature: Temp = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    repetition_penalty: RepeatPenalty = 1.0
    seed: Seed = None

    def config(self) -> Any:
        from cortiq_engine import SamplingConfig

        return SamplingConfig(**dataclasses.asdict(self))


F = TypeVar("F", bound=Callable[..., Any])


def option_groups(fn: F) -> F:
    """``fn`` as typer sees it: each parameter typed with an ``OptionGroup`` becomes the
    group's fields, in their order, and the call gets the group built from them."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for p in inspect.signature(fn).parameters.values():
        hint = hints.get(p.name, p.annotation)
        if isinstance(hint, type) and issubclass(hint, OptionGroup):
            field_hints = typing.get_type_hints(hint, include_extras=True)
            fields = dataclasses.fields(hint)  # type: ignore[arg-type]
            params += [
                inspect.Parameter(f.name, p.kind, default=f.default, annotation=field_hints[f.name]) for f in fields
            ]
            groups[p.name] = (hint, [f.name for f in fields])
        else:
            params.append(p.replace(annotation=hint))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for name, (group, fields) in groups.items():
            kwargs[name] = group(**{f: kwargs.pop(f) for f in fields if f in kwargs})
        return fn(*args, **kwargs)

    wrapper.__signature__ = inspect.Signature(params, return_annotation=hints.get("return", inspect.Signature.empty))  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper  # type: ignore[return-value]
