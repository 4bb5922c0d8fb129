"""The ``control-store`` command: look into a store, migrate it, and run the demo fleet.

Standard library only (argparse, text tables, a text progress bar), so the command needs no
dependency beyond the library's; ``import control_store`` never imports this module.

Exit codes: 0 success; 1 an expected failure, told in one line on stderr (bad URL, unknown
run, locked or corrupt database, problems found by ``check``, a failed demo invariant);
2 a usage error; 3 an expected failure a retry may cure (the database locked past
--busy-timeout, a full disk: the error is ``retryable``); 130 interrupted by Ctrl-C (SIGINT),
143 by SIGTERM, 129 by SIGHUP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import sys
import time
import unicodedata
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn, TextIO

import msgspec

from . import _codec, _launch, _migrate, _sqlite
from ._show import counted
from ._store import Store, connect_any_version
from .errors import (
    ControlError,
    CorruptRowError,
    DatabaseBusyError,
    MigrationError,
    NotFoundError,
    PendingMigrationError,
    StorageError,
)
from .models import JobOutcome, JobStatus, Run, RunStatus

if TYPE_CHECKING:  # the demo's module is imported only when the demo runs
    from _typeshed import SupportsWrite

    from ._demo import Check, DemoConfig, Snapshot

PROG: Final = _launch.PROG
URL_ENV: Final = "CONTROL_STORE_URL"
DEFAULT_URL: Final = "sqlite://control.db"
EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
# A failure a retry may cure (the error's retryable is True: the lock held past --busy-timeout,
# a full disk, the file moved): a script can tell it from one that needs a person.
EXIT_RETRY: Final = 3
EXIT_INTERRUPTED: Final = 130
DEFAULT_LIMIT: Final = 20


class Failure(Exception):
    """An expected failure of a command: its message is the one line the user sees."""


class UsageError(Failure):
    """Options that cannot work together or at all: exit 2, as argparse's own usage errors."""


