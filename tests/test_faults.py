"""Faults from outside: a full disk, read-only files, a lock held elsewhere, a file pulled away.

Each must be a clear ControlError that says what happened and what to do, lose nothing that was
recorded before, and let the same call succeed once the cause is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from control_store import (
    ConfigurationError,
    ControlError,
    DatabaseBusyError,
    EvalJob,
    InvalidInputError,
    Job,
    JobOutcome,
    JobStatus,
    MissingRunError,
    Run,
    RunStatus,
    StorageError,
    Store,
    _sqlite,
)

from _workers import fill
from conftest import (
    CALL_TIMEOUT,
    SHIPPED,
    FailingStatements,
    Worker,
    assert_sound,
    group_in_flight,
    make_jobs,
    make_run,
    thread_held,
)

pytestmark = pytest.mark.slow


async def _execute(store: Store, sql: str) -> list[tuple[object, ...]]:
    """Run ``sql`` on the store's own connection (the only way to reach its per-connection
    settings, such as max_page_count, or an in-memory database)."""
    backend = store._backend
    assert backend is not None
    return await backend.read(lambda conn: conn.execute(sql).fetchall())


async def test_a_full_database_refuses_the_write_keeps_the_rest_and_accepts_the_retry(
    store: Store,
) -> None:
    """At the page limit a write is a retryable StorageError; earlier data stays; retry works."""
    run = make_run(job_count=3_003)
    before = make_jobs(run, 3)
    await store.insert_run(run)
    await store.insert_jobs(before)
    await store.record_job_outcome(run.id, JobOutcome(before[0].id, score=1.0))
    [(pages,)] = await _execute(store, "PRAGMA page_count")
    await _execute(store, f"PRAGMA max_page_count = {pages}")  # no room to grow
    batch = [job for job in make_jobs(run) if job.id not in {j.id for j in before}][:3_000]
    with pytest.raises(StorageError, match=r"is full.*free space and retry") as caught:
        await store.insert_jobs(batch)
    assert caught.value.retryable
    # Several writers at once (one group transaction) each get the error, and none is half-done.
    results = await asyncio.gather(
        *(store.insert_jobs(batch[i::4]) for i in range(4)), return_exceptions=True
    )
    assert all(isinstance(result, StorageError) for result in results)
    assert await store.list_jobs(run.id) == [
        msgspec.structs.replace(
            before[0], status="done", outcome=JobOutcome(before[0].id, score=1.0)
        ),
        *before[1:],
    ]
    await _execute(store, "PRAGMA max_page_count = 1073741823")  # the cause is gone
    await store.insert_jobs(batch)
    assert len(await store.list_jobs(run.id)) == 3_003
    assert await store.check() == []


def _sqlite_error(message: str, name: str, code: int) -> sqlite3.OperationalError:
    error = sqlite3.OperationalError(message)
    error.sqlite_errorname, error.sqlite_errorcode = name, code
    return error


async def test_a_rollback_that_fails_leaves_no_transaction_for_the_next_call(
    db_path: Path,
) -> None:
    """A write failing on a failing disk whose ROLLBACK fails too (an I/O error) is told its
    own error, not the ROLLBACK's; and the transaction the ROLLBACK left open, holding the
    failed call's rows and the write lock, is ended before the next call: a read does not see
    rows the caller was told were not written, and writes go on."""
    async with await Store.connect(db_path) as store:
        run = make_run(job_count=2)
        jobs = make_jobs(run)
        await store.insert_run(run)
        worker = store._connected()._worker
        worker.raw = FailingStatements(  # type: ignore[assignment]
            worker.raw,
            after={
                "INSERT INTO jobs": _sqlite_error("database or disk is full", "SQLITE_FULL", 13)
            },
            before={"ROLLBACK": _sqlite_error("disk I/O error", "SQLITE_IOERR", 10)},
        )
        with pytest.raises(StorageError, match="is full"):
            await store.insert_jobs(jobs)
        assert await store.get_job(jobs[0].id) is None
        assert await store.list_jobs(run.id) == []
        await store.insert_jobs(jobs)
        assert await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0))
        assert await store.check() == []
    async with await Store.connect(db_path) as store:
        assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]
        assert await store.check() == []


async def test_a_write_that_fills_the_database_fails_alone_in_its_group(db_path: Path) -> None:
    """One insert_jobs too big for the room left, grouped with small writes before and after
    it: SQLite rolls back the whole group's transaction, yet only that call fails; the others
    run again and commit, except an insert from a generator, consumed by its first run, which
    gets the error too (nothing of it written). A call that had failed on its own keeps its own
    error."""
    async with Store.connect(db_path) as store:
        run, big = make_run(job_count=4), make_run(job_count=20_000)
        for each in (run, big):
            await store.insert_run(each)
        jobs = make_jobs(run)
        await store.insert_jobs(jobs[:2])
        [(pages,)] = await _execute(store, "PRAGMA page_count")
        assert isinstance(pages, int)
        await _execute(store, f"PRAGMA max_page_count = {pages + 30}")  # room for small writes
        ahead = await group_in_flight(store)
        late = make_run()
        results = await asyncio.gather(
            store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0)),
            store.insert_jobs(job for job in jobs[2:3]),
            store.insert_jobs(job for job in make_jobs(make_run(), 1)),  # its run is missing
            store.insert_jobs(make_jobs(big)),
            store.insert_jobs(jobs[3:]),
            store.insert_run(late),
            return_exceptions=True,
        )
        await ahead
        recorded, generated, orphan, too_big, listed, inserted = results
        assert recorded is True
        assert isinstance(too_big, StorageError)
        assert isinstance(generated, StorageError)
        assert isinstance(orphan, MissingRunError)
        assert (listed, inserted) == (None, None)
        assert [job.id for job in await store.list_jobs(run.id)] == [
            jobs[0].id,
            jobs[1].id,
            jobs[3].id,
        ]
        assert await store.list_jobs(big.id) == []
        assert await store.get_run(late.id) == late
        await _execute(store, "PRAGMA max_page_count = 1073741823")
        assert await store.check() == []


async def test_a_file_size_limit_mid_write_is_a_storage_error_and_retry_succeeds(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A process that hits a file size limit (a full small disk) gets StorageError, then retries."""
    async with Store.connect(db_path) as store:
        earlier = make_run()
        await store.insert_run(earlier)
    worker = spawn("write-past-file-size-limit", db_path, 100_000, 5_000)
    refused = worker.expect("refused")
    assert refused[1:3] == ["StorageError", "True"]
    assert "free space" in " ".join(refused)
    assert worker.expect("inserted") == ["inserted", "5000"]
    run_id = worker.expect("run")[1]
    worker.finish()
    async with Store.connect(db_path) as store:
        assert await store.get_run(earlier.id) == earlier
        assert len(await store.list_jobs(uuid.UUID(run_id))) == 5_000
    await assert_sound(db_path)


def _mount_commands() -> tuple[str, str]:
    """The paths of mount and umount; the test skips where either is missing."""
    mount_command, umount_command = shutil.which("mount"), shutil.which("umount")
    if mount_command is None or umount_command is None:
        pytest.skip("no mount command here")
    return mount_command, umount_command


@contextlib.contextmanager
def _mounted(place: Path, *source: str, needs: str) -> Iterator[Path]:
    """``mount SOURCE... place`` (the test skips, saying it ``needs`` so, where that fails),
    unmounted after."""
    mount_command, umount_command = _mount_commands()
    place.mkdir()
    mounted = subprocess.run([mount_command, *source, str(place)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"no such mount here (it needs {needs})")
    try:
        yield place
    finally:
        subprocess.run([umount_command, "-l", str(place)], capture_output=True, check=False)


def _small_disk(place: Path, size: str) -> contextlib.AbstractContextManager[Path]:
    """A tmpfs of ``size`` mounted at ``place`` (root only; skips elsewhere)."""
    return _mounted(place, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", needs="root")


async def test_a_real_full_disk_refuses_each_write_whole_and_keeps_what_was_acked(
    tmp_path: Path,
) -> None:
    """A file system that is really full (ENOSPC from the kernel, not a page limit): each of
    64 concurrent records, a claim and a new store's connect is a retryable StorageError that
    says to free space, and changes nothing; a close() while full keeps every acknowledged
    write; once space is freed, the retried records each count once."""
    with _small_disk(tmp_path / "disk", "1m") as disk:
        db = disk / "control.db"
        store = await Store.connect(db)
        run = make_run(job_count=64)
        jobs = make_jobs(run)
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        assert await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0))
        filler = await asyncio.to_thread(fill, disk)
        outcomes = [JobOutcome(job.id, score=0.5, output="x" * 2_000) for job in jobs]
        results = await asyncio.gather(
            *(store.record_job_outcome(run.id, outcome) for outcome in outcomes[1:]),
            return_exceptions=True,
        )
        for result in results:
            assert isinstance(result, StorageError), result
            assert result.retryable
            assert "free space" in str(result), result
        with pytest.raises(StorageError, match="free space"):
            await store.claim_next_run()
        with pytest.raises(StorageError, match="free space"):
            await Store.connect(disk / "new.db")
        after = await store.get_run(run.id)
        assert after is not None
        assert (after.status, after.done_count) == (RunStatus.QUEUED, 1)
        await store.close()  # full: it cannot checkpoint, and loses nothing
        filler.unlink()
        async with Store.connect(db) as store:
            assert await store.check() == []
            again = await store.record_job_outcomes(run.id, outcomes)
            assert again == [False, *[True] * 63]
            done = await store.get_run(run.id)
            assert done is not None
            assert (done.status, done.done_count) == (RunStatus.DONE, 64)
        async with Store.connect(disk / "new.db") as fresh:
            assert await fresh.check() == []
        await assert_sound(db)


async def test_a_disk_with_no_room_for_the_shm_file_is_named_full(tmp_path: Path) -> None:
    """A new store on a disk with room for its file but not for its -shm (the WAL's index,
    32 KiB): SQLite says only "disk I/O error" (SQLITE_IOERR_SHMSIZE); the refusal says the
    disk is full, is retryable, and a retry once space is freed connects."""
    with _small_disk(tmp_path / "disk", "1m") as disk:
        filler = await asyncio.to_thread(fill, disk, 16 * 1024)
        with pytest.raises(StorageError) as caught:
            await Store.connect(disk / "control.db")
        assert caught.value.retryable
        message = str(caught.value)
        assert "SQLITE_IOERR_SHMSIZE" in message
        assert "is full: the disk has no room to grow its -shm file" in message
        assert message.endswith("nothing of this call was written: free space and retry")
        filler.unlink()
        async with Store.connect(disk / "control.db") as store:
            await store.insert_run(make_run())
            assert await store.check() == []


