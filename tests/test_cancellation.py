"""Cancelled calls: each took effect wholly or not at all, and the store carries on."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import threading
import uuid
import warnings
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from control_store import Job, JobOutcome, JobStatus, Run, RunStatus, Store, _sqlite

from conftest import (
    CALL_TIMEOUT,
    group_in_flight,
    held_by_no_connection,
    held_store,
    make_jobs,
    make_run,
    raw_db,
    sized,
    thread_held,
    traced,
)

JOBS_PER_RUN = 10


async def _no_transaction_left_open(store: Store) -> None:
    backend = store._backend
    assert backend is not None
    assert not await backend.read(lambda conn: conn.in_transaction)
    database = await backend.read(lambda conn: conn.execute("PRAGMA database_list").fetchall())
    path = database[0][2]
    if path:  # a file: another connection can take the write lock at once
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
        finally:
            other.close()


@pytest.mark.parametrize("seed", range(sized(3, 10)))
async def test_cancelling_a_third_of_the_calls_in_flight_leaves_each_whole_or_absent(
    store: Store, seed: int
) -> None:
    """A random third of many concurrent calls is cancelled: no call is half-done, none is lost."""
    rng = random.Random(seed)
    size = sized(40, 150)
    fed = [make_run(job_count=JOBS_PER_RUN) for _ in range(size)]  # jobs in, outcomes coming
    empty = [make_run(job_count=JOBS_PER_RUN) for _ in range(size)]  # jobs coming
    for run in [*fed, *empty]:
        await store.insert_run(run)
    fed_jobs = [job for run in fed for job in make_jobs(run)]
    await store.insert_jobs(fed_jobs)
    batches = {run.id: make_jobs(run) for run in empty}
    new_runs = [make_run() for _ in range(size)]

    calls: list[tuple[str, Any, Coroutine[Any, Any, Any]]] = []
    calls += [("insert_run", run, store.insert_run(run)) for run in new_runs]
    calls += [("insert_jobs", run_id, store.insert_jobs(b)) for run_id, b in batches.items()]
    calls += [("claim", None, store.claim_next_run()) for _ in range(size)]
    for job in fed_jobs:
        calls.append(("record", job, store.record_job_outcome(job.run_id, JobOutcome(job.id))))
    calls += [  # redeliveries of some of the same outcomes
        ("record", job, store.record_job_outcome(job.run_id, JobOutcome(job.id)))
        for job in rng.sample(fed_jobs, size)
    ]
    rng.shuffle(calls)
    tasks = [asyncio.ensure_future(coro) for _, _, coro in calls]
    doomed = rng.sample(range(len(tasks)), len(tasks) // 3)
    for index in doomed:  # cancel at scattered moments: queued, grouped, or on the thread
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)
        tasks[index].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)

    cancelled = {i for i, result in enumerate(results) if isinstance(result, BaseException)}
    assert all(isinstance(results[i], asyncio.CancelledError) for i in cancelled)
    assert cancelled <= set(doomed)
    await _no_transaction_left_open(store)

    claimed = []
    for index, (kind, subject, _) in enumerate(calls):
        done = index not in cancelled
        if kind == "insert_run":
            stored = await store.get_run(subject.id)
            if done:
                assert stored is not None
            if stored is not None:  # whole: the run as inserted (perhaps claimed since)
                assert msgspec.structs.replace(stored, status=RunStatus.QUEUED) == subject
        elif kind == "insert_jobs":
            count = len(await store.list_jobs(subject))
            assert count in (0, JOBS_PER_RUN)
            if done:
                assert count == JOBS_PER_RUN
        elif kind == "record" and done:
            recorded = await store.get_job(subject.id)
            assert recorded is not None
            assert recorded.status is JobStatus.DONE
        elif kind == "claim" and done:
            result = results[index]
            if isinstance(result, Run):
                claimed.append(result.id)
    assert len(set(claimed)) == len(claimed)  # no run handed out twice
    queued = {run.id for run in await store.list_runs(status=RunStatus.QUEUED)}
    assert not queued & set(claimed)  # each claim returned took effect
    running = {run.id for run in await store.list_runs(status=RunStatus.RUNNING)}
    assert running <= set(claimed)  # a cancelled claim gave its run back
    assert await store.check() == []  # every record counted exactly when its job is done

    # The store carries on: a write, a claim and a record after all that.
    extra = make_run(job_count=1)
    await store.insert_run(extra)
    await store.insert_jobs(make_jobs(extra))
    [job] = await store.list_jobs(extra.id)
    assert await store.record_job_outcome(extra.id, JobOutcome(job.id))
    assert await store.claim_next_run() is not None or not await store.list_runs(
        status=RunStatus.QUEUED
    )
    assert await store.check() == []


def _statuses(store: Store) -> dict[str, int]:
    """Runs by status, read synchronously on the loop's thread: what the store holds right now,
    without an await that would let a task under test move on."""
    backend = store._backend
    assert backend is not None
    conn = (
        sqlite3.connect(f"file:{backend._worker.path}?mode=ro", uri=True)
        if backend._worker.path
        else None
    )
    source = conn if conn is not None else backend._worker.raw
    try:
        return dict(source.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall())
    finally:
        if conn is not None:
            conn.close()


@pytest.mark.parametrize("behind", ["a read", "a write"])
async def test_a_claim_cancelled_before_it_starts_claims_nothing(
    db_path: Path, behind: str
) -> None:
    """A claim cancelled while it waits behind another call of its store never runs: its runs
    stay queued for the next claimer, whether it waited alone or in the group commit's queue.
    Never run, not run and given back: no claim statement reaches the connection, so no other
    process ever sees its runs running, and no give-back can fail and strand them."""
    async with Store.connect(db_path) as store:
        for _ in range(2):
            await store.insert_run(make_run())
        backend = store._backend
        assert backend is not None
        async with traced(store) as statements:
            await _cancel_a_claim_while_queued(store, backend, behind)
        assert not [sql for sql in statements if "UPDATE runs" in sql], statements
        assert RunStatus.RUNNING.value not in _statuses(store)
        assert len(await store.claim_runs(3)) == (2 if behind == "a read" else 3)


async def _cancel_a_claim_while_queued(
    store: Store, backend: _sqlite.SqliteBackend, behind: str
) -> None:
    """Hold the store's thread, queue a claim behind a read (or behind a write, in the group
    commit's queue), cancel it, then let everything run."""
    ahead = None
    async with thread_held(backend):
        if behind == "a write":  # becomes the write in flight: the claim queues for a group
            ahead = asyncio.ensure_future(store.insert_run(make_run()))
            await asyncio.sleep(0)
        claim = asyncio.ensure_future(store.claim_runs(2))
        await asyncio.sleep(0)
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
    if ahead is not None:
        await ahead


