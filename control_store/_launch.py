"""The control-store command's entry point (``control-store``, ``python -m control_store``).

Importing the command takes a few tenths of a second (asyncio, sqlite3, msgspec), and Python
answers Ctrl-C meanwhile with a KeyboardInterrupt traceback, and SIGTERM or SIGHUP by dying
without a word. So the stop signals are answered first, from this small module (the package
imports nothing at its own import): until the command's own handling takes over, just before
it opens anything, a stop signal ends the process with one line and the exit code the command
gives for it (130, 143, 129). Nothing was opened, so nothing is left behind.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

PROG = "control-store"  # the command's name in its lines (cli.PROG)
# Signals that stop a command as Ctrl-C does (the command's own handling: cli.STOP_SIGNALS).
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def interrupted(signum: int) -> str:
    """How the command's line names a stop: "interrupted", "interrupted by SIGTERM"."""
    return (
        "interrupted"
        if signum == signal.SIGINT
        else f"interrupted by {signal.Signals(signum).name}"
    )


def _stopped(signum: int, frame: FrameType | None) -> None:
    line = f"{PROG}: {interrupted(signum)} while starting; nothing was done\n"
    # Not contextlib.suppress: contextlib costs 5 ms to import, in the window this narrows.
    try:  # noqa: SIM105
        os.write(2, line.encode())
    except OSError:  # stderr closed (2>&-): the exit code still says it
        pass
    os._exit(128 + signum)


def answer_stop_signals() -> None:
    """Answer the stop signals with _stopped, except one the caller ignores (nohup)."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stopped)


def started() -> None:
    """Give the stop signals back to Python's own handling (SIGINT a KeyboardInterrupt), which
    the command answers from here on: only where answer_stop_signals set them."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is _stopped:
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, default)


def main() -> int:
    """Run the command line in ``sys.argv``; return the exit code."""
    answer_stop_signals()
    from .cli import main as run  # the import the signals are answered around

    return run()
