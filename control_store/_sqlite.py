"""The SQLite backend: URL and options, SQL text, the connection's thread, error translation.

Everything SQLite-specific lives here, so that another backend is an addition, not a rewrite.

Shape of every call: the whole transaction is one synchronous function run on aiosqlite's
worker thread, so each call costs one thread hop (~15-20 µs) and no transaction can be left
open by a cancelled task: the function always ends in COMMIT or ROLLBACK before the thread
takes the next one. On an in-memory database, small calls (a bounded number of rows) run the
same function inline on the event loop's thread instead, with no hop: there is no file to
wait on, so they cannot block the loop for long (see SqliteBackend._inline_ok). Write calls
that arrive while the thread is busy are grouped into one transaction and one commit (group
commit), each in its own savepoint, so one caller's error rolls back only its own work and
every caller gets its own result only after the commit that holds its write.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import math
import operator
import os
import re
import sqlite3
import stat
import sys
import threading
import time
import types
import urllib.parse
import uuid
import warnings
from collections import Counter
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    MappingView,
    Sequence,
    Set,
)
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any, Final, NamedTuple, NoReturn, TypeVar, cast

import aiosqlite
import aiosqlite.core

from . import _codec, _migrate
from ._show import counted, failure, is_a, shown, typed
from .errors import (
    AlreadyExistsError,
    ConfigurationError,
    ConstraintError,
    ControlError,
    CorruptRowError,
    DatabaseBusyError,
    InvalidInputError,
    MigrationError,
    MissingRunError,
    NotFoundError,
    PendingMigrationError,
    ReadOnlyStoreError,
    StorageError,
    StoreClosedError,
    WrongEventLoopError,
    WrongRunError,
)
from .models import Job, JobStatus, Problem, Run, utc_now

T = TypeVar("T")
_E = TypeVar("_E", bound=BaseException)
Op = Callable[[sqlite3.Connection], T]

# SQLite's name for an in-memory database: what parse_url returns for one. As a caller's path
# it is refused (see parse_url): only MEMORY_URL, and Store.in_memory(), ask for memory.
MEMORY: Final = ":memory:"
MEMORY_URL: Final = "sqlite::memory:"
# Error names meaning "another connection holds the lock": wait and retry, or report busy.
_BUSY: Final = ("SQLITE_BUSY", "SQLITE_LOCKED")
_SCHEME: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_CREDENTIALS: Final = re.compile(r"//([^/@:]*):[^/@]*@")
_URL_CREDENTIALS: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)//([^/@:]*):[^/@]*@")

# ---------------------------------------------------------------------------------------------
# SQL. Columns are listed in _codec.RUN_COLUMNS / JOB_COLUMNS order; values are always bound.

_RUN_COLUMNS: Final = _codec.RUN_COLUMNS
_JOB_COLUMNS: Final = _codec.JOB_COLUMNS

INSERT_RUN: Final = f"INSERT INTO runs ({_RUN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
SELECT_RUN: Final = f"SELECT {_RUN_COLUMNS} FROM runs WHERE id = ?"
INSERT_JOB: Final = f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)"
SELECT_JOB: Final = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?"
# rowid: jobs come back in the order they were inserted.
SELECT_JOBS_OF_RUN: Final = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE run_id = ? ORDER BY rowid"
# iter_jobs' pages, in list_jobs' order (rowid), by keyset: each page starts after the last
# rowid of the one before, so reading page k costs the same as reading page 1 (an OFFSET would
# step over every row before it). idx_jobs_run keys (run_id, rowid), so "run_id = ? AND rowid
# > ?" is one range seek in it. The first page has its own statement rather than "rowid > some
# minimum": a hand-inserted row may hold any rowid, even -2**63, and list_jobs would return it.
SELECT_FIRST_JOB_PAGE: Final = (
    f"SELECT rowid, {_JOB_COLUMNS} FROM jobs WHERE run_id = ? ORDER BY rowid LIMIT ?"
)
SELECT_NEXT_JOB_PAGE: Final = (
    f"SELECT rowid, {_JOB_COLUMNS} FROM jobs WHERE run_id = ? AND rowid > ? ORDER BY rowid LIMIT ?"
)

# The claim is one statement, so two claimers can never both see the same run as queued: the
# subquery and the update run under the write lock that BEGIN IMMEDIATE took. idx_runs_status
# serves the subquery (status, created_at, then the implicit rowid for ties in insertion order).
# RETURNING keeps the lock and reports rowcount 0 until every row is fetched: fetch all at once.
# By rowid, which the index carries, rather than id: no second lookup in the id index.
CLAIM_NEXT_RUN: Final = f"""
UPDATE runs SET status = 'running'
WHERE rowid = (
    SELECT rowid FROM runs WHERE status = 'queued' ORDER BY created_at, rowid LIMIT 1
)
RETURNING {_codec.CLAIMED_COLUMNS}
"""

# The batch claim: the same guard as CLAIM_NEXT_RUN over the oldest `limit` queued runs, in one
# statement under one write lock, so a run is never in two claimers' batches. RETURNING gives
# rows in no promised order: it also returns the rowid, and op_claim_runs sorts by
# (created_at, rowid), the subquery's order.
CLAIM_RUNS: Final = f"""
UPDATE runs SET status = 'running'
WHERE rowid IN (
    SELECT rowid FROM runs WHERE status = 'queued' ORDER BY created_at, rowid LIMIT ?
)
RETURNING {_codec.CLAIMED_COLUMNS}
"""

# A claim whose caller was cancelled before it received the runs gives them back (see
# SqliteBackend.write's undo): only while still running, which they stay until that caller, the
# only one who could have worked on them, records their jobs.
RELEASE_RUN: Final = "UPDATE runs SET status = 'queued' WHERE id = ? AND status = 'running'"
# Whether a job id is among the jobs table's last N rows (see _inserted_by_this_call).
SELECT_LATEST_JOB: Final = (
    "SELECT 1 FROM (SELECT id FROM jobs ORDER BY rowid DESC LIMIT ?) WHERE id = ?"
)
SELECT_LARGEST_JOB_ROWID: Final = "SELECT max(rowid) FROM jobs"
_LARGEST_ROWID: Final = 2**63 - 1

# The record's guard: only a job of this run that is not yet done changes, so a redelivered
# outcome (at-least-once delivery) changes nothing and the first delivery wins.
# Only a job as the store leaves one before its outcome, queued or running with no outcome:
# a row edited by hand into another state (done without an outcome, or an outcome on a job not
# done) is refused by _why_unrecorded, not taken as new work or as a redelivery.
MARK_JOB_DONE: Final = """
UPDATE jobs SET status = 'done', outcome = ?
WHERE id = ? AND run_id = ? AND status IN ('queued', 'running') AND outcome IS NULL
"""
# Run only when MARK_JOB_DONE changed exactly one row: progress advances once per job. The
# typeof() guards refuse to build on a counter someone overwrote by hand (SQLite would happily
# compute 'abc' + 1 = 1): the caller then reports the row and the whole record rolls back.
ADVANCE_RUN: Final = """
UPDATE runs
SET done_count = done_count + 1,
    status = CASE WHEN done_count + 1 >= job_count THEN 'done' ELSE status END
WHERE id = ? AND typeof(done_count) = 'integer' AND typeof(job_count) = 'integer'
"""
SELECT_RUN_COUNTERS: Final = "SELECT id, job_count, done_count FROM runs WHERE id = ?"
# The batch record's single advance: `n` newly done jobs of one run move its counter once,
# with the same guards as ADVANCE_RUN.
ADVANCE_RUN_BY: Final = """
UPDATE runs
SET done_count = done_count + ?,
    status = CASE WHEN done_count + ? >= job_count THEN 'done' ELSE status END
WHERE id = ? AND typeof(done_count) = 'integer' AND typeof(job_count) = 'integer'
"""
# insert_jobs' guard, once per run of the batch after its rows went in (0002_job_rows): the
# run's count of jobs moves by the number inserted, only while it stays within job_count, and,
# as in ADVANCE_RUN, only over counters that are integers.
ADD_JOB_ROWS: Final = """
UPDATE runs SET job_rows = job_rows + ?
WHERE id = ? AND job_rows + ? <= job_count AND job_rows >= 0
    AND typeof(job_rows) = 'integer' AND typeof(job_count) = 'integer'
"""
SELECT_JOB_ROWS: Final = "SELECT job_count, job_rows FROM runs WHERE id = ?"
# A job of this insert_jobs call for a run that turned out to be missing: the call's rows are
# the run's newest, and idx_jobs_run keys (run_id, rowid), so this is one seek.
SELECT_NEWEST_JOB_OF_RUN: Final = "SELECT id FROM jobs WHERE run_id = ? ORDER BY rowid DESC LIMIT 1"
SELECT_RUNS: Final = f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY created_at DESC, rowid DESC LIMIT ?"
SELECT_RUNS_BY_STATUS: Final = (
    f"SELECT {_RUN_COLUMNS} FROM runs WHERE status = ? ORDER BY created_at DESC, rowid DESC LIMIT ?"
)
# iter_runs' pages: list_runs' order, each page after the (created_at, rowid) of the last run of
# the page before, through idx_runs_created or idx_runs_status. The next page is the rest of the
# last run's created_at (rowid below its rowid) and then the older created_at values, each one
# range seek, merged (at most twice the page, sorted): the row value (created_at, rowid) < (?, ?)
# seeks on created_at alone and filters rowid, so every page re-read the ties already walked,
# quadratic over runs submitted with one created_at (200k: each page 50k steps slower).
_RUN_PAGE: Final = f"SELECT created_at, rowid, {_RUN_COLUMNS} FROM runs"
_RUN_PAGE_ORDER: Final = "ORDER BY created_at DESC, rowid DESC LIMIT ?"
_TIES_FIRST: Final = "ORDER BY 1 DESC, 2 DESC LIMIT ?"  # by created_at, rowid: the merge


def _next_run_page(where: str) -> str:
    """The next page's SQL, with ``where`` (ending in AND, or empty) before its own conditions:
    the parameters are where's, created_at, rowid, limit, where's, created_at, limit, limit."""
    return (
        f"SELECT * FROM ({_RUN_PAGE} WHERE {where} created_at = ? AND rowid < ? "
        "ORDER BY rowid DESC LIMIT ?) "
        f"UNION ALL SELECT * FROM ({_RUN_PAGE} WHERE {where} created_at < ? {_RUN_PAGE_ORDER}) "
        f"{_TIES_FIRST}"
    )


SELECT_FIRST_RUN_PAGE: Final = f"{_RUN_PAGE} {_RUN_PAGE_ORDER}"
SELECT_NEXT_RUN_PAGE: Final = _next_run_page("")
SELECT_FIRST_RUN_PAGE_BY_STATUS: Final = f"{_RUN_PAGE} WHERE status = ? {_RUN_PAGE_ORDER}"
SELECT_NEXT_RUN_PAGE_BY_STATUS: Final = _next_run_page("status = ? AND")

# The check's view of every run's counters beside what its jobs say. A job counts as done when
# it has an outcome, not by its status: the check's repair for a job whose status disagrees
# with its outcome makes the status follow the outcome, so this is the count once every repair
# is made, and the run's repairs (done_count, status) agree with the jobs' instead of undoing
# them. One pass over jobs, grouped in SQL: no row of jobs comes up to Python.
CHECK_RUN_COUNTERS: Final = """
SELECT r.id, r.status, r.job_count, r.done_count, COALESCE(j.done, 0), COALESCE(j.total, 0),
    r.job_rows
FROM runs AS r
LEFT JOIN (
    SELECT run_id, SUM(outcome IS NOT NULL) AS done, COUNT(*) AS total FROM jobs GROUP BY run_id
) AS j ON j.run_id = r.id
"""
# Jobs whose run_id names no run: the schema's one foreign key (0001), checked directly rather
# than by PRAGMA foreign_key_check, which names a row by its rowid where the finding wants the
# job's id and the missing run's. One probe of runs' primary key per job, as that pragma does.
CHECK_ORPHAN_JOBS: Final = """
SELECT j.id, j.run_id, j.outcome IS NOT NULL FROM jobs AS j
WHERE NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.id = j.run_id)
"""
# Ids the store wrote are canonical UUID text (lower-case hex, hyphenated), and every lookup
# by id binds that text: a row hand-inserted with another spelling of a UUID (upper case, no
# hyphens, braces) decodes, so it is listed and claimed, yet get_run, insert_jobs and
# record_job_outcome never find it. These scans stay in SQL and only offenders come up to
# Python. Text that parses as a UUID is canonical exactly when it has the canonical shape (36
# characters, hyphens at 9, 14, 19, 24: any hyphen elsewhere leaves fewer than 32 hex digits)
# and no upper case; testing that is a third of the cost of a GLOB with a [0-9a-f] class per
# character (0.5 s against 1.7 s over a million jobs here). What the filter lets through that
# is no UUID at all is left to the decoders' finding.
UUID_SHAPE_GLOB: Final = "????????-????-????-????-????????????"
CHECK_NONCANONICAL_RUN_IDS: Final = """
SELECT id FROM runs WHERE typeof(id) = 'text' AND (id NOT GLOB ? OR id != lower(id))
ORDER BY rowid
"""
CHECK_NONCANONICAL_JOB_IDS: Final = """
SELECT id FROM jobs WHERE typeof(id) = 'text' AND (id NOT GLOB ? OR id != lower(id))
ORDER BY rowid
"""
CHECK_JOB_OUTCOMES: Final = """
SELECT id, status, outcome IS NOT NULL FROM jobs
WHERE (status = 'done') != (outcome IS NOT NULL)
"""
SELECT_ALL_RUNS: Final = f"SELECT {_RUN_COLUMNS} FROM runs"
SELECT_ALL_JOBS: Final = f"SELECT {_JOB_COLUMNS} FROM jobs"

# Why a record changed nothing: no such job, another run's job, or a redelivery.
SELECT_JOB_RUN: Final = "SELECT run_id FROM jobs WHERE id = ?"
SELECT_JOB_STATE: Final = "SELECT run_id, status, outcome IS NOT NULL FROM jobs WHERE id = ?"
SELECT_MISSING_RUN: Final = "SELECT 1 FROM runs WHERE id = ?"
SELECT_JOB_EXISTS: Final = "SELECT 1 FROM jobs WHERE id = ?"
# check(): what a job stored twice adds to its run's counts.
SELECT_JOB_COUNTS: Final = "SELECT run_id, outcome IS NOT NULL FROM jobs WHERE id = ?"
# check(): what the jobs of a run stored twice add to the counts of the row that stays.
SELECT_RUN_JOB_COUNTS: Final = (
    "SELECT COALESCE(SUM(outcome IS NOT NULL), 0), COUNT(*) FROM jobs WHERE run_id = ?"
)

# What a database holds besides SQLite's own objects (sqlite_schema is sqlite_master's
# other name since 3.33; our floor is 3.35).
SCHEMA_NAMES: Final = "SELECT name FROM sqlite_schema WHERE name NOT LIKE 'sqlite^_%' ESCAPE '^'"

CREATE_TRACKING_TABLE: Final = f"""
CREATE TABLE IF NOT EXISTS {_migrate.TRACKING_TABLE} (
    version         INTEGER PRIMARY KEY NOT NULL,
    description     TEXT    NOT NULL,
    installed_on    TEXT    NOT NULL,
    success         INTEGER NOT NULL,
    checksum        BLOB    NOT NULL,
    execution_time  INTEGER NOT NULL
)
"""
# check(): every object of the schema but SQLite's own, views and triggers too (a view may
# stand where a table should), in the order made (a table before its indexes); and what it
# compares of each table and index.
SELECT_OBJECTS: Final = (
    "SELECT type, name, tbl_name, sql FROM sqlite_schema "
    "WHERE name NOT LIKE 'sqlite^_%' ESCAPE '^' ORDER BY rowid"
)
SELECT_COLUMNS: Final = "SELECT * FROM pragma_table_info(?)"
SELECT_FOREIGN_KEYS: Final = "SELECT * FROM pragma_foreign_key_list(?)"
# index_xinfo, not index_info: with each key column's order and collation, which decide what
# the index can serve (one made COLLATE NOCASE serves no ORDER BY created_at, and each page of
# iter_runs then scanned the table while check() called the index sound).
SELECT_INDEX_COLUMNS: Final = "SELECT * FROM pragma_index_xinfo(?) ORDER BY seqno"
SELECT_INDEXES: Final = "SELECT * FROM pragma_index_list(?)"
SELECT_APPLIED: Final = (
    f"SELECT version, description, checksum, success, installed_on "
    f"FROM {_migrate.TRACKING_TABLE} ORDER BY version"
)
INSERT_APPLIED: Final = (
    f"INSERT INTO {_migrate.TRACKING_TABLE} "
    "(version, description, installed_on, success, checksum, execution_time) "
    "VALUES (?, ?, ?, 1, ?, ?)"
)
# What holds the migration history's name (a table, as made; a view or an index made by hand),
# or nothing. Names are SQLite's: case-insensitive, shared by tables, views and indexes.
SELECT_TRACKING_KIND: Final = (
    "SELECT type FROM sqlite_schema WHERE name = ? COLLATE NOCASE AND type != 'trigger'"
)


# ---------------------------------------------------------------------------------------------
# URL and options


@dataclass(frozen=True, slots=True)
class Options:
    """What ``Store.connect(url, **options)`` accepts, validated."""

    busy_timeout: float
    synchronous: str
    migrate: bool
    read_only: bool = False
    # Private (no keyword sets it): the CLI's `migrate --status` reads a schema of any version
    # read-only, to list what is pending; every other read-only store refuses one at connect.
    check_schema: bool = True


_SYNCHRONOUS: Final = ("OFF", "NORMAL", "FULL", "EXTRA")


def redact(url: str) -> str:
    """``url`` with any password replaced, fit to appear in a message. Only a URL's: a plain
    path such as d//u:p@x.db names that file, and shown changed it would name another."""
    return _URL_CREDENTIALS.sub(r"\1//\2:***@", url)


@dataclass(frozen=True, slots=True)
class UrlFixes:
    """The fixes parse_url's refusals give, in the words of whoever passed the URL: a caller of
    Store.connect, or a user of the command line (cli.py's own), for whom keyword arguments
    and pathlib mean nothing."""

    path_itself: str
    """How to pass a path as it is, undecoded."""
    options: str
    """Where options go instead of a URL's query."""
    as_file: str
    """How to name the file {path}, whose name reads as a URL with a scheme."""
    memory: str
    """How to get an in-memory store, or a file named ':memory:'."""


LIBRARY_FIXES: Final = UrlFixes(
    path_itself="pass the path itself, as a str or a pathlib.Path",
    options="pass options as keyword arguments: Store.connect(url, busy_timeout=...)",
    as_file="pass it as ./{path} or a pathlib.Path",
    memory=(
        f"for an in-memory store use Store.in_memory() (or the URL {MEMORY_URL}); for a file "
        "named ':memory:', pass './:memory:' as a str (pathlib drops the './'), or an absolute "
        "path such as Path.cwd() / ':memory:'"
    ),
)


def _percent_decoded(url: str, path: str, fixes: UrlFixes) -> str:
    """A sqlite URL's path with its %XX escapes decoded, as sqlx reads it: the URL
    sqlite://my%20runs.db (shared with a service using sqlx, say) is the file "my runs.db",
    never a new file named "my%20runs.db" beside it. A % not followed by two hex digits stays;
    a plain path is never decoded."""
    if "%" not in path:
        return path
    try:
        decoded = urllib.parse.unquote(path, errors="strict")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(
            f"URL {redact(url)!r} percent-encodes bytes that are not UTF-8 ({exc.reason}); "
            f"nothing was opened: encode the name's UTF-8 bytes (%C3%A9 for é), or "
            f"{fixes.path_itself}"
        ) from exc
    if decoded == path:
        return path
    if "\0" in decoded:
        raise ConfigurationError(
            f"URL {redact(url)!r} names a path holding a NUL character (%00), which no file "
            "name can; nothing was opened: check how the URL was built"
        )
    # Releases before this one took the escapes as they are: a file they made under this
    # URL is named with them. Opening the decoded name would create a new, empty database
    # beside it, and every run in the old one would seem gone.
    if not os.path.lexists(decoded) and os.path.isfile(path):
        plain = f"pass {path!r} itself as a plain path"
        # A rename into a directory that is not there (an escaped '/': a%2Fb.db) fails.
        if os.path.isdir(os.path.dirname(decoded) or "."):
            fix = (
                f"rename {path!r} to {decoded!r} (with every process stopped, its -wal and "
                f"-shm files too), or {plain}"
            )
        else:
            fix = f"{plain} (its decoded name is in a directory that does not exist)"
        raise ConfigurationError(
            f"URL {redact(url)!r} names {decoded!r}, since a sqlite URL's %XX escapes are "
            f"decoded (as sqlx reads it), and no such file exists, but {path!r} does, made by "
            f"a release of control_store that kept the escapes; nothing was opened: {fix}"
        )
    return decoded


def url_scheme(text: str) -> str | None:
    """The scheme parse_url reads ``text`` as a URL of, lower-cased; None for a plain path (a
    Windows drive letter is not a scheme)."""
    match = _SCHEME.match(text)
    if match is None or (len(match.group(1)) == 1 and text[2:3] in ("\\", "/")):
        return None
    return match.group(1).lower()


def parse_options(options: dict[str, object]) -> Options:
    """Validate ``Store.connect``'s keyword options."""
    allowed = {"busy_timeout", "synchronous", "migrate", "read_only"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigurationError(
            f"unknown option {unknown[0]}={shown(options[unknown[0]])}; "
            f"Store.connect accepts {sorted(allowed)}"
        )
    busy_timeout = options.get("busy_timeout", 5.0)
    # A subclass's plain value, compared as that: never its own methods.
    seconds: int | float | None = None
    # By type, never isinstance(), which reads __class__ (an object can fake any class there).
    if is_a(busy_timeout, int) and not is_a(busy_timeout, bool):
        seconds = int.__index__(busy_timeout)
    elif is_a(busy_timeout, float):
        seconds = float.__float__(busy_timeout)
    if seconds is None or not 0 <= seconds <= 86_400:
        raise ConfigurationError(
            f"busy_timeout={shown(busy_timeout)} must be a number of seconds from 0 to 86400 "
            "(default 5): how long a write waits for another process's write lock"
        )
    synchronous = options.get("synchronous", "FULL")
    # A subclass's plain text, upper-cased once: what the check passes is what the PRAGMA gets.
    level = str.upper(str.__str__(synchronous)) if is_a(synchronous, str) else None
    if level not in _SYNCHRONOUS:
        raise ConfigurationError(
            f"synchronous={shown(synchronous)} must be one of {list(_SYNCHRONOUS)}; "
            "FULL (the default) survives power loss, NORMAL survives a process crash"
        )
    read_only = options.get("read_only", False)
    if not is_a(read_only, bool):
        raise ConfigurationError(
            f"read_only={shown(read_only)} must be True or False; True opens an existing database "
            "for reading only (no writes, no migrations, the file left as it is)"
        )
    migrate = options.get("migrate", not read_only)
    if not is_a(migrate, bool):
        raise ConfigurationError(
            f"migrate={shown(migrate)} must be True or False; True (the default) applies pending "
            "migrations at connect, False leaves them for 'await store.migrate()'"
        )
    if read_only and migrate:
        raise ConfigurationError(
            "migrate=True contradicts read_only=True: a read-only store never migrates; drop "
            "migrate=True, or connect without read_only to apply migrations"
        )
    return Options(float(seconds), level, migrate, read_only)


def _require_file(path: str, database: str) -> None:
    """Refuse a read-only open of a file that does not exist: ``mode=ro`` never creates one.

    A ConfigurationError, as parse_url's missing directory: the URL names nothing usable.
    (SQLite would say only SQLITE_CANTOPEN, "unable to open database file".)
    """
    if not os.path.exists(path):
        raise ConfigurationError(
            f"cannot open {database} read-only: no such file{missing_because(path)} "
            "(read_only=True never creates one); check the path, or create and migrate the "
            "database by connecting without read_only"
        )


def missing_because(path: str) -> str:
    """Why there is no file at ``path``, where more can be said than that, as a clause to put
    after "no such file": a directory on the way missing, or a symlink whose target is."""
    if os.path.islink(path):
        return f": it is a symlink to {os.path.realpath(path)!r}, which does not exist"
    directory = Path(path).parent
    if directory.exists():
        return ""
    while not directory.parent.exists() and directory != directory.parent:
        directory = directory.parent  # the first directory on the way that is missing
    return f": directory {str(directory)!r} does not exist"


def read_only_uri(path: str) -> str:
    """The ``file:`` URI that opens ``path`` read-only (``mode=ro``): never created, never written.

    Absolute, and percent-encoded by Path.as_uri (``?``, ``#``, ``%`` and spaces included):
    in a URI SQLite reads ``?`` as the start of the query and ``#`` as the fragment, and
    decodes ``%XX``, so a file named ``a?b#c%20.db`` must reach it as ``a%3Fb%23c%2520.db``.
    """
    # Made absolute, never normalised: abspath reads "link/../x.db" as "x.db" beside the link,
    # another file than the one the kernel (and SQLite, and a writable store) opens.
    absolute = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    return f"{Path(absolute).as_uri()}?mode=ro"


# The oldest SQLite this library runs on: 3.35.0 brought RETURNING, which every claim uses.
MIN_SQLITE: Final = (3, 35, 0)


def require_sqlite() -> None:
    """Refuse, before anything is opened, an SQLite older than MIN_SQLITE.

    sqlite3 uses whatever SQLite library Python was built against (the system's, on most Linux
    distributions); an old one would otherwise fail at the first claim with a syntax error.
    """
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        need = ".".join(map(str, MIN_SQLITE))
        raise ConfigurationError(
            f"control_store needs SQLite {need} or newer (claims use RETURNING), but this "
            f"Python's sqlite3 module uses SQLite {sqlite3.sqlite_version}; nothing was opened: "
            "run on a Python built against a newer SQLite (python.org builds and current "
            "Linux distributions have one)"
        )


def parse_url(
    url: str | os.PathLike[str], *, fixes: UrlFixes = LIBRARY_FIXES, creates: bool = True
) -> str:
    """The SQLite file path (or ``:memory:``) that ``url`` names, as sqlx reads it.

    ``sqlite::memory:``, ``sqlite://relative/path.db``, ``sqlite:///absolute/path.db``,
    ``sqlite:path.db``, or a plain path. The directory must exist; the file is created.

    Only ``sqlite::memory:`` names an in-memory database. SQLite reads the file name
    ``:memory:`` that way too, so a plain path ``:memory:`` (or ``sqlite://:memory:``, which
    names a file everywhere else) would silently give a store that keeps nothing; it is refused,
    with both fixes. ``fixes``: the words of the fixes a refusal gives (see UrlFixes).
    ``creates``: False for a read-only open, which never creates the file: a path where none is
    (its directory missing, a dangling symlink) is then left to the caller's "no such file".
    """
    if is_a(url, os.PathLike):  # by type: isinstance() reads a __class__ that may lie or raise
        try:
            path = os.fspath(url)
        except Exception as exc:  # the caller's __fspath__ failed
            raise ConfigurationError(
                f"path {shown(url)} cannot be read: os.fspath() of it raised {failure(exc)}; "
                "pass the path as a str or a pathlib.Path"
            ) from exc
        if not is_a(path, str):
            raise ConfigurationError(
                f"path {shown(url)} gives {type(path).__name__}, not str; pass a str path, "
                "e.g. os.fsdecode() of it"
            )
        path = str.__str__(path)  # a subclass's plain text: never its own methods
    elif is_a(url, str):
        url = str.__str__(url)  # a subclass's plain text: never its own methods
        scheme = url_scheme(url)
        if scheme is None:
            path = url  # a plain path
        elif scheme == "sqlite":
            rest = url[len("sqlite:") :]
            if "?" in rest:
                raise ConfigurationError(
                    f"URL {redact(url)!r} has query parameters, which are not supported; "
                    f"{fixes.options}"
                )
            if rest == MEMORY:  # sqlite::memory:
                return MEMORY
            if url[-1].isspace():
                # Left from where the URL was read (a line of a file, an environment variable):
                # it would be part of the file's name, a new file beside the one meant.
                raise ConfigurationError(
                    f"URL {redact(url)!r} ends with whitespace ({url[-1]!r}), which would be "
                    "part of the file's name; nothing was opened: remove it from the URL (a file "
                    "whose name really ends so is named by its %XX escape, %20 for a space)"
                )
            if rest.lower().startswith(MEMORY):
                # SQLite reads only ':memory:' itself as memory: this would be a file so named.
                named = _percent_decoded(url, rest, fixes)
                raise ConfigurationError(
                    f"URL {redact(url)!r} is not {MEMORY_URL} (its case or what follows differ), "
                    f"so it would open a file named {named!r}; nothing was opened: for an "
                    f"in-memory store write {MEMORY_URL} as it is here; for a file so named, "
                    f"sqlite://./{rest}"
                )
            if _CREDENTIALS.match(rest):
                # Other schemes' URLs carry a password there; shown in a message (as part of
                # a path whose directory is missing, say), it would leak.
                raise ConfigurationError(
                    f"URL {redact(url)!r} holds a user name and password, but SQLite has no "
                    "users: a sqlite URL names a file; nothing was opened: drop the "
                    "credentials (sqlite://relative/path.db, sqlite:///absolute/path.db), or, "
                    "for a directory really named so, pass the path itself, starting with ./"
                )
            path = _percent_decoded(url, _typed_path(rest), fixes)
            if path == MEMORY:
                raise _memory_as_a_file(redact(url), fixes)
            if path in ("", "memory"):
                raise ConfigurationError(
                    f"URL {redact(url)!r} names no file; use sqlite://path/to/file.db, or "
                    f"{MEMORY_URL} for an in-memory database"
                )
        elif scheme in ("postgres", "postgresql"):
            raise ConfigurationError(
                f"URL {redact(url)!r} asks for PostgreSQL, which this version of control_store "
                "does not support yet; use a sqlite:// URL"
            )
        else:
            typed_scheme = url[: len(scheme)]
            # "name:rest" with no // reads as a URL too, but is likelier a file name with a
            # colon in it (a timestamp, say): say how to pass it as one.
            as_file = (
                ""
                if url[len(scheme) + 1 :].startswith("//")
                else f", or, if it names a file, {fixes.as_file.format(path=redact(url))}"
            )
            raise ConfigurationError(
                f"URL {redact(url)!r} has the unknown scheme {typed_scheme!r} (the text before "
                "its first ':'); use sqlite://relative/path.db, sqlite:///absolute/path.db or "
                f"sqlite::memory:{as_file}"
            )
    else:  # unreachable by the hints, reached by callers all the same (bytes, None)
        raise _not_a_url(url)
    if path == MEMORY:
        raise _memory_as_a_file(path, fixes)
    if not path:
        raise ConfigurationError("the database path is empty; name a file, e.g. control.db")
    if "\0" in path:
        raise ConfigurationError(
            f"the database path {path!r} holds a NUL character, which no file name can; "
            "check where the path was built"
        )
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:  # a lone surrogate that no byte decodes as
        raise ConfigurationError(
            f"the database path {path!r} cannot be a file name here: the file system encoding "
            f"({exc.encoding}) cannot encode {path[exc.start : exc.end]!r} at position "
            f"{exc.start}; check where the path was built (os.fsdecode() of a name read from "
            "the file system always encodes back)"
        ) from exc
    if path.startswith("file:"):
        # SQLite (built with SQLITE_USE_URI, as most are) reads a name starting with "file:" as
        # a URI and opens another file ("file:x.db" is "x.db"); "./file:x.db" is just a name.
        path = os.path.join(os.curdir, path)
    name = database_name(url, path)
    if not os.path.isabs(path):
        _refuse_deleted_cwd(name)
    try:
        _check_place(path, name, creates=creates)
    except OSError as exc:  # the path cannot even be looked at: too long, not searchable
        raise _unreachable(name, exc) from exc
    return path


def _refuse_deleted_cwd(name: str) -> None:
    """Refuse a relative path while the current directory is deleted: every file in it is
    gone for good (SQLite could not create one there), and "no such file", with the fix to
    create the database, sent the user round in circles."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ConfigurationError(
            f"cannot open {name}: its path is relative, and the current directory was deleted "
            "while this process was in it, so nothing can be opened or created there: change "
            "to a directory that exists (cd), or give an absolute path"
        ) from None


def database_name(url: str | os.PathLike[str], path: str) -> str:
    """How messages name the file ``path`` that parse_url read ``url`` as: the path, and, where
    the URL's %XX escapes were decoded, that URL too (the user typed the URL, and may not
    know it names another spelling)."""
    if (
        not is_a(url, str)
        or url_scheme(url) != "sqlite"
        or path == _typed_path(url[len("sqlite:") :])
    ):
        return repr(path)
    return f"{path!r} (the URL {redact(url)!r})"


def _typed_path(rest: str) -> str:
    """The path a sqlite URL spells after "sqlite:", as typed (escapes not decoded):
    sqlite://relative/x.db and sqlite:relative/x.db both spell relative/x.db."""
    return rest[2:] if rest.startswith("//") else rest


