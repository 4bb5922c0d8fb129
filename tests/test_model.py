"""The store against a plain in-memory model, over random sequences of calls (hypothesis)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from control_store import (
    AlreadyExistsError,
    ConstraintError,
    ControlError,
    EvalJob,
    InvalidInputError,
    Job,
    JobOutcome,
    JobStatus,
    MissingRunError,
    NotFoundError,
    Run,
    RunId,
    RunStatus,
    Store,
    WrongRunError,
)

from conftest import sized

T = TypeVar("T")
BASE = datetime(2026, 1, 1, tzinfo=UTC)
FLAWS = ["duplicate-in-store", "duplicate-in-batch", "missing-run", "unstorable"]
scores = st.none() | st.floats(allow_nan=False, allow_infinity=False)


class StoreModel(RuleBasedStateMachine):
    """Random insert_run, insert_jobs (sound and flawed), claims and records, checked step by step.

    The model is three plain containers: runs in insertion order, jobs in insertion order, and
    each run's jobs. Claims take the queued run with the smallest (created_at, insertion index);
    a first outcome marks its job done and advances its run; anything refused changes nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store: Store = self.call(self._open())
        self.runs: dict[uuid.UUID, Run] = {}
        self.jobs: dict[uuid.UUID, Job] = {}
        self.jobs_of: dict[uuid.UUID, list[uuid.UUID]] = {}

    @staticmethod
    async def _open() -> Store:
        return await Store.in_memory()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def refused(self, coro: Coroutine[Any, Any, object], error: type[ControlError]) -> None:
        with pytest.raises(error):
            self.call(coro)

    def teardown(self) -> None:
        self.call(self.store.close())
        self.loop.close()

    @initialize()
    def start(self) -> None:
        """Every sequence starts from an empty store."""

    # -- runs ------------------------------------------------------------------------------

    @rule(job_count=st.integers(0, 4), second=st.integers(0, 3))
    def insert_run(self, job_count: int, second: int) -> None:
        # Few distinct instants, so claims often break ties by insertion order.
        run = Run("m.yaml", ["a"], 1, job_count, created_at=BASE + timedelta(seconds=second))
        if job_count == 0:  # a run of no jobs could never be done
            self.refused(self.store.insert_run(run), InvalidInputError)
            return
        self.call(self.store.insert_run(run))
        self.runs[run.id] = run
        self.jobs_of[run.id] = []

    @rule(job_count=st.integers(1, 4), given=st.integers(0, 5), second=st.integers(0, 3))
    def insert_run_with_jobs(self, job_count: int, given: int, second: int) -> None:
        """insert_run(run, jobs=...): all job_count jobs go in with the run; any other number
        of them, nothing."""
        run = Run("m.yaml", ["a"], 1, job_count, created_at=BASE + timedelta(seconds=second))
        jobs = [Job(run.id, EvalJob("a", f"s{i}", 0)) for i in range(given)]
        if given != job_count:
            self.refused(self.store.insert_run(run, jobs=jobs), ConstraintError)
            return
        self.call(self.store.insert_run(run, jobs=iter(jobs)))
        self.runs[run.id] = run
        self.jobs_of[run.id] = [job.id for job in jobs]
        self.jobs.update((job.id, job) for job in jobs)

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def insert_run_again(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(list(self.runs)))
        self.refused(
            self.store.insert_run(Run("other.yaml", ["b"], 2, 1, id=RunId(run_id))),
            AlreadyExistsError,
        )

    # -- jobs ------------------------------------------------------------------------------

    def room(self, run_id: uuid.UUID) -> int:
        return self.runs[run_id].job_count - len(self.jobs_of[run_id])

    @precondition(lambda self: self.runs)
    @rule(data=st.data(), count=st.integers(0, 3))
    def insert_jobs(self, data: st.DataObject, count: int) -> None:
        run_id = data.draw(st.sampled_from(list(self.runs)))
        batch = [
            Job(run_id, EvalJob("a", f"s{i}", 0)) for i in range(min(count, self.room(run_id)))
        ]
        self.call(self.store.insert_jobs(batch))
        for job in batch:
            self.jobs[job.id] = job
            self.jobs_of[run_id].append(job.id)

    @precondition(lambda self: self.runs)
    @rule(data=st.data(), flaw=st.sampled_from(FLAWS), count=st.integers(0, 2))
    def insert_flawed_jobs(self, data: st.DataObject, flaw: str, count: int) -> None:
        run_id = data.draw(st.sampled_from(list(self.runs)))
        batch = [Job(run_id, EvalJob("a", f"s{i}", 0)) for i in range(count)]
        error: type[ControlError]
        if flaw == "duplicate-in-store":
            if not self.jobs:
                return
            stored = self.jobs[data.draw(st.sampled_from(list(self.jobs)))]
            batch.append(Job(run_id, EvalJob("a", "dup", 0), id=stored.id))
            error = AlreadyExistsError
        elif flaw == "duplicate-in-batch":
            twin = Job(run_id, EvalJob("a", "twin", 0))
            batch += [twin, twin]
            error = AlreadyExistsError
        elif flaw == "missing-run":
            batch.append(Job(uuid.uuid4(), EvalJob("a", "orphan", 0)))
            error = MissingRunError
        else:
            batch.append(Job(run_id, EvalJob("a", "huge", 2**64)))
            error = InvalidInputError
        position = data.draw(st.integers(0, len(batch) - 1))
        batch.insert(position, batch.pop())  # the flaw anywhere in the batch
        self.refused(self.store.insert_jobs(batch), error)

    # -- claims ----------------------------------------------------------------------------

    @rule()
    def claim(self) -> None:
        order = list(self.runs)
        queued = [r for r in self.runs.values() if r.status is RunStatus.QUEUED]
        expected = min(queued, key=lambda r: (r.created_at, order.index(r.id)), default=None)
        claimed = self.call(self.store.claim_next_run())
        if expected is None:
            assert claimed is None
            return
        expected = msgspec.structs.replace(expected, status=RunStatus.RUNNING)
        assert claimed == expected
        self.runs[expected.id] = expected

    @rule(limit=st.integers(1, 3))
    def claim_batch(self, limit: int) -> None:
        order = list(self.runs)
        queued = sorted(
            (r for r in self.runs.values() if r.status is RunStatus.QUEUED),
            key=lambda r: (r.created_at, order.index(r.id)),
        )
        expected = [msgspec.structs.replace(r, status=RunStatus.RUNNING) for r in queued[:limit]]
        assert self.call(self.store.claim_runs(limit)) == expected
        for run in expected:
            self.runs[run.id] = run

    # -- records ---------------------------------------------------------------------------

    def advance(self, job: Job, outcome: JobOutcome) -> None:
        """The model of a first outcome: its job done, its run one further (done at job_count)."""
        self.jobs[job.id] = msgspec.structs.replace(job, status=JobStatus.DONE, outcome=outcome)
        run = self.runs[job.run_id]
        done_count = run.done_count + 1
        status = RunStatus.DONE if done_count >= run.job_count else run.status
        self.runs[run.id] = msgspec.structs.replace(run, done_count=done_count, status=status)

    def jobs_where(self, done: bool) -> list[uuid.UUID]:
        return [j.id for j in self.jobs.values() if (j.status is JobStatus.DONE) == done]

    @precondition(lambda self: self.jobs_where(done=False))
    @rule(data=st.data(), score=scores)
    def record_first(self, data: st.DataObject, score: float | None) -> None:
        job = self.jobs[data.draw(st.sampled_from(self.jobs_where(done=False)))]
        outcome = JobOutcome(job.id, score=score, output="first")
        assert self.call(self.store.record_job_outcome(job.run_id, outcome)) is True
        self.advance(job, outcome)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), score=scores)
    def record_batch(self, data: st.DataObject, score: float | None) -> None:
        """A batch of one run's jobs, done or not, its first one twice (others maybe too): the
        first outcome of a job not yet done counts, every other is False."""
        with_jobs = [run_id for run_id, job_ids in self.jobs_of.items() if job_ids]
        run_id = data.draw(st.sampled_from(with_jobs))
        picked = data.draw(st.lists(st.sampled_from(self.jobs_of[run_id]), min_size=1, max_size=4))
        picked.append(picked[0])  # every batch holds a job twice: the second is a redelivery
        outcomes = [JobOutcome(j, score=score, output=f"batch {i}") for i, j in enumerate(picked)]
        expected = []
        for outcome in outcomes:
            job = self.jobs[outcome.job_id]
            new = job.status is not JobStatus.DONE
            expected.append(new)
            if new:
                self.advance(job, outcome)
        assert self.call(self.store.record_job_outcomes(run_id, outcomes)) == expected

    @precondition(lambda self: self.jobs_where(done=True))
    @rule(data=st.data(), score=scores)
    def record_again(self, data: st.DataObject, score: float | None) -> None:
        job = self.jobs[data.draw(st.sampled_from(self.jobs_where(done=True)))]
        outcome = JobOutcome(job.id, score=score, output="again")
        assert self.call(self.store.record_job_outcome(job.run_id, outcome)) is False

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def record_unknown_job(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(list(self.runs)))
        outcome = JobOutcome(uuid.uuid4(), score=1.0)
        self.refused(self.store.record_job_outcome(run_id, outcome), NotFoundError)

    @precondition(lambda self: self.jobs and len(self.runs) > 1)
    @rule(data=st.data())
    def record_under_wrong_run(self, data: st.DataObject) -> None:
        job = self.jobs[data.draw(st.sampled_from(list(self.jobs)))]
        other = data.draw(st.sampled_from([r for r in self.runs if r != job.run_id]))
        outcome = JobOutcome(job.id, score=1.0)
        self.refused(self.store.record_job_outcome(other, outcome), WrongRunError)

    # -- agreement -------------------------------------------------------------------------

    @invariant()
    def store_agrees_with_model(self) -> None:
        order = list(self.runs)
        newest_first = sorted(
            self.runs.values(), key=lambda r: (r.created_at, order.index(r.id)), reverse=True
        )
        assert self.call(self.store.list_runs()) == newest_first
        assert self.call(_walked(self.store.iter_runs(page_size=2))) == newest_first
        for run_id, job_ids in self.jobs_of.items():
            assert self.call(self.store.list_jobs(run_id)) == [self.jobs[j] for j in job_ids]
        assert self.call(self.store.check()) == []


async def _walked(runs: AsyncIterator[Run]) -> list[Run]:
    return [run async for run in runs]


StoreModel.TestCase.settings = settings(
    max_examples=sized(35, 100),
    stateful_step_count=sized(25, 50),
    deadline=None,
    derandomize=True,  # the same sequences on every run: CI cannot flake on a new one
)


# hypothesis builds TestCase at run time, so mypy cannot see that it is a class.
class TestStoreModel(StoreModel.TestCase):  # type: ignore[misc,valid-type]
    """The store and the model agree after every step of random call sequences."""