@pytest.mark.parametrize(
    "how", ["alone", "group", "migration", "owed-claim", "owed-close", "owed-migration"]
)
async def test_a_commit_refused_for_a_full_shm_stays_refused_after_a_kill(
    tmp_path: Path, spawn: Callable[..., Worker], how: str
) -> None:
    """SQLite writes a commit's frames into the -wal, fsyncs them, and only then indexes them
    in the -shm: where the -shm cannot grow (a full disk, SQLITE_IOERR_SHMSIZE), the call fails
    and readers never see it, but its frames are in the -wal, whole, and SQLite's recovery at
    the next open after a kill applied them (measured with sqlite3 alone). The store, told
    "nothing of this call was written", must make that so: a process killed after the refusal
    leaves the file without the refused jobs, with every acknowledged one: of a call alone,
    of two in a group whose COMMIT failed so (generators, which do not run again alone), and
    of a migration at a second store's connect. Where that void meets another connection's
    write lock, it is owed, and made before the store's next transaction (a claim that finds
    no run writes no page, and so voids nothing) or at its close (whose checkpoint, the disk
    still full, fails, which keeps the -wal for the next open's recovery); a migration's, at
    the close of the connect it failed."""
    with _small_disk(tmp_path / "disk", "40m") as disk:
        worker = spawn("commit-past-a-full-index", disk, how)
        acked = int(worker.expect("acked")[1])
        for _ in range(2 if how == "group" else 1):
            refused = worker.expect("refused")
            assert refused[1:3] == ["StorageError", "True"]
            assert "is full: the disk has no room to grow its -shm file" in " ".join(refused)
        worker.kill()
        (disk / "filler").unlink()
        async with Store.connect(disk / "control.db") as store:
            (run,) = await store.list_runs()
            assert len(await store.list_jobs(run.id)) == acked
            assert await store.check() == []
            assert [m.version for m in await store.migration_status()] == [v for v, _ in SHIPPED]
        await assert_sound(disk / "control.db")


# A disk that stops taking writes: once the file named by DEAD_DISK_ARMED exists, every
# fsync of the database's files (DEAD_DISK: a prefix of their paths) fails with EIO, and after
# the first so failed every pwrite too, as on a failing device or a network file system gone
# away. Built by gcc, and loaded by LD_PRELOAD into a process of its own.
_DEAD_DISK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>
static int fsync_failed = 0;
static int dead(int fd, int is_fsync) {
    const char *db = getenv("DEAD_DISK"), *armed = getenv("DEAD_DISK_ARMED");
    char link[64], path[4096];
    if (!db || !armed || access(armed, F_OK) != 0 || !(is_fsync || fsync_failed)) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    if (strncmp(path, db, strlen(db)) != 0) return 0;
    fsync_failed = 1;
    errno = EIO;
    return 1;
}
#define REAL(f) static __typeof__(&f) real; if (!real) real = dlsym(RTLD_NEXT, #f)
ssize_t pwrite64(int fd, const void *b, size_t c, off_t o) {
    REAL(pwrite64); return dead(fd, 0) ? -1 : real(fd, b, c, o);
}
ssize_t pwrite(int fd, const void *b, size_t c, off_t o) {
    REAL(pwrite); return dead(fd, 0) ? -1 : real(fd, b, c, o);
}
int fsync(int fd) { REAL(fsync); return dead(fd, 1) ? -1 : real(fd); }
int fdatasync(int fd) { REAL(fdatasync); return dead(fd, 1) ? -1 : real(fd); }
"""

# On that disk: a run stored, then the disk dies, and the next write's COMMIT fails at its
# fsync, its frames in the -wal and no void possible; then a kill, or a close. Either an
# insert_run alone, or ("group") two insert_jobs of generators, grouped behind a claim that
# finds no run and writes nothing: generators, which do not run again alone after the group.
_ON_A_DYING_DISK = """
import asyncio, os, signal, sys
from pathlib import Path
from control_store import ControlError, EvalJob, Job, Run, Store
def jobs(run, batch):
    return (Job(run.id, EvalJob("m", f"s{batch}-{i}", 0)) for i in range(2))
async def main(db, armed, then):
    store = await Store.connect(db)
    kept = Run("kept.yaml", ["m"], 1, 4)
    await store.insert_run(kept)
    if then == "group":
        assert (await store.claim_next_run()).id == kept.id
    Path(armed).touch()
    if then == "group":
        ahead = asyncio.ensure_future(store.claim_next_run())
        await asyncio.sleep(0)
        writes = [store.insert_jobs(jobs(kept, batch)) for batch in range(2)]
    else:
        writes = [store.insert_run(Run("refused.yaml", ["m"], 1, 1))]
    for exc in await asyncio.gather(*writes, return_exceptions=True):
        print("refused", type(exc).__name__, exc, flush=True)
    if then == "group":
        assert await ahead is None
    if then != "close":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        await store.close()
    except ControlError as exc:
        print("close", type(exc).__name__, exc, flush=True)
    else:
        print("closed", flush=True)
asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("then", ["kill", "close", "group"])
async def test_a_refused_call_whose_pages_cannot_be_voided_says_it_may_be_applied(
    tmp_path: Path, then: str
) -> None:
    """Where the disk refuses the void too (it takes no write at all any more), the pages of
    the call its COMMIT's fsync refused stay in the -wal, and the next open, after a kill or a
    close whose checkpoint failed, applies them: the call's error says it may be applied after
    all, and so does the close, which raises instead of returning as if all were well. In a
    group, so does each call whose write that COMMIT held, generators too (which do not run
    again alone, so only the group's failure can tell them)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc here, to build the LD_PRELOAD library that fails the disk")
    shim = tmp_path / "dead_disk.so"
    source = tmp_path / "dead_disk.c"
    source.write_text(_DEAD_DISK_SHIM, encoding="utf-8")
    build = [gcc, "-O2", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"]
    await asyncio.to_thread(subprocess.run, build, check=True)
    db = tmp_path / "control.db"
    armed = tmp_path / "armed"
    env = os.environ | {
        "LD_PRELOAD": str(shim),
        "DEAD_DISK": str(db),
        "DEAD_DISK_ARMED": str(armed),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _ON_A_DYING_DISK,
        str(db),
        str(armed),
        then,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    out, _ = await asyncio.wait_for(process.communicate(), CALL_TIMEOUT)
    lines = out.decode().splitlines()
    refusals = 2 if then == "group" else 1
    for line in lines[:refusals]:
        assert line.startswith("refused StorageError "), lines
        assert "SQLITE_IOERR_FSYNC" in line
        assert "could not be made yet" in line
        assert "the next open may apply this call after all" in line
    if then == "close":
        assert process.returncode == 0, lines
        assert lines[1].startswith("close StorageError "), lines
        assert "is closed, but" in lines[1]
        assert "may apply that call after all" in lines[1]
    else:
        assert (process.returncode, lines[refusals:]) == (-signal.SIGKILL, [])
    # What each said might happen did: the next open's recovery applied the refused writes.
    async with Store.connect(db) as store:
        runs = {run.manifest: run for run in await store.list_runs()}
        if then == "group":
            assert list(runs) == ["kept.yaml"]
            assert len(await store.list_jobs(runs["kept.yaml"].id)) == 4
        else:
            assert sorted(runs) == ["kept.yaml", "refused.yaml"]
        assert await store.check() == []
    await assert_sound(db)


# A new store's connect in a process whose files may not grow past 16 KiB (RLIMIT_FSIZE), less
# than the -shm's first 32 KiB; SIGXFSZ, which kills by default, ignored: the write fails.
_UNDER_A_FILE_SIZE_LIMIT = """
import asyncio, resource, signal, sys
from control_store import ControlError, Store
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
async def main():
    try:
        await Store.connect(sys.argv[1])
    except ControlError as exc:
        print(type(exc).__name__, exc.retryable, exc)
asyncio.run(main())
"""


async def test_a_shm_past_a_file_size_limit_names_the_limit(tmp_path: Path) -> None:
    """The -shm that cannot grow (SQLITE_IOERR_SHMSIZE) under a file size limit, on a disk with
    room: the refusal names the limit and its fix, not only a full disk."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _UNDER_A_FILE_SIZE_LIMIT,
        str(tmp_path / "control.db"),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), CALL_TIMEOUT)
    told = out.decode()
    assert told.startswith("StorageError True "), told
    assert "SQLITE_IOERR_SHMSIZE" in told
    assert "past this process's file size limit" in told
    assert "the limit (RLIMIT_FSIZE, ulimit -f) is 16384 bytes" in told
    assert "free space, or raise the limit, and retry" in told


def test_a_full_disk_of_4_kib_blocks_is_an_error_at_every_level_of_free_space(
    tmp_path: Path, spawn: Callable[..., Worker]
) -> None:
    """README's advice for a store's disk: on ext4 of 4 KiB blocks, a new store's connect
    with anything from 0 to 40 KiB free is a retryable full-disk StorageError (or connects),
    never a process killed by SIGBUS, as on 1 KiB blocks where SQLite's -shm pages, written
    through memory, outgrow what the file system allocated; once space is freed it connects."""
    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        pytest.skip("no mkfs.ext4 here")
    image = tmp_path / "ext4.img"
    with image.open("wb") as out:
        out.truncate(8 * 1024 * 1024)
    # -m 0: no blocks kept for root, who runs this test and would otherwise write into them.
    subprocess.run([mkfs, "-q", "-F", "-m", "0", "-b", "4096", str(image)], check=True)
    with _mounted(tmp_path / "disk", "-o", "loop", str(image), needs="root and a loop device"):
        assert os.statvfs(tmp_path / "disk").f_bsize == 4096
        worker = spawn("connect-at-each-free-level", tmp_path / "disk", 40 * 1024, 1024)
        outcomes = [worker.line() for _ in range(41)]
        assert worker.expect("freed") == ["freed", "0"]
        worker.finish()
    refused = [words for words in outcomes if words[0] == "refused"]
    assert [int(words[1]) for words in outcomes] == list(range(0, 40 * 1024 + 1, 1024))
    assert refused, outcomes  # 40 KiB is too little for a new store's schema and -wal
    for words in refused:
        assert words[2:4] == ["StorageError", "True"], words
        assert "is full" in " ".join(words), words
        assert " ".join(words).endswith("free space and retry"), words


