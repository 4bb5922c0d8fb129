"""iter_jobs: a run's jobs in keyset pages, one bounded read each, in list_jobs' order."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from control_store import (
    CorruptRowError,
    EvalJob,
    InvalidInputError,
    Job,
    JobOutcome,
    JobStatus,
    Store,
    StoreClosedError,
    _codec,
    _sqlite,
)

from conftest import make_jobs, make_run, raw_db


async def _run_with_jobs(store: Store, count: int, *, room: int = 0) -> list[Job]:
    """A run with ``count`` jobs, inserted in three batches interleaved with another run's; its
    job_count leaves ``room`` for more."""
    # At least one job each: a run of none is refused (count 0: a run whose jobs are to come).
    run, other = make_run(max(count + room, 1)), make_run(max(count, 1))
    await store.insert_run(run)
    await store.insert_run(other)
    jobs, others = make_jobs(run, count), make_jobs(other, count)
    third = count // 3
    for start, stop in ((0, third), (third, 2 * third), (2 * third, count)):
        await store.insert_jobs(jobs[start:stop])
        await store.insert_jobs(others[start:stop])
    return await store.list_jobs(run.id)


def _reads(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, int]]:
    """Record each read the store's backend makes: (the op, how many jobs it returned)."""
    backend = store._backend
    assert backend is not None
    calls: list[tuple[Any, int]] = []
    real = backend.read

    async def read(op: Callable[[sqlite3.Connection], Any], *, small: bool = False) -> Any:
        result = await real(op, small=small)
        calls.append((op, len(result[0]) if isinstance(result, tuple) else -1))
        return result

    monkeypatch.setattr(backend, "read", read)
    return calls


async def _collect(walk: AsyncIterator[Job], into: list[Job]) -> None:
    """Append every job of ``walk`` to ``into``, until it ends or raises."""
    async for job in walk:
        into.append(job)


async def _nothing_left_open(store: Store, db_path: Path) -> None:
    """No transaction on the store's connection, and nothing holding a snapshot of the file."""
    backend = store._backend
    assert backend is not None
    assert not await backend.read(lambda conn: conn.in_transaction)
    if backend._worker.path is not None:
        other = sqlite3.connect(db_path, timeout=0, isolation_level=None)
        try:
            # TRUNCATE waits for no reader: busy is 0 only if no snapshot is held anywhere.
            busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            assert busy == 0
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
        finally:
            other.close()


@pytest.mark.parametrize(
    ("page_size", "count"),
    [(4, 0), (4, 1), (4, 4), (4, 5), (4, 13), (1, 3), (300, 300), (300, 301)],
)
async def test_iter_jobs_yields_list_jobs_in_order_across_pages(
    store: Store, page_size: int, count: int
) -> None:
    """Every job of the run, in list_jobs' order, whatever the page boundaries."""
    expected = await _run_with_jobs(store, count)
    assert len(expected) == count
    walked = [
        job
        async for job in store.iter_jobs(
            expected[0].run_id if expected else uuid.uuid4(), page_size=page_size
        )
    ]
    assert walked == expected


async def test_iter_jobs_of_an_empty_or_unknown_run_yields_nothing(store: Store) -> None:
    """A run without jobs (yet) and an unknown run id both yield nothing, as list_jobs returns
    []."""
    run = make_run(1)
    await store.insert_run(run)
    for run_id in (run.id, uuid.uuid4()):
        assert await store.list_jobs(run_id) == []
        assert [job async for job in store.iter_jobs(run_id)] == []


@pytest.mark.parametrize(("page_size", "count"), [(4, 10), (4, 8), (4, 0), (300, 301)])
async def test_each_page_is_one_read_of_at_most_page_size_rows(
    store: Store, monkeypatch: pytest.MonkeyPatch, page_size: int, count: int
) -> None:
    """A walk is one backend read per page, each of at most page_size jobs; a short page ends it."""
    jobs = await _run_with_jobs(store, count)
    run_id = jobs[0].run_id if jobs else uuid.uuid4()
    calls = _reads(store, monkeypatch)
    walked = [job async for job in store.iter_jobs(run_id, page_size=page_size)]
    assert walked == jobs
    assert all(op.func is _sqlite.op_job_page for op, _ in calls)
    sizes = [n for _, n in calls]
    full, rest = divmod(count, page_size)
    assert sizes == [page_size] * full + [rest]  # an exact multiple ends on one empty read