async def test_a_migrate_cancelled_while_queued_never_runs(tmp_path: Path) -> None:
    """migrate() cancelled while it waits behind another call for the store's thread is
    withdrawn, as every write is: it ran all the same (a plain hop), applying the migrations of
    a call its caller had cancelled. The next migrate() applies them."""
    async with Store.connect(tmp_path / "fresh.db", migrate=False) as store:
        backend = store._backend
        assert backend is not None
        async with thread_held(backend):
            migrating = asyncio.ensure_future(store.migrate())
            await asyncio.sleep(0)
            migrating.cancel()
            with pytest.raises(asyncio.CancelledError):
                await migrating
        assert [m.version for m in await store.migration_status() if m.installed_on] == []
        assert await store.migrate() != []


class _HeldClaim:
    """Stops the store's claims on the worker thread, mid-transaction (a statement trace runs
    before each statement), until ``gate`` is set."""

    def __init__(self) -> None:
        self.inside, self.gate = threading.Event(), threading.Event()

    @classmethod
    async def on(cls, store: Store) -> _HeldClaim:
        held = cls()
        backend = store._backend
        assert backend is not None
        await backend.read(lambda conn: conn.set_trace_callback(held))
        return held

    def __call__(self, statement: str) -> None:
        if statement.lstrip().startswith("UPDATE runs SET status = 'running'"):
            self.inside.set()
            self.gate.wait(CALL_TIMEOUT)

    async def entered(self) -> bool:
        """Whether a claim reached its UPDATE (waited for on a thread: not the loop's)."""
        return await asyncio.to_thread(self.inside.wait, CALL_TIMEOUT)


