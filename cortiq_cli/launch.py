"""The console script's entry point, kept free of heavy imports.

Loading the commands imports numpy, numba and typer (about a second); a Ctrl-C in that
second would print an import traceback. Until a command starts (``common.handle_errors``
hands Ctrl-C back to Python's KeyboardInterrupt, which the commands turn into
"interrupted" and exit code 130 after cleaning up), SIGINT ends the process at once with
the same line and code: nothing has been written yet.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted(signum: int, frame: object) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def install() -> None:
    """The startup handler, unless SIGINT is ignored (a shell's background job, nohup):
    that choice is the parent's, as Python itself keeps it."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _interrupted)


def release() -> None:
    """Back to Python's KeyboardInterrupt, if the startup handler is still the one."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> None:
    install()
    from cortiq_cli.main import main as run

    run()
