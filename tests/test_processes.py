"""Many claimers and many reporters at once: across OS processes on one file, and across tasks."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from control_store import JobOutcome, Run, RunStatus, Store

from conftest import Worker, acked, assert_sound, make_jobs, make_run, sized

pytestmark = pytest.mark.slow


async def test_each_run_is_claimed_by_exactly_one_process(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """Processes draining one queue together claim every run exactly once, with no error."""
    runs = [make_run() for _ in range(sized(1_000, 5_000))]
    async with Store.connect(db_path) as store:
        for run in runs:
            await store.insert_run(run)
    workers = [spawn("claim", db_path) for _ in range(sized(4, 8))]
    for worker in workers:
        worker.expect("ready")
    for worker in workers:  # all connected first, so the claims really contend
        worker.go()
    claims = [acked(worker.finish(), "claimed") for worker in workers]
    counts = Counter(run_id for claimed in claims for run_id in claimed)
    assert sorted(counts) == sorted(str(run.id) for run in runs)
    assert set(counts.values()) == {1}
    assert sum(1 for claimed in claims if claimed) >= 2, "the processes did not contend"
    async with Store.connect(db_path) as store:
        assert await store.list_runs(status=RunStatus.QUEUED) == []
        assert len(await store.list_runs(status=RunStatus.RUNNING)) == len(runs)
    await assert_sound(db_path)


async def test_batch_claims_and_batch_records_across_processes_count_once(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """Processes draining one queue with claim_runs and reporting with record_job_outcomes
    (each outcome twice in its batch) claim every run once and record every job once."""
    runs = [make_run(job_count=3) for _ in range(sized(300, 1_500))]
    async with Store.connect(db_path) as store:
        for run in runs:
            await store.insert_run(run, jobs=make_jobs(run))
    workers = [spawn("claim-batches", db_path, limit) for limit in (1, 2, 3, 5)]
    for worker in workers:
        worker.expect("ready")
    for worker in workers:
        worker.go()
    lines = [line for worker in workers for line in worker.finish()]
    claims = Counter(acked(lines, "claimed"))
    assert sorted(claims) == sorted(str(run.id) for run in runs)
    assert set(claims.values()) == {1}
    firsts = Counter(acked(lines, "recorded"))
    assert len(firsts) == 3 * len(runs)
    assert set(firsts.values()) == {1}
    async with Store.connect(db_path) as store:
        assert len(await store.list_runs(status=RunStatus.DONE)) == len(runs)
    await assert_sound(db_path)


async def test_each_run_is_claimed_by_exactly_one_task(db_path: Path) -> None:
    """Tasks draining one store together claim every run exactly once, oldest first."""
    runs = [make_run() for _ in range(sized(600, 3_000))]
    async with Store.connect(db_path) as store:
        for run in runs:
            await store.insert_run(run)
        claimed: list[Run] = []

        async def drain() -> None:
            while (run := await store.claim_next_run()) is not None:
                claimed.append(run)

        await asyncio.gather(*(drain() for _ in range(sized(30, 100))))
        assert Counter(run.id for run in claimed) == Counter(run.id for run in runs)
        # Claims commit in order, so the order they were returned in is queue order.
        assert [run.id for run in claimed] == [run.id for run in runs]
        assert await store.check() == []


async def test_redelivered_outcomes_across_processes_count_each_job_once(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """Processes that each report every outcome of a run, in random orders, count each job once."""
    run = make_run(job_count=sized(300, 2_000))
    jobs = make_jobs(run)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        await store.claim_next_run()
    seeds = random.sample(range(1_000_000), sized(3, 6))
    workers = [spawn("redeliver", db_path, run.id, seed) for seed in seeds]
    for worker in workers:
        worker.expect("ready")
    for worker in workers:
        worker.go()
    reports = [w for worker in workers for w in worker.finish() if w[0] == "recorded"]
    assert len(reports) == len(jobs) * len(workers)
    firsts = Counter(job_id for _, job_id, new in reports if new == "True")
    assert sorted(firsts) == sorted(str(job.id) for job in jobs)
    assert set(firsts.values()) == {1}
    async with Store.connect(db_path) as store:
        stored = await store.get_run(run.id)
        assert stored is not None
        assert stored.done_count == len(jobs)
        assert stored.status is RunStatus.DONE
        outcomes = {job.outcome for job in await store.list_jobs(run.id)}
        assert outcomes == {JobOutcome(job.id, score=1.0) for job in jobs}
    await assert_sound(db_path)
