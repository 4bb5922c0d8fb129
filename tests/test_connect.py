"""Opening a store: URL forms, options, and the clear errors for what cannot be opened."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from control_store import (
    ConfigurationError,
    ControlError,
    DatabaseBusyError,
    EvalJob,
    Job,
    PendingMigrationError,
    StorageError,
    Store,
    UnknownMigrationError,
    _migrate,
    _sqlite,
)

from conftest import make_run, raw_db


@pytest.mark.parametrize(
    "form", ["sqlite://{rel}", "sqlite:///{abs}", "sqlite:{rel}", "{rel}", "{abs}", "path"]
)
async def test_url_forms_name_the_same_file(
    form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every URL form, and a Path, opens (and creates) the file it names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    target = tmp_path / "sub" / "control.db"
    absolute = str(target)
    url: str | Path = target
    if form != "path":
        # "sqlite:///" already supplies the leading slash of an absolute path.
        url = form.format(
            rel="sub/control.db", abs=absolute.removeprefix("/") if "///" in form else absolute
        )
    run = make_run()
    async with Store.connect(url) as store:
        await store.insert_run(run)
    assert target.exists()
    async with Store.connect(target) as store:
        assert await store.get_run(run.id) == run


async def test_in_memory_stores_are_private() -> None:
    """Two in-memory stores do not share data; sqlite::memory: is the same as in_memory()."""
    run = make_run()
    async with Store.in_memory() as a, Store.connect("sqlite::memory:") as b:
        await a.insert_run(run)
        assert await b.get_run(run.id) is None
        assert await a.get_run(run.id) == run


async def test_connect_runs_as_a_task(tmp_path: Path) -> None:
    """Store.connect(...) is a coroutine to asyncio: create_task, TaskGroup and gather take it."""
    task = asyncio.create_task(Store.connect(tmp_path / "a.db"))
    async with asyncio.TaskGroup() as group:
        grouped = group.create_task(Store.in_memory())
    gathered = await asyncio.gather(Store.connect(tmp_path / "b.db"), Store.in_memory())
    for store in (await task, grouped.result(), *gathered):
        assert await store.claim_next_run() is None
        await store.close()


async def test_connecting_twice_from_one_call_opens_two_stores(tmp_path: Path) -> None:
    """Awaiting one Store.connect(...) twice opens two stores, as before it was a coroutine."""
    connecting = Store.connect(tmp_path / "a.db")
    first = await connecting
    second = await connecting
    assert first is not second
    await first.close()
    await second.close()


async def test_each_task_made_of_one_connect_call_opens_its_own_store(tmp_path: Path) -> None:
    """Tasks made of one Store.connect(...), at once or one after another (and after an
    await of it), each open a store of their own: the second task stepped the first one's
    coroutine, or raised the raw "cannot reuse already awaited coroutine"."""
    connecting = Store.connect(tmp_path / "a.db")
    together = await asyncio.gather(
        asyncio.create_task(connecting), asyncio.create_task(connecting)
    )
    awaited = await connecting
    later = await asyncio.create_task(connecting)
    stores = [*together, awaited, later]
    assert len({id(store) for store in stores}) == 4
    run = make_run()
    await stores[0].insert_run(run)
    for store in stores:
        assert await store.get_run(run.id) == run
        await store.close()
    assert connecting._running == {}  # nothing kept of the coroutines that ended


async def test_a_connect_task_cancelled_before_it_starts_opens_nothing(tmp_path: Path) -> None:
    """A connect task cancelled before its first step creates no file and leaves no thread.

    Compared as sets of threads, not counts: a worker of an earlier test's store may still be
    ending, and a count then fell by one under a thread that had started nothing (CI, 3.13)."""
    before = set(threading.enumerate())
    task = asyncio.create_task(Store.connect(tmp_path / "a.db"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not (tmp_path / "a.db").exists()
    assert set(threading.enumerate()) <= before


@pytest.mark.filterwarnings("error")  # and no "coroutine was never awaited" left behind
def test_a_store_method_on_a_connect_not_awaited_says_to_await_it(tmp_path: Path) -> None:
    """store = Store.connect(url) without its await: using a store's method on it says how to
    open the store, where it said only that '_Connecting' has no such attribute; nothing is
    opened."""
    for connecting in (Store.connect(tmp_path / "x.db"), Store.in_memory()):
        for name in ("get_run", "list_runs", "read_only"):
            with pytest.raises(AttributeError, match=r"use store = await Store.connect\(url\)"):
                getattr(connecting, name)
        with pytest.raises(AttributeError, match="object has no attribute 'no_such'"):
            getattr(connecting, "no_such")  # noqa: B009
        assert not hasattr(connecting, "get_run")
    assert list(tmp_path.iterdir()) == []


async def test_a_connect_never_awaited_warns_as_a_coroutine_does(tmp_path: Path) -> None:
    """A bare ``Store.connect(url)`` statement (its await forgotten) opens nothing; dropped, it
    warns as a coroutine never awaited does (RuntimeWarning), where it was silent, and mypy
    --strict and pyright do not flag it (it is no plain Coroutine). One awaited, entered, run
    as a task or closed does not warn: the suite's warnings are errors."""
    path = tmp_path / "x.db"
    forgettings: list[tuple[Callable[[], object], str]] = [
        (lambda: Store.connect(path), f"Store.connect({path!r})"),
        (Store.in_memory, "Store.in_memory()"),
    ]
    for forgotten, named in forgettings:
        with pytest.warns(RuntimeWarning, match=re.escape(f"{named} was never awaited")):
            forgotten()  # dropped at once (CPython's reference counting)
    assert not path.exists()
    closed = Store.connect(path)
    closed.close()  # as a coroutine closed before its first step: no warning
    del closed
    gc.collect()


