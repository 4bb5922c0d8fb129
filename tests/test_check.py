"""store.check(): every broken invariant is found, described for a person, and nothing changes."""

from __future__ import annotations

import asyncio
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest

from control_store import (
    AlreadyExistsError,
    ConstraintError,
    ControlError,
    CorruptRowError,
    Job,
    JobOutcome,
    MigrationError,
    MissingRunError,
    NotFoundError,
    Problem,
    Store,
    _codec,
    _sqlite,
)

from conftest import (
    follow_advice,
    make_jobs,
    make_run,
    orphaned_jobs,
    raw_db,
    stored_run,
    traced,
)

# runs' columns but id, in table order: a hand copy of a run is INSERT ... SELECT <id>, these.
_RUN_COLUMNS: Final = (
    "manifest, models, epochs, job_count, status, created_at, done_count, job_rows"
)


def _copy_runs(new_id: str) -> str:
    """SQL copying every run under the id ``new_id`` (an SQL expression of ``id``), as a hand
    insert would."""
    return f"INSERT INTO runs SELECT {new_id}, {_RUN_COLUMNS} FROM runs"


def _copy_jobs(new_id: str, *, run_id: str = "run_id", where: str = "id = ?") -> str:
    """SQL copying the jobs ``where`` selects under the id ``new_id``, and the run id
    ``run_id`` (SQL expressions of the row's columns), as a hand insert would."""
    return (
        f"INSERT INTO jobs SELECT {new_id}, {run_id}, spec, status, attempt, outcome FROM jobs "
        f"WHERE {where}"
    )


async def _edit(store: Store, sql: str, *params: object) -> None:
    """Hand edits (``;``-separated) through the store's own connection, foreign keys off as in a
    shell."""
    backend = store._backend
    assert backend is not None

    def edit(conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA foreign_keys = OFF")
        try:
            for statement in sql.split(";"):
                conn.execute(statement, params)
        finally:
            conn.execute("PRAGMA foreign_keys = ON")

    await backend.read(edit)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            "UPDATE runs SET done_count = 2",
            r"has done_count 2 but 1 of its jobs are done \(have an outcome\); set done_count to 1",
        ),
        (
            "UPDATE jobs SET status = 'done' WHERE outcome IS NULL",
            r"is 'done' but has no outcome; set its status to 'queued'",
        ),
        (
            "UPDATE runs SET status = 'done'",
            r"is 'done' but only 1 of its 3 jobs are done; set its status to 'queued'",
        ),
        (
            "DELETE FROM jobs WHERE outcome IS NULL; UPDATE runs SET job_count = 1, job_rows = 1",
            r"has all 1 jobs done but is 'running'; set its status to 'done'",
        ),
        ("UPDATE runs SET job_count = 2", r"has job_count 2 but 3 jobs; delete the jobs"),
        ("UPDATE jobs SET run_id = 'gone'", r"has run_id gone, which is no run's id \(no UUID\)"),
        ("UPDATE runs SET epochs = 'many'", r"runs\.epochs of row \S+ holds 'many'"),
        ("UPDATE runs SET id = upper(id)", r"has its id stored as non-canonical text"),
        ("UPDATE jobs SET id = upper(id)", r"has its id stored as non-canonical text"),
        ("UPDATE jobs SET run_id = upper(run_id)", r"in non-canonical text; rewrite its run_id"),
        ("UPDATE runs SET job_rows = 2", r"run \S+ has job_rows 2 but 3 jobs; set job_rows to 3"),
        (
            "DELETE FROM jobs; UPDATE runs SET job_count = 0, job_rows = 0, done_count = 0",
            r"has job_count 0 and is 'running': no outcome can ever finish it",
        ),
        (
            "UPDATE jobs SET status = 'queued' WHERE outcome IS NOT NULL",
            r"is 'queued' but has an outcome; set its status to 'done'",
        ),
    ],
    ids=[
        "miscounted",
        "done-without-outcome",
        "done-too-early",
        "finished-not-done",
        "too-many-jobs",
        "orphan-job",
        "unreadable",
        "run-id-spelling",
        "job-id-spelling",
        "run-id-spelling-in-job",
        "job-rows-drift",
        "no-jobs-to-finish",
        "outcome-not-done",
    ],
)
async def test_check_reports_each_broken_invariant(store: Store, edit: str, expected: str) -> None:
    """A hand edit that breaks an invariant is reported, with the row and what is wrong."""
    run = make_run(job_count=3)
    jobs = make_jobs(run)
    await store.insert_run(run)
    await store.insert_jobs(jobs)
    await store.claim_next_run()
    await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0))
    assert await store.check() == []
    await _edit(store, edit)
    problems = await store.check()
    assert problems
    assert any(re.search(expected, p.message) for p in problems), problems
    assert all(p.table in ("runs", "jobs") and p.row_id for p in problems)


async def test_check_changes_nothing(db_path: Path) -> None:
    """check() on a damaged database leaves every row of it as it was."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=2)
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
        await _edit(store, "UPDATE runs SET done_count = 5, status = 'done'")
    before = _dump(db_path)
    async with Store.connect(db_path, migrate=False) as store:
        assert await store.check()
        assert await store.check()
        backend = store._backend
        assert backend is not None
        assert await backend.read(lambda conn: conn.total_changes) == 0
    assert _dump(db_path) == before


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


async def test_check_reports_a_damaged_file(db_path: Path) -> None:
    """A database whose pages were overwritten fails SQLite's integrity check inside check()."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=200)
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
    raw = sqlite3.connect(db_path)
    try:
        raw.execute("PRAGMA writable_schema = ON")
        (root,) = raw.execute(
            "SELECT rootpage FROM sqlite_schema WHERE name = 'idx_jobs_run'"
        ).fetchone()
        (page_size,) = raw.execute("PRAGMA page_size").fetchone()
    finally:
        raw.close()
    with db_path.open("r+b") as file:  # scribble over the index's root page
        file.seek((root - 1) * page_size)
        file.write(b"\x00" * 64)
    async with Store.connect(db_path, migrate=False) as store:
        problems = await store.check()
    assert any(p.table == "database" and "integrity check" in p.message for p in problems)


async def _jobs_rebuilt(path: Path, remake: Callable[[str], str]) -> list[str]:
    """A store of one run's two jobs whose jobs table was rebuilt by hand from
    ``remake(its CREATE TABLE)``, rows and index too; what check() then finds."""
    async with Store.connect(path) as store:
        run = make_run(job_count=2)
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
    with raw_db(path) as conn:
        (sql,) = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'jobs'").fetchone()
        remade = remake(sql)
        assert remade != sql
        conn.execute(remade.replace("CREATE TABLE jobs", "CREATE TABLE j2", 1))
        conn.execute("INSERT INTO j2 SELECT * FROM jobs")
        conn.execute("DROP TABLE jobs")
        conn.execute("ALTER TABLE j2 RENAME TO jobs")
        conn.execute("CREATE INDEX idx_jobs_run ON jobs (run_id)")
    async with Store.connect(path, migrate=False) as store:
        return [p.message for p in await store.check()]


@pytest.mark.parametrize("option", ["WITHOUT ROWID", "STRICT"])
async def test_a_table_rebuilt_with_table_options_is_named(db_path: Path, option: str) -> None:
    """jobs rebuilt by hand as WITHOUT ROWID (every read of the store orders by rowid) or
    STRICT: a schema finding naming the option, and the row checks skipped, where check() used
    to fail blaming a trigger or view of the user's."""
    messages = await _jobs_rebuilt(db_path, lambda sql: f"{sql} {option}")
    assert any(
        m.startswith(f"table jobs is made {option}, not as this release made it") for m in messages
    ), messages
    assert messages[-1].startswith("the row-level checks were skipped")


@pytest.mark.parametrize("clause", ["ABORT", "FAIL"])
async def test_a_conflict_clause_that_still_refuses_the_write_is_no_finding(
    db_path: Path, clause: str
) -> None:
    """ON CONFLICT ABORT (SQLite's default) or FAIL still refuse an insert of a stored id,
    and the store rolls back what the call wrote: nothing to report. (ROLLBACK ends the whole
    group transaction, a finding: see the test below.)"""
    messages = await _jobs_rebuilt(
        db_path,
        lambda sql: sql.replace(
            "PRIMARY KEY NOT NULL", f"PRIMARY KEY ON CONFLICT {clause} NOT NULL"
        ),
    )
    assert messages == []
    async with Store.connect(db_path) as store:
        (run,) = await store.list_runs()
        (job, *_) = await store.list_jobs(run.id)
        with pytest.raises(AlreadyExistsError):
            await store.insert_jobs([job])
        assert await store.check() == []


@pytest.mark.parametrize(
    ("clause", "effect"),
    [
        ("ON CONFLICT REPLACE", "replace the stored row, instead"),
        ("on  conflict ignore", "be dropped without a word, instead"),
        ("ON CONFLICT ROLLBACK", "roll back the whole group transaction, failing"),
    ],
)
async def test_a_primary_key_rebuilt_with_a_conflict_clause_is_named(
    db_path: Path, clause: str, effect: str
) -> None:
    """jobs rebuilt by hand with its primary key ON CONFLICT REPLACE, IGNORE or ROLLBACK, which
    pragma_table_info does not show: an insert of a stored job id replaced the recorded job
    with a new one, dropped the insert without a word, or ended the group's transaction (other
    callers' one-shot writes failing with it), where the store refuses it alone. check() names
    the clause and what it does; the same words in a default's text or a comment are no
    clause."""
    messages = await _jobs_rebuilt(
        db_path, lambda sql: sql.replace("PRIMARY KEY NOT NULL", f"PRIMARY KEY {clause} NOT NULL")
    )
    shown = " ".join(clause.upper().split())
    assert messages[0].startswith(f"table jobs is made with {shown}, which this release's"), (
        messages
    )
    assert f"an insert of an id already stored would {effect}" in messages[0]
    assert len(messages) == 1, messages  # the rows are read as ever
    quiet = await _jobs_rebuilt(
        db_path.with_name("quiet.db"),
        lambda sql: sql.replace(
            "outcome  TEXT",
            "outcome TEXT -- on conflict ignore\n, CHECK (status != 'on conflict replace')",
        ),
    )
    assert quiet == []


