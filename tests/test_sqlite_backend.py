"""The SQLite backend's write path: one hop per call on aiosqlite's thread, and group commit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import aiosqlite
import pytest

from control_store import (
    AlreadyExistsError,
    ConfigurationError,
    EvalJob,
    Job,
    JobOutcome,
    NotFoundError,
    Run,
    Store,
    StoreClosedError,
    WrongEventLoopError,
    _sqlite,
)

from conftest import FailingStatements, make_jobs, make_run

WAIT = 10.0  # seconds; only a bound on a hang, never an expectation of speed


def backend_of(store: Store) -> _sqlite.SqliteBackend:
    """The store's backend (these tests look inside it on purpose)."""
    backend = store._backend
    assert backend is not None
    return backend


async def count_commits(store: Store) -> list[str]:
    """Trace every statement the store's connection runs; returns the growing list."""
    statements: list[str] = []
    backend = backend_of(store)
    await backend.read(lambda conn: conn.set_trace_callback(statements.append))
    return statements


def commits(statements: list[str]) -> int:
    """How many transactions committed, from a statement trace."""
    return sum(1 for s in statements if s.strip().upper() == "COMMIT")


class Gate:
    """A job generator that stops on the worker thread until released: holds the writer."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.entered = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> Iterator[Job]:
        yield self.jobs[0]
        self.entered.set()
        if not self.release.wait(WAIT):
            raise TimeoutError("the test never released the gate")
        yield from self.jobs[1:]


async def wait_entered(gate: Gate) -> None:
    """Wait until the worker thread is inside ``gate``."""
    assert await asyncio.to_thread(gate.entered.wait, WAIT), "the gate was never entered"


@pytest.fixture
async def file_store(db_path: Path) -> AsyncIterator[Store]:
    """A store on a WAL file, for tests that look at the file from a second connection."""
    store = await Store.connect(db_path)
    try:
        yield store
    finally:
        await store.close()


# --- the private aiosqlite surface we rely on -------------------------------------------------


async def test_aiosqlite_still_has_what_on_thread_needs() -> None:
    """aiosqlite keeps _connection, _running and a _tx queue; fails loudly if it changes."""
    conn = await aiosqlite.connect(":memory:")
    try:
        _sqlite.check_worker(conn)
        assert isinstance(conn._connection, sqlite3.Connection)
        assert conn._running is True
        assert hasattr(conn._tx, "put_nowait")
    finally:
        await conn.close()


async def test_on_thread_runs_on_the_worker_with_its_connection() -> None:
    """on_thread runs the function on aiosqlite's worker thread, in one round trip."""
    conn = await aiosqlite.connect(":memory:")
    try:
        raw = conn._connection
        here = threading.get_ident()
        seen = await _sqlite.on_thread(conn, lambda: (threading.get_ident(), raw is not None))
        assert seen == (conn._thread.ident, True)
        assert seen[0] != here
        with pytest.raises(ZeroDivisionError):
            await _sqlite.on_thread(conn, lambda: 1 // 0)
    finally:
        await conn.close()
    with pytest.raises(ValueError, match="Connection closed"):
        _sqlite.on_thread(conn, lambda: None)


def test_check_worker_names_what_is_missing() -> None:
    """An aiosqlite without the expected internals is refused with a message saying so."""

    class Changed:
        _connection = None

    with pytest.raises(ConfigurationError, match=r"_running.*install an aiosqlite"):
        _sqlite.check_worker(Changed())  # type: ignore[arg-type]


async def test_a_lone_write_is_one_transaction_and_one_commit(store: Store) -> None:
    """A lone record runs BEGIN IMMEDIATE, its two statements and one COMMIT."""
    run = make_run()
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    trace = await count_commits(store)
    assert await store.record_job_outcome(run.id, JobOutcome(jobs[0].id))
    assert len(trace) == 4
    assert trace[0] == "BEGIN IMMEDIATE"
    assert trace[1].lstrip().startswith("UPDATE jobs SET status = 'done'")
    assert trace[2].lstrip().startswith("UPDATE runs")
    assert trace[3] == "COMMIT"


async def test_every_lone_write_takes_the_write_lock_first(store: Store) -> None:
    """insert_run and claims run inside BEGIN IMMEDIATE ... COMMIT; a read is its statement."""
    run = make_run()
    trace = await count_commits(store)
    await store.insert_run(run)
    assert trace[0] == "BEGIN IMMEDIATE"
    assert trace[1].startswith(f"INSERT INTO runs ({_sqlite._RUN_COLUMNS}) VALUES ('{run.id}'")
    assert trace[2:] == ["COMMIT"]
    trace.clear()
    claimed = await store.claim_next_run()
    assert claimed is not None
    assert trace[0] == "BEGIN IMMEDIATE"
    assert trace[1].lstrip().startswith("UPDATE runs SET status = 'running'")
    assert trace[2:] == ["COMMIT"]
    trace.clear()
    await store.get_run(run.id)
    assert len(trace) == 1
    assert trace[0].startswith("SELECT")


# --- group commit ---------------------------------------------------------------------------


async def test_concurrent_writers_share_one_commit(file_store: Store) -> None:
    """On a file, 64 concurrent records take two commits: the first caller's and one for the
    other 63 (in memory each runs inline, on its own: see test_small_calls_in_memory_...)."""
    store = file_store
    run = make_run(job_count=64)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    trace = await count_commits(store)
    results = await asyncio.gather(
        *(store.record_job_outcome(run.id, JobOutcome(job.id)) for job in jobs)
    )
    assert results == [True] * 64
    assert commits(trace) == 2
    assert trace.count("SAVEPOINT group_commit") == 63
    current = await store.get_run(run.id)
    assert current is not None
    assert current.done_count == 64


async def test_each_caller_in_a_group_gets_its_own_result(store: Store) -> None:
    """In one group: new outcomes get True, a duplicate False, an unknown job its own error."""
    run = make_run(job_count=4)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    ghost = Job(run.id, EvalJob("m", "ghost", 0))
    holder = make_run(job_count=2)
    await store.insert_run(holder)
    gate = Gate(make_jobs(holder))
    trace = await count_commits(store)
    first = asyncio.create_task(store.insert_jobs(gate))
    await wait_entered(gate)
    calls = [
        store.record_job_outcome(run.id, JobOutcome(jobs[0].id, output="a")),
        store.record_job_outcome(run.id, JobOutcome(jobs[0].id, output="b")),
        store.record_job_outcome(run.id, JobOutcome(ghost.id)),
        store.record_job_outcome(run.id, JobOutcome(jobs[1].id)),
    ]
    grouped = asyncio.gather(*calls, return_exceptions=True)
    await asyncio.sleep(0)  # every caller queues behind the held writer
    gate.release.set()
    await first
    a, b, missing, other = await grouped
    assert (a, b, other) == (True, False, True)
    assert isinstance(missing, NotFoundError)
    assert str(ghost.id) in str(missing)
    assert commits(trace) == 2
    stored = await store.get_job(jobs[0].id)
    assert stored is not None
    assert stored.outcome == JobOutcome(jobs[0].id, output="a")
    current = await store.get_run(run.id)
    assert current is not None
    assert current.done_count == 2


async def test_a_failing_caller_rolls_back_only_its_own_work(store: Store) -> None:
    """A batch that fails halfway inside a group leaves no row; its neighbours commit."""
    run = make_run(job_count=10)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs[:1])
    gate = Gate(jobs[1:3])
    trace = await count_commits(store)
    first = asyncio.create_task(store.insert_jobs(gate))
    await wait_entered(gate)
    before = store.insert_jobs(jobs[3:5])
    # Inserts jobs[5] and jobs[6], then hits the already-stored jobs[0]: must leave none.
    failing = store.insert_jobs([jobs[5], jobs[6], jobs[0]])
    after = store.insert_jobs(jobs[7:])
    grouped = asyncio.gather(before, failing, after, return_exceptions=True)
    await asyncio.sleep(0)
    gate.release.set()
    await first
    ok_before, error, ok_after = await grouped
    assert ok_before is None
    assert ok_after is None
    assert isinstance(error, AlreadyExistsError)
    assert commits(trace) == 2
    stored = {job.id for job in await store.list_jobs(run.id)}
    assert stored == {job.id for job in jobs} - {jobs[5].id, jobs[6].id}


