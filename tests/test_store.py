"""The store's contract, on every backend: runs, jobs, claims and idempotent outcomes."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import AsyncGenerator, Iterator
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import cast

import msgspec
import pytest

from control_store import (
    AlreadyExistsError,
    ConfigurationError,
    ConstraintError,
    EvalJob,
    InvalidInputError,
    Job,
    JobId,
    JobOutcome,
    JobStatus,
    MissingRunError,
    NotFoundError,
    Run,
    RunId,
    RunStatus,
    Store,
    StoreClosedError,
    WrongRunError,
    _sqlite,
)

from conftest import group_in_flight, make_jobs, make_run, query_plan, raw_db


async def test_insert_then_get_run(store: Store) -> None:
    """A run reads back equal to what was inserted."""
    run = make_run()
    await store.insert_run(run)
    assert await store.get_run(run.id) == run
    assert await store.get_run(uuid.uuid4()) is None


async def test_claim_moves_run_to_running_then_none(store: Store) -> None:
    """Claiming takes the queued run, marks it running, and then there is none left."""
    run = make_run()
    await store.insert_run(run)
    claimed = await store.claim_next_run()
    assert claimed is not None
    assert claimed.id == run.id
    assert claimed.status is RunStatus.RUNNING
    assert await store.get_run(run.id) == claimed
    assert await store.claim_next_run() is None


async def test_record_outcome_advances_done_count_and_finishes_run(store: Store) -> None:
    """Each new outcome advances done_count; the last one marks the run done."""
    run = make_run(job_count=3)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    await store.claim_next_run()
    for i, job in enumerate(jobs, start=1):
        assert await store.record_job_outcome(run.id, JobOutcome(job.id, score=0.5 * i))
        current = await store.get_run(run.id)
        assert current is not None
        assert current.done_count == i
        assert current.status is (RunStatus.DONE if i == 3 else RunStatus.RUNNING)
    stored = await store.get_job(jobs[0].id)
    assert stored is not None
    assert stored.status is JobStatus.DONE
    assert stored.outcome == JobOutcome(jobs[0].id, score=0.5)


async def test_recording_the_same_job_twice_counts_once(store: Store) -> None:
    """A redelivered outcome returns False, and the first delivery's outcome stands."""
    run = make_run(job_count=2)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    first = JobOutcome(jobs[0].id, score=1.0, output="first")
    assert await store.record_job_outcome(run.id, first)
    assert not await store.record_job_outcome(run.id, first)
    assert not await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, output="second"))
    current = await store.get_run(run.id)
    assert current is not None
    assert current.done_count == 1
    assert current.status is RunStatus.QUEUED
    stored = await store.get_job(jobs[0].id)
    assert stored is not None
    assert stored.outcome == first