async def test_a_column_rebuilt_with_another_collation_is_named_not_its_index(
    db_path: Path,
) -> None:
    """jobs rebuilt by hand with run_id COLLATE NOCASE, which pragma_table_info does not show:
    check() names the column, its collation and the index keying it, whose repair is the
    table's. It used to report only idx_jobs_run, whose DROP and CREATE made it again with the
    column's collation, the same finding after each repair. COLLATE in a comment, a string or
    a CHECK's expression, or an explicit BINARY, is no finding."""
    messages = await _jobs_rebuilt(
        db_path,
        lambda sql: sql.replace(
            "run_id   TEXT    NOT NULL", 'run_id TEXT NOT NULL COLLATE "nocase"'
        ),
    )
    assert len(messages) == 1, messages  # the index is not reported apart, the rows are read
    assert messages[0].startswith(
        "column jobs.run_id is made COLLATE NOCASE, not BINARY as this release made it"
    )
    assert "the indexes keying it (idx_jobs_run)" in messages[0]
    assert "restore the database from a backup (without one, make it again" in messages[0]
    # After a constraint in parentheses too (it was read as the end of the column).
    after = await _jobs_rebuilt(
        db_path.with_name("after.db"),
        lambda sql: sql.replace(
            "run_id   TEXT    NOT NULL",
            "run_id TEXT NOT NULL CHECK (length(run_id) IN (36, (36))) COLLATE NOCASE",
        ),
    )
    assert len(after) == 1, after
    assert after[0].startswith("column jobs.run_id is made COLLATE NOCASE, not BINARY")
    quiet = await _jobs_rebuilt(
        db_path.with_name("quiet.db"),
        lambda sql: sql.replace(
            "spec     TEXT    NOT NULL",
            "spec TEXT NOT NULL COLLATE Binary -- collate nocase\n CHECK (spec COLLATE rtrim"
            " != 'collate nocase') /* COLLATE NOCASE */",
        ).replace(
            "status   TEXT    NOT NULL DEFAULT 'queued'",
            "status TEXT NOT NULL DEFAULT 'queued' COLLATE 'BINARY'",
        ),
    )
    assert quiet == []


async def test_a_foreign_key_added_to_one_of_the_schemas_columns_is_named(db_path: Path) -> None:
    """jobs rebuilt by hand with spec REFERENCES runs (id), a foreign key this release does not
    make: check() names it (it found nothing), and an insert it refuses says so, naming the
    job and that its run exists, not "refers to run ..., which does not exist". One on a
    column of the user's own is theirs: no finding."""
    messages = await _jobs_rebuilt(
        db_path,
        lambda sql: sql.replace(
            "spec     TEXT    NOT NULL", "spec TEXT NOT NULL REFERENCES runs (id)"
        ),
    )
    with raw_db(db_path) as conn:  # the user's own column, with a key of its own
        conn.execute("ALTER TABLE runs ADD COLUMN note TEXT REFERENCES runs (id)")
    assert [p.message for p in await _check(db_path)] == messages
    (message,) = messages
    assert message.startswith(
        "column jobs.spec refers to runs(id), a foreign key this release's schema does not make"
    )
    assert "restore the database from a backup (without one, make it again" in message
    async with Store.connect(db_path) as store:
        run = make_run(job_count=1)
        await store.insert_run(run)
        (job,) = make_jobs(run)
        with pytest.raises(ConstraintError) as caught:
            await store.insert_jobs([job])
        assert not isinstance(caught.value, MissingRunError)
        assert f"job {job.id} was refused by a foreign key this release's schema does" in str(
            caught.value
        )
        assert f"(its run {run.id} exists)" in str(caught.value)
        assert await store.list_jobs(run.id) == []
    # A second key on a column that has this release's: it was no finding.
    second = await _jobs_rebuilt(
        db_path.with_name("second.db"),
        lambda sql: sql.replace(
            "outcome  TEXT",
            "outcome TEXT, FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE",
        ),
    )
    assert len(second) == 1, second
    assert second[0].startswith(
        "column jobs.run_id refers to runs(id) ON DELETE CASCADE, a foreign key this release's"
    )


async def test_a_write_refused_by_a_check_constraint_of_the_users_says_so(db_path: Path) -> None:
    """A CHECK constraint a table was rebuilt with is the user's own, as a trigger is: no
    finding. A write it refuses is a ConstraintError naming it, saying nothing was written,
    where to see it and how to write past it; it used to give SQLite's words alone."""
    run = make_run(job_count=1)
    messages = await _jobs_rebuilt(
        db_path,
        lambda sql: sql.replace(
            "spec     TEXT    NOT NULL",
            f"spec TEXT NOT NULL CONSTRAINT not_that_run CHECK (run_id != '{run.id}')",
        ),
    )
    assert messages == []
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        (job,) = make_jobs(run)
        with pytest.raises(ConstraintError) as caught:
            await store.insert_jobs([job])
        assert await store.list_jobs(run.id) == []
    message = str(caught.value)
    assert "refused the write: a CHECK constraint this store's schema does not make" in message
    assert "CHECK constraint failed: not_that_run" in message
    assert "nothing of this call was written" in message
    assert "SELECT name, sql FROM sqlite_schema WHERE sql LIKE '%CHECK%'" in message


@pytest.mark.parametrize("action", ["ABORT", "FAIL", "ROLLBACK"])
async def test_a_write_refused_by_a_trigger_of_the_users_says_so(
    db_path: Path, action: str
) -> None:
    """A trigger of the user's (no finding of check()) that RAISEs on a write of the store's
    is a ConstraintError saying a trigger refused it, and where to see the triggers: it gave
    SQLite's words alone, with no fix."""
    run = make_run(job_count=1)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
    with raw_db(db_path) as conn:
        conn.execute(
            "CREATE TRIGGER no_jobs BEFORE INSERT ON jobs "
            f"BEGIN SELECT RAISE({action}, 'jobs are closed today'); END"
        )
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        with pytest.raises(ConstraintError) as caught:
            await store.insert_jobs(make_jobs(run))
        assert await store.list_jobs(run.id) == []
    message = str(caught.value)
    assert "refused the write: a trigger that is not the store's (its schema makes none)" in message
    assert "jobs are closed today" in message
    assert "nothing of this call was written" in message
    assert "SELECT name, sql FROM sqlite_schema WHERE type = 'trigger'" in message


async def test_a_write_refused_by_a_unique_index_of_the_users_is_no_already_exists(
    store: Store,
) -> None:
    """A unique index of someone's own on the store's tables (check() leaves it be) refuses a
    run or job whose id is new: a ConstraintError saying which index-held value it is, not
    AlreadyExistsError's "a row with this id already exists"."""
    backend = store._open()
    await backend.read(
        lambda conn: conn.execute("CREATE UNIQUE INDEX one_manifest ON runs (manifest)")
    )
    await store.insert_run(make_run())
    with pytest.raises(ConstraintError) as caught:
        await store.insert_run(make_run())
    assert not isinstance(caught.value, AlreadyExistsError)
    assert "a UNIQUE index or constraint this store's schema does not make already holds" in (
        str(caught.value)
    )
    assert "UNIQUE constraint failed: runs.manifest" in str(caught.value)
    # The listing it gives is of that table, and tells its primary key's index (_1) apart.
    assert "tbl_name = 'runs'" in str(caught.value)
    assert "sqlite_autoindex_runs_N with N above 1" in str(caught.value)
    assert len(await store.list_runs()) == 1


async def test_a_trigger_named_as_one_of_the_schemas_indexes_is_no_finding(db_path: Path) -> None:
    """Triggers have names of their own, apart from tables', views' and indexes': a user's
    trigger named idx_runs_created hid the index of that name from check(), which then asked
    for an index that was there (and whose repair failed on it)."""
    await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("CREATE TRIGGER idx_runs_created AFTER INSERT ON runs BEGIN SELECT 1; END")
    assert await _check(db_path) == []
    with raw_db(db_path) as conn:
        conn.execute("DROP INDEX idx_runs_created")
    (problem,) = await _check(db_path)
    assert problem.message.endswith(
        "make it again: CREATE INDEX idx_runs_created ON runs (created_at)"
    )
    with raw_db(db_path) as conn:
        conn.executescript(problem.message.split("make it again: ")[1])
        triggers = conn.execute("SELECT name FROM sqlite_schema WHERE type = 'trigger'").fetchall()
    assert triggers == [("idx_runs_created",)]  # the user's, kept
    assert await _check(db_path) == []


