"""Worker processes for the multi-process, crash and fault tests.

Run as ``python tests/_workers.py MODE DATABASE [ARGS...]``. Each worker opens its own
``Store`` on the file, prints one line per acknowledged call (only after the call returned, and
flushed at once, so a line that reached the parent is a write the store acknowledged), and
reads ``go`` lines from stdin where a test must act between two steps. A worker that fails
prints its traceback to stderr and exits with status 1.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import resource
import signal
import sqlite3
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Final

from control_store import ControlError, EvalJob, Job, JobOutcome, Run, Store, _migrate, _sqlite

from _loops import use_requested_loop

# The versions the library ships, and the test-only heavy migration just after them.
SHIPPED: Final = [m.version for m in _migrate.load_migrations("sqlite")]
HEAVY_MIGRATION: Final = SHIPPED[-1] + 1
HEAVY_ROWS: Final = 200_000
PROGRESS_EVERY: Final = 1_000

# A second migration that takes long enough to be killed in the middle: it fills a table row
# by row, calling progress() (a function the opener registers) so the worker can announce how
# far it got. It exists only in these tests, after the migrations the library ships.
_HEAVY_SQL: Final = f"""
CREATE TABLE filler (i INTEGER NOT NULL, pad BLOB NOT NULL);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {HEAVY_ROWS})
INSERT INTO filler SELECT progress(i), randomblob(64) FROM n;
CREATE INDEX idx_filler_i ON filler (i);
"""


def say(*parts: object) -> None:
    """Print one line for the parent, at once."""
    print(*parts, flush=True)


def wait_go() -> None:
    """Block until the parent writes a line: the test's cue to take the next step."""
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the parent closed stdin before saying go")


_ORIGINAL_LOAD: Final = _migrate.load_migrations


def heavy_migrations(backend: str, directory: Path | None = None) -> list[_migrate.Migration]:
    """The library's migrations plus the heavy test one: a stand-in for load_migrations."""
    known = _ORIGINAL_LOAD(backend, directory)
    data = _HEAVY_SQL.encode()
    heavy = _migrate.Migration(
        version=HEAVY_MIGRATION,
        description="heavy filler",
        sql=_HEAVY_SQL,
        checksum=_migrate.checksum(data),
        path=Path(f"{HEAVY_MIGRATION:04d}_heavy_filler.sql"),
    )
    return [*known, heavy]


async def open_with_heavy_migration(db: str, on_progress: Callable[[int], None]) -> Store:
    """A store on ``db`` migrated with the library's migrations plus the heavy test one.

    The caller must have patched ``_migrate.load_migrations`` with ``heavy_migrations`` (the
    parent test does it with monkeypatch, ``migrate`` below for the worker).
    """
    store = await Store.connect(db, migrate=False)

    def progress(i: int) -> int:
        if i % PROGRESS_EVERY == 0:
            on_progress(i)
        return i

    backend = store._backend
    assert backend is not None
    await backend.read(lambda conn: conn.create_function("progress", 1, progress))
    await store.migrate()
    return store


# ---------------------------------------------------------------------------------------------
# Modes


async def claim(db: str) -> None:
    """Drain the queue: print every run this process claimed."""
    async with Store.connect(db) as store:
        say("ready")
        wait_go()
        while (run := await store.claim_next_run()) is not None:
            say("claimed", run.id)
    say("finished")


async def claim_batches(db: str, limit: str) -> None:
    """Drain the queue with claim_runs(limit), then report each claimed run's outcomes twice
    with record_job_outcomes: print every run claimed and every outcome newly recorded."""
    async with Store.connect(db) as store:
        say("ready")
        wait_go()
        while runs := await store.claim_runs(int(limit)):
            for run in runs:
                say("claimed", run.id)
                jobs = await store.list_jobs(run.id)
                twice = [JobOutcome(job.id, score=1.0) for job in jobs] * 2
                news = await store.record_job_outcomes(run.id, twice)
                for new, outcome in zip(news, twice, strict=True):
                    if new:
                        say("recorded", outcome.job_id)
    say("finished")