async def test_a_waiter_cancelled_before_its_turn_takes_no_effect(store: Store) -> None:
    """A queued write whose caller is cancelled before the group runs writes nothing."""
    run = make_run(job_count=6)
    jobs = make_jobs(run)
    await store.insert_run(run)
    gate = Gate(jobs[:2])
    first = asyncio.create_task(store.insert_jobs(gate))
    await wait_entered(gate)
    waiter = asyncio.create_task(store.insert_jobs(jobs[2:4]))
    neighbour = asyncio.create_task(store.insert_jobs(jobs[4:]))
    await asyncio.sleep(0)  # both are queued behind the held writer
    waiter.cancel()
    gate.release.set()
    await first
    await neighbour
    with pytest.raises(asyncio.CancelledError):
        await waiter
    stored = [job.id for job in await store.list_jobs(run.id)]
    assert stored == [jobs[i].id for i in (0, 1, 4, 5)]


async def test_a_caller_cancelled_mid_transaction_takes_full_effect(store: Store) -> None:
    """Cancelling a caller whose write is already on the thread still commits all of it."""
    run = make_run(job_count=6)
    jobs = make_jobs(run)
    await store.insert_run(run)
    holder = Gate(jobs[:2])
    first = asyncio.create_task(store.insert_jobs(holder))
    await wait_entered(holder)
    grouped = Gate(jobs[2:5])
    waiter = asyncio.create_task(store.insert_jobs(grouped))
    neighbour = asyncio.create_task(store.insert_jobs(jobs[5:]))
    await asyncio.sleep(0)
    holder.release.set()
    await first
    await wait_entered(grouped)  # the group's transaction holds part of the waiter's batch
    waiter.cancel()
    first.cancel()  # cancelling a finished call changes nothing
    grouped.release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await neighbour
    assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]