@pytest.mark.parametrize(
    "holder", ["VIEW idx_runs_created AS SELECT 1", "TABLE idx_runs_created (a)"]
)
async def test_an_index_whose_name_another_object_holds_gets_a_repair_that_works(
    db_path: Path, holder: str
) -> None:
    """A view or a table standing under the name of one of this release's indexes: the repair
    moves it out of the way (a view dropped, a table, someone's rows, renamed), then makes the
    index; followed as written, nothing is left to find."""
    await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("DROP INDEX idx_runs_created")
        conn.execute(f"CREATE {holder}")
        if holder.startswith("TABLE"):
            conn.execute("INSERT INTO idx_runs_created VALUES ('kept')")
    (problem,) = await _check(db_path)
    assert "lacks index idx_runs_created as this release made it" in problem.message
    with raw_db(db_path) as conn:
        conn.executescript(problem.message.split("make it again: ")[1])
    assert await _check(db_path) == []
    if holder.startswith("TABLE"):
        with raw_db(db_path) as conn:
            assert conn.execute("SELECT a FROM idx_runs_created_moved").fetchall() == [("kept",)]


async def test_a_foreign_key_rebuilt_with_an_action_is_named(db_path: Path) -> None:
    """jobs.run_id rebuilt by hand with ON DELETE CASCADE (deleting a run would delete its
    jobs): a finding naming the action and the one this release made, not "no longer refers"."""
    cascade = "REFERENCES runs (id) ON DELETE CASCADE"
    messages = await _jobs_rebuilt(
        db_path, lambda sql: sql.replace("REFERENCES runs (id)", cascade)
    )
    assert messages == [
        "column jobs.run_id refers to runs(id) ON DELETE CASCADE, where this release made it "
        "with no action (a table rebuilt by hand); restore the database from a backup",
        _sqlite._ROWS_NEED_SCHEMA,
    ]


def _second_row_for_a_key(path: Path, job_id: str) -> None:
    """Behind SQLite's back: a second jobs row with ``job_id``, which the primary key's index
    never got (the index is taken out of the schema for the INSERT, then put back)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        table_sql, index_row = conn.execute(
            "SELECT (SELECT sql FROM sqlite_schema WHERE name = 'jobs'), "
            "(SELECT rootpage FROM sqlite_schema WHERE name = 'sqlite_autoindex_jobs_1')"
        ).fetchone()
        conn.execute("PRAGMA writable_schema = ON")
        loose = table_sql.replace("PRIMARY KEY NOT NULL", "NOT NULL", 1)
        conn.execute("UPDATE sqlite_schema SET sql = ? WHERE name = 'jobs'", (loose,))
        conn.execute("DELETE FROM sqlite_schema WHERE name = 'sqlite_autoindex_jobs_1'")
    finally:
        conn.close()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("INSERT INTO jobs SELECT * FROM jobs WHERE id = ?", (job_id,))
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_schema SET sql = ? WHERE name = 'jobs'", (table_sql,))
        conn.execute(
            "INSERT INTO sqlite_schema VALUES "
            "('index', 'sqlite_autoindex_jobs_1', 'jobs', ?, NULL)",
            (index_row,),
        )
    finally:
        conn.close()


async def test_a_key_held_twice_is_found_and_its_repair_works_as_written(db_path: Path) -> None:
    """A unique index missing the entry of a second row with one key: REINDEX alone fails
    ("UNIQUE constraint failed"), so the finding also says how to list the two rows; deleting
    the extra by its rowid, then REINDEX, as written, makes the database sound."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=2)
        await store.insert_run(run)
        jobs = make_jobs(run)
        await store.insert_jobs(jobs)
    _second_row_for_a_key(db_path, str(jobs[0].id))
    async with Store.connect(db_path, migrate=False) as store:
        problems = await store.check()
    # "row 3 missing from index ...", then "wrong # of entries in index ...": the same repair.
    findings = [p.message for p in problems if "sqlite_autoindex_jobs_1" in p.message]
    assert findings
    listing = re.search(r"list them with (SELECT .*?\)), delete", findings[0])
    assert listing is not None, findings[0]
    with raw_db(db_path) as conn:
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
            conn.execute("REINDEX sqlite_autoindex_jobs_1")
        rows = conn.execute(listing[1]).fetchall()
        assert [row[1] for row in rows] == [str(jobs[0].id)] * 2
        conn.execute("DELETE FROM jobs WHERE rowid = ?", (max(row[0] for row in rows),))
        conn.execute("REINDEX sqlite_autoindex_jobs_1")
    async with Store.connect(db_path, migrate=False) as store:
        assert await store.check() == []


async def test_damaged_pages_are_a_finding_each(db_path: Path) -> None:
    """SQLite reports damaged pages in one row of several lines under a "*** in database
    main ***" heading: check() makes each line a finding of its own, one line of text each,
    and the heading none."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=2000)
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
    with db_path.open("r+b") as file:  # scribble over pages 3 on, the jobs' b-trees among them
        file.seek(8192)
        file.write(bytes(range(256)) * 100)
    async with Store.connect(db_path, migrate=False) as store:
        problems = await store.check()
    pages = [p for p in problems if re.match(r"SQLite integrity check: Page \d+: ", p.message)]
    assert len(pages) >= 2
    for problem in problems:
        assert "\n" not in problem.message
        assert "*** in database" not in problem.message


async def test_a_job_whose_run_is_missing_is_named_by_its_id(db_path: Path) -> None:
    """A job whose run row was deleted is reported by the job's id, naming the missing run."""
    run, jobs = await orphaned_jobs(db_path)
    problems = await _check(db_path)
    assert sorted(p.row_id for p in problems) == sorted(str(job.id) for job in jobs)
    for problem in problems:
        assert problem.table == "jobs"
        assert problem.message == (
            f"job {problem.row_id} refers to run {run.id}, which does not exist; restore run "
            f"{run.id} from a backup, or delete this job"
        )


async def test_the_jobs_of_a_missing_run_past_a_hundred_get_one_finding(db_path: Path) -> None:
    """A run deleted by hand leaves all its jobs without it: the first hundred get a finding
    each, the rest one together (a run of a million jobs gave a million findings, 241 MB of
    output), naming the first of them, how many, and the DELETE for them all; made as given,
    nothing is left to find."""
    run, jobs = await stored_run(db_path, job_count=_sqlite._ORPHANS_NAMED + 3)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("DELETE FROM runs")
    problems = await _check(db_path)
    assert [p.row_id for p in problems] == [
        str(job.id) for job in jobs[: _sqlite._ORPHANS_NAMED + 1]
    ]
    *each, together = problems
    assert all(f"refers to run {run.id}, which does not exist" in p.message for p in each)
    assert together.message.startswith(
        f"job {jobs[_sqlite._ORPHANS_NAMED].id} and 2 more jobs with run_id {run.id} have the "
        "finding of the 100 jobs named above"
    )
    follow_advice(db_path, together.message, r"at once: (DELETE FROM jobs WHERE .*)$")
    assert await _check(db_path) == []


@pytest.mark.parametrize("tail", ["\x00", "\n", "\x1b[2J"], ids=["nul", "newline", "escape"])
async def test_the_delete_for_orphans_past_a_hundred_works_for_any_run_id_text(
    db_path: Path, tail: str
) -> None:
    """The DELETE for the jobs past the first hundred of a run_id whose text holds a NUL or a
    control character names it by its bytes: quoted as text, a NUL ended the statement for any
    client ("unrecognized token", or Python's "the query contains a null character"), and a
    control character is shown as its escape by control-store check, which pasted matched no
    row."""
    await stored_run(db_path, job_count=_sqlite._ORPHANS_NAMED + 3)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("DELETE FROM runs")
        conn.execute("UPDATE jobs SET run_id = run_id || ?", (tail,))
    problems = await _check(db_path)
    (together,) = [p for p in problems if "at once: DELETE" in p.message]
    statement = together.message.split("at once: ", 1)[1]
    assert statement.isprintable(), statement
    follow_advice(db_path, together.message, r"at once: (DELETE FROM jobs WHERE .*)$")
    assert await _check(db_path) == []


@pytest.mark.parametrize(
    ("index", "remade"),
    [
        ("idx_runs_created", "runs (created_at COLLATE NOCASE)"),
        ("idx_runs_status", "runs (status COLLATE NOCASE, created_at)"),
        ("idx_jobs_run", "jobs (run_id DESC)"),
    ],
)
async def test_an_index_remade_with_another_collation_or_order_is_found(
    db_path: Path, index: str, remade: str
) -> None:
    """An index of this release's name remade on the same columns with another collation or
    order serves other queries (one COLLATE NOCASE serves no ORDER BY created_at: every page of
    iter_runs scanned the table) and is reported, with the DROP and CREATE that make it again;
    made as given, nothing is left to find."""
    await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute(f"DROP INDEX {index}")
        conn.execute(f"CREATE INDEX {index} ON {remade}")
    (problem,) = await _check(db_path)
    assert f"lacks index {index} as this release made it" in problem.message
    follow_advice(db_path, problem.message, r"make it again: (DROP INDEX \w+); ")
    follow_advice(db_path, problem.message, r"; (CREATE INDEX .*)$")
    assert await _check(db_path) == []


async def test_an_index_is_checked_beside_a_renamed_column_it_does_not_key(
    db_path: Path,
) -> None:
    """A column renamed by hand and an index remade COLLATE NOCASE on the same table: one
    check() names both (the index was held back until the column was repaired, so each
    repair brought up a new finding); an index keying the renamed column is left to the
    column's repair, which it follows back."""
    await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("ALTER TABLE runs RENAME COLUMN manifest TO manifest_path")
        conn.execute("DROP INDEX idx_runs_status")
        conn.execute("CREATE INDEX idx_runs_status ON runs (status COLLATE NOCASE, created_at)")
        conn.execute("ALTER TABLE jobs RENAME COLUMN run_id TO run")  # idx_jobs_run follows
    messages = [problem.message for problem in await _check(db_path)]
    assert any("lacks column runs.manifest" in m for m in messages), messages
    assert any("lacks index idx_runs_status as this release made it" in m for m in messages)
    assert any("lacks column jobs.run_id" in m for m in messages), messages
    # idx_jobs_run keys the renamed run_id: repaired with it, not named apart.
    assert not any("idx_jobs_run" in m for m in messages), messages