async def redeliver(db: str, run_id: str, seed: str) -> None:
    """Report every outcome of a run, in this process's own random order."""
    rng = random.Random(int(seed))
    async with Store.connect(db) as store:
        jobs = await store.list_jobs(uuid.UUID(run_id))
        rng.shuffle(jobs)
        say("ready")
        wait_go()
        for job in jobs:
            new = await store.record_job_outcome(job.run_id, JobOutcome(job.id, score=1.0))
            say("recorded", job.id, new)
    say("finished")


async def record_acked(db: str, run_id: str, tasks: str) -> None:
    """A record storm: ``tasks`` tasks record the run's outcomes; print each once acknowledged."""
    async with Store.connect(db) as store:
        jobs = await store.list_jobs(uuid.UUID(run_id))
        queue = iter(jobs)

        async def worker() -> None:
            for job in queue:
                await store.record_job_outcome(job.run_id, JobOutcome(job.id, output="ok"))
                say("ack", job.id)

        say("ready")
        await asyncio.gather(*(worker() for _ in range(int(tasks))))
    say("finished")


async def lose_wal(db: str, run_id: str, count: str, then: str) -> None:
    """Record ``count`` outcomes, printing each once acknowledged; then delete the -wal (a
    careless cleanup) and, as ``then`` says, try one more record ("write", printing what the
    store said), or read the run ("read"); or insert a new run, then delete it in the middle of
    an insert_jobs of its 4 jobs ("during", printing the run's id once that returned). Then
    wait for go (or a kill), close the store, and print "closed"."""
    wal = f"{db}-wal"
    async with Store.connect(db) as store:
        jobs = await store.list_jobs(uuid.UUID(run_id))
        for job in jobs[: int(count)]:
            await store.record_job_outcome(job.run_id, JobOutcome(job.id, output="ok"))
            say("ack", job.id)
        if then == "during":
            run = Run("late.yaml", ["m"], 1, 4)
            await store.insert_run(run)

            def late_jobs() -> Iterator[Job]:
                for index in range(4):
                    if index == 2:
                        os.unlink(wal)  # inside the insert's transaction: after its checks
                    yield Job(run.id, EvalJob("m", f"s{index}", 0))

            await store.insert_jobs(late_jobs())
            say("inserted", run.id)
        else:
            os.unlink(wal)
            if then == "read":
                await store.get_run(uuid.UUID(run_id))
                say("read")
            else:
                try:
                    await store.record_job_outcome(jobs[-1].run_id, JobOutcome(jobs[-1].id))
                    say("acked-without-wal", jobs[-1].id)
                except ControlError as exc:
                    say("refused", type(exc).__name__)
        wait_go()
    say("closed")


async def insert_runs_acked(db: str, tasks: str) -> None:
    """Insert runs forever from ``tasks`` tasks; print each id once acknowledged."""
    async with Store.connect(db) as store:

        async def worker() -> None:
            while True:
                run = Run("crash.yaml", ["m"], 1, 1)
                await store.insert_run(run)
                say("ack", run.id)

        say("ready")
        await asyncio.gather(*(worker() for _ in range(int(tasks))))


async def claim_acked(db: str, tasks: str) -> None:
    """Claim runs from ``tasks`` tasks; print each claimed id once acknowledged."""
    async with Store.connect(db) as store:

        async def worker() -> None:
            while (run := await store.claim_next_run()) is not None:
                say("ack", run.id)

        say("ready")
        await asyncio.gather(*(worker() for _ in range(int(tasks))))
    say("finished")


async def insert_jobs_big(db: str, run_id: str, count: str) -> None:
    """One insert_jobs call of ``count`` jobs, announcing progress from inside the batch."""
    n = int(count)
    run = uuid.UUID(run_id)

    def jobs() -> Iterator[Job]:
        for i in range(n):
            if i % PROGRESS_EVERY == 0:
                say("progress", i)
            yield Job(run, EvalJob("m", f"s{i}", 0))

    async with Store.connect(db) as store:
        await store.insert_jobs(jobs())
        say("inserted", n)


async def migrate(db: str) -> None:
    """Apply the heavy test migration, announcing progress from inside it."""
    _migrate.load_migrations = heavy_migrations
    store = await open_with_heavy_migration(db, lambda i: say("progress", i))
    await store.close()
    say("migrated")