async def test_a_claim_cancelled_on_the_thread_gives_its_runs_back(db_path: Path) -> None:
    """A claim cancelled while its transaction runs still commits, and then gives its runs
    back: no run stays claimed by a task that never received it."""
    async with Store.connect(db_path) as store:
        runs = [make_run() for _ in range(3)]
        for run in runs:
            await store.insert_run(run)
        held = await _HeldClaim.on(store)
        claim = asyncio.ensure_future(store.claim_runs(2))
        try:
            assert await held.entered()
            claim.cancel()
            await asyncio.sleep(0)
            assert not claim.done()  # it waits for its transaction, to give the runs back
        finally:
            held.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await claim
        assert _statuses(store) == {RunStatus.QUEUED.value: 3}
        claimed = await store.claim_runs(3)
        assert [run.id for run in claimed] == [run.id for run in runs]  # oldest first, as before


async def test_a_claim_cancelled_after_running_inline_gives_its_run_back() -> None:
    """In memory a claim runs inline, before its first await; cancelled at that await, it has
    claimed its run, and gives it back."""
    async with Store.in_memory() as store:
        run = make_run()
        await store.insert_run(run)
        claim = asyncio.ensure_future(store.claim_next_run())
        await asyncio.sleep(0)  # the claim ran, and yields once before returning
        assert _statuses(store) == {RunStatus.RUNNING.value: 1}
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        assert _statuses(store) == {RunStatus.QUEUED.value: 1}
        assert await store.claim_next_run() == msgspec.structs.replace(
            run, status=RunStatus.RUNNING
        )


def _thread_of(store: Store) -> threading.Thread:
    backend = store._backend
    assert backend is not None
    thread = backend._conn._thread
    assert thread is not None
    return thread


async def test_a_second_close_waits_for_the_first(db_path: Path) -> None:
    """Two tasks closing one store (a shutdown task and an ``async with`` exit): the second
    returns only once the first has let the queued writes commit and closed the connection."""
    store = await Store.connect(db_path)
    thread = _thread_of(store)
    backend = store._backend
    assert backend is not None
    runs = [make_run() for _ in range(20)]
    writes = [asyncio.ensure_future(store.insert_run(run)) for run in runs]
    await asyncio.sleep(0)
    first = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    await store.close()
    assert all(write.done() for write in writes)
    assert backend._conn._connection is None  # closed (its thread ends right after)
    await asyncio.to_thread(thread.join, CALL_TIMEOUT)
    assert not thread.is_alive()
    await asyncio.gather(first, *writes)
    async with Store.connect(db_path, read_only=True) as reader:
        assert len(await reader.list_runs()) == len(runs)


async def test_a_cancelled_close_still_closes(db_path: Path) -> None:
    """A close whose caller is cancelled (a wait_for that timed out) finishes anyway: the
    queued writes commit and the connection and its thread end; close() again returns."""
    store = await Store.connect(db_path)
    thread = _thread_of(store)
    runs = [make_run() for _ in range(20)]
    writes = [asyncio.ensure_future(store.insert_run(run)) for run in runs]
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert store.closed
    await asyncio.gather(*writes)
    await asyncio.to_thread(thread.join, CALL_TIMEOUT)
    assert not thread.is_alive()
    await store.close()
    async with Store.connect(db_path, read_only=True) as reader:
        assert len(await reader.list_runs()) == len(runs)


async def test_close_waits_for_a_cancelled_claim_to_give_its_runs_back(db_path: Path) -> None:
    """close() called while a cancelled claim is still on the thread waits for the claim and
    for its give-back: the connection never closes between the two."""
    store = await Store.connect(db_path)
    for _ in range(2):
        await store.insert_run(make_run())
    held = await _HeldClaim.on(store)
    claim = asyncio.ensure_future(store.claim_runs(2))
    try:
        assert await held.entered()
        claim.cancel()
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0)
    finally:
        held.gate.set()
    await closing
    with pytest.raises(asyncio.CancelledError):
        await claim
    async with Store.connect(db_path, read_only=True) as reader:
        assert len(await reader.list_runs(status=RunStatus.QUEUED)) == 2