async def test_a_lone_caller_cancelled_mid_transaction_takes_full_effect(store: Store) -> None:
    """The first writer, cancelled while its transaction runs, still commits all of it."""
    run = make_run(job_count=4)
    jobs = make_jobs(run)
    await store.insert_run(run)
    gate = Gate(jobs)
    call = asyncio.create_task(store.insert_jobs(gate))
    await wait_entered(gate)
    call.cancel()
    gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]
    assert await store.check() == []


async def test_a_call_returns_only_after_its_commit(file_store: Store, db_path: Path) -> None:
    """When a grouped record returns, a second connection already sees it committed."""
    run = make_run(job_count=16)
    jobs = make_jobs(run)
    await file_store.insert_run(run)
    await file_store.insert_jobs(jobs)

    def visible(job: Job) -> bool:
        with sqlite3.connect(db_path) as other:
            row = other.execute("SELECT status FROM jobs WHERE id = ?", (str(job.id),)).fetchone()
        other.close()
        return bool(row == ("done",))

    async def record_then_look(job: Job) -> bool:
        assert await file_store.record_job_outcome(run.id, JobOutcome(job.id))
        return visible(job)

    assert await asyncio.gather(*(record_then_look(job) for job in jobs)) == [True] * 16


async def test_closing_waits_for_grouped_writes(store: Store) -> None:
    """close() lets queued writes finish and commit; later calls say the store is closed."""
    runs = [make_run() for _ in range(8)]
    calls = [asyncio.create_task(store.insert_run(run)) for run in runs]
    await asyncio.sleep(0)
    await backend_of(store).close()
    await asyncio.wait(calls)
    assert [call.exception() for call in calls] == [None] * 8


