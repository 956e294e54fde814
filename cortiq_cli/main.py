"""The ``cortiq`` console script: one typer app, one module per command."""

from __future__ import annotations

import importlib

if __name__ == "__main__":  # python -m cortiq_cli.main: as the console script (launch.py)
    from cortiq_cli import launch

    launch.install()

import typer  # noqa: E402

from cortiq_cli.common import OneLineErrors  # noqa: E402
from cortiq_cli.help import CortiqCommand, CortiqGroup  # noqa: E402
from cortiq_cli.options import check_cmf_paths, check_renamed  # noqa: E402


class CliGroup(OneLineErrors, CortiqGroup):
    """llama.cpp-style help and --version (cortiq_cli/help.py); bad option values and OS
    failures as one line, not a box or a traceback (cortiq_cli/common.py)."""


class CliCommand(CortiqCommand):
    """A command that refuses a retired flag by its new name and a folder where it reads
    a CMF file by the command that makes one (cortiq_cli/options.py), before it runs."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if not {"-h", "--help"} & set(args):
            check_renamed(self.name or "", args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context) -> object:
        check_cmf_paths(self.name or "", ctx.params)
        return super().invoke(ctx)


app = typer.Typer(
    name="cortiq",
    help="Convert, run and evaluate large language models on the CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=CliGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# (command name, module in cortiq_cli, function). Each module keeps its own options.
COMMANDS = [
    ("convert", "cmd_convert", "convert"),
    ("import-gguf", "cmd_import_gguf", "import_gguf"),
    ("inspect", "cmd_inspect", "inspect"),
    ("verify", "cmd_inspect", "verify"),
    ("generate", "cmd_generate", "generate"),
    ("ppl", "cmd_ppl", "ppl"),
    ("calibrate", "cmd_calibrate", "calibrate"),
    ("mtp-probe", "cmd_mtp_probe", "mtp_probe"),
    ("mtp-train", "cmd_mtp_train", "mtp_train"),
    ("mtp-vocab", "cmd_mtp_vocab", "mtp_vocab"),
    ("chat", "cmd_chat", "chat"),
    ("bench", "cmd_bench", "bench"),
    ("imatrix", "cmd_imatrix", "imatrix"),
    ("quant-sweep", "cmd_quant_sweep", "quant_sweep"),
]

for _name, _module, _func in COMMANDS:
    app.command(_name, cls=CliCommand)(getattr(importlib.import_module(f"cortiq_cli.{_module}"), _func))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