async def test_claims_are_oldest_first_at_microsecond_resolution(store: Store) -> None:
    """Runs a microsecond apart are claimed in time order, whatever the insertion order."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    later = make_run(created_at=base + timedelta(microseconds=1))
    earlier = make_run(created_at=base)
    latest = make_run(created_at=base + timedelta(seconds=1))
    for run in (latest, later, earlier):
        await store.insert_run(run)
    claimed = [await store.claim_next_run() for _ in range(3)]
    assert [r.id for r in claimed if r is not None] == [earlier.id, later.id, latest.id]


async def test_claim_ties_break_in_insertion_order(store: Store) -> None:
    """Runs created at the same instant are claimed in the order they were inserted."""
    moment = datetime(2026, 5, 5, 12, 0, tzinfo=UTC)
    runs = [make_run(created_at=moment) for _ in range(5)]
    for run in runs:
        await store.insert_run(run)
    claimed = [await store.claim_next_run() for _ in runs]
    assert [r.id for r in claimed if r is not None] == [r.id for r in runs]


async def test_claim_skips_running_and_done_runs(store: Store) -> None:
    """Only queued runs are claimed."""
    done = make_run(job_count=1)
    await store.insert_run(done)
    (job,) = make_jobs(done)
    await store.insert_jobs([job])
    assert await store.claim_next_run() == msgspec.structs.replace(done, status=RunStatus.RUNNING)
    assert await store.record_job_outcome(done.id, JobOutcome(job.id, score=1.0))
    assert (await store.get_run(done.id)) == msgspec.structs.replace(
        done, status=RunStatus.DONE, done_count=1
    )
    await store.insert_run(msgspec.structs.replace(make_run(), status=RunStatus.RUNNING))
    queued = make_run()
    await store.insert_run(queued)
    claimed = await store.claim_next_run()
    assert claimed is not None
    assert claimed.id == queued.id
    assert await store.claim_next_run() is None


@pytest.mark.parametrize(
    "created_at",
    [
        datetime(2026, 1, 1, 0, 0, 0, 0, tzinfo=UTC),
        datetime(2026, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
        datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(2026, 6, 1, 12, 0, 0, 500000, tzinfo=timezone(timedelta(hours=-7))),
    ],
    ids=["zero-fraction", "one-microsecond", "last-microsecond", "non-utc-offset"],
)
async def test_timestamps_round_trip_exactly(store: Store, created_at: datetime) -> None:
    """created_at reads back as the same instant, in UTC, to the microsecond."""
    run = make_run(created_at=created_at)
    await store.insert_run(run)
    stored = await store.get_run(run.id)
    assert stored is not None
    assert stored.created_at == created_at
    assert stored.created_at.tzinfo is UTC
    assert stored == run


async def test_unicode_and_large_integers_round_trip(store: Store) -> None:
    """Text in any script and 64-bit integers survive the store unchanged."""
    run = Run("évals/数学 🧪.yaml", ["модель", "模型-β", ""], 2**62, 2**63 - 1)
    await store.insert_run(run)
    assert await store.get_run(run.id) == run
    job = Job(run.id, EvalJob("模型-β", "sample \u0000 nul", -(2**63)))
    await store.insert_jobs([job])
    assert await store.get_job(job.id) == job
    outcome = JobOutcome(job.id, score=-1e308, output="résultat\n🎯", error="ошибка")
    assert await store.record_job_outcome(run.id, outcome)
    stored = await store.get_job(job.id)
    assert stored is not None
    assert stored.outcome == outcome


async def test_list_jobs_returns_a_runs_jobs_in_insertion_order(store: Store) -> None:
    """list_jobs gives exactly the run's jobs, in the order they were inserted."""
    run, other = make_run(job_count=4), make_run()
    await store.insert_run(run)
    await store.insert_run(other)
    jobs = make_jobs(run)
    await store.insert_jobs(jobs[:2])
    await store.insert_jobs(make_jobs(other))
    await store.insert_jobs(jobs[2:])
    assert await store.list_jobs(run.id) == jobs
    assert await store.list_jobs(uuid.uuid4()) == []


async def test_insert_jobs_accepts_a_generator(store: Store) -> None:
    """Any iterable of jobs is stored, a generator included."""
    run = make_run(job_count=50)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await store.insert_jobs(job for job in jobs)
    assert await store.list_jobs(run.id) == jobs


class _Unprintable(ValueError):
    """An exception whose message cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


# What a caller's source of jobs may raise that looks like one of the store's own failures: a
# locked or failing other database, a closed connection, a value too large; or that cannot
# even say what it is.
_SOURCE_FAILURES = [
    sqlite3.OperationalError("database is locked"),
    sqlite3.ProgrammingError("Cannot operate on a closed cursor."),
    ValueError("Connection closed"),
    OverflowError("Python int too large to convert to SQLite INTEGER"),
    _Unprintable(),
]


def _failing_after_one(run: Run, raised: Exception) -> Iterator[Job]:
    yield make_jobs(run, 1)[0]
    raise raised


@pytest.mark.parametrize("raised", _SOURCE_FAILURES, ids=lambda exc: type(exc).__name__)
async def test_what_a_job_generator_raises_reaches_the_caller_as_it_is(
    store: Store, raised: Exception
) -> None:
    """An exception from the caller's own generator is the caller's, however much it looks like
    the store's: insert_jobs raises that very exception, not a ControlError blaming the store,
    inserts nothing, and the store goes on working."""
    run = make_run(job_count=2)
    await store.insert_run(run)
    with pytest.raises(type(raised)) as caught:
        await store.insert_jobs(_failing_after_one(run, raised))
    assert caught.value is raised
    assert await store.list_jobs(run.id) == []
    jobs = make_jobs(run)
    await store.insert_jobs(jobs)
    assert await store.list_jobs(run.id) == jobs


async def test_a_failing_job_generator_in_a_group_fails_only_its_own_call(db_path: Path) -> None:
    """Grouped with other writes, a generator that raises fails its own insert_jobs alone, with
    its own exception; the others commit."""
    async with Store.connect(db_path) as store:
        run, other = make_run(job_count=2), make_run(job_count=2)
        await store.insert_run(run)
        ahead = await group_in_flight(store)
        raised = _Unprintable()
        failed, *others = await asyncio.gather(
            store.insert_jobs(_failing_after_one(run, raised)),
            store.insert_run(other),
            store.insert_jobs(make_jobs(other)),
            return_exceptions=True,
        )
        await ahead
        assert failed is raised
        assert others == [None, None]
        assert await store.list_jobs(run.id) == []
        assert len(await store.list_jobs(other.id)) == 2
        assert await store.check() == []


class _RunIdSubclass(uuid.UUID):
    """A uuid.UUID subclass, accepted as a run id like uuid.UUID itself."""


async def test_insert_jobs_keeps_each_jobs_own_run(store: Store) -> None:
    """Jobs of several runs in one batch, in blocks or interleaved, each keep their own run."""
    a, b, c = (make_run(job_count=6) for _ in range(3))
    for run in (a, b, c):
        await store.insert_run(run)
    spec = EvalJob("m", "s", 0)
    same_value = uuid.UUID(str(c.id))  # equal to c.id, but another object
    subclass = _RunIdSubclass(int=c.id.int)
    run_ids = [a.id, a.id, b.id, a.id, b.id, b.id, c.id, same_value, subclass, a.id, c.id]
    jobs = [Job(run_id, spec) for run_id in run_ids]
    await store.insert_jobs(iter(jobs))
    for run in (a, b, c):
        assert await store.list_jobs(run.id) == [job for job in jobs if job.run_id == run.id]


class _ShortId(uuid.UUID):
    """A uuid.UUID subclass that prints itself its own way, as some codebases' id types do."""

    def __str__(self) -> str:
        return "id-" + self.hex[:8]


