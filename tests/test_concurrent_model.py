"""The store against a model of it, under concurrency: rounds of random calls made at once (so
the group commit runs them in one transaction, each in its savepoint), some of them refused,
on both backends. Each call's result and, after each round, the whole store are compared with
what a plain Python model, applying the same calls one after another in an order the store
could have run them, says they must be. tests/test_model.py does the same one call at a time."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from control_store import (
    AlreadyExistsError,
    ConstraintError,
    EvalJob,
    InvalidInputError,
    Job,
    JobOutcome,
    JobStatus,
    MissingRunError,
    NotFoundError,
    Run,
    RunStatus,
    Store,
    WrongRunError,
)

from conftest import sized

BASE = datetime(2026, 3, 1, tzinfo=UTC)
MODELS = ["model-a", "model-b", "model-c"]


@dataclasses.dataclass(frozen=True)
class Held:
    """A stored run as the model keeps it: as inserted, then its status and counters. Frozen,
    so a copy of the model shares every run it has not changed."""

    run: Run
    order: int  # insertion order: ties of created_at break by it
    status: RunStatus
    done_count: int = 0
    jobs: tuple[uuid.UUID, ...] = ()

    def now(self) -> Run:
        return msgspec.structs.replace(self.run, status=self.status, done_count=self.done_count)


class Refused(Exception):
    """What the model says a call raises: the error's class."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__(error.__name__)
        self.error = error


