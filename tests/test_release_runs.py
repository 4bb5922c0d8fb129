"""A scheduler that stops with runs it claimed gives them back through the store."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_store import (
    DatabaseBusyError,
    InvalidInputError,
    Job,
    JobOutcome,
    ReadOnlyStoreError,
    RunStatus,
    Store,
    WrongEventLoopError,
)

from conftest import make_jobs, make_run


async def test_a_scheduler_stopping_gives_back_the_runs_it_holds(store: Store) -> None:
    """release_runs queues again the claimed runs still running, in their place (the next
    claim takes the oldest again), leaves one done meanwhile done, counts an id given twice
    once and an unknown id not at all, and keeps the store sound."""
    runs = [make_run(job_count=2) for _ in range(3)]
    for run in runs:
        await store.insert_run(run, jobs=make_jobs(run))
    held = await store.claim_runs(3)
    assert [r.id for r in held] == [r.id for r in runs]
    # One of them finished meanwhile (its workers outlived the claim): left done.
    for job in await store.list_jobs(runs[2].id):
        await store.record_job_outcome(runs[2].id, JobOutcome(job.id))
    assert await store.release_runs(run.id for run in held) == 2  # any iterable, a generator too
    stored = [await store.get_run(run.id) for run in runs]
    assert [r.status if r else None for r in stored] == [
        RunStatus.QUEUED,
        RunStatus.QUEUED,
        RunStatus.DONE,
    ]
    assert [r.done_count if r else None for r in stored] == [0, 0, 2]
    again = await store.claim_next_run()
    assert again is not None
    assert again.id == runs[0].id
    assert await store.release_runs([again.id, again.id]) == 1
    assert await store.release_runs([]) == 0
    assert await store.release_runs([uuid.uuid4()]) == 0  # unknown: nothing to give back
    assert await store.release_runs([runs[1].id]) == 0  # queued already: left as it is
    assert await store.check() == []


async def test_release_runs_refuses_bad_ids_and_changes_nothing(store: Store) -> None:
    """An argument that is no iterable of UUIDs is an InvalidInputError naming it, and nothing
    is given back, not even the good ids before a bad one."""
    run = make_run()
    await store.insert_run(run, jobs=make_jobs(run))
    claimed = await store.claim_next_run()
    assert claimed is not None
    with pytest.raises(InvalidInputError, match="run_id"):
        await store.release_runs([run.id, "not an id"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="run_ids") as one_id:
        await store.release_runs(run.id)  # type: ignore[arg-type]
    assert str(one_id.value).endswith("nothing was given back: wrap a single id in a list")
    with pytest.raises(InvalidInputError, match="run_ids") as one_run:
        await store.release_runs(run)  # type: ignore[arg-type]
    assert str(one_run.value).endswith(
        "nothing was given back: pass [run.id]: a list of the runs' ids, not a Run"
    )
    stored = await store.get_run(run.id)
    assert stored is not None
    assert stored.status is RunStatus.RUNNING


async def test_release_runs_is_refused_on_a_read_only_store(db_path: Path) -> None:
    """A read-only store gives nothing back: ReadOnlyStoreError, the run still running."""
    async with Store.connect(db_path) as store:
        run = make_run()
        await store.insert_run(run, jobs=make_jobs(run))
        await store.claim_next_run()
    async with Store.connect(db_path, read_only=True) as ro:
        with pytest.raises(ReadOnlyStoreError, match="release_runs"):
            await ro.release_runs([run.id])
        stored = await ro.get_run(run.id)
        assert stored is not None
        assert stored.status is RunStatus.RUNNING


async def test_a_generator_of_ids_a_busy_release_consumed_is_named_in_its_error(
    db_path: Path,
) -> None:
    """A retryable error of a release given a generator says the generator was consumed: the
    retry it invites, with that same generator, would give back nothing and return 0, leaving
    the runs 'running' for good."""
    async with Store.connect(db_path, busy_timeout=0.05) as store:
        run = make_run()
        await store.insert_run(run, jobs=make_jobs(run))
        claimed = await store.claim_next_run()
        assert claimed is not None
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(DatabaseBusyError, match="consumed it"):
                await store.release_runs(r for r in [claimed.id])
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert await store.release_runs(r for r in [claimed.id]) == 1


async def test_a_release_refused_from_another_loop_leaves_its_generator_unread(
    store: Store,
) -> None:
    """Refused from another event loop, a release has not read its generator: the retry from
    the store's own loop, with the same generator, gives the runs back."""
    run = make_run()
    await store.insert_run(run, jobs=make_jobs(run))
    claimed = await store.claim_next_run()
    assert claimed is not None
    ids = iter([claimed.id])
    refused: list[BaseException] = []

    def elsewhere() -> None:
        async def call() -> None:
            try:
                await store.release_runs(ids)
            except WrongEventLoopError as exc:
                refused.append(exc)

        asyncio.run(call())

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(refused) == 1
    assert await store.release_runs(ids) == 1


async def test_a_cancelled_release_still_gives_its_runs_back(store: Store) -> None:
    """A release cancelled while it waits behind another write of its store is not withdrawn:
    when the cancellation reaches the caller, the runs are queued again. Withdrawn, they would
    stay 'running', which the caller cannot tell from 'given back, and claimed by another
    scheduler since', so releasing again could hand a run to two schedulers."""
    run = make_run()
    await store.insert_run(run, jobs=make_jobs(run))
    claimed = await store.claim_next_run()
    assert claimed is not None
    other = make_run(job_count=1)
    await store.insert_run(other)
    gate = threading.Event()

    def slow_jobs() -> Iterator[Job]:  # holds the store's writer until the gate opens
        gate.wait(10)
        yield from make_jobs(other)

    insert = asyncio.ensure_future(store.insert_jobs(slow_jobs()))
    await asyncio.sleep(0.05)
    release = asyncio.ensure_future(store.release_runs([claimed.id]))
    await asyncio.sleep(0.05)
    release.cancel()
    gate.set()
    await asyncio.gather(insert, release, return_exceptions=True)
    assert release.cancelled()
    stored = await store.get_run(run.id)
    assert stored is not None
    assert stored.status is RunStatus.QUEUED