async def test_close_waits_for_a_queued_claim_cancelled_after_its_group_ran(
    db_path: Path,
) -> None:
    """A claim queued for a group, cancelled in the loop pass after that group committed (its
    caller has not resumed yet), while close() waits: the caller gives the run back before the
    connection closes, and ends cancelled, not with an error of a closed connection."""
    store = await Store.connect(db_path)
    for _ in range(3):
        await store.insert_run(make_run())
    backend = store._backend
    assert backend is not None
    ahead = await group_in_flight(store)
    claim = asyncio.ensure_future(store.claim_next_run())
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    # Polled, not awaited: an Event's waiter would resume after the claim's caller, and the
    # cancel must land in the pass where the group has run but its caller has not resumed.
    while not backend._idle.is_set():  # noqa: ASYNC110
        await asyncio.sleep(0)
    claim.cancel()
    await asyncio.wait_for(asyncio.gather(ahead, closing), CALL_TIMEOUT)
    with pytest.raises(asyncio.CancelledError):
        await claim
    async with Store.connect(db_path, read_only=True) as reader:
        assert {run.status for run in await reader.list_runs()} == {RunStatus.QUEUED}


@pytest.mark.parametrize("when", ["before its first step", "with its group on the thread"])
async def test_cancelling_every_task_gives_back_the_claims_of_a_group(
    db_path: Path, when: str
) -> None:
    """A shutdown that cancels every task, the store's own group-commit task included, while
    claims wait for a group or are in one on the thread: no run is left claimed by a caller
    that never received it, and the store goes on writing."""
    async with Store.connect(db_path) as store:
        for _ in range(6):
            await store.insert_run(make_run())
        backend = store._backend
        assert backend is not None
        held = await _HeldClaim.on(store) if when != "before its first step" else None
        ahead = await group_in_flight(store)
        claims = [asyncio.ensure_future(store.claim_next_run()) for _ in range(4)]
        try:
            if held is None:
                await ahead  # the flusher for the claims' group is created, not yet started
            else:
                await ahead
                assert await held.entered()  # the claims' group is on the thread
            flusher = backend._flusher
            assert flusher is not None
            for task in (flusher, *claims):
                task.cancel()
            await asyncio.sleep(0)
        finally:
            if held is not None:
                held.gate.set()
        results = await asyncio.wait_for(
            asyncio.gather(*claims, return_exceptions=True), CALL_TIMEOUT
        )
        assert all(isinstance(result, asyncio.CancelledError) for result in results)
        assert _statuses(store) == {RunStatus.QUEUED.value: 7}
        if held is not None:
            await backend.read(lambda conn: conn.set_trace_callback(None))
        assert len(await store.claim_runs(7)) == 7


async def test_a_give_back_queued_behind_a_group_survives_a_shutdown_cancelling_every_task(
    db_path: Path,
) -> None:
    """A claim cancelled while its group ran queues its give-back behind the next group; then a
    shutdown cancels every task (asyncio.run ending, a SIGTERM handler). The give-back still
    runs: it used to be a task of its own, which that shutdown cancelled too, and which then
    withdrew itself, leaving the run 'running' with nobody on it and no word."""
    async with Store.connect(db_path) as store:
        for _ in range(3):
            await store.insert_run(make_run())
        later = make_run(job_count=1)
        await store.insert_run(later)
        backend = store._backend
        assert backend is not None
        held = await _HeldClaim.on(store)
        started, gate = threading.Event(), threading.Event()

        def slow_jobs() -> Iterator[Job]:
            started.set()
            gate.wait(CALL_TIMEOUT)
            yield from make_jobs(later)

        ahead = await group_in_flight(store)
        claim = asyncio.ensure_future(store.claim_next_run())
        await ahead
        assert await held.entered()  # the claim's group is on the thread
        behind = asyncio.ensure_future(store.insert_jobs(slow_jobs()))  # the next group
        await asyncio.sleep(0)
        claim.cancel()
        held.gate.set()  # the claim commits; its caller, cancelled, queues the give-back
        assert await asyncio.to_thread(started.wait, CALL_TIMEOUT)  # the next group runs
        deadline = asyncio.get_running_loop().time() + CALL_TIMEOUT
        while not backend._pending:  # the give-back, queued behind it
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.001)
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:  # the shutdown
            task.cancel()
        gate.set()
        await asyncio.wait_for(asyncio.gather(*others, return_exceptions=True), CALL_TIMEOUT)
        await backend.read(lambda conn: conn.set_trace_callback(None))
        assert claim.cancelled()
        assert behind.done()
        assert await store.list_runs(status=RunStatus.RUNNING) == []
        assert await store.check() == []