class OutputError(Exception):
    """Standard output failed (a closed pipe, a full disk); ``error`` is the OSError."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class Interrupted(Exception):
    """The command was stopped by a signal (Ctrl-C, kill, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# Signals that stop a command as Ctrl-C does. SIGTERM (kill) and SIGHUP (a closed terminal)
# would otherwise end the process at once, skipping the demo's clean-up, and leave its scheduler
# processes running, re-parented to init, still claiming runs.
STOP_SIGNALS: Final = _launch.STOP_SIGNALS


# ---------------------------------------------------------------------------------------------
# Output: text for people (aligned tables, a bar, colour on a terminal), JSON for scripts.


@dataclass(frozen=True, slots=True)
class Terminal:
    """How to write to one stream: whether it is a terminal, can show Unicode, takes colour."""

    stream: TextIO
    tty: bool
    unicode: bool
    color: bool
    width: int
    encoding: str = "utf-8"
    dumb: bool = False  # a terminal that takes no escape sequences at all (TERM=dumb)
    # The terminal's own width where it is narrower than ``width``, the floor tables are laid
    # out to (0: ``width``): a line rewritten in place must fit it, or each rewrite wraps and
    # erases only its last row.
    columns: int = 0

    @classmethod
    def of(cls, stream: TextIO) -> Terminal:
        tty = stream.isatty()
        encoding = (getattr(stream, "encoding", None) or "ascii").lower()
        encoding = encoding.replace("-", "").replace("_", "")
        dumb = tty and os.environ.get("TERM") == "dumb"
        # no-color.org: NO_COLOR turns colour off when set to anything but the empty string.
        color = tty and not dumb and not os.environ.get("NO_COLOR")
        # Off a terminal (a pipe, a file) nothing is cut: the reader may be grep.
        columns = shutil.get_terminal_size((100, 24)).columns if tty else 1_000_000
        width = max(_MIN_WIDTH, columns)
        unicode = encoding in ("utf8", "utf16", "utf32")
        codec = getattr(stream, "encoding", None) or "ascii"
        encoding = "utf-8" if unicode else codec
        return cls(stream, tty, unicode, color, width, encoding, dumb, max(1, columns))

    @property
    def ellipsis(self) -> str:
        """What ends a cut cell: "…" where the stream shows it, "..." (not its escape) else."""
        return "…" if self.unicode else "..."

    def shown(self, text: str) -> str:
        """``text`` as this stream shows it: what its encoding cannot hold as the backslash
        escapes _tolerant has it write, so that a table measures what is printed."""
        if self.unicode or text.isascii():
            return text
        try:
            return text.encode(self.encoding, "backslashreplace").decode(self.encoding)
        except LookupError:  # an encoding Python does not know: the stream would fail anyway
            return text

    def paint(self, text: str, code: str) -> str:
        """``text`` in ANSI colour ``code`` on a colour terminal, unchanged elsewhere."""
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def bar(self, done: int, total: int, width: int = 12) -> str:
        """A progress bar of ``width`` cells: full blocks on Unicode terminals, # and - else."""
        filled = width if total <= 0 else min(width, done * width // total)
        full, empty = ("█", "░") if self.unicode else ("#", "-")
        return full * filled + empty * (width - filled)

    def mark(self, ok: bool) -> str:
        if self.unicode:
            return self.paint("✓", "32") if ok else self.paint("✗", "31")
        return "ok  " if ok else "FAIL"

    def print(self, text: str = "") -> None:
        self.write(text + "\n")

    def write(self, text: str) -> None:
        """Write ``text``; an OSError of the stream (EPIPE, ENOSPC) becomes OutputError.

        In pieces smaller than the stream's buffer: a text larger than it goes to the file in
        one write(2), and when that write is cut short (the reader of a pipe gone, a disk
        filling up) CPython's text layer drops the rest without an error (measured: 132 KB of
        JSON into `head -c 100` exited 0). Through the buffer, the rest is written again, and
        the failure is raised."""
        with _writing():
            try:
                for start in range(0, len(text), _PIECE):
                    self.stream.write(text[start : start + _PIECE])
            except OSError as exc:
                raise OutputError(exc) from exc

    def flush(self) -> None:
        with _writing():
            try:
                self.stream.flush()
            except OSError as exc:
                raise OutputError(exc) from exc

    def json(self, value: object) -> str:
        """``value`` as JSON this stream can encode: non-ASCII escaped unless it is Unicode."""
        return _json(value, ascii_only=not self.unicode)


# Whether the command is inside a write to its output, and the stop signals that came then (see
# _unblock_output).
_WRITING: Final = [False]
_STOPPED_WRITING: Final[list[int]] = []


@contextlib.contextmanager
def _writing() -> Iterator[None]:
    _WRITING[0] = True
    try:
        yield
    finally:
        _WRITING[0] = False


def _unblock_output(signum: int, frame: object) -> None:
    """The Python-level handler of a stop signal, set under asyncio's (which still learns of
    the signal through its wakeup fd, and stops the command as ever).

    asyncio's own handler does nothing: a write(2) blocked on a full pipe (a reader that
    stalls: ssh, a paused consumer) was retried after it and never returned to the event loop,
    so the signal waited for as long as the reader stalled, and was lost when the reader then
    went away (exit 1, nothing said). Here, a signal that comes during a write points stdout
    at devnull: the write completes, and the command stops as it does for a signal at any
    other time, its finally-clauses run in order. What it had left to print is dropped: it was
    stopping."""
    if _WRITING[0]:
        _STOPPED_WRITING.append(signum)
        _silence_stdout()


# Characters per write: at most 8 KiB in UTF-8 (4 bytes a character), io.DEFAULT_BUFFER_SIZE.
_PIECE: Final = 2048


_MIN_WIDTH: Final = 60  # the narrowest width tables are laid out to


def _json(value: object, *, ascii_only: bool = False) -> str:
    """``value`` as indented JSON; with ``ascii_only``, every non-ASCII character escaped
    (\\uXXXX, as json.dumps's ensure_ascii), so a stream that cannot encode it still gets valid
    JSON that decodes to the same strings."""
    try:
        encoded = msgspec.json.encode(value)
    except UnicodeEncodeError:
        # A lone surrogate, which UTF-8 cannot hold: text from the command line (a path whose
        # bytes are not UTF-8, --url $'\xff.db', decoded with surrogateescape). Written as
        # JSON's \udcXX escape, as Python's json writes it: json.loads gives the same text
        # back, and os.fsencode of it the path's bytes.
        return json.dumps(msgspec.to_builtins(value), indent=2, ensure_ascii=True)
    text = msgspec.json.format(encoded, indent=2).decode()
    if ascii_only:
        # Outside strings JSON is ASCII: every match is inside a string, where an escape is valid.
        text = _NON_ASCII.sub(lambda match: json.dumps(match.group())[1:-1], text)
    return text


_NON_ASCII: Final = re.compile(r"[^\x00-\x7f]")


def _tolerant(stream: TextIO | None) -> Callable[[], None]:
    """Make ``stream`` write what its encoding cannot as backslash escapes (a run's manifest in
    Japanese to an ASCII terminal, PYTHONIOENCODING=latin-1) instead of raising
    UnicodeEncodeError mid-output; return the function that restores it."""
    if not isinstance(stream, io.TextIOWrapper) or stream.errors == "backslashreplace":
        return lambda: None
    errors = stream.errors
    stream.reconfigure(errors="backslashreplace")
    return lambda: stream.reconfigure(errors=errors)


_STATUS_COLOR: Final = {"queued": "2", "running": "33", "done": "32"}


def _age(then: datetime, now: datetime) -> str:
    seconds = max(0.0, (now - then).total_seconds())
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


# Characters output for people shows as escapes: stored text (a manifest, a model name, an
# error message) holding them could drive the terminal, reorder the line or hide a difference.
# Cc, the C0 and C1 controls and DEL: "\n" forges a row, ESC [2J clears the screen, ESC ] sets
# the window title. Zl and Zp, the line and paragraph separators, which some terminals break
# lines at. Cf, the format characters: the bidirectional marks, embeddings, overrides and
# isolates reorder what follows them on the line ("Trojan Source": a model name could show
# another's id or score), and the rest draw as nothing (U+200B zero width space, U+2060 word
# joiner, U+FEFF, U+00AD soft hyphen, the tag characters U+E0000-E007F), so "gpt-x" and
# "gpt-x\u200b" would show as the same row. Cs: a lone surrogate (from a byte an argument could
# not decode) has no glyph. By category, from the running Python's Unicode database, so a format
# character added to Unicode later is escaped too.
# Zs, the spaces other than U+0020 (no-break, thin, ideographic, ogham): at the end of a
# name, "gpt-x\u2009" would look like "gpt-x".
_ESCAPED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp", "Zs"})
# And the other code points Unicode says to draw as nothing, though not of those categories
# (DerivedCoreProperties.txt, Default_Ignorable_Code_Point, less its Cf members): the combining
# grapheme joiner, the Khmer inherent vowels, the Mongolian free variation selectors, the Hangul
# fillers, the variation selectors (U+FE00-FE0F, U+E0100-E01EF) and the code points reserved as
# ignorable (U+2065, U+FFF0-FFF8, U+E0000-E0FFF): "gpt-x\ufe0f" would look like "gpt-x" too.
# And U+2800, the braille pattern blank, a symbol that draws as a space.
_IGNORABLE: Final = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2065\u2800\u3164\ufe00-\ufe0f"
    "\uffa0\ufff0-\ufff8\U000e0000-\U000e0fff]"
)
# Every character but printable ASCII: the candidates, each then judged by _escape_unsafe.
_NOT_PRINTABLE_ASCII: Final = re.compile(r"[^\x20-\x7e]")


def _printable(text: str, *, data: bool = True) -> str:
    """``text`` with every character that could drive the terminal, reorder the line or draw as
    nothing shown as its escape (\\n, \\x1b, \\x85, \\u200b, \\U000e0041), for output meant for
    a person; JSON escapes control characters itself, and keeps the rest as stored.

    Stored ``data`` has its backslashes doubled first, as repr() does: else a name holding a
    backslash and an n would show as the name holding a line break does (its escape), two
    names as one. A message (not data) names values by their repr(), backslashes doubled."""
    if data and "\\" in text:
        text = text.replace("\\", "\\\\")
    if not (text.isascii() and text.isprintable()):  # else, the common case: nothing to look up
        text = _NOT_PRINTABLE_ASCII.sub(_escape_unsafe, text)
    if text[:1] == " " or text[-1:] == " ":
        # A space at either end vanishes in a padded cell: "gpt-x " would show as "gpt-x".
        core = text.strip(" ")
        lead = len(text) - len(text.lstrip(" ")) if core else len(text)
        trail = len(text) - len(text.rstrip(" ")) if core else 0
        text = "\\x20" * lead + core + "\\x20" * trail
    return text


# What a list of model names writes itself (", " between names, " +N" for those left out), and
# the quote that marks a name holding one.
_LIST_MARKS: Final = re.compile(r"[,+']")


def _listed(name: str) -> str:
    """A model name as a list of names shows it (_printable), quoted where it holds what the
    list itself writes, so the one model "a, b" never shows as the models "a" and "b", nor
    "b +1" as "b" and one more; a quote in it is escaped."""
    shown = _printable(name)
    if shown and not _LIST_MARKS.search(shown):
        return shown
    return "'" + shown.replace("'", "\\'") + "'"


def _drawn(char: str) -> bool:
    """Whether output for people shows ``char`` as itself, not as its escape (_printable)."""
    return unicodedata.category(char) not in _ESCAPED_CATEGORIES and not _IGNORABLE.match(char)


def _escape_unsafe(match: re.Match[str]) -> str:
    char = match.group()
    if _drawn(char):
        return char
    # repr's escape where it has one (\n, \x1b, \u202e): the form these were always shown in.
    # A variation selector or a Hangul filler is printable to repr, which keeps it as is.
    escaped = repr(char)[1:-1]
    if escaped != char:
        return escaped
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _columns(text: str) -> int:
    """How many terminal columns ``text`` takes: two for an East Asian wide or fullwidth
    character (CJK, most emoji), none for a non-spacing or enclosing mark (U+0301, Thai and
    Devanagari vowel signs), one for any other (the characters that draw as nothing are
    escapes by now: see _printable)."""
    if text.isascii():
        return len(text)
    return sum(_char_columns(char) for char in text)


def _char_columns(char: str) -> int:
    if unicodedata.category(char) in ("Mn", "Me"):  # non-spacing and enclosing marks
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _pad(text: str, width: int) -> str:
    """``text`` and the spaces that fill it to ``width`` columns."""
    return text + " " * (width - _columns(text))


def _clip(text: str, width: int, ellipsis: str = "…") -> str:
    """``text`` cut to ``width`` columns, ``ellipsis`` (one column wide or more: "..." for a
    stream that cannot show "…") ending what was cut."""
    if _columns(text) <= width:
        return text
    room = width - _columns(ellipsis)
    if room < 0:
        return text[:width] if text.isascii() else ""
    kept, used = [], 0
    for char in text:
        used += _char_columns(char)
        if used > room:
            break
        kept.append(char)
    return "".join(kept) + ellipsis


def _table(
    term: Terminal,
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    after: Sequence[int] | None = None,
    status: int | None = None,
) -> list[int]:
    """Left-aligned columns; the last column is cut to the terminal's width. Every cell is
    shown printable (see _printable). Returns the widths used; ``after``: the widths of the
    part of the same table printed before (its heading included), which a column keeps
    unless this part's rows are wider; ``status``: the column of run statuses, in colour. A
    cell of stored data comes _printable already (its backslashes doubled once, not again
    here)."""
    rows = [[term.shown(_printable(cell, data=False)) for cell in row] for row in rows]
    widths = [max(len(h), *(_columns(r[i]) for r in rows)) for i, h in enumerate(header)]
    if after is not None:
        widths = [max(pair) for pair in zip(widths, after, strict=True)]
    fixed = sum(widths[:-1]) + 2 * (len(widths) - 1)
    widths[-1] = max(len(header[-1]), min(widths[-1], term.width - fixed))
    if after is None:
        heading = "  ".join(_pad(h, w) for h, w in zip(header, widths, strict=True)).rstrip()
        term.print(term.paint(heading, "1"))
    for row in rows:
        cells = [
            _pad(_clip(cell, w, term.ellipsis), w) for cell, w in zip(row, widths, strict=True)
        ]
        if status is not None:
            cells[status] = term.paint(cells[status], _STATUS_COLOR.get(row[status], "0"))
        term.print("  ".join(cells).rstrip())
    return widths


# ---------------------------------------------------------------------------------------------
# Opening the store


def _url(args: argparse.Namespace) -> str:
    given = getattr(args, "url", None)
    # --url=--: argparse before 3.13 takes the "--" for the end of options and leaves [];
    # 3.13's keeps it. Refused on each alike: a file named so is written ./--.
    if isinstance(given, list) or given == "--":
        raise UsageError(
            "--url=-- names no database (argparse reads '--' as the end of the options); for a "
            "file named '--', give --url ./--"
        )
    if given == "":
        raise UsageError(
            "--url is empty; name a database, e.g. --url sqlite://control.db (or leave --url "
            f"out for ${URL_ENV}, else {DEFAULT_URL})"
        )
    from_env = not given and bool(os.environ.get(URL_ENV))
    args.url_from_env = from_env
    url = given or os.environ.get(URL_ENV) or DEFAULT_URL
    return str(url)


# Appended to an error about the database the URL names, when the URL came from the
# environment: the user typed no --url, and would otherwise look for the mistake in the command.
_FROM_ENV: Final = f"(the URL came from ${URL_ENV}; --url overrides it)"


@contextlib.contextmanager
def _naming_the_url(args: argparse.Namespace) -> Iterator[None]:
    """Mark an error raised inside (parsing the URL, opening what it names) as one about the
    URL, so that _main says where the URL came from."""
    try:
        yield
    except (ControlError, Failure) as exc:
        args.url_error = exc
        raise


def _given_url(args: argparse.Namespace) -> list[str]:
    """``--url URL`` for a suggested command when the user gave --url: without it, the command
    pasted would open $CONTROL_STORE_URL or the default instead (they need no option)."""
    given = getattr(args, "url", None)
    return _url_option(_sqlite.redact(given)) if given else []


def _url_option(url: str) -> list[str]:
    """``--url`` with ``url``, for a suggested command: as one word ``--url=URL`` when the URL
    starts with a dash, which argparse would take for an option ("expected one argument")."""
    return [f"--url={url}"] if url.startswith("-") else ["--url", url]


def _path_url(path: Path) -> str:
    """``path`` as a URL that names it: with ./ before a relative path that would read as a
    URL with a scheme (run:1.db has the scheme 'run')."""
    text = str(path)
    return text if _sqlite.url_scheme(text) is None else f"./{text}"


def _command(*argv: str) -> str:
    """A command line to suggest, quoted for a POSIX shell (_shell_join), so that it works when
    pasted: a URL with a space or a quote stays one argument. Framed in single quotes, or in
    double quotes when it holds one (as repr frames a string)."""
    line = _shell_join([PROG, *argv])
    return f'"{line}"' if "'" in line else f"'{line}'"


def _shell_join(argv: Sequence[str]) -> str:
    """``argv`` quoted for a POSIX shell, as one line to paste (see _shell_words)."""
    setup, words = _shell_words(argv)
    return setup + " ".join(words)


def _shell_words(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``argv`` quoted for a POSIX shell, and what must run before the words (usually ""):
    as shlex does, but an argument holding a character that the message's one line would not
    show as itself (a tab, a newline, a variation selector: see _printable) made by printf,
    "$(printf '...')", with the character as an octal escape. shlex would keep it raw inside
    single quotes, where the line shows its escape, which a shell does not expand, or nothing.
    (Not bash's $'...': dash, many systems' /bin/sh, has no such quotes.)

    "$(...)" drops the newlines its output ends with, so a word ending in one is made with an
    x after it, set as a positional parameter ("set -- ...; "), and used as "${1%x}"."""
    held: list[str] = []
    words: list[str] = []
    for arg in argv:
        if arg.endswith("\n"):
            held.append(_printf_quote(f"{arg}x"))
            words.append(f'"${{{len(held)}%x}}"')
        elif (arg.isascii() and arg.isprintable()) or all(map(_pastes_raw, arg)):
            words.append(shlex.quote(arg))
        else:
            words.append(_printf_quote(arg))
    return (f"set -- {' '.join(held)}; " if held else ""), words


def _pastes_raw(char: str) -> bool:
    """Whether ``char`` can stand as itself in a pasted command: shown as itself on the line,
    by the streams the line may go to too (on an ASCII stream, PYTHONIOENCODING=ascii, an é
    is written as the escape \\xe9, which pasted inside quotes names another file)."""
    return char.isprintable() and _drawn(char) and (char.isascii() or _streams_encode(char))


def _streams_encode(char: str) -> bool:
    """Whether stdout and stderr (either may carry a suggested command) write ``char`` as the
    bytes it has in an argument: pasted, the terminal gives the shell the stream's bytes, and
    the program reads its arguments in the file system encoding (PYTHONIOENCODING=latin-1 under
    a UTF-8 locale writes an é as the one byte 0xe9, which as an argument is another name)."""
    try:
        wanted = os.fsencode(char)
    except UnicodeEncodeError:
        return False
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            if char.encode(encoding) != wanted:
                return False
        except UnicodeEncodeError:
            return False
        except LookupError:  # an encoding Python does not know: the stream would fail anyway
            continue
    return True


def _argument_bytes(char: str) -> bytes:
    """``char`` as the bytes a program reads it from in an argument (its file system
    encoding), else its UTF-8."""
    try:
        return os.fsencode(char)
    except UnicodeEncodeError:
        return char.encode("utf-8", "surrogateescape")


def _printf_quote(arg: str) -> str:
    """``arg`` as a shell word that printf makes: its format's escapes are POSIX (\\\\,
    %%, \\ddd octal, one per byte of a character as an argument holds it: _argument_bytes),
    and a quote closes, escapes and reopens the single quotes around it."""
    escaped = "".join(
        "\\\\"
        if char == "\\"
        else "%%"
        if char == "%"
        else "'\\''"
        if char == "'"
        else char
        if _pastes_raw(char)
        else "".join(f"\\{byte:03o}" for byte in _argument_bytes(char))
        for char in arg
    )
    return f"\"$(printf -- '{escaped}')\""


def _shown(args: argparse.Namespace) -> str:
    """The URL as messages show it: any password replaced, control characters escaped."""
    return _printable(_sqlite.redact(_url(args)), data=False)


# The demo's processes all open one file and write at once: a longer default wait for the lock.
DEMO_BUSY_TIMEOUT: Final = 30.0


# Every command's but the demo's; the same as Store.connect's own default.
_DEFAULT_BUSY_TIMEOUT: Final = 5.0


def _busy_timeout(args: argparse.Namespace) -> float:
    return float(getattr(args, "busy_timeout", _DEFAULT_BUSY_TIMEOUT))


# parse_url's fixes in a command line's words: --url and --busy-timeout, not keyword arguments
# and pathlib.
_URL_FIXES: Final = _sqlite.UrlFixes(
    path_itself="give the path itself as --url (a plain path is not decoded)",
    options="give options as the command's own: --busy-timeout SECONDS",
    as_file="give --url ./{path}",
    memory=(
        f"for a file named ':memory:', give --url ./:memory: ({_sqlite.MEMORY_URL} is a new, "
        "empty in-memory database)"
    ),
)


def _parsed(url: str, *, creates: bool = True) -> str:
    """The path ``url`` names; a bad URL is a ConfigurationError whose fix is a command's.
    ``creates``: see parse_url."""
    return _sqlite.parse_url(url, fixes=_URL_FIXES, creates=creates)


def _database_path(url: str, *, create_hint: str) -> str:
    """The file ``url`` names, which must exist: a command that only reads never creates one."""
    path = _parsed(url, creates=False)
    if path != _sqlite.MEMORY and not Path(path).exists():
        directory = Path(path).parent
        if not directory.exists():  # the command named next makes the file, not its directory
            create_hint = f"create the directory {str(directory)!r} (mkdir -p), then {create_hint}"
        raise Failure(
            f"no database at {path!r} (URL {_sqlite.redact(url)!r})"
            f"{_sqlite.missing_because(path)}; check --url or "
            f"${URL_ENV}, or {create_hint}"
        )
    return path


async def _open_existing(args: argparse.Namespace) -> Store:
    """Open the store for reading only: never create a file, never migrate, never write.

    read_only=True (SQLite's mode=ro), so the read commands work on a copy on read-only media
    or a file this user may not write, and leave the file as it was.
    """
    with _naming_the_url(args):
        return await _open_read_only(args)


async def _open_read_only(args: argparse.Namespace) -> Store:
    url = _url(args)
    given = _given_url(args)
    hint = f"create one with {_command('migrate', *given)} (or {_command('demo', *given)})"
    path = _database_path(url, create_hint=hint)
    if path == _sqlite.MEMORY:
        # A new in-memory database, empty, which a read-only store refuses: migrated, so the
        # commands answer (no runs) instead of failing.
        return _track(args, await Store.connect(url, busy_timeout=_busy_timeout(args)))
    try:
        store = await Store.connect(url, busy_timeout=_busy_timeout(args), read_only=True)
        return _track(args, store)
    except PendingMigrationError as exc:
        database = f"database {_sqlite.database_name(url, path)}"
        if not exc.found:  # no migration at all: an empty file (another application's is
            # refused by connect, naming its tables), or an emptied history
            migrate = _command("migrate", *_url_option(_sqlite.redact(url)))
            if exc.tables:
                raise Failure(
                    f"{database} has the tables {', '.join(exc.tables)} but an empty migration "
                    f"history ({_migrate.TRACKING_TABLE}): its rows were deleted; restore the "
                    f"database from a backup, or, if its schema is this release's, put the rows "
                    f"back ({migrate} refuses to make the tables again and gives the row of "
                    "each migration in turn)"
                ) from exc
            raise Failure(
                f"{database} holds no control_store schema (it is empty); check the "
                f"URL, or create the schema with {migrate}"
            ) from exc
        names = ", ".join(f"{version} ({description})" for version, description in exc.pending)
        older = f", or read it with the control-store release whose newest migration is {exc.found}"
        raise Failure(
            f"{database} has pending migrations: {names}; apply them with "
            f"{_command('migrate', *_url_option(_sqlite.redact(url)))} (on a copy you may not "
            f"write: migrate a writable copy{older})"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Commands. Each returns an exit code; expected failures raise ControlError or Failure.


async def cmd_migrate(args: argparse.Namespace, out: Terminal) -> int:
    """Apply pending migrations, or list applied and pending ones (--status)."""
    url = _url(args)
    if args.status:
        store = await _open_for_status(args)
        refused: ControlError | None = None
        async with store:
            try:
                await store.migration_status()
            except (CorruptRowError, MigrationError) as exc:  # failed, edited, unknown, lost
                refused = exc  # listed all the same: the listing is what shows the damage
            backend = store._connected()  # the CLI is part of the package: its own backend
            records = await backend.read(backend.migration_history_op())
        if args.json:
            listed = [asdict(r) | {"applied": r.state == "applied"} for r in records]
            out.print(out.json(listed))
        else:
            rows = [
                [str(r.version), _printable(r.description), r.state, r.installed_on or ""]
                for r in records
            ]
            _table(out, ["VERSION", "DESCRIPTION", "STATE", "INSTALLED ON"], rows)
        if refused is not None:
            out.flush()
            raise refused
        return EXIT_OK
    with _naming_the_url(args):
        _parsed(url)
        opened = await Store.connect(url, busy_timeout=_busy_timeout(args), migrate=False)
    async with opened as store:
        _track(args, store)
        applied = await store.migrate()
        states = await store.migration_status()
    current = max((s.version for s in states if s.installed_on), default=0)
    args.migrated = current  # for an error writing what follows: the migrate itself is done
    if args.json:
        out.print(out.json({"applied": applied, "version": current}))
    elif applied:
        for state in states:
            if state.version in applied:
                out.print(f"applied migration {state.version} ({state.description})")
        out.print(f"database is at migration {current}")
    else:
        out.print(f"database is up to date (migration {current}); nothing to apply")
    return EXIT_OK


async def _open_for_status(args: argparse.Namespace) -> Store:
    """Open the store read-only to list its migrations, at whatever version it is."""
    url = _url(args)
    with _naming_the_url(args):
        hint = f"create one with {_command('migrate', *_given_url(args))}"
        path = _database_path(url, create_hint=hint)
        if path == _sqlite.MEMORY:
            return _track(
                args, await Store.connect(url, busy_timeout=_busy_timeout(args), migrate=False)
            )
        return _track(args, await connect_any_version(url, busy_timeout=_busy_timeout(args)))


# Runs per read when `runs --all` walks them: its memory is bounded by a page, not the runs.
RUNS_PAGE_SIZE: Final = 1000


async def cmd_runs(args: argparse.Namespace, out: Terminal) -> int:
    """A table of runs, newest first, with a progress bar: the newest --limit, or --all."""
    async with await _open_existing(args) as store:
        return await _print_runs(store, args, out, limit=None if args.all else args.limit)


def _json_page(out: Terminal, page: Sequence[Run], *, first: bool) -> None:
    """A page of the JSON list of runs, a run encoded at a time: the ``first`` opens the list,
    the caller closes it ("\\n]")."""
    items = ",\n".join(_indented(out.json(_run_json(run))) for run in page)
    out.write(("[\n" if first else ",\n") + items)


async def _print_runs(
    store: Store, args: argparse.Namespace, out: Terminal, *, limit: int | None
) -> int:
    """``runs``: the newest ``limit`` runs (None: every run), a page at a time (iter_runs),
    printed as each page comes, so that a million runs need no more memory than a page (all at
    once, 1.5 GB for --json; --limit 200000 read with one list_runs took 296 MB, where a walk
    takes 39 MB). The JSON is one document, written an item at a time (one encode of 300,000
    runs needs hundreds of MB at once, and msgspec, refused that memory, crashed the process
    with SIGSEGV instead of raising MemoryError); the table's columns are sized by its first
    page, and widen where a later page needs it."""
    now = datetime.now(UTC)
    printed = False
    widths: list[int] | None = None  # the table's, once its first part is printed
    digits = 0  # the widest job_count so far, so that later pages' counts line up too

    def emit(page: list[Run]) -> None:
        nonlocal printed, widths, digits
        if args.json:
            _json_page(out, page, first=not printed)
        else:
            digits = max(digits, *(len(str(run.job_count)) for run in page))
            widths = _runs_table(out, page, now, after=widths, digits=digits)
        printed = True

    # One more than the limit is read, to say whether there are more without counting them.
    page_size = RUNS_PAGE_SIZE if limit is None else min(limit + 1, RUNS_PAGE_SIZE)
    page: list[Run] = []
    taken = 0
    more = False
    async for run in store.iter_runs(status=args.status, page_size=page_size):
        if taken == limit:
            more = True
            break
        taken += 1
        page.append(run)
        if len(page) == RUNS_PAGE_SIZE:
            emit(page)
            page = []
    if page:
        emit(page)
    if not printed:
        out.print("[]" if args.json else _no_runs(args))
    elif args.json:
        out.print("\n]")
    if more:
        left_out = f"(newest {limit} shown; --limit N for more, --all for every run)"
        if args.json:
            # On stderr: the document stays a list of runs, and a script piping it on (jq
            # '.[].id') would otherwise miss runs without a word.
            out.flush()  # the runs first, where both streams go to one terminal
            _complain(left_out)
        else:
            out.print(left_out)
    return EXIT_OK


def _indented(text: str) -> str:
    """``text``, every line two spaces further in: an item of an indented JSON list."""
    return "\n".join(f"  {line}" for line in text.split("\n"))


def _no_runs(args: argparse.Namespace) -> str:
    which = f"{args.status} runs" if args.status else "runs"
    return f"no {which} in {_shown(args)}"


def _runs_table(
    out: Terminal,
    runs: Sequence[Run],
    now: datetime,
    *,
    after: list[int] | None = None,
    digits: int | None = None,
) -> list[int]:
    """The table of ``runs`` (or its next part, ``after`` the widths of the part before, its
    counts padded to ``digits``, the widest job_count of the table); returns the widths used."""
    header = ["RUN ID", "STATUS", "PROGRESS", "AGE", "MANIFEST", "MODELS"]
    if digits is None:
        digits = max(len(str(run.job_count)) for run in runs)
    rows = [
        [
            str(run.id),
            run.status.value,
            f"{out.bar(run.done_count, run.job_count)} {_fraction(run, digits)}",
            _age(run.created_at, now),
            # Cut as the stream shows it: on one that cannot encode a character, its escape.
            _clip(out.shown(_printable(run.manifest)), 40 if out.tty else out.width, out.ellipsis),
        ]
        for run in runs
    ]
    used = sum(
        max(len(h), *(_columns(r[i]) for r in rows), *([] if after is None else [after[i]])) + 2
        for i, h in enumerate(header[:-1])
    )
    # The column is as wide as its heading at least, which the table shows whatever is left.
    room = max(out.width - used, len(header[-1]))
    for row, run in zip(rows, runs, strict=True):
        names = [out.shown(_listed(m)) for m in run.models]
        row.append(_fit_names(names, room, out.ellipsis))
    return _table(out, header, rows, after=after, status=1)


def _run_json(run: Run) -> dict[str, object]:
    """``run`` as --json gives it: as msgspec encodes it, but created_at as the store writes it,
    fixed width with microseconds, so text order is time order. msgspec drops a zero fraction:
    "2026-01-01T00:00:00Z" would sort after "2026-01-01T00:00:00.500000Z"."""
    created_at = _codec.format_timestamp(run.created_at, what="created_at")
    return msgspec.structs.asdict(run) | {"created_at": created_at}


def _fit_names(names: Sequence[str], width: int, ellipsis: str = "…") -> str:
    """As many of ``names`` as fit in ``width``, then "+N" for the rest; where not even the
    first fits whole, the first cut short (with ``ellipsis``) and "+N", else "N models".

    The most that fit is found from the lengths alone, then joined once: joining each count
    in turn to measure it took time quadratic in the number of models (3.7 s a row for a run
    of 20,000)."""
    count = len(names)
    widths = list(map(_columns, names))  # columns, not characters: a CJK name takes two each
    joined = sum(widths) + 2 * (count - 1)  # the columns of ", ".join(names): ", " between
    for shown in range(count, 0, -1):
        rest = f" +{count - shown}" if shown < count else ""
        if joined + len(rest) <= width:
            return ", ".join(names[:shown]) + rest
        joined -= widths[shown - 1] + 2  # the last name shown and the ", " before it
    if not names:
        return ""
    rest = f" +{count - 1}" if count > 1 else ""
    if width - len(rest) > len(ellipsis):  # a character of the name at least, and the mark
        return _clip(names[0], width - len(rest), ellipsis) + rest
    return f"{count} model{'' if count == 1 else 's'}"


def _fraction(run: Run, width: int = 0) -> str:
    """``done/job_count pct%``, the counts right-aligned to ``width`` digits (at least the
    run's own), so that the cells of a table's rows line up."""
    width = max(width, len(str(run.job_count)))
    percent = 100 * run.done_count // run.job_count if run.job_count else 100
    return f"{run.done_count:>{width}}/{run.job_count:<{width}} {percent:>3}%"


@dataclass(frozen=True, slots=True)
class _Scores:
    done: int
    scored: int
    errors: int
    mean_score: float | None
    min_score: float | None
    max_score: float | None


# Every float is an integer multiple of 2**-1074 (the smallest subnormal), so scaled by 2**1074
# a sum of floats is an exact Python int, kept in O(1) memory however many jobs stream by.
_EXACT_SCALE_BITS: Final = 1074


class _Tally:
    """One model's outcomes (or all of them), summed as jobs stream by, in O(1) memory.

    The mean is the exact mean rounded once: the exact sum divided by the count in one
    int / int, which Python rounds correctly. So the mean of equal scores is that score (a
    -0.0 gives 0.0: the sum is an int), and a mean always lies between the least and the
    greatest score, even where their sum is past
    the largest float (two scores of 1.7e308). ``math.fsum(scores) / len(scores)`` rounds twice,
    and can do neither: three scores of 5.174716367880626e16 have a mean of ...625e16 by it, and
    a sum past the largest float raises OverflowError. Min and max keep the first of equal
    values, as the builtins do (which decides the sign shown for a 0.0 beside a -0.0).
    """

    __slots__ = ("done", "errors", "max", "min", "scored", "sum")

    def __init__(self) -> None:
        self.done = 0
        self.scored = 0
        self.errors = 0
        self.sum = 0  # the exact sum of the scores, times 2**_EXACT_SCALE_BITS
        self.min: float | None = None
        self.max: float | None = None

    def add(self, outcome: JobOutcome) -> None:
        self.done += 1
        if outcome.error is not None:
            self.errors += 1
        score = outcome.score
        if score is not None:
            self.scored += 1
            numerator, denominator = score.as_integer_ratio()  # denominator: a power of two
            self.sum += numerator << (_EXACT_SCALE_BITS + 1 - denominator.bit_length())
            if self.min is None or score < self.min:
                self.min = score
            if self.max is None or score > self.max:
                self.max = score

    def scores(self) -> _Scores:
        mean = None
        if self.scored:
            mean = self.sum / (self.scored << _EXACT_SCALE_BITS)  # rounded once: see above
        return _Scores(self.done, self.scored, self.errors, mean, self.min, self.max)


# show tallies error messages in memory; a run whose every job failed with its own message (a
# job id in the text, say) would otherwise hold one entry per job. The first distinct messages
# are counted, up to these limits; errors with any later new message are only counted in all.
MAX_DISTINCT_ERRORS: Final = 10_000
MAX_ERROR_CHARS: Final = 4_000_000


@dataclass(frozen=True, slots=True)
class _Summary:
    """What show reports about a run's jobs."""

    counts: dict[str, int]
    overall: _Scores
    per_model: dict[str, _Scores]
    errors: Counter[str]
    untallied_errors: int  # errors whose message came after the limits above were reached


# Jobs per read when show walks a run: a few ms of decoding per page on the store's thread.
SHOW_PAGE_SIZE: Final = 1000


async def _summarise(store: Store, run: Run) -> _Summary:
    """Count and summarise the run's jobs page by page, in memory bounded by the number of
    models and by the error limits above, not by the number of jobs."""
    by_status = dict.fromkeys([status.value for status in JobStatus], 0)
    overall = _Tally()
    # The run's models first, in its order, then any other model as its first job comes.
    per_model = {model: _Tally() for model in run.models}
    errors: Counter[str] = Counter()
    error_chars = untallied = 0
    async for job in store.iter_jobs(run.id, page_size=SHOW_PAGE_SIZE):
        by_status[job.status.value] += 1
        tally = per_model.get(job.spec.model)
        if tally is None:
            tally = per_model[job.spec.model] = _Tally()
        outcome = job.outcome
        if outcome is None:
            continue
        overall.add(outcome)
        tally.add(outcome)
        error = outcome.error
        if error is not None:  # "" too (str() of a TimeoutError()): an error, as counted above
            if error in errors:
                errors[error] += 1
            elif len(errors) < MAX_DISTINCT_ERRORS and error_chars + len(error) <= MAX_ERROR_CHARS:
                errors[error] = 1
                error_chars += len(error)
            else:
                untallied += 1
    return _Summary(
        by_status,
        overall.scores(),
        {model: tally.scores() for model, tally in per_model.items()},
        errors,
        untallied,
    )


def _begin_read(conn: sqlite3.Connection) -> None:
    # Deferred: a read snapshot from the first read on, no lock, in WAL mode only. A file
    # switched out of it (a copy for read-only media) would hold SQLite's SHARED lock for the
    # whole walk, and every writer would wait on show, the store switching it back included.
    (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
    if str(mode).lower() == "wal":
        conn.execute("BEGIN")


def _end_read(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        conn.execute("COMMIT")


@contextlib.asynccontextmanager
async def _one_snapshot(store: Store) -> AsyncIterator[None]:
    """Within: every read of ``store`` (the CLI's own read-only store) sees one snapshot.

    show reads the run, then its jobs a page at a time: each read its own snapshot had it
    print, while outcomes were being recorded, a progress (the run's done_count) that its job
    counts and tallies contradict, a run 'running' with every job done, and counts of no
    single moment. One read transaction over them all costs no lock in WAL mode (writers go
    on; out of it there is none, see _begin_read), but keeps the -wal from being checkpointed
    past it while show reads, as check() does."""
    backend = store._connected()
    await backend.read(_begin_read)
    try:
        yield
    finally:
        if not store.closed:
            with contextlib.suppress(ControlError):  # a read transaction: ending it loses nothing
                await backend.read(_end_read)


async def cmd_show(args: argparse.Namespace, out: Terminal) -> int:
    """One run: its fields, its jobs counted by status, and a summary of their outcomes."""
    async with await _open_existing(args) as store, _one_snapshot(store):
        run = await store.get_run(args.run_id)
        if run is None:
            check = _command("check", *_given_url(args))
            raise NotFoundError(
                f"no run {args.run_id} in {_shown(args)} (a row edited to another spelling of "
                f"the id, upper case say, is not found by it: {check} names such rows); list "
                f"the runs with {_command('runs', *_given_url(args))}"
            )
        summary = await _summarise(store, run)
    counts, overall, per_model = summary.counts, summary.overall, summary.per_model
    errors, untallied = summary.errors, summary.untallied_errors
    if args.json:
        shown: dict[str, object] = {
            "run": _run_json(run),
            "jobs": counts,
            "outcomes": asdict(overall),
            "models": {model: asdict(s) for model, s in per_model.items()},
            "errors": [{"error": e, "count": n} for e, n in errors.most_common()],
        }
        if untallied:  # only past the limits: otherwise the output is what it always was
            shown["errors_not_tallied"] = untallied
        out.print(out.json(shown))
        return EXIT_OK
    now = datetime.now(UTC)
    # isoformat, not strftime: glibc's %Y writes year 1 as "1", not "0001".
    created = run.created_at.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "seconds")
    created += " UTC"
    fields = [
        ("run", str(run.id)),
        ("status", out.paint(run.status.value, _STATUS_COLOR[run.status.value])),
        ("progress", f"{out.bar(run.done_count, run.job_count, 24)} {_fraction(run)}"),
        ("manifest", _printable(run.manifest)),
        ("models", ", ".join(map(_listed, run.models))),
        ("epochs", str(run.epochs)),
        ("created", f"{created} ({_age(run.created_at, now)} ago)"),
        (
            "jobs",
            "  ".join(f"{status} {n:,}" for status, n in counts.items())
            + f"  (of {run.job_count:,})",
        ),
        ("outcomes", _describe(overall)),
    ]
    for name, value in fields:
        out.print(f"{name:<10}{value}")
    if overall.done:
        out.print()
        rows = [
            [
                _printable(model),
                f"{s.done:,}",
                f"{s.scored:,}",
                _score(s.mean_score),
                f"{s.errors:,}",
            ]
            for model, s in per_model.items()
        ]
        _table(out, ["MODEL", "DONE", "SCORED", "MEAN", "ERRORS"], rows)
    if errors or untallied:
        out.print()
        out.print("most common errors:")
        for error, n in errors.most_common(5):
            # Cut as the stream shows it: on one that cannot encode a character, its escape.
            shown_error = out.shown(_printable(error)) if error else "(no message)"
            out.print(f"  {n:>6,}  {_clip(shown_error, out.width - 10, out.ellipsis)}")
        if untallied:
            out.print(
                f"  {untallied:>6,}  more, not tallied by message: only the first "
                f"{MAX_DISTINCT_ERRORS:,} distinct messages ({MAX_ERROR_CHARS:,} characters) "
                "are counted"
            )
    return EXIT_OK


def _score(value: float | None) -> str:
    """A score for a table: three decimals, or in scientific notation from a billion up,
    where three decimals would fill the column with up to 309 digits (a score near the float
    limit). Judged as three decimals show it: 999999999.9996 reads 1000000000.000 otherwise,
    beside 1.000e+09 for a billion."""
    if value is None:
        return "-"
    return f"{value:.3e}" if abs(round(value, 3)) >= 1e9 else f"{value:.3f}"


def _describe(s: _Scores) -> str:
    if not s.done:
        return "none recorded yet"
    text = f"{s.done:,} recorded, {s.scored:,} scored, mean score {_score(s.mean_score)}"
    if s.scored:
        text += f" (min {_score(s.min_score)}, max {_score(s.max_score)})"
    return text + f", {counted(s.errors, 'error')}"


async def cmd_check(args: argparse.Namespace, out: Terminal) -> int:
    """Look for inconsistencies; exit 1 if there are any."""
    async with await _open_existing(args) as store:
        problems = await store.check()
    if args.json:
        out.print(out.json({"ok": not problems, "problems": problems}))
    elif problems:
        for problem in problems:
            where = _printable(f"{problem.table} {problem.row_id}".strip())
            out.print(f"{where}: {_printable(problem.message, data=False)}")
        plural = "s" if len(problems) != 1 else ""
        out.print(f"{len(problems)} problem{plural} found in {_shown(args)}")
    else:
        out.print(f"no problems found in {_shown(args)}")
    return EXIT_FAILURE if problems else EXIT_OK


async def cmd_demo(args: argparse.Namespace, out: Terminal) -> int:
    """Run the demo fleet and verify its invariants against the database."""
    try:
        from . import _demo  # only the demo needs multiprocessing and the fleet's code
    except OSError as exc:  # its file cannot be opened: out of file descriptors, say
        loading = f"the demo's code could not be loaded ({exc}); nothing was done"
        if exc.errno not in _migrate.RETRYABLE_ERRNOS:
            raise Failure(f"{loading}: reinstall control-store, then run it again") from exc
        # As the store's own refusal for want of descriptors or memory: a retry may cure it.
        error = StorageError(
            f"{loading}: close some files or raise the limit of open files (ulimit -n), then "
            "run it again"
        )
        error.retryable = True
        raise error from exc

    _check_demo_sizes(args)
    url = _url(args)
    with _naming_the_url(args):
        path = _parsed(url)
        if path == _sqlite.MEMORY:
            # Each scheduler process would open its own new, empty in-memory database: the runs
            # submitted here would never be claimed, and the checks would blame the store.
            raise UsageError(
                f"the demo cannot run on an in-memory database (URL {_sqlite.redact(url)!r}): "
                "its scheduler processes each open the URL, and would each get a new empty "
                "database; give it a file: --url sqlite://demo.db"
            )
    seed = _demo.new_seed() if args.seed is None else args.seed
    config = _demo.DemoConfig(
        url=url,
        runs=args.runs,
        models=args.models,
        samples=args.samples,
        epochs=args.epochs,
        schedulers=args.schedulers,
        processes=min(args.processes, args.schedulers),
        workers=args.workers,
        duplicate_rate=args.duplicate_rate,
        death_rate=args.death_rate,
        error_rate=args.error_rate,
        latency_ms=args.latency_ms,
        seed=seed,
        busy_timeout=float(getattr(args, "busy_timeout", DEMO_BUSY_TIMEOUT)),
    )
    human = not args.json
    with _naming_the_url(args):
        opened = await Store.connect(config.url, busy_timeout=config.busy_timeout)
    async with opened as store:
        _track(args, store)
        with _only_demo(config.url, path):
            queued = await store.list_runs(status=RunStatus.QUEUED, limit=1)
            if queued:
                raise Failure(
                    f"{_sqlite.redact(config.url)} already has queued runs (e.g. {queued[0].id}), "
                    "which the demo's schedulers would claim; run the demo on a database of its "
                    f"own, a new file: {_fresh_demo_command(path)}"
                )
            if human:
                _describe_demo(out, config)
                out.flush()  # now: a reader that is gone (demo | head -1) is noticed before work
            args.demo_stage = "submitting"
            args.demo_submitted = _demo.Submitted()
            args.demo_runs = config.runs
            runs = await _demo.submit(store, config, args.demo_submitted)
            progress = _Progress(out, config.total_jobs, config.runs, enabled=human)
            args.demo_stage = "running"
            try:
                result = await _demo.run_fleet(config, progress.update)
            except BaseException as exc:
                # The progress line ended first, so that the stop's line on stderr starts a
                # line of its own on a terminal (stdout gone, nothing is to be ended).
                with contextlib.suppress(Exception):
                    progress.finish()
                # Stopped (a signal, output gone, an error): run_fleet has ended every scheduler
                # process, and the runs they held would stay 'running' for good.
                args.demo_requeued = await _requeue_stranded(args, store, runs)
                if isinstance(exc, OSError):  # no process, pipe or shared memory to be had
                    raise Failure(
                        f"the demo's scheduler processes could not be started or watched "
                        f"({exc}); with fewer --processes the demo needs fewer processes and "
                        "open files (see ulimit -u and -n), and multiprocessing needs a "
                        "writable /dev/shm"
                    ) from exc
                raise
            # Finished only if every scheduler did its work: a stop sent to the whole process
            # group can end the schedulers first, and run_fleet return, before it reaches this
            # process; the stop then said the runs "had all finished" and left those the
            # schedulers held 'running'.
            args.demo_stage = "finished" if result.clean else "running"
            progress.finish()
            try:
                checks = await _demo.verify(store, config, runs, result)
            except BaseException:
                if not result.clean:  # stopped while verifying a fleet that failed
                    args.demo_requeued = await _requeue_stranded(args, store, runs)
                raise
            if not all(c.ok for c in checks):
                # A scheduler process that failed left its runs 'running': verified as they
                # were, then queued again, as for a stopped demo (every process has ended).
                args.demo_requeued = await _requeue_stranded(args, store, runs)
    ok = all(c.ok for c in checks)
    snap = result.snapshot
    if args.json:
        out.print(
            out.json(
                {
                    "ok": ok,
                    "config": asdict(config) | {"jobs_per_run": config.jobs_per_run},
                    "runs": [str(run.id) for run in runs],
                    "elapsed_seconds": round(snap.elapsed, 3),
                    "jobs_per_second": round(_jobs_per_second(snap), 1),
                    "deliveries": snap.deliveries,
                    "recorded": snap.recorded,
                    "duplicates_absorbed": snap.absorbed,
                    "redispatched": snap.redispatched,
                    "checks": [asdict(c) for c in checks],
                }
            )
        )
    else:
        _summarise_demo(out, config, snap, checks, ok, where=_given_url(args))
    if ok:
        return EXIT_OK
    failed = "; ".join(c.name for c in checks if not c.ok)
    retry = any(r.retryable for r in result.reports)
    again = ""
    if retry:
        # The file now holds this demo's unfinished runs, queued: a retry needs another file.
        again = (
            "; a scheduler stopped on an error a retry may cure: run the demo again on a new "
            f"file, {_fresh_demo_command(path)}"
        )
    requeued = _requeued(args)
    held = requeued if requeued is not None else f"; {_still_running(args, 'the runs')}"
    _complain(f"{PROG}: error: demo invariant failed: {failed}{held}{again}")
    # A scheduler stopped by what a retry may cure (a lock held past --busy-timeout, a full
    # disk): exit as any command failing so does.
    return EXIT_RETRY if retry else EXIT_FAILURE


# The demo's sizes, bounded by what a demo is for: a fleet at work on one machine, watched for
# a few minutes. Measured on 2 shared cores: 1,000,000 jobs (8 runs x 5 x 12,500 x 2) took
# 410 s of fleet time (about 2,400 jobs/s), 8.7 minutes in all, and the parent peaked at
# 193 MB, most of it the id of every first delivery the schedulers reported, which verify
# compares with the database (it walks the jobs a page at a time). More is no demo, and
# --samples 100000000000 would have asked for 10**12 jobs: days of work, terabytes of ids.
MAX_DEMO_JOBS: Final = 1_000_000
# Each scheduler process is a Python interpreter of its own (tens of MB), and all of them take
# turns at the one file's write lock: a few show the contention, dozens only add waiting.
MAX_DEMO_PROCESSES: Final = 32
# Scheduler tasks beyond this only queue at the write lock (and beyond --runs find nothing).
MAX_DEMO_SCHEDULERS: Final = 1_000
# A scheduler hands out a run's jobs a page at a time (_demo.DISPATCH_PAGE, 1,000), and starts
# at most one worker per job of the page: more workers would never start.
MAX_DEMO_WORKERS: Final = 1_000
_DEMO_SIZE_DEFAULTS: Final = {"runs": 8, "models": 5, "samples": 25, "epochs": 2}


def _check_demo_sizes(args: argparse.Namespace) -> None:
    """Refuse sizes that cannot be a demo, before anything is opened or written (exit 2)."""
    for name, limit, why in (
        (
            "processes",
            MAX_DEMO_PROCESSES,
            "each is a Python interpreter of its own, and all "
            "take turns at the one file's write lock: a few show it, more only wait",
        ),
        ("schedulers", MAX_DEMO_SCHEDULERS, "more only queue at the one file's write lock"),
        (
            "workers",
            MAX_DEMO_WORKERS,
            "a scheduler hands out 1,000 jobs at a time, one per "
            "worker at most, so more would never start",
        ),
    ):
        value = getattr(args, name)
        # --processes beyond --schedulers is cut to it (no process without a scheduler).
        if min(value, args.schedulers if name == "processes" else value) > limit:
            raise UsageError(
                f"--{name} {value} is more than the demo's limit of {limit:,}: {why}; "
                f"give --{name} {limit} or less"
            )
    sizes = {name: int(getattr(args, name)) for name in _DEMO_SIZE_DEFAULTS}
    jobs = sizes["runs"] * sizes["models"] * sizes["samples"] * sizes["epochs"]
    if jobs > MAX_DEMO_JOBS:
        # Name the size furthest above its default: the one the user most likely meant to try.
        name = max(sizes, key=lambda n: sizes[n] / _DEMO_SIZE_DEFAULTS[n])
        others = ", ".join(f"--{other}" for other in sizes if other != name)
        product = " x ".join(f"{value:,} {size}" for size, value in sizes.items())
        raise UsageError(
            f"--{name} {sizes[name]} is more than the demo can take: {product} is {jobs:,} "
            f"jobs, and the demo takes at most {MAX_DEMO_JOBS:,} (at a few thousand jobs/s, "
            "minutes of work, and its final check holds every job's id); give a smaller "
            f"--{name} (or lower {others})"
        )


def _describe_demo(out: Terminal, c: DemoConfig) -> None:
    out.print(
        # The URL as every message shows it: a newline or an ESC in a path typed is an escape.
        f"control-store demo on {_printable(_sqlite.redact(c.url), data=False)}: "
        f"{counted(c.runs, 'run')} x "
        f"{counted(c.jobs_per_run, 'job')} ({counted(c.models, 'model')} x "
        f"{counted(c.samples, 'sample')} x {counted(c.epochs, 'epoch')})"
    )
    processes = counted(c.processes, "process", "processes")
    out.print(
        f"  {counted(c.schedulers, 'scheduler')} in {processes}, "
        f"{counted(c.workers, 'worker')} each; "
        f"{c.duplicate_rate:.0%} of outcomes delivered twice, {c.death_rate:.0%} of dispatches "
        f"end with the worker dying before it acknowledges (seed {c.seed})"
    )


async def _requeue_stranded(
    args: argparse.Namespace, store: Store, runs: list[Run]
) -> int | ControlError:
    """Queue the runs a stopped demo's schedulers held again: how many, or why it failed (told
    by _demo_leftovers, not raised: the stop's own error goes on). Not interrupted by the stop:
    the store leaves the stop's list first."""
    from . import _demo

    with contextlib.suppress(ValueError):
        args.open_stores.remove(store)
    try:
        return await _demo.requeue_stranded(store, runs)
    except ControlError as exc:
        # A lock held past --busy-timeout, say: whether any run is held is read (reads go on
        # beside another connection's write), so that a demo whose schedulers claimed nothing
        # does not send its user to the recipe for runs left 'running'.
        with contextlib.suppress(ControlError):
            if not await _demo.held_runs(store, runs):
                return 0
        return exc


@contextlib.contextmanager
def _only_demo(url: str, path: str) -> Iterator[None]:
    """The demo's lock on the database ``url`` names at ``path`` (see _demo.only_demo_on),
    refused as a Failure."""
    from . import _demo

    try:
        with _demo.only_demo_on(path):
            yield
    except _demo.DemoLockFailed as failed:
        raise Failure(
            f"the demo cannot make its lock file {str(failed.path)!r} beside the database "
            f"({failed.error.strerror or failed.error}), which keeps a second demo off it: "
            "give the demo a database in a directory it may write, with a shorter name"
        ) from failed.error
    except _demo.DemoRunning as running:
        holder = "" if running.pid is None else f" (process {running.pid})"
        raise Failure(
            f"another demo is running on {_sqlite.redact(url)}{holder}, and two demos on one "
            "database would claim each other's runs; wait for it to end, or run this one on a "
            f"database of its own, a new file: {_fresh_demo_command(path)}"
        ) from None


def _fresh_demo_command(path: str) -> str:
    """The demo command for a new file beside ``path``, for a demo refused on ``path``."""
    fresh = Path(path).with_name(f"{Path(path).stem}-demo{Path(path).suffix or '.db'}")
    return _command("demo", *_url_option(_path_url(fresh)))


def _jobs_per_second(snap: Snapshot) -> float:
    """The fleet's rate: jobs recorded (each once, however often delivered) per second."""
    return snap.recorded / max(snap.elapsed, 1e-9)


def _summarise_demo(
    out: Terminal,
    c: DemoConfig,
    snap: Snapshot,
    checks: Sequence[Check],
    ok: bool,
    *,
    where: list[str],
) -> None:
    """The demo's closing lines; ``where``: the --url to name in the commands it suggests."""
    # The jobs recorded, not those submitted: a fleet that failed part-way did fewer.
    done = (
        counted(c.total_jobs, "job")
        if snap.recorded == c.total_jobs
        else f"{snap.recorded:,} of {counted(c.total_jobs, 'job')}"
    )
    deliveries = counted(snap.deliveries, "delivery", "deliveries")
    out.print(
        f"{done} in {snap.elapsed:.1f} s: {_jobs_per_second(snap):,.0f} jobs/s, "
        f"{deliveries}, {counted(snap.absorbed, 'duplicate')} absorbed "
        f"({counted(snap.redispatched, 'job')} dispatched again after a worker died)"
    )
    out.print("verified against the database:")
    for check in checks:
        out.print(f"  {out.mark(check.ok)} {check.name}: {check.detail}")
    if ok:
        setup, words = _shell_words(where)
        url = "".join(f" {word}" for word in words)
        out.print(f"look inside: {setup}{PROG} runs{url}   then   {PROG} show <RUN ID>{url}")


class _Progress:
    """Live progress: one line rewritten in place on a terminal, a plain line a second else."""

    def __init__(self, out: Terminal, jobs: int, runs: int, *, enabled: bool) -> None:
        self._out = out
        self._jobs = jobs
        self._runs = runs
        self._enabled = enabled
        self._last_line = 0.0
        self._shown = False
        self._drawn = 0  # columns of the line last drawn, which the next covers on a dumb one

    def _line(self, snap: Snapshot) -> str:
        rate = snap.recorded / snap.elapsed if snap.elapsed > 0 else 0.0
        width = len(f"{self._jobs:,}")
        return (
            f"{self._out.bar(snap.recorded, self._jobs, 20)} "
            f"{snap.recorded:>{width},}/{self._jobs:,} jobs recorded  "
            f"runs done {snap.runs_done:,}/{self._runs:,}  "
            f"duplicates absorbed {snap.absorbed:,}  {rate:,.0f} jobs/s"
        )

    def update(self, snap: Snapshot) -> None:
        if not self._enabled:
            return
        if self._out.tty:
            fits = min(self._out.width, self._out.columns or self._out.width) - 1
            line = _clip(self._line(snap), max(1, fits), self._out.ellipsis)
            if self._out.dumb:  # no ESC[K to erase the line: spaces cover what is left of it
                drawn, self._drawn = self._drawn, _columns(line)
                self._out.write("\r" + line + " " * max(0, drawn - self._drawn))
            else:
                self._out.write("\r\x1b[K" + line)
            self._out.flush()
            self._shown = True
        elif snap.elapsed - self._last_line >= 1.0:
            self._last_line = snap.elapsed
            self._out.print(self._line(snap))
            self._out.flush()  # a log read as it grows; and a reader gone is noticed at once

    def finish(self) -> None:
        if self._shown:
            self._out.write("\n")
            self._out.flush()


# ---------------------------------------------------------------------------------------------
# Arguments


_INT64_MAX: Final = 2**63 - 1  # SQLite's largest integer: the largest limit it can take


# int() and float() also read '1_000', ' 5', '+5', '1e3', 'nan', 'infinity' and other scripts'
# digits ('٣' is 3): a number on a command line is written in ASCII digits, or it is a typo.
_WHOLE: Final = re.compile(r"[0-9]+", re.ASCII)
_DECIMAL: Final = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)
_SEED: Final = re.compile(r"-?[0-9]+", re.ASCII)  # random.Random takes any int
_MOST_DIGITS: Final = 4300  # what int() reads of a text (sys.int_max_str_digits' default)


def _positive_int(text: str) -> int:
    if not _WHOLE.fullmatch(text):
        if text.startswith("-") and _WHOLE.fullmatch(text[1:]):
            raise argparse.ArgumentTypeError(f"{text} must be from 1 to {_INT64_MAX}")
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: write it in digits 0-9")
    digits = text.lstrip("0") or "0"  # int() counts leading zeros toward its 4,300 digits
    if len(digits) > len(str(_INT64_MAX)):
        raise argparse.ArgumentTypeError(
            f"a number of {len(digits):,} digits must be from 1 to {_INT64_MAX}"
        )
    value = int(digits)
    if not 1 <= value <= _INT64_MAX:
        raise argparse.ArgumentTypeError(f"{value} must be from 1 to {_INT64_MAX}")
    return value


def _seed(text: str) -> int:
    if not _SEED.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a seed: write a whole number in digits 0-9, as the demo prints it"
        )
    digits = text.lstrip("-").lstrip("0") or "0"
    if len(digits) > _MOST_DIGITS:
        raise argparse.ArgumentTypeError(
            f"a seed of {len(digits):,} digits is more than Python reads: give at most "
            f"{_MOST_DIGITS:,} digits"
        )
    return int(digits) * (-1 if text.startswith("-") else 1)


def _rate(limit: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        if not _DECIMAL.fullmatch(text):
            if text.startswith("-") and _DECIMAL.fullmatch(text[1:]):
                if float(text[1:]) == 0.0:
                    return 0.0  # -0 is 0
                raise argparse.ArgumentTypeError(f"{text} must be between 0 and {limit}")
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number: write it in digits 0-9, with a '.' for a fraction"
            )
        value = float(text)
        if not 0.0 <= value <= limit:
            raise argparse.ArgumentTypeError(f"{text} must be between 0 and {limit}")
        return value

    return parse


def _seconds(text: str) -> float:
    return _rate(86_400.0)(text)


def _run_id(text: str) -> uuid.UUID:
    # Not uuid.UUID(text): it also reads ' ', '+', '_' and non-ASCII digits, as another id.
    parsed = _codec.spelt_uuid(text)
    if parsed is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a run id; run ids are UUIDs, as '{PROG} runs' lists them"
        )
    return parsed


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose help fails as a command's output does: argparse drops an error
    writing it (a full disk, a closed stdout) and exits 0. Its subcommands' parsers are of the
    same class (add_subparsers makes them with the parent's)."""

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        if file is not None:
            super().print_help(file)
        elif not _emitted(self.format_help()):
            self.exit(EXIT_FAILURE)

    def error(self, message: str) -> NoReturn:
        """argparse's usage error, on stderr only and with its message escaped as every other
        error is: with stderr closed (2>&-) argparse printed the usage to stdout, into a pipe
        meant for JSON, and an argument's terminal escapes reached the terminal raw."""
        if sys.stderr is not None:
            with contextlib.suppress(OSError):
                self.print_usage(sys.stderr)
        _complain(f"{self.prog}: error: {message}")
        self.exit(EXIT_USAGE)


def _common(busy_timeout_default: str) -> _Parser:
    """The options every command takes; ``busy_timeout_default``: the default its help states
    (the demo's is longer: see DEMO_BUSY_TIMEOUT)."""
    common = _Parser(add_help=False)
    # SUPPRESS: an option given before the command is not overwritten by the command's default.
    common.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help=f"the store's URL (default: ${URL_ENV}, else {DEFAULT_URL})",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )
    common.add_argument(
        "--busy-timeout",
        type=_seconds,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help=f"how long to wait for another process's write lock (default: {busy_timeout_default})",
    )
    return common


class _Version(argparse.Action):
    """--version: this release, and the SQLite and Python it runs on (the first things a bug
    report needs). Read only when asked: importing importlib.metadata and reading the
    package's metadata cost every command ~45 ms at start-up (measured) when argparse's own
    version action, which takes the text up front, was used."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        import importlib.metadata  # here, not at the top: see the class docstring

        try:
            release = importlib.metadata.version("control-store")
        except importlib.metadata.PackageNotFoundError:  # a source tree never installed
            release = "(not installed)"
        python = ".".join(map(str, sys.version_info[:3]))
        # On stdout, as argparse's own version action prints it.
        line = f"{PROG} {release} (SQLite {sqlite3.sqlite_version}, Python {python})\n"
        parser.exit(EXIT_OK if _emitted(line) else EXIT_FAILURE)


def _parser() -> argparse.ArgumentParser:
    common = _common(f"{_DEFAULT_BUSY_TIMEOUT:g}")
    parser = _Parser(
        prog=PROG,
        parents=[_common(f"{_DEFAULT_BUSY_TIMEOUT:g}; demo: {DEMO_BUSY_TIMEOUT:g}")],
        description="Look into a control_store database, migrate it, or run the demo fleet.",
        epilog=f"exit codes: 0 ok, 1 failure (one line on stderr), 2 usage error, 3 failure a "
        "retry may cure (a lock held past --busy-timeout, a full disk), 130/143/129 stopped by "
        f"SIGINT/SIGTERM/SIGHUP. Try: {PROG} demo",
    )
    parser.add_argument(
        "--version",
        action=_Version,
        help="show the versions of control-store, SQLite and Python, then exit",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    migrate = commands.add_parser(
        "migrate", parents=[common], help="apply pending migrations (--status: list them)"
    )
    migrate.add_argument(
        "--status", action="store_true", help="list applied and pending migrations, change nothing"
    )
    migrate.set_defaults(command=cmd_migrate)

    runs = commands.add_parser("runs", parents=[common], help="a table of runs, newest first")
    runs.add_argument("--status", choices=[s.value for s in RunStatus], help="only these runs")
    how_many = runs.add_mutually_exclusive_group()
    how_many.add_argument(
        "--limit",
        type=_positive_int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N runs (default: {DEFAULT_LIMIT})",
    )
    how_many.add_argument("--all", action="store_true", help="every run, no limit")
    runs.set_defaults(command=cmd_runs)

    show = commands.add_parser(
        "show", parents=[common], help="one run: jobs by status and a summary of outcomes"
    )
    show.add_argument("run_id", type=_run_id, metavar="RUN_ID", help="the run's id (a UUID)")
    show.set_defaults(command=cmd_show)

    check = commands.add_parser(
        "check", parents=[common], help="look for inconsistencies (exit 1 if any)"
    )
    check.set_defaults(command=cmd_check)

    demo = commands.add_parser(
        "demo",
        parents=[_common(f"{DEMO_BUSY_TIMEOUT:g}")],
        help="run a small evaluation fleet and verify its invariants",
        description="Submit runs, start schedulers in OS processes that claim them and "
        "dispatch their jobs to simulated workers delivering at-least-once, then verify "
        "against the database that every job was counted exactly once. Its --busy-timeout "
        f"defaults to {DEMO_BUSY_TIMEOUT:g} s, not 5: its processes all start writing to one "
        f"file at once. Its sizes are a demo's: at most {MAX_DEMO_JOBS:,} jobs in all (R x M x "
        f"N x E), {MAX_DEMO_PROCESSES} processes, {MAX_DEMO_SCHEDULERS:,} schedulers, "
        f"{MAX_DEMO_WORKERS:,} workers per scheduler.",
    )
    sizes = demo.add_argument_group("sizes")
    sizes.add_argument("--runs", type=_positive_int, default=8, metavar="R", help="default: 8")
    sizes.add_argument("--models", type=_positive_int, default=5, metavar="M", help="default: 5")
    sizes.add_argument("--samples", type=_positive_int, default=25, metavar="N", help="default: 25")
    sizes.add_argument("--epochs", type=_positive_int, default=2, metavar="E", help="default: 2")
    sizes.add_argument(
        "--schedulers", type=_positive_int, default=4, metavar="S", help="default: 4"
    )
    sizes.add_argument(
        "--processes",
        type=_positive_int,
        default=2,
        metavar="P",
        help="OS processes the schedulers are spread over "
        f"(default: 2; at most {MAX_DEMO_PROCESSES})",
    )
    sizes.add_argument(
        "--workers", type=_positive_int, default=8, metavar="W", help="per scheduler (default: 8)"
    )
    behaviour = demo.add_argument_group("at-least-once delivery")
    behaviour.add_argument(
        "--duplicate-rate",
        type=_rate(1.0),
        default=0.10,
        metavar="F",
        help="share of outcomes delivered twice (default: 0.10)",
    )
    behaviour.add_argument(
        "--death-rate",
        type=_rate(0.9),
        default=0.05,
        metavar="F",
        help="chance per dispatch that the worker dies after delivering, before "
        "acknowledging, so the job goes out again (default: 0.05)",
    )
    behaviour.add_argument(
        "--error-rate",
        type=_rate(1.0),
        default=0.02,
        metavar="F",
        help="share of jobs whose evaluation reports an error (default: 0.02)",
    )
    behaviour.add_argument(
        "--latency-ms",
        type=_rate(10_000.0),
        default=2.0,
        metavar="MS",
        help="mean pretend evaluation time (default: 2)",
    )
    behaviour.add_argument(
        "--seed", type=_seed, default=None, help="seed of the delivery faults (default: random)"
    )
    demo.set_defaults(command=cmd_demo)
    return parser


Command = Callable[[argparse.Namespace, Terminal], Coroutine[Any, Any, int]]

# After a stop signal: how often the running statement is interrupted again (an interrupt that
# lands between two statements has no effect), and how long the clean-up may take before the
# process exits anyway. SQLite's lock wait (busy_timeout) ignores an interrupt: a command
# waiting on another process's lock would otherwise stay deaf for the whole wait. Exiting then
# is safe: a transaction cut short by the process's end is rolled back by SQLite.
INTERRUPT_REPEAT_SECONDS: Final = 0.1
STOP_GRACE_SECONDS: Final = 3.0


def _track(args: argparse.Namespace, store: Store) -> Store:
    """Remember ``store``, so that a stop signal can interrupt what runs on it."""
    args.open_stores.append(store)
    return store


def _interrupt(stores: Sequence[Store]) -> None:
    for store in stores:
        store._interrupt()  # the CLI is part of the package: the private hook is its own


async def _supervise(
    command: Command,
    args: argparse.Namespace,
    out: Terminal,
    stuck: Callable[[int], None] = lambda signum: None,
) -> int:
    """Run ``command``; a stop signal cancels it, so its clean-up runs, then raises Interrupted.

    Cancelling rather than raising KeyboardInterrupt wherever the signal lands: the command's
    finally-clauses (the demo terminating its children, a store closing) run in order. The
    statement running on any open store is interrupted; ``stuck(signum)`` is called if the
    command has still not ended STOP_GRACE_SECONDS later.
    """
    loop = asyncio.get_running_loop()
    args.open_stores = []
    _STOPPED_WRITING.clear()  # a signal an earlier main() in this process got

    async def run() -> int:
        code = await command(args, out)
        out.flush()  # here, where a stop signal that comes while it is blocked ends it
        return code

    task = loop.create_task(run())
    received: list[int] = []

    def interrupt() -> None:
        if not task.done():
            _interrupt(args.open_stores)
            loop.call_later(INTERRUPT_REPEAT_SECONDS, interrupt)

    def stop(signum: int) -> None:
        if not received:
            received.append(signum)
            task.cancel()
            interrupt()
            loop.call_later(STOP_GRACE_SECONDS, lambda: None if task.done() else stuck(signum))

    installed: list[tuple[int, Any]] = []
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:  # nohup, a script's background job: the caller's choice
            continue
        try:
            loop.add_signal_handler(signum, stop, signum)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
            continue
        installed.append((signum, previous))
        signal.signal(signum, _unblock_output)
    try:
        code = await task
    except asyncio.CancelledError:
        if received:
            raise Interrupted(received[0]) from None
        raise
    else:
        if _STOPPED_WRITING:  # its last write, ended by the signal before asyncio's stop came
            raise Interrupted(_STOPPED_WRITING[0])
        return code
    finally:
        for signum, previous in installed:
            loop.remove_signal_handler(signum)
            signal.signal(signum, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 0 for --help, 2 for a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not hasattr(args, "json"):
        args.json = False
    restore = [_tolerant(sys.stdout), _tolerant(sys.stderr)]
    try:
        return _main(args)
    finally:
        for undo in restore:
            undo()


def _interrupted(args: argparse.Namespace, signum: int, started: float) -> str:
    elapsed = time.perf_counter() - started
    message = f"{PROG}: {_launch.interrupted(signum)} after {elapsed:.1f} s"
    if args.command is cmd_demo:
        message += f"; {_demo_leftovers(args)}"
    return message


def _exit_now(args: argparse.Namespace, started: float, signum: int) -> None:
    """End the process at once: the clean-up after a stop signal is stuck in SQLite (a lock
    wait), and SQLite rolls back whatever the process's end cuts short."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    _complain(_interrupted(args, signum, started) + " (stopped while waiting for the database)")
    os._exit(128 + signum)


_LINE_BREAKS: Final = re.compile(r"\s*[\r\n]+\s*")


def _complain(line: str) -> None:
    """Write ``line`` to stderr, if there is a stderr that works: the exit code still tells."""
    if sys.stderr is None:  # started with stderr closed (2>&-): print would pick stdout
        return
    with contextlib.suppress(OSError):
        print(_printable(line, data=False), file=sys.stderr)
        sys.stderr.flush()


def _emitted(text: str) -> bool:
    """Write ``text`` to stdout and flush it, outside any command (--version, --help's
    flush): False once the failure is told, in one line as a command tells it."""
    if sys.stdout is None:  # started with stdout closed (>&-)
        _complain(
            f"{PROG}: error: standard output is closed: run it with its output going "
            "somewhere (a file, a pipe, /dev/null)"
        )
        return False
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        _silence_stdout()
        if not isinstance(exc, BrokenPipeError):  # a reader gone is no error to tell
            _complain(f"{PROG}: error: cannot write to standard output ({exc})")
        return False
    return True


def _silence_stdout() -> None:
    """Point stdout at devnull, so the interpreter's final flush of what could not be written
    does not fail a second time ("Exception ignored ... BrokenPipeError")."""
    with contextlib.suppress(OSError, ValueError):  # io.UnsupportedOperation: no fd
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _demo_leftovers(args: argparse.Namespace) -> str:
    """What a demo stopped early left behind, and what to do about it."""
    stage = getattr(args, "demo_stage", None)
    refused = (
        "a later demo refuses that file while it holds a queued run: delete the file (and "
        "any -wal and -shm left beside it), or give the next demo another --url"
    )
    if stage == "submitting":
        # Only what the store confirmed written (see _demo.submit): a run's jobs go in one
        # transaction, after the run itself.
        submitted = args.demo_submitted
        written = len(submitted.runs)
        if submitted.without_jobs is not None and not written:
            return (
                f"it had written only run {submitted.without_jobs.id} to {_shown(args)}, "
                f"without its jobs (stopped while they were being written); {refused}"
            )
        if submitted.without_jobs is not None:
            return (
                f"it had written {written} of its {counted(args.demo_runs, 'run')} with their "
                f"jobs to {_shown(args)}, and run {submitted.without_jobs.id} without its jobs "
                f"(stopped while they were being written); {refused}"
            )
        if written:
            return (
                f"it had written {written} of its {counted(args.demo_runs, 'run')} with their "
                f"jobs to {_shown(args)}, none of them started; {refused}"
            )
    if stage in (None, "submitting"):
        return f"it had submitted no runs to {_shown(args)}"
    if stage == "finished":
        return f"its runs had all finished in {_shown(args)}"
    # The runs its stopped schedulers held were queued again (see _requeue_stranded), so a
    # run not done is queued: the next demo refuses the file while one is.
    requeued = _requeued(args)
    if requeued is None:
        return (
            f"its unfinished runs stay in {_shown(args)}, and {_still_running(args, 'those')}; "
            f"{refused}"
        )
    return f"its unfinished runs stay in {_shown(args)}{requeued}, and {refused}"


def _requeued(args: argparse.Namespace) -> str | None:
    """How many runs a stopped or failed demo's schedulers held were queued again (see
    _requeue_stranded), as a note: " (... queued again)", "" for none; None where queueing
    them again failed or never finished (_still_running says so)."""
    requeued: int | ControlError | None = getattr(args, "demo_requeued", None)
    if not isinstance(requeued, int):
        return None
    if not requeued:
        return ""
    if requeued == 1:
        return " (the run its schedulers held was queued again)"
    return f" (the {requeued:,} runs its schedulers held were queued again)"


def _still_running(args: argparse.Namespace, those: str) -> str:
    """``those`` runs (as the sentence names them) a demo's schedulers held stay 'running':
    why (queueing them again failed, or never finished), and how to queue them by hand."""
    requeued: int | ControlError | None = getattr(args, "demo_requeued", None)
    # Failed, or never done (stopped at once while it waited for another process's lock).
    why = (
        "queueing them again did not finish"
        if requeued is None
        else f"queueing them again failed ({_LINE_BREAKS.sub(' ', str(requeued))})"
    )
    find = _command("runs", "--status", "running", "--all", *_given_url(args))
    return (
        f"{those} its schedulers held stay 'running': {why}; queue them again with the UPDATE "
        f"of README's recipe for runs a killed scheduler left (find them with {find})"
    )


def _main(args: argparse.Namespace) -> int:
    command: Command = args.command
    started = time.perf_counter()
    if sys.stdout is None:  # started with stdout closed (>&-): nothing could be shown
        _complain(
            f"{PROG}: error: standard output is closed; nothing was done: run the command "
            "with its output going somewhere (a file, a pipe, /dev/null)"
        )
        return EXIT_FAILURE
    out = Terminal.of(sys.stdout)
    try:
        _launch.started()  # stop signals: the command's own handling from here (_supervise)
        code = asyncio.run(_supervise(command, args, out, partial(_exit_now, args, started)))
    except (ControlError, Failure) as exc:
        # One line, whatever the message held; other whitespace kept (a path's double space).
        message = _LINE_BREAKS.sub(" ", str(exc))
        if isinstance(exc, DatabaseBusyError):
            message += " (here: --busy-timeout SECONDS)"
        if getattr(args, "url_error", None) is exc and getattr(args, "url_from_env", False):
            message += f" {_FROM_ENV}"
        if command is cmd_demo and getattr(args, "demo_stage", None) in ("submitting", "running"):
            message += f"; so the demo stopped; {_demo_leftovers(args)}"
        _complain(f"{PROG}: error: {message}")
        if isinstance(exc, UsageError):
            return EXIT_USAGE
        return EXIT_RETRY if isinstance(exc, ControlError) and exc.retryable else EXIT_FAILURE
    except OutputError as exc:
        _silence_stdout()
        elapsed = time.perf_counter() - started
        if command is cmd_demo:
            # The demo stops when its output does, as a program killed by SIGPIPE would; but
            # unlike a read command it leaves work behind, so it says so.
            _complain(
                f"{PROG}: error: cannot write to standard output ({exc.error}) after "
                f"{elapsed:.1f} s, so the demo stopped; {_demo_leftovers(args)}"
            )
        elif (done := getattr(args, "migrated", None)) is not None or not isinstance(
            exc.error, BrokenPipeError
        ):
            # A migrate whose reader went away (migrate | grep -q applied) wrote all the same:
            # its exit 1 must not read as a migrate that failed, so it says so, as on a full disk.
            _complain(
                f"{PROG}: error: cannot write to standard output ({exc.error})"
                + (
                    ""
                    if done is None
                    else f"; the migrate succeeded: database is at migration {done}"
                )
            )
        # A reader that went away (`control-store runs | head`) is no error to tell: the
        # command stops quietly, as a program killed by SIGPIPE does.
        return EXIT_FAILURE
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        _complain(_interrupted(args, signum, started))
        return 128 + signum
    except MemoryError:
        # The machine (or a ulimit -v) refused memory. By now the frames that held it are gone,
        # so one line can be written; a traceback would tell the user nothing more.
        elapsed = time.perf_counter() - started
        message = f"{PROG}: error: out of memory after {elapsed:.1f} s"
        if command is cmd_demo:
            message += f", so the demo stopped; {_demo_leftovers(args)}; try smaller sizes"
        else:
            message += "; free some memory (or raise the process's limit) and run it again"
        _complain(message)
        return EXIT_FAILURE
    return code