def _not_a_url(url: object) -> ConfigurationError:
    """The error for a ``url`` that is neither a str nor an os.PathLike."""
    fix = (
        "decode it first: os.fsdecode(...) of it"
        if is_a(url, bytes) or is_a(url, bytearray)
        else "pass a sqlite:// URL string, or a path as a str or a pathlib.Path"
    )
    return ConfigurationError(f"expected a URL string or a path, got {typed(url)}; {fix}")


def _memory_as_a_file(given: str, fixes: UrlFixes) -> ConfigurationError:
    """The error for ``:memory:`` given where a file is named (see parse_url)."""
    return ConfigurationError(
        f"{given!r} names a file, but SQLite would open an in-memory database for it, which "
        f"keeps nothing once the store closes; nothing was opened: {fixes.memory}"
    )


def _unreachable(name: str, exc: OSError) -> ControlError:
    """The error for a path the file system refuses to look at (os.stat failed); ``name`` is
    the path as messages give it (see database_name)."""
    fix = (
        "give a shorter path: each name on it may be at most 255 bytes (NAME_MAX), and the "
        "whole path at most 4,096 (PATH_MAX)"
        if exc.errno == errno.ENAMETOOLONG
        else "check the path, and that this user may enter every directory on it"
    )
    message = f"cannot open {name}: {exc.strerror or exc}; {fix}"
    if not isinstance(exc, PermissionError):
        return ConfigurationError(message)
    error = StorageError(message)  # as a write-protected file: cured outside, then retried
    error.retryable = True
    return error


def _check_place(path: str, name: str, *, creates: bool) -> None:
    """Refuse a path whose directory is missing or not a directory, or that is a directory;
    ``name`` is the path as messages give it (see database_name); ``creates``: see parse_url."""
    directory = Path(path).parent
    if not directory.is_dir():
        if not creates and not directory.exists():
            return  # no such file: the caller says so, without a word of creating one
        if directory.exists():
            raise ConfigurationError(
                f"cannot open {name}: {str(directory)!r} is a file, not a directory; "
                "name a file in a directory"
            )
        raise ConfigurationError(
            f"cannot open {name}: directory {str(directory)!r} does not exist, so neither does "
            "the database; check the path, or, for a new database, create the directory first "
            "(the store creates the file, not its directory)"
        )
    if Path(path).is_dir():
        raise ConfigurationError(f"cannot open {name}: it is a directory; name a file in it")
    try:
        mode = os.stat(path).st_mode  # through a symlink, as SQLite opens it
    except FileNotFoundError:  # none yet (or a dangling symlink): SQLite creates it
        if creates:
            _check_new_file(path, name)
        return
    if not stat.S_ISREG(mode):
        # SQLite would open it all the same: a FIFO blocks the open until a writer comes, and
        # /dev/null takes every write and keeps none.
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ConfigurationError(
            f"cannot open {name}: it is {kind}, and a database must be a regular file; name "
            "a regular file, or a path where none exists yet for the store to create"
        )
    # SQLite says only SQLITE_CANTOPEN for a file it may not read, the database or its -wal or
    # -shm (named after the symlink's target, for a path that is a symlink): by its message, a
    # full or failing disk. Asked with access(), never by opening the file: closing any
    # descriptor of a file drops every POSIX lock this process holds on it, SQLite's for
    # another store on it included, and the next connection to close, in any process, then
    # took itself for the last and deleted the -wal and -shm under that store (measured).
    target = os.path.realpath(path)
    for suffix, which in (("", "it"), ("-wal", "its -wal file"), ("-shm", "its -shm file")):
        place = path if not suffix else f"{target}{suffix}"
        if _unreadable(place):
            also = (
                "and writable, to write to it" if not suffix else "and writable: SQLite writes it"
            )
            error = StorageError(
                f"cannot open {name}: this user may not read {which}"
                f"{f' {place!r}' if suffix else ''} (permission denied); make the file readable "
                f"by this user ({also}), then retry"
            )
            error.retryable = True  # as a write-protected file: cured outside, then retried
            raise error
    _check_sidecars(path, target, name)


