"""Rows this version cannot read are reported as CorruptRowError, naming what is wrong."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from control_store import (
    ConstraintError,
    CorruptRowError,
    JobOutcome,
    MissingRunError,
    Run,
    Store,
)

from conftest import make_jobs, make_run, orphaned_jobs, raw_db, stored_run


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("status", "paused"),
        ("models", "not json"),
        ("models", '{"a": 1}'),
        ("created_at", "2026-01-01 00:00:00"),
        ("epochs", "three"),
        ("id", "not-a-uuid"),
    ],
)
async def test_unreadable_run_column_names_table_column_row_and_value(
    db_path: Path, column: str, value: str
) -> None:
    """get_run and claim_next_run raise CorruptRowError with table, column, id and value."""
    run = make_run()
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE runs SET {column} = ?", (value,))
    row_id = value if column == "id" else str(run.id)
    async with Store.connect(db_path) as store:
        with pytest.raises(CorruptRowError) as caught:
            await store.list_runs()
        error = caught.value
        assert (error.table, error.column, error.row_id, error.value) == (
            "runs",
            column,
            row_id,
            value,
        )
        assert f"runs.{column}" in str(error)
        assert repr(value) in str(error)
        problems = await store.check()
        assert any(p.row_id == row_id and column in p.message for p in problems)


@pytest.mark.parametrize("stored", ["5-01-01T00:00:00.000000Z", "999-12-31T23:59:59.999999Z"])
async def test_unpadded_year_from_an_early_release_gets_its_exact_repair(
    db_path: Path, stored: str
) -> None:
    """The first release wrote years below 1000 without leading zeros (glibc's %Y) through
    insert_run: upgraded, such a run blocks every claim_runs() that reaches it, so its error
    and its check() finding give the UPDATE that rewrites it, and that UPDATE cures it."""
    run = make_run()
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
    with raw_db(db_path) as conn:
        conn.execute("UPDATE runs SET created_at = ?", (stored,))
    padded = stored.rjust(len("0005-01-01T00:00:00.000000Z"), "0")
    repair = f"UPDATE runs SET created_at = '{padded}' WHERE id = '{run.id}'"
    async with Store.connect(db_path) as store:
        with pytest.raises(CorruptRowError) as caught:
            await store.claim_runs(10)
        assert repair in str(caught.value)
        problems = await store.check()
        assert [p.message for p in problems if repair in p.message], problems
    with raw_db(db_path) as conn:
        conn.execute(repair)
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        (claimed,) = await store.claim_runs(10)
        assert claimed.id == run.id


@pytest.mark.parametrize(
    ("column", "value"),
    [("status", "lost"), ("spec", '{"model": 1}'), ("outcome", "[]"), ("attempt", -1)],
)
async def test_unreadable_job_column_is_reported(db_path: Path, column: str, value: object) -> None:
    """get_job and list_jobs raise CorruptRowError naming the jobs column and the value."""
    run, (job,) = await stored_run(db_path, job_count=1)
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE jobs SET {column} = ?", (value,))
    async with Store.connect(db_path) as store:
        for call in (store.get_job(job.id), store.list_jobs(run.id)):
            with pytest.raises(CorruptRowError, match=f"jobs.{column}") as caught:
                await call
            assert caught.value.value == value
            assert caught.value.row_id == str(job.id)


@pytest.mark.parametrize(
    ("table", "column", "value"),
    [
        ("runs", "models", '{"a": 1}'),
        ("runs", "models", '["a", 1]'),
        ("runs", "models", 7),
        ("jobs", "spec", '["gpt-4o", "q1", 0]'),
        ("jobs", "outcome", '{"score": 1}'),
    ],
)
async def test_an_unreadable_json_cell_says_what_the_column_holds_and_that_form_reads(
    db_path: Path, table: str, column: str, value: object
) -> None:
    """msgspec's own words ("Expected `array`, got `object`") do not say what to write: the
    message gives the column's form with an example, and that example, written in, reads."""
    run, (job,) = await stored_run(db_path, job_count=1)
    if column == "outcome":  # a recorded job's: its run's counters agree with it
        async with Store.connect(db_path) as store:
            await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE {table} SET {column} = ?", (value,))
    async with Store.connect(db_path) as store:
        read = (lambda: store.get_run(run.id)) if table == "runs" else lambda: store.get_job(job.id)
        with pytest.raises(CorruptRowError) as caught:
            await read()
        message = str(caught.value)
        assert "expected a JSON" in message or "expected NULL or a JSON" in message, message
        example = message.split(" like ", 1)[1].split(";")[0].split(", as text)")[0]
        example = example.replace("<this job's id>", str(job.id))
        with raw_db(db_path) as conn:
            conn.execute(f"UPDATE {table} SET {column} = ?", (example,))
        await read()
        assert await store.check() == []


@pytest.mark.parametrize("column", ["spec", "outcome"])
async def test_json_nested_past_the_recursion_limit_is_a_corrupt_row(
    db_path: Path, column: str
) -> None:
    """A JSON cell whose unknown field nests deeper than Python's recursion limit (which
    msgspec parses to skip, and fails with RecursionError) is a CorruptRowError naming the
    cell for every read, one row or a batch, and a finding of check()."""
    run, jobs = await stored_run(db_path, job_count=12)  # beyond the batch decoders' threshold
    deep = "[" * 100_000 + "]" * 100_000
    job = jobs[5]
    if column == "spec":
        text = f'{{"model":"m","sample_id":"s","epoch":0,"extra":{deep}}}'
    else:
        text = f'{{"job_id":"{job.id}","extra":{deep}}}'
        async with Store.connect(db_path) as store:  # a job that has an outcome is done
            assert await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE jobs SET {column} = ? WHERE id = ?", (text, str(job.id)))
    async with Store.connect(db_path, read_only=True) as store:
        with pytest.raises(CorruptRowError, match=f"jobs.{column}") as caught:
            await store.get_job(job.id)
        assert caught.value.row_id == str(job.id)
        with pytest.raises(CorruptRowError, match=f"jobs.{column}") as caught:
            await store.list_jobs(run.id)
        assert caught.value.row_id == str(job.id)
        with pytest.raises(CorruptRowError, match=f"jobs.{column}"):
            async for _ in store.iter_jobs(run.id, page_size=100):
                pass
        problems = await store.check()
        assert [(p.table, p.row_id) for p in problems] == [("jobs", str(job.id))]
        assert f"jobs.{column}" in problems[0].message


def _job_and_run_rows(path: Path, run: Run) -> tuple[list[Any], list[Any]]:
    with raw_db(path) as conn:
        jobs = conn.execute(
            "SELECT id, status, outcome FROM jobs WHERE run_id = ? ORDER BY rowid", (str(run.id),)
        ).fetchall()
        runs = conn.execute("SELECT status, done_count FROM runs").fetchall()
    return jobs, runs


@pytest.mark.parametrize(
    ("edit", "status", "why", "repair"),
    [
        # 'done' with no outcome: taken for a redelivery, the outcome was dropped, and the run
        # could never finish.
        (
            "UPDATE jobs SET status = 'done' WHERE id = ?",
            "done",
            "the job holds no outcome, so it has not run",
            "UPDATE jobs SET status = 'queued' WHERE id = ?",
        ),
        # A recorded job made 'queued' again: a redelivery overwrote the first outcome and was
        # counted a second time, finishing the run while another job had not run.
        (
            "UPDATE jobs SET status = 'queued' WHERE id = ?",
            "queued",
            "the job holds an outcome, so it is done",
            "UPDATE jobs SET status = 'done' WHERE id = ?",
        ),
        (
            "UPDATE jobs SET status = 'lost' WHERE id = ?",
            "lost",
            "expected one of ['queued', 'running', 'done']",
            "UPDATE jobs SET status = 'done' WHERE id = ?",
        ),
    ],
)
async def test_a_job_whose_status_disagrees_with_its_outcome_is_refused_by_reads_and_records(
    db_path: Path, edit: str, status: str, why: str, repair: str
) -> None:
    """A job is 'done' exactly when it holds an outcome. A row edited by hand out of that is a
    CorruptRowError naming it, for every read (one row or a batch) and for a record of its
    outcome, one or in a batch, which changes nothing; check() names the row, and its repair
    makes the store take the row again."""
    run, jobs = await stored_run(db_path, job_count=12)  # beyond the batch decoders' threshold
    job = jobs[3]
    async with Store.connect(db_path) as store:
        if status != "done":  # the edits that make a recorded job look unrecorded
            assert await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))
    with raw_db(db_path) as conn:
        conn.execute(edit, (str(job.id),))
    before = _job_and_run_rows(db_path, run)
    redelivery = JobOutcome(job.id, score=0.0)
    async with Store.connect(db_path) as store:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: store.get_job(job.id),
            lambda: store.list_jobs(run.id),
            lambda: store.record_job_outcome(run.id, redelivery),
            lambda: store.record_job_outcomes(run.id, [JobOutcome(jobs[0].id), redelivery]),
        ]
        for call in calls:
            with pytest.raises(CorruptRowError, match=r"jobs\.status") as caught:
                await call()
            assert caught.value.row_id == str(job.id)
            assert caught.value.value == status
            assert why in str(caught.value)
        assert _job_and_run_rows(db_path, run) == before
        problems = await store.check()
        assert str(job.id) in [p.row_id for p in problems]
    with raw_db(db_path) as conn:
        conn.execute(repair, (str(job.id),))
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        assert await store.record_job_outcome(run.id, redelivery) is (status == "done")
        assert len(await store.list_jobs(run.id)) == 12
        assert await store.check() == []


