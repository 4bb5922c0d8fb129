"""kill -9 at a random moment: acknowledged writes survive, unfinished ones leave no trace."""

from __future__ import annotations

import random
import shutil
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from control_store import JobStatus, RunStatus, Store, _migrate

from _workers import (
    HEAVY_MIGRATION,
    HEAVY_ROWS,
    PROGRESS_EVERY,
    SHIPPED,
    heavy_migrations,
    open_with_heavy_migration,
)
from conftest import Worker, acked, assert_sound, integrity, make_jobs, make_run, sized

pytestmark = pytest.mark.slow

ROUNDS = sized(1, 4)


def fresh(template: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the migrated template database."""
    path = tmp_path / f"{name}.db"
    shutil.copyfile(template, path)
    return path


def kill_after_acks(worker: Worker, most: int) -> list[list[str]]:
    """Let the worker acknowledge a random number (1..most) of calls, then kill -9 it."""
    worker.expect("ready")
    for _ in range(random.randint(1, most)):
        worker.expect("ack")
    return worker.kill()


@pytest.mark.parametrize("round_", range(ROUNDS))
async def test_acknowledged_outcomes_survive_kill_during_a_record_storm(
    template_db: Path, tmp_path: Path, spawn: Callable[..., Worker], round_: int
) -> None:
    """Outcomes a killed process saw acknowledged are recorded, and each counted exactly once."""
    db = fresh(template_db, tmp_path, f"storm{round_}")
    run = make_run(job_count=sized(1_000, 5_000))
    jobs = make_jobs(run)
    async with Store.connect(db) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
    lines = kill_after_acks(spawn("record-acked", db, run.id, 8), len(jobs) // 2)
    recorded = set(acked(lines))
    assert recorded
    async with Store.connect(db) as store:
        done = {
            str(job.id) for job in await store.list_jobs(run.id) if job.status is JobStatus.DONE
        }
        assert recorded <= done
        stored = await store.get_run(run.id)
        assert stored is not None
        assert stored.done_count == len(done)
    await assert_sound(db)


@pytest.mark.parametrize("round_", range(ROUNDS))
async def test_acknowledged_runs_survive_kill(
    template_db: Path, tmp_path: Path, spawn: Callable[..., Worker], round_: int
) -> None:
    """Runs a killed process saw acknowledged are all stored."""
    db = fresh(template_db, tmp_path, f"runs{round_}")
    lines = kill_after_acks(spawn("insert-runs-acked", db, 4), sized(300, 2_000))
    inserted = set(acked(lines))
    async with Store.connect(db) as store:
        stored = {str(run.id) for run in await store.list_runs()}
    assert inserted
    assert inserted <= stored
    await assert_sound(db)


@pytest.mark.parametrize("round_", range(ROUNDS))
async def test_acknowledged_claims_survive_kill(
    template_db: Path, tmp_path: Path, spawn: Callable[..., Worker], round_: int
) -> None:
    """Claims a killed process saw acknowledged stay claimed; no other run moved."""
    db = fresh(template_db, tmp_path, f"claims{round_}")
    runs = [make_run() for _ in range(sized(600, 3_000))]
    async with Store.connect(db) as store:
        for run in runs:
            await store.insert_run(run)
    lines = kill_after_acks(spawn("claim-acked", db, 4), len(runs) // 2)
    claimed = set(acked(lines))
    async with Store.connect(db) as store:
        running = {str(run.id) for run in await store.list_runs(status=RunStatus.RUNNING)}
        queued = await store.list_runs(status=RunStatus.QUEUED)
    assert claimed
    assert claimed <= running
    assert len(running) + len(queued) == len(runs)
    # Claims are oldest first, so what the killed process took is a prefix of the queue.
    assert running == {str(run.id) for run in runs[: len(running)]}
    await assert_sound(db)


@pytest.mark.parametrize(
    ("then", "cue", "words"),
    [("write", "refused", ["refused", "StorageError"]), ("read", "read", ["read"])],
)
@pytest.mark.parametrize("end", ["close", "kill"])
async def test_a_lost_wal_keeps_what_was_acked_through_a_close_and_the_file_sound_through_a_kill(
    template_db: Path,
    tmp_path: Path,
    spawn: Callable[..., Worker],
    then: str,
    cue: str,
    words: list[str],
    end: str,
) -> None:
    """With its -wal deleted under it, a store refuses the next write (a read still answers).
    Closed, the process keeps every write it acknowledged: SQLite's last connection copies the
    log it still holds into the database file. Killed, those writes are lost with the log, as
    with SQLite alone, but the file stays sound (see test_faults: the store never copies the
    log part-way)."""
    db = fresh(template_db, tmp_path, f"lose-wal-{then}-{end}")
    run = make_run(job_count=10)
    async with Store.connect(db) as store:
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
    worker = spawn("lose-wal", db, run.id, 5, then)
    assert worker.expect(cue) == words
    if end == "close":
        worker.go()
        lines = worker.finish()
        assert ["closed"] in lines
    else:
        lines = worker.kill()
    recorded = set(acked(lines))
    assert len(recorded) == 5
    await assert_sound(db)
    if end == "close":
        async with Store.connect(db) as store:
            done = {
                str(job.id) for job in await store.list_jobs(run.id) if job.status is JobStatus.DONE
            }
            stored = await store.get_run(run.id)
        assert done == recorded
        assert stored is not None
        assert stored.done_count == 5


async def test_an_insert_the_wal_vanished_under_is_kept_through_a_close(
    template_db: Path, tmp_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A -wal deleted inside an insert's transaction (after its checks, before its commit): the
    insert is acknowledged, into the log SQLite still holds, and kept when the store closes."""
    db = fresh(template_db, tmp_path, "lose-wal-during")
    run = make_run(job_count=10)
    async with Store.connect(db) as store:
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
    worker = spawn("lose-wal", db, run.id, 5, "during")
    (_, late) = worker.expect("inserted")
    worker.go()
    worker.finish()
    async with Store.connect(db) as store:
        assert len(await store.list_jobs(uuid.UUID(late))) == 4
    await assert_sound(db)


@pytest.mark.parametrize("round_", range(sized(1, 2)))
async def test_kill_during_a_large_insert_jobs_leaves_no_partial_batch(
    template_db: Path, tmp_path: Path, spawn: Callable[..., Worker], round_: int
) -> None:
    """A process killed in the middle of one big insert_jobs leaves none of it, or all of it."""
    db = fresh(template_db, tmp_path, f"jobs{round_}")
    count = sized(20_000, 100_000)
    run = make_run(job_count=count)
    async with Store.connect(db) as store:
        await store.insert_run(run)
    worker = spawn("insert-jobs-big", db, run.id, count)
    # The batch announces itself from inside, every PROGRESS_EVERY jobs; stop it part-way.
    stop_at = random.randrange(1, count // PROGRESS_EVERY) * PROGRESS_EVERY
    while int(worker.expect("progress")[1]) < stop_at:
        pass
    lines = worker.kill()
    finished = any(words[0] == "inserted" for words in lines)
    assert integrity(db) == "ok"
    async with Store.connect(db) as store:
        stored = len(await store.list_jobs(run.id))
        assert stored in (0, count)
        if finished:
            assert stored == count
        if not stored:  # the call can simply be made again
            await store.insert_jobs(make_jobs(run))
    await assert_sound(db)
    async with Store.connect(db) as store:
        assert len(await store.list_jobs(run.id)) == count


@pytest.mark.parametrize("round_", range(ROUNDS))
async def test_kill_during_a_migration_leaves_it_unapplied_and_reopening_applies_it(
    template_db: Path,
    tmp_path: Path,
    spawn: Callable[..., Worker],
    monkeypatch: pytest.MonkeyPatch,
    round_: int,
) -> None:
    """A migration killed half-way left nothing behind; the next connect applies all of it."""
    db = fresh(template_db, tmp_path, f"migrate{round_}")
    worker = spawn("migrate", db)
    stop_at = random.randrange(1, HEAVY_ROWS // PROGRESS_EVERY) * PROGRESS_EVERY
    while int(worker.expect("progress")[1]) < stop_at:
        pass
    lines = worker.kill()
    assert integrity(db) == "ok"
    raw = sqlite3.connect(db)
    try:
        versions = [v for (v,) in raw.execute(f"SELECT version FROM {_migrate.TRACKING_TABLE}")]
        tables = {n for (n,) in raw.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    finally:
        raw.close()
    assert versions in (SHIPPED, [*SHIPPED, HEAVY_MIGRATION])
    if any(words[0] == "migrated" for words in lines):
        assert versions == [*SHIPPED, HEAVY_MIGRATION]
    if versions == SHIPPED:
        assert "filler" not in tables  # no half-applied migration
    monkeypatch.setattr(_migrate, "load_migrations", heavy_migrations)
    store = await open_with_heavy_migration(str(db), lambda i: None)
    try:
        assert [m.version for m in await store.migration_status() if m.installed_on] == [
            *SHIPPED,
            HEAVY_MIGRATION,
        ]
        assert await store.check() == []
        backend = store._backend
        assert backend is not None
        (rows,) = await backend.read(
            lambda conn: conn.execute("SELECT count(*) FROM filler").fetchone()
        )
        assert rows == HEAVY_ROWS
    finally:
        await store.close()
    assert integrity(db) == "ok"
