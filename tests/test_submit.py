"""insert_run(run, jobs=...): a run and all its jobs in one transaction, or nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from control_store import (
    AlreadyExistsError,
    ConstraintError,
    EvalJob,
    InvalidInputError,
    Job,
    JobOutcome,
    Run,
    RunStatus,
    Store,
)

from conftest import make_jobs, make_run


async def assert_absent(store: Store, run: Run) -> None:
    """Neither the run nor any job of it is stored."""
    assert await store.get_run(run.id) is None
    assert await store.list_jobs(run.id) == []


async def test_a_run_is_inserted_with_its_jobs_from_a_list_or_a_generator(store: Store) -> None:
    """The run and every job, claimable at once and complete: recording each job's outcome
    finishes it."""
    listed = make_run(job_count=3)
    listed_jobs = make_jobs(listed)
    await store.insert_run(listed, jobs=listed_jobs)
    streamed = make_run(job_count=1_000)

    def generated() -> Iterator[Job]:
        for index in range(streamed.job_count):
            yield Job(streamed.id, EvalJob("m", f"s{index}", 0))

    await store.insert_run(streamed, jobs=generated())
    assert await store.list_jobs(listed.id) == listed_jobs
    assert len(await store.list_jobs(streamed.id)) == 1_000
    claimed = await store.claim_next_run()
    assert claimed is not None
    assert claimed.id == listed.id
    for job in listed_jobs:
        assert await store.record_job_outcome(listed.id, JobOutcome(job.id))
    done = await store.get_run(listed.id)
    assert done is not None
    assert done.status is RunStatus.DONE
    assert await store.check() == []


@pytest.mark.parametrize("count", [0, 2, 4])
async def test_a_number_of_jobs_other_than_job_count_inserts_nothing(
    store: Store, count: int
) -> None:
    """Fewer jobs than job_count (none at all, too), or more: ConstraintError naming the run,
    and neither the run nor a job is stored."""
    run = make_run(job_count=3)
    jobs = [Job(run.id, EvalJob("m", f"s{index}", 0)) for index in range(count)]
    with pytest.raises(ConstraintError, match=rf"run {run.id} has job_count 3.*nothing"):
        await store.insert_run(run, jobs=jobs)
    await assert_absent(store, run)
    consumed = r"consumed it" if jobs else r"nothing was inserted: pass all 3"  # none taken
    with pytest.raises(ConstraintError, match=consumed):  # a generator: says so
        await store.insert_run(run, jobs=iter(jobs))
    await assert_absent(store, run)


async def test_a_job_of_another_run_inserts_nothing(store: Store) -> None:
    """A job whose run_id is another run's: InvalidInputError naming the job and both runs,
    and nothing is stored, the other run's jobs neither."""
    run, other = make_run(job_count=2), make_run(job_count=1)
    await store.insert_run(other)
    stray = make_jobs(other)[0]
    with pytest.raises(
        InvalidInputError, match=rf"job {stray.id} belongs to run {other.id}, not to run {run.id}"
    ):
        await store.insert_run(run, jobs=[make_jobs(run)[0], stray])
    await assert_absent(store, run)
    assert await store.list_jobs(other.id) == []


class TaggedJob(Job, frozen=True, kw_only=True):
    """A caller's own Job subclass, which the store takes as a Job."""

    tag: str = "nightly"


async def test_a_job_subclass_of_another_run_is_refused_too(store: Store) -> None:
    """A Job subclass of another run is refused as a plain Job is (it used to be inserted for
    that run, and the call to succeed with its own run short of jobs); from a generator, the
    error also says the generator was consumed."""
    run, other = make_run(job_count=2), make_run(job_count=5)
    await store.insert_run(other)
    jobs = [TaggedJob(run.id, EvalJob("m", "s0", 0)), TaggedJob(other.id, EvalJob("m", "s", 0))]
    with pytest.raises(InvalidInputError, match=rf"jobs\[1\]: job .* belongs to run {other.id}"):
        await store.insert_run(run, jobs=jobs)
    await assert_absent(store, run)
    assert await store.list_jobs(other.id) == []
    with pytest.raises(InvalidInputError, match=r"belongs to run .*consumed it"):
        await store.insert_run(run, jobs=iter(jobs))
    await assert_absent(store, run)


async def test_a_stored_or_repeated_job_id_is_named_as_such(store: Store) -> None:
    """Exactly job_count jobs, one of them with an id already stored or given twice: the
    AlreadyExistsError naming that job, as insert_jobs gives it, not a miscount."""
    first = make_run(job_count=1)
    [stored] = make_jobs(first)
    await store.insert_run(first, jobs=[stored])
    run = make_run(job_count=2)
    reused = Job(run.id, EvalJob("m", "s", 0), id=stored.id)
    with pytest.raises(
        AlreadyExistsError,
        match=rf"job {stored.id} already exists; nothing was inserted, the run {run.id} "
        r"neither: give that job of the run a fresh id",
    ):
        await store.insert_run(run, jobs=[make_jobs(run)[0], reused])
    await assert_absent(store, run)
    twice = make_jobs(run)[0]
    with pytest.raises(
        AlreadyExistsError,
        match=rf"job {twice.id} is given twice in insert_run's jobs for run {run.id}; nothing "
        r"was inserted, the run neither: give each job its own id",
    ):
        await store.insert_run(run, jobs=[twice, twice])
    await assert_absent(store, run)