async def test_an_outcome_naming_another_job_is_a_corrupt_row(db_path: Path) -> None:
    """A recorded outcome whose job_id names another job (a hand edit, a row copied over
    another) would be reported as this job's result: every read refuses it as a
    CorruptRowError naming both jobs, one row or a batch, and check() reports it. The same
    job's id in upper case is the same UUID, and reads as it is."""
    run, jobs = await stored_run(db_path, job_count=12)  # beyond the batch decoders' threshold
    job, other = jobs[3], jobs[4]
    async with Store.connect(db_path) as store:
        for each in jobs:
            assert await store.record_job_outcome(run.id, JobOutcome(each.id, score=1.0))
    with raw_db(db_path) as conn:
        text = f'{{"job_id":"{other.id}","score":1.0}}'
        conn.execute("UPDATE jobs SET outcome = ? WHERE id = ?", (text, str(job.id)))
        upper = f'{{"job_id":"{str(other.id).upper()}","score":1.0}}'
        conn.execute("UPDATE jobs SET outcome = ? WHERE id = ?", (upper, str(other.id)))
    async with Store.connect(db_path, read_only=True) as store:
        with pytest.raises(CorruptRowError, match=r"jobs\.outcome") as caught:
            await store.get_job(job.id)
        assert caught.value.row_id == str(job.id)
        assert "which cannot be this row's" in str(caught.value)
        assert f"it is the outcome of job {other.id}, and this row is job {job.id}" in str(
            caught.value
        )
        with pytest.raises(CorruptRowError, match=r"jobs\.outcome") as caught:
            await store.list_jobs(run.id)
        assert caught.value.row_id == str(job.id)
        read = await store.get_job(other.id)
        assert read is not None
        assert read.outcome == JobOutcome(other.id, score=1.0)
        problems = await store.check()
        assert [(p.table, p.row_id) for p in problems] == [("jobs", str(job.id))]
        assert f"it is the outcome of job {other.id}" in problems[0].message
        assert "give the row its own job's outcome" in problems[0].message
    with raw_db(db_path) as conn:  # the repair: the row's own job's outcome
        own = f'{{"job_id":"{job.id}","score":1.0}}'
        conn.execute("UPDATE jobs SET outcome = ? WHERE id = ?", (own, str(job.id)))
    async with Store.connect(db_path, read_only=True) as store:
        assert await store.check() == []