@pytest.mark.parametrize("as_errors", [False, True], ids=["warned", "warnings-are-errors"])
async def test_a_claim_whose_give_back_fails_says_which_runs_stay_running(
    db_path: Path, as_errors: bool
) -> None:
    """A cancelled claim whose give-back cannot take the write lock (another process holds it
    past busy_timeout, and keeps it) warns, naming the runs left running and the repair, and
    ends cancelled. Where warnings are errors (this suite's own filterwarnings = error), the
    raised warning must not take the cancellation's place: its message goes to the loop's
    exception handler instead."""
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        async with Store.connect(db_path, busy_timeout=0.05) as store:
            run = make_run()
            await store.insert_run(run)
            held = await _HeldClaim.on(store)
            claim = asyncio.ensure_future(store.claim_next_run())
            other = sqlite3.connect(db_path, isolation_level=None)
            try:
                assert await held.entered()
                claim.cancel()
                held.gate.set()
                # The claim commits; then the other process takes the lock before the give-back.
                other.execute("PRAGMA busy_timeout = 10000")
                other.execute("BEGIN IMMEDIATE")
                with warnings.catch_warnings(record=True) as warned:
                    warnings.simplefilter("error" if as_errors else "always", RuntimeWarning)
                    with pytest.raises(asyncio.CancelledError):
                        await asyncio.wait_for(claim, CALL_TIMEOUT)
            finally:
                with contextlib.suppress(sqlite3.Error):
                    other.execute("ROLLBACK")
                other.close()
            assert claim.cancelled()
            messages = [str(w.message) for w in warned] + [c["message"] for c in reported]
            assert len(messages) == 1
            assert (len(reported) == 1) is as_errors
            (message,) = messages
            assert str(run.id) in message
            assert "DatabaseBusyError: the write lock could not be taken within busy_timeout" in (
                message
            )
            # The cancelled call has nothing to retry: the busy error's own advice is left out.
            assert "retry" not in message
            assert "larger busy_timeout" not in message
            assert _statuses(store) == {RunStatus.RUNNING.value: 1}
            # The one fix it gives, run as printed, queues the run again.
            repair = message.split("queue them again with: ", 1)[1]
            with raw_db(db_path) as conn:
                conn.execute(repair)
            assert _statuses(store) == {RunStatus.QUEUED.value: 1}
            claimed = await store.claim_next_run()
            assert claimed is not None
            assert claimed.id == run.id
            assert await store.check() == []
    finally:
        loop.set_exception_handler(None)


class _HeldStatements:
    """Stops the store's worker thread at the first statement starting with each prefix (a
    statement trace runs before each), until that prefix's gate is set."""

    def __init__(self, *prefixes: str) -> None:
        self.inside = {prefix: threading.Event() for prefix in prefixes}
        self.gate = {prefix: threading.Event() for prefix in prefixes}

    def __call__(self, statement: str) -> None:
        for prefix, inside in self.inside.items():
            if statement.lstrip().startswith(prefix) and not inside.is_set():
                inside.set()
                self.gate[prefix].wait(CALL_TIMEOUT)

    async def entered(self, prefix: str) -> bool:
        return await asyncio.to_thread(self.inside[prefix].wait, CALL_TIMEOUT)