def _may(path: str, mode: int) -> bool:
    """access(): whether this process may use ``path`` so (by its effective ids, where the
    system can ask; False for a path that is not there)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _on_read_only_mount(path: str) -> bool:
    """Whether ``path`` is on a file system mounted read-only (statvfs's ST_RDONLY)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # not there, or no statvfs on this system
        return False


def _unreadable(path: str) -> bool:
    """Whether ``path`` is there and this process may not read it (its effective ids, where the
    system can ask). access() says False for a file that is not there too: asked until it and
    a look at the file agree three times over, since a -wal or -shm comes and goes as other
    processes connect and close (a review saw 1 connect in ~500 refused as unreadable beside
    a process connecting and closing in a loop)."""
    for _ in range(3):
        if _may(path, os.R_OK):
            return False
        if not os.path.exists(path):
            return False
    return True


def _check_sidecars(path: str, target: str, name: str) -> None:
    """Refuse a database in WAL mode that another process has open while its -wal or -shm is
    missing: deleted (or moved) under that process's store. SQLite, connecting, would make a
    new -shm beside the running store's deleted one, and the two processes then write the file
    at once: the first store's close(), the fault table's fix, then checkpointed with its stale
    index and left the file "not a database" (measured); with the -wal gone, it read the
    -shm's index into a log that is not there (SQLITE_IOERR_SHORT_READ, read as a disk fault).
    A store of this process on the file shares its -shm with this one (SQLite keys it by the
    file): nothing is made anew. Told by /proc/locks, as _stale_sidecars tells it; where that
    cannot be read, nothing is refused (a database closed cleanly has neither file).

    And refuse another name of a file a store of this process has open, whose -wal would be
    another file (a hard link, in another directory or under another base name; a symlink, a
    bind mount or a renamed directory leads to the same -wal and is no other name)."""
    wanted = _opened(path)
    if wanted is None:
        return  # nothing there to look at: SQLite's open says what is wrong
    elsewhere = [
        opened
        for opened in list(_FILES.values())
        if opened.identity == wanted.identity
        and None not in (opened.sidecars, wanted.sidecars)
        and opened.sidecars != wanted.sidecars
    ]
    if elsewhere:
        raise ConfigurationError(
            f"cannot open {name}: a store of this process has the same file open under another "
            f"name, {elsewhere[0].name!r} (a hard link): SQLite names the -wal after the name "
            "opened, so the two stores would keep two logs of one file, and read its pages "
            "wrong (SQLITE_IOERR_SHORT_READ, measured); nothing was opened: connect with the "
            "name the open store uses"
        )
    identity = wanted.identity
    missing = [suffix for suffix in ("-wal", "-shm") if not os.path.lexists(f"{target}{suffix}")]
    if not missing:
        return
    if _held(identity):
        _check_own_wal(path, target, name, identity, missing)
        return
    # A connection opening the file, or closing it last, holds its lock on the file for a
    # moment while the two files are not there yet, or no longer (longer if its process is
    # held up there: a review stopped one for 0.1 s, and a look of 0.1 s refused it): looked at
    # again for up to a second before a refusal, so that only a lasting state is one, unless a
    # holder shows the files deleted under it. (On the caller's thread, the event loop's for a
    # connect: only a connect that meets this window, or the fault, waits, and the first look
    # that sees the files ends it; a thread of the default executor's would tie the connect to
    # one, which a process out of threads lacks.)
    others: set[int] = set()
    base = os.path.basename(target)
    for attempt in range(_SIDECAR_LOOKS):
        if attempt:
            if any(_runs_on_deleted(pid, base, missing) for pid in others):
                break
            time.sleep(_SIDECAR_PAUSE)
        # Read locks: every connection in WAL mode holds one on the file while it has it open.
        # A write lock there is a connection in locking_mode=EXCLUSIVE, which keeps its index
        # in its own memory, no -shm at all (SQLite then says the file is busy), or the last
        # to close, about to delete both files. The header is read last, once, when a reader
        # is first seen (a rollback-journal file's readers need neither file): any look with
        # no other reader ends the loop, so one is seen at the first look or never.
        holding = _sqlite_readers(identity)
        missing = [s for s in missing if not os.path.lexists(f"{target}{s}")]
        if holding is None or not missing:
            return
        others = holding - {os.getpid()}
        if not others or (attempt == 0 and not _in_wal_mode(path)):
            return
        if not _with_wal_index(others, identity):
            # Still opening the file, however long it is held up there (SIGSTOP, a debugger,
            # docker pause): a review stopped one before it made the -wal, and every connect
            # beside it was refused as meeting deleted files for as long as it stayed stopped.
            return
    files = " and ".join(repr(f"{target}{suffix}") for suffix in missing)
    holders = (
        f"process {others.pop()} has"
        if len(others) == 1
        else f"processes {', '.join(str(pid) for pid in sorted(others))} have"
    )
    lost = (
        "a new one here would make two processes write the file at once, and corrupt it"
        if "-shm" in missing
        else "the running store's writes since the last checkpoint are only in the log it "
        "still holds open"
    )
    raise ConfigurationError(
        f"cannot open {name}: {files} {'are' if len(missing) > 1 else 'is'} missing while "
        f"{holders} the database open: deleted or moved under a running store, or that "
        "process has the file open under another name (a hard link: SQLite names the -wal and "
        f"-shm after the name opened); nothing was opened ({lost}): put a moved file back, or "
        "connect with the name that process uses; else close that process's store "
        "with await store.close() (the last store to close keeps every write it acknowledged), "
        "close every other store on the file, and connect again"
    )


def _check_own_wal(
    path: str, target: str, name: str, identity: tuple[int, int], missing: list[str]
) -> None:
    """Refuse a file a store of this process has open in WAL mode while its -wal is missing.

    That store shares its -shm with a new connection (SQLite keys the index by the file), but
    not its -wal: each connection opens the log by name, so SQLite would make a new, empty one
    beside the deleted log the running store still holds. Reads through the shared index then
    fail as a disk fault (SQLITE_IOERR_SHORT_READ), or, once everything was checkpointed, the
    new store writes its commits into the new log while the index describes both: the running
    store reads wrong pages, and its close() (the last) checkpointed them and left the file
    malformed (measured). The new -wal also hid the fault from other processes' connects.
    Looked at again for up to a second, as for another process: a store of this process
    closing last deletes the -wal a moment before it lets the file go."""
    if "-wal" not in missing or _header(path)[18:20] != b"\x02\x02":
        return  # a -shm is shared; a rollback-journal file needs neither
    # Only a store that has seen its -wal can have lost it: one still connecting (opened, its
    # first read not made yet) makes it once its connect goes on, which this look, on the
    # event loop's thread, would hold up for as long as it waited.
    for attempt in range(_SIDECAR_LOOKS):
        if attempt:
            time.sleep(_SIDECAR_PAUSE)
        if os.path.lexists(f"{target}-wal") or not _held(identity, with_wal=True):
            return
    raise ConfigurationError(
        f"cannot open {name}: {f'{target}-wal'!r} is missing while a store of this process has "
        "the database open: deleted or moved under that store; nothing was opened (SQLite would "
        "make a new, empty log beside the one that store still holds, and the two stores would "
        "then write two logs of one file and corrupt it): put a moved file back; else close "
        "that store with await store.close() (the last store to close keeps every write it "
        "acknowledged), close every other store on the file, and connect again"
    )


# How many times, and how far apart, _check_sidecars looks before it refuses: ~1 s in all.
_SIDECAR_LOOKS: Final = 26
_SIDECAR_PAUSE: Final = 0.04


def _runs_on_deleted(pid: int, base: str, missing: list[str]) -> bool:
    """Whether process ``pid`` has a missing -shm of the database named ``base`` mapped, or
    its -wal open, as a deleted file (Linux's /proc/PID: a store running on them); False where
    that cannot be seen (another user's process), and the looks decide."""
    try:
        if "-shm" in missing:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                if any(line.rstrip("\n").endswith(f"/{base}-shm (deleted)") for line in maps):
                    return True
        if "-wal" in missing:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").endswith(f"/{base}-wal (deleted)"):
                        return True
    except OSError:
        return False
    return False


def _lock_holders(inode: int) -> set[int] | None:
    """The processes holding (or waiting for) any lock on the file of ``inode``, per Linux's
    /proc/locks (-1 stands for an open file description's lock, whose owner it does not
    show); None where /proc/locks cannot be read.

    By inode number alone, on any device: /proc/locks prints the device of the inode's
    superblock, which is not stat()'s st_dev on btrfs (a subvolume's anonymous device) nor on
    an overlayfs over more than one file system. Another file of that number locked elsewhere
    only makes a caller see the file in use: fit for a check whose error is a refusal to make
    a new -shm (_stale_sidecars), not for one that refuses a connect (_sqlite_readers)."""
    held = _proc_locks()
    if held is None:
        return None
    found = re.findall(
        rf"^\d+: (?:-> )?\S+\s+\S+\s+\S+\s+(-?\d+) [0-9a-f]+:[0-9a-f]+:{inode} ", held, re.M
    )
    return {int(pid) for pid in found}


def _sqlite_readers(identity: tuple[int, int]) -> set[int] | None:
    """The processes holding SQLite's shared lock on the database file ``identity`` (device,
    inode), per /proc/locks: a POSIX read lock on the bytes SQLite's unix VFS locks for it
    (SHARED_FIRST to SHARED_FIRST + SHARED_SIZE - 1). Every connection in WAL mode holds it
    while it has the file open. Only that lock, on that device: a shared flock(1) on the file,
    or an SQLite file of the same inode number on another device, is none (a file system whose
    /proc/locks device differs from stat()'s, btrfs say, then shows no reader at all). None
    where /proc/locks cannot be read."""
    held = _proc_locks()
    if held is None:
        return None
    device, inode = identity
    where = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    found = re.findall(
        rf"^\d+: POSIX\s+\S+\s+READ\s+(\d+) {where} {_SHARED_FIRST} {_SHARED_LAST}$", held, re.M
    )
    return {int(pid) for pid in found}


def _with_wal_index(pids: set[int], identity: tuple[int, int]) -> bool:
    """Whether any of ``pids`` holds a POSIX lock on the byte of a -shm that every connection
    with its WAL index open read-locks (the "dead man switch", UNIX_SHM_DMS), per /proc/locks:
    on any file but the database ``identity``, since the lock stays on a -shm deleted, moved
    or linked under another name. A connection holding none has not opened its -shm yet: it
    is opening the file, and runs on no deleted files. (One that has another database's -shm
    open counts all the same.) True where /proc/locks cannot be read."""
    held = _proc_locks()
    if held is None:
        return True
    pairs = re.findall(
        rf"^\d+: POSIX\s+\S+\s+\S+\s+(\d+) [0-9a-f]+:[0-9a-f]+:(\d+) {_SHM_DMS} {_SHM_DMS}$",
        held,
        re.M,
    )
    if any(int(pid) in pids and int(inode) != identity[1] for pid, inode in pairs):
        return True
    # A read-only connection that may not write the -shm, and opened the file with no other
    # connection on it, keeps the index in its own memory and locks no -shm, but reads the
    # -wal it holds open (a review moved both files away under one, and a connect then made
    # the schema anew over the writes in that -wal).
    locked = {int(inode) for inode in re.findall(r" [0-9a-f]+:[0-9a-f]+:(\d+) ", held)}
    return any(_holds_a_wal(pid, identity, locked) for pid in pids)


def _holds_a_wal(pid: int, identity: tuple[int, int], locked: Set[int]) -> bool:
    """Whether process ``pid`` has a file open that begins as a -wal does (SQLite's WAL magic
    number), other than the database ``identity``. Only files no process holds a POSIX lock
    on are opened to be read: closing one this process has locked would drop its locks. True
    where its open files cannot be listed (another user's process)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False  # ended
    except OSError:
        return True
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            st = os.stat(link)
            if (
                not stat.S_ISREG(st.st_mode)
                or (st.st_dev, st.st_ino) == identity
                or st.st_ino in locked
                or st.st_size < _WAL_HEADER
            ):
                continue
            with open(link, "rb") as file:
                if file.read(4) in _WAL_MAGIC:
                    return True
        except OSError:
            continue
    return False


# A -wal file's header, and the magic number it begins with (big-endian 0x377f0682, or
# 0x377f0683 for a log of big-endian checksums).
_WAL_HEADER: Final = 32
_WAL_MAGIC: Final = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")


# The byte of a -shm SQLite's unix VFS read-locks while a connection has it mapped (sqlite3.c:
# UNIX_SHM_BASE 120 + SQLITE_SHM_NLOCK 8 = UNIX_SHM_DMS).
_SHM_DMS: Final = 128


# The bytes of a database file SQLite's unix VFS read-locks for a shared lock (sqlite3.c:
# PENDING_BYTE 0x40000000, SHARED_FIRST PENDING_BYTE + 2, SHARED_SIZE 510).
_SHARED_FIRST: Final = 0x40000002
_SHARED_LAST: Final = _SHARED_FIRST + 510 - 1


def _proc_locks() -> str | None:
    """Linux's table of file locks, or None where there is none to read."""
    try:
        with open("/proc/locks", encoding="ascii") as locks:  # a procfs file: no POSIX locks
            return locks.read()
    except OSError:
        return None


def _file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes (RLIMIT_FSIZE), in bytes; None
    where there is none (or no resource module to tell)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _check_new_file(path: str, name: str) -> None:
    """Refuse a file SQLite is to create where it cannot: the target of a dangling symlink in a
    directory that does not exist, or a name too long for its journal's (SQLite's failure,
    "unable to open database file", reads as a disk fault, and left an empty file behind)."""
    target = Path(os.path.realpath(path))
    if target != Path(os.path.abspath(path)) and not target.parent.is_dir():
        raise ConfigurationError(
            f"cannot open {name}: it is a symlink to {str(target)!r}, whose directory "
            f"{str(target.parent)!r} does not exist; create it first, or point the symlink at "
            "a file in a directory that exists"
        )
    # No database file, but its -wal or -shm: the file was deleted or moved while a process had
    # it open (or after a crash). SQLite, opening a new empty file there, deletes that -wal (a
    # running store's only copy of its writes since the last checkpoint) and shares the -shm
    # with the running store, whose reads then go wrong without an error (measured).
    left = [suffix for suffix in ("-wal", "-shm") if os.path.lexists(f"{target}{suffix}")]
    # Not refused: a file another process's connect created meanwhile, or what a closed
    # read-only store leaves (an empty -wal, a -shm no process uses), which holds nothing.
    if left and not os.path.exists(path) and not _stale_sidecars(str(target)):
        files = " and ".join(repr(f"{target}{suffix}") for suffix in left)
        raise ConfigurationError(
            f"cannot open {name}: no database file is there, but {files} "
            f"{'are' if len(left) > 1 else 'is'}: the database was "
            "deleted or moved while a process had it open (or after a crash); nothing was "
            "created: put the database file back (a store still running on it then goes on, "
            "and close() keeps its writes); only if no process has it open and its contents are "
            f"not wanted, delete {files} and connect again"
        )
    # By the target: a dangling symlink's file is made in its target's directory.
    if not _may(str(target.parent), os.W_OK | os.X_OK) and not os.path.lexists(target):
        # SQLite says only "unable to open database file" (SQLITE_CANTOPEN), which read as a
        # full or failing disk.
        directory = str(target.parent)
        if _on_read_only_mount(directory):
            why = "is on a file system mounted read-only"
            fix = "remount it read-write, or create the database on another file system"
        else:
            why = "may not be written by this user (permission denied)"
            fix = "make it writable by this user, or create the database where it may write"
        error = StorageError(
            f"cannot create {name}: its directory {directory!r} {why}, and the store creates "
            f"the database and its -wal and -shm files there; nothing was created: {fix}, then "
            "retry"
        )
        error.retryable = True  # as a write-protected file: cured outside, then retried
        raise error
    try:
        longest = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255  # what Linux, macOS and Windows file systems allow
    size = len(os.fsencode(target.name))
    if size + len(_JOURNAL_SUFFIX) > longest:
        raise ConfigurationError(
            f"cannot open {name}: its file name is {size} bytes long, and the name of "
            f"SQLite's journal beside it (the name and {_JOURNAL_SUFFIX!r}) would be "
            f"{size + len(_JOURNAL_SUFFIX)}, past this file system's limit of {longest}; give "
            f"the database a name of at most {longest - len(_JOURNAL_SUFFIX)} bytes"
        )


def _stale_sidecars(target: str) -> bool:
    """Whether ``target``'s -wal is empty (or absent) and its -shm (if any) is locked by no
    process: SQLite, making a new file there, then loses nothing and shares nothing. Asked of
    /proc/locks, never by opening the -shm (closing it would drop this process's locks);
    False where that cannot be told (no /proc/locks, or a file that cannot be looked at)."""
    try:
        if os.path.lexists(f"{target}-wal") and os.stat(f"{target}-wal").st_size:
            return False
        try:
            st = os.stat(f"{target}-shm")
        except FileNotFoundError:
            return True
    except OSError:
        return False
    # Another file of that inode number locked elsewhere only makes this say "in use": a
    # refusal, never a -shm shared.
    return _lock_holders(st.st_ino) == set()


# The longest name SQLite gives a file beside the database: its rollback journal's, used before
# the switch to WAL (the -wal and -shm files are shorter).
_JOURNAL_SUFFIX: Final = "-journal"

_FILE_KINDS: Final = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


# ---------------------------------------------------------------------------------------------
# Error translation: the one place sqlite3 and aiosqlite errors become ControlErrors.


def translate(exc: BaseException, *, database: str, busy_timeout: float) -> BaseException:
    """The ``ControlError`` that explains ``exc``, with ``exc`` as its cause.

    ControlErrors pass through; exceptions that are not driver errors (bugs, cancellation) are
    returned unchanged.
    """
    if isinstance(exc, ControlError):
        return exc
    error: ControlError
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
        detail = f"{exc} ({name})"
        if name.startswith(_BUSY):
            error = DatabaseBusyError(
                f"{database} is locked: this call did not get its lock within "
                f"busy_timeout={busy_timeout:g}s, because another connection held it that long, "
                "or because other connections kept taking it in turn (SQLite's wait retries "
                "at intervals and is not first come, first served: many busy writers can "
                "outrun one waiter) (in WAL mode, every store's, only a writer blocks; a file "
                "switched out of WAL mode is blocked by a reader's open transaction too) "
                f"[{detail}]; retry the call, or connect with a larger busy_timeout"
            )
        elif name == "SQLITE_PROTOCOL":
            # SQLite's wait for the lock on the -shm while another connection rebuilds the
            # WAL's index (on opening a file whose index is not valid), about 10 s whatever
            # busy_timeout is: a process stopped there holds it until it goes on or ends (a
            # review's SIGSTOP). Or SQLite lost its lock race that long. Lock contention.
            error = DatabaseBusyError(
                f"{database} is locked: another connection held the lock on its -shm (the "
                "index of its -wal) for the ~10 s SQLite waits for it whatever busy_timeout "
                "is, as one does while it rebuilds that index on opening the file; a process "
                "stopped or hung there holds it until it goes on or ends "
                f"[{detail}]; nothing was written: let that process go on (kill -CONT PID, "
                "for one stopped) or end it, then retry the call"
            )
        elif name == "SQLITE_CONSTRAINT_FOREIGNKEY":
            error = MissingRunError(
                f"{database} refused the write: a job refers to a run that does not exist, or a "
                "foreign key this release's schema does not make (check() names it) refused a "
                f"value [{detail}]; nothing of this call was written"
            )
        elif name == "SQLITE_CONSTRAINT_PRIMARYKEY":
            error = AlreadyExistsError(f"a row with this id already exists [{detail}]")
        elif name == "SQLITE_CONSTRAINT_UNIQUE":
            # Never an id (a primary key fails as PRIMARYKEY): a unique index of someone's own
            # or one of this schema's remade UNIQUE (which check() reports), or a UNIQUE
            # constraint a table was rebuilt with.
            failed = re.search(r"UNIQUE constraint failed: (\w+)\.", str(exc))
            table = failed[1] if failed else "runs"
            error = ConstraintError(
                f"{database} refused the write: a UNIQUE index or constraint this store's schema "
                f"does not make already holds the value [{detail}]; nothing of this call was "
                "written: drop the index on those columns if the store's rows are to be written "
                f"(SELECT name, sql FROM sqlite_schema WHERE type = 'index' AND tbl_name = "
                f"'{table}' lists them; one named sqlite_autoindex_{table}_N with N above 1 and "
                "no sql is a UNIQUE constraint of the table's own definition, which only "
                "remaking the table as this release makes it removes), or write another value"
            )
        elif name == "SQLITE_CONSTRAINT_CHECK":
            # This release's tables have none (check() does not report a user's, as it does not
            # a trigger): one a table was rebuilt with refused a value the store writes.
            error = ConstraintError(
                f"{database} refused the write: a CHECK constraint this store's schema does not "
                f"make refused a value of it [{detail}]; nothing of this call was written: write "
                "a value it admits, or remake the table without it (SELECT name, sql FROM "
                "sqlite_schema WHERE sql LIKE '%CHECK%' shows it; SQLite's procedure for table "
                "changes: https://sqlite.org/lang_altertable.html#otheralter)"
            )
        elif name == "SQLITE_CONSTRAINT_TRIGGER":
            # This release makes no trigger: one of the user's refused (RAISE ABORT, FAIL or
            # ROLLBACK) a write the store makes, its message in the detail.
            error = ConstraintError(
                f"{database} refused the write: a trigger that is not the store's (its schema "
                f"makes none) raised [{detail}]; nothing of this call was written: write what it "
                "admits, or change or drop the trigger (SELECT name, sql FROM sqlite_schema "
                "WHERE type = 'trigger' lists them)"
            )
        elif name.startswith("SQLITE_CONSTRAINT"):
            error = ConstraintError(
                f"{database} refused the write [{detail}]; nothing of this call was written"
            )
        elif name == "SQLITE_FULL":
            error = StorageError(
                f"{database} is full: the disk or the database's page limit is reached "
                f"[{detail}]; nothing of this call was written: free space and retry"
            )
            error.retryable = True
        elif name == "SQLITE_READONLY_ROLLBACK":
            # A file in rollback-journal mode (switched out of WAL, as for a copy on read-only
            # media) whose writer died inside a transaction: its hot -journal must be rolled
            # back before anyone reads, which a read-only connection may not do. Nothing about
            # permissions; and no retry cures it until a writable connection has opened it.
            error = StorageError(
                f"{database} has a hot rollback journal (its -journal file, left by a writer "
                f"that stopped inside a transaction) [{detail}], which a "
                "read-only connection cannot roll back; nothing was written: open the database "
                "once for writing, with the -journal beside it, so SQLite rolls that "
                "transaction back: sqlite3 FILE 'PRAGMA quick_check' keeps its rollback journal "
                "(control-store migrate, or a store without read_only, would switch the file "
                "to a -wal); on read-only media, do so on a writable copy of both files"
            )
        elif name.startswith("SQLITE_READONLY"):
            error = StorageError(
                f"{database} is read-only [{detail}]; nothing was written: make the file, its "
                "-wal and -shm files and its directory writable by this process, then retry"
            )
            error.retryable = True
        elif name == "SQLITE_TOOBIG":
            error = _too_big(detail)
        elif name == "SQLITE_NOTADB":
            error = ConfigurationError(
                f"{database} is not a SQLite database [{detail}]; it was left untouched: point "
                "the URL at a control_store database or at a new file"
            )
        elif name.startswith("SQLITE_CORRUPT"):
            error = StorageError(
                f"{database} is corrupt [{detail}]; stop writing to it and {_RESTORE}"
            )
        elif name.startswith("SQLITE_CANTOPEN") and _out_of_descriptors():
            # SQLite says only "unable to open database file" of a process at its limit of
            # open files: that limit, not the disk, is what to fix.
            error = StorageError(
                f"{database} cannot be opened [{detail}]: this process is at its limit of open "
                f"files; no row was written (at connect, the file or its -wal may already have "
                f"been created, or the file switched to WAL mode, which is harmless): "
                f"{_migrate.OUT_OF_FILES_FIX}"
            )
            error.retryable = True
        elif name == "SQLITE_IOERR_SHMSIZE":
            # SQLite grows the -shm (the WAL's index: 32 KiB at the first write, then 32 KiB
            # more for each 4,096 frames of -wal) by writing a byte into each new page; on a
            # full disk that write fails so (measured: a new file with 8-32 KiB free).
            limit = _file_size_limit()
            if limit is None:
                error = StorageError(
                    f"{database} is full: the disk has no room to grow its -shm file (the "
                    f"index of its -wal) [{detail}]; nothing of this call was written: free "
                    "space and retry"
                )
            else:  # a limit below the -shm's size fails the same way (a review: 8-24 KiB)
                error = StorageError(
                    f"{database} is full, or past this process's file size limit: its -shm "
                    f"file (the index of its -wal) could not grow [{detail}], and the limit "
                    f"(RLIMIT_FSIZE, ulimit -f) is {limit} bytes; nothing of this call was "
                    "written: free space, or raise the limit, and retry"
                )
            error.retryable = True
        elif name.startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN")):
            # A disk that fills up mid-write, or a file size limit (RLIMIT_FSIZE, quota), shows
            # as SQLITE_IOERR_WRITE rather than SQLITE_FULL when the write fails outright.
            error = StorageError(
                f"{database} cannot be read or written [{detail}]; check that the disk has free "
                "space (and that no file size limit or quota is reached), that the file and "
                "its directory exist and are writable, and that the disk is healthy, then retry"
            )
            error.retryable = True
        elif str(exc) == "unsupported file format":  # a schema format past 4, say
            error = ConfigurationError(
                f"{database} is in a file format newer than this SQLite "
                f"({sqlite3.sqlite_version}) reads [{detail}]: a newer SQLite made it; nothing "
                "was changed: use a Python whose sqlite3 is built on a newer SQLite "
                "(sqlite3.sqlite_version tells which one it has)"
            )
        elif isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
            error = StoreClosedError(f"the store for {database} is closed; connect again")
        elif missing := _SCHEMA_DAMAGE.match(str(exc)):
            if (missing.group("has") or "").lower() == _migrate.TRACKING_TABLE:
                # A migration's INSERT into its history ("table T has no column named C"); its
                # SELECT is _read_applied's. check() cannot help here: on a schema behind this
                # release it says to migrate, and the migration is what failed.
                error = tracking_damage(database, detail)
            elif _ours(missing):
                error = MigrationError(
                    f"{database} lacks part of the schema this release made [{detail}]: a "
                    "table or column was dropped or changed (by hand, or by a tool); nothing was "
                    "written: run store.check() (control-store check), which names what is "
                    "missing and how to repair it"
                )
            else:
                name = next(
                    part
                    for part in missing.group("column", "named", "table", "view", "refers")
                    if part
                )
                error = ControlError(
                    f"{database} failed [{detail}]: {name} is no part of this release's schema, "
                    "so a trigger or view of your own refers to it; nothing was written: "
                    "repair that trigger or view (SELECT name, sql FROM sqlite_master WHERE sql "
                    f"LIKE '%{name}%' lists them)"
                )
        else:
            # An error no branch above expects: what SQLite said, and what a caller can do.
            error = ControlError(
                f"{database} failed: {detail}, an error this release does not expect: retry "
                "the call, and if it fails so again, run check() (control-store check) and "
                f"report this message with the SQLite version ({sqlite3.sqlite_version})"
            )
    elif isinstance(exc, OverflowError):  # sqlite3 binding a text of over 2**31 - 1 bytes
        error = _too_big(str(exc))
    elif isinstance(exc, ValueError) and str(exc) in ("Connection closed", "no active connection"):
        error = StoreClosedError(f"the store for {database} is closed; connect again")
    elif isinstance(exc, UnicodeDecodeError) and isinstance(exc.object, bytes):
        # CPython's sqlite3 decodes SQLite's error message as UTF-8 and, when it is not, raises
        # this UnicodeDecodeError instead of the DatabaseError: SQLite quoted a name from the
        # file's schema whose bytes are not UTF-8 ("malformed database schema (idx_\xd2...)"),
        # which only damage (a flipped byte) or a hand edit makes.
        said = exc.object.decode("utf-8", "backslashreplace")
        error = StorageError(
            f"{database} is corrupt [{said} (SQLite's message, holding bytes that are not "
            f"UTF-8)]; stop writing to it and {_RESTORE}"
        )
    else:
        return exc
    error.__cause__ = exc
    return error


# SQLite's errors for a schema missing a part, or holding another kind of object under a
# name, with the table's name when the message gives it.
_SCHEMA_DAMAGE: Final = re.compile(
    r"no such table: (?:main\.)?(?P<table>\w+)|no such column: (?:\w+\.)?(?P<column>\w+)"
    r"|table (?P<has>\w+) has no column named (?P<named>\w+)"
    r"|cannot modify (?P<view>\w+) because it is a view"
    r'|foreign key mismatch - "(?P<refers>\w+)" referencing'
)


# The tracking table's columns, for check() (none is a column of runs or jobs).
_TRACKING_COLUMNS: Final = frozenset(
    {"version", "description", "installed_on", "success", "checksum", "execution_time"}
)


def tracking_damage(database: str, detail: object) -> MigrationError:
    """The error for a migration history missing a column (dropped or renamed by hand): its
    repair, and the table as made. Not a user's trigger naming a column of the same name in a
    table of its own: only the statements on this table (_read_applied, INSERT_APPLIED) say so.
    """
    return MigrationError(
        f"the migration history of {database}, {_migrate.TRACKING_TABLE}, is not as this release "
        f"makes it [{detail}]: a column was dropped or renamed (by hand, or by a tool); nothing "
        f"was written: {_TRACKING_REPAIR}. The table as made: "
        f"{' '.join(CREATE_TRACKING_TABLE.split())}"
    )


def _tracking_replaced(database: str, kind: str) -> MigrationError:
    """The error for a view or an index standing under the migration history's name: read as
    no history, it was told "its rows were deleted", and migrate() ran 0001 again."""
    table = _migrate.TRACKING_TABLE
    make = " ".join(CREATE_TRACKING_TABLE.split()).replace(" IF NOT EXISTS", "")
    repair = (
        f"if the view shows the history's rows, make them a table again: CREATE TABLE "
        f"history_rows AS SELECT * FROM {table}; DROP VIEW {table}; {make}; INSERT INTO {table} "
        "SELECT * FROM history_rows; DROP TABLE history_rows; else restore the database from a "
        "backup"
        if kind == "view"
        else f"restore the database from a backup (DROP {kind.upper()} {table} frees the name, "
        "but the history's rows are not in this file)"
    )
    return MigrationError(
        f"{database} has a {kind} named {table} where this release keeps its migration "
        f"history, a table (made by hand, or by a tool); nothing was done: {repair}"
    )


_TRACKING_REPAIR: Final = (
    "rename a renamed column back; put a dropped execution_time back with ALTER TABLE "
    f"{_migrate.TRACKING_TABLE} ADD COLUMN execution_time INTEGER NOT NULL DEFAULT 0; for any "
    "other column, restore the database from a backup"
)


def _ours(missing: re.Match[str]) -> bool:
    """Whether the table or column a _SCHEMA_DAMAGE error names is one of this release's
    schema (else a trigger or view of the user's own names it)."""
    schema = [part for part in _expected_schema() if part.kind == "table"]
    if (column := missing.group("column")) is not None:
        # The rowid too, which the store's reads order by: a table remade WITHOUT ROWID lacks it
        # (check() names the table).
        return column.lower() in _ROWID_NAMES or any(
            column.lower() in part.column_names for part in schema
        )
    table = next(name for name in missing.group("table", "has", "view", "refers") if name)
    return table.lower() in {part.name for part in schema} | {_migrate.TRACKING_TABLE}


# The names SQLite gives a table's rowid.
_ROWID_NAMES: Final = frozenset({"rowid", "oid", "_rowid_"})


def _too_big(detail: str, what: str = "a value of this call") -> InvalidInputError:
    return InvalidInputError(
        f"{what} is longer than SQLite keeps in one text or blob (its length "
        f"limit, 1,000,000,000 bytes unless the build changed it) [{detail}]; nothing was "
        "written: keep large outputs elsewhere (a file, an object store) and store a reference"
    )


def _outcome_too_big(
    exc: Exception, job_id: str, outcome_json: str, where: str = ""
) -> InvalidInputError | None:
    """The error naming the outcome that ``exc`` (raised recording it) found too long to store,
    or None if ``exc`` is no such refusal; ``where``: its place in a batch ("outcomes[3]: ")."""
    what = (
        f"{where}the outcome of job {job_id}, {len(outcome_json):,} characters as stored (its "
        "output, error and score as JSON; as many bytes or more in UTF-8),"
    )
    return _refused_as_too_big(exc, what)


def _refused_as_too_big(exc: Exception, what: str) -> InvalidInputError | None:
    """The error saying ``what`` (a value the call stored) is too long, if ``exc`` is sqlite3
    refusing it as that; else None."""
    if isinstance(exc, OverflowError):  # sqlite3 binding a text of over 2**31 - 1 bytes
        detail = str(exc)
    elif getattr(exc, "sqlite_errorname", None) == "SQLITE_TOOBIG":
        detail = f"{exc} (SQLITE_TOOBIG)"
    else:
        return None
    return _too_big(detail, what)


# ---------------------------------------------------------------------------------------------
# The connection's thread. aiosqlite exposes no public way to run a function of ours on its
# worker thread with the sqlite3 connection. These private names of aiosqlite.Connection are
# the whole of what we rely on, checked at connect (check_worker) and by
# tests/test_sqlite_backend.py, so an aiosqlite that changes them fails loudly, not oddly:
#   _connection  the sqlite3.Connection, None before it is opened and once closed; we open
#                it ourselves, on the worker (see open_on_worker), and never await the
#                aiosqlite.Connection itself
#   _running     False once the worker was told to stop
#   _tx          the worker's queue of (future or None, zero-argument function); the worker
#                calls the function and, given a future, resolves it on its loop. We give None
#                and settle our own future (see _deliver), which survives a closed loop
#   _thread      the worker, a threading.Thread that awaiting the connection would start; we
#                make it a daemon (see daemon_worker) and start it ourselves
# and aiosqlite.core._STOP_RUNNING_SENTINEL, which a function returns to end the worker's loop
# (see stop_worker).
# We put on _tx ourselves rather than await Connection._execute: that saves a coroutine, a
# functools.partial and a loop lookup on every call of the hot path.

# How long a connect whose open failed waits for its worker thread to end (it ends in
# microseconds: it is past the open, and has only its stop left to run).
_STOP_WAIT: Final = 5.0

_WORKER_ATTRIBUTES: Final = ("_connection", "_running", "_tx", "_thread")


def check_worker(conn: aiosqlite.Connection) -> None:
    """Fail loudly if this aiosqlite lacks what on_thread relies on."""
    missing = [name for name in _WORKER_ATTRIBUTES if not hasattr(conn, name)]
    if not hasattr(aiosqlite.core, "_STOP_RUNNING_SENTINEL"):
        missing.append("core._STOP_RUNNING_SENTINEL")
    if missing or not hasattr(getattr(conn, "_tx", None), "put_nowait"):
        raise ConfigurationError(
            f"control_store runs its transactions on aiosqlite's worker thread through "
            f"aiosqlite.Connection.{', .'.join(_WORKER_ATTRIBUTES)}, which this aiosqlite "
            f"({aiosqlite.__version__}) does not have as expected (missing: {missing or '_tx'}); "
            "install an aiosqlite version control_store supports (see pyproject.toml)"
        )


def daemon_worker(conn: aiosqlite.Connection) -> None:
    """Make the worker of a connection not yet started a daemon thread.

    aiosqlite's worker is a non-daemon thread that waits on its queue until close(). The
    interpreter joins non-daemon threads at exit before it collects anything, so a process
    that ends without closing its store (a forgotten close(), an exception that skips it)
    would hang at exit forever. A daemon worker ends with the process instead, at worst in
    the middle of a transaction: SQLite's atomic commit makes that the same as a killed
    process, and the next connection rolls it back.
    """
    check_worker(conn)
    thread = conn._thread
    if not isinstance(thread, threading.Thread) or thread.ident is not None:
        raise ConfigurationError(
            f"control_store expects aiosqlite.Connection._thread to be a threading.Thread not "
            f"yet started when the connection is made; this aiosqlite "
            f"({aiosqlite.__version__}) has {thread!r}; install an aiosqlite version "
            "control_store supports (see pyproject.toml)"
        )
    thread.daemon = True


class _Connection(aiosqlite.Connection):
    """aiosqlite's connection without its finalizer, which is ours to do.

    aiosqlite's ``__del__`` warns, nameless, and queues a stop that hands a result to an event
    loop (none in a forked child: a DeprecationWarning on 3.13). Every connection of ours is
    stopped by stop_worker instead: by SqliteBackend's finalizer, which names the database, or
    by the connect that failed before any backend held it. Without this, a store dropped in a
    reference cycle (an exception that skipped close()) warned twice, since the garbage
    collector may finalize the connection before the store; and a forked child's copy, which
    is not the child's to stop, warned on being dropped.
    """

    def __del__(self) -> None:
        pass


# Every sqlite3 connection a worker opened, until a stop closes it (_close_quietly). Held here
# so that the garbage collector never finalizes one itself: a store, or a connect task, left
# in a reference cycle (an exception that skipped close(), a loop closed without cancelling
# its tasks) is collected with everything it holds, in any order, and on Python 3.13 a
# connection finalized there warns of being left unclosed, nameless, before the store's own
# finalizer has queued its close. And a forked child does not close its copy of the parent's
# connection while it runs (SQLite forbids any use of a connection across fork(), a close
# included; a child that exits through the interpreter's teardown, rather than os._exit as
# multiprocessing's do, may still close it then).
_OPEN: Final[set[sqlite3.Connection]] = set()
# Connections whose migrate() failed to void its failed COMMIT's frames, until the worker
# running it takes the void over as owed (see migrate and _Worker.run_read_locked).
_UNVOIDED: Final[set[sqlite3.Connection]] = set()
# A token for each connection SQLite is opening on a worker thread right now (see open_it).
_CONNECTING: Final[set[object]] = set()


# The file (device, inode) each open connection of a store has open, from its open to its
# close (_close_quietly). POSIX locks belong to a process and a file: closing any descriptor
# of the file drops all of this process's SQLite's locks on it, so the library never opens
# such a file itself (see _in_wal_mode). A fork()ed child's copy names its parent's
# connections, but a child forked while any was open connects no store (_Process.forked_from).
class _Opened(NamedTuple):
    """A connection's file, as _FILES holds it."""

    identity: tuple[int, int]  # (device, inode)
    # Where SQLite puts its -wal and -shm: the name opened, symlinks resolved (its name), by
    # its directory's (device, inode) and its base name, which a bind mount of the directory
    # or a rename of it keeps (None where the directory cannot be looked at).
    sidecars: tuple[int, int, str] | None
    name: str


_FILES: Final[dict[sqlite3.Connection, _Opened]] = {}


# The connections that have seen their file's -wal (refuse_replaced_wal_files recorded it).
_SAW_WAL: Final[set[sqlite3.Connection]] = set()


def _held(
    identity: tuple[int, int],
    *,
    besides: sqlite3.Connection | None = None,
    with_wal: bool = False,
) -> bool:
    """Whether a store's connection has the file ``identity`` open; ``besides``, a connection
    not to count (the one whose connect asks); ``with_wal``: only one that has seen its -wal."""
    return any(
        opened.identity == identity and raw is not besides and (not with_wal or raw in _SAW_WAL)
        for raw, opened in list(_FILES.items())
    )


def _opened(path: str) -> _Opened | None:
    """The file at ``path`` as _FILES would hold it; None where it cannot be looked at."""
    identity = _identity_if_there(path)
    if identity is None:
        return None
    name = os.path.realpath(path)
    directory = _identity_if_there(os.path.dirname(name))
    sidecars = None if directory is None else (*directory, os.path.basename(name))
    return _Opened(identity, sidecars, name)


class Opening(NamedTuple):
    """A connection whose file is being opened on its worker (see open_on_worker)."""

    conn: aiosqlite.Connection
    opened: asyncio.Future[sqlite3.Connection]
    made: list[sqlite3.Connection]  # what the open made, on the worker's side of the hand-over


def open_on_worker(
    open_file: Callable[[], sqlite3.Connection], database: str, *, path: str | None = None
) -> Opening:
    """Start a new connection's worker thread (a daemon) and open the file on it; await
    ``opened`` for the sqlite3 connection, then make it the connection's own (take_opened).

    The worker keeps what it opened in ``made`` too, so that abandon_open, queued behind the
    open, closes it on the worker's thread even if no one took it (its caller cancelled); and
    the hand-over survives a loop that has closed meanwhile (see _deliver).
    """
    conn = _Connection(open_file, iter_chunk_size=64)
    daemon_worker(conn)
    try:
        conn._thread.start()
    except RuntimeError as exc:  # "can't start new thread": out of memory or of threads
        error = StorageError(
            f"could not start the thread that runs {database}'s connection [{exc}]: this "
            "process is out of memory or at its limit of threads; nothing was opened: free "
            "memory or end some threads, then retry"
        )
        error.retryable = True
        raise error from exc
    made: list[sqlite3.Connection] = []

    def open_it() -> sqlite3.Connection:
        token = object()
        _CONNECTING.add(token)  # a fork() while SQLite opens the file is refused too
        try:
            raw = open_file()
            _OPEN.add(raw)
        finally:
            _CONNECTING.discard(token)
        opened = None if path is None else _opened(path)
        if opened is not None:
            _FILES[raw] = opened
        made.append(raw)
        return raw

    loop = asyncio.get_running_loop()
    opened: asyncio.Future[sqlite3.Connection] = loop.create_future()
    conn._tx.put_nowait((None, partial(_deliver, [loop, opened, open_it])))
    return Opening(conn, opened, made)


def take_opened(opening: Opening) -> aiosqlite.Connection:
    """The connection, its file now open (``opened`` is done): on the loop's thread, which no
    stop can race, since none is queued until a caller has the connection."""
    opening.conn._connection = opening.opened.result()
    return opening.conn


def abandon_open(opening: Opening) -> None:
    """End the worker of a connect that failed or was cancelled before it took the
    connection, without waiting: queued behind the open (which may still be under way on a
    slow disk), the worker closes what it made, on its own thread, and ends, handing nothing
    to any event loop."""
    opening.conn._running = False

    def stop() -> object:
        for raw in opening.made:
            _close_quietly(raw)
        return aiosqlite.core._STOP_RUNNING_SENTINEL

    opening.conn._tx.put_nowait((None, stop))


def _close_quietly(raw: sqlite3.Connection) -> None:
    """Close a sqlite3 connection on its worker, for a stop: the stop must go on to end the
    worker's loop (a function that raises does not), and no one is left to tell of a close
    that failed (sqlite3_close_v2, which Python calls, defers rather than fails)."""
    with contextlib.suppress(Exception):
        raw.close()
    _FILES.pop(raw, None)
    _SAW_WAL.discard(raw)
    _UNVOIDED.discard(raw)
    _OPEN.discard(raw)


def stop_worker(conn: aiosqlite.Connection, *, closed: asyncio.Future[None] | None = None) -> None:
    """End the worker of a connection nobody will use again, with no await and no loop: from a
    finalizer, a shutdown, or a connect given up after it took the connection.

    The queued function closes the sqlite3 connection on the worker's own thread, after any
    function still queued, then ends the worker's loop. Given ``closed`` (close_on_worker), it
    settles that future once the connection is closed; the hand-over is dropped if the loop
    closed meanwhile, so nothing fails on the thread (aiosqlite's own close hands its result
    over with call_soon_threadsafe, which raises there, with a traceback, after Ctrl-C). The
    connection is marked closed at once, so no call is queued behind the stop.
    """
    raw = conn._connection
    conn._connection = None
    conn._running = False

    def stop() -> object:
        if raw is not None:
            _close_quietly(raw)
        if closed is not None:
            with contextlib.suppress(RuntimeError):  # "Event loop is closed": nobody waits
                closed.get_loop().call_soon_threadsafe(_settle_result, closed, None)
        return aiosqlite.core._STOP_RUNNING_SENTINEL

    conn._tx.put_nowait((None, stop))


def close_on_worker(conn: aiosqlite.Connection) -> asyncio.Future[None]:
    """Close the sqlite3 connection on the worker's thread and end the worker (stop_worker);
    await the returned future for the close."""
    closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stop_worker(conn, closed=closed)
    return closed


def _out_of_descriptors() -> bool:
    """Whether this process cannot open one more file for want of descriptors."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


@types.coroutine
def _suspend() -> Generator[None, None, None]:
    """Yield to the event loop once, after an inline call ran: as a hop would, every call stays
    a suspension point, so a task polling the store cannot starve the others. The bare yield
    that asyncio.sleep(0) makes, without its own coroutine around it."""
    yield


def on_thread(conn: aiosqlite.Connection, fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run ``fn()`` on ``conn``'s worker thread; await the returned future: one hop.

    Raises ValueError("Connection closed") at once if the connection is closed (as aiosqlite
    does), which translate() turns into StoreClosedError.
    """
    if not conn._running or conn._connection is None:
        raise ValueError("Connection closed")
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    conn._tx.put_nowait((None, partial(_deliver, [loop, future, fn])))  # no future: _deliver
    return future


def _deliver(call: list[Any]) -> None:
    """On the worker thread: run the call's function and hand its result, or its error, to
    its future; ``call`` is ``[loop, future, fn]``.

    aiosqlite would hand them over itself, given the future; but if the loop closed meanwhile
    (asyncio.run ended with this call in flight), its call_soon_threadsafe raises on the worker
    thread and ends the thread, printing a traceback, and every later function put on the
    queue (the store's close when it is collected) would wait forever. No one can await a
    future of a closed loop, so here the outcome is dropped instead, and the thread goes on.

    ``call`` is emptied first: aiosqlite's worker keeps its last function in a local while it
    waits for the next, and the future would keep its caller's task alive through it. A loop
    closed without cancelling its tasks (run_until_complete stopped by Ctrl-C, then close())
    then left that task uncollected for good, so nothing ever stopped the worker it waits on.
    """
    loop, future, fn = call
    call.clear()
    try:
        result = fn()
    except BaseException as exc:  # handed to the caller, as aiosqlite does
        settle: Callable[..., None] = _settle_exception
        value: object = exc
    else:
        settle, value = _settle_result, result
    with contextlib.suppress(RuntimeError):  # "Event loop is closed": nobody is waiting
        loop.call_soon_threadsafe(settle, future, value)


def _settle_result(future: asyncio.Future[Any], value: object) -> None:
    if not future.done():  # a cancelled caller's future stays cancelled
        future.set_result(value)


def _settle_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


# ---------------------------------------------------------------------------------------------
# Connection setup and migrations (synchronous, on the worker thread).


# Bytes the -wal file is cut back to after a checkpoint (see configure).
WAL_SIZE_LIMIT: Final = 64 * 1024 * 1024


def _milliseconds(seconds: float) -> int:
    """busy_timeout as SQLite takes it, whole milliseconds, rounded up: a wait asked for, however
    short, is at least 1 ms, never 0 (no wait at all)."""
    return math.ceil(seconds * 1000)


def configure(conn: sqlite3.Connection, *, path: str, options: Options, database: str) -> None:
    """Set the connection's pragmas, outside any transaction, in the order that works.

    busy_timeout first (everything after may wait on a lock), foreign keys (as sqlx does), then
    WAL for files: concurrent first openers can fail switching to WAL, so check and retry.
    Before any change, a file that is another application's database is refused, and so is a
    migration history that migrating would refuse.
    """
    try:
        _configure(conn, path=path, options=options, database=database)
    except sqlite3.OperationalError as exc:
        why = None if path == MEMORY else _opened_read_only(exc, path=path, database=database)
        if why is None:
            raise
        raise why from exc


def _configure(conn: sqlite3.Connection, *, path: str, options: Options, database: str) -> None:
    conn.execute(f"PRAGMA busy_timeout = {_milliseconds(options.busy_timeout)}")
    conn.execute("PRAGMA foreign_keys = ON")
    if path != MEMORY:
        _refuse_unfit_unread(path, database, options)
        _refuse_unfit(conn, database)
        deadline = time.monotonic() + options.busy_timeout
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as exc:
                name = getattr(exc, "sqlite_errorname", "")
                if not name.startswith(_BUSY):
                    raise
                mode = None
                if time.monotonic() >= deadline:
                    raise
            if mode == "wal":
                break
            if time.monotonic() >= deadline:
                raise StorageError(
                    f"could not switch the database to WAL mode (it stayed {mode!r}); check "
                    "that the file system supports shared memory (not a network share)"
                )
            time.sleep(0.01)
    # Per connection; FULL syncs the WAL at every commit, NORMAL only at checkpoints.
    conn.execute(f"PRAGMA synchronous = {options.synchronous}")
    if path != MEMORY:
        # SQLite never shrinks the -wal file by itself: after a big insert_jobs, or writes
        # while another connection's long read held off checkpoints, it stays at its peak size
        # until the last connection closes (measured: 1 GiB). With a limit, it is cut back to
        # it each time the WAL restarts after a checkpoint.
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        _refuse_read_only(conn)


def _refuse_unfit(conn: sqlite3.Connection, database: str) -> None:
    """Refuse another application's database, and a migration history this release cannot
    vouch for (a newer release's, a failed or an edited migration: pending() refuses them),
    before the switch to WAL, which would change the file, with migrate=False too (no call
    could use such a file)."""
    _refuse_foreign_database(conn, database)
    _migrate.pending(
        _migrate.load_migrations("sqlite"),
        _read_applied(conn, database=database),
        database=database,
    )


def _refuse_unfit_unread(path: str, database: str, options: Options) -> None:
    """_refuse_unfit on a ``mode=ro`` connection of its own, where ``path`` has a -wal file
    holding frames, before the store's own connection reads the file.

    A read-write connection that has read a file in WAL mode checkpoints its -wal into it when
    it closes as the file's last: refused with it, another application's database (killed with
    its last commits in its -wal), or a store beside a -wal that came from another database (a
    copied set of files, which SQLite replays), would be changed by the refusal that says it
    was left untouched. A read-only connection never checkpoints. Where that connection cannot
    read the file (SQLite cannot make its -shm, say), the store's own connection finds out why
    and says so, as without a -wal.
    """
    try:
        # Beside the file itself: SQLite resolves a symlink, and keeps its -wal by the target.
        if os.path.getsize(os.path.realpath(path) + "-wal") == 0:
            return
    except OSError:
        return  # no -wal: nothing a close could checkpoint
    try:
        ro = sqlite3.connect(read_only_uri(path), uri=True, isolation_level=None)
    except sqlite3.Error:
        return
    try:
        ro.execute(f"PRAGMA busy_timeout = {_milliseconds(options.busy_timeout)}")
        _refuse_unfit(ro, database)
    except sqlite3.Error as exc:
        # Busy for busy_timeout already (another connection's exclusive lock: a
        # locking_mode=EXCLUSIVE reader, the last store closing): the store's own connection
        # would wait as long again, and its error tell of one wait (a review measured 4 s at
        # busy_timeout=2).
        name = getattr(exc, "sqlite_errorname", "")
        if name.startswith(_BUSY) or name == "SQLITE_PROTOCOL":  # the ~10 s wait: see translate
            raise
        return
    finally:
        ro.close()


def _refuse_foreign_database(conn: sqlite3.Connection, database: str) -> None:
    """Refuse a database that holds tables but no control_store migration history.

    Every database this library ever wrote has its tracking table from the first migration on,
    so such a file is another application's (a mistyped URL): migrating it would write our
    tables into it, and switching it to WAL would change how its owner's file works.
    """
    names = [row[0] for row in conn.execute(SCHEMA_NAMES)]
    if names and _migrate.TRACKING_TABLE not in names:
        shown = ", ".join(repr(name) for name in names[:5]) + (", ..." if len(names) > 5 else "")
        raise ConfigurationError(
            f"{database} is not a control_store database: it holds {shown} and no "
            f"{_migrate.TRACKING_TABLE} table; it was left untouched: check the URL, and point "
            "it at a control_store database or at a new file"
        )


def _rewrite_page_one(conn: sqlite3.Connection) -> None:
    """Write the file's first page in the open write transaction without changing it:
    user_version set to itself (a write that needs no table of ours, and fires no trigger)."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    conn.execute(f"PRAGMA user_version = {int(version)}")  # PRAGMA takes no parameters


def _refuse_read_only(conn: sqlite3.Connection) -> None:
    """Fail now if SQLite could open the file only for reading.

    SQLite silently falls back to a read-only connection when the file is write-protected, and
    a read-only connection stays read-only after the permissions are fixed: every later write
    would fail until the store is reconnected. Trying a write that is rolled back (no commit,
    no fsync) turns that into SQLITE_READONLY at connect, where retrying the call is the cure.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        _rewrite_page_one(conn)
    finally:
        if conn.in_transaction:  # an I/O error may already have ended it; keep that error
            conn.execute("ROLLBACK")


def voids(exc: BaseException) -> bool:
    """Whether a COMMIT that failed with ``exc`` may have left its frames in the -wal whole, to
    be voided (see void_commit): an I/O error, not SQLITE_FULL (a write of a frame that failed
    so leaves no commit frame behind it, measured)."""
    return getattr(exc, "sqlite_errorname", "").startswith("SQLITE_IOERR")


def void_commit(conn: sqlite3.Connection) -> bool:
    """After a COMMIT that failed with an I/O error and was rolled back, make sure that what it
    wrote into the -wal is never applied; False if that could not be done now.

    SQLite writes a commit's frames into the -wal (and, at synchronous=FULL, fsyncs them)
    before it indexes them in the -shm. Where the indexing fails (SQLITE_IOERR_SHMSIZE: a full
    disk where the -shm must grow, as the -wal passes 4,062 frames and each 4,096 after), or
    the fsync does (SQLITE_IOERR_FSYNC), the commit is rolled back for every reader, but its
    frames lie in the -wal whole, and SQLite's recovery, at the next open of a -wal that was
    not checkpointed away (every connection killed, or a last close whose checkpoint failed),
    applies them: a refused insert_jobs's jobs were in the file after a kill (measured, with
    sqlite3 alone too), though its caller was told that nothing was written. A commit that
    writes a page writes its frame over theirs, from where they begin, which breaks their
    checksum chain for good: one is made here, at once, of _rewrite_page_one alone, into the
    -wal's room those frames took, so a full disk does not keep its frame out (at a -shm
    region's end its own COMMIT fails the same way, its frame written all the same). It fails
    only where it cannot take the write lock (another process holds it past busy_timeout) or an
    I/O error stops it: the void is then owed (see _Worker.owed_void).
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
        _rewrite_page_one(conn)
        conn.execute("COMMIT")
    except sqlite3.Error:
        with contextlib.suppress(sqlite3.Error):
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        return False
    return True


def _opened_read_only(exc: sqlite3.Error, *, path: str, database: str) -> ControlError | None:
    """Why SQLite opened the file only for reading, where more can be said than translate's
    "make the file, its -wal and -shm and its directory writable": which of them this user may
    not write (a -wal and -shm a read-only store left, with the database's mode or another
    user's), or a header whose write version is past 2 (a newer SQLite's file format, opened
    read-only however writable). None for any other failure."""
    name = getattr(exc, "sqlite_errorname", "")
    if name in ("SQLITE_READONLY", "SQLITE_CANTOPEN") and _on_read_only_mount(
        os.path.realpath(path)
    ):
        # access() refuses root too there, and SQLite says "unable to open database file"
        # where it cannot make the -wal and -shm: no permission, disk or file is at fault.
        target = os.path.realpath(path)
        readable = not _in_wal_mode(path) or all(
            os.path.exists(target + suffix) for suffix in ("-wal", "-shm")
        )
        error = StorageError(
            f"{database} cannot be opened for writing [{exc} ({name})]: it is on a file system "
            "mounted read-only; nothing was written: remount it read-write, or copy the "
            "database to a writable file system, then retry"
            + (
                " (or read it where it is with read_only=True, as the control-store read "
                "commands do)"
                if readable
                else ""
            )
        )
        error.retryable = True
        return error
    if name != "SQLITE_READONLY":
        return None
    header = _header(path)
    if len(header) < 20 or header[18] <= 2:
        target = os.path.realpath(path)
        names = [path, f"{target}-wal", f"{target}-shm"]
        denied = [name for name in names if not _may(name, os.W_OK) and os.path.exists(name)]
        if not denied:
            return None
        error = StorageError(
            f"{database} is read-only [{exc} (SQLITE_READONLY)]: this user may not write "
            f"{' and '.join(repr(name) for name in denied)}; nothing was written: make "
            f"{'it' if len(denied) == 1 else 'them'} writable by this user (a -wal and -shm a "
            "read-only store made take the database's mode, or its user), then retry"
        )
        error.retryable = True
        return error
    return ConfigurationError(
        f"{database} is in a file format newer than this SQLite ({sqlite3.sqlite_version}) "
        f"writes (its header's write version is {header[18]}; this SQLite writes 1 and 2), so "
        "SQLite opens it read-only however writable the file is; nothing was changed: read it "
        "with read_only=True (the control-store read commands do), or use a Python whose "
        "sqlite3 is built on the newer SQLite that made it"
    )


def configure_read_only(
    conn: sqlite3.Connection, *, path: str, database: str, options: Options
) -> None:
    """Set up a ``mode=ro`` connection and check its schema; nothing is written.

    No journal_mode (switching it writes the file header) and no synchronous (nothing to
    sync). query_only makes SQLite itself refuse any write that got past the Store's guard.
    The schema check is the connection's first read of the file: in WAL mode that is where
    SQLite needs the -shm file, so its failure is explained here (see _explain_unreadable).
    """
    conn.execute(f"PRAGMA busy_timeout = {_milliseconds(options.busy_timeout)}")
    conn.execute("PRAGMA query_only = ON")
    try:
        if options.check_schema:
            check_schema(conn, database=database)
        else:  # any version (migration_status), but not another application's database
            _refuse_foreign_database(conn, database)
    except sqlite3.Error as exc:
        explained = _explain_unreadable(exc, path=path, database=database, conn=conn)
        if explained is None:
            raise
        raise explained from exc


def check_schema(conn: sqlite3.Connection, *, database: str, read_only: bool = True) -> None:
    """Raise unless the schema is exactly at this library's newest migration.

    The same checks as migrating (a failed, edited or unknown migration is refused, as
    _migrate.pending does), and then no migration may be pending: a read-only store cannot
    apply it, and this library's queries assume the newest schema. ``read_only``: the store
    can never migrate (else it was opened with migrate=False, and store.migrate() would).
    """
    known = _migrate.load_migrations("sqlite")
    applied = _read_applied(conn, database=database)
    todo = _migrate.pending(known, applied, database=database)
    if not todo:
        return
    needed = known[-1]
    # pending() passed: every applied row is a known migration that succeeded.
    found = max((row.version for row in applied), default=0)
    names = ", ".join(f"{m.version} ({m.description})" for m in todo)
    tables: tuple[str, ...] = ()  # what a file with no migration recorded holds all the same
    if not applied:
        _refuse_foreign_database(conn, database)  # another application's: say so, not "empty"
        held = sorted({row[0] for row in conn.execute(SCHEMA_NAMES)} - {_migrate.TRACKING_TABLE})
        tables = tuple(
            sorted(
                str(name)
                for kind, name, _, _ in conn.execute(SELECT_OBJECTS)
                if kind == "table" and name != _migrate.TRACKING_TABLE
            )
        )
        state = (
            f"has no control_store migration recorded, though it holds {', '.join(held)}: its "
            f"rows in {_migrate.TRACKING_TABLE} were lost"
            if held
            else "has no control_store migration applied (it is empty)"
        )
        fix = (
            "connect without read_only (control-store migrate): its error gives the rows to "
            "put back, one a connect, in turn"
            if held
            else "point read_only at a control_store database, or create the schema by "
            "connecting once without read_only (control-store migrate does that)"
        )
    else:
        latest = next(row for row in applied if row.version == found)
        state = f"is at migration {found} ({latest.description})"
        fix = (
            "connect once without read_only to apply them (control-store migrate does that; "
            "on a copy you may not write, migrate a writable copy), or read it with the "
            f"control_store release whose newest migration is {found}"
        )
    if not read_only:
        fix = (
            "this store was opened with migrate=False: call 'await store.migrate()' to apply "
            "them, or connect without migrate=False"
        )
    never = "A read-only store never migrates" if read_only else "Nothing was done"
    raise PendingMigrationError(
        f"{database} {state}, but this version of control_store needs migration "
        f"{needed.version} ({needed.description}); pending: {names}. {never}: {fix}",
        found=found,
        needed=needed.version,
        pending=tuple((m.version, m.description) for m in todo),
        tables=tables,
    )


def _explain_unreadable(
    exc: sqlite3.Error, *, path: str, database: str, conn: sqlite3.Connection | None = None
) -> ControlError | None:
    """The StorageError that explains why a ``mode=ro`` connection cannot read ``path``.

    Measured on SQLite 3.40.1 (tests/test_read_only.py), for a database in WAL mode opened with
    mode=ro: it reads fine where its directory is writable (SQLite creates the -shm and -wal
    files it needs, and leaves them), or where both files are already there. In a directory it
    may not write, with no -shm file, the first read fails with SQLITE_READONLY_DIRECTORY; with
    a -wal file but no -shm file, with SQLITE_CANTOPEN. A database in rollback-journal mode
    needs neither file. None: ``exc`` is some other failure, translated as usual.
    """
    name = getattr(exc, "sqlite_errorname", "") or ""
    if not name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN")) or not _in_wal_mode(
        path, besides=conn
    ):
        return None
    directory = os.path.dirname(os.path.abspath(path))
    present = [suffix for suffix in ("-wal", "-shm") if os.path.exists(f"{path}{suffix}")]
    beside = " and ".join(present) or "neither"
    return StorageError(
        f"{database} cannot be read read-only [{exc} ({name})]: it is in WAL mode, and SQLite "
        "needs its -shm and -wal files even to read it, but may not create them in "
        f"{directory!r} (of the two, {beside} is there); nothing was changed. Copy the "
        "database together with its -wal and -shm files (all three, taken while no process "
        "writes it), or put the copy in a directory this process may write, or switch the "
        "copy out of WAL mode before making it read-only (sqlite3 COPY.db "
        "'PRAGMA journal_mode=DELETE': it then needs neither file)"
    )


def _in_wal_mode(path: str, *, besides: sqlite3.Connection | None = None) -> bool:
    """Whether the file's header says WAL: bytes 18 and 19 (write and read version) are 2.

    Never opened while another store of this process has the file open: closing the
    descriptor would drop that store's SQLite locks (see _check_place). Such a store has
    put it in WAL mode."""
    identity = _identity_if_there(path)
    if identity is not None and _held(identity, besides=besides):
        return True
    return _header(path)[18:20] == b"\x02\x02"


def _header(path: str) -> bytes:
    """The first 100 bytes of the file, SQLite's header (fewer, or none, where it cannot be
    read). Through a descriptor this process has open on the file already, where there is one
    (an sqlite3 connection of the caller's own): opening and closing one of ours would drop
    every POSIX lock this process holds on the file, that connection's too."""
    identity = _identity_if_there(path)
    if identity is not None:
        for fd in _descriptors_of(identity):
            with contextlib.suppress(OSError):
                return os.pread(fd, 100, 0)
    try:
        with open(path, "rb") as file:
            return file.read(100)
    except OSError:
        return b""


def _descriptors_of(identity: tuple[int, int]) -> list[int]:
    """This process's open descriptors of the file ``identity`` (Linux's /proc/self/fd; none
    found elsewhere)."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                st = os.stat(int(name))
                if (st.st_dev, st.st_ino) == identity and stat.S_ISREG(st.st_mode):
                    found.append(int(name))
    return found


def _locate(path: str) -> tuple[str, tuple[int, int], str]:
    """The path of the opened file, its identity, and the path SQLite names its -wal and -shm
    files after (symlinks resolved, as SQLite resolves them).

    The first is the path as given, made absolute so that a later os.chdir() does not make
    the file look replaced, but not normalised: the kernel resolves it afresh at each check,
    so a symlink on it retargeted under the store is seen as the file replaced, and
    "link/../x.db" stays the file SQLite opened (abspath would read it as "x.db" beside the
    link: another file). The last resolves every symlink, as SQLite does to name its files.
    """
    absolute = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    return absolute, _file_identity(absolute), os.path.realpath(absolute)


def _file_identity(path: str) -> tuple[int, int]:
    """The (device, inode) of the file at ``path``: which file it is, whatever its name."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _identity_if_there(path: str) -> tuple[int, int] | None:
    """_file_identity, or None where nothing (or nothing this process may look at) is."""
    try:
        return _file_identity(path)
    except OSError:
        return None


# The files SQLite keeps beside a database in WAL mode, and what each is for, as messages say.
# While any connection has the database open, SQLite never removes or replaces either: it
# truncates the -wal at a checkpoint, and the last connection to close deletes both.
_WAL_FILES: Final = (
    ("-wal", "write-ahead log (it holds every write since the last checkpoint)"),
    ("-shm", "shared-memory index (through it, processes share the write lock)"),
)


def _statements(sql: str) -> Iterator[str]:
    """Split a migration into statements (executescript would commit our transaction on 3.11)."""
    buffer: list[str] = []
    for line in sql.splitlines(keepends=True):
        buffer.append(line)
        candidate = "".join(buffer)
        if sqlite3.complete_statement(candidate):
            if candidate.strip():
                yield candidate
            buffer = []
    rest = "".join(buffer)
    if _strip_comments(rest).strip():
        yield rest  # an unterminated last statement: let SQLite judge it


def _strip_comments(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def _read_applied(conn: sqlite3.Connection, *, database: str) -> list[_migrate.AppliedMigration]:
    return [_applied(*row) for row in _tracking_rows(conn, database=database)]


def _tracking_rows(conn: sqlite3.Connection, *, database: str) -> list[tuple[Any, ...]]:
    """The history's rows as stored (SELECT_APPLIED's columns), text that is no UTF-8 as bytes."""
    held = conn.execute(SELECT_TRACKING_KIND, (_migrate.TRACKING_TABLE,)).fetchone()
    if held is None:
        return []
    if held[0] != "table":
        raise _tracking_replaced(database, str(held[0]))
    try:
        rows: list[tuple[Any, ...]] = _leniently(
            conn, lambda: conn.execute(SELECT_APPLIED).fetchall()
        )
    except sqlite3.OperationalError as exc:  # a column dropped or renamed: check() cannot run
        raise tracking_damage(database, exc) from exc
    return rows


def _applied(
    version: object, description: object, checksum: object, success: object, installed: object
) -> _migrate.AppliedMigration:
    """A tracking row as control_store writes it, or the CorruptRowError naming its cell: a
    row edited by hand (a checksum as hex text, a version -1) must not pass for another
    migration, or fail with a TypeError."""
    table = _migrate.TRACKING_TABLE
    if type(version) is not int or version < 1:
        raise _codec.corrupt_row(
            table,
            "version",
            version,
            version,
            "expected a migration's number, from 1",
            fix=f"delete the row (DELETE FROM {table} WHERE {_matching('version', version)}) if no "
            "migration of that number was applied, or restore the database from a backup",
        )
    if type(description) is not str:
        bad: tuple[str, object, str] = ("description", description, "expected text")
    elif type(checksum) is not bytes:  # its length is a release's own: a newer one may differ
        bad = ("checksum", checksum, "expected the SHA-384 of the migration's file, as a blob")
    elif type(success) is not int or success not in (0, 1):
        bad = ("success", success, "expected 0 or 1")
    elif type(installed) is not str:
        bad = ("installed_on", installed, "expected text")
    else:
        return _migrate.AppliedMigration(version, description, checksum, bool(success))
    column, value, why = bad
    fix = f"repair the row by hand ({_tracking_row(version)}) or restore the database from a backup"
    raise _codec.corrupt_row(table, column, version, value, why, fix)


def _matching(column: str, value: object) -> str:
    """The SQL condition that finds the stored ``value`` (any of SQLite's types) in
    ``column``, for a repair given as SQL: a Python repr is no SQL literal (None, b'..')."""
    # By storage class too: SQLite compares across classes (an integer 1 equals a real 1.0,
    # and its CAST to a blob is X'31'), so the value alone could find a row of another kind.
    if value is None:
        return f"{column} IS NULL"
    if type(value) is bytes:  # a blob, or text that is no UTF-8 (read leniently as its bytes)
        kinds, literal = "IN ('blob', 'text')", f"CAST({column} AS BLOB) = X'{value.hex()}'"
    elif type(value) is str:  # by its bytes: a quoted literal cannot hold a NUL
        kinds, literal = "= 'text'", f"CAST({column} AS BLOB) = X'{value.encode().hex()}'"
    elif type(value) is float:
        spelt = f"{'-' if value < 0 else ''}9e999" if not math.isfinite(value) else repr(value)
        kinds, literal = "= 'real'", f"{column} = {spelt}"  # 9e999: SQLite's infinity
    else:
        kinds, literal = "= 'integer'", f"{column} = {value!r}"
    return f"typeof({column}) {kinds} AND {literal}"


def _tracking_row(version: int) -> str:
    """What control_store records for migration ``version``, as the fix for its row."""
    for migration in _migrate.load_migrations("sqlite"):
        if migration.version == version:
            return (
                f"this release records migration {version} with description "
                f"'{migration.description}', success 1 and checksum "
                f"X'{migration.checksum.hex()}'"
            )
    return "a text description, success 0 or 1, and the migration file's SHA-384 as a blob"


def _migration_fix(migration: _migrate.Migration, exc: sqlite3.Error) -> str:
    """The fix for a migration that failed: when what it makes is there already, its tracking
    row was lost (deleted by hand, the file pieced together), and putting it back is the
    repair; else the migration file or the database is at fault."""
    if not _ALREADY_MADE.search(str(exc)):
        return "fix the migration file or the database"
    return (
        "what it makes is in the schema already, so its row in "
        f"{_migrate.TRACKING_TABLE} was lost (deleted by hand, or the file pieced together): "
        "if the schema is as this migration makes it (check() compares it once the row is "
        f"back), put the row back: {_migrate.restore_row_sql(migration)}; else restore the "
        "database from a backup"
    )


# SQLite's errors for a CREATE or ADD COLUMN whose object is there already.
_ALREADY_MADE: Final = re.compile(r"already exists|duplicate column name")


def migrate(conn: sqlite3.Connection, *, database: str) -> list[int]:
    """Apply every pending migration; return the versions applied.

    Each migration and its tracking row commit together in one BEGIN IMMEDIATE transaction,
    and the tracking table is read only after the write lock is held, so processes connecting
    to a fresh file at once apply each migration exactly once.
    """
    known = _migrate.load_migrations("sqlite")
    applied: list[int] = []
    upgrade = False  # whether the file had migrations before this call: an earlier release's
    while True:
        committing = False
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(CREATE_TRACKING_TABLE)
            held = _read_applied(conn, database=database)
            if not applied:
                upgrade = bool(held)
            todo = _migrate.pending(known, held, database=database)
            if not todo:
                conn.execute("COMMIT")
                return applied
            migration = todo[0]
            started = time.perf_counter_ns()
            for statement in _statements(migration.sql):
                try:
                    conn.execute(statement)
                except sqlite3.Error as exc:
                    name = getattr(exc, "sqlite_errorname", "")
                    if name.startswith(("SQLITE_BUSY", "SQLITE_FULL", "SQLITE_IOERR")):
                        raise  # the database's trouble, not the migration's: translated as such
                    raise MigrationError(
                        f"migration {migration.version} ({migration.description}) failed on "
                        f"{database}: {exc} ({name}), in statement "
                        f"{_strip_comments(statement).strip()[:200]!r}; "
                        f"none of it was applied: {_migration_fix(migration, exc)}"
                    ) from exc
            conn.execute(
                INSERT_APPLIED,
                (
                    migration.version,
                    migration.description,
                    _codec.format_timestamp(utc_now(), what="installed_on"),
                    migration.checksum,
                    time.perf_counter_ns() - started,
                ),
            )
            committing = True
            conn.execute("COMMIT")
            applied.append(migration.version)
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if committing and voids(exc) and not void_commit(conn):
                # Another process holds the write lock: the worker running this owes the void
                # (see _Worker.run_read_locked), paid in its next write transaction, or as the
                # connect that failed here closes the store. (A killed process leaves every
                # connection's frames in the -wal, and recovery would apply the migration its
                # connect was told had failed: a file this release then refused as newer.)
                _UNVOIDED.add(conn)
            if applied and isinstance(exc, (sqlite3.Error, ControlError)):
                raise _after_applied(exc, applied, known, conn, database, upgrade) from exc
            raise


def _after_applied(
    exc: BaseException,
    applied: Sequence[int],
    known: Sequence[_migrate.Migration],
    conn: sqlite3.Connection,
    database: str,
    upgrade: bool,
) -> BaseException:
    """The error of a migration that failed after earlier ones of the same call committed:
    translated, and saying that those are in the file now (a "nothing was written" would be
    false) and, of an ``upgrade`` (a file that had migrations before the call), that the
    release upgraded from refuses the file from then on; a new file had no such release."""
    try:
        (busy_ms,) = conn.execute("PRAGMA busy_timeout").fetchone()
    except sqlite3.Error:  # a connection broken by the failure: say what failed, all the same
        busy_ms = 0
    error = translate(exc, database=database, busy_timeout=busy_ms / 1000)
    if not isinstance(error, ControlError):
        return exc
    names = ", ".join(f"{m.version} ({m.description})" for m in known if m.version in applied)
    message = str(error).replace(
        "nothing of this call was written", "nothing of this migration was written"
    )
    error.args = (
        f"{message}; the migrations before it, {names}, were applied and committed: "
        f"{database} is at migration {applied[-1]} now"
        + (", which the release upgraded from refuses" if upgrade else "")
        + "; the next connect (or control-store migrate) applies the rest",
    )
    return error


@dataclass(frozen=True, slots=True)
class MigrationState:
    """One migration as the database and this library see it."""

    version: int
    description: str
    installed_on: str | None


def migration_status(conn: sqlite3.Connection, *, database: str) -> list[MigrationState]:
    """Every known migration with when it was applied (None: pending); checks them too."""
    known = _migrate.load_migrations("sqlite")
    held = _tracking_rows(conn, database=database)
    applied = [_applied(*row) for row in held]
    _migrate.pending(known, applied, database=database)  # a history it vouches for: all known
    return [
        MigrationState(r.version, r.description, r.installed_on)
        for r in _records(known, applied, _installed_on(held))
    ]


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """One migration as migration_history sees it, whatever the history holds."""

    version: int
    description: str
    state: str
    """'applied', 'pending', 'missing' (not recorded, but a later one is: its row was lost),
    'failed' (recorded as failed), 'changed' (its file's checksum is not the one recorded),
    'unreadable' (the recorded checksum is no SHA-384, or a cell of the row, the version
    aside, is not of what control_store writes), or 'unknown' (recorded, but this
    library has no such migration: a newer release's)."""
    installed_on: str | None


def migration_history(conn: sqlite3.Connection, *, database: str) -> list[MigrationRecord]:
    """Every known migration and every recorded one, in version order, each with its state,
    also where migration_status refuses the history (a failed, edited or unknown migration):
    what ``control-store migrate --status`` lists beside that refusal. A row that cannot be
    read at all is still a CorruptRowError; one whose version reads, but another cell not
    (a checksum as text, a success of 'yes'), is listed as 'unreadable'."""
    known = _migrate.load_migrations("sqlite")
    held = _tracking_rows(conn, database=database)
    rows = []
    unreadable = set()
    for row in held:
        try:
            rows.append(_applied(*row))
        except CorruptRowError as exc:
            if exc.column == "version":
                raise
            unreadable.add(row[0])
    return _records(known, rows, _installed_on(held), unreadable)


def _installed_on(held: Sequence[tuple[Any, ...]]) -> dict[int, str]:
    """Each version's installed_on, of the history's rows as _tracking_rows read them (a cell
    that is no text, shown as nothing)."""
    return {row[0]: row[4] for row in held if type(row[0]) is int and type(row[4]) is str}


def _records(
    migrations: Sequence[_migrate.Migration],
    rows: Sequence[_migrate.AppliedMigration],
    installed: dict[int, str],
    unreadable: Set[int] = frozenset(),
) -> list[MigrationRecord]:
    """The known ``migrations`` and the recorded ``rows``, each with its state and its
    ``installed`` time, and the versions of the ``unreadable`` rows (a cell but the version
    not as written)."""
    known = {m.version: m for m in migrations}
    applied = {row.version: row for row in rows}
    records = []
    newest = max(applied.keys() | unreadable, default=0)
    for version in sorted(known.keys() | applied.keys() | unreadable):
        mine, row = known.get(version), applied.get(version)
        if version in unreadable:
            state = "unreadable"  # a cell edited by hand (_applied names it)
        elif row is None:
            state = "missing" if version < newest else "pending"  # see _migrate.pending
        elif mine is None:
            state = "unknown"
        elif not row.success:
            state = "failed"
        elif len(row.checksum) != len(mine.checksum):
            state = "unreadable"  # no SHA-384: the cell was edited (see _migrate.pending)
        elif not _migrate.same_migration(mine, row.checksum):
            state = "changed"
        else:
            state = "applied"
        description = mine.description if mine is not None else row.description if row else ""
        records.append(MigrationRecord(version, description, state, installed.get(version)))
    return records


# ---------------------------------------------------------------------------------------------
# Operations: synchronous functions of the sqlite3 connection, run on the worker thread.
# Write operations run inside the transaction (and savepoint) the group commit opened.


_NOT_UTF8: Final = "Could not decode to UTF-8"


def _leniently(conn: sqlite3.Connection, query: Callable[[], T]) -> T:
    """Run a read; if a TEXT value in it is not UTF-8, run it again and let the codec say which.

    sqlite3 fails the whole fetch with an OperationalError that names neither the table nor the
    row when stored text is not UTF-8 (a hand edit, a foreign writer). Reads have no side
    effect, so the query runs again with a text factory that hands such values over as bytes,
    and decoding the row raises the CorruptRowError that names table, column, id and value.
    The strict factory stays the default: it is sqlite3's C fast path.
    """
    try:
        return query()
    except sqlite3.OperationalError as exc:
        if _NOT_UTF8 not in str(exc):
            raise
    with _lenient_text(conn):
        return query()


@contextlib.contextmanager
def _lenient_text(conn: sqlite3.Connection) -> Iterator[None]:
    """Within: TEXT that is not UTF-8 arrives as bytes, for the codec to report by row."""
    conn.text_factory = _codec.lenient_text
    try:
        yield
    finally:
        conn.text_factory = str


# A runs row as _codec.run_params makes it.
RunParams = tuple[str, str, str, int, int, str, str, int]


def _utf8_length(text: str) -> int:
    """The length of ``text`` in UTF-8, without a copy for ASCII text (most of it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def op_insert_run(params: tuple[Any, ...], conn: sqlite3.Connection) -> None:
    try:
        conn.execute(INSERT_RUN, params)
    except (sqlite3.DataError, OverflowError) as exc:  # a value too long: name the run's field
        fields = (("manifest", params[1]), ("models", params[2]))
        # By bytes, as SQLite's limit counts: the one with more characters may have fewer.
        column, value = max(fields, key=lambda field: _utf8_length(field[1]))
        form = "JSON; " if column == "models" else ""
        too_big = _refused_as_too_big(
            exc,
            f"run {params[0]}: its {column}, {len(value):,} characters as stored ({form}as "
            "many bytes or more in UTF-8),",
        )
        if too_big is None:
            raise
        raise too_big from exc
    except sqlite3.IntegrityError as exc:
        if getattr(exc, "sqlite_errorname", "") == "SQLITE_CONSTRAINT_PRIMARYKEY":
            raise AlreadyExistsError(
                f"run {params[0]} already exists; insert it once, or give the new run a "
                "fresh id (Run(...) makes one by default)"
            ) from exc
        raise


def op_get_run(run_id: str, conn: sqlite3.Connection) -> Run | None:
    row = _leniently(conn, lambda: conn.execute(SELECT_RUN, (run_id,)).fetchone())
    return None if row is None else _codec.decode_run(row)


def op_get_job(job_id: str, conn: sqlite3.Connection) -> Job | None:
    row = _leniently(conn, lambda: conn.execute(SELECT_JOB, (job_id,)).fetchone())
    return None if row is None else _codec.decode_job(row)


def op_list_jobs(run_id: str, conn: sqlite3.Connection) -> list[Job]:
    rows = _leniently(conn, lambda: conn.execute(SELECT_JOBS_OF_RUN, (run_id,)).fetchall())
    return _codec.decode_jobs(rows)


def op_job_page(
    run_id: str, after: int | None, limit: int, conn: sqlite3.Connection
) -> tuple[list[Job], int | None]:
    """Up to ``limit`` jobs of a run after rowid ``after`` (None: from the first), and the rowid
    to continue after (``after`` itself when the page is empty).

    One statement in autocommit mode, fetched whole: its own read snapshot, and nothing (no
    cursor, no transaction) left open between pages.
    """
    if after is None:
        rows = _leniently(
            conn, lambda: conn.execute(SELECT_FIRST_JOB_PAGE, (run_id, limit)).fetchall()
        )
    else:
        rows = _leniently(
            conn, lambda: conn.execute(SELECT_NEXT_JOB_PAGE, (run_id, after, limit)).fetchall()
        )
    if not rows:
        return [], after
    return _codec.decode_keyed_jobs(rows), rows[-1][0]


# For a run the caller did insert, which its id does not find: its row was edited by hand.
_IF_INSERTED: Final = (
    "if you did, and check() names its row as edited by hand, repair that row instead"
)


def op_insert_jobs(jobs: Iterable[Job], conn: sqlite3.Connection) -> int:
    return sum(_insert_jobs(jobs, conn).values())


def _insert_jobs(
    jobs: Iterable[Job], conn: sqlite3.Connection, *, with_run: str | None = None
) -> dict[str, int]:
    """Insert ``jobs``; return how many went to each run (by id text). ``with_run``: the id of
    the run insert_run inserts with them, whose op has guarded them already (see _of_run),
    and whose caller is told of a job id taken as insert_run's."""
    # executemany pulls one row at a time through map, so any iterable streams in bounded
    # memory; last() is the row being inserted when a constraint fails.
    encode, last, per_run = _codec.job_encoder()
    rows: Iterable[_codec.JobRow] = map(encode, guarded(jobs) if with_run is None else jobs)
    if with_run is None and not _replayable(jobs):
        # A generator may never end: refuse its first job past a run's room as it comes, as
        # insert_run does (_of_run), or it would hold the write lock, and grow the -wal, for
        # as long as it ran. A list or tuple is bounded: counted whole, at the end.
        rows = _within_job_count(rows, conn)
    try:
        conn.executemany(INSERT_JOB, rows)
    except InvalidInputError as exc:  # encode's: guarded() wraps what the caller's jobs raise
        _codec.in_batch(exc, "jobs", sum(per_run().values()))
        raise
    except (sqlite3.DataError, OverflowError) as exc:  # a value too long: name the job
        failed = last()
        too_big = None
        if failed is not None:
            too_big = _refused_as_too_big(
                exc,
                f"jobs[{sum(per_run().values()) - 1}]: job {failed[0]}, its spec "
                f"{len(failed[2]):,} characters as stored (JSON; as many bytes or more in UTF-8),",
            )
        if too_big is None:
            raise
        raise too_big from exc
    except sqlite3.IntegrityError as exc:
        name = getattr(exc, "sqlite_errorname", "")
        failed = last()
        if failed is not None and name == "SQLITE_CONSTRAINT_PRIMARYKEY":
            if with_run is not None:
                raise _job_id_taken(failed[0], with_run, conn) from exc
            twice = _inserted_by_this_call(failed[0], sum(per_run().values()) - 1, conn)
            if twice:
                raise AlreadyExistsError(
                    f"job {failed[0]} is given twice in this call's jobs; no job of this call "
                    "was inserted: give each job its own id (Job(...) makes one by default)"
                ) from exc
            if twice is None:
                raise AlreadyExistsError(
                    f"job {failed[0]} already exists, or is given twice in this call's jobs; no "
                    "job of this call was inserted: give each job its own id, and drop a job "
                    "stored before from the batch"
                ) from exc
            raise AlreadyExistsError(
                f"job {failed[0]} already exists; no job of this call was inserted: drop it "
                "from the batch, or give it a fresh id"
            ) from exc
        if failed is not None and name == "SQLITE_CONSTRAINT_FOREIGNKEY":
            if conn.execute(SELECT_JOB_ROWS, (failed[1],)).fetchone() is not None:
                raise ConstraintError(
                    f"job {failed[0]} was refused by a foreign key this release's schema does "
                    f"not make (its run {failed[1]} exists) [{exc}]; no job of this call was "
                    "inserted: check() names the key, and how to remake the table without it"
                ) from exc
            raise MissingRunError(
                f"job {failed[0]} refers to run {failed[1]}, which does not exist; no job of "
                f"this call was inserted: insert the run first ({_IF_INSERTED})"
            ) from exc
        raise
    counts = per_run()
    for run_id, added in counts.items():
        if conn.execute(ADD_JOB_ROWS, (added, run_id, added)).rowcount != 1:
            _refuse_job_rows(run_id, added, conn)
    return counts


def _within_job_count(
    rows: Iterable[_codec.JobRow], conn: sqlite3.Connection
) -> Iterator[_codec.JobRow]:
    """``rows``, refusing the first one past its run's room (job_count - job_rows, read once
    per run, when its first row comes). A run that is missing, or whose counters are not
    integers, is left to the foreign key and to ADD_JOB_ROWS at the end, which explain it."""
    room: dict[str, int | None] = {}  # the rows each run may still take (None: not counted)
    for row in rows:
        run_id = row[1]
        try:
            left = room[run_id]
        except KeyError:
            found = conn.execute(SELECT_JOB_ROWS, (run_id,)).fetchone()
            ints = found is not None and all(type(v) is int for v in found) and found[1] >= 0
            left = max(found[0] - found[1], 0) if ints else None
        if left is not None:
            # One past the room: refused, unless this job's id is taken (stored before, or
            # given earlier in the call), which the insert then refuses as that, as it would
            # have without this check.
            if left <= 0 and conn.execute(SELECT_JOB_RUN, (row[0],)).fetchone() is None:
                _refuse_job_rows(run_id, None, conn)
            left -= 1
        room[run_id] = left
        yield row


def _inserted_by_this_call(job_id: str, inserted: int, conn: sqlite3.Connection) -> bool | None:
    """Whether ``job_id`` is one of the ``inserted`` jobs this call inserted before the one that
    failed (given twice, not stored before): SQLite gives a new row the table's largest rowid
    plus one, so they are the table's last rows, still there in the call's transaction. None:
    no telling, once a row holds the largest rowid there is (SQLite then picks them at
    random)."""
    if inserted <= 0:
        return False
    if conn.execute(SELECT_LARGEST_JOB_ROWID).fetchone()[0] == _LARGEST_ROWID:
        return None
    return conn.execute(SELECT_LATEST_JOB, (inserted, job_id)).fetchone() is not None


def _job_id_taken(job_id: str, run_id: str, conn: sqlite3.Connection) -> AlreadyExistsError:
    """The error for insert_run's job whose id a job has already: one stored before, or one
    given earlier in the same call (inserted by then, in the call's own transaction)."""
    row = conn.execute(SELECT_JOB_RUN, (job_id,)).fetchone()
    if row is not None and row[0] == run_id:
        return AlreadyExistsError(
            f"job {job_id} is given twice in insert_run's jobs for run {run_id}; nothing was "
            "inserted, the run neither: give each job its own id (Job(...) makes one by "
            "default)"
        )
    return AlreadyExistsError(
        f"job {job_id} already exists; nothing was inserted, the run {run_id} neither: give "
        "that job of the run a fresh id (Job(...) makes one by default)"
    )


def _replayable(items: Iterable[Any]) -> bool:
    """Whether ``items`` is a list or a tuple: its iterator cannot raise, and it can be read
    again; any other iterable may do either (a generator, a cursor of another database)."""
    return type(items) in (list, tuple)


def one_shot(items: Iterable[Any]) -> bool:
    """Whether reading ``items`` may use them up, so that a failed call must say it read them:
    an iterator (a generator, a map), or any other iterable that is no collection, such as an
    object whose ``__iter__`` is a generator over a file, a queue or a cursor (each iter() of it
    goes on where the last one stopped, so a retry with it would insert only what is left, and
    succeed). A sequence, set or mapping (a list, a set, a deque, a dict's view), or a class
    that subclasses collections.abc.Collection, reads the same again. Having ``__len__`` and
    ``__contains__`` promises nothing: a progress bar over a generator (tqdm's) has both, and
    each iter() of it goes on with the generator."""
    kind = type(items)
    if kind is list or kind is tuple:  # the common case, before the abstract classes' checks
        return False
    if issubclass(kind, (Sequence, Set, Mapping, MappingView)):
        return False
    return Collection not in kind.__mro__


def insert_jobs_op(jobs: Iterable[Job]) -> Op[int]:
    """The op inserting ``jobs``: a RunsOnce unless they can be read again (_replayable)."""
    if _replayable(jobs):
        return partial(op_insert_jobs, jobs)
    return RunsOnce(jobs, type(jobs).__name__, one_shot=one_shot(jobs))


def insert_run_with_jobs_op(params: RunParams, jobs: Iterable[Job]) -> Op[int]:
    """The op of insert_run(run, jobs=...), of the run's checked ``params``: a RunsOnce unless
    the jobs can be read again."""
    if _replayable(jobs):
        return partial(op_insert_run_with_jobs, params, jobs)
    kind = type(jobs).__name__
    return RunsOnce(jobs, kind, one_shot=one_shot(jobs), run=params)


def op_insert_run_with_jobs(
    params: RunParams, jobs: Iterable[Job], conn: sqlite3.Connection
) -> int:
    """The run, then every one of its jobs, in the op's one transaction: a run is never seen
    without all its jobs, so no claim can hand out a run whose submitter died between the
    two (README: "A run comes with its jobs"). A job of another run, or a number
    of jobs other than the run's job_count, fails the op, and nothing is inserted.

    The run's id and job_count are its checked ``params``, as inserted, never the Run read
    again: the caller's jobs run in this op, and one may change the Run meanwhile (a frozen
    struct too, by msgspec.structs.force_setattr), or be a subclass that reads otherwise."""
    run_id, job_count = params[0], params[4]
    op_insert_run(params, conn)
    # _of_run outside the guard: its refusals are the store's, not the caller's iterable's.
    counts = _insert_jobs(_of_run(run_id, job_count, guarded(jobs)), conn, with_run=run_id)
    strays = [other for other in counts if other != run_id]
    if strays:  # a run_id whose own __eq__ said it was this run's: the rows say otherwise
        raise InvalidInputError(
            f"a job given to insert_run for run {run_id} belongs to run {strays[0]}; nothing "
            "was inserted: give insert_run(run, jobs=...) that run's jobs only (Job(run.id, "
            "...))"
        )
    inserted = counts.get(run_id, 0)
    if inserted != job_count:
        raise ConstraintError(
            f"run {run_id} has job_count {job_count}, but insert_run was given {inserted} "
            f"job{'' if inserted == 1 else 's'} for it; nothing was inserted: pass "
            f"{'its one job' if job_count == 1 else f'all {job_count} of its jobs'}, or insert "
            "the run alone and its jobs with "
            "insert_jobs, in as many calls as you like (a claim may then hand it out before "
            "they are all in)"
        )
    return inserted


def _of_run(run_id: str, job_count: int, jobs: Iterable[Job]) -> Iterator[Job]:
    """``jobs``, refusing one of another run (insert_run's, inserting run ``run_id``), and the
    job past ``job_count`` as soon as it comes: an endless generator would otherwise hold the
    write lock, and grow the -wal, for as long as it ran. A job that is no Job, or whose
    run_id is no UUID (or one whose own methods fail), goes on to the encoder, which explains
    it; one whose run_id's own __eq__ lies is found by the rows (op_insert_run_with_jobs)."""
    number = uuid.UUID(run_id).int
    room = job_count
    for job in jobs:
        # By its type (never isinstance(), which an object faking __class__ passes), and its
        # fields read from the struct (never a subclass's properties, which may raise): one
        # that cannot be read so goes on to the encoder, which explains it.
        if type(job) is Job:  # the hot path: Job's own slots, no property over them
            try:
                fields: tuple[object, object] | None = (job.run_id, job.id)
            except AttributeError:  # a field unset through its slot descriptor
                fields = None
        else:
            fields = _job_fields(job)
        if fields is not None:
            other, job_id = fields
            if (type(other) is uuid.UUID or is_a(other, uuid.UUID)) and _number_of(other) not in (
                number,
                None,
            ):
                raise InvalidInputError(
                    f"job {_id_shown(job_id)} belongs to run {_id_shown(other)}, "
                    f"not to run {run_id}, which "
                    "insert_run was inserting with its jobs; nothing was inserted: give "
                    "insert_run(run, jobs=...) that run's jobs only (Job(run.id, ...)), and "
                    "insert other runs' jobs with insert_jobs"
                )
        if not room:
            raise ConstraintError(
                f"run {run_id} has job_count {job_count}, but insert_run was given more "
                f"jobs for it; nothing was inserted: pass exactly {job_count} of its jobs, "
                "and put any others in a new run"
            )
        room -= 1
        yield job


def _job_fields(job: object) -> tuple[object, object] | None:
    """``(run_id, id)`` of a Job (a subclass's too, by name: a subclass's own fields may come
    between them), as the struct holds them; None for anything else, or a Job whose fields
    cannot be read (the encoder explains it)."""
    if not is_a(job, Job):
        return None
    try:
        run_id, _, job_id, *_ = _codec.struct_fields(job, Job, what="the job")
    except InvalidInputError:
        return None
    return run_id, job_id


def _id_shown(value: object) -> str:
    """An id for a message: a UUID's canonical text, made from its number (never a subclass's
    __str__, which may raise or name another id), else as shown() shows any value."""
    number = _number_of(value) if is_a(value, uuid.UUID) else None
    return str(uuid.UUID(int=number)) if number is not None else shown(value)


def _number_of(value: uuid.UUID) -> int | None:
    """A UUID's 128-bit number, as uuid.UUID itself holds it (never a subclass's __eq__), or
    None if reading it fails or gives no 128-bit number (a subclass's own ``int``): the
    encoder then explains it."""
    try:
        number = int.__index__(_codec.uuid_number(value))  # the slot, not a subclass's own
    except Exception:
        return None
    return number if 0 <= number < 1 << 128 else None


@dataclass(slots=True)
class RunsOnce:
    """The insert of jobs that may not be read twice (anything but a list or a tuple: a
    generator, or an iterable whose iterator may raise), after their ``run`` for insert_run's.
    A group never runs it again (see _Worker.apart).

    ``pulled`` is set when the insert takes the first job. From then on a ``one_shot``
    iterable (see one_shot: an iterator, a progress bar over a generator) is consumed, so an
    error must say so (see told), or a caller retrying the same call with the same generator
    would insert only what is left of it, or nothing, and succeed. Not before (the insert's
    statement failing as it is prepared, a lock never taken); nor for a sequence, set or
    mapping (a list, a set, a deque), which reading leaves as it was.
    """

    jobs: Iterable[Job]
    kind: str  # the type of the caller's iterable, as the error names it
    one_shot: bool
    run: RunParams | None = None  # insert_run's: the run inserted first
    pulled: bool = False

    def __call__(self, conn: sqlite3.Connection) -> int:
        if self.run is not None:
            return op_insert_run_with_jobs(self.run, self._watched(), conn)
        return op_insert_jobs(self._watched(), conn)

    def _watched(self) -> Iterator[Job]:
        """The jobs, noting when the first is taken; the rest at the pace of ``yield from``."""
        jobs = iter(self.jobs)  # in the generator: what it raises reaches _pulled's guard
        for job in jobs:
            self.pulled = True
            yield job
            break
        yield from jobs

    def told(self, error: BaseException) -> BaseException:
        """``error`` as its caller gets it: once a one-shot iterable was consumed, a
        ControlError of its own (a copy: a group may hand one instance to several callers)
        that ends by saying so and how to retry; else ``error`` itself (a lock that was never
        taken, say, leaves the iterable as it was, and retrying with it is right)."""
        if not (self.pulled and self.one_shot) or not isinstance(error, ControlError):
            return error  # the caller's own exception (RaisedByCaller's) is theirs to read
        return consumed(error, self.kind, items="jobs", verb="insert")


def consumed(error: ControlError, kind: str, *, items: str, verb: str) -> ControlError:
    """``error`` of a batch call whose one-shot iterable (of ``kind``) the failed attempt
    consumed, as its caller gets it: a copy (a group may hand one instance to several callers)
    whose message ends by saying so, and how to retry. Whatever the error says to do, retrying
    with that same iterable would ``verb`` only what is left of it (nothing, for a generator
    run to its end) and succeed: a run short of jobs, which nothing reports (a run's jobs may
    legitimately come in later calls), or outcomes never recorded."""
    told = _copy_of(error)
    told.args = (
        f"{error}. The {items} came as a one-shot iterable ({kind}), and this failed attempt "
        f"consumed it: a retry must pass a new iterable of the same {items} (make the "
        f"generator again, or pass a list), not this one, which would {verb} only the {items} "
        "it has left, or none",
    )
    return told


def _copy_of(error: _E) -> _E:
    """A copy of ``error`` (its message, attributes and cause) for one caller of several: a
    group may hand one instance to several callers."""
    told = copy.copy(error)
    told.__cause__ = error.__cause__
    return told


def guarded(items: Iterable[T]) -> Iterable[T]:
    """The caller's batch, with what its iterable raises wrapped in RaisedByCaller, so that it
    reaches the caller as it is: an error of the caller's own source (another database's
    cursor failing, say) must never be taken for, or turned into, one of this store's (a
    locked or closed store, a value too long, a refused item). A _replayable batch cannot
    raise, and skips the guard, whose frame costs up to 3% of a job's insert."""
    return items if _replayable(items) else _pulled(items)


def _pulled(items: Iterable[T]) -> Iterator[T]:
    try:
        yield from items
    except Exception as exc:
        raise RaisedByCaller(exc) from None


class RaisedByCaller(Exception):
    """An exception the caller's own iterable raised inside an op: translate() lets it through,
    and SqliteBackend.write raises the caller's exception itself (as does Store, for a batch
    it reads on the loop's thread)."""

    def __init__(self, raised: Exception) -> None:
        super().__init__(raised)
        self.raised = raised


def _refuse_job_rows(run_id: str, added: int | None, conn: sqlite3.Connection) -> NoReturn:
    """Raise the error that explains why ADD_JOB_ROWS changed nothing (the call rolls back);
    ``added`` None: refused at the first job past the run's room, the rest unread (a one-shot
    iterable's, by _within_job_count), so the call adds at least the room and one more."""
    row = _leniently(conn, lambda: conn.execute(SELECT_JOB_ROWS, (run_id,)).fetchone())
    if row is None:  # only if foreign keys were off on this connection: the FK refuses it
        (job_id,) = conn.execute(SELECT_NEWEST_JOB_OF_RUN, (run_id,)).fetchone()
        raise MissingRunError(
            f"job {job_id} refers to run {run_id}, which does not exist; no job of this call "
            f"was inserted: insert the run first ({_IF_INSERTED})"
        )
    job_count, job_rows = row
    for value, column in ((job_count, "job_count"), (job_rows, "job_rows")):
        if not isinstance(value, int):
            raise _codec.corrupt_row("runs", column, run_id, value, "expected an integer")
    if job_rows < 0:  # a hand edit: counted from it, the run would take more than job_count
        raise _codec.corrupt_row("runs", "job_rows", run_id, job_rows, "expected an integer >= 0")
    # No call changes a stored run's job_count: the fix is fewer jobs, or another run.
    room = max(job_count - job_rows, 0)
    fix = (
        f"insert at most {room:,} more job{'' if room == 1 else 's'} for it, and put the rest in "
        "a new run"
        if room
        else "it has all its jobs; put further jobs in a new run"
    )
    adds = (
        f"at least {room + 1:,} more (refused at the first job too many)"
        if added is None
        else f"{added:,} more"
    )
    raise ConstraintError(
        f"run {run_id} has job_count {job_count:,} and {counted(job_rows, 'job')} already; this "
        f"call would add {adds}; no job of this call was inserted: {fix} (a run's "
        "job_count is fixed when it is inserted)"
    )


def op_run_page(
    status: str | None,
    after: tuple[object, int] | None,
    limit: int,
    conn: sqlite3.Connection,
) -> tuple[list[Run], tuple[object, int] | None]:
    """Up to ``limit`` runs (with ``status``, if not None) after the key ``after``, (created_at,
    rowid) of the last run read (None: from the newest), and the key to continue after
    (``after`` itself when the page is empty). One statement fetched whole, as op_job_page."""
    by_status: tuple[object, ...] = () if status is None else (status,)
    if after is None:
        sql = SELECT_FIRST_RUN_PAGE if status is None else SELECT_FIRST_RUN_PAGE_BY_STATUS
        params = (*by_status, limit)
    else:
        sql = SELECT_NEXT_RUN_PAGE if status is None else SELECT_NEXT_RUN_PAGE_BY_STATUS
        created_at, rowid = after
        params = (*by_status, created_at, rowid, limit, *by_status, created_at, limit, limit)
    rows = _leniently(conn, lambda: conn.execute(sql, params).fetchall())
    if not rows:
        return [], after
    created_at, rowid = rows[-1][:2]
    return _codec.decode_runs([row[2:] for row in rows]), (created_at, rowid)


def op_list_runs(status: str | None, limit: int, conn: sqlite3.Connection) -> list[Run]:
    def query() -> list[Any]:
        if status is None:
            return conn.execute(SELECT_RUNS, (limit,)).fetchall()
        return conn.execute(SELECT_RUNS_BY_STATUS, (status, limit)).fetchall()

    return _codec.decode_runs(_leniently(conn, query))


# The lines of PRAGMA integrity_check whose repair is known (SQLite's wording, stable across
# versions since 3.x). SQLite documents an index that lost or gained entries
# (SQLITE_CORRUPT_INDEX) as "might be resolved by running the REINDEX command, assuming no
# other problems exist elsewhere in the database file"; a duplicate in a UNIQUE index must
# lose a row first, or REINDEX fails on it.
_INDEX_ENTRIES: Final = re.compile(r"(?:missing from|wrong # of entries in) index (\S+)$")
_NOT_UNIQUE: Final = re.compile(r"non-unique entry in UNIQUE index (\S+)$")
_BAD_VALUE: Final = re.compile(r"^NULL value in (\w+)\.(\w+)$")
_RESTORE: Final = (
    "restore the file from a backup (with every process on it stopped, delete its -wal and -shm "
    "files before copying the backup in: SQLite applies a -wal it finds beside the path, as a "
    "killed process leaves one, to whatever file is there, and a sound backup then reads as "
    "damaged too); without one, the sqlite3 shell's .recover command copies what is still "
    "readable into a new database (a shell built without SQLITE_ENABLE_DBPAGE_VTAB, as "
    'Debian 12\'s is, fails it with "SQL logic error": there, sqlite3 damaged.db .dump | '
    "sed '$s/^ROLLBACK; -- due to errors$/COMMIT;/' | sqlite3 new.db copies the rows it can "
    "read; the shell ends the dump of a damaged table with ROLLBACK, so piped as it is, new.db "
    "keeps nothing)"
)


_ROWS_SKIPPED: Final = (
    "the row-level checks were skipped: they read through the structures SQLite found damaged, "
    "so their findings could be wrong; make the repairs above, then run check() again"
)


def _integrity_lines(result: str) -> list[str]:
    """The findings in one row of PRAGMA integrity_check, a line each: a row about damaged
    pages holds many, under a "*** in database main ***" heading that is no finding."""
    lines = [line for line in result.splitlines() if line.strip()]
    return [line for line in lines if not _DATABASE_HEADING.match(line)] or [result]


_DATABASE_HEADING: Final = re.compile(r"\*\*\* in database \S+ \*\*\*$")


def _unique_keys(conn: sqlite3.Connection) -> dict[str, tuple[str, str]]:
    """Each UNIQUE index (a primary key's included) by name: its table and its columns, joined
    by commas; {} if the schema cannot be read that far (the damage reaches it)."""
    keys: dict[str, tuple[str, str]] = {}
    try:
        tables = [name for kind, name, _, _ in conn.execute(SELECT_OBJECTS) if kind == "table"]
        for table in tables:
            for _, index, unique, *_ in conn.execute(SELECT_INDEXES, (table,)).fetchall():
                if unique:
                    columns = conn.execute(SELECT_INDEX_COLUMNS, (index,))
                    named = ", ".join(str(row[2]) for row in columns if row[5])  # keys only
                    keys[index] = (table, named)
    except sqlite3.DatabaseError:
        return {}
    return keys


def integrity_repair(line: str, unique: dict[str, tuple[str, str]] | None = None) -> str:
    """The finding for one line of PRAGMA integrity_check, ending with its repair. ``unique``:
    the UNIQUE indexes' tables and columns (see _unique_keys), for an index of them."""
    if match := _INDEX_ENTRIES.search(line):
        fix = f"rebuild the index: REINDEX {match[1]}"
        if unique and match[1] in unique:
            # The index may have lost the entry of a second row holding a key: REINDEX then
            # fails with "UNIQUE constraint failed" until one of them is gone.
            table, columns = unique[match[1]]
            fix += (
                f" (if that fails with 'UNIQUE constraint failed', two rows hold one key: list "
                f"them with SELECT rowid, {columns} FROM {table} NOT INDEXED WHERE ({columns}) "
                f"IN (SELECT {columns} FROM {table} NOT INDEXED GROUP BY {columns} HAVING "
                f"count(*) > 1), delete the one that should not exist by its rowid, then "
                f"REINDEX {match[1]} again)"
            )
    elif match := _NOT_UNIQUE.search(line):
        fix = (
            f"two rows hold the same key of index {match[1]}: delete the one that should not "
            f"exist, then REINDEX {match[1]}"
        )
    elif match := _BAD_VALUE.search(line):
        table, column = match[1], match[2]
        fix = (
            f"find the row with SELECT rowid FROM {table} WHERE {column} IS NULL and set "
            f"{column} or delete the row, or {_RESTORE}"
        )
    else:  # damaged pages, or a value of the wrong type: the file itself is not to be trusted
        fix = _RESTORE
    return f"SQLite integrity check: {line}; {fix}"


@dataclass(frozen=True, slots=True)
class _Part:
    """A table or index of the schema, as check() compares it between this release's schema
    and a database's. Names in lower case (SQLite's names ignore case). ``columns``: a
    table's (name, type, NOT NULL, default, primary key position), or the columns an index
    keys; ``keys``: a table's foreign keys (column, table, column, actions); ``flags``: an index's
    (UNIQUE, partial)."""

    kind: str
    name: str
    table: str
    sql: str
    columns: tuple[tuple[object, ...], ...]
    keys: tuple[tuple[str, str, str, str], ...]
    flags: tuple[object, ...]

    @property
    def column_names(self) -> list[object]:
        return [column[0] for column in self.columns]


_Shape = tuple[
    tuple[tuple[object, ...], ...], tuple[tuple[str, str, str, str], ...], tuple[object, ...]
]


@cache
def _expected_schema() -> list[_Part]:
    """The tables and indexes this release's migrations make, read from an in-memory database
    the migrations ran on."""
    conn = sqlite3.connect(MEMORY)
    try:
        for migration in _migrate.load_migrations("sqlite"):
            conn.executescript(migration.sql)
        return [
            _Part(
                kind,
                name.lower(),
                table.lower(),
                " ".join(sql.split()),
                *_shape(conn, kind, name, table),
            )
            for kind, name, table, sql in conn.execute(SELECT_OBJECTS).fetchall()
            if kind in ("table", "index")
        ]
    finally:
        conn.close()


def _shape(conn: sqlite3.Connection, kind: str, name: str, table: str) -> _Shape:
    """(columns, foreign keys, flags) of the table or index ``name`` (of ``table``), as _Part
    holds them."""
    if kind == "index":
        keyed = tuple(
            (str(row[2]).lower(), row[3], str(row[4]).upper())  # name, DESC, collation
            for row in conn.execute(SELECT_INDEX_COLUMNS, (name,))
            if row[5]  # a key column, not the rowid every index carries after them
        )
        flags = next(
            (
                (row[2], row[4])
                for row in conn.execute(SELECT_INDEXES, (table,))
                if str(row[1]).lower() == name.lower()
            ),
            (),
        )
        return keyed, (), flags
    columns = tuple(
        (str(row[1]).lower(), str(row[2]).upper(), row[3], row[4], row[5])
        for row in conn.execute(SELECT_COLUMNS, (name,))
    )
    keys = tuple(
        (str(row[3]).lower(), str(row[2]).lower(), str(row[4]).lower(), _key_actions(row))
        for row in conn.execute(SELECT_FOREIGN_KEYS, (name,))
    )
    return columns, keys, ()


def _key_actions(row: Sequence[object]) -> str:
    """A foreign key's ON UPDATE and ON DELETE actions, as its CREATE TABLE would spell them
    ("" for none): ON DELETE CASCADE would delete a run's jobs with the run."""
    actions = [f"ON {when} {what}" for when, what in (("UPDATE", row[5]), ("DELETE", row[6]))]
    return " ".join(action for action in actions if not action.endswith("NO ACTION"))


def _column_text(column: tuple[object, ...]) -> str:
    """A column's definition as its CREATE TABLE would spell it."""
    _, kind, not_null, default, key = column
    parts = [
        str(kind),
        "PRIMARY KEY" if key else "",
        "NOT NULL" if not_null else "",
        f"DEFAULT {default}" if default is not None else "",
        "" if kind else "(no type)",
    ]
    return " ".join(part for part in parts if part)


def _schema_sound(conn: sqlite3.Connection, found: Callable[[str, object, str], None]) -> bool:
    """Report where the database's schema differs from this release's (a part dropped, renamed
    or redefined by hand or by a tool), each with its repair; False if a table is missing or not
    as made, which the row checks need. What the database has beyond it (a user's own table,
    column, index or trigger) is no finding.
    """
    # Tables, views and indexes share one namespace; triggers have their own: a trigger of
    # the user's named as one of this schema's indexes hides nothing.
    objects = [row for row in conn.execute(SELECT_OBJECTS) if row[0] != "trigger"]
    have = {str(name).lower(): (kind, str(table).lower()) for kind, name, table, _ in objects}
    definitions = {str(name).lower(): str(sql or "") for _, name, _, sql in objects}
    ours = {part.name for part in _expected_schema()} | {_migrate.TRACKING_TABLE}
    unsound: set[str] = set()
    # What a table's repair remakes with it: all its indexes, where the table itself is to be
    # made again; those keying a column to be renamed back (an index follows a rename), where
    # only columns are. Any other index of such a table is checked as ever.
    remade: set[str] = set()
    damaged: dict[str, set[object]] = {}
    collated: dict[str, set[object]] = {}  # columns made with another collation

    def report(message: str) -> None:
        found("database", "", message)

    if have.get(_migrate.TRACKING_TABLE, (None, None))[0] == "table":
        # Only the next migration reads execution_time: a store connects without it, and the
        # loss would show only at the next release's upgrade.
        held = conn.execute(SELECT_COLUMNS, (_migrate.TRACKING_TABLE,))
        lacking = sorted(_TRACKING_COLUMNS - {str(column[1]).lower() for column in held})
        if lacking:
            report(
                f"the migration history, {_migrate.TRACKING_TABLE}, lacks column "
                f"{', '.join(lacking)}, which the next migration writes: {_TRACKING_REPAIR}"
            )
    for part in _expected_schema():
        kind, table = have.get(part.name, (None, None))
        if part.kind == "index":
            if part.table in remade or (
                (damaged.get(part.table, set()) | collated.get(part.table, set()))
                & set(part.column_names)
            ):
                continue  # repaired with its table, or with its column
            shape = (part.columns, part.keys, part.flags)
            if (
                kind == "index"
                and table == part.table
                and _shape(conn, kind, part.name, table) == shape
            ):
                continue
            # What holds the name goes first: an index or a view by a DROP, a table (someone's
            # rows) by a rename, which loses nothing. A trigger's names are apart from these.
            drop = {
                "index": f"DROP INDEX {part.name}; ",
                "view": f"DROP VIEW {part.name}; ",
                "table": f"ALTER TABLE {part.name} RENAME TO {part.name}_moved; ",
            }.get(str(kind), "")
            report(
                f"the schema lacks index {part.name} as this release made it ({part.sql}); "
                f"make it again: {drop}{part.sql}"
            )
            continue
        if kind != "table":
            unsound.add(part.name)
            remade.add(part.name)
            clear = "" if kind is None else f"DROP {str(kind).upper()} {part.name}; "
            # A table of the user's with this one's columns may be this one, renamed.
            renamed = next(
                (
                    other
                    for other, (other_kind, _) in have.items()
                    if other_kind == "table"
                    and other not in ours
                    and [c[0] for c in _shape(conn, "table", other, other)[0]] == part.column_names
                ),
                None,
            )
            back = (
                f"if {renamed} is {part.name} renamed, rename it back: {clear}ALTER TABLE "
                f"{renamed} RENAME TO {part.name}; else "
                if renamed is not None
                else ""
            )
            # The table's CREATE, then its indexes', dropped first: a rename takes them along.
            make = "; ".join(
                other.sql
                if other.kind == "table"
                else f"DROP INDEX IF EXISTS {other.name}; {other.sql}"
                for other in _expected_schema()
                if other.table == part.name
            )
            what = (
                f"lacks table {part.name}"
                if kind is None
                else (f"has a {kind} named {part.name} where this release's table should be")
            )
            report(
                f"the schema {what}; {back}restore the database from a backup (without one, "
                f"{clear}make it again, empty: {make})"
            )
            continue
        made = _TABLE_OPTIONS.findall(" ".join(part.sql.split()))
        options = _TABLE_OPTIONS.findall(" ".join(definitions.get(part.name, "").split()))
        if sorted(o.upper() for o in options) != sorted(o.upper() for o in made):
            # WITHOUT ROWID: the store reads and orders every table by rowid, so no row check
            # could run; STRICT refuses values the store never writes, but a hand edit may.
            unsound.add(part.name)
            remade.add(part.name)
            report(
                f"table {part.name} is made {' and '.join(options) or 'without options'}, not "
                f"as this release made it ({' and '.join(made) or 'with no table options'}): a "
                f"table rebuilt by hand; {_rebuild(part)}"
            )
            continue
        clauses = _CONFLICT_CLAUSE.findall(_code_of(definitions.get(part.name, "")))
        if clauses:
            # pragma_table_info does not show them: an insert of a stored id would then replace
            # the stored row (REPLACE: a recorded job made new again, a running run queued
            # again) or be dropped without a word (IGNORE), where the store refuses it.
            made = sorted({" ".join(c.upper().split()) for c in clauses})
            effects = " or ".join(_CONFLICT_EFFECTS[clause.split()[-1]] for clause in made)
            report(
                f"table {part.name} is made with {', '.join(made)}, "
                "which this release's table has not (a table rebuilt by hand): an insert of an "
                f"id already stored would {effects}, instead of being refused alone; "
                f"{_rebuild(part)}"
            )
        declared = _collations(definitions.get(part.name, ""))
        for name, collation in _collations(part.sql).items():
            if declared.get(name, collation) == collation:
                continue  # as made, or a column gone, which the column checks below report
            # The column's indexes take its collation: remade as this release makes them they
            # would take it again, so they are not reported apart (the rebuild remakes them).
            collated.setdefault(part.name, set()).add(name)
            keying = [
                i.name
                for i in _expected_schema()
                if i.kind == "index" and i.table == part.name and name in i.column_names
            ]
            keyed = f" ({', '.join(keying)})" if keying else ""
            report(
                f"column {part.name}.{name} is made COLLATE {declared[name]}, not "
                f"{collation} as this release made it (a table rebuilt by hand): SQLite "
                "compares and orders its values by that collation, in the store's queries and "
                f"in the indexes keying it{keyed}, where "
                f"they expect {collation}'s; {_rebuild(part)}"
            )
        columns, keys, _ = _shape(conn, "table", part.name, part.name)
        by_name = {column[0]: column for column in columns}
        strangers = [column[0] for column in columns if column[0] not in part.column_names]
        for want in part.columns:
            got = by_name.get(want[0])
            if got == want:
                continue
            unsound.add(part.name)
            damaged.setdefault(part.name, set()).add(want[0])
            if got is None:
                back = (
                    f"if {part.name}.{strangers[0]} is it renamed, rename it back: ALTER TABLE "
                    f"{part.name} RENAME COLUMN {strangers[0]} TO {want[0]}; else "
                    if len(strangers) == 1
                    else ""
                )
                report(
                    f"the schema lacks column {part.name}.{want[0]}; {back}restore the database "
                    "from a backup (its values are not in this file)"
                )
            else:
                report(
                    f"column {part.name}.{want[0]} is {_column_text(got)}, not "
                    f"{_column_text(want)} as this release made it (a table rebuilt by hand, "
                    "by CREATE TABLE ... AS SELECT say, loses its keys and constraints); restore "
                    "the database from a backup"
                )
        for key in part.keys:
            if key in keys:
                continue
            unsound.add(part.name)
            if (
                key[0] in damaged.get(part.name, ())
                or key[1] in remade
                or key[2] in damaged.get(key[1], ())
            ):
                continue  # a rename moved it, and renaming back (the finding made) moves it back
            acting = [other for other in keys if other[:3] == key[:3]]
            if acting:
                report(
                    f"column {part.name}.{key[0]} refers to {key[1]}({key[2]}) "
                    f"{acting[0][3] or 'with no action'}, where this release made it "
                    f"{key[3] or 'with no action'} (a table rebuilt by hand); restore the "
                    "database from a backup"
                )
                continue
            now = [other for other in keys if other[0] == key[0]]
            why = (
                f"it refers to {now[0][1]}({now[0][2]}) instead: renaming a table rewrites the "
                "references to it"
                if now
                else "it has no foreign key: a table rebuilt by hand loses them"
            )
            report(
                f"column {part.name}.{key[0]} no longer refers to {key[1]}({key[2]}) ({why}); "
                "restore the database from a backup"
            )
        # A foreign key on one of this release's columns that it does not make (one on a column
        # of the user's own is theirs): every write of a value it finds no row for is refused.
        # Columns whose key this release made is missing: a key of theirs was told above (as
        # the one they refer to instead), or they are to be renamed back.
        told: set[object] = {key[0] for key in part.keys if key not in keys}
        told |= damaged.get(part.name, set())
        for other in keys:
            if other[0] not in part.column_names or other in part.keys or other[0] in told:
                continue
            target = other[1] if other[2] == "none" else f"{other[1]}({other[2]})"
            target += f" {other[3]}" if other[3] else ""  # its actions, ON DELETE CASCADE say
            report(
                f"column {part.name}.{other[0]} refers to {target}, a foreign key this "
                "release's schema does not make (a table rebuilt by hand): a write of a "
                f"{other[0]} that no row of {other[1]} holds is refused; {_rebuild(part)}"
            )
    return not unsound


# A conflict clause of a column or table constraint that changes what a refused write does
# (none in this release's tables), in a CREATE TABLE's text with its strings, quoted names and
# comments taken out (_code_of). ABORT is SQLite's default, and FAIL refuses the statement as
# it does (the store rolls back the call's savepoint); ROLLBACK ends the whole transaction, the
# group's, whose one-shot writes cannot run again.
_CONFLICT_CLAUSE: Final = re.compile(
    r"\bON\s+CONFLICT\s+(?:IGNORE|REPLACE|ROLLBACK)\b", re.IGNORECASE
)
# What each such clause does to an insert of an id already stored, as check() tells it.
_CONFLICT_EFFECTS: Final = {
    "IGNORE": "be dropped without a word",
    "REPLACE": "replace the stored row",
    "ROLLBACK": "roll back the whole group transaction, failing the writes of other callers",
}
_NOT_CODE: Final = re.compile(
    r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|\[[^\]]*\]|--[^\n]*|/\*.*?\*/", re.S
)


def _code_of(sql: str) -> str:
    """``sql`` without its string literals, quoted names and comments: the words left are
    keywords and bare names."""
    return _NOT_CODE.sub(" ", sql)


def _rebuild(part: _Part) -> str:
    """The repair of a table rebuilt by hand in a way no ALTER TABLE undoes."""
    return (
        "restore the database from a backup (without one, make it again as this release does, "
        f"{part.sql}, under another name, copy its rows over and swap the two, as SQLite's "
        "procedure for other table changes does: "
        "https://sqlite.org/lang_altertable.html#otheralter)"
    )


# A CREATE TABLE's tokens: strings, quoted names, comments, words, one character of the rest.
_TOKEN: Final = re.compile(
    r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`(?:[^`]|``)*`|\[[^\]]*\]|--[^\n]*|/\*.*?(?:\*/|\Z)"
    r"|\w+|\S",
    re.S,
)
# The words that begin a table constraint, where a column definition begins with its name.
_TABLE_CONSTRAINT: Final = frozenset({"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN"})


def _name(token: str) -> str:
    """A name as SQLite reads it, quoted ("x", `x`, [x], 'x') or bare, in lower case."""
    if token[:1] in "\"`'":  # 'x' too: SQLite takes a string where a name is expected
        return token[1:-1].replace(token[0] * 2, token[0]).lower()
    if token[:1] == "[":
        return token[1:-1].lower()
    return token.lower()