def test_a_page_is_one_range_seek_in_the_run_index() -> None:
    """The page query seeks idx_jobs_run on (run_id, rowid): page k costs what page 1 does."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(
            "CREATE TABLE jobs (id TEXT PRIMARY KEY NOT NULL, run_id TEXT NOT NULL, spec TEXT, "
            "status TEXT, attempt INTEGER, outcome TEXT);"
            "CREATE INDEX idx_jobs_run ON jobs (run_id);"
        )
        plan = conn.execute(f"EXPLAIN QUERY PLAN {_sqlite.SELECT_NEXT_JOB_PAGE}", ("r", 0, 9))
        details = [row[3] for row in plan]
    finally:
        conn.close()
    assert details == ["SEARCH jobs USING INDEX idx_jobs_run (run_id=? AND rowid>?)"]


async def test_a_walk_sees_each_job_once_as_it_was_when_its_page_was_read(store: Store) -> None:
    """Writes between pages: jobs already read stay as read, later pages show the new state,
    and jobs inserted during the walk come once, at the end."""
    jobs = await _run_with_jobs(store, 6, room=1)
    run_id = jobs[0].run_id
    walk = store.iter_jobs(run_id, page_size=2)
    seen = [await anext(walk), await anext(walk)]
    await store.record_job_outcomes(run_id, [JobOutcome(jobs[0].id), JobOutcome(jobs[4].id)])
    late = Job(run_id, jobs[0].spec)
    await store.insert_jobs([late])
    seen += [job async for job in walk]
    assert [job.id for job in seen] == [*(job.id for job in jobs), late.id]
    assert seen[0].status is JobStatus.QUEUED  # read before its outcome was recorded
    assert seen[4].status is JobStatus.DONE  # its page was read after
    assert seen[4].outcome == JobOutcome(jobs[4].id)


async def test_breaking_out_early_leaves_nothing_open(store: Store, db_path: Path) -> None:
    """A loop that stops after one job holds no transaction or snapshot; writes go on at once."""
    jobs = await _run_with_jobs(store, 10)
    run_id = jobs[0].run_id
    async for job in store.iter_jobs(run_id, page_size=4):
        assert job == jobs[0]
        break
    await _nothing_left_open(store, db_path)
    assert await store.record_job_outcome(run_id, JobOutcome(jobs[9].id, score=1.0))
    assert [job async for job in store.iter_jobs(run_id, page_size=4)][9].status is JobStatus.DONE
    assert await store.check() == []


async def test_cancelling_a_walk_mid_page_read_leaves_nothing_open(
    store: Store, db_path: Path
) -> None:
    """A task cancelled while reading its next page leaves no transaction, and the store goes on."""
    jobs = await _run_with_jobs(store, 12)
    run_id = jobs[0].run_id
    first_page_read = asyncio.Event()
    walked: list[Job] = []

    async def walk() -> None:
        async for job in store.iter_jobs(run_id, page_size=4):
            walked.append(job)
            if len(walked) == 4:
                first_page_read.set()  # the loop goes on into the second page's read

    task = asyncio.create_task(walk())
    await first_page_read.wait()
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert walked == jobs[:4]
    await _nothing_left_open(store, db_path)
    assert await store.record_job_outcome(run_id, JobOutcome(jobs[0].id, score=0.5))
    assert [job.id async for job in store.iter_jobs(run_id)] == [job.id for job in jobs]
    assert await store.check() == []


async def test_a_failed_page_read_leaves_the_walk_where_it_was(store: Store) -> None:
    """A read that fails does not advance the walk: iterating again reads the same page."""
    jobs = await _run_with_jobs(store, 6)
    walk = store.iter_jobs(jobs[0].run_id, page_size=4)
    backend = store._backend
    assert backend is not None
    real = backend.read
    failures = [StoreClosedError("injected: the read failed")]

    def flaky(op: Callable[[sqlite3.Connection], Any], *, small: bool = False) -> Awaitable[Any]:
        if failures:
            raise failures.pop()
        return real(op, small=small)

    backend.read = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(StoreClosedError, match="injected"):
            await anext(walk)
        assert [job async for job in walk] == jobs
    finally:
        del backend.read


async def test_a_corrupt_row_mid_walk_raises_naming_it(db_path: Path) -> None:
    """The pages before a bad row are yielded, then CorruptRowError names it, again if retried."""
    async with Store.connect(db_path) as store:
        jobs = await _run_with_jobs(store, 10)
    bad = jobs[5]
    with raw_db(db_path) as conn:
        conn.execute("UPDATE jobs SET spec = ? WHERE id = ?", ('{"model": 1}', str(bad.id)))
    async with Store.connect(db_path) as store:
        walk = store.iter_jobs(bad.run_id, page_size=2)
        walked: list[Job] = []
        with pytest.raises(CorruptRowError) as caught:
            await _collect(walk, walked)
        assert walked == jobs[:4]  # the page holding jobs 4 and 5 is not yielded at all
        error = caught.value
        assert (error.table, error.column, error.row_id) == ("jobs", "spec", str(bad.id))
        with pytest.raises(CorruptRowError, match=str(bad.id)):
            await anext(walk)


async def test_text_that_is_not_utf8_mid_walk_raises_naming_the_row(db_path: Path) -> None:
    """A hand-written non-UTF-8 value fails its page with the CorruptRowError naming the row."""
    async with Store.connect(db_path) as store:
        jobs = await _run_with_jobs(store, 9)
    bad = jobs[7]
    with raw_db(db_path) as conn:
        conn.execute("UPDATE jobs SET status = CAST(x'ff' AS TEXT) WHERE id = ?", (str(bad.id),))
    async with Store.connect(db_path) as store:
        walked: list[Job] = []
        with pytest.raises(CorruptRowError) as caught:
            await _collect(store.iter_jobs(bad.run_id, page_size=3), walked)
        assert walked == jobs[:6]
        assert (caught.value.column, caught.value.row_id) == ("status", str(bad.id))


@pytest.mark.parametrize("page_size", [0, -1, 100_001, 2**63, 1.5, "100", True, None])
async def test_a_bad_page_size_is_refused_when_the_walk_is_made(
    store: Store, page_size: Any
) -> None:
    """page_size must be an int from 1 to 100000: refused at the call, naming the value."""
    run = make_run(1)
    await store.insert_run(run)
    with pytest.raises(InvalidInputError) as caught:
        store.iter_jobs(run.id, page_size=page_size)
    message = str(caught.value)
    assert "page_size" in message
    assert repr(page_size) in message
    assert "1 to 100000" in message


async def test_a_bad_run_id_or_a_closed_store_is_refused_at_the_call(store: Store) -> None:
    """A run id that is not a UUID is InvalidInputError; a closed store is StoreClosedError."""
    with pytest.raises(InvalidInputError, match="run_id"):
        store.iter_jobs(str(uuid.uuid4()))  # type: ignore[arg-type]
    await store.close()
    with pytest.raises(StoreClosedError):
        store.iter_jobs(uuid.uuid4())


async def test_closing_the_store_mid_walk_ends_it_with_store_closed(store: Store) -> None:
    """The page after the store closed raises StoreClosedError instead of reading."""
    jobs = await _run_with_jobs(store, 5)
    walk = store.iter_jobs(jobs[0].run_id, page_size=2)
    assert await anext(walk) == jobs[0]
    await store.close()
    assert await anext(walk) == jobs[1]  # the page in hand
    with pytest.raises(StoreClosedError):
        await anext(walk)


@pytest.mark.parametrize("rowid", [0, -(2**63)])
async def test_a_job_at_any_rowid_is_walked_as_list_jobs_returns_it(
    db_path: Path, rowid: int
) -> None:
    """A job row inserted by hand with rowid 0 or the least rowid SQLite allows: the first page
    starts below any rowid, so the walk yields every job list_jobs returns (a first page read
    as "after rowid 0" dropped it while check() called the store sound)."""
    async with Store.connect(db_path) as store:
        jobs = await _run_with_jobs(store, 4, room=1)
    extra = Job(jobs[0].run_id, EvalJob("model-a", "hand-inserted", 0))
    with raw_db(db_path) as conn:
        conn.execute(
            f"INSERT INTO jobs (rowid, {_codec.JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rowid, *_codec.job_params(extra)),
        )
        conn.execute("UPDATE runs SET job_rows = job_rows + 1 WHERE id = ?", (str(extra.run_id),))
    async with Store.connect(db_path) as store:
        listed = await store.list_jobs(extra.run_id)
        assert listed[0] == extra
        assert [job async for job in store.iter_jobs(extra.run_id, page_size=2)] == listed
        assert await store.check() == []