@pytest.mark.parametrize("table", ["jobs", "runs"])
async def test_texts_crafted_to_join_into_other_values_are_refused_in_a_batch_too(
    db_path: Path, table: str
) -> None:
    """Three JSON cells edited so that, joined into one array, they would read as three other
    values (one opens a string the next closes, the third holds two values): a batch read
    (list_jobs, iter_jobs, list_runs, beyond the batch decoders' threshold) refuses the first
    as a one-row read does, instead of making up values no row holds."""
    run, jobs = await stored_run(db_path, job_count=12)
    runs = [run, *(make_run() for _ in range(11))]
    async with Store.connect(db_path) as store:
        for other in runs[1:]:
            await store.insert_run(other)
    if table == "jobs":
        column, rows = "spec", [str(job.id) for job in jobs[:3]]
        texts = [
            '{"model":"m","sample_id":"s0',
            '","epoch":0}',
            '{"model":"m","sample_id":"a","epoch":0},{"model":"m","sample_id":"b","epoch":0}',
        ]
    else:
        # Adjacent in list_runs' order, newest first.
        column, rows = "models", [str(each.id) for each in runs[:-4:-1]]
        texts = ['["a","b', '"]', '["x"],["y"]']
    with raw_db(db_path) as conn:
        for row_id, text in zip(rows, texts, strict=True):
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE id = ?", (text, row_id))
    async with Store.connect(db_path, read_only=True) as store:
        batch = store.list_jobs(run.id) if table == "jobs" else store.list_runs()
        with pytest.raises(CorruptRowError) as caught:
            await batch
        assert (caught.value.table, caught.value.column) == (table, column)
        assert caught.value.row_id in rows
        if table == "jobs":
            with pytest.raises(CorruptRowError):
                async for _ in store.iter_jobs(run.id, page_size=100):
                    pass