def hold_lock(db: str) -> None:
    """Hold the database's write lock (BEGIN IMMEDIATE) until told to let go."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    say("locked")
    wait_go()
    conn.execute("ROLLBACK")
    conn.close()
    say("released")


# Linux capability numbers (linux/capability.h): what lets root ignore file permissions.
_CAP_DAC_OVERRIDE: Final = 1
_CAP_DAC_READ_SEARCH: Final = 2
_CAP_FOWNER: Final = 3
_CAPABILITY_VERSION_3: Final = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def obey_file_permissions() -> None:
    """Make this process subject to file permissions even as root.

    Root ignores permission bits through CAP_DAC_OVERRIDE (and friends); dropping them from
    this thread before any other starts makes a read-only file read-only for it too, which is
    what a user without those privileges meets. A no-op for other users.
    """
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    drop = (1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH) | (1 << _CAP_FOWNER)
    data[0].effective &= ~drop
    data[0].permitted &= ~drop
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


async def write_read_only(db: str) -> None:
    """Meet a read-only database: report the error, then connect and write once told to."""
    obey_file_permissions()
    try:
        store = await Store.connect(db)
    except ControlError as exc:
        say("refused", type(exc).__name__, exc.retryable, str(exc).replace("\n", " "))
    else:
        await store.close()
        say("opened")
        return
    wait_go()
    async with Store.connect(db) as store:
        run = Run("after-fix.yaml", ["m"], 1, 1)
        await store.insert_run(run)
        say("inserted", run.id)


async def read_only_runs(db: str) -> None:
    """Open the database read-only, as a user who may not write it: say what it holds or why not."""
    obey_file_permissions()
    try:
        async with Store.connect(db, read_only=True) as store:
            runs = await store.list_runs()
            problems = await store.check()
    except ControlError as exc:
        say("refused", type(exc).__name__, str(exc).replace("\n", " "))
    else:
        say("read", len(runs), len(problems))


def probe_permissions(path: str) -> None:
    """Say whether this process, as the workers run, may write the read-only file ``path``."""
    obey_file_permissions()
    try:
        with open(path, "ab"):
            pass
    except PermissionError:
        say("protected")
    else:
        say("writable")


async def write_past_file_size_limit(db: str, limit: str, count: str) -> None:
    """Meet a file size limit (a full small disk): report the error, retry once it is lifted."""
    # A write past RLIMIT_FSIZE raises SIGXFSZ, which kills by default; ignored, the write
    # fails with EFBIG or stops short, as on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    async with Store.connect(db) as store:
        run = Run("big.yaml", ["m"], 1, int(count))
        await store.insert_run(run)
        jobs = [Job(run.id, EvalJob("m", f"s{i}", 0)) for i in range(int(count))]
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
        try:
            await store.insert_jobs(jobs)
        except ControlError as exc:
            say("refused", type(exc).__name__, exc.retryable, str(exc).replace("\n", " "))
        else:
            say("inserted", len(jobs))
            return
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        await store.insert_jobs(jobs)
        say("inserted", len(jobs))
        say("run", run.id)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` with one file to its last byte, or to its last ``leave`` bytes; delete
    that file to free the space."""
    filler = disk / "filler"
    with filler.open("ab") as out:
        while True:
            stats = os.statvfs(disk)
            free = stats.f_bavail * stats.f_frsize
            if free <= leave:
                return filler
            try:
                out.write(b"\0" * (free - leave))
                out.flush()
            except OSError:  # ENOSPC: what was written is the room there was
                return filler


async def connect_at_each_free_level(disk: str, most: str, step: str) -> None:
    """Connect a new store on ``disk``, filled each time to leave 0, ``step``, 2 ``step``...
    up to ``most`` bytes free: say what each connect got (a process SIGBUS kills says no
    more), then connect once the space is freed."""
    place = Path(disk)
    for leave in range(0, int(most) + 1, int(step)):
        for path in place.iterdir():
            if path.is_file():
                path.unlink()
        fill(place, leave)
        try:
            async with Store.connect(place / "control.db"):
                pass
        except ControlError as exc:
            say("refused", leave, type(exc).__name__, exc.retryable, str(exc).replace("\n", " "))
        else:
            say("connected", leave)
    (place / "filler").unlink()
    async with Store.connect(place / "control.db") as store:
        await store.insert_run(Run("after.yaml", ["m"], 1, 1))
        say("freed", len(await store.check()))