async def test_ids_of_a_uuid_subclass_are_stored_as_their_canonical_text(store: Store) -> None:
    """A UUID subclass with its own __str__ is stored under the id's canonical text, so plain
    uuid.UUIDs find the rows and every later call reads them."""
    run = msgspec.structs.replace(make_run(job_count=2), id=RunId(_ShortId(int=uuid.uuid4().int)))
    jobs = [
        Job(
            _ShortId(int=run.id.int),
            EvalJob("m", str(i), 0),
            id=JobId(_ShortId(int=uuid.uuid4().int)),
        )
        for i in range(2)
    ]
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    plain = uuid.UUID(int=run.id.int)
    assert await store.get_run(plain) == run
    assert await store.get_job(uuid.UUID(int=jobs[0].id.int)) == jobs[0]
    assert (await store.claim_next_run()) == msgspec.structs.replace(run, status=RunStatus.RUNNING)
    assert await store.record_job_outcome(run.id, JobOutcome(_ShortId(int=jobs[0].id.int)))
    assert await store.record_job_outcomes(_ShortId(int=plain.int), [JobOutcome(jobs[1].id)]) == [
        True
    ]
    assert (await store.get_run(plain)) == msgspec.structs.replace(
        run, status=RunStatus.DONE, done_count=2
    )
    assert await store.check() == []


async def test_a_missing_run_among_interleaved_runs_is_named(store: Store) -> None:
    """A batch switching runs names the failing job and its own run, not its neighbour's."""
    run = make_run()
    await store.insert_run(run)
    ghost = uuid.uuid4()
    orphan = Job(ghost, EvalJob("m", "s", 0))
    jobs = [Job(run.id, EvalJob("m", "s", 0)), orphan, Job(run.id, EvalJob("m", "s", 1))]
    with pytest.raises(MissingRunError, match=f"job {orphan.id} refers to run {ghost},"):
        await store.insert_jobs(jobs)
    assert await store.list_jobs(run.id) == []


@pytest.mark.parametrize("position", [0, 1], ids=["first", "after-a-good-job"])
async def test_a_job_without_a_run_id_is_refused(store: Store, position: int) -> None:
    """A run_id that is not a UUID is an InvalidInputError, first in a batch or later."""
    run = make_run()
    await store.insert_run(run)
    bad = Job(None, EvalJob("m", "s", 0))  # type: ignore[arg-type]
    jobs = make_jobs(run, 2)
    jobs.insert(position, bad)
    with pytest.raises(InvalidInputError, match=rf"job {bad.id}: run_id must be a uuid\.UUID"):
        await store.insert_jobs(jobs)
    assert await store.list_jobs(run.id) == []


async def test_duplicate_run_id_is_refused(store: Store) -> None:
    """Inserting a run id twice is an AlreadyExistsError naming the id; the first stays."""
    run = make_run()
    await store.insert_run(run)
    with pytest.raises(AlreadyExistsError, match=str(run.id)):
        await store.insert_run(msgspec.structs.replace(make_run(), id=run.id))
    assert await store.get_run(run.id) == run


async def test_insert_jobs_is_all_or_nothing_on_a_duplicate_id(store: Store) -> None:
    """A batch with one already-stored job id inserts none of its jobs."""
    run = make_run(job_count=5)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await store.insert_jobs(jobs[:1])
    with pytest.raises(AlreadyExistsError) as caught:
        await store.insert_jobs([jobs[1], jobs[2], jobs[0], jobs[3]])
    assert str(caught.value) == (
        f"job {jobs[0].id} already exists; no job of this call was inserted: drop it from the "
        "batch, or give it a fresh id"
    )
    assert await store.list_jobs(run.id) == jobs[:1]