async def test_close_waits_for_the_writes_queued_behind_a_give_back(db_path: Path) -> None:
    """A cancelled claim's give-back started the store's flusher while the store was idle, and
    left it marked idle: with the claim settled, a close() closed the connection under the
    writes still queued behind the flusher's group in flight (StoreClosedError, "is closed;
    connect again", for calls made before the close). close() lets them commit, as it does
    any write it accepted."""
    store = await Store.connect(db_path)
    run = make_run(job_count=20)
    jobs = make_jobs(run)
    await store.insert_run(run, jobs=jobs)
    await store.insert_run(make_run())
    backend = store._backend
    assert backend is not None
    claiming, giving_back = "UPDATE runs SET status = 'running'", "UPDATE runs SET status = 'q"
    recording = "UPDATE jobs SET"
    held = _HeldStatements(claiming, giving_back, recording)
    await backend.read(lambda conn: conn.set_trace_callback(held))
    claim = asyncio.ensure_future(store.claim_next_run())
    assert await held.entered(claiming)
    claim.cancel()
    held.gate[claiming].set()  # the claim commits, then gives its run back through the flusher

    def record(some: list[Job]) -> list[asyncio.Future[bool]]:
        return [
            asyncio.ensure_future(store.record_job_outcome(run.id, JobOutcome(j.id))) for j in some
        ]

    assert await held.entered(giving_back)  # the flusher's group of the give-back alone
    first = record(jobs[:10])  # queued behind it: the flusher's next group
    await asyncio.sleep(0)
    held.gate[giving_back].set()
    assert await held.entered(recording)  # that group is on the thread
    await asyncio.wait([claim], timeout=CALL_TIMEOUT)  # the give-back is done: nothing owed
    assert claim.cancelled()
    second = record(jobs[10:])  # queued behind the group in flight
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0.05)  # a close() that saw the store idle queues its close now
    held.gate[recording].set()
    await asyncio.wait_for(closing, CALL_TIMEOUT)
    assert await asyncio.gather(*first, *second) == [True] * len(jobs)
    async with Store.connect(db_path) as again:
        stored = await again.get_run(run.id)
        assert stored is not None
        assert stored.done_count == len(jobs)
        assert await again.check() == []


async def test_a_shutdown_cancelling_close_itself_still_gives_claims_back(db_path: Path) -> None:
    """A shutdown that cancels close()'s own task, the group-commit task and the claimers while
    a group of claims is on the thread: the claims give their runs back before the connection
    ends, and it does end."""
    store = await Store.connect(db_path)
    for _ in range(4):
        await store.insert_run(make_run())
    backend = store._backend
    assert backend is not None
    thread = _thread_of(store)
    held = await _HeldClaim.on(store)
    ahead = await group_in_flight(store)
    claims = [asyncio.ensure_future(store.claim_next_run()) for _ in range(2)]
    try:
        await ahead
        assert await held.entered()  # the claims' group is on the thread
        closing = asyncio.ensure_future(store.close())
        for _ in range(2):  # close() makes its task, which starts waiting for the claims
            await asyncio.sleep(0)
        closer, flusher = backend._closer, backend._flusher
        assert closer is not None
        assert flusher is not None
        for task in (closing, closer, flusher, *claims):
            task.cancel()
        await asyncio.sleep(0)
    finally:
        held.gate.set()
    results = await asyncio.wait_for(
        asyncio.gather(closing, *claims, return_exceptions=True), CALL_TIMEOUT
    )
    assert all(isinstance(result, asyncio.CancelledError) for result in results)
    await asyncio.wait_for(asyncio.shield(closer), CALL_TIMEOUT)  # it ended, not cancelled
    await asyncio.to_thread(thread.join, CALL_TIMEOUT)
    assert not thread.is_alive()
    async with Store.connect(db_path, read_only=True) as reader:
        assert {run.status for run in await reader.list_runs()} == {RunStatus.QUEUED}


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "claim in flight"])
async def test_a_close_cancelled_before_its_first_step_still_ends_the_connection(
    db_path: Path, in_flight: bool
) -> None:
    """close()'s task cancelled before it ran (a shutdown right after close() began): the
    connection still ends, once a claim in flight has given its run back."""
    store = await Store.connect(db_path)
    await store.insert_run(make_run())
    backend = store._backend
    assert backend is not None
    thread = _thread_of(store)
    held = await _HeldClaim.on(store) if in_flight else None
    claim = asyncio.ensure_future(store.claim_next_run()) if in_flight else None
    try:
        if held is not None:
            assert await held.entered()
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0)  # close() made its task, which has not run yet
        closer = backend._closer
        assert closer is not None
        for task in (closer, closing) if claim is None else (closer, closing, claim):
            task.cancel()
    finally:
        if held is not None:
            held.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    if claim is not None:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(claim, CALL_TIMEOUT)
    await asyncio.to_thread(thread.join, CALL_TIMEOUT)
    assert not thread.is_alive()
    assert store.closed
    async with Store.connect(db_path, read_only=True) as reader:
        assert {run.status for run in await reader.list_runs()} == {RunStatus.QUEUED}


