"""Many tasks on one store: claims, redelivered records, errors and cancellation."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from control_store import JobOutcome, NotFoundError, Run, RunStatus, Store, StoreClosedError

from conftest import make_jobs, make_run


async def test_thirty_tasks_claim_every_run_exactly_once(store: Store) -> None:
    """Concurrent claimers on one store never get the same run, and drain the queue."""
    runs = [make_run() for _ in range(120)]
    for run in runs:
        await store.insert_run(run)
    claimed: list[Run] = []

    async def scheduler() -> None:
        while (run := await store.claim_next_run()) is not None:
            claimed.append(run)

    await asyncio.gather(*(scheduler() for _ in range(30)))
    assert sorted(str(r.id) for r in claimed) == sorted(str(r.id) for r in runs)
    assert all(r.status is RunStatus.RUNNING for r in claimed)


async def test_concurrent_redeliveries_count_each_job_once(store: Store) -> None:
    """Every outcome delivered by three tasks at once: done_count equals the job count."""
    run = make_run(job_count=60)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    deliveries = [JobOutcome(job.id, score=1.0) for job in jobs] * 3
    random.Random(7).shuffle(deliveries)
    results = await asyncio.gather(*(store.record_job_outcome(run.id, o) for o in deliveries))
    assert sum(results) == len(jobs)
    final = await store.get_run(run.id)
    assert final is not None
    assert final.done_count == len(jobs)
    assert final.status is RunStatus.DONE
    assert await store.check() == []


async def test_one_callers_error_does_not_undo_anothers_write(store: Store) -> None:
    """In a burst of writes, the failing ones fail alone and every other one is committed."""
    run = make_run(job_count=20)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    ghosts = make_jobs(make_run(job_count=10))
    calls = [store.record_job_outcome(run.id, JobOutcome(j.id)) for j in jobs]
    calls += [store.record_job_outcome(run.id, JobOutcome(g.id)) for g in ghosts]
    random.Random(3).shuffle(calls)
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert sum(r is True for r in results) == len(jobs)
    assert sum(isinstance(r, NotFoundError) for r in results) == len(ghosts)
    final = await store.get_run(run.id)
    assert final is not None
    assert final.done_count == len(jobs)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_cancelled_calls_take_effect_wholly_or_not_at_all(store: Store, seed: int) -> None:
    """Cancelling a third of in-flight calls leaves each done or not done, and no open txn."""
    rng = random.Random(seed)
    run = make_run(job_count=90)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    extra_runs = [make_run() for _ in range(30)]
    tasks: list[asyncio.Task[object]] = [
        asyncio.create_task(store.record_job_outcome(run.id, JobOutcome(j.id))) for j in jobs
    ]
    tasks += [asyncio.create_task(store.insert_run(r)) for r in extra_runs]
    rng.shuffle(tasks)
    await asyncio.sleep(0)  # let them start
    for task in rng.sample(tasks, len(tasks) // 3):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    backend = store._open()
    assert not await backend.read(lambda conn: conn.in_transaction)
    stored = await store.list_jobs(run.id)
    done = sum(job.outcome is not None for job in stored)
    current = await store.get_run(run.id)
    assert current is not None
    assert current.done_count == done  # the job and its run moved together, or neither did
    for extra in extra_runs:
        assert await store.get_run(extra.id) in (None, extra)
    assert await store.check() == []
    # The store keeps working: finish every job.
    for job in jobs:
        await store.record_job_outcome(run.id, JobOutcome(job.id))
    final = await store.get_run(run.id)
    assert final is not None
    assert final.status is RunStatus.DONE
    assert final.done_count == len(jobs)


async def test_close_waits_for_writes_in_flight(db_path: Path) -> None:
    """close() during a burst lets every accepted write commit; later calls are refused."""
    runs = [make_run() for _ in range(40)]
    store = await Store.connect(db_path)
    tasks = [asyncio.create_task(store.insert_run(r)) for r in runs]
    await asyncio.sleep(0)  # every task is now inside its call
    await store.close()
    await asyncio.gather(*tasks)
    with pytest.raises(StoreClosedError):
        await store.insert_run(make_run())
    async with Store.connect(db_path) as reopened:
        for run in runs:
            assert await reopened.get_run(run.id) == run