@pytest.mark.parametrize("first", [0, 2], ids=["first-job", "later-job"])
async def test_a_job_given_twice_in_one_batch_is_told_so(store: Store, first: int) -> None:
    """A job id twice in one insert_jobs batch is refused as given twice, not as one already
    stored (a caller told so could drop it, and it would never be inserted); nothing is."""
    run = make_run(job_count=5)
    await store.insert_run(run)
    jobs = make_jobs(run)
    batch = [*jobs[:first], jobs[first], jobs[3], jobs[first], jobs[4]]
    with pytest.raises(AlreadyExistsError) as caught:
        await store.insert_jobs(batch)
    assert str(caught.value) == (
        f"job {jobs[first].id} is given twice in this call's jobs; no job of this call was "
        "inserted: give each job its own id (Job(...) makes one by default)"
    )
    assert await store.list_jobs(run.id) == []
    await store.insert_jobs(jobs)  # the fix: each job once
    assert await store.list_jobs(run.id) == jobs


async def test_a_duplicate_past_the_largest_rowid_is_told_as_either(db_path: Path) -> None:
    """Once a jobs row holds the largest rowid there is, SQLite picks new rowids at random, and
    the rows a call inserted can no longer be told by them: the refusal names both causes."""
    run = make_run(job_count=4)
    jobs = make_jobs(run, 4)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs[:1])
        with raw_db(db_path) as conn:
            conn.execute("UPDATE jobs SET rowid = 9223372036854775807")
        with pytest.raises(AlreadyExistsError) as caught:
            await store.insert_jobs([jobs[1], jobs[0]])
        assert str(caught.value).startswith(
            f"job {jobs[0].id} already exists, or is given twice in this call's jobs;"
        )
        assert await store.list_jobs(run.id) == jobs[:1]


async def test_in_one_group_commit_a_job_twice_is_told_apart_from_another_calls(
    db_path: Path,
) -> None:
    """Calls grouped into one transaction: a job inserted by an earlier call of the group is
    one that already exists for a later call, and a job given twice in a call is that call's
    own mistake; each failing call inserts nothing, the others all they were given."""
    run = make_run(job_count=6)
    jobs = make_jobs(run)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        results = await asyncio.gather(
            store.insert_run(make_run()),  # on the thread while the four below queue up
            store.insert_jobs(jobs[:2]),
            store.insert_jobs([jobs[2], jobs[1]]),  # jobs[1]: the first call's
            store.insert_jobs([jobs[3], jobs[4], jobs[3]]),  # jobs[3] twice
            store.insert_jobs([jobs[5]]),
            return_exceptions=True,
        )
        assert results[0] is None
        assert results[1] is None
        assert results[4] is None
        assert isinstance(results[2], AlreadyExistsError)
        assert str(results[2]).startswith(f"job {jobs[1].id} already exists;")
        assert isinstance(results[3], AlreadyExistsError)
        assert str(results[3]).startswith(f"job {jobs[3].id} is given twice in this call's jobs;")
        assert await store.list_jobs(run.id) == [*jobs[:2], jobs[5]]


async def test_job_for_a_missing_run_is_refused(store: Store) -> None:
    """A job whose run does not exist is a MissingRunError naming both; nothing is inserted."""
    run = make_run()
    await store.insert_run(run)
    ghost = uuid.uuid4()
    good = make_jobs(run)
    orphan = Job(ghost, EvalJob("m", "s", 0))
    with pytest.raises(MissingRunError, match=f"{orphan.id}.*{ghost}"):
        await store.insert_jobs([*good, orphan])
    assert await store.list_jobs(run.id) == []
    assert await store.get_job(orphan.id) is None


async def test_invalid_job_in_a_batch_inserts_nothing(store: Store) -> None:
    """A job that cannot be stored, late in a batch, leaves the whole batch out."""
    run = make_run()
    await store.insert_run(run)
    jobs = make_jobs(run)
    bad = Job(run.id, EvalJob("m", "s", 2**64))
    with pytest.raises(InvalidInputError, match=r"spec\.epoch"):
        await store.insert_jobs([*jobs, bad])
    assert await store.list_jobs(run.id) == []