def _collations(sql: str) -> dict[str, str]:
    """Each column's collation as the CREATE TABLE ``sql`` declares it, by the column's name
    in lower case: the name after a COLLATE among the column's own constraints (upper case),
    BINARY (SQLite's default) where there is none. pragma_table_info does not show it."""
    collations: dict[str, str] = {}
    item: list[str] = []  # the column definition or table constraint read so far, depth 1 only
    depth = 0
    for piece in _TOKEN.findall(sql):
        if piece.startswith(("--", "/*")):
            continue
        if piece == "(":
            depth += 1
        elif piece == ")":
            depth -= 1
        if depth == 1 and piece not in ("(", ")", ","):
            item.append(piece)  # a word of the item's own, not one inside its parentheses
        elif (depth == 1 and piece == ",") or (depth == 0 and piece == ")"):
            if item and item[0].upper() not in _TABLE_CONSTRAINT:
                after = [i + 1 for i, word in enumerate(item[:-1]) if word.upper() == "COLLATE"]
                collations[_name(item[0])] = _name(item[after[-1]]).upper() if after else "BINARY"
            item = []
            if depth == 0:
                break
    return collations


# A CREATE TABLE's table options, after its closing parenthesis.
_TABLE_OPTIONS: Final = re.compile(r"\b(WITHOUT ROWID|STRICT)\s*(?:,|;|$)", re.IGNORECASE)

