"""A scheduler that stops with runs it claimed gives them back through the store."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from control_store import (
    InvalidInputError,
    JobOutcome,
    ReadOnlyStoreError,
    RunStatus,
    Store,
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
    with pytest.raises(InvalidInputError, match="run_ids"):
        await store.release_runs(run.id)  # type: ignore[arg-type]
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