async def test_outcome_for_an_unknown_job_changes_nothing(store: Store) -> None:
    """An outcome for a job the store lacks is a NotFoundError; the run is untouched."""
    run = make_run()
    await store.insert_run(run)
    await store.insert_jobs(make_jobs(run))
    ghost = uuid.uuid4()
    with pytest.raises(NotFoundError, match=str(ghost)):
        await store.record_job_outcome(run.id, JobOutcome(ghost, score=1.0))
    assert await store.get_run(run.id) == run


async def test_outcome_for_another_runs_job_changes_nothing(store: Store) -> None:
    """An outcome reported under the wrong run is a WrongRunError; neither run changes."""
    run, other = make_run(), make_run()
    await store.insert_run(run)
    await store.insert_run(other)
    jobs = make_jobs(run)
    await store.insert_jobs(jobs)
    with pytest.raises(WrongRunError, match=f"{jobs[0].id}.*{run.id}.*{other.id}"):
        await store.record_job_outcome(other.id, JobOutcome(jobs[0].id, score=1.0))
    assert await store.get_run(run.id) == run
    assert await store.get_run(other.id) == other
    assert await store.get_job(jobs[0].id) == jobs[0]


@pytest.mark.parametrize(
    ("run", "match"),
    [
        (Run("m", ["a"], 0, 1), r"epochs is 0, below 1 \(a run evaluates at least once\)"),
        (Run("m", ["a"], 1, -1), r"job_count is -1, below 1 \(.* no jobs could never be done"),
        (Run("m", ["a"], 1, 2**63), r"job_count is \d+, outside 1\.\.\d+; SQLite stores 64-bit"),
        (Run("m", ["a"], 1, 0), r"job_count is 0, .* a run of no jobs could never be done"),
        (Run("m", ["a"], 1, 3, done_count=2), "done_count is 2, but a new run has no jobs yet"),
        (
            Run("m", ["a"], 1, 1, status=RunStatus.DONE),
            r"status is 'done', but a new run has no jobs yet.*insert it queued \(or running\)",
        ),
        (Run("m", ["a"], 1, 1, created_at=datetime(2026, 1, 1)), "no time zone"),
        (Run("m", ["a", 3], 1, 1), "models"),  # type: ignore[list-item]
        (Run("m", ["a"], 1, 1, status="paused"), "paused"),  # type: ignore[arg-type]
        (Run(7, ["a"], 1, 1), "manifest"),  # type: ignore[arg-type]
        (
            Run(
                "m", ["a"], 1, 1, created_at=datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
            ),
            r"created_at .* is outside 0001-01-01\.\.9999-12-31 once in UTC",
        ),
        (Run("suite-\udce9.yaml", ["a"], 1, 1), r"manifest holds '\\udce9' at index 6, a lone"),
        (Run("m", ["a", "b\ud800"], 1, 1), r"models\[1\] holds '\\ud800' at index 1, a lone"),
    ],
    ids=[
        "zero-epochs",
        "negative-job-count",
        "overflow",
        "no-jobs",
        "done-count-at-insert",
        "done-at-insert",
        "naive-time",
        "model-not-str",
        "bad-status",
        "manifest-not-str",
        "before-year-1-in-utc",
        "manifest-surrogate",
        "model-surrogate",
    ],
)
async def test_bad_run_is_refused_and_nothing_stored(store: Store, run: Run, match: str) -> None:
    """A run the store cannot keep faithfully is an InvalidInputError naming the field."""
    with pytest.raises(InvalidInputError, match=match):
        await store.insert_run(run)
    assert await store.get_run(run.id) is None


@pytest.mark.parametrize(
    "outcome",
    [
        JobOutcome(uuid.uuid4(), score=float("nan")),
        JobOutcome(uuid.uuid4(), score=float("inf")),
        JobOutcome("not-a-uuid"),  # type: ignore[arg-type]
        JobOutcome(uuid.uuid4(), output=None),  # type: ignore[arg-type]
        JobOutcome(uuid.uuid4(), score=10**400),
        JobOutcome(uuid.uuid4(), output="stdout: \udcff\udcfe"),
        JobOutcome(uuid.uuid4(), error="\ud83d"),
    ],
    ids=[
        "nan",
        "inf",
        "str-id",
        "none-output",
        "int-beyond-float",
        "output-surrogate",
        "error-surrogate",
    ],
)
async def test_bad_outcome_is_refused(store: Store, outcome: JobOutcome) -> None:
    """An outcome JSON cannot hold is an InvalidInputError, and nothing changes."""
    run = make_run()
    await store.insert_run(run)
    with pytest.raises(InvalidInputError):
        await store.record_job_outcome(run.id, outcome)
    assert await store.get_run(run.id) == run