async def test_a_run_written_in_a_group_reads_back_equal(store: Store) -> None:
    """Grouped inserts of runs store each run faithfully."""
    runs = [Run("m", ["a"], 1, 1) for _ in range(10)]
    await asyncio.gather(*(store.insert_run(run) for run in runs))
    assert [await store.get_run(run.id) for run in runs] == runs


# --- in memory, small calls run inline on the event loop's thread ---------------------------


async def threads_of(store: Store) -> list[int]:
    """The thread that ran each statement of the store's connection, as they run."""
    seen: list[int] = []
    backend = backend_of(store)
    await backend.read(
        lambda conn: conn.set_trace_callback(lambda _: seen.append(threading.get_ident()))
    )
    seen.clear()
    return seen


async def test_small_calls_in_memory_run_inline_and_big_ones_hop() -> None:
    """In memory, bounded calls run on the loop's thread; unbounded ones on the worker's."""
    async with Store.in_memory() as store:
        loop_thread = threading.get_ident()
        worker = backend_of(store)._conn._thread.ident
        run = make_run(job_count=2)
        jobs = make_jobs(run)
        seen = await threads_of(store)
        await store.insert_run(run)
        await store.get_run(run.id)
        await store.claim_next_run()
        assert seen
        assert set(seen) == {loop_thread}
        seen.clear()
        await store.insert_jobs(jobs)
        await store.list_jobs(run.id)
        await store.check()
        assert seen
        assert set(seen) == {worker}
        seen.clear()
        await store.record_job_outcomes(run.id, [JobOutcome(jobs[0].id)])
        await store.claim_runs(256)
        assert seen
        assert set(seen) == {loop_thread}
        seen.clear()
        await store.claim_runs(257)
        assert seen
        assert set(seen) == {worker}


async def test_file_calls_always_hop(file_store: Store) -> None:
    """On a file every call runs on the worker thread: a file may make a call wait."""
    worker = backend_of(file_store)._conn._thread.ident
    run = make_run()
    seen = await threads_of(file_store)
    await file_store.insert_run(run)
    await file_store.get_run(run.id)
    await file_store.claim_next_run()
    assert seen
    assert set(seen) == {worker}


async def test_an_inline_call_waits_for_the_workers_transaction() -> None:
    """While the worker holds a transaction, a small call hops and runs after its COMMIT."""
    async with Store.in_memory() as store:
        holder = make_run(job_count=2)
        await store.insert_run(holder)
        gate = Gate(make_jobs(holder))
        trace = await count_commits(store)
        first = asyncio.create_task(store.insert_jobs(gate))
        await wait_entered(gate)
        late = make_run()
        inserting = asyncio.create_task(store.insert_run(late))
        reading = asyncio.create_task(store.get_run(holder.id))
        await asyncio.sleep(0.05)  # both had their turn on the loop, and must not have run
        assert not inserting.done()
        assert not reading.done()
        gate.release.set()
        await first
        await inserting
        assert await reading == holder
        # The gate's transaction committed whole before the late insert began.
        first_commit = trace.index("COMMIT")
        assert not any(s.startswith("INSERT INTO runs") for s in trace[:first_commit])
        assert await store.get_run(late.id) == late


async def test_inline_calls_let_other_tasks_run() -> None:
    """A task polling an in-memory store does not starve the task it is waiting for."""
    async with Store.in_memory() as store:
        run = make_run()

        async def insert_later() -> None:
            for _ in range(3):
                await asyncio.sleep(0)
            await store.insert_run(run)

        inserter = asyncio.create_task(insert_later())
        polls = 0
        while await store.get_run(run.id) is None:
            polls += 1
        await inserter
        assert polls >= 1