@pytest.mark.parametrize(
    ("rename", "back"),
    [
        ("ALTER TABLE jobs RENAME COLUMN run_id TO rid", "rename it back"),
        ("ALTER TABLE runs RENAME COLUMN id TO rid", "rename it back"),
        ("ALTER TABLE runs RENAME TO runs_old", "if runs_old is runs renamed, rename it back"),
    ],
    ids=["key-column", "referenced-column", "referenced-table"],
)
async def test_a_rename_that_moved_a_foreign_key_asks_only_to_rename_back(
    db_path: Path, rename: str, back: str
) -> None:
    """A column or table renamed by hand moves the foreign key with it: check() asks to rename
    it back, which moves the key back, and not also to restore from a backup for the key
    (which would throw recent data away); renamed back, nothing is left to find."""
    await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute(rename)
    messages = [problem.message for problem in await _check(db_path)]
    assert any(back in m for m in messages), messages
    assert not any("refer" in m for m in messages), messages
    (problem,) = [p for p in await _check(db_path) if back in p.message]
    follow_advice(db_path, problem.message, r"(ALTER TABLE [^;]+);")
    assert await _check(db_path) == []


def _unindexed_job(db_path: Path) -> None:
    """Insert a job row that idx_jobs_run does not hold, as a crash or bad copy could leave."""
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA writable_schema = ON")
        saved = conn.execute("SELECT * FROM sqlite_schema WHERE name = 'idx_jobs_run'").fetchone()
        conn.execute("DELETE FROM sqlite_schema WHERE name = 'idx_jobs_run'")
    with raw_db(db_path) as conn:  # reopened: this connection's schema has no such index
        conn.execute(
            "INSERT INTO jobs (id, run_id, spec) SELECT ?, run_id, spec FROM jobs LIMIT 1",
            ("00000000-0000-4000-8000-000000000001",),
        )
        conn.execute("UPDATE runs SET job_rows = job_rows + 1, job_count = job_count + 1")
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("INSERT INTO sqlite_schema VALUES (?, ?, ?, ?, ?)", saved)


async def test_an_index_missing_rows_is_reported_with_reindex_as_its_repair(
    db_path: Path,
) -> None:
    """An index that lost entries is reported with REINDEX as the repair, which clears it."""
    async with Store.connect(db_path) as store:
        run = make_run(job_count=2)
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
    _unindexed_job(db_path)
    async with Store.connect(db_path, migrate=False) as store:
        problems = await store.check()
    *damage, skipped = problems
    assert damage
    assert all((p.table, p.row_id) == ("database", "") for p in problems)
    for problem in damage:
        assert problem.message.startswith("SQLite integrity check: ")
        assert problem.message.endswith("; rebuild the index: REINDEX idx_jobs_run"), problem
    # Not "job_rows 3, 2 jobs": the counters read through the index that lost a row.
    assert skipped.message.startswith("the row-level checks were skipped")
    with raw_db(db_path) as conn:
        conn.execute("REINDEX idx_jobs_run")
    async with Store.connect(db_path, migrate=False) as store:
        assert await store.check() == []


def test_each_integrity_check_line_gets_a_repair() -> None:
    """Every kind of line PRAGMA integrity_check prints maps to a finding that ends in a repair."""
    from control_store._sqlite import integrity_repair

    cases = {
        "row 3 missing from index idx_jobs_run": "rebuild the index: REINDEX idx_jobs_run",
        "wrong # of entries in index idx_runs_status": "rebuild the index: REINDEX idx_runs_status",
        "non-unique entry in UNIQUE index sqlite_autoindex_runs_1": "two rows hold the same",
        "NULL value in jobs.spec": "SELECT rowid FROM jobs WHERE spec IS NULL",
        "NUMERIC value in runs.manifest": "restore the file from a backup",
        "*** in database main ***\nPage 7: btreeInitPage() returns error code 11": ".recover",
    }
    for line, expected in cases.items():
        assert expected in integrity_repair(line), line


# The repairs findings end with, as statements: the first alternative a finding offers.
_SET_NUMBER: Final = re.compile(r"set (done_count|job_rows|job_count) to (\d+)")
_SET_STATUS: Final = re.compile(r"set its status to '(\w+)'")
_SET_ID: Final = re.compile(r"rewrite it as '([0-9a-f-]{36})'")
_SET_RUN_ID: Final = re.compile(r"rewrite its run_id as '([0-9a-f-]{36})'")


# "a second row for run <canonical>, ... DELETE FROM runs WHERE id = ...": canonical, table.
_DELETE_ROW: Final = re.compile(r"a second row for \w+ (\S+),.* DELETE FROM (\w+) WHERE id")


# "first move its outcome ...: UPDATE jobs SET outcome = (...) ... WHERE id = '...'; then".
_MOVE_OUTCOME: Final = re.compile(r"(UPDATE jobs SET outcome = .*? WHERE id = '[^']+'); then")


async def _check(db_path: Path) -> list[Problem]:
    """check() of the database at ``db_path``, through a store of its own."""
    async with Store.connect(db_path) as store:
        return await store.check()


async def _repair(db_path: Path, problems: list[Problem]) -> None:
    """Follow every finding, in order (_follow); then check again, which must find nothing."""
    _follow(db_path, problems)
    assert await _check(db_path) == []


def _follow(db_path: Path, problems: list[Problem]) -> None:
    """Apply, by hand, the repair each finding describes (fails on a finding without one)."""
    with raw_db(db_path) as conn:
        for problem in problems:
            table, row_id = problem.table, problem.row_id
            if number := _SET_NUMBER.search(problem.message):
                column, value = number[1], int(number[2])
                conn.execute(f"UPDATE {table} SET {column} = ? WHERE id = ?", (value, row_id))
            elif status := _SET_STATUS.search(problem.message):
                conn.execute(f"UPDATE {table} SET status = ? WHERE id = ?", (status[1], row_id))
            elif run_id := _SET_RUN_ID.search(problem.message):
                conn.execute("UPDATE jobs SET run_id = ? WHERE id = ?", (run_id[1], row_id))
            elif table == "jobs" and (job_id := _SET_ID.search(problem.message)):
                conn.execute("UPDATE jobs SET id = ? WHERE id = ?", (job_id[1], row_id))
            elif delete := _DELETE_ROW.search(problem.message):
                if moved := _MOVE_OUTCOME.search(problem.message):
                    conn.execute(moved[1])  # the outcome the copy alone holds, kept
                canonical, table_named = delete[1], delete[2]
                if table_named == "runs":  # its jobs first, as the finding says
                    conn.execute("UPDATE jobs SET run_id = ? WHERE run_id = ?", (canonical, row_id))
                conn.execute(f"DELETE FROM {table_named} WHERE id = ?", (row_id,))
            elif table == "runs" and (new := _SET_ID.search(problem.message)):
                assert "PRAGMA defer_foreign_keys = ON" in problem.message
                conn.execute("PRAGMA defer_foreign_keys = ON")  # until this transaction ends
                conn.execute("UPDATE runs SET id = ? WHERE id = ?", (new[1], row_id))
                conn.execute("UPDATE jobs SET run_id = ? WHERE run_id = ?", (new[1], row_id))
            else:
                raise AssertionError(f"no repair to follow in {problem}")


_LAST_JOB: Final = "(SELECT max(rowid) FROM jobs)"


@pytest.mark.parametrize(
    ("job_count", "recorded", "edits", "final"),
    [
        (2, 0, ["UPDATE runs SET done_count = 2"], ("running", 0)),
        (3, 1, ["UPDATE runs SET done_count = 3"], ("running", 1)),
        (2, 2, ["UPDATE runs SET done_count = 0, status = 'running'"], ("done", 2)),
        (2, 1, ["UPDATE runs SET done_count = 5"], ("running", 1)),
        (
            2,
            1,
            [
                "UPDATE jobs SET status = 'done'",
                "UPDATE runs SET done_count = 2, status = 'done'",
            ],
            ("queued", 1),
        ),
        (
            2,
            1,
            ["UPDATE jobs SET status = 'queued'", "UPDATE runs SET done_count = 0"],
            ("running", 1),
        ),
        (
            2,
            2,
            [
                f"UPDATE jobs SET status = 'running' WHERE rowid = {_LAST_JOB}",
                "UPDATE runs SET done_count = 1, status = 'running'",
            ],
            ("done", 2),
        ),
        (
            2,
            2,
            [f"UPDATE jobs SET status = 'running' WHERE rowid = {_LAST_JOB}"],
            ("done", 2),
        ),
        (1, 0, ["DELETE FROM jobs", "UPDATE runs SET job_count = 0, job_rows = 0"], ("done", 0)),
    ],
    ids=[
        "done-count-above-done-jobs",
        "done-count-reaches-job-count",
        "all-done-not-counted",
        "done-count-past-job-count",
        "counted-done-without-outcome",
        "outcome-not-marked-or-counted",
        "last-outcome-not-marked",
        "last-outcome-not-marked-but-counted",
        "no-jobs-to-finish",
    ],
)
async def test_following_every_repair_leaves_nothing_to_find(
    db_path: Path, job_count: int, recorded: int, edits: list[str], final: tuple[str, int]
) -> None:
    """After the repairs check() describes, check() finds nothing and the run is as it should be."""
    run = make_run(job_count=job_count)
    jobs = make_jobs(run)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        await store.claim_next_run()
        for job in jobs[:recorded]:
            await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))
    with raw_db(db_path) as conn:
        for edit in edits:
            conn.execute(edit)
    problems = await _check(db_path)
    assert problems
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        repaired = await store.get_run(run.id)
    assert repaired is not None
    assert (repaired.status, repaired.done_count) == final