def test_a_connect_never_awaited_shows_no_password() -> None:
    """The never-awaited warning shows a URL's password as ***, as the connect error does."""
    with pytest.warns(RuntimeWarning, match="never awaited") as caught:
        Store.connect("sqlite://user:s3cret@host/x.db")
    assert [str(w.message).count("s3cret") for w in caught] == [0]
    assert "user:***@" in str(caught[0].message)


async def test_connect_is_awaitable_and_store_closes_with_async_with(tmp_path: Path) -> None:
    """`await Store.connect(...)` gives a store; `async with store` closes it."""
    store = await Store.connect(tmp_path / "a.db")
    async with store:
        assert not store.closed
    assert store.closed


def _closed(store: Store) -> bool:
    return store.closed


async def test_one_connect_entered_by_two_tasks_and_nested_closes_each_store(
    tmp_path: Path,
) -> None:
    """One ``Store.connect(...)`` entered with ``async with`` by two tasks at once, and twice
    nested in one task: each block gets a store of its own, and each exit closes the store
    its own enter opened, whatever order the blocks end in."""
    connecting = Store.connect(tmp_path / "a.db")
    seen: dict[str, Store] = {}
    both_in = asyncio.Barrier(2)
    first_left = asyncio.Event()

    async def block(name: str, leave_first: bool) -> None:
        async with connecting as store:
            seen[name] = store
            await both_in.wait()
            if not leave_first:
                await first_left.wait()  # the other block ends while this one is open
            assert not store.closed
        assert _closed(store)  # a call: mypy would take `closed` to be False still
        first_left.set()

    await asyncio.gather(block("a", leave_first=False), block("b", leave_first=True))
    assert seen["a"] is not seen["b"]
    async with connecting as outer:
        async with connecting as inner:
            assert inner is not outer
        assert inner.closed
        assert not outer.closed
    assert outer.closed


async def test_an_async_with_exited_in_another_task_closes_its_store(tmp_path: Path) -> None:
    """An ``async with`` whose exit runs in another task than its enter (a pytest-asyncio
    fixture's teardown, an AsyncExitStack closed elsewhere) still closes its store."""
    connecting = Store.connect(tmp_path / "a.db")
    store = await asyncio.create_task(connecting.__aenter__())
    await asyncio.create_task(connecting.__aexit__(None, None, None))
    assert store.closed


async def test_an_exit_from_another_task_closes_the_store_of_the_task_that_ended(
    tmp_path: Path,
) -> None:
    """A teardown task exits a block entered by a task that has since ended, while another
    task's block on the same Store.connect(...) is still open: the ended task's store is
    closed, and the open block's store goes on working until its own exit."""
    connecting = Store.connect(tmp_path / "a.db")
    stack = contextlib.AsyncExitStack()

    async def set_up() -> Store:
        return await stack.enter_async_context(connecting)

    fixture = await asyncio.create_task(set_up())
    inside = asyncio.Event()
    leave = asyncio.Event()

    async def working() -> None:
        async with connecting as store:
            inside.set()
            await leave.wait()
            await store.insert_run(make_run())  # still open after the teardown
        assert _closed(store)

    worker = asyncio.create_task(working())
    await inside.wait()
    await asyncio.create_task(stack.aclose())  # the teardown, in a task of its own
    assert fixture.closed
    leave.set()
    await worker


async def test_a_thread_that_cannot_start_is_a_retryable_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process out of memory or of threads cannot start the store's worker: connect raises
    a retryable StorageError that says so, not Python's bare RuntimeError."""

    def cannot_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(StorageError, match="could not start the thread") as caught:
        await Store.connect(tmp_path / "a.db")
    assert caught.value.retryable
    assert "free memory or end some threads, then retry" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert not (tmp_path / "a.db").exists()