_ROWS_NEED_SCHEMA: Final = (
    "the row-level checks were skipped: they read the tables and columns this release's "
    "schema has; make the repairs above, then run check() again"
)


def abandonable(op: Op[T]) -> tuple[Op[T], Callable[[], None]]:
    """``op``, and a function that makes it stop at its next SQLite step: for a long read whose
    caller is gone (a cancelled check(), a wait_for that timed out). Without it the read ran to
    its end on the store's one thread (13 s for check() at a million jobs) while every later
    call of the store, close() too, waited for a result no one would take. A progress handler,
    not conn.interrupt(): it is the op's own, so it can only stop this op, never the one after.
    The op's read snapshot is ended whatever state the interrupted statement left it in."""
    gone = threading.Event()

    def run(conn: sqlite3.Connection) -> T:
        conn.set_progress_handler(gone.is_set, 1000)
        try:
            return op(conn)
        finally:
            conn.set_progress_handler(None, 0)
            if gone.is_set() and conn.in_transaction:
                conn.execute("ROLLBACK")  # a read transaction: rolling back loses nothing

    return run, gone.set


def op_check(conn: sqlite3.Connection) -> list[Problem]:
    """Every inconsistency in the database, changing nothing: SQLite's integrity check in one
    read snapshot, then the schema and the rows in another, which their findings need to agree.
    Not all in one: a reader's snapshot keeps the WAL from being checkpointed past it, and
    beside a steady writer the WAL grew by all that was written during the whole check (to
    about 1 GB at a million jobs, measured); the integrity check is about a third of it."""
    problems: list[Problem] = []

    def found(table: str, row_id: object, message: str) -> None:
        problems.append(Problem(table, str(row_id), message))

    with _read_snapshot(conn):
        try:
            lines = [
                line
                for (result,) in conn.execute("PRAGMA integrity_check")
                if result != "ok"
                for line in _integrity_lines(result)
            ]
            unique = _unique_keys(conn) if lines else {}
            for line in lines:
                found("database", "", integrity_repair(line, unique))
        except sqlite3.DatabaseError as exc:  # damage so deep the check itself cannot run
            found("database", "", f"SQLite integrity check failed: {exc}; {_RESTORE}")
    if problems:
        # The row-level queries read through these same b-trees (the counters through
        # idx_jobs_run): over an index missing rows they would report, say, a wrong job_rows
        # whose "repair" breaks a sound run. Repair the file first.
        found("database", "", _ROWS_SKIPPED)
        return problems
    with _read_snapshot(conn):
        if not _schema_sound(conn, found):
            found("database", "", _ROWS_NEED_SCHEMA)
        else:
            _check_rows(conn, found)
    return problems