async def test_a_run_with_more_jobs_than_job_count_gets_no_status_advice(db_path: Path) -> None:
    """While a run has more jobs than job_count, check() asks for that first, then a new check."""
    run = make_run(job_count=3)
    jobs = make_jobs(run)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        await store.claim_next_run()
        await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=1.0))
    with raw_db(db_path) as conn:
        conn.execute("UPDATE runs SET job_count = 1")  # 1 of 1 done, were job_count right
    async with Store.connect(db_path) as store:
        (problem,) = await store.check()
    assert problem.message == (
        f"run {run.id} has job_count 1 but 3 jobs; delete the jobs it should not have, or set "
        "job_count to 3 if it should have them all; then run check() again, which judges its "
        "done_count and status by the jobs that remain"
    )


_SPELLINGS: Final = {
    "upper-case": str.upper,
    "no-hyphens": lambda text: text.replace("-", ""),
    "braces": lambda text: "{" + text + "}",
    # Canonical length and case, hyphens elsewhere: uuid.UUID ignores hyphens wherever they are.
    "moved-hyphens": lambda text: "-".join(_regroup(text.replace("-", ""), (4, 8, 8, 8, 4))),
}


def _regroup(hex_digits: str, sizes: tuple[int, ...]) -> list[str]:
    """``hex_digits`` cut into consecutive groups of the given sizes."""
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return [hex_digits[end - size : end] for size, end in zip(sizes, ends, strict=True)]


@pytest.mark.parametrize("spell", _SPELLINGS.values(), ids=_SPELLINGS.keys())
async def test_ids_stored_as_other_uuid_text_are_reported_and_repairable(
    db_path: Path, spell: Callable[[str], str]
) -> None:
    """A run and a job hand-inserted with ids in another UUID spelling, which lookups by id
    cannot find, are reported; after the repairs the store finds and records them."""
    run = make_run(job_count=2)
    jobs = make_jobs(run)
    respelled = spell(str(run.id))
    with raw_db(db_path) as conn:  # foreign keys on: the jobs refer to the run as it is stored
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(
            "INSERT INTO runs (id, manifest, models, epochs, job_count, status, created_at, "
            "job_rows) VALUES (?, 'm', '[\"a\"]', 1, 2, 'queued', "
            "'2026-01-01T00:00:00.000000Z', 2)",
            (respelled,),
        )
        for job_id in (spell(str(jobs[0].id)), str(jobs[1].id)):
            conn.execute(
                "INSERT INTO jobs (id, run_id, spec) VALUES (?, ?, ?)",
                (job_id, respelled, '{"model":"a","sample_id":"s","epoch":0}'),
            )
    async with Store.connect(db_path) as store:
        assert await store.get_run(run.id) is None
        assert await store.get_job(jobs[0].id) is None
        problems = await store.check()
    assert sorted((p.table, p.row_id) for p in problems) == [
        ("jobs", spell(str(jobs[0].id))),
        ("runs", respelled),
    ]
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        assert await store.get_run(run.id) is not None
        assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]
        for job in jobs:
            assert await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))
        finished = await store.get_run(run.id)
    assert finished is not None
    assert (finished.status, finished.done_count) == ("done", 2)


@pytest.mark.parametrize("run_stored", ["canonical", "upper-case", "missing"])
async def test_a_job_whose_run_id_is_spelled_otherwise_gets_the_right_repair(
    db_path: Path, run_stored: str
) -> None:
    """A job whose run_id is another spelling of its run's id is told to rewrite it, whether
    the run is stored canonically, under another spelling, or not at all."""
    run, (job,) = await stored_run(db_path, job_count=1)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE jobs SET run_id = ?", (str(run.id).replace("-", ""),))
        if run_stored == "upper-case":
            conn.execute("UPDATE runs SET id = upper(id)")
        elif run_stored == "missing":
            conn.execute("DELETE FROM runs")
    problems = await _check(db_path)
    (job_problem,) = [p for p in problems if p.table == "jobs"]
    assert job_problem.row_id == str(job.id)
    assert f"rewrite its run_id as '{run.id}'" in job_problem.message
    if run_stored == "missing":
        assert f"restore run {run.id} from a backup" in job_problem.message
        return
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        assert await store.record_job_outcome(run.id, JobOutcome(job.id, score=1.0))


async def test_a_second_row_under_another_spelling_of_an_id_is_to_be_deleted(
    db_path: Path,
) -> None:
    """A run and a job copied by hand under another spelling of ids that already exist: the
    finding says to delete the copy (a rewrite would collide), and after that, nothing is found."""
    run, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute(_copy_runs("upper(id)"))
        conn.execute(_copy_jobs("upper(id)"), (str(jobs[0].id),))
    problems = await _check(db_path)
    copies = {
        ("runs", str(run.id).upper()),
        ("jobs", str(jobs[0].id).upper()),
    }
    assert sorted((p.table, p.row_id) for p in problems) == sorted(copies)
    assert all("a second row for" in problem.message for problem in problems)
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]


# Text of UUID shape that uuid.UUID() would read as another UUID (it parses with int(x, 16),
# which takes whitespace, '+', '_' and non-ASCII digits): no spelling of any id.
_MISREAD: Final = {
    "trailing-space": lambda text: text[:-1] + " ",
    "plus": lambda text: "+" + text[1:],
    "underscore": lambda text: text[:9] + "_" + text[10:],
    "full-width-digit": lambda text: "\uff11" + text[1:],
    "upper-trailing-space": lambda text: text.upper()[:-1] + " ",
}


@pytest.mark.parametrize("misread", _MISREAD.values(), ids=_MISREAD.keys())
async def test_an_id_that_only_looks_like_a_uuid_is_reported_as_unreadable(
    db_path: Path, misread: Callable[[str], str]
) -> None:
    """Reads refuse it as no UUID, and check() reports it so, with no rewrite to another UUID
    (uuid.UUID() reads '...059 ' as a UUID with its digits shifted)."""
    run, jobs = await stored_run(db_path)
    bad_run, bad_job = misread(str(run.id)), misread(str(jobs[0].id))
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = ?", (bad_run,))
        conn.execute("UPDATE jobs SET run_id = ?", (bad_run,))
        conn.execute("UPDATE jobs SET id = ? WHERE id = ?", (bad_job, str(jobs[0].id)))
    async with Store.connect(db_path) as store:
        with pytest.raises(CorruptRowError, match=r"runs\.id of row .*expected a UUID\)"):
            await store.list_runs()
        problems = await store.check()
    found = {(p.table, p.row_id): p.message for p in problems}
    assert "expected a UUID)" in found.pop(("runs", bad_run))
    assert "expected a UUID)" in found.pop(("jobs", bad_job))
    # The other job is intact but for its run_id: unreadable too, and named by its own id.
    assert "jobs.run_id of row" in found.pop(("jobs", str(jobs[1].id)))
    assert found == {}
    assert not any("rewrite it as" in p.message for p in problems)


@pytest.mark.parametrize("copy", [False, True], ids=["respelt", "second-copy"])
async def test_a_respelt_row_with_other_damage_is_named_as_stored(
    db_path: Path, *, copy: bool
) -> None:
    """A run whose id is upper-cased (or a hand copy under that spelling), with epochs 0 too:
    check() reports the spelling and the epochs, both under the id as stored; never under the
    canonical id, which names no row here, or a healthy one."""
    run, _ = await stored_run(db_path)
    spelt = str(run.id).upper()
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        if copy:
            conn.execute(_copy_runs("upper(id)"))
            conn.execute("UPDATE runs SET epochs = 0 WHERE id = ?", (spelt,))
        else:
            conn.execute("UPDATE runs SET id = upper(id), epochs = 0")
            conn.execute("UPDATE jobs SET run_id = upper(run_id)")
    problems = await _check(db_path)
    assert {p.row_id for p in problems} == {spelt}
    assert len(problems) == 2
    assert any(f"runs.epochs of row {spelt} holds 0" in p.message for p in problems)


async def test_an_outcome_for_a_job_whose_run_id_is_respelt_names_the_row(db_path: Path) -> None:
    """Recording an outcome for a job whose run_id was upper-cased by hand (with its run's id):
    the CorruptRowError naming the job's run_id, not a WrongRunError blaming the caller for a
    run id that is the right one; nothing is recorded."""
    run, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = upper(id)")
        conn.execute("UPDATE jobs SET run_id = upper(run_id)")
    async with Store.connect(db_path) as store:
        calls = (
            lambda: store.record_job_outcome(run.id, JobOutcome(jobs[0].id)),
            lambda: store.record_job_outcomes(run.id, [JobOutcome(jobs[0].id)]),
        )
        for call in calls:
            with pytest.raises(CorruptRowError, match=rf"jobs\.run_id of row {jobs[0].id} "):
                await call()
    with raw_db(db_path) as conn:
        recorded = conn.execute("SELECT count(*) FROM jobs WHERE outcome IS NOT NULL").fetchone()
    assert recorded == (0,)