@pytest.mark.parametrize(("seconds", "milliseconds"), [(0.0004, 1), (2.5, 2500), (0, 0)])
async def test_busy_timeout_is_rounded_up_to_whole_milliseconds(
    tmp_path: Path, seconds: float, milliseconds: int
) -> None:
    """SQLite waits in whole milliseconds: a busy_timeout under one is one, not 0 (no wait)."""
    for read_only in (False, True):
        async with Store.connect(
            tmp_path / "a.db", busy_timeout=seconds, read_only=read_only
        ) as store:
            backend = store._backend
            assert backend is not None
            rows = await backend.read(lambda conn: conn.execute("PRAGMA busy_timeout").fetchall())
            assert rows == [(milliseconds,)]


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("mysql://user@host/db", "unknown scheme 'mysql'"),
        ("postgres://admin:s3cret@db.example/evals", "PostgreSQL"),
        ("sqlite://", "names no file"),
        ("sqlite://data.db?mode=ro", "query parameters"),
        ("", "empty"),
    ],
)
async def test_unusable_urls_are_refused(url: str, match: str) -> None:
    """A URL that cannot be used is a ConfigurationError that says what to write instead."""
    with pytest.raises(ConfigurationError, match=match) as caught:
        await Store.connect(url)
    assert "s3cret" not in str(caught.value)


async def test_a_file_name_with_a_colon_is_told_how_to_pass_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'name:rest' reads as a URL of scheme 'name'; for such a file name (a timestamp in it)
    the refusal says to pass it as ./name or a Path, which then opens that file."""
    monkeypatch.chdir(tmp_path)
    name = "control-2024-01-01T12:00:00.db"
    with pytest.raises(ConfigurationError, match="unknown scheme 'control-2024-01-01T12'") as e:
        await Store.connect(name)
    assert f"pass it as ./{name} or a pathlib.Path" in str(e.value)
    for spelled in (f"./{name}", Path(name)):
        async with Store.connect(spelled) as store:
            assert await store.list_runs() == []
    assert (tmp_path / name).exists()
    with pytest.raises(ConfigurationError) as e:
        await Store.connect("mysql://user@host/db")  # a URL: no file advice
    assert "pass it as ./" not in str(e.value)


async def test_missing_directory_is_refused(tmp_path: Path) -> None:
    """A path in a directory that does not exist is refused, naming the directory. A
    read-only connect, which creates nothing, is told there is no such file and why, not to
    create the directory (tests/test_read_only.py has the other paths where no file can be)."""
    with pytest.raises(ConfigurationError) as refused:
        await Store.connect(tmp_path / "nope" / "control.db")
    message = str(refused.value)
    assert f"directory '{tmp_path / 'nope'}' does not exist, so neither does the" in message
    assert "check the path, or, for a new database, create the directory first" in message
    with pytest.raises(ConfigurationError) as refused:
        await Store.connect(tmp_path / "nope" / "control.db", read_only=True)
    message = str(refused.value)
    assert f"no such file: directory '{tmp_path / 'nope'}' does not exist (read_only" in message
    assert "create the directory" not in message
    assert not (tmp_path / "nope").exists()


class _BytesPath:
    """An os.PathLike whose __fspath__ gives bytes, which the store cannot take as a name."""

    def __fspath__(self) -> bytes:
        return b"control.db"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: str(tmp / "a\0b.db"), "NUL character"),
        (lambda tmp: f"sqlite://{tmp}/a\0b.db", "NUL character"),
        (lambda tmp: tmp / "a\0b.db", "NUL character"),
        (lambda tmp: _BytesPath(), "gives bytes, not str"),
        (lambda tmp: tmp / ("x" * 300 + ".db"), "File name too long"),
        (lambda tmp: tmp / "README" / "control.db", "is a file, not a directory"),
        (lambda tmp: str(tmp / "\ud800.db"), r"cannot encode '\\ud800' at position"),
        (lambda tmp: f"sqlite://{tmp}/\ud800.db", "cannot be a file name here"),
        (lambda tmp: tmp / "\ud800.db", "cannot be a file name here"),
    ],
    ids=[
        "nul-str",
        "nul-url",
        "nul-path",
        "bytes-pathlike",
        "name-too-long",
        "file-as-dir",
        "surrogate-str",
        "surrogate-url",
        "surrogate-path",
    ],
)
async def test_paths_no_file_can_have_are_refused(
    tmp_path: Path, make: Callable[[Path], object], match: str
) -> None:
    """A path that names no possible file is a ControlError naming the path and the reason."""
    (tmp_path / "README").write_text("a file")
    with pytest.raises(ControlError, match=match):
        await Store.connect(make(tmp_path))  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README"]


async def test_a_path_starting_with_file_colon_is_a_plain_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "file:x.db" names the file "file:x.db", not a URI for x.db (SQLite's SQLITE_USE_URI)."""
    monkeypatch.chdir(tmp_path)
    async with Store.connect("sqlite://file:x.db") as store:
        await store.insert_run(make_run())
    async with Store.connect(Path("file:x.db")) as store:
        assert len(await store.list_runs()) == 1
    assert "x.db" not in {p.name for p in tmp_path.iterdir()}
    assert (tmp_path / "file:x.db").is_file()