async def test_a_group_whose_commit_meets_a_file_size_limit_fails_only_the_big_write(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A big insert_jobs carries the WAL past a file size limit at the group's COMMIT, where no
    single call met the error: each call runs again alone, so only the big one fails; the
    small writes grouped with it commit."""
    worker = spawn("group-past-file-size-limit", db_path, 200_000, 5_000)
    assert worker.expect("results") == ["results", "bool", "StorageError", "NoneType"]
    late = worker.expect("late")[1]
    worker.finish()
    async with Store.connect(db_path) as store:
        assert await store.get_run(uuid.UUID(late)) is not None
        runs = {run.manifest: run for run in await store.list_runs()}
        assert runs["small.yaml"].status == RunStatus.DONE
        assert await store.list_jobs(runs["big.yaml"].id) == []
    await assert_sound(db_path)


def _chmod_all(db: Path, mode: int) -> None:
    for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        if path.exists():
            path.chmod(mode)


async def test_a_read_only_file_is_refused_at_connect_and_connect_succeeds_once_writable(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A write-protected database is a retryable StorageError at connect; data stays intact."""
    async with Store.connect(db_path) as store:
        earlier = make_run()
        await store.insert_run(earlier)
    _chmod_all(db_path, 0o444)
    try:
        worker = spawn("write-read-only", db_path)
        refused = worker.expect("refused")
    finally:
        _chmod_all(db_path, 0o644)
    assert refused[1:3] == ["StorageError", "True"]
    line = " ".join(refused)
    assert "is read-only" in line
    assert "writable" in line
    worker.go()
    inserted = worker.expect("inserted")[1]
    worker.finish()
    async with Store.connect(db_path) as store:
        assert await store.get_run(earlier.id) == earlier
        assert [str(run.id) for run in await store.list_runs()] == [inserted, str(earlier.id)]
    await assert_sound(db_path)


@pytest.mark.parametrize("through_symlink", [False, True], ids=["path", "dangling-symlink"])
async def test_a_new_file_in_a_write_protected_directory_is_named_at_connect(
    tmp_path: Path, spawn: Callable[..., Worker], through_symlink: bool
) -> None:
    """A database to be created in a directory this user may not write (by its path, or by a
    symlink to a file yet to be made there) is a retryable StorageError naming the directory,
    with nothing created (SQLite says only "unable to open database file", which was passed on
    as a full or failing disk); connect succeeds once the directory is writable."""
    directory = tmp_path / "protected"
    directory.mkdir()
    db = directory / "new.db"
    if through_symlink:
        (tmp_path / "link.db").symlink_to(db)
        db = tmp_path / "link.db"
    directory.chmod(0o555)
    try:
        worker = spawn("write-read-only", db)
        refused = worker.expect("refused")
    finally:
        directory.chmod(0o755)
    line = " ".join(refused)
    assert refused[1:3] == ["StorageError", "True"], line
    assert f"its directory '{directory}' may not be written by this user" in line, line
    assert "free space" not in line
    assert list(directory.iterdir()) == []
    worker.go()
    worker.expect("inserted")
    worker.finish()
    await assert_sound(db)


async def test_a_new_file_on_a_read_only_mount_is_named_as_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory on a file system mounted read-only is not called a permission problem
    (access() refuses root there too): the refusal says the mount is read-only."""
    statvfs = os.statvfs
    place = str(tmp_path)

    def read_only_here(path: str) -> os.statvfs_result:
        found = statvfs(path)
        if path != place:
            return found
        fields = list(found)
        fields[8] |= os.ST_RDONLY  # f_flag
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", read_only_here)
    monkeypatch.setattr(_sqlite, "_may", lambda path, mode: path != place)
    with pytest.raises(StorageError) as caught:
        await Store.connect(tmp_path / "new.db")
    assert caught.value.retryable
    message = str(caught.value)
    assert f"its directory '{tmp_path}' is on a file system mounted read-only" in message
    assert "remount it read-write" in message
    assert "permission" not in message
    assert list(tmp_path.iterdir()) == []


async def test_an_existing_file_on_a_read_only_mount_is_named_as_that(tmp_path: Path) -> None:
    """A database on a file system mounted read-only (a bind mount remounted so), with and
    without the -wal and -shm a running store keeps: the refusal says the mount is read-only,
    not that this user may not write the files (root may) nor that the disk may be full."""
    mount_command, umount_command = _mount_commands()
    source = tmp_path / "source"
    source.mkdir()
    async with Store.connect(source / "control.db") as store:
        await store.insert_run(make_run())
    mount = tmp_path / "ro"
    mount.mkdir()

    def run(*args: str) -> bool:
        return subprocess.run(args, capture_output=True, check=False).returncode == 0

    if not await asyncio.to_thread(run, mount_command, "--bind", str(source), str(mount)):
        pytest.skip("no bind mount here (it needs root)")
    try:
        if not await asyncio.to_thread(run, mount_command, "-o", "remount,bind,ro", str(mount)):
            pytest.skip("no read-only remount here")
        async with Store.connect(source / "control.db") as running:  # its -wal and -shm
            await running.insert_run(make_run())
            for _ in range(2):
                with pytest.raises(StorageError) as caught:
                    await Store.connect(mount / "control.db")
                assert caught.value.retryable
                message = str(caught.value)
                assert "is on a file system mounted read-only" in message, message
                assert "remount it read-write" in message
                assert "may not write" not in message
                assert "free space" not in message
                await running.close()  # then without them
    finally:
        await asyncio.to_thread(run, umount_command, str(mount))


async def test_a_read_only_wal_and_shm_are_named_at_connect(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A writable database beside a -wal and -shm this user may not write (a read-only
    store made them with a read-only file's mode, or as another user): the refusal names what
    it may not write, where it said to make "the file, its -wal and -shm files and its
    directory" writable; once they are, the connect works."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    async with Store.connect(db_path, read_only=True):
        pass  # leaves an empty -wal and a -shm
    wal, shm = Path(f"{db_path}-wal"), Path(f"{db_path}-shm")
    for path in (wal, shm):
        path.chmod(0o444)
    try:
        worker = spawn("write-read-only", db_path)
        refused = worker.expect("refused")
    finally:
        for path in (wal, shm):
            path.chmod(0o644)
    assert refused[1:3] == ["StorageError", "True"]
    line = " ".join(refused)
    # The -shm at least (SQLite may have remade the empty -wal by then); never the database.
    assert re.search(
        rf"this user may not write ('{re.escape(str(wal))}' and )?'{re.escape(str(shm))}'; nothing",
        line,
    ), line
    worker.go()
    worker.expect("inserted")
    worker.finish()
    await assert_sound(db_path)


async def test_a_read_only_directory_is_refused_at_connect_and_connect_succeeds_once_writable(
    tmp_path: Path, template_db: Path, spawn: Callable[..., Worker]
) -> None:
    """A database in a write-protected directory is a retryable StorageError at connect."""
    directory = tmp_path / "locked"
    directory.mkdir()
    db = directory / "control.db"
    shutil.copyfile(template_db, db)
    async with Store.connect(db) as store:
        earlier = make_run()
        await store.insert_run(earlier)
    directory.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    try:
        worker = spawn("write-read-only", db)
        refused = worker.expect("refused")
    finally:
        directory.chmod(0o755)
    assert refused[1:3] == ["StorageError", "True"]
    assert "directory writable" in " ".join(refused)
    worker.go()
    worker.expect("inserted")
    worker.finish()
    async with Store.connect(db) as store:
        assert await store.get_run(earlier.id) == earlier
    await assert_sound(db)


async def test_a_lock_held_past_busy_timeout_is_retryable_and_reads_go_on(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """Another process holding the write lock makes writes a DatabaseBusyError, retried later."""
    async with Store.connect(db_path, busy_timeout=0.2) as store:
        earlier = make_run()
        await store.insert_run(earlier)
        holder = spawn("hold-lock", db_path)
        holder.expect("locked")
        late = make_run()
        with pytest.raises(DatabaseBusyError, match=r"busy_timeout=0\.2s.*retry") as caught:
            await store.insert_run(late)
        assert caught.value.retryable
        # A busy wait fails as well when the lock was free most of the time but other
        # connections kept winning it (SQLite's busy handler is not fair): the message must
        # not assert that one connection held it for the whole timeout.
        assert "held a lock on it for longer than" not in str(caught.value)
        assert "kept taking it in turn" in str(caught.value)
        results = await asyncio.gather(
            *(store.insert_run(make_run()) for _ in range(5)),
            store.claim_next_run(),
            return_exceptions=True,
        )
        assert all(isinstance(result, DatabaseBusyError) for result in results)
        assert await store.get_run(earlier.id) == earlier  # WAL: readers are never blocked
        holder.go()
        holder.expect("released")
        holder.finish()
        await store.insert_run(late)  # the same call, once the lock is free
        claimed = await store.claim_next_run()
        assert claimed is not None
        assert claimed.id == earlier.id
        assert await store.get_run(late.id) == late
        assert len(await store.list_runs()) == 2
        assert await store.check() == []


async def test_a_moved_file_refuses_writes_until_it_is_back(db_path: Path) -> None:
    """A database renamed away under a running store refuses writes, and accepts them once back."""
    async with Store.connect(db_path) as store:
        earlier = make_run()
        await store.insert_run(earlier)
        away = db_path.with_name("moved.db")
        db_path.rename(away)
        late = make_run()
        with pytest.raises(StorageError, match=r"deleted, moved or replaced.*retry") as caught:
            await store.insert_run(late)
        assert caught.value.retryable
        with pytest.raises(StorageError, match="moved"):
            await store.claim_next_run()
        away.rename(db_path)
        await store.insert_run(late)
        claimed = await store.claim_next_run()
        assert claimed is not None
        assert claimed.id == earlier.id
    async with Store.connect(db_path) as store:
        assert [run.id for run in await store.list_runs()] == [late.id, earlier.id]
        stored = await store.get_run(earlier.id)
        assert stored is not None
        assert stored.status is RunStatus.RUNNING
    await assert_sound(db_path)


async def test_each_caller_of_a_group_refused_whole_gets_an_error_of_its_own(
    db_path: Path,
) -> None:
    """A group refused as a whole (its file moved away) fails every caller in it: each with
    an error instance of its own, the same message and cause, so that one caller's traceback
    holds its own frames only, and a note one adds is not the others'."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=8)
        jobs = make_jobs(run)
        await store.insert_run(run, jobs=jobs)
        away = db_path.with_name("moved.db")
        ahead = await group_in_flight(store)
        db_path.rename(away)
        calls = [store.record_job_outcome(run.id, JobOutcome(job.id)) for job in jobs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        with contextlib.suppress(StorageError):
            await ahead
        away.rename(db_path)
        errors = [error for error in results if isinstance(error, StorageError)]
        assert len({id(error) for error in errors}) == len(errors) == 8, results
        assert len({str(error) for error in errors}) == 1
        assert all(error.retryable for error in errors)
        errors[0].add_note("the first caller's")
        assert not hasattr(errors[-1], "__notes__")
        assert [job.status for job in await store.list_jobs(run.id)] == [JobStatus.QUEUED] * 8


async def test_a_deleted_or_replaced_file_refuses_writes_until_restored(db_path: Path) -> None:
    """Deleting or replacing the file under a running store is a StorageError, not silent loss."""
    async with Store.connect(db_path) as store:
        earlier = make_run()
        await store.insert_run(earlier)
        backup = db_path.with_name("backup.db")
        os.link(db_path, backup)  # the same file under a second name: a perfect "backup"
        db_path.unlink()
        late = make_run()
        with pytest.raises(StorageError, match="deleted") as caught:
            await store.insert_run(late)
        # The fix it gives must work as written: a backup copied back is another file, which
        # this store never accepts (it said "restore it from a backup and retry", which then
        # failed on every retry), and a backup is to be restored only after the close.
        assert "restore it from a backup) and retry" not in str(caught.value)
        assert "before connecting again or restoring a backup over it" in str(caught.value)
        shutil.copyfile(backup, db_path)  # a different file at the same path
        with pytest.raises(StorageError, match="replaced"):
            await store.insert_run(late)
        os.replace(backup, db_path)  # the original file back in place
        await store.insert_run(late)
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("SELECT count(*) FROM runs").fetchone() == (2,)
    finally:
        raw.close()
    await assert_sound(db_path)


async def _closed_by_a_shutdown(store: Store, *, started: bool) -> None:
    """Close ``store`` as a shutdown that cancels every task does: its closer is cancelled
    while a write is still in flight, before its first step or while it waits (``started``),
    and the connection ends once that write is done."""
    backend = store._connected()
    async with thread_held(backend):
        write = asyncio.ensure_future(store.insert_run(make_run()))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0)
        closer = backend._closer
        assert closer is not None
        for _ in range(3 if started else 0):
            await asyncio.sleep(0)
        assert not closer.done()
        closer.cancel()
    with contextlib.suppress(StorageError):  # the file was replaced: the write is refused
        await write
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    await asyncio.to_thread(backend._conn._thread.join, CALL_TIMEOUT)
    assert not backend._conn._thread.is_alive()


async def _dropped_unclosed(store: Store) -> None:
    """Drop the caller's only other reference to ``store`` first (``del``); then collect it
    unclosed, as a forgotten close() leaves it, and wait for its worker to end."""
    conn = store._connected()._conn
    thread = conn._thread
    # The worker's last delivery ended first: the thread that settled the caller's last call
    # (and a failed call's error, whose traceback holds the store) may not yet have returned
    # from it when the GIL passes to this one. A call queued behind it runs after.
    await asyncio.wait_for(_sqlite.on_thread(conn, lambda: None), CALL_TIMEOUT)
    del conn
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del store
        # A pass of the loop first: the handle that resumed this task holds the future of the
        # caller's last call until then, and a failed call's error, through its traceback,
        # holds the store.
        await asyncio.sleep(0)
        gc.collect()
    assert [w.category for w in seen if "never closed" in str(w.message)] == [ResourceWarning]
    await asyncio.to_thread(thread.join, CALL_TIMEOUT)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    "closed_by",
    [
        "close()",
        "a shutdown before the close began",
        "a shutdown as it waits",
        "being dropped unclosed",
    ],
)
async def test_a_backup_moved_over_a_running_stores_file_is_sound_once_that_store_closes(
    db_path: Path, closed_by: str
) -> None:
    """A backup moved over the file under a running store, then that store closed, as its
    StorageError says, before connecting again (or by a shutdown that cancels every task, the
    store's closer too): the path opens the backup, sound and as it was. SQLite's close leaves
    the -wal of a moved file beside the path (it skips its checkpoint), and the next
    connection applied that log to the backup: a malformed file."""
    backup = db_path.with_name("backup.db")
    async with Store.connect(db_path) as store:
        kept = [make_run() for _ in range(5)]
        for run in kept:
            await store.insert_run(run, jobs=make_jobs(run))
    source = sqlite3.connect(db_path)
    target = sqlite3.connect(backup)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    store = await Store.connect(db_path)
    try:
        # Past a checkpoint (the file moves on from the backup), then more in the -wal.
        for _ in range(60):
            run = make_run(job_count=200)
            await store.insert_run(run, jobs=make_jobs(run))
        os.replace(backup, db_path)
        with pytest.raises(StorageError, match="before connecting again"):
            await store.insert_run(make_run())
        if closed_by.startswith("a shutdown"):
            await _closed_by_a_shutdown(store, started=closed_by.endswith("waits"))
    finally:
        if closed_by == "being dropped unclosed":
            dropped = _dropped_unclosed(store)
            del store
            await dropped
        else:
            await store.close()
    async with Store.connect(db_path) as store:
        assert sorted(run.id for run in await store.list_runs()) == sorted(r.id for r in kept)
    await assert_sound(db_path)


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
async def test_a_deleted_wal_or_shm_file_refuses_writes_and_close_keeps_what_was_acked(
    db_path: Path, suffix: str
) -> None:
    """Deleting the -wal or -shm file under a running store is a StorageError naming it, for a
    lone call and a group alike, with nothing written, where SQLite would go on acknowledging
    writes into an unlinked log (lost with the process) or beside a second index (two
    writers at once); closing the store keeps every write acknowledged before."""
    run = make_run(job_count=4)
    jobs = make_jobs(run)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        assert await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0))
        Path(f"{db_path}{suffix}").unlink()
        with pytest.raises(StorageError, match=rf"'{db_path}{suffix}'.*deleted.*close") as caught:
            await store.record_job_outcome(run.id, JobOutcome(jobs[1].id, score=1.0))
        assert not caught.value.retryable
        results = await asyncio.gather(
            *(store.record_job_outcome(run.id, JobOutcome(job.id)) for job in jobs[1:]),
            return_exceptions=True,
        )
        assert all(isinstance(result, StorageError) for result in results), results
        with pytest.raises(StorageError, match=suffix):
            await store.claim_next_run()
    async with Store.connect(db_path) as store:
        stored = await store.get_run(run.id)
        assert stored is not None
        assert (stored.status, stored.done_count) == (RunStatus.QUEUED, 1)
        assert [job.status for job in await store.list_jobs(run.id)] == [
            JobStatus.DONE,
            JobStatus.QUEUED,
            JobStatus.QUEUED,
            JobStatus.QUEUED,
        ]
    await assert_sound(db_path)