@pytest.mark.parametrize("state", ["done", "done-value", "outcome"])
async def test_a_job_inserted_done_or_with_an_outcome_is_refused(store: Store, state: str) -> None:
    """Only a recorded outcome marks a job done and counts it: a batch holding a job inserted
    done, or with an outcome already, is refused whole, and the store stays consistent."""
    run = make_run()
    await store.insert_run(run)
    jobs = make_jobs(run)
    bad = jobs[1]
    if state == "outcome":
        bad = msgspec.structs.replace(bad, outcome=JobOutcome(bad.id, score=1.0))
    else:
        status = JobStatus.DONE if state == "done" else "done"
        bad = msgspec.structs.replace(bad, status=cast(JobStatus, status))
    given = "it has an outcome" if state == "outcome" else "status is 'done'"
    with pytest.raises(
        InvalidInputError,
        match=rf"job {bad.id}: {given}, but a new job has no outcome yet; no job of this call "
        r"was inserted: .*record_job_outcome\(s\)",
    ):
        await store.insert_jobs([jobs[0], bad, jobs[2]])
    assert await store.list_jobs(run.id) == []
    assert await store.check() == []


async def test_a_run_never_gets_more_jobs_than_its_job_count(store: Store) -> None:
    """Within one call or across calls, jobs beyond job_count are a ConstraintError naming the
    run and the numbers, and nothing of the call is stored; up to job_count all goes in. The
    fix is one the caller can make: the run exists, so its job_count can no longer grow."""
    run = make_run(job_count=4)
    await store.insert_run(run)
    jobs = make_jobs(run, 6)
    with pytest.raises(
        ConstraintError,
        match=rf"run {run.id} has job_count 4 and 0 jobs already; this call would add 5 more; no "
        "job of this call was inserted: insert at most 4 more jobs for it, and put the rest in a "
        "new run",
    ) as caught:
        await store.insert_jobs(jobs[:5])
    assert "larger job_count when you insert it" not in str(caught.value)
    await store.insert_jobs(jobs[:3])
    with pytest.raises(
        ConstraintError,
        match=r"has job_count 4 and 3 jobs already.* add 2 more.*insert at most 1 more job for",
    ):
        await store.insert_jobs(jobs[3:5])
    await store.insert_jobs(jobs[3:4])
    with pytest.raises(
        ConstraintError,
        match=r"it has all its jobs; put further jobs in a new run \(a run's job_count is fixed",
    ):
        await store.insert_jobs(jobs[5:6])
    assert await store.list_jobs(run.id) == jobs[:4]
    assert await store.check() == []


class _UUIDSubclass(uuid.UUID):
    """An id type the encoder's fast path leaves to its checked path."""


async def test_a_batch_over_several_runs_is_counted_per_run(store: Store) -> None:
    """Each run's jobs are counted wherever they stand in the batch and whatever object holds
    the run id; one run over its job_count refuses the whole batch, every run's jobs with it."""
    small, large = make_run(job_count=2), make_run(job_count=5)
    await store.insert_run(small)
    await store.insert_run(large)
    same_id = uuid.UUID(str(large.id))  # equal to large.id, another object
    checked = JobId(_UUIDSubclass(int=uuid.uuid4().int))  # takes the encoder's checked path
    batch = [
        Job(large.id, EvalJob("m", "l0", 0)),
        Job(small.id, EvalJob("m", "s0", 0), id=checked),
        Job(same_id, EvalJob("m", "l1", 0)),
        Job(large.id, EvalJob("m", "l2", 0)),
        Job(small.id, EvalJob("m", "s1", 0)),
        Job(small.id, EvalJob("m", "s2", 0)),  # small's third: one too many
    ]
    with pytest.raises(ConstraintError, match=rf"run {small.id} has job_count 2 .* add 3 more"):
        await store.insert_jobs(batch)
    assert await store.list_jobs(large.id) == []
    await store.insert_jobs(batch[:5])
    assert len(await store.list_jobs(large.id)) == 3
    assert len(await store.list_jobs(small.id)) == 2
    await store.insert_jobs(make_jobs(large, 2))
    with pytest.raises(ConstraintError, match=rf"run {large.id} has job_count 5 and 5 jobs"):
        await store.insert_jobs(make_jobs(large, 1))
    assert await store.check() == []