@pytest.mark.parametrize(
    "url",
    ["sqlite://admin:s3cret@db.example/x.db", "sqlite://admin:s3cret@db.example/"],
)
async def test_a_sqlite_url_with_a_password_is_refused_without_showing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """A sqlite URL holding user:password@ (as other schemes' URLs do) is refused with the
    password redacted, and nothing is created."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=r"sqlite://admin:\*\*\*@db.example.*no users"):
        await Store.connect(url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "url", [":memory:", Path(":memory:"), "sqlite://:memory:"], ids=["str", "path", "url"]
)
async def test_memory_as_a_file_name_is_refused_with_both_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str | Path
) -> None:
    """A plain path ":memory:" (or sqlite://:memory:), which SQLite would silently open as an
    in-memory database, is a ConfigurationError naming Store.in_memory() and, for a file of
    that name, fixes that work for a str and for a Path (which drops a leading './')."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigurationError, match=r"use Store.in_memory\(\).* for a file named ':memory:', pass"
    ) as caught:
        await Store.connect(url)
    assert list(tmp_path.iterdir()) == []
    assert "'./:memory:' as a str" in str(caught.value)
    assert "Path.cwd() / ':memory:'" in str(caught.value)
    assert Path("./:memory:") == Path(":memory:")  # why a Path needs the absolute form
    async with Store.connect(Path.cwd() / ":memory:") as store:
        assert not store.read_only
    assert (tmp_path / ":memory:").exists()


async def test_a_file_named_memory_is_opened_as_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'./:memory:' names a file, which keeps what was stored; sqlite::memory: and
    Store.in_memory() still open in-memory stores."""
    monkeypatch.chdir(tmp_path)
    run = make_run()
    async with Store.connect("./:memory:") as store:
        await store.insert_run(run)
    async with Store.connect(tmp_path / ":memory:") as store:
        assert await store.get_run(run.id) == run
    async with Store.connect("sqlite::memory:") as memory, Store.in_memory() as other:
        assert memory._backend is not None
        assert memory._backend.database == "the in-memory database"
        assert await other.get_run(run.id) is None
    assert {p.name for p in tmp_path.iterdir()} >= {":memory:"}


@pytest.mark.parametrize(
    "rest", [":MEMORY:", ":Memory:", ":memory:#x", ":memory:.db", ":memory:%41"]
)
async def test_a_url_that_only_looks_like_memory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rest: str
) -> None:
    """sqlite:<rest> in another case, or with more after it, would open a file so named where
    sqlite::memory: was meant: refused, creating nothing, with the URL for each meaning; the
    URL given for the file opens it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as caught:
        await Store.connect(f"sqlite:{rest}")
    assert list(tmp_path.iterdir()) == []
    assert str(caught.value) == (
        f"URL 'sqlite:{rest}' is not sqlite::memory: (its case or what follows differ), so it "
        f"would open a file named {rest.replace('%41', 'A')!r}; nothing was opened: for an "
        "in-memory store write "
        f"sqlite::memory: as it is here; for a file so named, sqlite://./{rest}"
    )
    async with Store.connect(f"sqlite://./{rest}") as store:
        assert not store.read_only
    named = rest.replace("%41", "A")
    assert [p.name for p in tmp_path.iterdir() if p.name == named] == [named]


@pytest.mark.parametrize("end", ["\n", " ", "\r\n", "\t"])
async def test_a_url_ending_in_whitespace_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """A URL read with its line's end (from a file, an environment variable) would name a file
    whose name ends so, beside the one meant: refused, creating nothing; the %XX escape names
    such a file on purpose."""
    monkeypatch.chdir(tmp_path)
    for url in (f"sqlite://runs.db{end}", f"sqlite::memory:{end}"):
        with pytest.raises(ConfigurationError, match="ends with whitespace") as caught:
            await Store.connect(url)
        assert f"({end[-1]!r})" in str(caught.value)
        assert "remove it from the URL" in str(caught.value)
    assert list(tmp_path.iterdir()) == []
    async with Store.connect("sqlite://runs.db%20") as store:
        assert not store.read_only
    assert "runs.db " in {p.name for p in tmp_path.iterdir()}


class _BrokenPath:
    """An os.PathLike whose __fspath__ raises."""

    def __fspath__(self) -> str:
        raise RuntimeError("fspath broke")


async def test_a_path_whose_fspath_raises_is_refused() -> None:
    """A path object whose __fspath__ raises is a ConfigurationError saying what it raised."""
    with pytest.raises(ConfigurationError, match=r"os.fspath\(\) of it raised RuntimeError"):
        await Store.connect(_BrokenPath())