async def test_a_deleted_wal_is_found_through_a_symlinked_database_path(db_path: Path) -> None:
    """Opened through a symlink, the store watches the -wal SQLite names after the link's
    target, and refuses the write after that one is deleted."""
    link = db_path.with_name("link.db")
    link.symlink_to(db_path)
    async with Store.connect(link) as store:
        await store.insert_run(make_run())
        assert not Path(f"{link}-wal").exists()  # SQLite's files are the target's
        Path(f"{db_path}-wal").unlink()
        with pytest.raises(StorageError, match=rf"'{db_path}-wal'.*deleted"):
            await store.insert_run(make_run())


async def test_a_path_through_a_symlink_and_dotdot_watches_the_file_sqlite_opens(
    tmp_path: Path,
) -> None:
    """ "w/link/../x.db", link pointing to "a/b": the kernel and SQLite open "a/x.db", and so
    does the store's watch (a lexical abspath read it as "w/x.db": the connect was refused
    after SQLite had made its file, or, with an unrelated "w/x.db" there, the watch looked at
    that one and missed the -wal's loss)."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "link").symlink_to(tmp_path / "a" / "b")
    path = tmp_path / "w" / "link" / ".." / "x.db"
    async with Store.connect(str(path)) as store:
        await store.insert_run(make_run())
        assert (tmp_path / "a" / "x.db").is_file()
        (tmp_path / "w" / "x.db").write_bytes(b"")  # an unrelated file where abspath looks
        Path(tmp_path / "a" / "x.db-wal").unlink()
        with pytest.raises(StorageError, match=r"x\.db-wal'.*deleted"):
            await store.insert_run(make_run())


async def test_a_symlink_on_the_path_retargeted_under_the_store_refuses_writes(
    tmp_path: Path,
) -> None:
    """A directory symlink on the store's path pointed elsewhere while the store is open: the
    path now names another file, and writes are refused as for a replaced file; pointed
    back, they go on."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "a")
    async with Store.connect(link / "x.db") as store:
        await store.insert_run(make_run())
        async with Store.connect(tmp_path / "b" / "x.db"):  # a database at the new target
            pass
        link.unlink()
        link.symlink_to(tmp_path / "b")
        with pytest.raises(StorageError, match=r"deleted, moved or replaced"):
            await store.insert_run(make_run())
        link.unlink()
        link.symlink_to(tmp_path / "a")
        await store.insert_run(make_run())
        assert len(await store.list_runs()) == 2