async def test_text_that_utf8_cannot_encode_is_refused_with_the_fix(store: Store) -> None:
    """Lone surrogates (what errors='surrogateescape' leaves of undecodable bytes) cannot be
    stored: a job batch or an outcome batch holding one is refused whole, naming the field,
    the character and the fix. Other unusual text, NUL included, round-trips."""
    run = make_run(job_count=3)
    await store.insert_run(run)
    escaped = b"caf\xe9".decode("utf-8", errors="surrogateescape")
    jobs = [Job(run.id, EvalJob("model-a", s, 0)) for s in ("s0", escaped, "s2")]
    with pytest.raises(
        InvalidInputError,
        match=rf"job {jobs[1].id}: spec\.sample_id holds '\\udce9' at index 3, a lone "
        r"surrogate .* decode the bytes with errors='replace' or errors='backslashreplace'",
    ):
        await store.insert_jobs(jobs)
    assert await store.list_jobs(run.id) == []

    jobs = [Job(run.id, EvalJob("model-a", s, 0)) for s in ("nul\x00", "caf\u00e9", "\U0001f600")]
    await store.insert_jobs(jobs)
    assert await store.list_jobs(run.id) == jobs
    outcomes = [JobOutcome(jobs[0].id, output="ok"), JobOutcome(jobs[1].id, output=escaped)]
    with pytest.raises(InvalidInputError, match=rf"outcome for job {jobs[1].id}: output holds"):
        await store.record_job_outcomes(run.id, outcomes)
    assert await store.get_run(run.id) == run
    assert await store.list_jobs(run.id) == jobs


async def test_ids_must_be_uuids(store: Store) -> None:
    """A string where an id is expected is refused with the fix in the message."""
    with pytest.raises(InvalidInputError, match=r"uuid\.UUID\("):
        await store.get_run("0f8fad5b-d9cb-469f-a165-70867728950e")  # type: ignore[arg-type]
    # No text to wrap, or text uuid.UUID() would refuse: the fix is to pass a real id.
    for not_an_id in (None, 123, "zz", "0f8fad5b-d9cb-469f-a165-70867728950 "):
        with pytest.raises(
            InvalidInputError, match=r"pass the run's id .*e\.g\. run\.id"
        ) as caught:
            await store.get_run(not_an_id)  # type: ignore[arg-type]
        assert "uuid.UUID(" not in str(caught.value)
    # The record where its id was meant: the fix names that argument's own id.
    job = Job(uuid.uuid4(), EvalJob("m", "s", 0))
    with pytest.raises(InvalidInputError, match=r"job_id must be .*; pass job\.id, not the Job"):
        await store.get_job(job)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"pass the job's id .*e\.g\. job\.id"):
        await store.get_job(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="wrap a single job"):
        await store.insert_jobs(Job(uuid.uuid4(), EvalJob("m", "s", 0)))  # type: ignore[arg-type]
    text = "0f8fad5b-d9cb-469f-a165-70867728950e"
    with pytest.raises(InvalidInputError, match=r"job_id must be a uuid\.UUID.*wrap it as uuid"):
        await store.record_job_outcome(uuid.uuid4(), JobOutcome(text))  # type: ignore[arg-type]


async def test_an_async_iterator_of_jobs_is_refused_with_the_fix(store: Store) -> None:
    """insert_jobs reads its jobs on a thread: an async generator is refused, saying to
    collect it first, not to wrap a single job."""

    async def jobs() -> AsyncGenerator[Job, None]:
        yield Job(uuid.uuid4(), EvalJob("m", "s", 0))

    pending = jobs()
    with pytest.raises(InvalidInputError, match=r"collect an async iterator first"):
        await store.insert_jobs(pending)  # type: ignore[arg-type]
    await pending.aclose()


async def test_every_call_on_a_closed_store_says_closed(store: Store) -> None:
    """After close(), every method raises StoreClosedError naming the store's database, as
    does entering ``async with store``; close() again is a no-op."""
    run = make_run()
    backend = store._backend
    assert backend is not None
    await store.close()
    await store.close()
    assert store.closed
    calls = [
        store.insert_run(run),
        store.get_run(run.id),
        store.insert_jobs([]),
        store.get_job(run.id),
        store.list_jobs(run.id),
        store.claim_next_run(),
        store.record_job_outcome(run.id, JobOutcome(run.id)),
        store.list_runs(),
        store.check(),
    ]
    for call in calls:
        with pytest.raises(StoreClosedError, match="closed") as caught:
            await call
        assert f"the store on {backend.database} is closed" in str(caught.value)
    with pytest.raises(StoreClosedError, match="closed"):  # at the block's start, not inside
        async with store:
            pytest.fail("entered a closed store")


def test_a_store_made_from_a_url_says_to_connect() -> None:
    """Store(url), a natural first guess, is refused at once with the way to open a store,
    not left to fail at its first call with an AttributeError."""
    for url in ("sqlite://control.db", Path("control.db")):
        with pytest.raises(ConfigurationError, match=r"await Store\.connect\(url\)"):
            Store(url)  # type: ignore[arg-type]


