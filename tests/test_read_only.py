"""Read-only stores: reads work, every write is refused, the file is never changed or created.

Root ignores permission bits, so the cases that need a file or directory this process may not
write run in a worker that first drops those privileges (tests/_workers.py,
obey_file_permissions), as tests/test_faults.py does; they are skipped where that is not
possible.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sqlite3
import stat
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from control_store import (
    ConfigurationError,
    ControlError,
    Job,
    JobOutcome,
    PendingMigrationError,
    ReadOnlyStoreError,
    Run,
    RunStatus,
    Store,
    UnknownMigrationError,
)

from conftest import (
    NEXT_VERSION,
    SHIPPED,
    Worker,
    assert_sound,
    make_jobs,
    make_run,
    raw_db,
    with_second_migration,
)

TRACKING = "_control_store_migrations"
READ_ONLY_DIR = stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH


async def populate(path: Path) -> tuple[Run, list[Job]]:
    """A run of three jobs, one of them recorded, and a second run still queued: the first,
    as stored, and its jobs."""
    run = make_run(3)
    jobs = make_jobs(run)
    async with Store.connect(path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        await store.insert_run(make_run())
        await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=0.5))
        stored = await store.get_run(run.id)
    assert stored is not None
    return stored, jobs


def digest(path: Path) -> str:
    """The file's SHA-256: equal digests mean byte-for-byte equal files."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wal_is_empty(path: Path) -> bool:
    """True if no -wal file holds a page: nothing was written beside the file either."""
    wal = Path(f"{path}-wal")
    return not wal.exists() or wal.stat().st_size == 0


# ---------------------------------------------------------------------------------------------
# Reads


async def test_every_read_works_on_a_read_only_store(db_path: Path) -> None:
    """get_run, get_job, list_jobs, iter_jobs, list_runs, iter_runs, check and
    migration_status all answer."""
    run, jobs = await populate(db_path)
    async with Store.connect(db_path) as store:
        expected = (await store.get_run(run.id), await store.list_jobs(run.id))
        expected_runs = await store.list_runs()
        expected_status = await store.migration_status()
    db_path.chmod(0o444)
    async with Store.connect(db_path, read_only=True) as store:
        assert store.read_only
        assert (await store.get_run(run.id), await store.list_jobs(run.id)) == expected
        assert await store.get_job(jobs[0].id) == expected[1][0]
        assert await store.list_runs() == expected_runs
        assert await store.list_runs(status=RunStatus.QUEUED, limit=1) == expected_runs[:1]
        assert [r async for r in store.iter_runs(page_size=1)] == expected_runs
        assert [j async for j in store.iter_jobs(run.id, page_size=1)] == expected[1]
        assert await store.check() == []
        assert await store.migration_status() == expected_status
    assert store.read_only  # closed: still the kind of store it was opened as


async def test_a_writable_store_says_it_is_not_read_only(store: Store) -> None:
    """Store.read_only is False for an ordinary store."""
    assert not store.read_only


async def test_a_name_with_uri_characters_opens_the_file_it_names(tmp_path: Path) -> None:
    """?, #, %, %XX and spaces in the name reach SQLite escaped, naming that file only, given
    as a path or as a sqlite URL."""
    name = "a run? #3 100% of %41 b.db"
    path = tmp_path / name
    run, _ = await populate(path)
    # Where an unescaped URI would lead: the name cut at ?, or %41 decoded to A.
    (tmp_path / "a run").write_bytes(b"decoy")
    (tmp_path / name.replace("%41", "A")).write_bytes(b"decoy")
    async with Store.connect(path, read_only=True) as store:
        assert await store.get_run(run.id) == run
    # A sqlite:// URL spells the name percent-encoded, as sqlx reads it (a bare ? would be a
    # query, refused; %41 would be A).
    async with Store.connect(f"sqlite://{urllib.parse.quote(str(path))}", read_only=True) as store:
        assert await store.get_run(run.id) == run