async def test_a_lost_wal_beside_another_process_reading_does_not_hold_calls(
    db_path: Path,
) -> None:
    """With the -wal gone and another connection holding a read open, reads go on and a write
    is refused at once: the store's rescue never waits for that reader (a waiting checkpoint
    held every call for busy_timeout, here far longer than the hang guard)."""
    run = make_run()
    async with Store.connect(db_path, busy_timeout=CALL_TIMEOUT * 6) as store:
        await store.insert_run(run)
        reader = sqlite3.connect(db_path, isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM runs").fetchall()  # a snapshot, held
            Path(f"{db_path}-wal").unlink()
            assert await asyncio.wait_for(store.get_run(run.id), CALL_TIMEOUT) == run
            with pytest.raises(StorageError, match="-wal"):
                await asyncio.wait_for(store.insert_run(make_run()), CALL_TIMEOUT)
        finally:
            reader.close()
        assert await store.get_run(run.id) == run


async def test_a_lost_wal_is_never_copied_part_way_into_the_database_file(
    tmp_path: Path,
) -> None:
    """A new store's writes, all in the -wal, another connection's read open from between two
    of them, then the -wal deleted and a call made: the database file, as a kill would leave
    it without its log, is still sound (a checkpoint that read stopped part-way left it
    malformed). Closed, the store keeps both writes."""
    path = tmp_path / "fresh.db"
    first, second = make_run(job_count=3), make_run(job_count=3)
    store = await Store.connect(path)
    try:
        await store.insert_run(first, jobs=make_jobs(first))
        reader = sqlite3.connect(path, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM runs").fetchall()
        await store.insert_run(second, jobs=make_jobs(second))
        Path(f"{path}-wal").unlink()
        assert await store.get_run(first.id) == first
        with pytest.raises(StorageError, match="-wal"):
            await store.insert_run(make_run())
        reader.execute("ROLLBACK")
        reader.close()
        left = tmp_path / "as-a-kill-leaves-it.db"
        left.write_bytes(path.read_bytes())
        with contextlib.closing(sqlite3.connect(left)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        await store.close()
    async with Store.connect(path) as again:
        assert {run.id for run in await again.list_runs()} == {first.id, second.id}
    await assert_sound(path)


async def test_a_moved_wal_file_put_back_lets_writes_go_on(db_path: Path) -> None:
    """A -wal moved away refuses writes until it is back, as the database file does."""
    async with Store.connect(db_path) as store:
        earlier = make_run()
        await store.insert_run(earlier)
        wal = Path(f"{db_path}-wal")
        away = wal.with_name("moved-wal")
        wal.rename(away)
        with pytest.raises(StorageError, match="-wal"):
            await store.insert_run(make_run())
        away.rename(wal)
        late = make_run()
        await store.insert_run(late)
    async with Store.connect(db_path) as store:
        assert {run.id for run in await store.list_runs()} == {earlier.id, late.id}
    await assert_sound(db_path)


async def _another_process_reads_and_closes(db_path: Path) -> None:
    """A plain sqlite3 connection in another process reads the file and closes: the last
    connection to close, as SQLite sees it, if this process's locks were dropped."""
    reader = (
        "import sqlite3, sys; conn = sqlite3.connect(sys.argv[1]); "
        "conn.execute('SELECT count(*) FROM runs').fetchall(); conn.close()"
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", reader, str(db_path))
    assert await asyncio.wait_for(process.wait(), 60) == 0


async def test_a_second_store_in_a_process_keeps_the_first_ones_locks(db_path: Path) -> None:
    """Connecting a second store to a file this process has open never opens and closes the
    file (or its -wal or -shm) itself: closing any descriptor of a file drops every POSIX lock
    the process holds on it, and another process's connection closing next then took itself
    for the last and deleted the -wal and -shm under the open stores (a connect's check for an
    unreadable file did so for a while)."""
    first = await Store.connect(db_path)
    run = make_run()
    await first.insert_run(run)
    second = await Store.connect(db_path)
    await _another_process_reads_and_closes(db_path)
    assert Path(f"{db_path}-wal").exists()
    assert Path(f"{db_path}-shm").exists()
    later = make_run()
    await first.insert_run(later)  # refused as "-wal deleted" when the locks were dropped
    assert {r.id for r in await second.list_runs()} == {run.id, later.id}
    await second.close()
    await first.close()
    await assert_sound(db_path)


async def test_a_refused_read_only_open_keeps_this_process_s_locks(db_path: Path) -> None:
    """A read-only store refused on a hard link to a file a writable store of this process
    has open (its -wal and -shm cannot be opened beside the link): explaining the refusal
    reads the file's header, and that read never opens and closes the file (which drops the
    writable store's locks: another process's close then deleted its -wal and -shm)."""
    store = await Store.connect(db_path)
    await store.insert_run(make_run())
    elsewhere = db_path.parent / "elsewhere"
    elsewhere.mkdir()
    link = elsewhere / "link.db"
    os.link(db_path, link)
    for suffix in ("-wal", "-shm"):
        Path(f"{link}{suffix}").mkdir()  # no file SQLite can open
    with pytest.raises(ControlError):
        await Store.connect(link, read_only=True)
    await _another_process_reads_and_closes(db_path)
    assert Path(f"{db_path}-wal").exists()
    assert Path(f"{db_path}-shm").exists()
    await store.insert_run(make_run())  # refused as "-wal deleted" when the locks were dropped
    await store.close()
    await assert_sound(db_path)


async def test_connecting_where_a_running_stores_file_was_moved_away_is_refused(
    db_path: Path,
) -> None:
    """With the database file moved away under a running store, a second connect to the path
    (another process's "connect again") is refused: SQLite, creating a new file there, would
    delete the running store's -wal and share its -shm, and that store then read wrong rows and
    lost its writes when the file was put back (measured). Nothing is created meanwhile."""
    async with Store.connect(db_path) as store:
        earlier = make_run()
        await store.insert_run(earlier)
        away = db_path.with_name("moved.db")
        db_path.rename(away)
        with pytest.raises(ConfigurationError, match=r"no database file is there, but .*-wal"):
            await Store.connect(db_path)
        assert not db_path.exists()
        assert {run.id for run in await store.list_runs()} == {earlier.id}
        away.rename(db_path)
        late = make_run()
        await store.insert_run(late)
    async with Store.connect(db_path) as store:
        assert {run.id for run in await store.list_runs()} == {earlier.id, late.id}
    await assert_sound(db_path)


async def test_a_file_deleted_after_read_only_use_is_made_anew(db_path: Path) -> None:
    """A read-only store leaves an empty -wal and a -shm it may not delete; with the file
    then deleted (the demo's "delete the file"), a connect makes a new one: an empty -wal
    nobody has open holds nothing to lose (it was refused as a file deleted while open)."""
    async with Store.connect(db_path) as writer:
        await writer.insert_run(make_run())
    async with Store.connect(db_path, read_only=True) as reader:
        assert await reader.list_runs()
    assert Path(f"{db_path}-wal").stat().st_size == 0
    assert Path(f"{db_path}-shm").exists()
    db_path.unlink()
    async with Store.connect(db_path) as fresh:
        assert await fresh.list_runs() == []


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
async def test_an_empty_wal_of_a_running_store_still_refuses_a_new_file(db_path: Path) -> None:
    """A running store whose file was moved away, its -wal checkpointed empty: its -shm is
    still locked (in use), and a new file there would share it: refused all the same."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
        with contextlib.closing(sqlite3.connect(db_path)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert Path(f"{db_path}-wal").stat().st_size == 0
        away = db_path.with_name("moved.db")
        db_path.rename(away)
        with pytest.raises(ConfigurationError, match=r"no database file is there, but"):
            await Store.connect(db_path)
        away.rename(db_path)


# A store in another process: it writes a run, says so, and closes when its stdin says to.
_HOLDER = """
import asyncio, sys
from control_store import Run, Store
async def main():
    store = await Store.connect(sys.argv[1])
    await store.insert_run(Run("held", ["a"], 1, 1))
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await store.close()
asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def _another_process(script: str, path: Path, *args: str) -> AsyncIterator[int]:
    """A Python process running ``script`` on ``path`` (and ``args``), once it prints "ready",
    until its stdin says to end (it must exit 0); yields its pid."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        str(path),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    try:
        assert await asyncio.wait_for(holder.stdout.readline(), CALL_TIMEOUT) == b"ready\n"
        yield holder.pid
    finally:
        holder.stdin.write(b"\n")
        await holder.stdin.drain()
        assert await asyncio.wait_for(holder.wait(), CALL_TIMEOUT) == 0


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
@pytest.mark.parametrize("suffix", ["-shm", "-wal"])
async def test_connecting_while_another_processs_wal_or_shm_is_gone_is_refused(
    db_path: Path, suffix: str
) -> None:
    """Another process's store has the file open when its -shm (or -wal) is deleted: a connect
    here is refused, naming the file and the process. SQLite would make a new -shm beside the
    running store's deleted one, the two then wrote the file at once, and the first store's
    close() (the fault table's fix) left it "not a database"; with the -wal gone, every
    command failed as a disk fault to retry. After that store's close, the connect works, with
    every write of that store kept."""
    async with Store.connect(db_path) as store:
        mine = make_run()
        await store.insert_run(mine)
    async with _another_process(_HOLDER, db_path) as pid:
        Path(f"{db_path}{suffix}").unlink()
        with pytest.raises(ConfigurationError) as refused:
            await Store.connect(db_path)
        message = str(refused.value)
        assert f"'{db_path}{suffix}' is missing while process {pid} has the" in message
        assert "or that process has the file open under another name (a hard link" in message
        assert "close that process's store with await store.close()" in message
        assert not Path(f"{db_path}{suffix}").exists()  # nothing made anew
    async with Store.connect(db_path) as store:
        runs = await store.list_runs()
        assert mine in runs
        assert [run.manifest for run in runs].count("held") == 1
    await assert_sound(db_path)


@pytest.mark.parametrize("checkpointed", [False, True])
async def test_connecting_in_the_process_whose_store_lost_its_wal_is_refused(
    db_path: Path, checkpointed: bool
) -> None:
    """A store of this process has the file open when its -wal is deleted: a second connect
    here is refused too. SQLite shares the -shm between a process's connections, not the
    -wal: it made a new, empty log beside the deleted one, so the connect failed as a disk
    fault to retry (and the new file hid the fault from other processes), or, once everything
    was checkpointed, connected, wrote into the new log, and the first store's close() left
    the file malformed with every run lost. After that store's close, the connect works."""
    run = make_run(job_count=1_500 if checkpointed else 2)
    # 1,500 jobs of 3 kB: a commit past the 4 MiB autocheckpoint, so nothing is left unbackfilled
    jobs = [Job(run.id, EvalJob("m", f"{i}-" + "x" * 3_000, 0)) for i in range(run.job_count)]
    store = await Store.connect(db_path)
    try:
        await store.insert_run(run, jobs=jobs)
        Path(f"{db_path}-wal").unlink()
        with pytest.raises(ConfigurationError, match="is missing while a store of this process"):
            async with Store.connect(db_path):
                pass
        assert not Path(f"{db_path}-wal").exists()  # nothing made anew
    finally:
        await store.close()
    async with Store.connect(db_path) as store:
        assert len(await store.list_jobs(run.id)) == run.job_count
    await assert_sound(db_path)


# SQLite's shared lock on the file, as a connection holds it while it opens the file (before it
# makes the -wal and -shm), held for 0.3 s by a process held up there, then let go.
_OPENING = """
import fcntl, sys, time
f = open(sys.argv[1], "rb")
fcntl.lockf(f, fcntl.LOCK_SH, 510, 0x40000002)
print("ready", flush=True)
time.sleep(0.3)
fcntl.lockf(f, fcntl.LOCK_UN, 510, 0x40000002)
sys.stdin.readline()
"""


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
async def test_a_connect_beside_a_process_held_up_opening_the_file_waits_it_out(
    db_path: Path,
) -> None:
    """Another process holds SQLite's shared lock on a file closed cleanly (no -wal, no -shm),
    as a connection opening it does before it makes them, for 0.3 s (a busy machine held it
    there): that is no store running on deleted files, and the connect waits it out (it was
    refused after 0.1 s: a review saw 46 of 400 connects refused beside a process stopped for
    0.1 s in that window)."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    assert not Path(f"{db_path}-shm").exists()
    async with _another_process(_OPENING, db_path), Store.connect(db_path) as store:
        assert len(await store.list_runs()) == 1


# SQLite's shared lock on the file, held by a process stopped while it opens the file (SIGSTOP,
# a debugger), before it makes the -wal, or after (sys.argv[2]: "wal"), until its stdin says.
_STOPPED_OPENING = """
import fcntl, sys
f = open(sys.argv[1], "rb")
fcntl.lockf(f, fcntl.LOCK_SH, 510, 0x40000002)
if sys.argv[2:] == ["wal"]:
    open(sys.argv[1] + "-wal", "xb").close()
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
@pytest.mark.parametrize("made", ["", "wal"])
async def test_a_connect_beside_a_process_stopped_while_opening_the_file_goes_on(
    db_path: Path, made: str
) -> None:
    """Another process holds SQLite's shared lock on a file closed cleanly, as one stopped in
    its connect holds it, before it made the -wal or the -shm, for as long as it stays stopped:
    it has no -shm locked, so it runs on no deleted files, and the connect goes on beside it (a
    review's SIGSTOP there had every connect refused, after a second, as meeting files deleted
    under a running store, which nothing had deleted)."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    assert not Path(f"{db_path}-shm").exists()
    async with _another_process(_STOPPED_OPENING, db_path, made), Store.connect(db_path) as store:
        await store.insert_run(make_run())
        assert len(await store.list_runs()) == 2
        assert await store.check() == []
    await assert_sound(db_path)


# A raw sqlite3 connection in locking_mode=EXCLUSIVE in another process: in WAL mode it keeps
# its index in its own memory, with no -shm, and holds the file until its stdin says to close.
_EXCLUSIVE = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA locking_mode=EXCLUSIVE")
conn.execute("SELECT count(*) FROM runs").fetchall()
print("ready", flush=True)
sys.stdin.readline()
conn.close()
"""


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
async def test_a_process_holding_the_file_exclusively_is_busy_not_a_deleted_shm(
    db_path: Path,
) -> None:
    """Another process's connection in locking_mode=EXCLUSIVE has no -shm at all: a connect
    here meanwhile is DatabaseBusyError (retryable), never the refusal of a -shm deleted under
    a running store; after it closes, the connect works."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    async with _another_process(_EXCLUSIVE, db_path):
        assert not Path(f"{db_path}-shm").exists()
        with pytest.raises(DatabaseBusyError):
            await Store.connect(db_path, busy_timeout=0.1)
    async with Store.connect(db_path) as store:
        assert len(await store.list_runs()) == 1


# A process killed after a commit, before its close: its frames stay in the -wal.
_KILLED_AFTER_A_COMMIT = """
import os, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA user_version = 0")
os._exit(0)
"""


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
async def test_a_connect_behind_an_exclusive_lock_waits_busy_timeout_once(db_path: Path) -> None:
    """A -wal holding frames (a writer killed) while another process holds the file in
    locking_mode=EXCLUSIVE: the connect's look at the file on a read-only connection of its
    own waited busy_timeout, and the store's connection then as long again, under an error that
    told of one wait (a review measured 4 s at busy_timeout=2). One wait now."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    killed = [sys.executable, "-c", _KILLED_AFTER_A_COMMIT, str(db_path)]
    await asyncio.to_thread(subprocess.run, killed, check=True)
    assert Path(f"{db_path}-wal").stat().st_size > 0
    async with _another_process(_EXCLUSIVE, db_path):
        started = time.monotonic()
        with pytest.raises(DatabaseBusyError, match="busy_timeout=2s"):
            await Store.connect(db_path, busy_timeout=2)
        waited = time.monotonic() - started
    assert 2 <= waited < 3.5  # twice busy_timeout is 4
    async with Store.connect(db_path) as store:
        assert len(await store.list_runs()) == 1


def _protocol_error() -> sqlite3.OperationalError:
    """SQLite's SQLITE_PROTOCOL, as sqlite3 raises it (met for real only after SQLite's ~10 s
    wait, which a test cannot afford)."""
    failure = sqlite3.OperationalError("locking protocol")
    failure.sqlite_errorname = "SQLITE_PROTOCOL"
    return failure


async def test_a_connect_meeting_sqlite_protocol_waits_once(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLITE_PROTOCOL at the connect's look at a -wal left with writes: that ~10 s wait is not
    made again by the store's own connection (a review measured 20 s), as a busy one is not."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    killed = [sys.executable, "-c", _KILLED_AFTER_A_COMMIT, str(db_path)]
    await asyncio.to_thread(subprocess.run, killed, check=True)
    looks: list[str] = []

    def protocol(conn: sqlite3.Connection, database: str) -> None:
        looks.append(database)
        raise _protocol_error()

    monkeypatch.setattr(_sqlite, "_refuse_unfit", protocol)
    with pytest.raises(DatabaseBusyError, match="SQLITE_PROTOCOL"):
        await Store.connect(db_path)
    assert len(looks) == 1


# A store killed with its writes in the -wal (no close, so no checkpoint).
_KILLED_STORE = """
import asyncio, os, sys
from control_store import Run, Store
async def main():
    store = await Store.connect(sys.argv[1])
    for i in range(3):
        await store.insert_run(Run(f"kept-{i}", ["m"], 1, 1))
    os._exit(0)
asyncio.run(main())
"""

# A read-only connection that may not write the -shm (readonly_shm=1, as for another user's
# read_only store): opening the file with no other connection on it, it keeps the WAL's index
# in its own memory, locks no -shm, and reads the -wal it holds open.
_READER_WITHOUT_A_SHM = """
import sqlite3, sys
from pathlib import Path
conn = sqlite3.connect(Path(sys.argv[1]).as_uri() + "?mode=ro&readonly_shm=1", uri=True)
print(conn.execute("SELECT count(*) FROM runs").fetchone()[0], file=sys.stderr)
print("ready", flush=True)
sys.stdin.readline()
conn.close()
"""


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
async def test_a_reader_keeping_its_index_in_memory_keeps_moved_files_refused(
    db_path: Path, tmp_path: Path
) -> None:
    """A reader of another process that locks no -shm (its index in its own memory) runs on
    the -wal all the same: with the -wal and -shm moved away under it, a connect is refused as
    ever. Taken for a process still opening the file, it went on, found no schema in the file
    (the writes were in the moved -wal), and made one anew, which putting the files back, as
    the refusal says to, would then have met."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    killed = [sys.executable, "-c", _KILLED_STORE, str(db_path)]
    await asyncio.to_thread(subprocess.run, killed, check=True)
    aside = tmp_path / "aside"
    aside.mkdir()
    async with _another_process(_READER_WITHOUT_A_SHM, db_path):
        for suffix in ("-wal", "-shm"):
            Path(f"{db_path}{suffix}").rename(aside / f"control.db{suffix}")
        with pytest.raises(ConfigurationError, match="are missing while process"):
            await Store.connect(db_path)
        for suffix in ("-wal", "-shm"):
            (aside / f"control.db{suffix}").rename(f"{db_path}{suffix}")
    async with Store.connect(db_path) as store:
        assert len(await store.list_runs()) == 4
    await assert_sound(db_path)


async def test_an_owed_void_is_made_in_the_next_transaction_waiting_once(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A void owed since a COMMIT failed (its lock was held then) is made inside the next write
    transaction, under its lock: behind another process's lock the call waits busy_timeout
    once (a void of its own first waited, then the call as long again), and a claim that finds
    no run, which writes no page, makes it all the same."""
    store = await Store.connect(db_path, busy_timeout=0.3)
    backend = store._backend
    assert backend is not None
    await store.insert_run(make_run())
    assert await store.claim_next_run() is not None
    begins: list[str] = []

    def trace(sql: str) -> None:
        if sql.startswith("BEGIN"):
            begins.append(sql)

    def owed() -> bool:
        assert backend is not None
        return backend._worker.owed_void

    await backend.read(lambda conn: conn.set_trace_callback(trace))
    backend._worker.owed_void = True
    holder = spawn("hold-lock", db_path)
    holder.expect("locked")
    with pytest.raises(DatabaseBusyError):
        await store.insert_run(make_run())
    assert begins == ["BEGIN IMMEDIATE"]
    assert owed()
    holder.go()
    holder.expect("released")
    holder.finish()
    wal = Path(f"{db_path}-wal")
    before = wal.stat().st_size
    assert await store.claim_next_run() is None
    assert not owed()
    assert wal.stat().st_size > before  # a frame: user_version written over the failed commit
    await backend.read(lambda conn: conn.set_trace_callback(None))
    await store.close()


class _FullAtGroupCommit:
    """A store's sqlite3 connection, but the COMMIT of its first group (a transaction with a
    savepoint) fails as on a full disk (SQLITE_FULL, the transaction rolled back), and another
    connection, ``holder``, then takes the write lock. Counts the BEGINs tried."""

    def __init__(self, raw: sqlite3.Connection, holder: sqlite3.Connection) -> None:
        self.raw = raw
        self.holder = holder
        self.grouped = False
        self.failed = False
        self.begins = 0

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.startswith("BEGIN"):
            self.begins += 1
        self.grouped = self.grouped or sql.startswith("SAVEPOINT")
        if sql == "COMMIT" and self.grouped and not self.failed:
            self.failed = True
            self.raw.execute("ROLLBACK")
            self.holder.execute("BEGIN IMMEDIATE")
            full = sqlite3.OperationalError("database or disk is full")
            full.sqlite_errorname = "SQLITE_FULL"
            raise full
        return self.raw.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


async def test_a_group_whose_commit_failed_waits_for_a_held_lock_once(db_path: Path) -> None:
    """After a group's COMMIT fails (a full disk), its calls run again, each alone; with
    another process holding the write lock by then, the first to wait busy_timeout for it is
    told so, and so is every other, at once: each waited busy_timeout in turn, 64 callers over
    five minutes at the default. Retried once the lock is free, each counts once."""
    store = await Store.connect(db_path, busy_timeout=0.2)
    backend = store._connected()
    run = make_run(job_count=5)
    jobs = make_jobs(run)
    await store.insert_run(run, jobs=jobs)
    holder = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    worker = backend._worker
    raw = worker.raw
    faulty = _FullAtGroupCommit(raw, holder)
    worker.raw = cast(sqlite3.Connection, faulty)
    try:
        async with thread_held(backend):  # the first call alone, then the other four grouped
            calls = [
                asyncio.ensure_future(store.record_job_outcome(run.id, JobOutcome(job.id)))
                for job in jobs
            ]
            await asyncio.sleep(0)
        results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        worker.raw = raw
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
    assert faulty.failed
    assert results[0] is True
    assert all(isinstance(r, DatabaseBusyError) and r.retryable for r in results[1:]), results
    assert len({id(r) for r in results[1:]}) == 4  # each caller its own instance
    assert faulty.begins == 3  # the lone call's, the group's, and one run again alone
    assert [await store.record_job_outcome(run.id, JobOutcome(job.id)) for job in jobs] == [
        False,
        *[True] * 4,
    ]
    stored = await store.get_run(run.id)
    assert stored is not None
    assert stored.done_count == 5
    await store.close()


def test_a_close_after_the_opening_loop_ended_makes_an_owed_void(db_path: Path) -> None:
    """close() from another loop than the one that opened the store (its asyncio.run ended)
    makes an owed void too, as a close on the store's own loop does."""

    async def opened() -> Store:
        store = await Store.connect(db_path)
        await store.insert_run(make_run())
        return store

    store = asyncio.run(opened())
    backend = store._backend
    assert backend is not None
    backend._worker.owed_void = True
    asyncio.run(store.close())
    assert not backend._worker.owed_void


async def test_a_store_dropped_unclosed_makes_an_owed_void(db_path: Path) -> None:
    """A store collected without close() (a forgotten close, an exception that skipped it)
    makes an owed void before its connection ends, as close() does: SQLite's own close keeps
    the -wal where its checkpoint fails (a full disk), and the next open's recovery would apply
    the frames of a commit its caller was told had failed."""
    store = await Store.connect(db_path)
    await store.insert_run(make_run())
    worker = store._connected()._worker
    worker.owed_void = True
    dropped = _dropped_unclosed(store)
    del store
    await dropped
    assert not worker.owed_void


async def test_a_connect_keeps_the_locks_of_this_processs_own_sqlite3_connection(
    tmp_path: Path,
) -> None:
    """A plain sqlite3 connection of the caller's holds a read transaction on a file that has
    no -wal or -shm (a rollback-journal database): a connect to it (refused here: it is no
    control_store database) never opens and closes the file itself, which dropped that
    connection's lock, and another process then wrote under its open read transaction."""
    path = tmp_path / "theirs.db"
    mine = sqlite3.connect(path, isolation_level=None)
    try:
        mine.execute("CREATE TABLE t (x)")
        mine.execute("INSERT INTO t VALUES (1)")
        mine.execute("BEGIN")
        assert mine.execute("SELECT x FROM t").fetchall() == [(1,)]
        with pytest.raises(ConfigurationError, match="not a control_store database"):
            await Store.connect(path)
        writer = (
            "import sqlite3, sys; conn = sqlite3.connect(sys.argv[1], timeout=0.2); "
            "conn.execute('UPDATE t SET x = 2'); conn.commit()"
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", writer, str(path), stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(process.communicate(), CALL_TIMEOUT)
        assert process.returncode != 0  # the read transaction's lock held it off
        assert b"database is locked" in err
        assert mine.execute("SELECT x FROM t").fetchall() == [(1,)]
    finally:
        mine.close()


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
async def test_a_shared_flock_on_a_closed_database_is_no_store_holding_it(db_path: Path) -> None:
    """Another process holds a shared flock(2) on a database closed cleanly (no -wal, no
    -shm): that is no SQLite connection, and a connect works (it was refused as a -wal and -shm
    deleted under a running store)."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    assert not Path(f"{db_path}-shm").exists()
    flocking = (
        "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); "
        "print('ready', flush=True); sys.stdin.readline()"
    )
    async with _another_process(flocking, db_path), Store.connect(db_path) as store:
        assert len(await store.list_runs()) == 1


async def test_a_hard_link_to_a_file_a_store_here_has_open_is_refused(db_path: Path) -> None:
    """A second store of this process on another name of the same file (a hard link): SQLite
    names the -wal after the name opened, and shares the -shm by the file, so the two kept two
    logs of one file, and reads failed (SQLITE_IOERR_SHORT_READ). Refused, naming the open
    name, read-only too; the open store goes on, and the same name connects."""
    link = db_path.with_name("link.db")
    os.link(db_path, link)
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
        for read_only in (False, True):
            with pytest.raises(ConfigurationError) as caught:
                await Store.connect(link, read_only=read_only)
            message = str(caught.value)
            assert f"same file open under another name, '{db_path}' (a hard link)" in message
            assert "connect with the name the open store uses" in message
        async with Store.connect(db_path) as again:
            assert len(await again.list_runs()) == 1
        await store.insert_run(make_run())
    await assert_sound(db_path)


async def test_a_store_on_a_renamed_directory_of_an_open_file_is_no_other_name(
    tmp_path: Path,
) -> None:
    """The directory of a file a store has open renamed meanwhile: a second store on the new
    path leads SQLite to the same -wal and -shm (by the directory, not its path), so it is no
    hard link to refuse, and the two see each other's writes."""
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    async with Store.connect(before / "x.db") as store:
        await store.insert_run(make_run())
        before.rename(after)
        async with Store.connect(after / "x.db") as again:
            await again.insert_run(make_run())
            assert len(await store.list_runs()) == 2
    await assert_sound(after / "x.db")


@pytest.mark.parametrize("meanwhile", ["deleted", "created"])
async def test_a_shm_deleted_or_made_while_connect_looks_at_it_is_not_unreadable(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """Another process's last store closes, deleting the -wal and -shm, or its connect makes
    them, between a connect's looks at each (is it there, may this user read it): that is no
    unreadable file (it was refused so, about once in 500 connects beside a process connecting
    and closing in a loop), and the connect works."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    shm = Path(f"{db_path}-shm")
    if meanwhile == "deleted":
        async with Store.connect(db_path, read_only=True):
            pass  # a read-only store leaves an empty -wal and a -shm behind
        assert shm.exists()
    else:
        assert not shm.exists()
    asked = os.access

    def changed_meanwhile(path: object, mode: int, **kwargs: Any) -> bool:
        if str(path) == str(shm):
            if meanwhile == "deleted" and shm.exists():
                shm.unlink()  # the other process's last close, before this question
            elif meanwhile == "created" and not shm.exists():
                shm.touch()  # the other process's connect, just after this question
                return False
        return asked(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", changed_meanwhile)
    async with Store.connect(db_path) as store:
        monkeypatch.undo()
        assert len(await store.list_runs()) == 1


async def test_a_file_another_process_creates_meanwhile_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database is made by another process's connect between this one's look at the
    path and at its -wal and -shm: that is a new database, not one deleted while open."""
    db_path = tmp_path / "new.db"
    looked = os.path.lexists

    def racing(path: str) -> bool:
        if path.endswith("-wal") and not looked(db_path):
            other = sqlite3.connect(db_path)  # as a store's connect begins: WAL, no table
            other.execute("PRAGMA journal_mode=WAL")
            other.execute("SELECT count(*) FROM sqlite_schema").fetchall()  # makes -wal, -shm
            holder.append(other)  # open: its -wal and -shm stay
        return looked(path)

    holder: list[sqlite3.Connection] = []
    monkeypatch.setattr(os.path, "lexists", racing)
    async with Store.connect(db_path) as store:
        monkeypatch.undo()
        assert holder  # the race was run
        assert await store.list_runs() == []
    for conn in holder:
        conn.close()


async def test_a_deleted_file_is_not_made_anew_over_its_wal_and_shm(db_path: Path) -> None:
    """A file deleted under a running store: connecting to the path is refused while that
    store's -wal and -shm are there (a new file would take them over), before and after the
    store closes (SQLite leaves both behind a deleted file), and the refusal says what to do;
    with them deleted as it says, a connect makes a new file."""
    store = await Store.connect(db_path)
    await store.insert_run(make_run())
    db_path.unlink()
    for _ in range(2):
        with pytest.raises(ConfigurationError) as refused:
            await Store.connect(db_path)
        message = str(refused.value)
        assert "was deleted or moved while a process had it open" in message
        assert "put the database file back" in message
        assert f"delete '{db_path}-wal' and '{db_path}-shm'" in message
        assert not db_path.exists()
        await store.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{db_path}{suffix}").unlink()
    async with Store.connect(db_path) as fresh:
        assert await fresh.list_runs() == []


async def test_a_text_longer_than_sqlite_keeps_is_invalid_input(store: Store) -> None:
    """A value over SQLite's length limit is an InvalidInputError saying so, and nothing of the
    call is written (the limit is lowered here: the default is a gigabyte)."""
    backend = store._backend
    assert backend is not None
    await backend.read(lambda conn: conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 10_000))
    run = make_run(job_count=1)
    await store.insert_run(run)
    [job] = make_jobs(run)
    await store.insert_jobs([job])
    big = JobOutcome(job.id, output="x" * 20_000)
    size = len(msgspec.json.encode(big))
    with pytest.raises(InvalidInputError) as caught:
        await store.record_job_outcome(run.id, big)
    named = f"the outcome of job {job.id}, {size:,} characters as stored (its output, error"
    assert str(caught.value).startswith(named), caught.value
    assert "longer than SQLite keeps" in str(caught.value)
    assert "SQLITE_TOOBIG" in str(caught.value)
    with pytest.raises(InvalidInputError) as caught:  # the batch names the outcome by place
        await store.record_job_outcomes(run.id, [JobOutcome(job.id), big])
    assert str(caught.value).startswith(f"outcomes[1]: {named}"), caught.value
    # A run's too: named by its id and the field too long, alone and with its jobs.
    for long_run in (Run("m" * 20_000, ["a"], 1, 1), Run("m", ["a" * 20_000], 1, 1)):
        column = "manifest" if len(long_run.manifest) > 1 else "models"
        for jobs_of_it in (None, make_jobs(long_run)):
            with pytest.raises(InvalidInputError) as caught:
                await store.insert_run(long_run, jobs=jobs_of_it)
            named = f"run {long_run.id}: its {column}, "
            assert str(caught.value).startswith(named), caught.value
            assert "longer than SQLite keeps" in str(caught.value)
        assert await store.get_run(long_run.id) is None
    # The field named is the one too long in bytes, as SQLite counts, not in characters: a
    # manifest of 6,000 ASCII characters fits, models of 4,000 CJK characters (12,000 bytes)
    # do not.
    wide = Run("m" * 6_000, ["\u65e5" * 4_000], 1, 1)
    with pytest.raises(InvalidInputError) as caught:
        await store.insert_run(wide)
    assert str(caught.value).startswith(f"run {wide.id}: its models, "), caught.value
    # A job's too: named by its place in the batch and its id, as an outcome is.
    other = make_run(job_count=3)
    await store.insert_run(other)
    fine, huge = make_jobs(other, 2)
    huge = msgspec.structs.replace(huge, spec=EvalJob("a", "x" * 20_000, 0))
    for jobs in ([fine, huge], iter([fine, huge])):
        with pytest.raises(InvalidInputError) as caught:
            await store.insert_jobs(jobs)
        assert str(caught.value).startswith(f"jobs[1]: job {huge.id}, its spec "), caught.value
        assert "longer than SQLite keeps" in str(caught.value)
    assert await store.list_jobs(other.id) == []
    assert await store.get_job(job.id) == job
    assert len(await store.list_runs()) == 2


def test_a_text_over_two_gigabytes_is_invalid_input() -> None:
    """sqlite3's own refusal to bind a text of over 2**31 - 1 bytes (an OverflowError, which a
    test cannot afford to provoke) is translated like SQLite's length limit."""
    error = _sqlite.translate(
        OverflowError("string longer than INT_MAX bytes"), database="db", busy_timeout=5
    )
    assert isinstance(error, InvalidInputError)
    assert "longer than SQLite keeps" in str(error)
    assert isinstance(error.__cause__, OverflowError)


def test_a_lock_on_the_wal_index_held_past_sqlites_wait_is_busy() -> None:
    """SQLITE_PROTOCOL: SQLite waited its ~10 s, whatever busy_timeout is, for the lock on the
    -shm that a connection rebuilding the WAL's index holds (a review's process stopped there,
    SIGSTOP). Lock contention, retryable, told as such; it was "an error this release does not
    expect". (Met for real only after those 10 s, which a test cannot afford.)"""
    error = _sqlite.translate(_protocol_error(), database="database 'x.db'", busy_timeout=5)
    assert isinstance(error, DatabaseBusyError)
    assert error.retryable
    message = str(error)
    assert message.startswith("database 'x.db' is locked: another connection held the lock")
    assert "[locking protocol (SQLITE_PROTOCOL)]" in message
    assert "kill -CONT PID" in message
    assert message.endswith("then retry the call")


async def test_a_deleted_file_behind_a_symlink_is_not_made_anew(db_path: Path) -> None:
    """A store opened through a symlink whose target is then deleted: connecting through the
    same (now dangling) symlink is refused as through the target's own path (the symlink
    itself exists; it was taken for a file another connect made meanwhile)."""
    link = db_path.with_name("link.db")
    link.symlink_to(db_path)
    store = await Store.connect(link)
    await store.insert_run(make_run())
    kept = db_path.with_name("kept.db")
    os.link(db_path, kept)
    db_path.unlink()
    with pytest.raises(ConfigurationError, match=r"no database file is there, but"):
        await Store.connect(link)
    os.replace(kept, db_path)
    await store.insert_run(make_run())
    await store.close()
    await assert_sound(db_path)


async def test_stores_of_this_process_connecting_at_once_to_a_new_file_all_open(
    tmp_path: Path,
) -> None:
    """Several connects of one process to a file none has made yet: each sees the others'
    half-made files and still opens (the refusal above is for a -wal gone under an open store,
    not for one not made yet)."""
    for attempt in range(5):
        path = tmp_path / f"new{attempt}.db"
        stores = await asyncio.gather(*(Store.connect(path) for _ in range(6)))
        await asyncio.gather(*(store.close() for store in stores))


_EMFILE_TEST = """
import asyncio, json, os, resource, sys
from control_store import ControlError, Store, StorageError

async def main() -> None:
    store = await Store.connect(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    seen = set()
    # From no free descriptor to a few: each limit fails a different step of the connect
    # (SQLite's own open, or the read of the migration files); never with a raw OSError.
    for free in range(4):
        in_use = len(os.listdir("/proc/self/fd")) - 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + free, hard))
        for call in (store.migration_status, lambda: Store.connect(sys.argv[2] + str(free))):
            try:
                got = await call()
            except ControlError as exc:
                seen.add((type(exc).__name__, exc.retryable, str(exc)))
            except BaseException as exc:
                seen.add(("raw " + type(exc).__name__, False, str(exc)))
            else:
                if isinstance(got, Store):
                    await got.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await store.close()
    print(json.dumps(sorted(seen)))

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_process_at_its_open_file_limit_gets_a_storage_error_saying_so(
    tmp_path: Path,
) -> None:
    """At the limit of open files, connect() and migration_status() fail reading the migration
    files (os.listdir), or, with no descriptor free, in SQLite's own open (SQLITE_CANTOPEN):
    each a retryable StorageError with the README's fix, "close files or raise the limit",
    never a raw OSError, nor SQLite's open failure sending the user to the disk's free space."""
    done = subprocess.run(
        [sys.executable, "-c", _EMFILE_TEST, str(tmp_path / "a.db"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    assert seen
    for kind, retryable, message in seen:
        assert (kind, retryable) == ("StorageError", True), message
        assert "ulimit -n" in message, message


_EMFILE_CHANGES = """
import asyncio, contextlib, json, os, resource, sqlite3, sys
from control_store import ControlError, Store

def pragma(path, sql):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchone()[0]

async def main() -> None:
    root = sys.argv[1]
    old = os.path.join(root, "old.db")
    async with Store.connect(old):
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    seen = []
    for free in range(6):
        new = os.path.join(root, f"new{free}.db")
        assert pragma(old, "PRAGMA journal_mode=DELETE") == "delete"
        for path in (new, old):
            in_use = len(os.listdir("/proc/self/fd")) - 1
            resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + free, hard))
            try:
                store = await Store.connect(path)
            except ControlError as exc:
                error = [type(exc).__name__, exc.retryable, str(exc)]
            else:
                error = None
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            if error is None:
                await store.close()
                continue
            mode = pragma(old, "PRAGMA journal_mode")
            changed = os.path.exists(new) if path == new else mode == "wal"
            seen.append([free, path == new, changed, *error])
    print(json.dumps(seen))

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_connect_refused_at_the_open_file_limit_does_not_deny_what_it_changed(
    tmp_path: Path,
) -> None:
    """A connect at the limit of open files can fail after SQLite created the file (or its
    -wal), or after it switched a file out of WAL mode back into it: its error then does not
    say that nothing was changed, only that no row or migration was written; retryable, with
    the fix for the limit."""
    done = subprocess.run(
        [sys.executable, "-c", _EMFILE_CHANGES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    assert any(changed for _, _, changed, *_ in seen), seen  # the case this test is for
    for free, new, changed, kind, retryable, message in seen:
        assert (kind, retryable) == ("StorageError", True), (free, new, message)
        assert "ulimit -n" in message, message
        if changed:
            assert "nothing was changed" not in message, (free, new, message)
            assert "no row" in message, message


async def test_stores_of_this_process_connecting_at_once_to_a_closed_wal_file_all_open(
    tmp_path: Path,
) -> None:
    """Several connects of one process to a file in WAL mode that was closed cleanly (no -wal,
    no -shm): the first one's connection is open before its first read makes the -wal, and
    the look at the -wal runs on the event loop's thread, which that connect needs to go on:
    no -wal came in the second it waited, and every other connect was refused."""
    path = tmp_path / "closed.db"
    async with Store.connect(path):
        pass
    assert not Path(f"{path}-wal").exists()
    for _ in range(5):
        stores = await asyncio.gather(*(Store.connect(path) for _ in range(4)))
        await asyncio.gather(*(store.close() for store in stores))


async def test_an_error_sqlite_gives_that_no_branch_expects_still_says_what_to_do(
    db_path: Path,
) -> None:
    """An SQLite error of a kind the store does not expect (here SQLITE_MISMATCH) is a
    ControlError naming it that says what to do, not SQLite's words alone; the write is rolled
    back, and the retry succeeds."""
    async with Store.connect(db_path) as store:
        run = make_run()
        worker = store._connected()._worker
        worker.raw = FailingStatements(  # type: ignore[assignment]
            worker.raw,
            before={"INSERT INTO runs": _sqlite_error("datatype mismatch", "SQLITE_MISMATCH", 20)},
        )
        with pytest.raises(ControlError) as caught:
            await store.insert_run(run)
        message = str(caught.value)
        assert "datatype mismatch (SQLITE_MISMATCH)" in message, message
        assert "an error this release does not expect: retry the call" in message, message
        assert f"SQLite version ({sqlite3.sqlite_version})" in message
        assert await store.get_run(run.id) is None
        await store.insert_run(run)
        assert await store.get_run(run.id) == run
