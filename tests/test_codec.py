"""The codec's fast paths agree with its checked paths, and bad values still get diagnosed."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from control_store import CorruptRowError, EvalJob, Job, JobOutcome, Run, RunStatus, Store, _codec

from conftest import make_run


def test_fast_and_checked_paths_encode_and_decode_alike() -> None:
    """run_params/job_params/outcome_json and the decoders give what the checked paths give."""
    run = Run("m", ["a", "b"], 2, 5, status=RunStatus.RUNNING, done_count=1)
    row = _codec.run_params(run)
    assert row == _codec._checked_run_params(run)
    assert _codec.decode_run(row) == _codec._checked_run(row) == run
    job = Job(run.id, EvalJob("a", "s", -3), attempt=2)
    job_row = _codec.job_params(job)
    assert job_row == _codec._checked_job_params(job)
    assert _codec.decode_job(job_row) == _codec._checked_job(job_row) == job
    outcome = JobOutcome(job.id, score=0.25, output="x", error="e")
    assert _codec.outcome_json(outcome) == _codec._checked_outcome_json(outcome)


@pytest.mark.parametrize(
    ("index", "value", "column"),
    [
        (0, "not-a-uuid", "id"),
        (2, "[1]", "models"),
        (3, 0, "epochs"),
        (5, "paused", "status"),
        (6, "2026-01-01 00:00:00.000000Z", "created_at"),
        (6, "2026-01-01T00:00:00,000000Z", "created_at"),
        (6, "2026-01-01T00:00:00.000000+00:00", "created_at"),
    ],
)
def test_a_corrupt_run_row_is_diagnosed(index: int, value: object, column: str) -> None:
    """A value the fast path refuses reaches the checked path and names its column."""
    row = list(_codec.run_params(make_run()))
    row[index] = value
    with pytest.raises(CorruptRowError, match=rf"runs\.{column} of row") as caught:
        _codec.decode_run(tuple(row))
    assert caught.value.column == column


def test_a_corrupt_job_row_is_diagnosed() -> None:
    """A job row with a bad spec names the column and the value."""
    job = Job(uuid.uuid4(), EvalJob("a", "s", 0))
    row = list(_codec.job_params(job))
    row[2] = '{"model": 1}'
    with pytest.raises(CorruptRowError, match=r"jobs\.spec of row"):
        _codec.decode_job(tuple(row))


@pytest.mark.parametrize(
    "created_at",
    [
        datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
        datetime(2026, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=1))),
    ],
    ids=["year-999", "year-1", "offset"],
)
async def test_early_years_keep_the_fixed_width(store: Store, created_at: datetime) -> None:
    """Years before 1000 are stored with four digits and read back as the same instant."""
    run = make_run(created_at=created_at)
    assert len(_codec.run_params(run)[6]) == len("2026-01-01T00:00:00.000000Z")
    await store.insert_run(run)
    assert await store.get_run(run.id) == run