async def test_a_relative_path_opens_read_only(
    tmp_path: Path, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path (and a sqlite:// relative URL) is read from the current directory."""
    run, _ = await populate(db_path)
    monkeypatch.chdir(db_path.parent)
    for url in (db_path.name, f"sqlite://{db_path.name}"):
        async with Store.connect(url, read_only=True) as store:
            assert await store.get_run(run.id) == run


async def test_a_path_through_a_symlink_and_dot_dot_opens_the_file_the_kernel_does(
    tmp_path: Path,
) -> None:
    """ "link/../x.db", link a symlink to a directory elsewhere: the kernel (and a writable
    store) opens x.db beside the link's target; the read-only store read x.db beside the
    link, another file, by normalising the path as text before SQLite saw it."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "link").symlink_to(tmp_path / "real" / "sub")
    through = tmp_path / "here" / "link" / ".." / "x.db"
    run, _ = await populate(tmp_path / "real" / "x.db")
    decoy, _ = await populate(tmp_path / "here" / "x.db")  # where the text leads
    for given in (str(through), f"sqlite://{through}"):
        async with Store.connect(given, read_only=True) as store:
            assert await store.get_run(run.id) == run
            assert await store.get_run(decoy.id) is None


# ---------------------------------------------------------------------------------------------
# Writes are refused, and leave the file as it was


def _never_started() -> Iterator[Job]:
    """A generator whose body must never run: a refused insert_jobs does not start it."""
    started.append(True)
    yield from ()


started: list[bool] = []


WRITES: dict[str, Callable[[Store, Run, list[Job]], Awaitable[Any]]] = {
    "insert_run": lambda store, run, jobs: store.insert_run(make_run()),
    "insert_jobs": lambda store, run, jobs: store.insert_jobs(_never_started()),
    "claim_next_run": lambda store, run, jobs: store.claim_next_run(),
    "claim_runs": lambda store, run, jobs: store.claim_runs(5),
    "record_job_outcome": lambda store, run, jobs: store.record_job_outcome(
        run.id, JobOutcome(jobs[1].id, score=1.0)
    ),
    "record_job_outcomes": lambda store, run, jobs: store.record_job_outcomes(
        run.id, [JobOutcome(jobs[1].id, score=1.0), JobOutcome(jobs[2].id, error="x")]
    ),
    "migrate": lambda store, run, jobs: store.migrate(),
}


@pytest.mark.parametrize("method", sorted(WRITES))
async def test_each_write_is_refused_naming_it_and_the_file_is_unchanged(
    db_path: Path, method: str
) -> None:
    """Each write method raises ReadOnlyStoreError naming it and the fix; no byte changes."""
    run, jobs = await populate(db_path)
    before = digest(db_path)
    async with Store.connect(db_path, read_only=True) as store:
        runs, stored_jobs = await store.list_runs(), await store.list_jobs(run.id)
        with pytest.raises(ReadOnlyStoreError, match=rf"^{method}\(\) writes") as caught:
            await WRITES[method](store, run, jobs)
        assert "read_only=True" in str(caught.value)
        assert "connect again without read_only" in str(caught.value)
        assert str(db_path) in str(caught.value)
        assert not caught.value.retryable
        assert await store.list_runs() == runs  # the store still reads, and nothing moved
        assert await store.list_jobs(run.id) == stored_jobs
    assert digest(db_path) == before
    assert wal_is_empty(db_path)
    assert started == []
    await assert_sound(db_path)


async def test_a_write_that_slips_past_the_store_is_refused_by_sqlite(db_path: Path) -> None:
    """Even SQL run on the connection directly cannot write: mode=ro and query_only say no."""
    await populate(db_path)
    before = digest(db_path)
    async with Store.connect(db_path, read_only=True) as store:
        backend = store._backend
        assert backend is not None

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM runs")

        with pytest.raises(ControlError, match="read-only"):
            await backend.read(write)
        with pytest.raises(ReadOnlyStoreError):  # the backend's own guard
            await backend.write(write)
    assert digest(db_path) == before


async def test_connecting_read_only_changes_no_byte_of_a_rollback_journal_database(
    db_path: Path,
) -> None:
    """A database not in WAL mode stays so: read_only never switches the journal mode."""
    run, _ = await populate(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    before = digest(db_path)
    async with Store.connect(db_path, read_only=True) as store:
        assert await store.get_run(run.id) == run
    assert digest(db_path) == before
    assert not Path(f"{db_path}-wal").exists()
    with raw_db(db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)


# ---------------------------------------------------------------------------------------------
# Never created, never migrated


async def test_a_missing_file_is_refused_and_not_created(tmp_path: Path) -> None:
    """read_only=True on a path with no file: a ConfigurationError naming it; nothing created."""
    path = tmp_path / "missing.db"
    with pytest.raises(ConfigurationError, match=r"missing\.db.*no such file.*never creates"):
        await Store.connect(path, read_only=True)
    assert list(tmp_path.iterdir()) == []


async def test_a_path_with_no_file_says_why_and_never_speaks_of_creating(tmp_path: Path) -> None:
    """read_only=True where no file can be: a directory on the way missing, a symlink whose
    target is missing (its directory too), a name too long for a journal. Each is "no such
    file", naming the missing directory or the link's target, and never the advice of a connect
    that creates (create the directory, shorten the name); nothing is created."""
    link = tmp_path / "link.db"
    link.symlink_to(tmp_path / "nowhere" / "x.db")
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    for path, why in (
        (tmp_path / "a" / "b" / "x.db", f": directory '{tmp_path / 'a'}' does not exist ("),
        (link, f": it is a symlink to '{tmp_path / 'nowhere' / 'x.db'}', which does not exist ("),
        (tmp_path / ("b" * (longest - 1)), " (read_only=True never creates one)"),
    ):
        with pytest.raises(ConfigurationError) as caught:
            await Store.connect(path, read_only=True)
        message = str(caught.value)
        assert f"read-only: no such file{why}" in message, message
        assert "create it first" not in message
        assert "create the directory" not in message
        assert "give the database a name" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.db"]


async def test_an_empty_file_is_refused_as_unmigrated_and_stays_empty(tmp_path: Path) -> None:
    """An empty file has no schema to read: refused with version 0 named, still empty after."""
    path = tmp_path / "empty.db"
    path.touch()
    with pytest.raises(PendingMigrationError, match="no control_store migration") as caught:
        await Store.connect(path, read_only=True)
    newest, description = SHIPPED[-1]
    assert (caught.value.found, caught.value.needed) == (0, newest)
    assert caught.value.pending == tuple(SHIPPED)
    pending = ", ".join(f"{version} ({name})" for version, name in SHIPPED)
    assert f"needs migration {newest} ({description}); pending: {pending}" in str(caught.value)
    assert "without read_only" in str(caught.value)
    assert path.stat().st_size == 0


async def test_a_foreign_sqlite_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A SQLite file that is not a control_store database is refused as a writable connect
    refuses it, naming its tables, not as one that needs migrating (connecting without
    read_only would be refused too); its bytes stay."""
    path = tmp_path / "other.db"
    with raw_db(path) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
    before = digest(path)
    with pytest.raises(ConfigurationError, match="not a control_store database: it holds 'notes'"):
        await Store.connect(path, read_only=True)
    assert digest(path) == before


async def test_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    """A file that is not SQLite at all: the ConfigurationError a writable connect gives."""
    path = tmp_path / "garbage.db"
    path.write_bytes(b"not a database " * 100)
    with pytest.raises(ConfigurationError, match="not a SQLite database"):
        await Store.connect(path, read_only=True)
    assert path.read_bytes() == b"not a database " * 100


async def test_an_older_schema_is_refused_naming_both_versions(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database behind the library's newest migration: found, needed and the fix named."""
    await populate(db_path)
    with_second_migration(monkeypatch)
    before = digest(db_path)
    with pytest.raises(PendingMigrationError) as caught:
        await Store.connect(db_path, read_only=True)
    message = str(caught.value)
    newest, description = SHIPPED[-1]
    assert f"is at migration {newest} ({description})" in message
    assert f"needs migration {NEXT_VERSION} (add leases)" in message
    assert "connect once without read_only" in message
    assert f"release whose newest migration is {newest}" in message
    assert (caught.value.found, caught.value.needed) == (newest, NEXT_VERSION)
    assert digest(db_path) == before


async def test_a_newer_schema_is_refused_naming_both_versions(db_path: Path) -> None:
    """A database migrated by a newer release: its migration and this library's newest named."""
    with raw_db(db_path) as conn:
        conn.execute(f"INSERT INTO {TRACKING} VALUES (7, 'from the future', 'x', 1, x'00', 0)")
    before = digest(db_path)
    newest = SHIPPED[-1][0]
    with pytest.raises(UnknownMigrationError, match=rf"migration 7 .*only up to {newest}.*upgrade"):
        await Store.connect(db_path, read_only=True)
    assert digest(db_path) == before


# ---------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize("value", [1, 0, "yes", None, "True"])
async def test_read_only_must_be_a_bool(db_path: Path, value: object) -> None:
    """read_only that is not True or False is a ConfigurationError naming the value."""
    with pytest.raises(ConfigurationError, match=rf"read_only={value!r} must be True or False"):
        await Store.connect(db_path, read_only=value)  # type: ignore[arg-type]


async def test_read_only_contradicts_an_explicit_migrate(db_path: Path) -> None:
    """read_only=True with migrate=True is refused; with migrate=False it is fine."""
    with pytest.raises(ConfigurationError, match="migrate=True contradicts read_only=True"):
        await Store.connect(db_path, read_only=True, migrate=True)
    async with Store.connect(db_path, read_only=True, migrate=False) as store:
        assert store.read_only


async def test_read_only_takes_the_other_options(db_path: Path) -> None:
    """busy_timeout and synchronous are accepted, and still validated, beside read_only."""
    async with Store.connect(db_path, read_only=True, busy_timeout=0.5, synchronous="NORMAL"):
        pass
    with pytest.raises(ConfigurationError, match="busy_timeout"):
        await Store.connect(db_path, read_only=True, busy_timeout=-1)


@pytest.mark.parametrize(
    "connecting",
    [
        lambda: Store.in_memory(read_only=True),
        lambda: Store.connect("sqlite::memory:", read_only=True),
    ],
    ids=["in_memory", "connect"],
)
async def test_read_only_in_memory_is_refused(connecting: Callable[[], Awaitable[Store]]) -> None:
    """An in-memory database is new and empty: read_only=True there is a ConfigurationError."""
    with pytest.raises(ConfigurationError, match=r"in-memory database.*name an existing"):
        await connecting()


# ---------------------------------------------------------------------------------------------
# WAL: readers and a writer at once


async def test_a_writer_writes_while_a_read_only_store_holds_a_snapshot(db_path: Path) -> None:
    """WAL readers never block writers: another connection writes, at busy_timeout=0."""
    run, _ = await populate(db_path)
    async with (
        Store.connect(db_path, read_only=True) as reader,
        Store.connect(db_path, busy_timeout=0) as writer,
    ):
        backend = reader._backend
        assert backend is not None

        def count(conn: sqlite3.Connection) -> int:
            return int(conn.execute("SELECT count(*) FROM runs").fetchone()[0])

        def begin(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN")  # a read transaction, left open: the reader's snapshot
            return count(conn)

        def end(conn: sqlite3.Connection) -> None:
            conn.execute("COMMIT")

        assert await backend.read(begin) == 2
        late = make_run()
        # busy_timeout=0: had the reader's snapshot blocked the writer, these would raise.
        await writer.insert_run(late)
        claimed = await writer.claim_next_run()
        assert claimed is not None
        assert claimed.id == run.id
        assert await backend.read(count) == 2  # the snapshot still holds
        await backend.read(end)
        assert await reader.get_run(late.id) == late  # a new read sees the write
        stored = await reader.get_run(run.id)
        assert stored is not None
        assert stored.status is RunStatus.RUNNING
    await assert_sound(db_path)


# ---------------------------------------------------------------------------------------------
# Files and directories this process may not write (a worker without root's privileges)


def _read_in_worker(db: Path) -> list[str]:
    """What a worker that obeys permissions meets, opening ``db`` read-only: its line's words."""
    worker = Worker("read-only-runs", db)
    try:
        words = worker.line()
    finally:
        worker.stop()
    return words


async def _copy_with_sidecars(source: Path, directory: Path, *, keep: tuple[str, ...]) -> Path:
    """Copy ``source`` into ``directory`` while a store has it open with one run in its -wal.

    ``keep``: which of "-wal" and "-shm" to copy along. Returns the copy.
    """
    target = directory / source.name
    async with Store.connect(source) as store:
        await store.insert_run(make_run())  # lives in the -wal until a checkpoint
        for suffix in ("", *keep):
            shutil.copyfile(f"{source}{suffix}", f"{target}{suffix}")
    return target


def _lock(directory: Path) -> None:
    for path in directory.iterdir():
        path.chmod(0o444)
    directory.chmod(READ_ONLY_DIR)


def _unlock(directory: Path) -> None:
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


@pytest.mark.slow
@pytest.mark.usefixtures("permissions_obeyed")
async def test_a_read_only_file_in_a_writable_directory_is_read(db_path: Path) -> None:
    """A file this user may not write, in a directory they may: read; the file unchanged."""
    await populate(db_path)
    db_path.chmod(0o444)
    before = digest(db_path)
    try:
        words = _read_in_worker(db_path)
    finally:
        db_path.chmod(0o644)
    assert words == ["read", "2", "0"]
    assert digest(db_path) == before
    assert wal_is_empty(db_path)


@pytest.mark.slow
@pytest.mark.usefixtures("permissions_obeyed")
@pytest.mark.parametrize(
    ("keep", "runs"),
    [(("-wal", "-shm"), "3"), ((), None), (("-wal",), None), (("-shm",), None)],
    ids=["wal-and-shm", "neither", "wal-only", "shm-only"],
)
async def test_a_wal_database_in_a_read_only_directory(
    db_path: Path, tmp_path: Path, keep: tuple[str, ...], runs: str | None
) -> None:
    """In a directory it may not write, SQLite reads a WAL database only with both -wal and
    -shm beside it; otherwise the error says what to copy or where to put the copy."""
    await populate(db_path)
    directory = tmp_path / "media"
    directory.mkdir()
    copy = await _copy_with_sidecars(db_path, directory, keep=keep)
    _lock(directory)
    try:
        words = _read_in_worker(copy)
    finally:
        _unlock(directory)
    line = " ".join(words)
    if runs is not None:
        assert words == ["read", runs, "0"]  # the run that lived only in the -wal included
        return
    assert words[:2] == ["refused", "StorageError"], line
    for fragment in (
        "in WAL mode",
        "-shm and -wal files even to read it",
        str(directory),
        f"of the two, {' and '.join(keep) or 'neither'} is there",
        "Copy the database together with its -wal and -shm files",
        "a directory this process may write",
        "PRAGMA journal_mode=DELETE",
    ):
        assert fragment in line, (fragment, line)


@pytest.mark.slow
@pytest.mark.usefixtures("permissions_obeyed")
async def test_a_copy_out_of_wal_mode_is_read_in_a_read_only_directory(
    db_path: Path, tmp_path: Path
) -> None:
    """The fix the error offers: a copy switched to journal_mode=DELETE needs neither file."""
    await populate(db_path)
    directory = tmp_path / "media"
    directory.mkdir()
    copy = directory / "control.db"
    shutil.copyfile(db_path, copy)
    with raw_db(copy) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    _lock(directory)
    try:
        words = _read_in_worker(copy)
    finally:
        _unlock(directory)
    assert words == ["read", "2", "0"]
    assert sorted(p.name for p in directory.iterdir()) == ["control.db"]


async def test_a_rollback_journal_file_is_not_called_wal_when_its_read_fails(
    db_path: Path,
) -> None:
    """A read-only connect whose first read fails (a hot journal mode=ro cannot roll back) on a
    file in rollback-journal mode is not explained as a WAL file's missing -shm: the connect's
    own connection, on record from its open, is no other store of this process that put the
    file in WAL mode."""
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
        conn.execute("CREATE TABLE filler(x)")
        conn.execute("INSERT INTO filler VALUES (randomblob(100000))")
    journal = Path(f"{db_path}-journal")
    journal.write_bytes(b"\xd9\xd5\x05\xf9\x20\xa1\x63\xd7" + bytes(4096))  # a hot journal's header
    assert db_path.read_bytes()[18:20] == b"\x01\x01"
    with pytest.raises(ControlError) as refused:
        await Store.connect(db_path, read_only=True)
    assert "WAL mode" not in str(refused.value), str(refused.value)