@pytest.mark.parametrize("read_only", [False, True])
async def test_an_sqlite_too_old_for_returning_is_refused_before_opening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_only: bool
) -> None:
    """An SQLite before 3.35.0 (no RETURNING) is named, with the fix; no file is created or
    changed, and the same SQLite one patch release newer is accepted."""
    path = tmp_path / "control.db"
    if read_only:
        async with Store.connect(path):
            pass
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 34, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.34.1")
    with pytest.raises(
        ConfigurationError,
        match=r"needs SQLite 3\.35\.0 or newer .* uses SQLite 3\.34\.1; nothing was opened: run "
        "on a Python built against a newer SQLite",
    ):
        await Store.connect(path, read_only=read_only)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 35, 0))
    async with Store.connect(path, read_only=read_only) as store:
        assert await store.list_runs() == []


async def test_a_directory_is_not_a_database(tmp_path: Path) -> None:
    """Pointing at a directory is refused."""
    with pytest.raises(ConfigurationError, match="is a directory"):
        await Store.connect(tmp_path)


async def test_a_fifo_or_a_device_is_not_a_database(tmp_path: Path) -> None:
    """A FIFO (whose open would block until a writer came), a device (/dev/null keeps no
    write) or a symlink to one is refused at connect, naming what it is; nothing is created
    beside it."""
    fifo = tmp_path / "control.db"
    os.mkfifo(fifo)
    link = tmp_path / "link.db"
    link.symlink_to(os.devnull)
    device = "a character device"
    for path, kind in [(fifo, "a FIFO (named pipe)"), (Path(os.devnull), device), (link, device)]:
        with pytest.raises(ConfigurationError) as caught:
            await asyncio.wait_for(Store.connect(path, read_only=path is link), timeout=30)
        assert str(caught.value) == (
            f"cannot open {str(path)!r}: it is {kind}, and "
            "a database must be a regular file; name a regular file, or a path where none "
            "exists yet for the store to create"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control.db", "link.db"]


async def test_a_file_that_is_not_sqlite_is_refused_and_left_untouched(tmp_path: Path) -> None:
    """A non-database file is a ConfigurationError, and its bytes are unchanged."""
    path = tmp_path / "notes.db"
    content = b"these are my notes, not a database\n" * 200
    path.write_bytes(content)
    with pytest.raises(ConfigurationError, match=r"not a SQLite database.*untouched"):
        await Store.connect(path)
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]


async def test_a_file_sqlite_could_not_create_is_refused_saying_why(tmp_path: Path) -> None:
    """A name too long for the journal SQLite makes beside it (the name plus '-journal'), or a
    dangling symlink into a directory that does not exist: SQLite's "unable to open database
    file" read as a disk fault to retry, and the long name left an empty file. Refused first,
    naming the cause; no file is made, and the longest name that fits works."""
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    fits = longest - len("-journal")
    link = tmp_path / "link.db"
    link.symlink_to(tmp_path / "nowhere" / "x.db")
    for path, words in (
        (tmp_path / ("b" * (fits + 1)), f"give the database a name of at most {fits} bytes"),
        (link, f"it is a symlink to '{tmp_path / 'nowhere' / 'x.db'}', whose directory"),
    ):
        with pytest.raises(ConfigurationError, match=re.escape(words)):
            await Store.connect(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.db"]
    async with Store.connect(tmp_path / ("b" * fits)) as store:
        assert await store.list_runs() == []


async def test_a_file_format_newer_than_this_sqlites_is_named(db_path: Path) -> None:
    """A header a newer SQLite would write: a write version past 2 (SQLite opens such a file
    read-only, however writable: it was told to make the file writable and retry), or a schema
    format past 4 (it said only "failed: unsupported file format"). Each is a
    ConfigurationError naming the format and the fix; the file is left as it was, and the
    first still reads read-only."""
    async with Store.connect(db_path) as store:
        run = make_run()
        await store.insert_run(run)
    # Write and read versions 3 and 2 (WAL), 3 and 1 (a rollback journal: refused as it
    # switched to WAL); schema format 5.
    for offset, value, writes in (
        (18, b"\x03\x02", True),
        (18, b"\x03\x01", True),
        (47, b"\x05", False),
    ):
        copy = db_path.with_name(f"format-{offset}-{value.hex()}.db")
        copy.write_bytes(db_path.read_bytes())  # closed: no -wal beside it
        with copy.open("r+b") as file:
            file.seek(offset)
            file.write(value)
        before = copy.read_bytes()
        with pytest.raises(ConfigurationError) as caught:
            await Store.connect(copy)
        assert "is in a file format newer than this SQLite (" in str(caught.value)
        assert ("writes (its header's write version is 3" in str(caught.value)) == writes
        assert "then retry" not in str(caught.value)
        assert copy.read_bytes() == before
    async with Store.connect(db_path.with_name("format-18-0302.db"), read_only=True) as reader:
        assert await reader.list_runs() == [run]


@pytest.mark.parametrize("migrate", [True, False])
async def test_another_applications_database_is_refused_and_left_untouched(
    tmp_path: Path, migrate: bool
) -> None:
    """An SQLite file with tables but no control_store history (a mistyped URL) is refused:
    nothing of ours is written into it and its journal mode stays as its owner set it."""
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
        conn.commit()
    content = path.read_bytes()
    with pytest.raises(ConfigurationError, match=r"not a control_store database.*'notes'"):
        await Store.connect(path, migrate=migrate)
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def _killed_with_commits_in_its_wal(path: Path, statements: list[str]) -> None:
    """Run ``statements`` on ``path`` in WAL mode in another process that then dies at once
    (os._exit): its commits stay in the -wal, which no close checkpointed."""
    script = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode = WAL')\n"
        "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
        f"for sql in {statements!r}:\n"
        "    c.execute(sql)\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60)
    assert path.with_name(path.name + "-wal").stat().st_size > 0


def _bytes_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if not p.name.endswith("-shm")}


