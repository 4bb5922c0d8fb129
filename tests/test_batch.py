"""The batch APIs' contract, on every backend: claim_runs and record_job_outcomes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from control_store import (
    InvalidInputError,
    JobOutcome,
    JobStatus,
    NotFoundError,
    RunStatus,
    Store,
    WrongRunError,
)

from conftest import make_jobs, make_run

BASE = datetime(2026, 3, 1, tzinfo=UTC)


async def test_claim_runs_takes_the_oldest_first(store: Store) -> None:
    """claim_runs returns the oldest queued runs, oldest first, marked running."""
    runs = [make_run(created_at=BASE + timedelta(microseconds=i)) for i in range(6)]
    for run in reversed(runs):  # insertion order opposite to time order
        await store.insert_run(run)
    claimed = await store.claim_runs(4)
    assert [r.id for r in claimed] == [r.id for r in runs[:4]]
    assert all(r.status is RunStatus.RUNNING for r in claimed)
    for run in claimed:
        assert await store.get_run(run.id) == run
    rest = await store.claim_runs(10)
    assert [r.id for r in rest] == [r.id for r in runs[4:]]
    assert await store.claim_runs(1) == []


async def test_claim_runs_breaks_ties_in_insertion_order(store: Store) -> None:
    """Runs created at the same instant come back in the order they were inserted."""
    runs = [make_run(created_at=BASE) for _ in range(20)]
    for run in runs:
        await store.insert_run(run)
    assert [r.id for r in await store.claim_runs(20)] == [r.id for r in runs]


async def test_claim_runs_skips_running_and_done_runs(store: Store) -> None:
    """Only queued runs are claimed by a batch."""
    await store.insert_run(
        msgspec.structs.replace(make_run(created_at=BASE), status=RunStatus.RUNNING)
    )
    queued = make_run(created_at=BASE + timedelta(seconds=1))
    await store.insert_run(queued)
    assert [r.id for r in await store.claim_runs(5)] == [queued.id]


async def test_concurrent_claim_batches_never_share_a_run(store: Store) -> None:
    """Batches claimed by concurrent tasks are disjoint and together cover every run once."""
    runs = [make_run(created_at=BASE + timedelta(microseconds=i)) for i in range(50)]
    for run in runs:
        await store.insert_run(run)
    batches = await asyncio.gather(*(store.claim_runs(7) for _ in range(10)))
    ids = [r.id for batch in batches for r in batch]
    assert len(ids) == len(set(ids)) == 50
    assert set(ids) == {r.id for r in runs}


@pytest.mark.parametrize("limit", [0, -1, 2**63, 1.5, True, "3", None])
async def test_claim_runs_refuses_a_bad_limit(store: Store, limit: object) -> None:
    """A limit that is not an int >= 1 is an InvalidInputError naming it; nothing is claimed."""
    run = make_run()
    await store.insert_run(run)
    with pytest.raises(InvalidInputError, match=r"limit must be an int .*claim_next_run"):
        await store.claim_runs(limit)  # type: ignore[arg-type]
    assert await store.get_run(run.id) == run


async def test_record_outcomes_returns_new_or_duplicate_per_outcome(store: Store) -> None:
    """Each outcome gets True if newly recorded, False if its job was already done."""
    run = make_run(job_count=4)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    assert await store.record_job_outcome(run.id, JobOutcome(jobs[1].id, output="first"))
    outcomes = [JobOutcome(job.id, score=float(i)) for i, job in enumerate(jobs[:3])]
    assert await store.record_job_outcomes(run.id, outcomes) == [True, False, True]
    current = await store.get_run(run.id)
    assert current is not None
    assert current.done_count == 3
    assert current.status is RunStatus.QUEUED
    first = await store.get_job(jobs[1].id)
    assert first is not None
    assert first.outcome == JobOutcome(jobs[1].id, output="first")
    for i in (0, 2):
        stored = await store.get_job(jobs[i].id)
        assert stored is not None
        assert stored.status is JobStatus.DONE
        assert stored.outcome == outcomes[i]


async def test_record_outcomes_finishes_the_run(store: Store) -> None:
    """A batch holding the last outstanding jobs marks the run done with the full count."""
    run = make_run(job_count=5)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    assert await store.record_job_outcomes(run.id, [JobOutcome(j.id) for j in jobs]) == [True] * 5
    current = await store.get_run(run.id)
    assert current is not None
    assert (current.done_count, current.status) == (5, RunStatus.DONE)
    assert await store.check() == []


async def test_a_job_twice_in_one_batch_counts_once(store: Store) -> None:
    """The first occurrence of a job in a batch wins; the second is a redelivery."""
    run = make_run(job_count=3)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    batch = [JobOutcome(jobs[0].id, output="a"), JobOutcome(jobs[0].id, output="b")]
    assert await store.record_job_outcomes(run.id, batch) == [True, False]
    current = await store.get_run(run.id)
    assert current is not None
    assert current.done_count == 1
    stored = await store.get_job(jobs[0].id)
    assert stored is not None
    assert stored.outcome == batch[0]


async def test_an_unknown_job_in_a_batch_records_nothing(store: Store) -> None:
    """One outcome for a job the store lacks fails the whole batch with NotFoundError, which
    names its place in the batch and says the batch recorded nothing."""
    run = make_run(job_count=3)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    ghost = uuid.uuid4()
    batch = [JobOutcome(jobs[0].id), JobOutcome(ghost), JobOutcome(jobs[1].id)]
    with pytest.raises(NotFoundError, match=rf"^outcomes\[1\]: job {ghost} does not exist") as e:
        await store.record_job_outcomes(run.id, batch)
    assert "nothing of this call was recorded (a batch is all or nothing)" in str(e.value)
    assert str(e.value).endswith(", or leave it out of the batch")
    assert await store.get_run(run.id) == run
    assert await store.list_jobs(run.id) == jobs


async def test_another_runs_job_in_a_batch_records_nothing(store: Store) -> None:
    """One outcome for another run's job fails the whole batch with WrongRunError, which names
    its place in the batch."""
    run, other = make_run(job_count=2), make_run(job_count=2)
    jobs, others = make_jobs(run), make_jobs(other)
    for r in (run, other):
        await store.insert_run(r)
    await store.insert_jobs([*jobs, *others])
    batch = [JobOutcome(jobs[0].id), JobOutcome(others[0].id)]
    with pytest.raises(
        WrongRunError, match=rf"^outcomes\[1\]: job {others[0].id}.*{other.id}.*{run.id}"
    ):
        await store.record_job_outcomes(run.id, batch)
    assert await store.get_run(run.id) == run
    assert await store.get_run(other.id) == other
    assert await store.list_jobs(run.id) == jobs


async def test_a_bad_outcome_in_a_batch_records_nothing(store: Store) -> None:
    """An outcome JSON cannot hold fails the batch before anything is written."""
    run = make_run(job_count=2)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    batch = [JobOutcome(jobs[0].id), JobOutcome(jobs[1].id, score=float("nan"))]
    with pytest.raises(InvalidInputError, match=f"{jobs[1].id}.*not finite"):
        await store.record_job_outcomes(run.id, batch)
    with pytest.raises(InvalidInputError, match="expected a JobOutcome"):
        await store.record_job_outcomes(run.id, [JobOutcome(jobs[0].id), "done"])  # type: ignore[list-item]
    assert await store.get_run(run.id) == run
    assert await store.list_jobs(run.id) == jobs


async def test_what_an_outcome_generator_raises_reaches_the_caller_untouched(store: Store) -> None:
    """The caller's own exception, even a ControlError the store itself might raise, comes back
    as the very object with its message as it was, however often it is raised."""
    run = make_run(job_count=1)
    (job,) = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs([job])
    mine = InvalidInputError("score file line 3: not a number")

    def outcomes() -> Iterator[JobOutcome]:
        yield JobOutcome(job.id)
        raise mine

    for _ in range(2):
        with pytest.raises(InvalidInputError) as caught:
            await store.record_job_outcomes(run.id, outcomes())
        assert caught.value is mine
        assert str(mine) == "score file line 3: not a number"
    assert await store.get_run(run.id) == run


async def test_a_refused_item_is_named_by_its_place_in_the_batch(store: Store) -> None:
    """An item of a batch that is refused, from a list or a generator, is named by its place
    (a None has no id to name it by), and the message says nothing of the call was written."""
    run = make_run(job_count=3)
    jobs = make_jobs(run)
    await store.insert_run(run)
    with_none: list[Any] = [jobs[0], None]
    with pytest.raises(InvalidInputError, match=r"^jobs\[1\]: expected a Job, got NoneType: None"):
        await store.insert_jobs(with_none)
    bad = msgspec.structs.replace(jobs[2], attempt=-1)
    with pytest.raises(InvalidInputError, match=rf"^jobs\[2\]: job {bad.id}: attempt"):
        await store.insert_jobs(job for job in [*jobs[:2], bad])
    assert await store.list_jobs(run.id) == []
    await store.insert_jobs(jobs)
    outcomes: Iterator[Any] = iter([JobOutcome(jobs[0].id), None])
    with pytest.raises(
        InvalidInputError,
        match=r"^outcomes\[1\]: expected a JobOutcome, got NoneType: None; nothing of this call",
    ):
        await store.record_job_outcomes(run.id, outcomes)
    assert await store.get_run(run.id) == run


async def test_record_outcomes_refuses_bad_arguments(store: Store) -> None:
    """A non-UUID run id or a single outcome instead of a batch is refused with the fix."""
    run = make_run()
    outcome = JobOutcome(uuid.uuid4())
    with pytest.raises(InvalidInputError, match=r"uuid\.UUID\("):
        await store.record_job_outcomes(str(run.id), [outcome])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="wrap a single outcome in a list"):
        await store.record_job_outcomes(run.id, outcome)  # type: ignore[arg-type]
    # No outcome to wrap: the fix is a list, or (for an async iterator) collecting it.
    with pytest.raises(InvalidInputError, match=r"got NoneType; .*pass a list \(or any iterable\)"):
        await store.record_job_outcomes(run.id, None)  # type: ignore[arg-type]

    async def later() -> AsyncGenerator[JobOutcome, None]:
        yield outcome

    pending = later()
    with pytest.raises(InvalidInputError, match=r"collect an async iterator first") as caught:
        await store.record_job_outcomes(run.id, pending)  # type: ignore[arg-type]
    assert "insert" not in str(caught.value)
    await pending.aclose()


async def test_an_empty_batch_records_nothing(store: Store) -> None:
    """An empty batch returns [] and changes nothing, even for a run that does not exist."""
    assert await store.record_job_outcomes(uuid.uuid4(), []) == []
    assert await store.record_job_outcomes(uuid.uuid4(), iter([])) == []


async def test_batch_and_single_records_agree_under_redelivery(store: Store) -> None:
    """Interleaved single and batch deliveries of the same outcomes count each job once."""
    run = make_run(job_count=30)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    outcomes = [JobOutcome(job.id, score=1.0) for job in jobs]
    batches = asyncio.gather(
        store.record_job_outcomes(run.id, outcomes[:20]),
        store.record_job_outcomes(run.id, outcomes[10:]),
    )
    singles = asyncio.gather(*(store.record_job_outcome(run.id, o) for o in outcomes[::3]))
    (first, second), single = await asyncio.gather(batches, singles)
    assert sum(first) + sum(second) + sum(single) == 30
    current = await store.get_run(run.id)
    assert current is not None
    assert (current.done_count, current.status) == (30, RunStatus.DONE)
    assert await store.check() == []