class _Liar(uuid.UUID):
    """A UUID whose comparisons say it equals anything: a caller's value is never trusted
    to compare honestly."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = uuid.UUID.__hash__


async def test_a_run_id_that_lies_about_equality_cannot_slip_a_job_into_another_run(
    store: Store,
) -> None:
    """A job whose run_id is a UUID subclass claiming to equal the run's id, but naming another
    run: refused by the number it holds, never by its own __eq__, and nothing is inserted."""
    run, other = make_run(job_count=2), make_run(job_count=5)
    await store.insert_run(other)
    liar = Job(_Liar(int=other.id.int), EvalJob("m", "s", 0))
    with pytest.raises(InvalidInputError, match=rf"belongs to run {other.id}, not to run {run.id}"):
        await store.insert_run(run, jobs=[make_jobs(run)[0], liar])
    await assert_absent(store, run)
    assert await store.list_jobs(other.id) == []


async def test_an_endless_generator_is_refused_at_the_first_job_too_many(store: Store) -> None:
    """A generator that never stops is refused when it yields the job past job_count, not
    read (under the write lock) for as long as it runs."""
    run = make_run(job_count=3)
    pulled = 0

    def endless() -> Iterator[Job]:  # bounded only so that a regression fails, not hangs
        nonlocal pulled
        while pulled < 100_000:
            pulled += 1
            yield Job(run.id, EvalJob("m", f"s{pulled}", 0))

    with pytest.raises(ConstraintError, match=r"given more jobs .*pass exactly 3.*consumed it"):
        await store.insert_run(run, jobs=endless())
    assert pulled == 4
    await assert_absent(store, run)


async def test_insert_jobs_refuses_an_endless_generator_at_the_first_job_too_many(
    store: Store,
) -> None:
    """insert_jobs, too, refuses a generator's first job past its run's room as it comes (the
    run's job_count less the jobs it has, per run, a batch of two runs too), not after
    reading it (under the write lock, growing the -wal) for as long as it runs; nothing of
    the call is stored."""
    run, other = make_run(job_count=3), make_run(job_count=5)
    await store.insert_run(run)
    await store.insert_run(other)
    await store.insert_jobs(make_jobs(run, 1))
    pulled = 0

    def endless() -> Iterator[Job]:  # bounded only so that a regression fails, not hangs
        nonlocal pulled
        while pulled < 100_000:
            pulled += 1
            owner = other if pulled % 2 else run
            yield Job(owner.id, EvalJob("m", f"s{pulled}", 0))

    with pytest.raises(
        ConstraintError,
        match=rf"run {run.id} has job_count 3 and 1 job already; this call would add at least "
        r"3 more .*insert at most 2 more jobs.*consumed it",
    ):
        await store.insert_jobs(endless())
    assert pulled == 6  # run's third job of the call, the one past its room of 2
    assert len(await store.list_jobs(run.id)) == 1
    assert await store.list_jobs(other.id) == []
    assert await store.check() == []


async def test_an_existing_run_or_a_bad_job_inserts_nothing(store: Store) -> None:
    """A run id already stored (AlreadyExistsError), an invalid job (InvalidInputError), or the
    caller's own iterable failing (its exception, as raised): no job of the call is stored."""
    first = make_run(job_count=1)
    first_jobs = make_jobs(first)
    await store.insert_run(first, jobs=first_jobs)
    with pytest.raises(AlreadyExistsError, match=str(first.id)):
        await store.insert_run(first, jobs=[Job(first.id, EvalJob("m", "again", 0))])
    assert await store.list_jobs(first.id) == first_jobs
    run = make_run(job_count=2)
    done_job = Job(run.id, EvalJob("m", "s", 0), outcome=JobOutcome(run.id))
    with pytest.raises(InvalidInputError):
        await store.insert_run(run, jobs=[make_jobs(run)[0], done_job])
    await assert_absent(store, run)

    def failing() -> Iterator[Job]:
        yield make_jobs(run)[0]
        raise OSError("the manifest's file went away")

    with pytest.raises(OSError, match="went away"):
        await store.insert_run(run, jobs=failing())
    await assert_absent(store, run)


async def test_a_refused_submission_in_a_group_leaves_the_others_committed(
    db_path: object,
) -> None:
    """Concurrent submissions share a group commit: the one refused (short of jobs) stores
    nothing, and every other is stored whole."""
    async with Store.connect(str(db_path)) as store:
        runs = [make_run(job_count=2) for _ in range(6)]
        calls = [
            store.insert_run(run, jobs=make_jobs(run)[: 1 if index == 3 else 2])
            for index, run in enumerate(runs)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert [isinstance(result, ConstraintError) for result in results] == [
            index == 3 for index in range(6)
        ]
        for index, run in enumerate(runs):
            if index == 3:
                await assert_absent(store, run)
            else:
                assert len(await store.list_jobs(run.id)) == 2
        assert await store.check() == []