@pytest.mark.parametrize("migrate", [True, False])
async def test_a_refused_file_whose_wal_holds_commits_is_left_untouched(
    tmp_path: Path, migrate: bool
) -> None:
    """A refusal says the file "was left untouched": with its last commits in its -wal (its
    owner killed), the store's own connection had read it, and closing checkpointed the -wal
    into the file and deleted it. Another application's database and a store of a newer
    release's schema are refused, the file and its -wal byte for byte as they were."""
    foreign = tmp_path / "app" / "app.db"
    foreign.parent.mkdir()
    _killed_with_commits_in_its_wal(
        foreign, ["CREATE TABLE notes (body TEXT)", "INSERT INTO notes VALUES ('mine')"]
    )
    newer = tmp_path / "newer" / "control.db"
    newer.parent.mkdir()
    async with Store.connect(newer):
        pass
    _killed_with_commits_in_its_wal(
        newer,
        [f"INSERT INTO {_migrate.TRACKING_TABLE} VALUES (9999, 'future', 'x', 1, x'00', 0)"],
    )
    link = tmp_path / "link.db"  # SQLite keeps the -wal beside the symlink's target
    link.symlink_to(foreign)
    for path, error, match in (
        (foreign, ConfigurationError, r"not a control_store database.*'notes'.*untouched"),
        (link, ConfigurationError, r"not a control_store database.*'notes'.*untouched"),
        (newer, UnknownMigrationError, r"9999"),
    ):
        held = path.resolve().parent
        before = _bytes_of(held)
        with pytest.raises(error, match=match):
            await Store.connect(path, migrate=migrate)
        assert _bytes_of(held) == before, path


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"busy_timout": 1}, "unknown option busy_timout"),
        ({"busy_timeout": -1}, "busy_timeout=-1"),
        ({"busy_timeout": "5"}, "busy_timeout='5'"),
        ({"synchronous": "sometimes"}, "synchronous='sometimes'"),
        ({"migrate": "yes"}, "migrate='yes'"),
    ],
)
async def test_bad_options_are_refused(
    options: dict[str, object], match: str, tmp_path: Path
) -> None:
    """An unknown option or a bad value is a ConfigurationError naming it; no file is made."""
    path = tmp_path / "x.db"
    with pytest.raises(ConfigurationError, match=match):
        await Store.connect(path, **options)  # type: ignore[arg-type]
    assert not path.exists()


@pytest.mark.parametrize("synchronous", ["NORMAL", "full", "EXTRA"])
async def test_synchronous_option_is_applied(tmp_path: Path, synchronous: str) -> None:
    """The synchronous option reaches SQLite (checked on the store's own connection)."""
    levels = {"OFF": 0, "NORMAL": 1, "FULL": 2, "EXTRA": 3}
    async with Store.connect(tmp_path / "s.db", synchronous=synchronous) as store:  # type: ignore[arg-type]
        backend = store._open()
        value = await backend.read(lambda c: c.execute("PRAGMA synchronous").fetchone()[0])
        mode = await backend.read(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0])
        keys = await backend.read(lambda c: c.execute("PRAGMA foreign_keys").fetchone()[0])
    assert value == levels[synchronous.upper()]
    assert (mode, keys) == ("wal", 1)


async def test_the_wal_file_is_cut_back_after_a_big_write(tmp_path: Path) -> None:
    """A transaction bigger than WAL_SIZE_LIMIT grows the -wal file past it; after the next
    checkpoint, the following write cuts it back (SQLite alone keeps it at its peak size)."""
    path = tmp_path / "s.db"
    wal = tmp_path / "s.db-wal"
    async with Store.connect(path, synchronous="NORMAL") as store:
        run = make_run(job_count=1200)
        await store.insert_run(run)
        padding = "x" * 60_000  # 1200 jobs of ~60 KB: ~70 MiB in one transaction
        await store.insert_jobs(
            Job(run.id, EvalJob("model-a", f"{padding}{i}", 0)) for i in range(1200)
        )
        assert wal.stat().st_size > _sqlite.WAL_SIZE_LIMIT
        for _ in range(2):  # the first commit checkpoints, the second restarts the WAL
            await store.insert_run(make_run())
        assert wal.stat().st_size <= _sqlite.WAL_SIZE_LIMIT