async def test_a_cancelled_inline_call_has_run_whole_or_not_at_all() -> None:
    """Cancelled before it starts, an inline write does nothing; cancelled at its suspension
    after running, it took effect (as a call already on the worker thread does). Never half."""
    async with Store.in_memory() as store:
        never, ran = make_run(), make_run()
        unstarted = asyncio.create_task(store.insert_run(never))
        unstarted.cancel()
        started = asyncio.create_task(store.insert_run(ran))
        await asyncio.sleep(0)  # started ran its transaction and is suspended after it
        started.cancel()
        for task in (unstarted, started):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await store.get_run(never.id) is None
        assert await store.get_run(ran.id) == ran
        assert not await backend_of(store).read(lambda conn: conn.in_transaction)


async def test_a_call_after_close_began_is_refused_cleanly() -> None:
    """A small call that gets the backend while close() is under way says the store closed."""
    store = await Store.in_memory()
    backend = backend_of(store)
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0)  # close() has begun: the worker is closing the connection
    with pytest.raises(StoreClosedError):
        await backend.read(partial(_sqlite.op_get_run, str(make_run().id)), small=True)
    await closing


@pytest.mark.parametrize(("statement", "after"), [("COMMIT", False), ("BEGIN IMMEDIATE", True)])
async def test_an_inline_write_interrupted_around_its_transaction_leaves_none_open(
    statement: str, after: bool
) -> None:
    """A KeyboardInterrupt on the loop's thread just after an inline write's BEGIN or just
    before its COMMIT (the asyncio REPL, a notebook's interrupt) reaches the caller, and the
    write is rolled back. The transaction stayed open: reads saw the run its caller was told
    had failed, and the next caller's write failed with "cannot start a transaction within a
    transaction", rolling the first one back then."""
    async with Store.in_memory() as store:
        worker = backend_of(store)._worker
        raw = worker.raw
        interrupted, later = make_run(), make_run()
        interrupt: dict[str, BaseException] = {statement: KeyboardInterrupt()}
        worker.raw = FailingStatements(  # type: ignore[assignment]
            raw, after=interrupt if after else None, before=None if after else interrupt
        )
        try:
            with pytest.raises(KeyboardInterrupt):
                await store.insert_run(interrupted)
        finally:
            worker.raw = raw
        assert not raw.in_transaction
        assert await store.get_run(interrupted.id) is None
        await store.insert_run(later)
        assert [run.id for run in await store.list_runs()] == [later.id]


async def test_an_empty_batch_runs_no_transaction(db_path: Path) -> None:
    """insert_jobs of an empty list or tuple, like record_job_outcomes of one, writes nothing
    and so runs no statement: no transaction, no commit, no fsync at FULL."""
    async with Store.connect(db_path) as store:
        run = make_run()
        await store.insert_run(run)
        statements = await count_commits(store)
        await store.insert_jobs([])
        await store.insert_jobs(())
        assert await store.record_job_outcomes(run.id, []) == []
        assert statements == []
        await store.insert_jobs(iter([]))  # a generator is only known empty once it is read
        assert commits(statements) == 1


async def test_an_empty_batch_is_refused_from_another_event_loop(db_path: Path) -> None:
    """insert_jobs of an empty list or tuple, answered without a hop, is still refused where
    any call is (another event loop), as record_job_outcomes of an empty batch is."""
    async with Store.connect(db_path) as store:
        run = make_run()

        async def from_another_loop() -> list[str]:
            refused = []
            empty: tuple[list[Job], tuple[Job, ...]] = ([], ())
            for jobs in empty:
                with pytest.raises(WrongEventLoopError):
                    await store.insert_jobs(jobs)
                refused.append(type(jobs).__name__)
            with pytest.raises(WrongEventLoopError):
                await store.record_job_outcomes(run.id, [])
            return refused

        assert await asyncio.to_thread(asyncio.run, from_another_loop()) == ["list", "tuple"]