async def test_two_spellings_of_one_id_with_no_canonical_row_rewrite_one_delete_the_other(
    db_path: Path,
) -> None:
    """A run stored upper-case (its jobs follow) and a copy of it in braces; a job stored
    upper-case and a copy of it as bare hex: the first of each is rewritten, the second is a
    copy to delete (rewriting both would collide), and after the repairs nothing is found."""
    run, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = upper(id)")
        conn.execute("UPDATE jobs SET run_id = upper(run_id)")
        conn.execute(_copy_runs("'{' || lower(id) || '}'"))
        conn.execute("UPDATE jobs SET id = upper(id) WHERE id = ?", (str(jobs[0].id),))
        conn.execute(_copy_jobs("replace(lower(id), '-', '')"), (str(jobs[0].id).upper(),))
    problems = await _check(db_path)
    messages = {(p.table, p.row_id): p.message for p in problems}
    assert len(messages) == len(problems) == 4
    assert "rewrite it as" in messages[("runs", str(run.id).upper())]
    assert "a second row for run" in messages[("runs", "{" + str(run.id) + "}")]
    assert "rewrite it as" in messages[("jobs", str(jobs[0].id).upper())]
    assert "a second row for job" in messages[("jobs", jobs[0].id.hex)]
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]


async def test_a_job_copy_whose_run_id_is_respelt_too_is_only_to_be_deleted(
    db_path: Path,
) -> None:
    """A hand copy of a job under its upper-case id and its run's upper-case id, the run
    stored canonically: one finding, delete the copy; the run's counters are judged without
    it (they were told to count it, and after the delete, not to)."""
    run, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute(_copy_jobs("upper(id)", run_id="upper(run_id)"), (str(jobs[0].id),))
    problems = await _check(db_path)
    assert [(p.table, p.row_id) for p in problems] == [("jobs", str(jobs[0].id).upper())]
    assert "a second row for job" in problems[0].message
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        assert await store.get_run(run.id) is not None


async def test_a_run_whose_id_is_unreadable_gets_no_counter_advice(db_path: Path) -> None:
    """A run id edited into text that is no UUID (a trailing space), its jobs left pointing at
    the right id: the run is reported unreadable, its counters are not judged (its jobs do
    not refer to it as stored), and its jobs are told to look at that run first; once the id
    is repaired, nothing is found."""
    run, jobs = await stored_run(db_path)
    async with Store.connect(db_path) as store:
        assert await store.record_job_outcome(run.id, JobOutcome(jobs[0].id))
    bad = str(run.id)[:-1] + " "
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = ?", (bad,))
    problems = await _check(db_path)
    messages = {(p.table, p.row_id): p.message for p in problems}
    assert "expected a UUID" in messages.pop(("runs", bad))
    for job in jobs:
        message = messages.pop(("jobs", str(job.id)))
        assert f"but first repair the run ids found unreadable ({bad})" in message
    assert messages == {}
    with raw_db(db_path) as conn:
        conn.execute("UPDATE runs SET id = ?", (str(run.id),))
    async with Store.connect(db_path) as store:
        assert await store.check() == []


async def test_calls_that_miss_a_respelt_row_say_it_may_be_a_hand_edit(db_path: Path) -> None:
    """Calls that look a row up by the id the caller rightly gives, and miss it because a hand
    edit respelt the stored id, do not blame the caller alone: each error says the row may have
    been edited by hand and that check() names it; insert_jobs no longer only says to insert
    the run (again), and nothing is written."""
    run, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = upper(id)")  # its jobs keep the canonical run_id
        conn.execute("UPDATE jobs SET id = upper(id) WHERE id = ?", (str(jobs[0].id),))
    extra = make_jobs(run, 1)
    async with Store.connect(db_path) as store:
        with pytest.raises(MissingRunError, match=r"names its row as edited by hand, repair"):
            await store.insert_jobs(extra)
        with pytest.raises(NotFoundError, match=r"edited by hand: check\(\) names it"):
            await store.record_job_outcome(run.id, JobOutcome(jobs[0].id))
        with pytest.raises(CorruptRowError, match=r"or its id edited by hand, as check\(\) tells"):
            await store.record_job_outcome(run.id, JobOutcome(jobs[1].id))
    with raw_db(db_path) as conn:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (2,)
        recorded = conn.execute("SELECT count(*) FROM jobs WHERE outcome IS NOT NULL").fetchone()
    assert recorded == (0,)


async def test_a_job_copy_holding_the_only_outcome_hands_it_over_before_it_goes(
    db_path: Path,
) -> None:
    """A hand copy of a queued job, under its upper-case id, holds an outcome the job lacks
    (and the run counts it): the copy's finding moves that outcome to the job before deleting
    the copy, so following it loses no recorded result, and nothing else is to be repaired."""
    _, jobs = await stored_run(db_path)
    outcome = _codec.outcome_json(JobOutcome(jobs[0].id, score=0.5))
    with raw_db(db_path) as conn:
        conn.execute(
            "INSERT INTO jobs (id, run_id, spec, status, attempt, outcome) SELECT upper(id), "
            "run_id, spec, 'done', attempt, ? FROM jobs WHERE id = ?",
            (outcome, str(jobs[0].id)),
        )
        conn.execute("UPDATE runs SET done_count = 1")
    problems = await _check(db_path)
    assert [(p.table, p.row_id) for p in problems] == [("jobs", str(jobs[0].id).upper())]
    assert "first move its outcome, the only one recorded" in problems[0].message
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        kept = await store.get_job(jobs[0].id)
        assert kept is not None
        assert kept.outcome == JobOutcome(jobs[0].id, score=0.5)


async def test_a_run_copy_owning_jobs_counts_them_where_they_go(db_path: Path) -> None:
    """A finished run, a hand copy of it under its upper-case id, and one of its jobs moved to
    the copy: the only finding is the copy's (its jobs go to the run, then it is deleted); the
    run's counters and status are judged with those jobs, so no finding undoes another."""
    run, jobs = await stored_run(db_path)
    async with Store.connect(db_path) as store:
        await store.record_job_outcomes(run.id, [JobOutcome(job.id) for job in jobs])
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute(_copy_runs("upper(id)"))
        conn.execute("UPDATE jobs SET run_id = upper(run_id) WHERE id = ?", (str(jobs[1].id),))
    problems = await _check(db_path)
    assert [(p.table, p.row_id) for p in problems] == [("runs", str(run.id).upper())]
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        stored = await store.get_run(run.id)
        assert stored is not None
        assert (stored.status, stored.done_count) == ("done", 2)


async def test_repairs_made_in_the_order_given_name_rows_that_still_exist(
    db_path: Path,
) -> None:
    """A run and a job stored upper-case, the job 'done' with no outcome, the run's job_rows
    wrong: the findings that name rows by their ids as stored come before the rewrites of
    those ids, so each repair, made as written and in order, finds its row."""
    _, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = upper(id), job_rows = 7")
        conn.execute("UPDATE jobs SET run_id = upper(run_id)")
        conn.execute(
            "UPDATE jobs SET id = upper(id), status = 'done' WHERE id = ?", (str(jobs[0].id),)
        )
    problems = await _check(db_path)
    kinds = ["rewrite it as" in p.message for p in problems]
    assert kinds == [False, False, True, True]  # job_rows, the status; then the two rewrites
    await _repair(db_path, problems)


async def test_a_job_whose_run_id_is_no_uuid_holds_off_counter_advice(db_path: Path) -> None:
    """A recorded job whose run_id gets a stray space: its run's counters are not judged (the
    job is still counted there, once repaired), and the job is told to take its run's id, not
    to restore a run of that name; once it does, nothing is found."""
    run, jobs = await stored_run(db_path)
    async with Store.connect(db_path) as store:
        await store.record_job_outcome(run.id, JobOutcome(jobs[0].id))
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE jobs SET run_id = run_id || ' ' WHERE id = ?", (str(jobs[0].id),))
    problems = await _check(db_path)
    assert {(p.table, p.row_id) for p in problems} == {("jobs", str(jobs[0].id))}
    assert any("which is no run's id (no UUID)" in p.message for p in problems)
    assert not any("restore run" in p.message for p in problems)
    with raw_db(db_path) as conn:
        conn.execute("UPDATE jobs SET run_id = ? WHERE id = ?", (str(run.id), str(jobs[0].id)))
    async with Store.connect(db_path) as store:
        assert await store.check() == []


# An outcome of the job a copied row copies (an outcome names its job: one naming another job
# is a finding of its own).
_OWN_OUTCOME: Final = "json_object('job_id', id, 'score', 0.5, 'output', '', 'error', NULL)"