class _SlowOpen:
    """sqlite3.connect held on the worker thread (a slow disk) until the test releases it, or
    at most 3 s: less than the 5 s the store once waited for it, so a connect that waited
    would see the open finish. Each connection it opens is kept for the test to check, and
    made usable from any thread so that the test can see whether the store closed it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, held: bool = True) -> None:
        self.opened: list[sqlite3.Connection] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        if not held:
            self.release.set()
        real_connect = sqlite3.connect

        def slow_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            self.started.set()
            self.release.wait(3)
            conn: sqlite3.Connection = real_connect(*args, **{**kwargs, "check_same_thread": False})
            self.opened.append(conn)
            self.finished.set()
            return conn

        monkeypatch.setattr(sqlite3, "connect", slow_connect)

    def closed(self) -> bool:
        (conn,) = self.opened
        try:
            conn.execute("SELECT 1")
        except sqlite3.ProgrammingError as exc:
            return "closed database" in str(exc)
        return False


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread not in before]


async def test_a_connect_cancelled_while_the_file_opens_returns_at_once_and_leaves_nothing(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while its file opens on the worker thread (a slow disk, a hung network
    mount): connect raises CancelledError at once, without waiting for the open, so the event
    loop is not held; the worker then closes the connection that opened after all, on its own
    thread, and ends."""
    slow = _SlowOpen(monkeypatch)
    before = set(threading.enumerate())
    task = asyncio.ensure_future(Store.connect(db_path))
    await asyncio.sleep(0)  # the task's first step starts the worker and queues the open
    (worker,) = _new_threads(before)
    assert await asyncio.to_thread(slow.started.wait, CALL_TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not slow.finished.is_set()  # returned while the open was still held
    slow.release.set()
    await asyncio.to_thread(worker.join, CALL_TIMEOUT)
    assert not worker.is_alive()
    assert slow.closed()


async def test_a_connect_cancelled_as_its_file_opened_closes_what_it_opened(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled after the worker opened the file but before the loop took the connection:
    the connection no one will take is closed on the worker's thread, not left for the
    garbage collector (a ResourceWarning on Python 3.13), and the worker ends."""
    slow = _SlowOpen(monkeypatch, held=False)
    before = set(threading.enumerate())
    task = asyncio.ensure_future(Store.connect(db_path))
    await asyncio.sleep(0)  # the task's first step starts the worker and queues the open
    (worker,) = _new_threads(before)
    # Hold the loop until the open has ended: its hand-over now waits on the loop, behind
    # the cancel.
    assert slow.finished.wait(CALL_TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(worker.join, CALL_TIMEOUT)
    assert not worker.is_alive()
    assert slow.closed()


def test_a_connect_cancelled_by_a_loop_that_ends_before_the_open_leaves_nothing(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio.run ends (its tasks cancelled, its loop closed) while a connect's file is still
    opening: when the open ends, nothing fails on the worker thread for want of a loop, the
    connection is closed, and the worker ends."""
    slow = _SlowOpen(monkeypatch)
    failures: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    before = set(threading.enumerate())

    workers: list[threading.Thread] = []

    async def main() -> None:
        connecting = asyncio.ensure_future(Store.connect(db_path))
        await asyncio.sleep(0)  # the task's first step starts the worker and queues the open
        workers.extend(_new_threads(before))
        assert await asyncio.to_thread(slow.started.wait, CALL_TIMEOUT)
        assert not connecting.done()  # asyncio.run cancels it as it ends

    asyncio.run(main())
    assert not slow.finished.is_set()  # the loop closed while the open was still held
    slow.release.set()
    (worker,) = workers
    worker.join(CALL_TIMEOUT)
    assert not worker.is_alive()
    assert slow.closed()
    assert failures == []


async def test_a_connect_cancelled_while_it_waits_for_another_process_lock_returns_at_once(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while its set-up waits in SQLite's busy handler for a lock another process
    holds: connect raises CancelledError without waiting out busy_timeout (minutes, for a
    store connected for big inserts), and the worker closes the connection once the wait
    ends. (The connect used to close the store in full, which waited behind the set-up.)"""
    async with Store.connect(db_path):
        pass
    waiting = threading.Event()
    real_configure = _sqlite.configure

    def configure(conn: sqlite3.Connection, **kwargs: Any) -> None:
        waiting.set()
        real_configure(conn, **kwargs)

    monkeypatch.setattr(_sqlite, "configure", configure)
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        before = set(threading.enumerate())
        task = asyncio.ensure_future(Store.connect(db_path, busy_timeout=10 * CALL_TIMEOUT))
        await asyncio.sleep(0)  # the task's first step starts the worker
        (worker,) = _new_threads(before)
        assert await asyncio.to_thread(waiting.wait, CALL_TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, CALL_TIMEOUT)
        assert worker.is_alive()  # still in the busy handler: the lock is still held
    finally:
        holder.close()
    await asyncio.to_thread(worker.join, CALL_TIMEOUT)
    assert not worker.is_alive()
    assert held_by_no_connection(db_path)  # the connection was closed


def test_a_close_cut_short_by_its_loop_ending_leaves_no_traceback_on_the_worker(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while close() runs: asyncio.run cancels the close and closes the loop before the
    worker has closed the connection. The worker closes it all the same and ends, and
    nothing fails on its thread for want of the loop (aiosqlite's own close handed its
    result to the loop from the thread: a traceback on stderr)."""
    failures: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    loop = asyncio.new_event_loop()
    try:
        on = held_store(loop, db_path)
        closing = loop.create_task(on.store.close())
        for _ in range(100):  # until the close is queued behind the held call
            loop.run_until_complete(asyncio.sleep(0))
            if not on.backend._conn._running:
                break
        # What asyncio.run does as it ends: cancel every task (the store's own closing task
        # too), let them finish, close.
        left = asyncio.all_tasks(loop)
        assert {on.held, closing} <= left
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    finally:
        loop.close()
    on.hold.set()
    on.worker.join(CALL_TIMEOUT)
    assert not on.worker.is_alive()
    assert failures == []
    assert held_by_no_connection(db_path)  # the connection was closed


async def test_a_read_cancelled_while_queued_never_runs(db_path: Path) -> None:
    """A read cancelled while it waits behind another call of its store is withdrawn, as a
    write is (README, "Cancellation is safe"): it ran all the same, so reads that timed out
    while queued (a wait_for around list_jobs, check()) each still ran after their callers had
    gone, and every later call of the store waited for all of them."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=3)
        await store.insert_run(run, jobs=make_jobs(run))
        backend = store._backend
        assert backend is not None
        async with traced(store) as statements:
            async with thread_held(backend):
                reads = [
                    asyncio.ensure_future(call)
                    for call in (store.list_jobs(run.id), store.get_run(run.id), store.check())
                ]
                await asyncio.sleep(0)
                for read in reads:
                    read.cancel()
                for read in reads:
                    with pytest.raises(asyncio.CancelledError):
                        await read
            assert await store.get_job(run.id) is None  # the store carries on
        assert [sql for sql in statements if "FROM jobs WHERE id" not in sql] == [], statements


async def test_failed_give_backs_keep_nothing_in_the_warnings_registry(db_path: Path) -> None:
    """Under Python's default action for a RuntimeWarning (show once per text and place), each
    failed give-back's warning is shown, and none is kept in a ``__warningregistry__``: each
    text names its runs, so a long-lived scheduler whose give-backs kept failing grew by a
    registry entry (~800 bytes) a failure."""
    async with Store.connect(db_path, busy_timeout=0.01) as store:
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # every give-back fails: the lock is held
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("default", RuntimeWarning)
                registry = vars(_sqlite).setdefault("__warningregistry__", {})
                before = len(registry)
                for _ in range(3):
                    release = asyncio.ensure_future(store.release_runs([uuid.uuid4()]))
                    await asyncio.sleep(0)  # queued behind nothing: it starts
                    release.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await asyncio.wait_for(release, CALL_TIMEOUT)
            assert len(warned) == 3
            assert all("stay 'running'" in str(w.message) for w in warned)
            assert len(registry) == before
        finally:
            other.execute("ROLLBACK")
            other.close()