# How many frames of -wal the first 32 KiB of the -shm indexes (SQLite's HASHTABLE_NPAGE_ONE):
# the commit that writes past it grows the -shm.
FIRST_INDEX_FRAMES: Final = 4062


async def commit_past_a_full_index(disk: str, how: str) -> None:
    """insert_jobs whose commit writes its frames into the -wal, on a disk left with no room for
    the -shm to grow past FIRST_INDEX_FRAMES (SQLITE_IOERR_SHMSIZE): one call ``alone``, or
    two of generators in one ``group`` (neither runs again alone after the group's COMMIT
    fails), or instead a ``migration`` (HEAVY_MIGRATION's version) at a second store's
    connect; or one alone whose void meets another connection's write lock, and is owed, then
    a claim that writes no page (``owed-claim``) or a close (``owed-close``); or the migration
    with its void owed (``owed-migration``), paid as its connect closes. Say how many jobs
    were acknowledged and what the refused calls got, then wait to be killed."""
    place = Path(disk)
    db = place / "control.db"
    owed = how.startswith("owed-")
    store = await Store.connect(db, busy_timeout=0.5 if owed else 5.0)
    run = Run("index.yaml", ["m"], 1, 1_000_000)
    await store.insert_run(run)
    claimed = await store.claim_next_run()  # so that the group's claim below finds none
    assert claimed is not None
    assert claimed.id == run.id
    # A read snapshot held from here on keeps the -wal from starting over: its frames only grow.
    pin = sqlite3.connect(db, isolation_level=None)
    pin.execute("BEGIN")
    pin.execute("SELECT count(*) FROM runs").fetchone()
    frame: int = pin.execute("PRAGMA page_size").fetchone()[0] + 24
    made = iter(range(10**9))
    acked = 0

    def frames() -> int:
        return (os.path.getsize(f"{db}-wal") - 32) // frame

    def jobs(count: int) -> Iterator[Job]:
        return (Job(run.id, EvalJob("m", f"s{next(made)}", 0)) for _ in range(count))

    async def insert(count: int) -> None:
        nonlocal acked
        await store.insert_jobs(list(jobs(count)))
        acked += count

    if owed:  # the void after the refusal meets another connection's write lock: owed
        holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        void = _sqlite.void_commit

        def locked_out(conn: sqlite3.Connection) -> bool:
            _sqlite.void_commit = void  # once
            holder.execute("BEGIN IMMEDIATE")
            try:
                return void(conn)
            finally:
                holder.execute("ROLLBACK")

        _sqlite.void_commit = locked_out

    async def attempt() -> list[BaseException | None]:
        if how.endswith("migration"):  # a second store's connect applies it, of about step frames
            sql = (
                "CREATE TABLE filler AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT "
                f"i + 1 FROM n WHERE i < {step}) SELECT randomblob(3900) AS b FROM n;\n"
            )
            extra = _migrate.Migration(
                HEAVY_MIGRATION, "filler", sql, _migrate.checksum(sql.encode()), Path("x.sql")
            )

            def with_extra(backend: str, directory: Path | None = None) -> list[_migrate.Migration]:
                return [*_ORIGINAL_LOAD(backend, directory), extra]

            _migrate.load_migrations = with_extra
            try:
                await Store.connect(db, busy_timeout=0.5 if owed else 5.0)
            except ControlError as exc:
                return [exc]
            finally:
                _migrate.load_migrations = _ORIGINAL_LOAD
            return [None]
        if how == "alone" or owed:
            return list(await asyncio.gather(insert(2_000), return_exceptions=True))
        # The claim finds no queued run and writes nothing; the two calls queue behind it.
        ahead = asyncio.ensure_future(store.claim_next_run())
        await asyncio.sleep(0)
        results = await asyncio.gather(
            *(store.insert_jobs(jobs(1_000)) for _ in range(2)), return_exceptions=True
        )
        assert await ahead is None
        return results

    before = frames()
    await insert(2_000)
    step = frames() - before
    while frames() + 2 * step < FIRST_INDEX_FRAMES:
        await insert(2_000)
    while frames() + step < FIRST_INDEX_FRAMES + 8:
        await insert(10)
    committed = frames()
    assert committed < FIRST_INDEX_FRAMES, (committed, step)
    say("acked", acked)
    # Room for the batch's frames (those of failed tries are there already) and ~16 KiB, less
    # than the 32 KiB the -shm grows by; a try that finds too little room (SQLITE_FULL) leaves
    # the rest to the next, with a little more.
    for slack in range(16, 96, 8):
        (place / "filler").unlink(missing_ok=True)
        tail = os.path.getsize(f"{db}-wal") - (32 + committed * frame)
        fill(place, max(0, step * frame - tail) + slack * 1024)
        errors = await attempt()
        if not any(errors):
            raise AssertionError(f"committed with {slack} KiB over its frames")
        if all(isinstance(e, ControlError) and "SQLITE_IOERR_SHMSIZE" in str(e) for e in errors):
            if owed:
                assert _sqlite.void_commit is void  # the lockout ran, and made the void owed
            if how == "owed-claim":  # a commit that writes no page: the run was claimed
                assert await store.claim_next_run() is None
            elif how == "owed-close":  # the disk still full: its checkpoint cannot be made
                await store.close()
            for error in errors:
                assert isinstance(error, ControlError)
                say("refused", type(error).__name__, error.retryable, str(error).replace("\n", " "))
            break
        assert all(isinstance(e, ControlError) and "SQLITE_FULL" in str(e) for e in errors), errors
    else:
        raise AssertionError("no try met a full -shm")
    wait_go()  # killed here: the test's kill -9