@pytest.mark.parametrize(
    "edits",
    [
        pytest.param(  # a run copy holding a copy of one of the run's jobs (with its outcome)
            [
                _copy_runs("upper(id)"),
                _copy_jobs("upper(id)", run_id="upper(run_id)", where="outcome IS NOT NULL"),
            ],
            id="run-copy-holds-job-copy",
        ),
        pytest.param(  # two copies of the queued job, each with an outcome the job lacks
            [
                "INSERT INTO jobs SELECT upper(id), run_id, spec, 'done', attempt, "
                f"{_OWN_OUTCOME} FROM jobs WHERE outcome "
                "IS NULL",
                "INSERT INTO jobs SELECT '{' || id || '}', run_id, spec, 'done', attempt, "
                f"{_OWN_OUTCOME} FROM jobs WHERE outcome "
                "IS NULL AND id NOT GLOB '*[A-F{]*'",
                "UPDATE runs SET done_count = 3",
            ],
            id="two-copies-with-outcomes",
        ),
        pytest.param(  # the queued job's copy holds the only outcome; the job's run_id respelt
            [
                "INSERT INTO jobs SELECT upper(id), run_id, spec, 'done', attempt, "
                f"{_OWN_OUTCOME} FROM jobs WHERE outcome "
                "IS NULL",
                "UPDATE jobs SET run_id = upper(run_id) WHERE outcome IS NULL",
                "UPDATE runs SET done_count = 2",
            ],
            id="kept-job-orphaned",
        ),
        pytest.param(  # as above, the job moved onto a copy of its run
            [
                _copy_runs("upper(id)"),
                "INSERT INTO jobs SELECT '{' || id || '}', run_id, spec, 'done', attempt, "
                f"{_OWN_OUTCOME} FROM jobs WHERE outcome "
                "IS NULL",
                "UPDATE jobs SET run_id = upper(run_id) WHERE outcome IS NULL",
                "UPDATE runs SET done_count = 2 WHERE id = lower(id)",
            ],
            id="kept-job-in-run-copy",
        ),
    ],
)
async def test_copies_of_copies_are_repaired_in_one_round_losing_no_outcome(
    db_path: Path, edits: list[str]
) -> None:
    """Copies of runs and jobs under other spellings, in combinations: the findings, followed
    once in order, leave nothing to find, and every job that had an outcome (in any copy) has
    one, each counted once (a job's first outcome stands)."""
    run, jobs = await stored_run(db_path)
    async with Store.connect(db_path) as store:
        await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, score=0.5))
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        for edit in edits:
            conn.execute(edit)
    problems = await _check(db_path)
    await _repair(db_path, problems)
    async with Store.connect(db_path) as store:
        kept = await store.get_run(run.id)
        assert kept is not None
        recorded = [job for job in await store.list_jobs(run.id) if job.outcome is not None]
    assert kept.done_count == len(recorded) >= 1
    assert {job.id for job in await _jobs(db_path)} == {job.id for job in jobs}


async def _jobs(path: Path) -> list[Job]:
    async with Store.connect(path) as store:
        return [job for run in await store.list_runs() for job in await store.list_jobs(run.id)]


async def test_a_rewrite_waits_for_unreadable_run_ids_that_may_be_the_same_run(
    db_path: Path,
) -> None:
    """A run stored as a BLOB of its own id, and a braced copy of it: the copy's rewrite would
    collide once the BLOB is repaired, so the rewrite says to repair unreadable ids first."""
    run, _ = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute(_copy_runs("'{' || id || '}'"))
        conn.execute("UPDATE runs SET id = CAST(id AS BLOB) WHERE id = ?", (str(run.id),))
    problems = await _check(db_path)
    [rewrite] = [p for p in problems if p.row_id == "{" + str(run.id) + "}"]
    assert "rewrite it as" in rewrite.message
    assert "but first repair the run ids found unreadable" in rewrite.message


@pytest.mark.parametrize("run_missing", [False, True], ids=["run-stored", "run-missing"])
async def test_a_respelt_job_whose_run_is_missing_is_repaired_before_its_id_is(
    db_path: Path, *, run_missing: bool
) -> None:
    """Jobs whose ids and run_ids were upper-cased by hand: the findings about their run (a
    run_id to rewrite, or a run to restore or the job to delete) name them by their ids as
    stored, so they come before the rewrites of those ids; followed in order, nothing is
    left to find."""
    run, jobs = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE jobs SET id = upper(id), run_id = upper(run_id)")
        if run_missing:
            conn.execute("DELETE FROM runs")
    problems = await _check(db_path)
    order = [("rewrite it as" in p.message, p.row_id) for p in problems]
    assert order == [(False, str(job.id).upper()) for job in jobs] + [
        (True, str(job.id).upper()) for job in jobs
    ]
    if not run_missing:
        await _repair(db_path, problems)
        async with Store.connect(db_path) as store:
            assert [job.id for job in await store.list_jobs(run.id)] == [job.id for job in jobs]


async def test_every_unreadable_cell_of_a_row_is_a_finding_of_its_own(db_path: Path) -> None:
    """A run and a job each with several cells edited into values no read takes: check() names
    every one (not just the first a read meets), so after setting each cell it names back to a
    good value, the next check() finds nothing."""
    run, jobs = await stored_run(db_path)
    good = {
        ("runs", "manifest"): run.manifest,
        ("runs", "models"): _codec._encode(run.models).decode(),
        ("runs", "epochs"): run.epochs,
        ("jobs", "spec"): _codec._encode(jobs[0].spec).decode(),
        ("jobs", "attempt"): 0,
    }
    with raw_db(db_path) as conn:
        conn.execute(
            "UPDATE runs SET manifest = CAST(x'ff' AS TEXT), models = '[', epochs = 0",
        )
        conn.execute(
            "UPDATE jobs SET spec = CAST(x'80' AS TEXT), attempt = -1 WHERE id = ?",
            (str(jobs[0].id),),
        )
    problems = await _check(db_path)
    named = {
        (p.table, cell[1]): p.row_id
        for p in problems
        if (cell := re.search(rf"^{p.table}\.(\w+) of row ", p.message))
    }
    assert named == {
        ("runs", "manifest"): str(run.id),
        ("runs", "models"): str(run.id),
        ("runs", "epochs"): str(run.id),
        ("jobs", "spec"): str(jobs[0].id),
        ("jobs", "attempt"): str(jobs[0].id),
    }
    assert len(problems) == len(named)
    with raw_db(db_path) as conn:
        for (table, column), row_id in named.items():
            value = good[(table, column)]
            conn.execute(f"UPDATE {table} SET {column} = ? WHERE id = ?", (value, row_id))
    assert await _check(db_path) == []


async def test_an_unreadable_id_comes_after_every_other_finding_of_its_row(db_path: Path) -> None:
    """Repairing an unreadable id changes the id a row's other findings name it by, so those
    come first: its other bad cells (a job's run_id too), and for a job its status finding."""
    run, jobs = await stored_run(db_path)
    bad_run, bad_job = f"{run.id} ", f"{jobs[0].id} "
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = ?, status = 'finished', done_count = -1", (bad_run,))
        conn.execute("UPDATE jobs SET run_id = ?", (bad_run,))
        conn.execute(
            "UPDATE jobs SET id = ?, attempt = -1, status = 'done' WHERE id = ?",
            (bad_job, str(jobs[0].id)),
        )
    problems = await _check(db_path)
    for row_id, findings in ((bad_run, 3), (bad_job, 4)):
        named = [p.message for p in problems if p.row_id == row_id]
        assert len(named) == findings, named
        assert re.search(r"\.id of row .*expected a UUID\)", named[-1])
        assert not any(".id of row" in message for message in named[:-1])


@pytest.mark.parametrize(
    ("edit", "lacks", "rows_checked"),
    [
        ("DROP INDEX idx_jobs_run", "index idx_jobs_run as this release made it", True),
        (
            "DROP INDEX idx_jobs_run; CREATE INDEX idx_jobs_run ON jobs (spec)",
            "index idx_jobs_run as this release made it",
            True,
        ),
        (
            "ALTER TABLE runs RENAME TO runs_old",
            "if runs_old is runs renamed, rename it back: ALTER TABLE runs_old RENAME TO runs",
            False,
        ),
        (
            "ALTER TABLE runs RENAME TO r; CREATE VIEW runs AS SELECT * FROM r",
            "has a view named runs where this release's table should be",
            False,
        ),
        ("DROP TABLE jobs", "lacks table jobs; restore the database from a backup", False),
        ("ALTER TABLE runs DROP COLUMN job_rows", "lacks column runs.job_rows; restore", False),
        (
            "CREATE TABLE r AS SELECT * FROM runs; DROP TABLE runs; ALTER TABLE r RENAME TO runs; "
            "CREATE INDEX idx_runs_status ON runs (status, created_at)",
            "column runs.id is TEXT, not TEXT PRIMARY KEY NOT NULL as this release made it",
            False,
        ),
        (
            "DROP INDEX idx_runs_status; "
            "CREATE UNIQUE INDEX idx_runs_status ON runs (status, created_at)",
            "index idx_runs_status as this release made it",
            True,
        ),
        (
            "DROP INDEX idx_jobs_run; CREATE INDEX IDX_JOBS_RUN ON jobs (run_id)",
            None,
            True,
        ),
        (
            "ALTER TABLE runs RENAME COLUMN created_at TO created",
            "if runs.created is it renamed, rename it back: "
            "ALTER TABLE runs RENAME COLUMN created TO created_at",
            False,
        ),
        ("CREATE TABLE mine (x); CREATE INDEX my_index ON runs (manifest)", None, True),
    ],
    ids=[
        "index",
        "index-on-other-columns",
        "table-renamed",
        "view-for-a-table",
        "table",
        "column",
        "table-rebuilt-without-its-key",
        "index-made-unique",
        "index-name-in-other-case",
        "column-renamed",
        "a-users-own-additions",
    ],
)
async def test_a_schema_missing_a_part_is_reported_with_its_repair(
    db_path: Path, edit: str, lacks: str | None, *, rows_checked: bool
) -> None:
    """A table, column or index of this release's schema dropped by hand is a finding with its
    repair (the index's own CREATE); without a table or column the row checks are skipped,
    saying so. A user's own tables and indexes are no finding. Calls that need the missing
    part say to run check()."""
    run, _ = await stored_run(db_path)
    with raw_db(db_path) as conn:
        conn.execute("UPDATE runs SET done_count = 5")  # a row-level fault, found if checked
        conn.executescript(edit)
    problems = await _check(db_path)
    messages = [p.message for p in problems if p.table == "database"]
    if lacks is None:
        assert messages == []
    else:
        assert lacks in messages[0]
    assert any("has done_count 5" in p.message for p in problems) == rows_checked
    assert any("row-level checks were skipped" in m for m in messages) != rows_checked
    if lacks is not None and "index" in lacks:
        with raw_db(db_path) as conn:
            conn.executescript(messages[0].split("make it again: ")[1])
            conn.execute("UPDATE runs SET done_count = 0")
        assert await _check(db_path) == []
    if not rows_checked:  # a write that needs the part says to run check()
        refused: list[MigrationError] = []
        async with Store.connect(db_path) as store:
            (job,) = make_jobs(run, 1)
            for write in (store.insert_run(make_run()), store.insert_jobs([job])):
                try:
                    await write
                except MigrationError as exc:
                    refused.append(exc)
                except ConstraintError:  # the run has all its jobs: nothing the schema explains
                    pass
        assert refused
        assert all(re.search(r"lacks part of the schema.*check\(\)", str(e)) for e in refused)