@contextlib.contextmanager
def _read_snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction (deferred: a snapshot, no write lock) in which text that is not
    UTF-8 arrives as bytes, so that check()'s decoders report the row instead of sqlite3
    failing the whole check."""
    conn.execute("BEGIN")
    try:
        with _lenient_text(conn):
            yield
    finally:
        try:
            conn.execute("COMMIT")
        except sqlite3.Error:  # a read transaction: rolling back loses nothing
            if conn.in_transaction:
                conn.execute("ROLLBACK")


def _check_rows(conn: sqlite3.Connection, found: Callable[[str, object, str], None]) -> None:
    """The row-level half of op_check: id spellings, missing runs, readable rows, counters,
    outcomes (the list is Store.check's docstring).

    Findings that change an id come last, in an order that lets each repair be made as
    written: first every finding that names a row by its id as stored, then the run ids to
    repair (unreadable, then to rewrite), then the jobs whose run is missing (by their ids as
    stored; some re-attach to a rewritten run), then the job ids to repair (the same way), then
    the copies to delete.
    """
    run_rewrites: list[tuple[str, object, str]] = []  # run ids, to canonical text
    job_rewrites: list[tuple[str, object, str]] = []  # job ids, to canonical text
    attached: list[tuple[str, object, str]] = []  # orphan jobs: their repairs
    deletions: list[tuple[str, object, str]] = []  # second copies of rows
    # What the repairs found here change in each run's counts, by the run's id as stored:
    # [done, total] to add to what CHECK_RUN_COUNTERS counts, so that its counter findings
    # already hold once those repairs are made (rare: only after hand edits of ids).
    moved: dict[object, list[int]] = {}

    def move(run_id: object, done: int, total: int) -> None:
        counts = moved.setdefault(run_id, [0, 0])
        counts[0] += done
        counts[1] += total

    # The canonical text of each run id stored otherwise, to the text it is stored as.
    respelled: dict[str, str] = {}
    # Second rows of a run, to be deleted (no counter findings), to the id as stored of the row
    # that stays, where their jobs go.
    copies: dict[str, str] = {}
    for (run_id,) in conn.execute(CHECK_NONCANONICAL_RUN_IDS, (UUID_SHAPE_GLOB,)):
        if (canonical := _canonical_uuid(run_id)) is None:
            continue
        if canonical in respelled or conn.execute(SELECT_MISSING_RUN, (canonical,)).fetchone():
            # Rewriting it would collide with the row already there, or with an earlier row
            # rewritten to the same id (rows in rowid order): it is a second copy. Its jobs
            # go to that row, and count there.
            copies[run_id] = respelled.get(canonical, canonical)
            done, total = conn.execute(SELECT_RUN_JOB_COUNTS, (run_id,)).fetchone()
            move(copies[run_id], done, total)
            deletions.append(
                (
                    "runs",
                    run_id,
                    f"run {run_id} is a second row for run {canonical}, under its id in "
                    "non-canonical text (a hand insert); delete it: give its jobs, if it has any, "
                    f"run_id '{canonical}' (or delete them), then DELETE FROM runs WHERE id = "
                    f"'{run_id}'; then run check() again",
                )
            )
            continue
        respelled[canonical] = run_id
        run_rewrites.append(
            (
                "runs",
                run_id,
                f"run {run_id} has its id stored as non-canonical text, so get_run and "
                f"insert_jobs cannot find it; rewrite it as '{canonical}', in runs.id and in "
                "jobs.run_id of its jobs, in one transaction after PRAGMA defer_foreign_keys = ON",
            )
        )
    job_copies: set[str] = set()
    # Canonical ids that a finding rewrites a job to, to that job's text as stored.
    respelled_jobs: dict[str, str] = {}
    # Jobs whose outcome their copy's deletion moves over: no status finding of their own.
    outcome_moved: set[str] = set()
    for (job_id,) in conn.execute(CHECK_NONCANONICAL_JOB_IDS, (UUID_SHAPE_GLOB,)):
        if (canonical := _canonical_uuid(job_id)) is None:
            continue
        kept = respelled_jobs.get(canonical)
        if kept is not None or conn.execute(SELECT_JOB_EXISTS, (canonical,)).fetchone():
            kept = canonical if kept is None else kept
            job_copies.add(job_id)
            run_id, has_outcome = conn.execute(SELECT_JOB_COUNTS, (job_id,)).fetchone()
            # To be deleted: uncounted where it is counted (a run copy's jobs count in the run
            # that stays).
            move(copies.get(run_id, run_id), -has_outcome, -1)
            kept_run, kept_outcome = conn.execute(SELECT_JOB_COUNTS, (kept,)).fetchone()
            save = ""
            if has_outcome and not kept_outcome and kept not in outcome_moved:
                # The only recorded outcome: it moves to the row that stays, never lost (from
                # the first copy holding one: the first outcome stands).
                outcome_moved.add(kept)
                move(_home(conn, kept_run, respelled, copies), 1, 0)
                save = (
                    f"first move its outcome, the only one recorded, to job {canonical}: "
                    f"UPDATE jobs SET outcome = (SELECT outcome FROM jobs WHERE id = "
                    f"'{job_id}'), status = 'done' WHERE id = '{canonical}'; then "
                )
            deletions.append(
                (
                    "jobs",
                    job_id,
                    f"job {job_id} is a second row for job {canonical}, under its id in "
                    f"non-canonical text (a hand insert); delete it: {save}DELETE FROM jobs WHERE "
                    f"id = '{job_id}'; then run check() again",
                )
            )
            continue
        respelled_jobs[canonical] = job_id
        job_rewrites.append(
            (
                "jobs",
                job_id,
                f"job {job_id} has its id stored as non-canonical text, so get_job and "
                f"record_job_outcome cannot find it; rewrite it as '{canonical}'",
            )
        )
    unreadable_runs: list[object] = []  # ids that are no UUID: no repair can be judged by them
    # Their findings, made after every finding that names the row by that id.
    run_ids: list[tuple[str, object, str]] = []
    job_ids: list[tuple[str, object, str]] = []
    unreadable_parents = False  # a job's run_id is no UUID: its run is unknown
    decoders = (
        (SELECT_ALL_RUNS, _codec.decode_run, _codec.run_cell_errors),
        (SELECT_ALL_JOBS, _codec.decode_job, _codec.job_cell_errors),
    )
    for select, decode, cell_errors in decoders:
        for row in conn.execute(select):
            try:
                decode(row)
                continue
            except CorruptRowError:
                # Every bad cell of the row, each its own finding, so that the repairs given
                # leave none for a second check() to find. An id in another spelling of its
                # UUID is not among them: it has its own finding, with its rewrite.
                errors = cell_errors(row)
            for exc in errors:
                if exc.column != "id":
                    found(exc.table, exc.row_id, str(exc))
                else:  # its repair changes the id the row's other findings name it by
                    ids = run_ids if exc.table == "runs" else job_ids
                    ids.append((exc.table, exc.row_id, str(exc)))
                # Read as spelt, an id is refused only when it is no UUID at all.
                if exc.column == "id" and exc.table == "runs":
                    unreadable_runs.append(row[0])
                elif exc.column == "run_id":
                    unreadable_parents = True
    # A run that is gone (deleted by hand) leaves every job of it here: the first
    # _ORPHANS_NAMED of each run_id get a finding each, the rest one finding together (a run of
    # a million jobs gave a million findings, 241 MB of output). The verdict is the run_id's,
    # read once for all its jobs.
    verdicts: dict[object, tuple[str, str | None]] = {}
    seen: Counter[object] = Counter()  # jobs of each missing run_id met so far
    unnamed: dict[object, list[Any]] = {}  # run_id: [the first job not named, their count]
    for job_id, run_id, has_outcome in conn.execute(CHECK_ORPHAN_JOBS):
        if job_id in job_copies:  # to be deleted, as its own finding says
            continue
        job = _codec.id_text(job_id)
        if (verdict := verdicts.get(run_id)) is None:
            verdict = verdicts[run_id] = _missing_run(conn, run_id, respelled)
        message, parent = verdict
        if parent is None:
            seen[run_id] += 1
            if seen[run_id] > _ORPHANS_NAMED:
                unnamed.setdefault(run_id, [job, 0])[1] += 1
                continue
            if unreadable_runs:
                message += _repair_first(unreadable_runs, "one may be this job's run")
        attached.append(("jobs", job, f"job {job} {message}"))
        if parent is not None:  # re-attached to its run, stored canonically or respelled
            move(respelled.get(parent, parent), has_outcome, 1)
    for run_id, (job, count) in unnamed.items():
        attached.append(("jobs", job, _unnamed_orphans(run_id, job, count)))
    # A copy is to be deleted; a run whose id is unreadable has its jobs counted once that id
    # is repaired (they may refer to it by its right text). Any SQLite value is hashable.
    # While some job's run_id is no UUID, no run's counters can be judged: it may be any's.
    skipped: set[object] = {*copies, *unreadable_runs}
    for row in conn.execute(CHECK_RUN_COUNTERS):
        if unreadable_parents or row[0] in skipped:
            continue
        if (delta := moved.get(row[0])) is not None:
            row = (*row[:4], row[4] + delta[0], row[5] + delta[1], row[6])
        _check_counters(row, found)
    for job_id, status, has_outcome in conn.execute(CHECK_JOB_OUTCOMES):
        if job_id in job_copies or job_id in outcome_moved:
            continue
        # The status follows the outcome, never the reverse: a recorded outcome stands, and a
        # job without one has not run. CHECK_RUN_COUNTERS counts by outcome for the same reason,
        # so its run's done_count finding already accounts for this repair.
        if has_outcome:
            what, fix = "has an outcome", "set its status to 'done'"
        else:
            what, fix = "has no outcome", "set its status to 'queued' for it to run again"
        found(
            "jobs",
            _codec.id_text(job_id),
            f"job {_codec.id_text(job_id)} is {status!r} but {what}; {fix}",
        )
    for finding in run_ids:
        found(*finding)
    for table, row_id, message in run_rewrites:
        if unreadable_runs:
            message += _repair_first(
                unreadable_runs,
                "if one is this run, this row is a second copy, as check() then says",
            )
        found(table, row_id, message)
    for finding in (*attached, *job_ids, *job_rewrites, *deletions):
        found(*finding)


# Jobs of one missing run named one finding each; the rest get one finding together.
_ORPHANS_NAMED: Final = 100


def _unnamed_orphans(run_id: object, job: str, count: int) -> str:
    """The finding for ``count`` jobs, from ``job`` on, whose run_id names the same missing run
    as the _ORPHANS_NAMED jobs named before them: their repair, for all of them at once."""
    who = f"job {job}" if count == 1 else f"job {job} and {count - 1:,} more jobs"
    shown = _codec.id_text(run_id)
    delete = "delete each by its id"
    if isinstance(run_id, str) and run_id.isprintable():  # the text as stored, quoted for SQL
        quoted = run_id.replace("'", "''")
        delete = f"DELETE FROM jobs WHERE run_id = '{quoted}'"
    elif isinstance(run_id, str):
        # By its bytes: a NUL ends the SQL text any client reads (and no shell argument can
        # hold one), and a control character is shown as its escape, which pasted matches
        # nothing.
        delete = f"DELETE FROM jobs WHERE {_matching('run_id', run_id)}"
    return (
        f"{who} with run_id {shown} {'has' if count == 1 else 'have'} the finding of the "
        f"{_ORPHANS_NAMED} jobs named above with that run_id, not repeated for each: repair "
        f"them as those (restore the run), or delete every job of it at once: {delete}"
    )


def _repair_first(unreadable_runs: list[object], why: str) -> str:
    """A finding's caveat, while some run ids are unreadable: the first few, and ``why``."""
    shown = ", ".join(_codec.id_text(run) for run in unreadable_runs[:3])
    more = ", ..." if len(unreadable_runs) > 3 else ""
    return f"; but first repair the run ids found unreadable ({shown}{more}): {why}"


def _home(
    conn: sqlite3.Connection, run_id: object, respelled: dict[str, str], copies: dict[str, str]
) -> object:
    """The id, as stored, of the run row that a job with this run_id counts in once check()'s
    repairs are made: a run copy's is the row that stays; a respelt run_id's, its run."""
    if isinstance(run_id, str) and run_id in copies:
        return copies[run_id]
    if conn.execute(SELECT_MISSING_RUN, (run_id,)).fetchone():
        return run_id
    canonical = _canonical_uuid(run_id)
    if canonical is None:
        return run_id
    if canonical in respelled:
        return respelled[canonical]
    return canonical


def _check_counters(row: Sequence[Any], found: Callable[[str, object, str], None]) -> None:
    """The findings for one run's row of CHECK_RUN_COUNTERS.

    Judged against ``done``, its jobs with an outcome, never against the stored done_count,
    which may itself be the fault: a done_count set too high must not make the run look
    finished. So after every repair these findings give, the next check finds nothing.
    """
    run_id, status, job_count, done_count, done, total, job_rows = row
    run = f"run {_codec.id_text(run_id)}"

    def finding(message: str) -> None:
        found("runs", _codec.id_text(run_id), f"{run} {message}")

    if done_count != done:
        finding(
            f"has done_count {done_count!r} but {done} of its jobs are done (have an outcome); "
            f"set done_count to {done}"
        )
    if job_rows != total:
        finding(f"has job_rows {job_rows!r} but {total} jobs; set job_rows to {total}")
    if not isinstance(job_count, int):
        return  # unreadable: the decoder's finding says so; judged once it is repaired
    if total > job_count:
        # Which jobs go, or whether job_count grows, decides what is done: no status advice
        # can be right for both, so it waits for the next check.
        finding(
            f"has job_count {job_count} but {total} jobs; delete the jobs it should not have, or "
            f"set job_count to {total} if it should have them all; then run check() again, "
            "which judges its done_count and status by the jobs that remain"
        )
        return
    finished = done >= job_count  # all the jobs it can have are done (with job_count 0: none)
    if finished and status != "done":
        if job_count == 0:
            finding(
                f"has job_count 0 and is {status!r}: no outcome can ever finish it (this version "
                "refuses such runs); set its status to 'done', or delete it"
            )
        else:
            finding(f"has all {job_count} jobs done but is {status!r}; set its status to 'done'")
    elif status == "done" and not finished:
        finding(
            f"is 'done' but only {done} of its {job_count} jobs are done; set its status to "
            "'queued' for a scheduler to claim it and finish the rest"
        )


def _missing_run(
    conn: sqlite3.Connection, run_id: object, respelled: dict[str, str]
) -> tuple[str, str | None]:
    """What is wrong with a job whose run_id names no run, with its repair; and the canonical
    id of the run the repair attaches it to (None: it is to be restored or deleted).

    Only run ids spelled otherwise than canonically need more than "restore it or delete the
    job": the run may exist under the canonical text (the job's run_id is the one to rewrite),
    or under yet another spelling (its own finding rewrites it; the job must follow).
    """
    canonical = _canonical_uuid(run_id)
    if canonical is None:  # no UUID: the decoder's finding says so too
        return (
            f"has run_id {_codec.id_text(run_id)}, which is no run's id (no UUID): set it to "
            "the id of the run it belongs to, or delete this job; no run's counters are judged "
            "until then"
        ), None
    rewrite = "" if canonical == run_id else f" and rewrite its run_id as '{canonical}'"
    if (stored := respelled.get(canonical)) is not None:
        return (
            f"refers to run {run_id}, which is stored as {stored}; rewrite that run's id as "
            f"'{canonical}' as its own finding says{rewrite}"
        ), canonical
    if canonical != run_id and conn.execute(SELECT_MISSING_RUN, (canonical,)).fetchone():
        return (
            f"has run_id {run_id}, the id of run {canonical} in non-canonical text; rewrite its "
            f"run_id as '{canonical}'"
        ), canonical
    return (
        f"refers to run {run_id}, which does not exist; restore run {canonical} from a "
        f"backup{rewrite}, or delete this job"
    ), None


def _canonical_uuid(value: object) -> str | None:
    """The canonical text of a stored id that is UUID text; None for anything else."""
    parsed = _codec.spelt_uuid(value) if isinstance(value, str) else None
    return None if parsed is None else str(parsed)


def op_claim_next_run(conn: sqlite3.Connection) -> Run | None:
    runs = _codec.decode_claimed(_claim(conn, CLAIM_NEXT_RUN, ()))
    return runs[0] if runs else None


def release_claimed(runs: Run | list[Run] | None) -> GiveBack | None:
    """The op giving back runs a cancelled caller claimed but never received (None: no run)."""
    if runs is None or runs == []:
        return None
    claimed = runs if isinstance(runs, list) else [runs]
    return GiveBack([_codec.uuid_text(run.id) for run in claimed])


@dataclass(frozen=True, slots=True)
class GiveBack:
    """A write op: runs claimed for a caller cancelled before it received them, queued again
    (see SqliteBackend.write's undo)."""

    ids: list[str]

    def __call__(self, conn: sqlite3.Connection) -> int:
        """How many of the runs were still 'running', and so queued again."""
        return conn.executemany(RELEASE_RUN, [(run_id,) for run_id in self.ids]).rowcount

    def repair(self) -> str:
        """The SQL a person runs to do it by hand."""
        listed = ", ".join(f"'{run_id}'" for run_id in self.ids)
        return f"UPDATE runs SET status = 'queued' WHERE id IN ({listed}) AND status = 'running'"


def op_claim_runs(limit: int, conn: sqlite3.Connection) -> list[Run]:
    rows = _claim(conn, CLAIM_RUNS, (limit,))
    _sort_claimed(rows)
    return _codec.decode_claimed(rows)


def _sort_claimed(rows: list[Any]) -> None:
    """Sort claimed rows by (created_at, rowid), the subquery's order.

    As two stable sorts on one key each, rowid then created_at, which order the rows as the
    one (created_at, rowid) key does: a tuple made and compared per row cost ~3x as much
    (measured: ~10 us for 64 rows, against ~3.5 us). A created_at that is not text can make a
    sort fail; the rows are then sorted from their fetched order by the one key, as before
    (which can fail the same way), and decode_claimed raises the CorruptRowError that names it.
    """
    fetched = rows[:]
    try:
        rows.sort(key=_ROWID)
        rows.sort(key=_CREATED_AT)
    except TypeError:
        rows[:] = fetched
        with contextlib.suppress(TypeError):
            rows.sort(key=_CLAIM_ORDER)


# (created_at, rowid) of a row of _codec.CLAIMED_COLUMNS, and each alone.
_CLAIM_ORDER: Final = operator.itemgetter(6, 0)
_CREATED_AT: Final = operator.itemgetter(6)
_ROWID: Final = operator.itemgetter(0)


def _claim(conn: sqlite3.Connection, sql: str, params: tuple[object, ...]) -> list[Any]:
    """Run a claim and fetch its rows, with sqlite3's fast strict text decoding.

    A claim cannot simply be read again like the other reads when stored text is not UTF-8
    (see _leniently): the first attempt already moved the runs, since SQLite makes all of an
    UPDATE ... RETURNING's changes before the first row comes back. So that failure raises
    _RerunLeniently, and the runner undoes the op (its transaction, or its savepoint in a
    group) and runs it again with the lenient text factory; decoding the row then raises the
    CorruptRowError that names it, rolling the claim back with the call. A savepoint of its
    own would cost every claim two statements (measured: 6% of claim_next_run in memory) for
    a failure only a hand edit causes.
    """
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError as exc:
        if _NOT_UTF8 not in str(exc) or conn.text_factory is not str:
            raise
        raise _RerunLeniently from exc


class _RerunLeniently(Exception):
    """An op met stored text that is not UTF-8 after it had written: undo the op, then run it
    again with the lenient text factory (see _claim and _Worker.run_op)."""


def _why_unrecorded(
    run_id: str, job_id: str, conn: sqlite3.Connection, index: int | None = None
) -> None:
    """Raise the error that explains why MARK_JOB_DONE changed nothing; return on a redelivery.
    ``index``: the outcome's place in a record_job_outcomes batch, which the error names."""
    row = _leniently(conn, lambda: conn.execute(SELECT_JOB_STATE, (job_id,)).fetchone())
    where, nothing, also = "", "nothing was recorded", ""
    if index is not None:
        where = f"outcomes[{index}]: "
        nothing = "nothing of this call was recorded (a batch is all or nothing)"
        also = ", or leave it out of the batch"
    if row is None:
        raise NotFoundError(
            f"{where}job {job_id} does not exist (outcome reported for run {run_id}); "
            f"{nothing}: check the job id the worker reported (if it is right, the job's row "
            f"was edited by hand: check() names it){also}"
        )
    _codec.stored_uuid("jobs", "run_id", job_id, row[0])  # canonical text, or CorruptRowError
    if row[0] != run_id:
        raise WrongRunError(
            f"{where}job {job_id} belongs to run {row[0]}, not to run {run_id}; {nothing}: "
            f"report the outcome with the job's own run id{also}"
        )
    status, has_outcome = _codec.stored_job_status(job_id, row[1]), bool(row[2])
    if status is JobStatus.DONE and has_outcome:
        return  # a redelivery
    raise _codec.status_disagrees(job_id, row[1], has_outcome=has_outcome)


def op_record_outcome(
    run_id: str, job_id: str, outcome_json: str, conn: sqlite3.Connection
) -> bool:
    try:
        marked = conn.execute(MARK_JOB_DONE, (outcome_json, job_id, run_id)).rowcount
    except (sqlite3.DataError, OverflowError) as exc:
        too_big = _outcome_too_big(exc, job_id, outcome_json)
        if too_big is None:
            raise
        raise too_big from exc
    if marked == 1:
        if conn.execute(ADVANCE_RUN, (run_id,)).rowcount != 1:
            _refuse_corrupt_counters(run_id, job_id, conn)
        return True
    _why_unrecorded(run_id, job_id, conn)
    return False  # a redelivery: the first outcome stands


def _refuse_corrupt_counters(run_id: str, job_id: str, conn: sqlite3.Connection) -> None:
    """Raise the CorruptRowError for the run whose counters ADVANCE_RUN refused to touch.

    ``job_id`` is a job this call marked done: when the run row is missing, the row at fault is
    that job's (its run_id names no run), so the error names the job, not the absent run.
    """
    row = _leniently(conn, lambda: conn.execute(SELECT_RUN_COUNTERS, (run_id,)).fetchone())
    if row is None:  # the run deleted, or its id respelt, by hand with foreign keys off
        raise _codec.corrupt_row(
            "jobs",
            "run_id",
            job_id,
            run_id,
            "no run is stored under this id: the run was deleted, or its id edited by hand, "
            "as check() tells",
        )
    for index, column in ((1, "job_count"), (2, "done_count")):
        if not isinstance(row[index], int):
            raise _codec.corrupt_row("runs", column, run_id, row[index], "expected an integer")
    raise ControlError(f"run {run_id} could not be advanced; run store.check() to find out why")


def op_record_outcomes(
    run_id: str, outcomes: Sequence[tuple[str, str]], conn: sqlite3.Connection
) -> list[bool]:
    """MARK_JOB_DONE per (job id, outcome JSON), then one advance by the number newly done.

    Runs inside the call's own transaction or savepoint: raising NotFoundError/WrongRunError
    for any outcome rolls back every outcome of the batch. A job id twice in one batch is
    marked by its first occurrence; the second sees it done and is a redelivery.
    """
    results: list[bool] = []
    record = results.append
    new = 0
    first_new = ""  # a job this batch marked, for the error if the run cannot advance
    mark = conn.cursor().execute  # one cursor for the batch, not one per statement
    for job_id, outcome_json in outcomes:
        try:
            marked = mark(MARK_JOB_DONE, (outcome_json, job_id, run_id)).rowcount
        except (sqlite3.DataError, OverflowError) as exc:
            too_big = _outcome_too_big(exc, job_id, outcome_json, f"outcomes[{len(results)}]: ")
            if too_big is None:
                raise
            raise too_big from exc
        if marked == 1:
            if not new:
                first_new = job_id
            new += 1
            record(True)
        else:
            _why_unrecorded(run_id, job_id, conn, len(results))
            record(False)
    if new and conn.execute(ADVANCE_RUN_BY, (new, new, run_id)).rowcount != 1:
        _refuse_corrupt_counters(run_id, first_new, conn)
    return results


# ---------------------------------------------------------------------------------------------
# The backend: one connection, reads as single hops, writes through the group commit.


class _Process:
    """This process's id, kept current across fork() by a hook, so that each call can tell
    whether it runs in the process that opened its store without a system call."""

    pid: int = os.getpid()
    # The process this one was forked from (directly or through its parents) while that one
    # had a store's connection open or opening; None: none. This copy of SQLite is that
    # process's, as it was at the fork: its record of file locks that this process does not
    # hold (a store connected here to the same file would hold none, and its writes were lost
    # when the other process's store closed), and mutexes another thread held then, which no
    # thread here will release (a connect here, to any file or to memory, hung; measured).
    forked_from: int | None = None

    @classmethod
    def forked(cls) -> None:
        if cls.forked_from is None and (_OPEN or _CONNECTING):
            cls.forked_from = cls.pid
        cls.pid = os.getpid()


os.register_at_fork(after_in_child=_Process.forked)


class SqliteBackend:
    """One aiosqlite connection used as a one-writer pool."""

    def __init__(self, conn: aiosqlite.Connection, *, database: str, options: Options) -> None:
        check_worker(conn)
        self._conn = conn
        # Ours to use on the worker thread only (inside functions given to on_thread).
        raw = conn._connection
        if raw is None:
            raise StoreClosedError(f"the connection to {database} closed while opening")
        self._worker = _Worker(raw, database=database, busy_timeout=options.busy_timeout)
        self._database = database
        self._pending: list[tuple[_Ticket, asyncio.Future[tuple[bool, Any]]]] = []
        self._writing = False
        self._flusher: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()  # set while no write is in flight or queued
        self._idle.set()
        # Small calls on an in-memory database run inline on the event loop's thread: there is
        # no file to wait on (no fsync, no other process's lock), so the thread hop would be
        # most of their cost. Set by open(); file databases always hop.
        self._inline = False
        self._closing = False
        self._closer: asyncio.Task[None] | None = None
        # Claims accepted whose callers have yet to take their runs or give them back (_owe).
        self._owed = 0
        self._settled = asyncio.Event()
        self._settled.set()
        # write() refuses at once on a read-only store, and SQLite itself would too.
        self.read_only: bool = options.read_only
        # Set by note_unmigrated (migrate=False on a schema this library cannot use as it is:
        # behind, or with an edited, unknown or failed migration), cleared by migrate() or by
        # refuse_unmigrated finding the file fit since.
        self.unmigrated: MigrationError | None = None
        # A store belongs to the process and the event loop that opened it: see refuse_foreign.
        self._pid = _Process.pid
        self._loop = asyncio.get_running_loop()

    @property
    def database(self) -> str:
        """The database as messages name it: ``database '/path/x.db'`` or the in-memory one."""
        return self._database

    @classmethod
    async def open(cls, url: str | os.PathLike[str], options: Options) -> SqliteBackend:
        require_sqlite()
        path = parse_url(url, creates=not options.read_only)
        if _Process.forked_from is not None:  # see _Process.forked_from
            shown = "the in-memory database" if path == MEMORY else database_name(url, path)
            raise ConfigurationError(
                f"cannot open {shown} in process {_Process.pid}: it was forked (directly or "
                f"through its parents) from process {_Process.forked_from} while that process "
                "had a store open, and SQLite does not survive fork(): its locks are not "
                "inherited (a store here on the same file would hold none, and lose its "
                "writes), and a mutex another thread held at the fork stays held (a connect "
                "here may hang); nothing was opened: start this process with multiprocessing's "
                "'spawn' or 'forkserver' method, or close every store before forking"
            )
        database = (
            "the in-memory database" if path == MEMORY else f"database {database_name(url, path)}"
        )
        if options.read_only:
            return await cls._open_read_only(path, database, options)
        # check_same_thread=False: an in-memory store runs small calls on the loop's thread
        # too, serialised with the worker thread by _Worker.lock.
        backend = await cls._connect(
            path, database, options, file=path, check_same_thread=path != MEMORY
        )
        try:
            await backend.read(partial(configure, path=path, options=options, database=database))
            if path != MEMORY:
                try:
                    worker = backend._worker
                    worker.path, worker.identity, worker.wal_base = _locate(path)
                    worker.refuse_replaced_wal_files()  # sees them first
                except OSError as exc:  # the file went away (or out of reach) meanwhile
                    raise _unreachable(database_name(url, path), exc) from exc
            else:
                backend._inline = True
            if options.migrate:
                await backend.read(backend.migrate_op())
            else:
                await backend.note_unmigrated()
        except BaseException as exc:
            await backend.give_up(exc)
            raise
        return backend

    @classmethod
    async def _connect(
        cls,
        target: str,
        database: str,
        options: Options,
        *,
        file: str | None = None,
        **kwargs: Any,
    ) -> SqliteBackend:
        """A backend on a new aiosqlite connection in autocommit mode, its worker a daemon
        (see daemon_worker); the connection is closed again if the backend cannot be built.

        The file is opened on the worker as aiosqlite.connect would, but through our own
        hand-over (see open_on_worker), so that a connect that fails or is cancelled leaves
        nothing behind and never waits for the thread: the worker closes whatever it opened,
        on its own thread, and ends. (aiosqlite's own connect, cancelled, would drop a
        connection that had just opened for the garbage collector to find, and its stop
        would hand a result to a loop that may have closed by then, failing on the thread.)
        """
        opening = open_on_worker(
            partial(sqlite3.connect, target, isolation_level=None, **kwargs),
            database,
            path=None if file is None or file == MEMORY else file,
        )
        try:
            await opening.opened
        except BaseException as exc:
            abandon_open(opening)
            if opening.opened.done() and not opening.opened.cancelled():
                # The open failed: its worker is past it and ends at once. (Cancelled, the
                # worker ends by itself once the open in its hands is done: a hung disk must
                # not hold up the loop.)
                opening.conn._thread.join(_STOP_WAIT)
            if isinstance(exc, sqlite3.Error):
                error = translate(exc, database=database, busy_timeout=options.busy_timeout)
                raise error from exc
            raise
        conn = take_opened(opening)
        try:
            return cls(conn, database=database, options=options)
        except BaseException:
            stop_worker(conn)
            raise

    @classmethod
    async def _open_read_only(cls, path: str, database: str, options: Options) -> SqliteBackend:
        """Open an existing file with SQLite's ``mode=ro``: no journal switch, no migration.

        The schema must be exactly at this library's newest migration (see check_schema):
        a read-only store cannot bring it up to date, and must not misread another version.
        """
        if path == MEMORY:
            raise ConfigurationError(
                "read_only=True with an in-memory database: a new in-memory database is empty "
                "and a read-only store could never fill it; name an existing database file"
            )
        _require_file(path, database)
        backend = await cls._connect(read_only_uri(path), database, options, file=path, uri=True)
        try:
            await backend.read(
                partial(configure_read_only, path=path, database=database, options=options)
            )
        except BaseException as exc:
            await backend.give_up(exc)
            raise
        return backend

    async def give_up(self, exc: BaseException) -> None:
        """Close a backend whose connect failed with ``exc``, before any caller had it. A
        failure closes it in full. A cancellation (or Ctrl-C, or a coroutine closed
        unfinished) must not wait: the statement still running on the worker may sit in
        SQLite's busy handler for busy_timeout, waiting for another process's lock, or run a
        long migration to its end; so the worker is told to close the connection after it,
        and the connect raises at once. (Nothing can be awaited in a coroutine being closed.)
        """
        if isinstance(exc, Exception):
            await self.close()
        else:
            self._closing = True
            self._queue_before_close()  # a void the migration owes (see migrate), after it
            stop_worker(self._conn)

    def __del__(
        self,
        _warn: Callable[..., None] = warnings.warn,
        _process: type[_Process] = _Process,
        _stop: Callable[[aiosqlite.Connection], None] = stop_worker,
    ) -> None:
        # Collected without close(): stop the worker thread and say so, as asyncio does for an
        # unclosed event loop. _warn, _process and _stop are bound at definition: at
        # interpreter exit this module's globals (and the warnings module) may be gone (None)
        # before this runs. In a forked child there is no thread to stop, and the parent's
        # store is not this process's to warn about.
        if getattr(self, "_pid", None) != _process.pid:
            return
        if not getattr(self, "_closing", True):  # True too if __init__ failed before it
            self._closing = True
            # What a close makes before the connection ends (an owed void, the -wal of a moved
            # file emptied into the file this store opened): a store dropped unclosed ends its
            # connection all the same, with SQLite's own checkpoint, which would apply or keep
            # what those exist to keep off the file.
            self._queue_before_close()
            _stop(self._conn)
            _warn(
                f"the store for {self._database} was never closed; close it with "
                "'async with Store.connect(...) as store' or 'await store.close()'",
                ResourceWarning,
                source=self,
            )

    def refuse_foreign_close(self) -> None:
        """Refuse a close() that close() would refuse (refuse_foreign), before the caller
        changes anything: from another loop, while the opener's loop runs. A forked child's
        copy, a closed store and one whose loop has closed are closed from anywhere."""
        if self._pid != _Process.pid or self._loop.is_closed():
            return
        if self._closer is not None and self._closer.done():
            return
        self.refuse_foreign()

    async def close(self) -> None:
        # Every write already accepted finishes (and commits) before the connection closes:
        # a caller handed to the group commit gets its result, not a closed connection.
        if self._pid != _Process.pid:
            # A forked child's copy: the connection and its thread are the parent's, which
            # keeps using them. Closing here only forgets it (the thread is not in this process
            # to take a close, which would wait forever).
            self._closing = True
            return
        if self._closer is not None and self._closer.done():
            return  # closed: nothing to wait for, whichever loop asks
        if self._loop.is_closed():
            await self._close_after_its_loop()
            return
        self.refuse_foreign()
        if self._closer is None:
            self._closing = True  # read() and write() refuse from now on
            self._closer = self._loop.create_task(self._close())
            self._closer.add_done_callback(self._closer_stopped)
        # Shielded: a close whose caller is cancelled (a wait_for that timed out) still finishes,
        # and a second close, from another task, returns only once the first has finished.
        await asyncio.shield(self._closer)

    async def _close_after_its_loop(self) -> None:
        """close() once the loop that opened the store has closed (an asyncio.run that ended, a
        sync wrapper's loop): no call can be waiting on that loop, nor run there again, and
        neither can a close. The calling loop closes the connection instead: the worker
        finishes what it was given, then closes the file on its own thread."""
        self._closing = True  # read() and write() refuse from now on
        if self._conn._running:
            self._queue_before_close()
            stop_worker(self._conn)
        # Every caller waits for the worker to end, which it does once it has closed the file
        # (after what it was running): a second close() returns only then, as a second close
        # does on the store's own loop.
        thread = self._conn._thread
        if thread.is_alive():
            await asyncio.to_thread(thread.join)

    async def _close(self) -> None:
        """Wait for the writes accepted before close() and for claims still owed, then close the
        connection. A shutdown that cancels every task cancels this one too; the claims it waits
        for then need the connection all the more (each cancelled claim gives its runs back
        through it), so it waits on through cancellation, then ends the connection without
        another await (the loop may close at any moment after a shutdown's tasks are done)."""
        cancelled = False
        try:
            while True:
                try:
                    # Writes in flight, then claims whose callers have yet to take their runs
                    # or give them back (each give-back is a write: wait for idle again).
                    await self._idle.wait()
                    while not self._settled.is_set():
                        await self._settled.wait()
                        await self._idle.wait()
                    break
                except asyncio.CancelledError:
                    cancelled = True
            if not cancelled:
                self._queue_before_close()
                await close_on_worker(self._conn)
                if self._worker.owed_void:
                    raise self._closed_owing()
        finally:
            if self._conn._running:  # cancelled (a shutdown), or closed unfinished
                self._queue_before_close()
                stop_worker(self._conn)

    def _closed_owing(self) -> StorageError:
        """The error of a close that could not make an owed void (see _Worker.owed_void)."""
        return StorageError(
            f"{self._database} is closed, but the write that keeps the pages of a call that "
            "failed earlier (with an I/O error, or a full disk, as its COMMIT was made) out of "
            "the file could not be made (another process holds the write lock, or the disk "
            "refused it too): the next connection to write voids them, but the next open, "
            f"where no other process has the file open, may apply that call after all; {_LOOK}, "
            "and check the disk"
        )

    def _queue_before_close(self) -> None:
        """Queue _Worker.before_close (an owed void, empty_wal_if_moved) ahead of the
        connection's close, on the same thread: no await comes between the two, so a
        shutdown's cancellation cannot either."""
        if self._conn._running and not self.read_only:
            self._conn._tx.put_nowait((None, self._worker.before_close))

    def _closer_stopped(self, closer: asyncio.Task[None]) -> None:
        """A closer cancelled before its first step (a shutdown cancelling every task just after
        close() began) closed nothing. No task is started in its place (the loop may close
        before it runs): the connection ends as soon as nothing is in flight or owed.

        A closer's error (_closed_owing) is every close() caller's, but if each was cancelled
        no one awaits it: taken here, asyncio does not log it as never retrieved."""
        if not closer.cancelled():
            closer.exception()
        self._stop_if_drained()

    def _stop_if_drained(self) -> None:
        """After a closer that ended cancelled, end the connection once no write is in flight
        or queued and no claim is owed. (_close waits through cancellation, so a closer ends
        cancelled only before its first step, or in its final close, whose finally has ended
        the connection already.) Called when the closer stops, and whenever the store becomes
        idle or settled."""
        closer = self._closer
        if (
            closer is not None
            and closer.cancelled()
            and self._idle.is_set()
            and self._settled.is_set()
            and self._conn._running
        ):
            self._queue_before_close()
            stop_worker(self._conn)

    def _now_idle(self) -> None:
        """No write is in flight or queued any more. (Not on a closed loop, where nothing can
        wait for it: a task the loop abandoned, closed by the garbage collector, ends here.)"""
        if self._loop.is_closed():
            return
        self._idle.set()
        self._stop_if_drained()

    async def note_unmigrated(self) -> None:
        """With migrate=False: note a schema this library cannot use as it is, so that calls
        are refused with its fix until the file is fit, instead of failing in SQL or, on a
        newer release's schema or a half-done migration, writing what this release cannot
        vouch for: a schema behind this library's (PendingMigrationError: migrate() applies
        the rest), or one holding an edited, unknown or failed migration (the error that
        migrate() and a migrating connect would give, with its fix)."""
        try:
            await self.read(partial(check_schema, database=self._database, read_only=False))
        except MigrationError as exc:
            self.unmigrated = exc

    async def refuse_unmigrated(self) -> None:
        """For a call on a store whose schema was unfit (``unmigrated``): read the schema's
        state again, and raise the MigrationError that describes the file as it is now; or,
        if another process has migrated (or repaired) it since, return (the call proceeds)
        and stop refusing. Only this refusing path pays the read: a store whose schema was
        current never comes here.

        Not the error noted at connect: the file may have moved on since (another process
        migrating it, wholly or in part), and that error would describe it as it no longer is.
        """
        try:
            await self.read(partial(check_schema, database=self._database, read_only=False))
        except MigrationError as exc:
            self.unmigrated = exc
            raise
        self.unmigrated = None

    def interrupt(self) -> None:
        """Make the statement running on the connection fail now with SQLITE_INTERRUPT (its
        transaction rolls back), for a Ctrl-C handler: sqlite3's interrupt() may be called
        from any thread. Not a lock wait: SQLite's busy handler sleeps through it."""
        with contextlib.suppress(sqlite3.ProgrammingError):  # closed: nothing runs
            self._worker.raw.interrupt()

    # Ops are plain functions of the connection, never bound methods of the backend: see _Worker.
    def migrate_op(self) -> Op[list[int]]:
        return partial(migrate, database=self._database)

    def migration_status_op(self) -> Op[list[MigrationState]]:
        return partial(migration_status, database=self._database)

    def migration_history_op(self) -> Op[list[MigrationRecord]]:
        return partial(migration_history, database=self._database)

    def read(self, op: Op[T], *, small: bool = False) -> Awaitable[T]:
        """Run ``op`` outside any explicit transaction; await the result.

        ``small``: the op reads a bounded number of rows, so on an in-memory database it may
        run inline (see _inline_ok). Otherwise one hop, and no coroutine of ours on the hot
        path: errors are translated on the worker thread (_Worker.run_read), so the future already
        carries the ControlError. A caller cancelled while its op still waits for the thread
        withdraws it, and it never runs (see _hop_read); one that has started runs to its end,
        which for migrate's op, writing in transactions of its own, means all of it.
        """
        self.admit()
        if small and self._inline:
            return self._read_inline(op)
        return self._hop_read(op)

    def admit(self) -> None:
        """Refuse a call from another process or event loop (refuse_foreign), or made once
        close() began; what every call checks first, also one the Store answers without a hop
        (an empty batch)."""
        self.refuse_foreign()
        self._refuse_closing()

    def refuse_foreign(self) -> None:
        """Refuse a call from another process or event loop than the ones that opened the store.

        In a process forked from the opener (StoreClosedError), the SQLite connection is the
        parent's and its worker thread does not exist: a hop would wait forever, and using an
        SQLite connection across fork() can corrupt the database. The hook behind _Process
        keeps that check to an attribute comparison.

        From another event loop (WrongEventLoopError), the group commit's state and tasks are
        the opening loop's, and are not thread-safe: measured with four threads each running
        its own loop on one store, three of them waited forever.
        """
        if self._pid != _Process.pid:
            raise StoreClosedError(
                f"this store on {self._database} was opened by process {self._pid}, and "
                f"process {_Process.pid} is a fork of it: the store's connection thread does "
                "not exist here, and an SQLite connection must not be used across fork(); "
                "nothing was done: use stores in a process started by multiprocessing's "
                "'spawn' or 'forkserver' method, or forked while no store was open (SQLite "
                "does not survive fork(): a store connected here would be refused too)"
            )
        if asyncio.get_running_loop() is not self._loop:
            if self._loop.is_closed():
                raise WrongEventLoopError(
                    f"this store on {self._database} was opened on an event loop that has "
                    "closed since (an asyncio.run that ended, say), and a store serves only "
                    "the loop that opened it; nothing was done: connect a Store in this loop, "
                    "and close this one with 'await store.close()' (from any loop, once its "
                    "own has closed)"
                )
            if threading.current_thread() is self._conn._thread:
                # The advice below would wait forever here: the store's thread is busy running
                # the caller's generator, and serves nothing else until it ends.
                raise WrongEventLoopError(
                    f"this call to the store on {self._database} came from the store's own "
                    "thread, where insert_jobs consumes the caller's generator: the store serves "
                    "no call until that generator ends; nothing was done: read what the "
                    "generator needs before calling insert_jobs"
                )
            raise WrongEventLoopError(
                f"this store on {self._database} was opened on another event loop than the "
                "one calling it (a store serves the loop that opened it); nothing was done: "
                "connect a Store in each event loop (each thread or asyncio.run that uses "
                "one), or run the call on the store's own loop with "
                "asyncio.run_coroutine_threadsafe"
            )

    def _hop_read(self, op: Op[T]) -> asyncio.Future[T]:
        # A ticket, as a write's: a caller cancelled while its read still waits for the thread
        # (behind a write, a check(), a page of another walk) withdraws it, through its
        # future's cancellation, and it never runs; without one, every read that timed out
        # while queued still ran, one after another, and held up every later call.
        ticket: _Ticket = [op]
        try:
            future = on_thread(self._conn, partial(self._worker.run_read_ticket, ticket))
        except Exception as exc:  # the connection is closed
            self._worker.raise_(exc)
        future.add_done_callback(partial(_withdraw_if_cancelled, ticket))
        return future

    async def _read_inline(self, op: Op[T]) -> T:
        if not self._inline_ok():
            return await self._hop_read(op)
        try:
            result = self._worker.run_read_locked(op)
        finally:
            self._worker.lock.release()
        await _suspend()
        return result

    def _inline_ok(self) -> bool:
        """Whether a small call may run here, on the loop's thread; if so, the lock is held.

        Only for an in-memory database, and only between two whole functions of the worker
        thread: the lock is free only when the worker is not inside one, and it is taken
        without waiting, so the event loop never blocks on the worker. A call that finds it
        taken hops, and queues behind whatever holds it. Once close() began, read() and
        write() refuse calls; the only op still run, a cancelled claim's give-back, hops, to
        queue in order with the close.
        """
        return self._inline and not self._closing and self._worker.lock.acquire(blocking=False)

    async def write(
        self,
        op: Op[T],
        *,
        small: bool = False,
        undo: Callable[[T], GiveBack | None] | None = None,
    ) -> T:
        """Run ``op`` in a write transaction, grouped with any writes waiting meanwhile.

        ``small``: as for read(); inline, the call is its own transaction (in memory a commit
        costs no fsync, so grouping would buy nothing).

        Cancellation: a caller cancelled before its op started (queued behind another call of
        this store, or behind the group in flight) is withdrawn, and its op never runs. Once it
        started, the op commits or fails as it would have. ``undo`` is for an op whose effect
        only its caller can use (a claim): cancelled after the op started, the caller then
        waits for it, and if it committed, runs ``undo(result)`` (if not None) to take the
        effect back, so no run is left claimed by a task that never received it.
        """
        self.admit()
        if self.read_only:  # Store names the method first; this guards any other caller
            raise ReadOnlyStoreError(
                f"{self._database} was opened with read_only=True and refuses writes; "
                "nothing was written: connect again without read_only to write"
            )
        if undo is None:
            ok, value, cancelled = await self._transact(op, small, wait=False)
        else:
            # A claim is owed from now until its caller has its runs or has given them back,
            # and close() waits for that: the caller may be cancelled in the loop pass after
            # its group committed, before it resumes, and then still needs the connection.
            self._owe()
            try:
                ok, value, cancelled = await self._transact(op, small, wait=True)
                if cancelled is not None and ok:
                    await self._give_back_or_warn(undo(value))
            finally:
                self._settle()
        if cancelled is not None:
            raise cancelled
        if ok:
            return cast(T, value)
        if isinstance(value, RaisedByCaller):
            raise value.raised
        if isinstance(op, RunsOnce):  # every path that fails it ends here: say what it consumed
            raise op.told(value)
        raise value

    async def release(self, back: GiveBack) -> int:
        """Run Store.release_runs's give-back: as write() would, but never withdrawn. A caller
        cancelled at any point waits for it to end (as a cancelled claim waits for its own
        give-back), so a cancelled release_runs has given its runs back, or warned that it could
        not: its caller cannot ask the store, where 'running' is both a run not given back and
        one given back and claimed by another scheduler since, and releasing it again would
        hand that run to two schedulers."""
        self.admit()
        future = self._queue_give_back(back)
        try:
            ok, value = await asyncio.shield(future)
        except asyncio.CancelledError:
            await self._give_back_or_warn(back, future, what="release_runs was cancelled")
            raise
        if not ok:
            raise value
        return cast(int, value)

    async def _give_back_or_warn(
        self,
        back: GiveBack | None,
        queued: asyncio.Future[tuple[bool, Any]] | None = None,
        *,
        what: str = "a claim was cancelled after it committed",
    ) -> None:
        """Run a cancelled claim's give-back (or wait out ``queued``, one already queued). If
        that fails (another process holding the write lock past busy_timeout, a full disk), its
        runs stay running with no one to work on them, which only a person can repair: warn,
        naming them and the repair. The caller's cancellation goes on either way."""
        if back is None:
            return
        try:
            if queued is None:
                queued = self._queue_give_back(back)
            ok, value = await _wait_out(queued)
            if not ok:
                raise value
        except ControlError as exc:
            # What failed, not the error's own advice ("retry the call", "a larger
            # busy_timeout"): the call was cancelled, nothing retries it, and only the UPDATE
            # below puts the runs back.
            message = (
                f"{what}, and giving its runs back failed "
                f"({_what_failed(exc, busy_timeout=self._worker.busy_timeout)}); runs "
                f"{', '.join(back.ids)} stay 'running' with no scheduler working on them: once "
                f"{self._database} takes writes again, from a client that waits for the write "
                "lock (the sqlite3 shell started with -cmd '.timeout 5000': without it, it "
                "fails at once while another process writes), queue them again with: "
                f"{back.repair()}"
            )
            try:
                # Not warnings.warn: under Python's default action for a RuntimeWarning, it
                # keeps each warning's text in this module's __warningregistry__ for good, and
                # each text here is new (it names the runs), so a scheduler whose give-backs
                # kept failing grew by ~800 bytes a failure (measured). No registry: each one
                # is shown, as it was, and none is kept.
                warnings.warn_explicit(
                    message,
                    RuntimeWarning,
                    __file__,
                    sys._getframe().f_lineno,
                    module=__name__,
                    registry=None,
                    module_globals=globals(),
                )
            except Warning as raised:
                # Warnings as errors (pytest's filterwarnings = error, python -W error): the
                # warning raised here would take the place of the caller's cancellation, and
                # a TaskGroup or timeout would see an exception instead. The cancellation goes
                # on; the warning goes to the loop's exception handler (asyncio's logs it).
                self._loop.call_exception_handler(
                    {"message": message, "exception": raised, "runs": list(back.ids)}
                )

    def _refuse_closing(self) -> None:
        """Refuse a call that reached the backend after close() began (the Store refuses the
        ones made after it); only what was accepted before finishes."""
        if self._closing:
            raise StoreClosedError(f"the store for {self._database} is closed; connect again")

    def _queue_give_back(self, op: Op[Any]) -> asyncio.Future[tuple[bool, Any]]:
        """Queue a claim's undo for the store's flusher, at once, and return its outcome's
        future, even while the store closes (close waits for it, as for any write in flight).

        Queued here, by the cancelled caller itself, not by a task of its own: a shutdown that
        cancels every task (asyncio.run ending, a SIGTERM handler cancelling all_tasks())
        cancelled such a task too, which withdrew the give-back before it ran, or never ran
        at all if cancelled before its first step, and the run stayed 'running' with nobody
        on it and no word. Nothing withdraws this ticket; the flusher, if cancelled, waits its
        group out, and one cancelled before its first step is replaced (_flusher_stopped)."""
        future: asyncio.Future[tuple[bool, Any]] = self._loop.create_future()
        self._pending.append(([op], future))
        if not self._writing:
            self._start_flusher()
        return future

    async def _transact(
        self, op: Op[Any], small: bool, *, wait: bool
    ) -> tuple[bool, Any, asyncio.CancelledError | None]:
        """(ok, result or error, None), or, for a caller cancelled after its op started and
        ``wait``, (ok, result or error, the cancellation) once the op has ended."""
        if small and self._inline_ok():
            try:
                ok, value = self._worker.transact_one_locked(op)
            finally:
                self._worker.lock.release()
            try:
                await _suspend()
            except asyncio.CancelledError as exc:  # the op has committed (or failed) already
                if not wait:
                    raise
                return ok, value, exc
            return ok, value, None
        ticket = [op]  # what the worker pops to start the op, or the caller to withdraw it
        if self._writing:
            future: asyncio.Future[tuple[bool, Any]] = self._loop.create_future()
            self._pending.append((ticket, future))
            return await self._outcome(future, ticket, wait=wait)
        # Nobody is writing: go straight to the thread, and let writers that arrive meanwhile
        # queue up for one group transaction after this one.
        self._writing = True
        self._idle.clear()
        try:
            try:
                started = on_thread(self._conn, partial(self._worker.transact_one, ticket))
            except Exception as exc:
                self._worker.raise_(exc)
            return await self._outcome(started, ticket, wait=wait)
        finally:
            self._writing = False
            if self._pending and not self._loop.is_closed():
                self._start_flusher()
            else:
                self._now_idle()

    async def _outcome(
        self, future: asyncio.Future[tuple[bool, Any]], ticket: _Ticket, *, wait: bool
    ) -> tuple[bool, Any, asyncio.CancelledError | None]:
        """The write's (ok, value, None); if its caller is cancelled, the op is withdrawn, or
        with ``wait`` its end is awaited and returned with the cancellation. With ``wait`` the
        future is shielded, since cancelling it would drop the op's result; otherwise not (a
        shield costs a loop pass per call, measured: 15% of 64 concurrent records' rate).
        """
        try:
            ok, value = await (asyncio.shield(future) if wait else future)
        except asyncio.CancelledError as exc:
            if _withdraw(ticket) or not wait:
                raise
            ok, value = await _wait_out(future)
            return ok, value, exc
        return ok, value, None

    def _owe(self) -> None:
        """A claim was accepted: count it until its caller has received its runs or given them
        back, for close() to wait for (else it could close the connection between a claim and
        its give-back)."""
        self._owed += 1
        self._settled.clear()

    def _settle(self) -> None:
        """A claim's caller has its runs, or has given them back (or tried to)."""
        self._owed -= 1
        if not self._owed and not self._loop.is_closed():  # see _now_idle
            self._settled.set()
            self._stop_if_drained()

    def _start_flusher(self) -> None:
        # Not idle from here until the flusher has emptied the queue: close() waits on _idle,
        # and a give-back that started a flusher on an idle store left it set, so a close()
        # then closed the connection under the writes queued behind the give-back.
        self._writing = True
        self._idle.clear()
        flusher = asyncio.get_running_loop().create_task(self._flush())
        self._flusher = flusher
        flusher.add_done_callback(self._flusher_stopped)

    def _flusher_stopped(self, flusher: asyncio.Task[None]) -> None:
        """A flusher clears itself when it has emptied the queue. One cancelled before its first
        step (a shutdown cancelling every task, the store's own too) ran nothing, and the
        callers queued for it still wait: another takes over."""
        if self._flusher is not flusher:
            return
        self._flusher = None
        if self._pending and not self._loop.is_closed():
            self._start_flusher()
        else:
            self._writing = False
            self._now_idle()

    async def _flush(self) -> None:
        try:
            while self._pending:
                # A caller cancelled before its turn has withdrawn its ticket: left out.
                batch = [(ticket, fut) for ticket, fut in self._pending if ticket]
                self._pending = []
                if not batch:
                    continue
                results = await self._run_group([ticket for ticket, _ in batch])
                for (_, fut), result in zip(batch, results, strict=True):
                    if not fut.done():  # a cancelled caller's future (unshielded) stays so
                        fut.set_result(result)
        finally:
            self._writing = False
            self._flusher = None
            self._now_idle()
            # Left only if this coroutine was closed mid-queue (its event loop gone): callers
            # still waiting must not hang. (On a closed loop none can wait: see _now_idle.)
            for _, fut in self._pending:
                if not fut.done() and not self._loop.is_closed():
                    closed = StoreClosedError(f"the store for {self._database} closed")
                    fut.set_result((False, closed))
            self._pending = []

    async def _run_group(self, tickets: list[_Ticket]) -> list[tuple[bool, Any]]:
        """One group transaction on the thread: (ok, result or error) per ticket."""
        results: list[tuple[bool, Any]] = []  # filled on the thread

        def transact() -> None:
            results.extend(self._worker.transact(tickets))

        try:
            await on_thread(self._conn, transact)
        except asyncio.CancelledError:
            # The flusher, the store's own task, was cancelled (a shutdown cancelling every
            # task, say); the group is on the thread regardless and may commit, and each caller
            # must learn its outcome (a claim's, to give its runs back). The thread runs
            # functions in order: once a no-op queued after the group has run, so has the group.
            with contextlib.suppress(Exception):
                await _wait_out(on_thread(self._conn, _nothing))
        except Exception as exc:
            return _each_own(self._worker.translate(exc), len(tickets))
        if len(results) == len(tickets):
            return results
        lost = StoreClosedError(
            f"the store for {self._database} stopped while this call was in flight; the write "
            "may have committed: check before retrying"
        )
        return _each_own(lost, len(tickets))


def _nothing() -> None:
    return None


def _each_own(error: BaseException, callers: int) -> list[tuple[bool, Any]]:
    """(False, error) for each of ``callers`` callers of one failed group, each with an
    instance of its own (see _copy_of): one instance raised in several tasks gathers every
    task's frames into one traceback, and a note one caller adds would be every caller's."""
    return [(False, _copy_of(error) if i else error) for i in range(callers)]


def _what_failed(error: ControlError, *, busy_timeout: float) -> str:
    """What went wrong in ``error``, without the advice its message gives a caller: for a
    warning whose reader has no call to retry (a cancelled claim's failed give-back)."""
    cause = error.__cause__
    detail = ""
    if isinstance(cause, sqlite3.Error):
        name = getattr(cause, "sqlite_errorname", None) or type(cause).__name__
        detail = f" [{cause} ({name})]"
    if isinstance(error, DatabaseBusyError):
        what = f"the write lock could not be taken within busy_timeout={busy_timeout:g}s"
    elif isinstance(error, StorageError) and cause is None:  # see refuse_replaced_file
        what = (
            "the database file, or its -wal or -shm file, was deleted, moved or replaced while "
            "the store had it open"
        )
    elif isinstance(error, StorageError):
        what = "the file system refused the write"
    elif isinstance(error, StoreClosedError):
        what = "the store's connection closed"
    else:
        what = "the write failed"
    return f"{type(error).__name__}: {what}{detail}"


# A write's (or a hopping read's) op, in a one-element list: the worker pops it to start the
# op, a cancelled caller pops it to withdraw the op. list.pop is one step under the GIL, so
# exactly one of the two gets it, and the caller knows whether its op ran.
_Ticket = list[Op[Any]]
_WITHDRAWN: Final = (False, None)  # the result of a withdrawn op, which no one awaits

# What to do about a call the next open may apply after all (_OWED_NOTE, _closed_owing).
_LOOK: Final = (
    "look (get_run, get_job) before taking it as not made (a record made again is safe, and "
    "returns False if it was)"
)
# What the error of a call whose COMMIT failed adds while the void of its pages is owed.
_OWED_NOTE: Final = (
    "; the write that keeps this call's pages out of the file could not be made yet (another "
    "process holds the write lock, or the disk refused it too): the store makes it in its next "
    "write and at close(), but should the process end first, the next open may apply this call "
    f"after all: {_LOOK}"
)


def _owing(error: _E) -> _E:
    """``error`` with _OWED_NOTE added to its message (once), if it is a ControlError."""
    if isinstance(error, ControlError) and error.args and _OWED_NOTE not in str(error.args[0]):
        error.args = (f"{error.args[0]}{_OWED_NOTE}", *error.args[1:])
    return error


def _take(ticket: _Ticket) -> Op[Any] | None:
    """The ticket's op, taken from it: by the worker to start it, or by a cancelled caller to
    withdraw it (see _withdraw); None if the other side took it first."""
    try:
        return ticket.pop()
    except IndexError:
        return None


def _withdraw(ticket: _Ticket) -> bool:
    """Take the op back before the worker starts it; False if it has started."""
    return _take(ticket) is not None


def _withdraw_if_cancelled(ticket: _Ticket, future: asyncio.Future[Any]) -> None:
    """A read's future's done callback: its caller was cancelled, so withdraw the read if the
    worker has not started it (see SqliteBackend._hop_read)."""
    if future.cancelled():
        _take(ticket)


async def _wait_out(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end through any number of cancellations of the caller, which
    is already being cancelled and re-raises that afterwards (see SqliteBackend.write)."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    return task.result()


class _Worker:
    """What runs on the connection's worker thread: the sqlite3 connection, the lock that keeps
    it to one user at a time, and the transaction wrappers around each op.

    Separate from SqliteBackend, and holding no reference to it, because aiosqlite's worker
    keeps the last function it ran until the next arrives: were that a method of the backend,
    a store dropped without close() could never be collected, and so never warn or stop its
    thread (see SqliteBackend.__del__).
    """

    __slots__ = (
        "busy_timeout",
        "database",
        "identity",
        "left_open",
        "lock",
        "owed_void",
        "path",
        "raw",
        "wal_base",
        "wal_files",
    )

    def __init__(self, raw: sqlite3.Connection, *, database: str, busy_timeout: float) -> None:
        self.raw = raw
        self.database = database
        self.busy_timeout = busy_timeout
        # The file's identity at open: see refuse_replaced_file.
        self.path: str | None = None
        self.identity: tuple[int, int] | None = None
        # Those of its -wal and -shm files (None: not seen yet), in _WAL_FILES' order.
        self.wal_files: list[tuple[int, int] | None] = [None] * len(_WAL_FILES)
        # The path SQLite names them after: the database's with symlinks resolved.
        self.wal_base: str | None = None
        # Held by whoever is using the sqlite3 connection: the worker thread for each function
        # it runs, or the event loop's thread for a call run inline (see
        # SqliteBackend._inline_ok).
        self.lock = threading.Lock()
        # A ROLLBACK failed (an I/O error), leaving its transaction open: see roll_back.
        self.left_open = False
        # A failed COMMIT's frames are still to be voided (see void_commit): in the next write
        # transaction, under the lock it holds (a void of its own first would wait busy_timeout
        # for it, and the transaction as long again), by _rewrite_page_one, since the op may
        # write no page (a claim that finds no run), and so void nothing; or at close.
        self.owed_void = False

    def translate(self, exc: BaseException) -> BaseException:
        return translate(exc, database=self.database, busy_timeout=self.busy_timeout)

    def raise_(self, exc: BaseException) -> NoReturn:
        error = self.translate(exc)
        if error is exc:
            raise exc
        raise error from exc

    def run_read(self, op: Op[T]) -> T:
        with self.lock:
            return self.run_read_locked(op)

    def run_read_ticket(self, ticket: _Ticket) -> Any:
        """run_read of the ticket's op, unless its caller withdrew it (nobody awaits it then)."""
        op = _take(ticket)
        return None if op is None else self.run_read(op)

    def run_read_locked(self, op: Op[T]) -> T:
        try:
            if self.left_open:
                self.end_left_open()
            return op(self.raw)
        except Exception as exc:
            if self.raw in _UNVOIDED:  # a migration's failed COMMIT (see migrate)
                _UNVOIDED.discard(self.raw)
                self.owed_void = True
            self.raise_(exc)

    def transact_one(self, ticket: _Ticket) -> tuple[bool, Any]:
        """On the thread: run the ticket's op in its own BEGIN IMMEDIATE transaction and commit,
        unless its caller withdrew it (see _Ticket).

        The common case (one caller at a time) with no savepoint: the op's error rolls back the
        whole transaction, which holds nothing else.
        """
        with self.lock:
            op = _take(ticket)
            return _WITHDRAWN if op is None else self.transact_one_locked(op)

    def transact_one_locked(self, op: Op[Any]) -> tuple[bool, Any]:
        conn = self.raw
        committing = False
        try:
            if self.left_open:
                self.end_left_open()
            # IMMEDIATE: a deferred transaction that reads then writes gets SQLITE_BUSY at once
            # across processes, ignoring busy_timeout; IMMEDIATE waits for the lock properly.
            conn.execute("BEGIN IMMEDIATE")
            try:
                self.refuse_replaced_file()
                result = self.run_op(op, self.restart)
                if self.owed_void:
                    _rewrite_page_one(conn)
            except BaseException as exc:  # KeyboardInterrupt from a job generator too
                self.roll_back()
                return (False, self.translate(exc))
            committing = True
            conn.execute("COMMIT")
            self.owed_void = False
        except BaseException as exc:
            # KeyboardInterrupt too: an inline call (in memory) runs on the event loop's thread,
            # where a Ctrl-C lands between any two bytecodes, just before COMMIT or just after
            # BEGIN, say (the asyncio REPL and notebooks carry on after it). Not rolled back,
            # the transaction stayed open: reads saw a write its caller was told had failed,
            # and the next caller's BEGIN failed with "cannot start a transaction within a
            # transaction".
            self.roll_back()
            owing = committing and self.void_failed_commit(exc)
            error = self.translate(exc)
            return (False, _owing(error) if owing else error)
        return (True, result)

    def transact(self, tickets: Sequence[_Ticket]) -> list[tuple[bool, Any]]:
        """On the thread: run the tickets' ops in one BEGIN IMMEDIATE transaction and one commit.

        Returns (True, result) or (False, error) per op. Each op runs in its own savepoint, so
        a failing op rolls back only itself; after an error that ends the transaction itself
        (disk full, I/O, in an op or at the COMMIT), the others run again, each alone (see
        apart). An op whose caller withdrew it (see _Ticket) does not run.
        """
        with self.lock:
            return self.transact_locked([_take(ticket) for ticket in tickets])

    def transact_locked(self, ops: Sequence[Op[Any] | None]) -> list[tuple[bool, Any]]:
        conn = self.raw
        try:
            if self.left_open:
                self.end_left_open()
            conn.execute("BEGIN IMMEDIATE")  # IMMEDIATE: see transact_one
        except sqlite3.Error as exc:
            return _each_own(self.translate(exc), len(ops))
        results: list[tuple[bool, Any]] = []
        try:
            self.refuse_replaced_file()
            for op in ops:
                if op is None:  # withdrawn
                    results.append(_WITHDRAWN)
                    continue
                conn.execute("SAVEPOINT group_commit")
                result = self.attempt(op)
                if not result[0] and not conn.in_transaction:
                    error = result[1]
                    return self.apart(ops, results, error.__cause__ or error, result)
                if not result[0]:
                    conn.execute("ROLLBACK TO group_commit")
                conn.execute("RELEASE group_commit")
                results.append(result)
            if self.owed_void:
                _rewrite_page_one(conn)
        except Exception as exc:
            self.roll_back()
            return _each_own(self.translate(exc), len(ops))
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self.roll_back()
            owing = self.void_failed_commit(exc)
            told = self.apart(ops, results, exc)
            if not (owing and self.owed_void):  # a rerun that committed made the void
                return told
            # Still owed after the reruns: every op whose write the failed COMMIT held and
            # that failed since (its rerun too) says so. Not one whose savepoint had been
            # rolled back already, nor a withdrawn one (nobody waits for it).
            return [
                (ok, _owing(value) if not ok and was[0] else value)
                for (ok, value), was in zip(told, results, strict=True)
            ]
        self.owed_void = False
        return results

    def roll_back(self) -> None:
        """Roll back the open transaction, if any, raising nothing: an error path's, whose caller
        is told its own error, not the ROLLBACK's. A ROLLBACK that fails (an I/O error) leaves
        the transaction open, with the write lock, and this connection's reads would see the
        writes of a call that was told they failed: the next call ends it first."""
        conn = self.raw
        try:
            if conn.in_transaction:  # raises once the connection is closed
                conn.execute("ROLLBACK")
        except sqlite3.Error:
            self.left_open = True

    def end_left_open(self) -> None:
        """Roll back the transaction a failed ROLLBACK left open (see roll_back); raises if it
        fails again, for the call to report."""
        if self.raw.in_transaction:
            self.raw.execute("ROLLBACK")
        self.left_open = False

    def void_failed_commit(self, exc: BaseException) -> bool:
        """void_commit after a COMMIT that failed with ``exc`` and was rolled back; owed if it
        cannot be made now (or while a failed ROLLBACK leaves the transaction open). True if
        the pages of this COMMIT are so owed (not those of an earlier one)."""
        if voids(exc):
            self.owed_void = self.left_open or not void_commit(self.raw)
            return self.owed_void
        return False

    def before_close(self) -> None:
        """On the thread, just before the connection closes: a void still owed (no write
        transaction made it since: see owed_void), since a close whose checkpoint fails (a full
        disk) keeps the -wal, for the next open's recovery to apply those frames; then
        empty_wal_if_moved."""
        with self.lock, contextlib.suppress(Exception):
            if self.left_open:
                self.end_left_open()
            if self.owed_void:
                self.owed_void = not void_commit(self.raw)
        self.empty_wal_if_moved()

    def apart(
        self,
        ops: Sequence[Op[Any] | None],
        done: list[tuple[bool, Any]],
        cause: BaseException,
        result: tuple[bool, Any] | None = None,
    ) -> list[tuple[bool, Any]]:
        """The results of a group whose transaction ended with nothing of it kept: the op after
        those ``done`` failed with an error that ends the whole transaction (its ``result``:
        SQLITE_FULL, an I/O error, a trigger's RAISE(ROLLBACK)), or, with every op done and no
        ``result``, the COMMIT failed with ``cause`` (the disk filling as the WAL grew).

        The op that met the error gets it, and an op that had failed already keeps its own
        error. The others lost their work through no fault of their own, and may well succeed
        without the one that did (a disk filled by one big insert_jobs): each runs again, alone,
        in a transaction of its own, so that any that still fails fails alone, with its own
        error. Not an op that cannot run twice (a RunsOnce whose first run consumed its jobs'
        generator): it gets the error, its own instance, translated afresh (and write() says that
        the generator was consumed: see RunsOnce.told).

        The first op run again that cannot take the write lock within busy_timeout (another
        process took it after the failure) ends the reruns: the ops after it get its error, as
        instances of their own, at once. Each waited busy_timeout in turn before (64 callers:
        over five minutes at the default), for a lock most likely held still.
        """
        results: list[tuple[bool, Any]] = []
        busy: ControlError | None = None
        for index, op in enumerate(ops):
            if op is None:  # withdrawn
                results.append(_WITHDRAWN)
            elif index == len(done) and result is not None:
                results.append(result)
            elif index < len(done) and not done[index][0]:  # its own error stands
                results.append(done[index])
            elif index < len(done) and isinstance(op, RunsOnce):
                results.append((False, self.translate(cause)))
            elif busy is not None:
                results.append((False, _copy_of(busy)))
            else:
                ok, value = self.transact_one_locked(op)
                if not ok and isinstance(value, DatabaseBusyError):
                    busy = value
                results.append((ok, value))
        return results

    def refuse_replaced_file(self) -> None:
        """Raise StorageError if the path no longer names the file this store opened.

        SQLite in WAL mode keeps writing, without an error, to a file that was deleted, moved or
        replaced under it (measured: SQLITE_READONLY_DBMOVED is reported in rollback-journal mode
        only), so every acknowledged write after that would vanish with the old inode. One stat
        per transaction, under the write lock, before anything is written, turns that into an
        error; putting the file back makes the same store usable again.
        """
        if self.path is None:
            return
        if _identity_if_there(self.path) != self.identity:
            error = StorageError(
                f"{self.database} was deleted, moved or replaced while this store had it "
                "open; nothing of this call was written: put the very file back (moved back, "
                "not a copy: this store accepts only the file it opened) and retry; else close "
                "this store, and every store on the old file, before connecting again or "
                "restoring a backup over it (SQLite applies the -wal beside the path to "
                "whatever file is there)"
            )
            error.retryable = True
            raise error
        self.refuse_replaced_wal_files()

    def refuse_replaced_wal_files(self) -> None:
        """Raise StorageError if the database's -wal or -shm file is gone or another file.

        SQLite goes on without an error (measured): with the -wal deleted, it commits into the
        unlinked file it holds open, where every write since the last checkpoint is lost
        when the process dies (the schema too, on a new database); with the -shm deleted, a
        process connecting next makes a new one, and two processes then write at once,
        corrupting the file. One is seen the first time it is there (SQLite makes both at
        the connection's first read). By the path SQLite gives them: a symlink's target's.

        What a lost -wal holds is not copied into the database file here: a checkpoint that
        another process's open read stops part-way leaves the file, once the -wal is gone, a
        mix of page versions that SQLite reads as malformed (a review reproduced it). The last
        connection to close copies it whole, as it always does: hence "close, do not kill".
        """
        base = self.wal_base
        if base is None:
            return
        for index, (suffix, what) in enumerate(_WAL_FILES):
            now = _identity_if_there(base + suffix)
            known = self.wal_files[index]
            if known is None:
                self.wal_files[index] = now
                if index == 0 and now is not None and self.raw in _FILES:
                    _SAW_WAL.add(self.raw)
            elif now != known:
                raise StorageError(
                    f"{base + suffix!r}, the {what} of {self.database}, was deleted, moved or "
                    "replaced while this store had the database open; nothing of this call was "
                    "written, and no write can be made safely: put the file back if it was "
                    "moved, else close this store with 'await store.close()', not by ending "
                    "the process (closing writes what it holds into the database file), and "
                    "close every other process's store on the file too before connecting "
                    "again. Never delete a -wal or -shm file while the database is open; SQLite "
                    "itself deletes both when a connection closing takes itself for the last, "
                    "which it does when a process that has the database open also opened and "
                    "closed the file itself (a copy with shutil.copy, say: copy a live "
                    "database with sqlite3's backup API instead)"
                )

    def empty_wal_if_moved(self) -> None:
        """At close, on the thread: if the path names another file than the one this store
        opened (a backup moved over it) while the -wal beside it is still the one this store
        writes, copy that -wal into the file this store opened and empty it.

        SQLite's own close skips its checkpoint when the database file has moved, and so leaves
        the -wal beside the path, holding the old file's pages; the next connection there
        applies them to whatever file the path names now: a backup restored over the file
        was turned into a malformed one by a store closed as the fault's message said
        (measured). A TRUNCATE checkpoint empties the -wal only once every frame is in the
        old file (another connection still reading leaves it whole, for the last to close).
        """
        if self.path is None or self.wal_base is None:
            return
        now = _identity_if_there(self.path)
        if now is None or now == self.identity:
            # The usual close (SQLite checkpoints and removes the files itself), or a file gone:
            # its -wal then keeps a connect to the path refused until the file is put back.
            return
        known = self.wal_files[0]
        if known is None or _identity_if_there(self.wal_base + "-wal") != known:
            return  # not our log beside the path: nothing of ours to keep off the new file
        with self.lock, contextlib.suppress(Exception):
            self.raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def run_op(self, op: Op[T], undo: Callable[[], None]) -> T:
        """``op(conn)``; if it has to be run again with the lenient text factory (see _claim),
        ``undo()`` first takes back what it wrote."""
        conn = self.raw
        try:
            return op(conn)
        except _RerunLeniently:
            undo()
        with _lenient_text(conn):
            return op(conn)

    def restart(self) -> None:
        """Undo a lone op: roll its transaction back and begin another (see run_op)."""
        self.raw.execute("ROLLBACK")
        self.raw.execute("BEGIN IMMEDIATE")
        self.refuse_replaced_file()

    def rewind(self) -> None:
        """Undo an op of a group: roll back to its savepoint (see run_op)."""
        self.raw.execute("ROLLBACK TO group_commit")

    def attempt(self, op: Op[Any]) -> tuple[bool, Any]:
        try:
            return (True, self.run_op(op, self.rewind))
        except BaseException as exc:  # KeyboardInterrupt from a job generator too: the caller
            return (False, self.translate(exc))  # gets it; the savepoint is rolled back