async def group_past_file_size_limit(db: str, limit: str, count: str) -> None:
    """A group commit whose one big insert_jobs carries the WAL past a file size limit at its
    COMMIT, with small writes grouped before and after it: say what each call got."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as in write_past_file_size_limit
    async with Store.connect(db) as store:
        big, small = Run("big.yaml", ["m"], 1, int(count)), Run("small.yaml", ["m"], 1, 1)
        for run in (big, small):
            await store.insert_run(run)
        (job,) = [Job(small.id, EvalJob("m", "s", 0))]
        await store.insert_jobs([job])
        jobs = [Job(big.id, EvalJob("m", f"s{i}", 0)) for i in range(int(count))]
        late = Run("late.yaml", ["m"], 1, 1)
        ahead = asyncio.ensure_future(store.insert_run(Run("ahead.yaml", ["m"], 1, 1)))
        await asyncio.sleep(0)  # the write in flight: the calls below queue into one group
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
        results = await asyncio.gather(
            store.record_job_outcome(small.id, JobOutcome(job.id, score=1.0)),
            store.insert_jobs(jobs),
            store.insert_run(late),
            return_exceptions=True,
        )
        await ahead
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        say("results", *(type(result).__name__ for result in results))
        say("late", late.id)


async def event_loop() -> None:
    """Print the module of the event loop this worker runs on (see _loops)."""
    print(type(asyncio.get_running_loop()).__module__, flush=True)


_MODES: Final[dict[str, Callable[..., Awaitable[None] | None]]] = {
    "event-loop": event_loop,
    "claim": claim,
    "claim-batches": claim_batches,
    "redeliver": redeliver,
    "record-acked": record_acked,
    "insert-runs-acked": insert_runs_acked,
    "claim-acked": claim_acked,
    "insert-jobs-big": insert_jobs_big,
    "migrate": migrate,
    "hold-lock": hold_lock,
    "lose-wal": lose_wal,
    "write-read-only": write_read_only,
    "write-past-file-size-limit": write_past_file_size_limit,
    "group-past-file-size-limit": group_past_file_size_limit,
    "connect-at-each-free-level": connect_at_each_free_level,
    "commit-past-a-full-index": commit_past_a_full_index,
    "read-only-runs": read_only_runs,
    "probe-permissions": probe_permissions,
}


def main(argv: list[str]) -> None:
    """Run the mode named by ``argv[0]`` with the rest as its arguments."""
    use_requested_loop()
    mode = _MODES[argv[0]]
    result = mode(*argv[1:])
    if asyncio.iscoroutine(result):
        asyncio.run(result)


if __name__ == "__main__":
    main(sys.argv[1:])