async def test_a_missing_table_a_users_trigger_names_is_not_blamed_on_the_schema(
    db_path: Path,
) -> None:
    """A trigger of the user's own that writes to a table since dropped: the write fails saying
    so, not that this release's schema lacks a part (check() rightly finds nothing); a table of
    this release's replaced by a view is blamed on the schema, with check() to run."""
    own_parts = (  # the user's trigger names a table, then a column, that is gone
        (
            "CREATE TABLE audit (id TEXT); CREATE TRIGGER audit_runs AFTER INSERT ON runs "
            "BEGIN INSERT INTO audit VALUES (new.id); END; DROP TABLE audit",
            "audit",
        ),
        (
            "CREATE TABLE audit (id TEXT); DROP TRIGGER audit_runs; CREATE TRIGGER audit_runs "
            "AFTER INSERT ON runs BEGIN UPDATE audit SET tally = tally + 1; END",
            "tally",
        ),
        (  # a column named as one of the migration history's is still the user's own
            "DROP TRIGGER audit_runs; CREATE TRIGGER audit_runs AFTER INSERT ON runs "
            "BEGIN UPDATE audit SET id = success; END",
            "success",
        ),
        (  # "table audit has no column named description": the column is named
            "DROP TRIGGER audit_runs; CREATE TRIGGER audit_runs AFTER INSERT ON runs "
            "BEGIN INSERT INTO audit (description) VALUES (new.id); END",
            "description",
        ),
    )
    for edit, missing in own_parts:
        with raw_db(db_path) as conn:
            conn.executescript(edit)
        async with Store.connect(db_path) as store:
            with pytest.raises(
                ControlError, match=rf"{missing} is no part of this release's schema"
            ) as caught:
                await store.insert_run(make_run())
            assert not isinstance(caught.value, MigrationError)
            assert await store.check() == []
    with raw_db(db_path) as conn:
        conn.executescript(
            "DROP TRIGGER audit_runs; ALTER TABLE jobs RENAME TO j; "
            "CREATE VIEW jobs AS SELECT * FROM j"
        )
    run = make_run()
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
        with pytest.raises(MigrationError, match=r"because it is a view.*check\(\)"):
            await store.insert_jobs(make_jobs(run, 1))


async def test_check_ends_its_integrity_snapshot_before_it_reads_the_rows(db_path: Path) -> None:
    """check() reads in two snapshots: SQLite's integrity check, then the schema and the rows
    (which must agree with each other). A snapshot keeps the WAL from being checkpointed past
    it, and one for the whole check let a steady writer grow the WAL by all it wrote meanwhile
    (about 1 GB at a million jobs): the statements show the first one ended first."""
    async with Store.connect(db_path) as store:
        run = make_run()
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
        async with traced(store) as statements:
            assert await store.check() == []
    integrity = statements.index("PRAGMA integrity_check")
    first_row_read = next(
        i for i, sql in enumerate(statements) if i > integrity and "FROM runs" in sql
    )
    between = statements[integrity:first_row_read]
    assert "COMMIT" in between, between
    assert "BEGIN" in between, between
    assert between.index("COMMIT") < between.index("BEGIN"), between


async def test_a_column_rebuilt_with_no_type_is_told_without_a_gap(db_path: Path) -> None:
    """A column rebuilt with no type is told as "NOT NULL (no type)" (it read "is  NOT NULL")."""
    messages = await _jobs_rebuilt(
        db_path, lambda sql: sql.replace("spec     TEXT    NOT NULL", "spec NOT NULL")
    )
    assert messages[0].startswith(
        "column jobs.spec is NOT NULL (no type), not TEXT NOT NULL as this release made it"
    ), messages


async def test_a_cancelled_check_frees_the_store_at_once(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check() whose caller gave up (a wait_for that timed out) stops, rather than running to
    its end on the store's one thread (13 s at a million jobs) while the store's next calls,
    close() too, wait for it; the store then reads and writes as before."""

    def slow_check(conn: sqlite3.Connection) -> list[object]:
        # As long as a check of a big store (seconds), inside its read snapshot.
        conn.execute("BEGIN")
        conn.execute(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 400000000) "
            "SELECT count(*) FROM c"
        ).fetchone()
        conn.execute("COMMIT")
        return []

    async with Store.connect(db_path) as store:
        run = make_run(1)
        await store.insert_run(run)
        monkeypatch.setattr(_sqlite, "op_check", slow_check)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.check(), timeout=0.2)
        try:
            assert await asyncio.wait_for(store.get_run(run.id), timeout=3) == run
        except TimeoutError:
            store._connected().interrupt()  # free the thread, so that the test can end
            raise
        monkeypatch.undo()
        assert await store.check() == []
        claimed = await store.claim_next_run()
        assert claimed is not None
        assert claimed.id == run.id


_KILLED_WRITER: Final = """
import os, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
for n in range(3000):  # past checkpoints: the file moves on from the backup
    conn.execute(
        "INSERT INTO runs (id, manifest, models, epochs, job_count, created_at)"
        " VALUES (?, 'm', '[]', 1, 1, '2026-01-01T00:00:00.000000Z')", (f"x{n}",))
conn.execute("PRAGMA wal_autocheckpoint = 0")  # the last writes stay in the -wal
conn.execute("UPDATE runs SET manifest = manifest || ?", ("x" * 500,))
os._exit(0)  # killed: no close, so the -wal stays beside the file
"""


async def test_restoring_a_backup_as_damage_findings_say_leaves_a_sound_file(
    db_path: Path,
) -> None:
    """A writer killed with its last commits in the -wal, then a sound backup copied over the
    file: SQLite applies that -wal to the backup, which check() then reports damaged, so the
    repair "restore the file from a backup" must say to delete the -wal and -shm first (with
    every process stopped); followed so, the restored file is the backup, and sound."""
    kept = []
    async with Store.connect(db_path) as store:
        for _ in range(20):
            run = make_run(job_count=20)
            await store.insert_run(run, jobs=make_jobs(run))
            kept.append(run.id)
    backup = db_path.with_name("backup.db")
    shutil.copyfile(db_path, backup)  # every store closed: a file copy is a backup
    await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _KILLED_WRITER, str(db_path)], check=True
    )
    assert Path(f"{db_path}-wal").stat().st_size > 0
    repair = _sqlite.integrity_repair(
        "*** in database main ***\nPage 7: btreeInitPage() returns error code 11"
    )
    assert "delete its -wal and -shm files before copying the backup in" in repair, repair
    for suffix in ("-wal", "-shm"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(backup, db_path)
    assert await _check(db_path) == []
    async with Store.connect(db_path) as store:
        assert sorted(run.id for run in await store.list_runs()) == sorted(kept)


def test_the_restore_advice_names_a_way_that_works_without_the_dbpage_table() -> None:
    """.recover needs sqlite_dbpage, which Debian 12's shell lacks (README): the finding must
    give the .dump fallback the README gives, not only the command that fails there."""
    assert "sqlite3 damaged.db .dump | " in _sqlite._RESTORE


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="no sqlite3 shell")
async def test_the_dump_the_restore_advice_gives_keeps_what_a_damaged_file_still_holds(
    tmp_path: Path,
) -> None:
    """Followed on a file with a damaged table page, the advice's .dump pipeline must copy the
    rows still readable: the shell ends such a dump with ROLLBACK, which piped as it is into
    sqlite3 new.db leaves new.db empty (and Store.connect then makes a fresh, empty store)."""
    damaged = tmp_path / "damaged.db"
    async with Store.connect(damaged) as store:
        for _ in range(20):
            run = make_run(job_count=20)
            await store.insert_run(run, jobs=make_jobs(run))
    raw = sqlite3.connect(damaged)
    try:
        leaves = [
            n
            for (n,) in raw.execute(
                "SELECT pageno FROM dbstat WHERE name = 'jobs' AND pagetype = 'leaf'"
                " ORDER BY pageno"
            )
        ]
        (page_size,) = raw.execute("PRAGMA page_size").fetchone()
    finally:
        raw.close()
    with damaged.open("r+b") as file:  # one of the jobs table's pages, overwritten
        file.seek((leaves[len(leaves) // 2] - 1) * page_size)
        file.write(b"\xff" * page_size)
    assert await _check(damaged) != []
    match = re.search(
        r"there, (sqlite3 damaged\.db \.dump .*?\| sqlite3 new\.db)", _sqlite._RESTORE
    )
    assert match, _sqlite._RESTORE
    # the advice's own words, as a user pastes them into a shell
    pipeline = ["/bin/sh", "-c", match[1]]
    await asyncio.to_thread(subprocess.run, pipeline, cwd=tmp_path, check=True)
    async with Store.connect(tmp_path / "new.db") as store:
        assert len(await store.list_runs()) == 20