async def test_recording_against_a_corrupt_run_changes_nothing(db_path: Path) -> None:
    """An outcome whose run cannot advance leaves the job undone: job and run move together."""
    run, (job,) = await stored_run(db_path, job_count=1)
    with raw_db(db_path) as conn:
        conn.execute(
            "CREATE TRIGGER refuse BEFORE UPDATE ON runs BEGIN SELECT RAISE(ABORT, 'no'); END"
        )
    async with Store.connect(db_path) as store:
        with pytest.raises(ConstraintError, match="SQLITE_CONSTRAINT_TRIGGER"):
            await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))
    with raw_db(db_path) as conn:
        assert conn.execute("SELECT status, outcome FROM jobs").fetchone() == ("queued", None)


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
async def test_outcome_for_a_job_whose_run_was_deleted_names_the_job(
    db_path: Path, batch: bool
) -> None:
    """Recording for a job whose run row is gone names that jobs row by its own id."""
    run, jobs = await orphaned_jobs(db_path)
    async with Store.connect(db_path) as store:
        outcomes = [JobOutcome(job.id) for job in jobs]
        record = (
            store.record_job_outcomes(run.id, outcomes)
            if batch
            else store.record_job_outcome(run.id, outcomes[0])
        )
        with pytest.raises(CorruptRowError) as caught:
            await record
        error = caught.value
        assert (error.table, error.column, error.row_id, error.value) == (
            "jobs",
            "run_id",
            str(jobs[0].id),
            str(run.id),
        )
        assert f"of row {jobs[0].id}" in str(error)
    with raw_db(db_path) as conn:
        assert conn.execute("SELECT DISTINCT status FROM jobs").fetchall() == [("queued",)]


async def test_jobs_for_a_missing_run_with_foreign_keys_off_name_the_job(store: Store) -> None:
    """insert_jobs on a connection whose foreign keys were turned off still refuses a missing
    run, naming a job of the call and the run, and inserts nothing."""
    run = make_run(job_count=2)
    jobs = make_jobs(run)
    backend = store._backend
    assert backend is not None
    await backend.read(lambda conn: conn.execute("PRAGMA foreign_keys = OFF"))
    try:
        with pytest.raises(MissingRunError) as caught:
            await store.insert_jobs(jobs)
    finally:
        await backend.read(lambda conn: conn.execute("PRAGMA foreign_keys = ON"))
    message = str(caught.value)
    assert f"run {run.id}, which does not exist" in message
    assert any(f"job {job.id} " in message for job in jobs)
    assert await store.list_jobs(run.id) == []