async def test_list_runs_newest_first_with_filters(store: Store) -> None:
    """list_runs gives runs newest first, filtered by status and cut by limit."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    runs = [make_run(created_at=base + timedelta(minutes=i)) for i in range(4)]
    for run in runs:
        await store.insert_run(run)
    claimed = await store.claim_next_run()
    assert claimed is not None
    assert [r.id for r in await store.list_runs()] == [r.id for r in reversed(runs)]
    assert [r.id for r in await store.list_runs(status=RunStatus.RUNNING)] == [runs[0].id]
    assert len(await store.list_runs(status=RunStatus.QUEUED, limit=2)) == 2
    assert len(await store.list_runs(limit=2**63 - 1)) == 4
    for bad in (-1, 2**63, True, 1.0):
        with pytest.raises(
            InvalidInputError, match=r"limit must be an int from 0 to 9223372036854775807 or None"
        ):
            await store.list_runs(limit=bad)  # type: ignore[arg-type]


async def test_check_finds_nothing_in_a_sound_store(store: Store) -> None:
    """check() returns no problems after ordinary use."""
    run = make_run()
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    await store.claim_next_run()
    await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0))
    assert await store.check() == []


class _Float(float):
    """A float subclass, as numpy.float64 is (msgspec refuses to encode one)."""


class _Str(str):
    """A str subclass, as numpy.str_ is, printing itself its own way."""

    def __str__(self) -> str:
        return "not the text"


class _Int(int):
    """An int subclass, as an IntEnum member is."""


async def test_subclasses_of_str_float_and_int_are_stored_as_their_values(store: Store) -> None:
    """What the hints admit is stored: str, float and int subclasses (numpy's scalars, enums)
    are kept as their plain values, and every model compares equal after the round trip."""
    run = Run(_Str("suite.yaml"), [_Str("model-a")], _Int(2), _Int(1))
    job = Job(run.id, EvalJob(_Str("model-a"), _Str("sample-1"), _Int(1)), attempt=_Int(0))
    outcome = JobOutcome(job.id, score=_Float(0.5), output=_Str("out"), error=_Str("none"))
    await store.insert_run(run)
    await store.insert_jobs([job])
    assert await store.get_run(run.id) == run
    assert await store.get_job(job.id) == job
    assert await store.record_job_outcome(run.id, outcome)
    recorded = await store.get_job(job.id)
    assert recorded is not None
    assert recorded.outcome == outcome
    assert type(recorded.outcome.score) is float


@pytest.mark.parametrize(
    ("score", "match"),
    [
        (2**53 + 1, "cannot hold exactly; pass float"),
        (10**300, "cannot hold exactly; pass float"),
        (Decimal("0.5"), r"score must be a float or None, got Decimal: .*pass float\(\.\.\.\)"),
    ],
    ids=["int-past-2**53", "huge-int", "decimal"],
)
async def test_a_score_that_would_not_survive_the_round_trip_is_refused(
    store: Store, score: object, match: str
) -> None:
    """A score is kept as a float: an int no float holds exactly, or a non-float, is refused
    with the fix, and nothing is recorded; an int a float holds is recorded and reads back
    equal."""
    run = make_run(job_count=2)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await store.insert_jobs(jobs)
    with pytest.raises(InvalidInputError, match=match):
        await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=score))  # type: ignore[arg-type]
    assert await store.get_job(jobs[0].id) == jobs[0]
    exact = JobOutcome(jobs[1].id, score=2**53)
    assert await store.record_job_outcome(run.id, exact)
    recorded = await store.get_job(jobs[1].id)
    assert recorded is not None
    assert recorded.outcome == exact


@pytest.mark.parametrize(
    ("sql", "params", "plan"),
    [
        (_sqlite.SELECT_RUNS, (20,), ["SCAN runs USING INDEX idx_runs_created"]),
        (
            _sqlite.SELECT_RUNS_BY_STATUS,
            ("done", 20),
            ["SEARCH runs USING INDEX idx_runs_status (status=?)"],
        ),
        (
            _sqlite.CLAIM_RUNS,
            (64,),
            [
                "SEARCH runs USING INTEGER PRIMARY KEY (rowid=?)",
                "LIST SUBQUERY 1",
                "SEARCH runs USING COVERING INDEX idx_runs_status (status=?)",
            ],
        ),
    ],
    ids=["list_runs", "list_runs-by-status", "claim_runs"],
)
def test_the_newest_runs_are_one_index_walk_whatever_the_table_holds(
    sql: str, params: tuple[object, ...], plan: list[str]
) -> None:
    """list_runs() with or without a status walks an index in its order, with no sort of the
    whole table (once about 1 s a call at a million runs, holding the store's connection), and
    the claims still seek the status index: on the schema the shipped migrations make."""
    assert query_plan(sql, params) == plan