@dataclasses.dataclass
class Model:
    runs: dict[uuid.UUID, Held] = dataclasses.field(default_factory=dict)
    jobs: dict[uuid.UUID, Job] = dataclasses.field(default_factory=dict)
    inserted: int = 0

    def copy(self) -> Model:
        return Model(dict(self.runs), dict(self.jobs), self.inserted)

    def change(self, run_id: uuid.UUID, **changes: Any) -> None:
        self.runs[run_id] = dataclasses.replace(self.runs[run_id], **changes)

    def state(self) -> object:
        """What tells two models apart, hashable: calls that commute (most do) give one state
        whichever order they ran in, so the search below tries each state once."""
        return (
            tuple(
                (run_id, held.status, held.done_count, held.order, held.jobs)
                for run_id, held in self.runs.items()
            ),
            frozenset((job.id, job.outcome) for job in self.jobs.values() if job.outcome),
        )

    # --- the calls, applied one at a time: each returns the result or raises Refused ---

    def insert_run(self, run: Run, jobs: list[Job] | None) -> None:
        if run.id in self.runs:
            raise Refused(AlreadyExistsError)
        if jobs is not None:
            if any(job.run_id != run.id for job in jobs):
                raise Refused(InvalidInputError)
            if len(jobs) != run.job_count:
                raise Refused(ConstraintError)
        self.inserted += 1
        self.runs[run.id] = Held(run, self.inserted, run.status)
        if jobs is not None:
            self._add_jobs(jobs)

    def insert_jobs(self, jobs: list[Job]) -> None:
        if any(job.run_id not in self.runs for job in jobs):
            raise Refused(MissingRunError)
        ids = [job.id for job in jobs]
        if len(set(ids)) != len(ids) or any(job_id in self.jobs for job_id in ids):
            raise Refused(AlreadyExistsError)
        for run_id in {job.run_id for job in jobs}:
            held = self.runs[run_id]
            more = sum(job.run_id == run_id for job in jobs)
            if len(held.jobs) + more > held.run.job_count:
                raise Refused(ConstraintError)
        self._add_jobs(jobs)

    def _add_jobs(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.jobs[job.id] = job
            self.change(job.run_id, jobs=(*self.runs[job.run_id].jobs, job.id))

    def claim_runs(self, limit: int) -> list[Run]:
        queued = sorted(
            (held for held in self.runs.values() if held.status is RunStatus.QUEUED),
            key=lambda held: (held.run.created_at, held.order),
        )
        for held in queued[:limit]:
            self.change(held.run.id, status=RunStatus.RUNNING)
        return [self.runs[held.run.id].now() for held in queued[:limit]]

    def claim_next_run(self) -> Run | None:
        claimed = self.claim_runs(1)
        return claimed[0] if claimed else None

    def release_runs(self, run_ids: Sequence[uuid.UUID]) -> int:
        released = 0
        for run_id in dict.fromkeys(run_ids):
            held = self.runs.get(run_id)
            if held is not None and held.status is RunStatus.RUNNING:
                self.change(run_id, status=RunStatus.QUEUED)
                released += 1
        return released

    def record_job_outcomes(self, run_id: uuid.UUID, outcomes: list[JobOutcome]) -> list[bool]:
        for outcome in outcomes:
            job = self.jobs.get(outcome.job_id)
            if job is None:
                raise Refused(NotFoundError)
            if job.run_id != run_id:
                raise Refused(WrongRunError)
        results = []
        for outcome in outcomes:
            job = self.jobs[outcome.job_id]
            new = job.status is not JobStatus.DONE
            if new:
                self.jobs[job.id] = msgspec.structs.replace(
                    job, status=JobStatus.DONE, outcome=outcome
                )
                held = self.runs[run_id]
                done = held.done_count + 1
                status = RunStatus.DONE if done >= held.run.job_count else held.status
                self.change(run_id, done_count=done, status=status)
            results.append(new)
        return results

    def record_job_outcome(self, run_id: uuid.UUID, outcome: JobOutcome) -> bool:
        return self.record_job_outcomes(run_id, [outcome])[0]


@dataclasses.dataclass
class Call:
    """One call of a round: made on the store, and applied to the model."""

    name: str
    on_store: Callable[[Store], Awaitable[Any]]
    on_model: Callable[[Model], Any]
    # Whether it may end on the call's first step, ahead of calls made before it that wait for
    # the connection's thread: a call refused or answered before any SQL, or a small one (a
    # single row, a batch of at most 256), which an in-memory store runs inline when its
    # connection is free. Every other call queues for the thread, in the order calls came.
    ahead: bool = True


class Rounds:
    """Random calls drawn from what the model holds: mostly ones that succeed, some refused."""

    def __init__(self, rng: random.Random, model: Model) -> None:
        self.rng = rng
        self.model = model
        self.clock = 0  # created_at, in microseconds past BASE: some runs share an instant

    def run(self) -> Run:
        rng = self.rng
        self.clock += rng.choice([0, 0, 1, 7])
        return Run(
            f"suite-{rng.randrange(1000)}.yaml",
            rng.sample(MODELS, rng.randint(1, len(MODELS))),
            rng.randint(1, 3),
            rng.randint(1, 6),
            created_at=BASE + timedelta(microseconds=self.clock),
        )

    def jobs(self, run: Run, count: int) -> list[Job]:
        rng = self.rng
        return [
            Job(run.id, EvalJob(rng.choice(run.models), f"s{rng.randrange(100)}", 0))
            for _ in range(count)
        ]

    def stored(self) -> list[Held]:
        return list(self.model.runs.values())

    def call(self) -> Call:
        kinds = [self.insert_run, self.insert_jobs, self.claim, self.record, self.records]
        if any(held.status is RunStatus.RUNNING for held in self.stored()):
            kinds.append(self.release)
        return self.rng.choice(kinds)()

    def insert_run(self) -> Call:
        rng = self.rng
        run = self.run()
        jobs: list[Job] | None = None
        shape = rng.random()
        if shape < 0.4:
            jobs = self.jobs(run, run.job_count)
        elif shape < 0.5:
            jobs = self.jobs(run, run.job_count + rng.choice([-1, 1]))  # ConstraintError
        elif shape < 0.55 and self.model.runs:
            # A run whose id is taken (AlreadyExistsError), or one of its jobs another run's.
            other = rng.choice(self.stored()).run
            if rng.random() < 0.5:
                run = msgspec.structs.replace(run, id=other.id)
            else:
                jobs = self.jobs(run, run.job_count - 1) + self.jobs(other, 1)
        elif shape < 0.6:
            run = msgspec.structs.replace(run, epochs=0)  # InvalidInputError, before the model
            return Call("insert_run(epochs=0)", lambda s: s.insert_run(run), _refused_invalid)
        return Call(
            f"insert_run({'' if jobs is None else f'jobs={len(jobs)}'})",
            lambda s: s.insert_run(run, jobs=jobs) if jobs is not None else s.insert_run(run),
            lambda m: m.insert_run(run, jobs),
            ahead=jobs is None,
        )

    def insert_jobs(self) -> Call:
        rng = self.rng
        jobs: list[Job] = []
        for held in rng.sample(self.stored(), min(len(self.stored()), rng.randint(0, 2))):
            room = held.run.job_count - len(held.jobs)
            # Mostly what fits; sometimes one too many (ConstraintError).
            jobs += self.jobs(held.run, rng.randint(0, room) if rng.random() < 0.85 else room + 1)
        fault = rng.random()
        if fault < 0.1:
            jobs += self.jobs(self.run(), 1)  # a run never stored: MissingRunError
        elif fault < 0.15 and jobs:
            jobs.append(jobs[0])  # twice in one call: AlreadyExistsError
        elif fault < 0.2 and self.model.jobs:
            taken = self.model.jobs[rng.choice(list(self.model.jobs))]
            jobs.append(msgspec.structs.replace(taken, status=JobStatus.QUEUED, outcome=None))
        rng.shuffle(jobs)
        return Call(
            f"insert_jobs({len(jobs)})",
            lambda s: s.insert_jobs(jobs),
            lambda m: m.insert_jobs(jobs),
            ahead=not jobs,
        )

    def claim(self) -> Call:
        if self.rng.random() < 0.5:
            return Call("claim_next_run", lambda s: s.claim_next_run(), Model.claim_next_run)
        limit = self.rng.randint(1, 4)
        return Call(
            f"claim_runs({limit})", lambda s: s.claim_runs(limit), lambda m: m.claim_runs(limit)
        )

    def release(self) -> Call:
        rng = self.rng
        running = [h.run.id for h in self.stored() if h.status is RunStatus.RUNNING]
        ids = rng.sample(running, rng.randint(1, len(running)))
        if rng.random() < 0.3:
            ids.append(rng.choice(self.stored()).run.id)  # any state: only a running one moves
        return Call(
            f"release_runs({len(ids)})",
            lambda s: s.release_runs(ids),
            lambda m: m.release_runs(ids),
            ahead=False,
        )

    def outcome(self) -> tuple[uuid.UUID, JobOutcome]:
        """An outcome for a run: mostly of one of its jobs, done or not (a redelivery); now
        and then of no job (NotFoundError) or of another run's job (WrongRunError)."""
        rng = self.rng
        model = self.model
        with_jobs = [held for held in self.stored() if held.jobs]
        if not with_jobs or rng.random() < 0.05:
            run_id = rng.choice(self.stored()).run.id if model.runs else uuid.uuid4()
            return run_id, JobOutcome(uuid.uuid4())
        held = rng.choice(with_jobs)
        job_id = rng.choice(held.jobs)
        run_id = held.run.id
        if rng.random() < 0.05 and len(model.runs) > 1:
            run_id = rng.choice([r for r in model.runs if r != held.run.id])
        score = rng.choice([None, 0.0, 1.0, 0.25])
        return run_id, JobOutcome(job_id, score=score, output=f"out-{rng.randrange(10)}")

    def record(self) -> Call:
        run_id, outcome = self.outcome()
        return Call(
            "record_job_outcome",
            lambda s: s.record_job_outcome(run_id, outcome),
            lambda m: m.record_job_outcome(run_id, outcome),
        )

    def records(self) -> Call:
        rng = self.rng
        run_id, first = self.outcome()
        outcomes = [first]
        held = self.model.runs.get(run_id)
        if held is not None and held.jobs:
            for _ in range(rng.randint(0, 5)):  # repeats too: a job twice in one batch
                outcomes.append(JobOutcome(rng.choice(held.jobs), score=rng.random()))
        rng.shuffle(outcomes)
        return Call(
            f"record_job_outcomes({len(outcomes)})",
            lambda s: s.record_job_outcomes(run_id, outcomes),
            lambda m: m.record_job_outcomes(run_id, outcomes),
        )


def _refused_invalid(model: Model) -> None:
    raise Refused(InvalidInputError)


Snapshot = tuple[list[uuid.UUID], dict[uuid.UUID, Run], dict[uuid.UUID, list[Job]]]


async def snapshot(store: Store) -> Snapshot:
    """Every run (newest first) and job the store holds."""
    runs = await store.list_runs()
    return (
        [run.id for run in runs],
        {run.id: run for run in runs},
        {run.id: await store.list_jobs(run.id) for run in runs},
    )


def snapshot_of(model: Model) -> Snapshot:
    """The same of the model."""
    by_age = sorted(model.runs.values(), key=lambda held: (held.run.created_at, held.order))
    return (
        [held.run.id for held in reversed(by_age)],
        {held.run.id: held.now() for held in by_age},
        {held.run.id: [model.jobs[job_id] for job_id in held.jobs] for held in by_age},
    )


def gives(call: Call, model: Model, result: object) -> bool:
    """Whether ``call``, applied to ``model`` (which it changes if it succeeds), gives what
    the store gave: the same value, or an error of the same class."""
    try:
        expected = call.on_model(model)
    except Refused as refused:
        return isinstance(result, refused.error)
    return not isinstance(result, BaseException) and result == expected


def linearized(
    model: Model, calls: list[Call], results: list[object], stored: Snapshot
) -> Model | None:
    """The model after the round's calls applied in an order in which each gives what the
    store gave it and which leaves what the store holds; None if there is none.

    The orders searched are the ones the store can run calls in: those waiting for the
    connection's thread in the order they were made (first in, first out), and any call that
    can end on its first step (Call.ahead) either there, before every call made after it, or
    queued like the others. Each (calls left, last queued, model state) is searched once."""
    seen: set[object] = set()  # found to lead nowhere

    def search(model: Model, left: frozenset[int], queued: int, last: int) -> Model | None:
        """``queued``: the latest call made of those applied as queued; ``last``: of all."""
        if not left:
            return model if snapshot_of(model) == stored else None
        if min(left) < queued:
            return None  # made before a call that queued after it, and not run by then
        key = (left, queued, model.state())  # ``last`` follows from ``left``
        if key in seen:
            return None
        for index in sorted(left):
            # Ahead of the queue if it can be: the queue then stays where it was, which
            # leaves open every order that queueing it would.
            after = queued if calls[index].ahead and index > last else index
            trial = model.copy()
            if gives(calls[index], trial, results[index]):
                found = search(trial, left - {index}, after, max(last, index))
                if found is not None:
                    return found
        seen.add(key)
        return None

    return search(model, frozenset(range(len(calls))), -1, -1)


@pytest.mark.parametrize("seed", range(sized(6, 10)))
async def test_concurrent_calls_agree_with_a_model_of_the_store(store: Store, seed: int) -> None:
    """Rounds of up to 16 calls at once, every kind of write among them and about one in five
    refused: there is an order of each round's calls in which every call gets from the model
    what it got from the store, and that leaves the model holding what the store holds; and
    check() finds nothing wrong."""
    rng = random.Random(seed)
    rounds = Rounds(rng, Model())
    for number in range(sized(40, 120)):
        calls = [rounds.call() for _ in range(rng.randint(1, 16))]
        results = await asyncio.gather(
            *(call.on_store(store) for call in calls), return_exceptions=True
        )
        stored = await snapshot(store)
        assert await store.check() == [], f"seed {seed}, round {number}"
        found = linearized(rounds.model, calls, results, stored)
        assert found is not None, (
            f"seed {seed}, round {number}: no order of its calls gives what the store gave",
            [(call.name, result) for call, result in zip(calls, results, strict=True)],
        )
        rounds.model = found