async def test_write_lock_held_past_busy_timeout_is_a_retryable_busy_error(
    db_path: Path,
) -> None:
    """Another connection holding the write lock too long gives DatabaseBusyError; retry works."""
    run = make_run()
    async with Store.connect(db_path, busy_timeout=0.1) as store:
        holder = sqlite3.connect(db_path, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(DatabaseBusyError, match=r"locked.*busy_timeout=0\.1s.*retry") as e:
                await store.insert_run(run)
            assert e.value.retryable
            assert isinstance(e.value.__cause__, sqlite3.OperationalError)
            assert await store.get_run(run.id) is None  # readers are not blocked under WAL
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        await store.insert_run(run)
        assert await store.get_run(run.id) == run


async def test_a_reader_blocking_a_file_out_of_wal_mode_is_not_called_a_writer(
    db_path: Path,
) -> None:
    """On a file switched out of WAL mode (as for a read-only copy), a reader's open
    transaction blocks connect; the busy error does not blame a write lock."""
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    reader = sqlite3.connect(db_path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM runs").fetchone()  # holds a shared lock
        with pytest.raises(DatabaseBusyError) as caught:
            await Store.connect(db_path, busy_timeout=0.1)
    finally:
        reader.execute("ROLLBACK")
        reader.close()
    message = str(caught.value)
    assert "write lock" not in message
    assert "reader's open transaction" in message
    assert caught.value.retryable
    async with Store.connect(db_path) as store:  # the reader gone, it opens (and is WAL again)
        assert await store.list_runs() == []


async def test_paths_with_unicode_and_spaces(tmp_path: Path) -> None:
    """A file name with spaces and non-ASCII characters works as a plain path."""
    path = tmp_path / "évals été" / "store 1.db"
    os.makedirs(path.parent)
    run = make_run()
    async with Store.connect(str(path)) as store:
        await store.insert_run(run)
        assert await store.get_run(run.id) == run
    assert path.exists()


async def test_a_relative_path_survives_a_change_of_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store opened by a relative path keeps writing after the process changes directory."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    async with Store.connect("sqlite://control.db") as store:
        monkeypatch.chdir(tmp_path / "elsewhere")
        run = make_run()
        await store.insert_run(run)
        assert await store.get_run(run.id) == run
    assert not (tmp_path / "elsewhere" / "control.db").exists()


def test_a_failed_open_ends_its_thread_before_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When SQLite cannot open the file, connect's error comes after aiosqlite's worker thread
    has ended: an asyncio.run that ends at once leaves no thread behind to fail."""

    def cannot_open(*args: object, **kwargs: object) -> sqlite3.Connection:
        raise sqlite3.OperationalError("unable to open database file")

    failures: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    monkeypatch.setattr(sqlite3, "connect", cannot_open)  # what aiosqlite's connector calls

    async def open_store() -> None:
        await Store.connect(tmp_path / "control.db")

    before = set(threading.enumerate())
    for _ in range(20):
        with pytest.raises(ControlError, match="unable to open"):
            asyncio.run(open_store())
    assert set(threading.enumerate()) <= before
    assert failures == []


async def test_a_sqlite_urls_percent_escapes_are_decoded_as_sqlx_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlite://my%20runs.db, as sqlx spells it (a URL shared with a service using sqlx), opens
    "my runs.db", not a new empty file named "my%20runs.db" beside it; a % not followed by two
    hex digits stays; escapes of bytes that are not UTF-8 are refused, creating nothing."""
    monkeypatch.chdir(tmp_path)
    run = make_run()
    async with Store.connect(Path("my runs é.db")) as store:
        await store.insert_run(run)
    async with Store.connect("sqlite://my%20runs%20%C3%A9.db") as store:
        assert await store.list_runs() == [run]
    async with Store.connect("sqlite://50%.db"):
        pass
    before = sorted(p.name for p in tmp_path.iterdir())
    assert "my%20runs%20%C3%A9.db" not in before
    assert "50%.db" in before
    with pytest.raises(ConfigurationError, match=r"not UTF-8.*nothing was opened"):
        await Store.connect("sqlite://bad%FF.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


async def test_messages_about_a_decoded_url_name_the_url_typed_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error about the file a percent-encoded URL names gives the URL as typed beside the
    decoded path: the user typed the URL, and may not know it names "my runs.db"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigurationError,
        match=r"cannot open 'no dir/x.db' \(the URL 'sqlite://no%20dir/x.db'\): directory",
    ):
        await Store.connect("sqlite://no%20dir/x.db")
    with pytest.raises(
        ConfigurationError,
        match=r"database 'my runs.db' \(the URL 'sqlite://my%20runs.db'\) read-only: no such",
    ):
        await Store.connect("sqlite://my%20runs.db", read_only=True)
    sqlite3.connect("my runs.db").close()  # an empty file: no schema yet
    with pytest.raises(
        PendingMigrationError, match=r"database 'my runs.db' \(the URL 'sqlite://my%20runs.db'\)"
    ):
        await Store.connect("sqlite://my%20runs.db", read_only=True)
    (tmp_path / "my dir").mkdir()
    with pytest.raises(
        ConfigurationError, match=r"\(the URL 'sqlite://my%20dir/x{300}\.db'\): File name too long"
    ):
        await Store.connect("sqlite://my%20dir/" + "x" * 300 + ".db")
    # Without escapes, the path alone, as before.
    with pytest.raises(ConfigurationError, match=r"database 'x.db' read-only"):
        await Store.connect("sqlite://x.db", read_only=True)


async def test_a_file_an_older_release_made_under_an_escaped_url_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releases before the URL decoding named the file sqlite://old%20runs.db opened
    "old%20runs.db". With that file there and no "old runs.db", the URL is refused, naming both
    and the rename, rather than opening a new, empty database beside the old one; a %00 is
    refused naming the URL typed; nothing is created either way. A directory under the escaped
    name is no such file."""
    monkeypatch.chdir(tmp_path)
    run = make_run()
    async with Store.connect(Path("old%20runs.db")) as store:  # as the older release named it
        await store.insert_run(run)
    before = sorted(p.name for p in tmp_path.iterdir())
    for options in ({}, {"read_only": True}):
        with pytest.raises(
            ConfigurationError, match=r"names 'old runs.db'.*'old%20runs.db' does.*rename"
        ):
            await Store.connect("sqlite://old%20runs.db", **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"URL 'sqlite://a%00b.db' .* NUL"):
        await Store.connect("sqlite://a%00b.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    async with Store.connect(Path("old%20runs.db")) as store:
        assert await store.list_runs() == [run]
    # An escaped '/' names a directory that is not there: no rename into it is offered.
    async with Store.connect(Path("a%2Fb.db")):
        pass
    with pytest.raises(ConfigurationError) as caught:
        await Store.connect("sqlite://a%2Fb.db")
    assert "rename" not in str(caught.value)
    assert "pass 'a%2Fb.db' itself as a plain path" in str(caught.value)
    # A directory (or a dangling link) under the escaped name is no database an older release
    # made: the URL names the decoded file, as for any other.
    (tmp_path / "dir%20x.db").mkdir()
    async with Store.connect("sqlite://dir%20x.db"):
        pass
    assert (tmp_path / "dir x.db").is_file()


async def test_a_relative_path_in_a_deleted_working_directory_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the current directory deleted, a relative path names nothing that can be opened
    or created: the refusal says why, where it said "No such file or directory; check the path"
    (and the CLI told to create the database, which then failed the same way)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    for url in ("x.db", "sqlite://x.db", Path("x.db")):
        with pytest.raises(ConfigurationError, match="the current directory was deleted"):
            await Store.connect(url)
    async with Store.connect(tmp_path / "x.db") as store:  # an absolute path still opens
        assert await store.list_runs() == []


@pytest.mark.parametrize("name", ["y" * 300 + ".db", "d" * 300 + "/x.db"], ids=["file", "dir"])
async def test_a_name_too_long_says_to_shorten_it(tmp_path: Path, name: str) -> None:
    """A path the file system refuses as too long is told to be shortened, not to check that
    this user may enter every directory on it."""
    with pytest.raises(ConfigurationError, match="File name too long") as caught:
        await Store.connect(tmp_path / name)
    assert "give a shorter path" in str(caught.value)
    assert "may enter every directory" not in str(caught.value)


async def test_a_store_method_asked_of_an_unawaited_connect_says_to_await_it() -> None:
    """store = Store.connect(url) without await, then store.get_run(...): a ConfigurationError
    (a ControlError, as the contract has every error be) that is an AttributeError too, so
    hasattr() and getattr() with a default still work; it says to await the connect. A name
    a Store does not have stays a plain AttributeError."""
    opening = Store.connect("sqlite::memory:")
    with pytest.raises(ConfigurationError) as caught:
        opening.get_run  # type: ignore[attr-defined]  # noqa: B018
    assert isinstance(caught.value, AttributeError)
    assert (caught.value.name, caught.value.obj) == ("get_run", opening)
    assert str(caught.value) == (
        "'get_run' is an attribute of a Store, and this is not one yet: Store.connect() and "
        "Store.in_memory() return what opens one; use store = await Store.connect(url), or "
        "async with Store.connect(url) as store"
    )
    assert not hasattr(opening, "claim_runs")
    assert getattr(opening, "closed", "default") == "default"
    with pytest.raises(AttributeError) as plain:
        opening.no_such_method  # type: ignore[attr-defined]  # noqa: B018
    assert not isinstance(plain.value, ControlError)
    store = await opening
    assert await store.get_run(uuid.uuid4()) is None
    await store.close()
