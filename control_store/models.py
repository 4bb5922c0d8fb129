"""The records the store keeps: runs, the jobs they fan out into, and job outcomes.

All are frozen msgspec structs that compare equal after a round trip through the store.
"""

from __future__ import annotations

import enum
import os
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, ClassVar, NewType

import msgspec

__all__ = [
    "EvalJob",
    "Job",
    "JobId",
    "JobOutcome",
    "JobStatus",
    "Problem",
    "Run",
    "RunId",
    "RunStatus",
    "new_job_id",
    "new_run_id",
    "utc_now",
]

# NewType, not a UUID subclass: msgspec decodes NewTypes over UUID natively. Any uuid.UUID is
# accepted where an id is expected.
RunId = NewType("RunId", uuid.UUID)
JobId = NewType("JobId", uuid.UUID)


def _uuid7() -> uuid.UUID:
    """A fresh UUID version 7 (RFC 9562): 48 bits of Unix time in milliseconds, then 12 bits of
    the millisecond's fraction (its method 3), then 62 random bits.

    Ids made later sort later, as UUIDs and as the canonical text the store keeps, so a store's
    primary-key indexes grow at their end instead of at a random page: on a file of 1.2M jobs,
    `insert_jobs` keeps the rate it has on an empty one (README, "API"). Made in the same ~244 ns
    tick, two ids are in random order; 62 random bits a tick keep them apart."""
    ms, ns = divmod(time.time_ns(), 1_000_000)
    tick = ns * 4096 // 1_000_000
    rand = int.from_bytes(os.urandom(8)) & 0x3FFF_FFFF_FFFF_FFFF
    return uuid.UUID(int=ms << 80 | (0x7000 | tick) << 64 | 0x8000_0000_0000_0000 | rand)


def new_run_id() -> RunId:
    """A fresh run id: a UUID version 7, ordered by the time it was made, random past it."""
    return RunId(_uuid7())


def new_job_id() -> JobId:
    """A fresh job id: a UUID version 7, ordered by the time it was made, random past it."""
    return JobId(_uuid7())


def utc_now() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


class RunStatus(enum.StrEnum):
    """Where a run is: waiting for a scheduler, claimed by one, or finished."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class JobStatus(enum.StrEnum):
    """Where a job is: waiting, being evaluated, or recorded."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class EvalJob(msgspec.Struct, frozen=True):
    """What one job evaluates: a model on one sample in one epoch (the JSON ``spec`` column)."""

    model: str
    sample_id: str
    epoch: int


class JobOutcome(msgspec.Struct, frozen=True):
    """A worker's report on one job (the JSON ``outcome`` column, NULL until the job is done)."""

    job_id: uuid.UUID
    score: float | None = None
    output: str = ""
    error: str | None = None


# msgspec makes kw_only apply to the fields a class defines, so the required fields live on a
# base and the defaulted ones are keyword-only: Run("m", ["a"], 1, 3, status=...).
class _RunFields(msgspec.Struct, frozen=True):
    manifest: str
    models: list[str]
    epochs: int
    job_count: int


class Run(_RunFields, frozen=True, kw_only=True):
    """An evaluation run: a manifest, the models to evaluate, a number of epochs."""

    id: RunId = msgspec.field(default_factory=new_run_id)
    status: RunStatus = RunStatus.QUEUED
    created_at: datetime = msgspec.field(default_factory=utc_now)
    done_count: int = 0

    if TYPE_CHECKING:
        # hash(run) raises TypeError (its models are a list): a type checker that knows it
        # (pyright's reportUnhashable) refuses a run as a dict key or a set member, which only
        # fails once run. Key runs by run.id (README, "API").
        __hash__: ClassVar[None]  # type: ignore[assignment]


class _JobFields(msgspec.Struct, frozen=True):
    run_id: uuid.UUID
    spec: EvalJob


class Job(_JobFields, frozen=True, kw_only=True):
    """One unit of evaluation within a run."""

    id: JobId = msgspec.field(default_factory=new_job_id)
    status: JobStatus = JobStatus.QUEUED
    attempt: int = 0
    outcome: JobOutcome | None = None


class Problem(msgspec.Struct, frozen=True):
    """One inconsistency ``Store.check()`` found, described for a person."""

    table: str
    """The table holding the row ("runs", "jobs"), or "database" for the file as a whole."""
    row_id: str
    """The id of the row at fault ("" for the whole database)."""
    message: str
