"""Runs left 'running' by a scheduler that was killed: the README's recipe to queue them again.

Until claims carry leases nothing tells a dead scheduler from a slow one, so the store leaves
such runs 'running'. The recipe, run by a person once that scheduler is known to be dead: find
them (control-store runs --status running), then queue them again with the guarded UPDATE the
give-back warning prints. These tests run it exactly as the README gives it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from control_store import JobOutcome, RunStatus, Store

from conftest import Worker, assert_sound, make_jobs, make_run, raw_db

pytestmark = pytest.mark.slow

# The README's UPDATE, for the ids the person found: only runs still 'running' change, so a run
# that finished meanwhile (its jobs recorded by workers that outlived the scheduler) stays done.
REQUEUE = "UPDATE runs SET status = 'queued' WHERE id IN ({ids}) AND status = 'running'"
FIND = ["runs", "--status", "running", "--all", "--json"]


def running_runs(path: Path) -> list[str]:
    """The ids ``control-store runs --status running --all --json`` lists, run as a command."""
    done = subprocess.run(
        [sys.executable, "-m", "control_store", *FIND, "--url", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return [run["id"] for run in json.loads(done.stdout)]


async def test_runs_of_a_killed_scheduler_are_queued_again_by_the_readme_update(
    db_path: Path, spawn: Callable[..., Worker]
) -> None:
    """A scheduler process claims two runs and is killed (kill -9) before recording anything;
    one run is then finished by its workers, which outlived it. The runs command lists the
    running ones; the guarded UPDATE, applied by hand through sqlite3, queues only the one
    still running (the finished one stays done); another store claims it, its outcome is
    recorded, and check() finds nothing."""
    stranded, finished = make_run(job_count=1), make_run(job_count=1)
    stranded_jobs, finished_jobs = make_jobs(stranded), make_jobs(finished)
    async with Store.connect(db_path) as store:
        for run, jobs in ((stranded, stranded_jobs), (finished, finished_jobs)):
            await store.insert_run(run)
            await store.insert_jobs(jobs)
    scheduler = spawn("claim", db_path)
    scheduler.expect("ready")
    scheduler.go()
    claimed = [scheduler.expect("claimed")[1] for _ in range(2)]
    scheduler.kill()
    assert sorted(claimed) == sorted([str(stranded.id), str(finished.id)])
    async with Store.connect(db_path) as store:
        # Stranded: no other scheduler can claim them.
        assert await store.claim_next_run() is None
        found = running_runs(db_path)
        assert sorted(found) == sorted(claimed)
        # A worker of the dead scheduler's still reports its job: that run is done.
        assert await store.record_job_outcome(finished.id, JobOutcome(finished_jobs[0].id))
        with raw_db(db_path) as conn:
            ids = ", ".join(f"'{run_id}'" for run_id in found)
            changed = conn.execute(REQUEUE.format(ids=ids)).rowcount
        assert changed == 1
        requeued = await store.get_run(stranded.id)
        done = await store.get_run(finished.id)
        assert requeued is not None
        assert requeued.status is RunStatus.QUEUED
        assert done is not None
        assert done.status is RunStatus.DONE
        assert running_runs(db_path) == []
        again = await store.claim_next_run()
        assert again is not None
        assert again.id == stranded.id
        assert await store.claim_next_run() is None
        assert await store.record_job_outcome(stranded.id, JobOutcome(stranded_jobs[0].id))
    await assert_sound(db_path)


# The README's recipe for a run whose submitter died between insert_run and insert_jobs.
FIND_SHORT = (
    "SELECT id, status, job_rows, job_count FROM runs "
    "WHERE status <> 'done' AND job_rows < job_count"
)
SHRINK = (
    "UPDATE runs SET job_count = job_rows, "
    "status = CASE WHEN done_count = job_rows THEN 'done' ELSE status END "
    "WHERE id = '{id}' AND status <> 'done' AND job_rows BETWEEN 1 AND job_count - 1"
)
DELETE_EMPTY = "DELETE FROM runs WHERE id = '{id}' AND job_rows = 0"


def test_the_readme_gives_the_short_run_recipe_as_these_tests_run_it() -> None:
    """The SQL below is the README's, word for word (whitespace aside)."""
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    for sql in (FIND_SHORT, SHRINK, DELETE_EMPTY):
        assert sql.replace("{id}", "<run id>") in readme.replace("`", ""), sql


async def test_a_run_short_of_jobs_is_found_and_shrunk_by_the_readme_sql(db_path: Path) -> None:
    """A submitter died after inserting 4 of a run's 10 jobs, and another with none: the
    README's SELECT finds both, its UPDATE shrinks the first to its 4 jobs (claimed, it then
    finishes with its last outcome), its DELETE drops the empty one, and check() finds
    nothing."""
    short, empty = make_run(job_count=10), make_run(job_count=3)
    jobs = make_jobs(short)[:4]
    async with Store.connect(db_path) as store:
        await store.insert_run(short)
        await store.insert_jobs(jobs)
        await store.insert_run(empty)
        claimed = await store.claim_next_run()
        assert claimed is not None
        assert claimed.id == short.id
        for job in jobs[:3]:
            assert await store.record_job_outcome(short.id, JobOutcome(job.id))
        with raw_db(db_path) as conn:
            found = {row[0]: row[1:] for row in conn.execute(FIND_SHORT)}
            assert found == {str(short.id): ("running", 4, 10), str(empty.id): ("queued", 0, 3)}
            assert conn.execute(SHRINK.format(id=short.id)).rowcount == 1
            assert conn.execute(DELETE_EMPTY.format(id=empty.id)).rowcount == 1
            assert conn.execute(FIND_SHORT).fetchall() == []
        assert await store.record_job_outcome(short.id, JobOutcome(jobs[3].id))
        done = await store.get_run(short.id)
        assert done is not None
        assert (done.status, done.done_count, done.job_count) == (RunStatus.DONE, 4, 4)
        assert await store.get_run(empty.id) is None
        assert await store.check() == []