async def test_a_huge_unreadable_value_is_shown_cut_in_messages_and_findings(
    db_path: Path,
) -> None:
    """A 2 MB output edited into a bad outcome: the read's error and check()'s finding show the
    value cut (and say how long it was), and still end with what was wrong. The error's
    ``value`` keeps the whole value."""
    _, (job,) = await stored_run(db_path, job_count=1)
    output = "x" * 2_000_000
    outcome = f'{{"job_id": "{job.id}", "score": "0.5", "output": "{output}"}}'
    with raw_db(db_path) as conn:
        conn.execute("UPDATE jobs SET outcome = ?, status = 'done'", (outcome,))
        conn.execute("UPDATE runs SET done_count = 1, status = 'done'")
    async with Store.connect(db_path) as store:
        with pytest.raises(CorruptRowError) as caught:
            await store.get_job(job.id)
        (finding,) = await store.check()
    assert caught.value.value == outcome
    for message in (str(caught.value), finding.message):
        assert len(message) < 2_000
        assert f"({len(repr(outcome))} characters in all)" in message
        assert message.endswith("repair the row by hand or restore it from a backup")
        assert "$.score" in message


# Which writes read which of a run's counters: a record advances done_count up to job_count,
# an insert of jobs adds to job_rows up to job_count.
_COUNTER_WRITES = {
    "done_count": ("record_job_outcome", "record_job_outcomes"),
    "job_count": ("record_job_outcome", "record_job_outcomes", "insert_jobs"),
    "job_rows": ("insert_jobs",),
}


@pytest.mark.parametrize("column", sorted(_COUNTER_WRITES))
async def test_a_counter_edited_into_text_refuses_every_write_that_reads_it(
    db_path: Path, column: str
) -> None:
    """A run's counter edited by hand into text: each write whose guard reads it (recording an
    outcome, one or a batch; inserting jobs) raises the CorruptRowError naming that cell and
    changes nothing, rather than overwriting it, or letting jobs past a job_count that can no
    longer be compared."""
    run = make_run(job_count=4)
    jobs = make_jobs(run)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs[:2])
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE runs SET {column} = 'abc'")
        before = conn.execute("SELECT * FROM runs").fetchall()
    async with Store.connect(db_path) as store:
        writes: dict[str, Callable[[], Awaitable[object]]] = {
            "record_job_outcome": lambda: store.record_job_outcome(run.id, JobOutcome(jobs[0].id)),
            "record_job_outcomes": lambda: store.record_job_outcomes(
                run.id, [JobOutcome(jobs[1].id)]
            ),
            "insert_jobs": lambda: store.insert_jobs(jobs[2:]),
        }
        for name in _COUNTER_WRITES[column]:
            with pytest.raises(CorruptRowError) as caught:
                await writes[name]()
            assert (caught.value.table, caught.value.row_id) == ("runs", str(run.id)), name
            assert caught.value.column in ("done_count", "job_count", "job_rows"), name
    with raw_db(db_path) as conn:
        assert conn.execute("SELECT * FROM runs").fetchall() == before
        assert conn.execute("SELECT count(*), count(outcome) FROM jobs").fetchone() == (2, 0)


@pytest.mark.parametrize(
    "respell", ["CAST(id AS BLOB)", "CAST(x'ff' || id AS TEXT)"], ids=["blob", "not-utf8"]
)
async def test_unpadded_year_repair_never_names_a_row_by_an_id_it_cannot_spell(
    db_path: Path, respell: str
) -> None:
    """A run whose id is no text (a BLOB, or text that is no UTF-8) and whose created_at an
    early release wrote unpadded gets no UPDATE WHERE id = '<repr of the bytes>': that matches
    no row, or the other row whose id is that text, which it would rewrite."""
    damaged, other = make_run(), make_run()
    async with Store.connect(db_path) as store:
        await store.insert_run(damaged)
        await store.insert_run(other)
    with raw_db(db_path) as conn:
        conn.execute(
            f"UPDATE runs SET id = {respell}, created_at = '5-01-01T00:00:00.000000Z' WHERE id = ?",
            (str(damaged.id),),
        )
        conn.execute("UPDATE runs SET id = ? WHERE id = ?", (f"b'{damaged.id}'", str(other.id)))
    async with Store.connect(db_path) as store:
        problems = await store.check()
    found = [p.message for p in problems if "runs.created_at" in p.message]
    assert found, problems
    assert not any("UPDATE runs SET created_at" in m for m in found), found
