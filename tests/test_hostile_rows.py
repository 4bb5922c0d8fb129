"""Rows edited by hand: every read path reports the bad value, and nothing else ever escapes."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_store import ControlError, CorruptRowError, JobOutcome, Store
from control_store._codec import lenient_text

from conftest import group_in_flight, make_jobs, make_run, raw_db, sized, stored_run

# The integer columns and their smallest sound value; every other column holds text.
INTEGER_MINIMUM = {"epochs": 1, "job_count": 0, "done_count": 0, "job_rows": 0, "attempt": 0}
COLUMNS = [
    ("runs", "id"),
    ("runs", "manifest"),
    ("runs", "models"),
    ("runs", "epochs"),
    ("runs", "job_count"),
    ("runs", "status"),
    ("runs", "created_at"),
    ("runs", "done_count"),
    ("runs", "job_rows"),
    ("jobs", "id"),
    ("jobs", "run_id"),
    ("jobs", "spec"),
    ("jobs", "status"),
    ("jobs", "attempt"),
    ("jobs", "outcome"),
]


@dataclass(frozen=True)
class Hostile:
    """A value to write into a column."""

    value: Any
    as_text: bool = False  # bind bytes as TEXT: a string that is not UTF-8


def hostile(column: str) -> st.SearchStrategy[Hostile]:
    """Random bytes, wrong types, and near misses for ``column``."""
    near = ["", "queued ", "DONE", "[1, 2]", "{}", '{"model": 1}', "2026-01-01", "null", "-1"]
    values = [
        st.binary(max_size=40).map(Hostile),
        st.floats(allow_nan=False).map(Hostile),
        st.integers(-(2**63), 2**63 - 1).map(Hostile),
        st.text(max_size=40).map(Hostile),
        st.sampled_from(near).map(Hostile),
        # Not valid UTF-8, stored as TEXT: sqlite3 itself cannot decode it.
        st.binary(max_size=40).map(lambda b: Hostile(b + b"\xff", as_text=True)),
    ]
    if column == "outcome":
        values.append(st.just(Hostile(None)))
    return st.one_of(values)


def unreadable(column: str, stored: object) -> bool:
    """Whether no reader may accept ``stored`` (as SQLite keeps it, after column affinity)."""
    if column in INTEGER_MINIMUM:
        return not isinstance(stored, int) or stored < INTEGER_MINIMUM[column]
    if column == "outcome" and stored is None:
        return False
    # Text columns: anything but text surely fails; text may parse (any text is a manifest).
    return not isinstance(stored, str)


async def _corrupt(store: Store, table: str, column: str, row_id: str, bad: Hostile) -> object:
    """Write ``bad`` into one cell through the store's own sqlite3 connection, as a hand edit;
    return the value as SQLite now holds it (column affinity turns 7 into '7' in a TEXT column).

    Foreign keys are off for the edit, as in a plain ``sqlite3`` shell.
    """
    placeholder = "CAST(? AS TEXT)" if bad.as_text else "?"
    edit_sql = f"UPDATE {table} SET {column} = {placeholder} WHERE id = ?"
    read_sql = f"SELECT {column} FROM {table} WHERE rowid = ?"
    backend = store._backend
    assert backend is not None

    def edit(conn: sqlite3.Connection) -> object:
        (rowid,) = conn.execute(f"SELECT rowid FROM {table} WHERE id = ?", (row_id,)).fetchone()
        conn.execute("PRAGMA foreign_keys = OFF")
        try:
            assert conn.execute(edit_sql, (bad.value, row_id)).rowcount == 1
        finally:
            conn.execute("PRAGMA foreign_keys = ON")
        conn.text_factory = lenient_text
        try:
            return conn.execute(read_sql, (rowid,)).fetchone()[0]
        finally:
            conn.text_factory = str

    return await backend.read(edit)


async def _scenario(table: str, column: str, bad: Hostile) -> None:
    async with Store.in_memory() as store:
        run = make_run(job_count=2)
        jobs = make_jobs(run)
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        target = str(run.id if table == "runs" else jobs[0].id)
        stored = await _corrupt(store, table, column, target, bad)
        must_fail = unreadable(column, stored)
        row_id = target
        if column == "id":
            row_id = stored if isinstance(stored, str) else repr(stored)

        def names_the_cell(exc: CorruptRowError) -> None:
            assert (exc.table, exc.column, exc.row_id) == (table, column, row_id)
            assert exc.value == stored
            assert f"{table}.{column} of row {row_id} holds {stored!r}" in str(exc)

        # Each read either returns its rows or names the damaged cell; those marked True
        # surely reach the damaged row, so an unreadable value must make them fail.
        reads: list[tuple[Callable[[], Awaitable[object]], bool]] = [(store.list_runs, False)]
        if table == "runs":
            # job_rows is no field of a Run: no read of a run reaches it (insert_jobs does).
            of_run = column != "job_rows"
            reads = [
                (store.list_runs, of_run),
                (lambda: store.get_run(run.id), of_run and column != "id"),
                # A refused claim rolls back, so the claim after it still reaches the row.
                (lambda: store.claim_runs(5), of_run and column != "status"),
                (store.claim_next_run, of_run and column != "status"),
            ]
        else:
            reads += [
                (lambda: store.get_job(jobs[0].id), column != "id"),
                (lambda: store.list_jobs(run.id), column != "run_id"),
            ]
        for read, reaches in reads:
            try:
                await read()
            except CorruptRowError as exc:
                names_the_cell(exc)
            else:
                assert not (must_fail and reaches), f"{table}.{column} = {stored!r} was read"
        # check() reports the cell rather than failing, before a record may overwrite it.
        problems = await store.check()
        if must_fail:
            assert any(p.table == table and p.row_id == row_id for p in problems), problems
        # Records (and, for job_rows, an insert past the run's job_count) touch the row: any
        # outcome, as long as it is a ControlError; a CorruptRowError names a cell (the
        # damaged one, or a job whose run the damage cut off).
        calls: list[Awaitable[object]] = [
            store.record_job_outcome(run.id, JobOutcome(job.id)) for job in jobs
        ]
        if column == "job_rows":
            calls.append(store.insert_jobs(make_jobs(run, 1)))
        for call in calls:
            error = await _error_of(call)
            assert error is None or isinstance(error, ControlError), repr(error)
            if isinstance(error, CorruptRowError):
                assert f"{error.table}.{error.column} of row {error.row_id} holds" in str(error)
        await store.check()


async def _error_of(call: Awaitable[object]) -> Exception | None:
    """The exception ``call`` raised, if any."""
    try:
        await call
    except Exception as exc:  # the caller judges which kinds are allowed
        return exc
    return None


@pytest.mark.parametrize(("table", "column"), COLUMNS, ids=[f"{t}.{c}" for t, c in COLUMNS])
def test_a_hand_edited_cell_is_reported_by_every_read_and_nothing_else_escapes(
    table: str, column: str
) -> None:
    """Any value in any column: reads give the row or a CorruptRowError naming the cell."""

    @settings(max_examples=sized(25, 100), deadline=None, derandomize=True)
    @given(bad=hostile(column))
    def check(bad: Hostile) -> None:
        asyncio.run(_scenario(table, column, bad))

    check()


@pytest.mark.parametrize("value", [2, 2.0, "2"], ids=["int", "float", "text"])
async def test_a_job_rows_cell_set_to_what_it_holds_is_no_damage(value: object) -> None:
    """job_rows is an integer column: the value it already holds (2, however bound) is sound,
    and check() rightly finds nothing; the oracle must not call every int unreadable."""
    await _scenario("runs", "job_rows", Hostile(value))


@pytest.mark.parametrize("one_shot", [False, True], ids=["list", "iterator"])
async def test_a_negative_job_rows_cell_gives_a_run_no_job_past_its_job_count(
    one_shot: bool,
) -> None:
    """README: insert_jobs keeps job_rows "so a run is never given more jobs than its
    job_count". A job_rows edited below 0 must be refused as the damaged cell it is, not
    counted from: else a run of job_count 2 takes 5 jobs and ends done 5 of 2."""
    async with Store.in_memory() as store:
        run = make_run(job_count=2)
        await store.insert_run(run, jobs=make_jobs(run))
        await _corrupt(store, "runs", "job_rows", str(run.id), Hostile(-5))
        extra = make_jobs(run, 3)
        with pytest.raises(CorruptRowError, match=r"runs\.job_rows of row .* holds -5"):
            await store.insert_jobs(iter(extra) if one_shot else extra)
        assert len(await store.list_jobs(run.id)) == 2


async def test_text_that_is_not_utf8_is_reported_by_every_read_path() -> None:
    """Non-UTF-8 text is named by get, list, claim and check; the refused claim rolls back."""
    async with Store.in_memory() as store:
        run = make_run()
        await store.insert_run(run)
        await _corrupt(store, "runs", "manifest", str(run.id), Hostile(b"\xff\xfe", as_text=True))
        for call in (lambda: store.get_run(run.id), store.list_runs, store.claim_next_run):
            with pytest.raises(CorruptRowError, match=rf"runs\.manifest of row {run.id}"):
                await call()
        [problem] = await store.check()
        assert problem.row_id == str(run.id)
        assert "b'\\xff\\xfe'" in problem.message
        backend = store._backend
        assert backend is not None
        statuses = await backend.read(lambda c: c.execute("SELECT status FROM runs").fetchall())
        assert statuses == [("queued",)]  # the refused claim changed nothing


async def test_a_claim_meeting_text_that_is_not_utf8_is_undone_alone_and_in_a_group(
    db_path: Path,
) -> None:
    """On a file, a claim whose runs hold text that is not UTF-8 is undone and run again with
    the lenient text factory, as a lone call and inside a group commit: its caller gets the
    CorruptRowError naming the row, no run moves, and the group's other callers keep their
    results."""
    async with Store.connect(db_path) as store:
        bad, good = make_run(), make_run()
        for run in (bad, good):  # bad first: the oldest, which every claim takes
            await store.insert_run(run)
        await _corrupt(store, "runs", "manifest", str(bad.id), Hostile(b"\xff", as_text=True))
        backend = store._backend
        assert backend is not None
        trace: list[str] = []
        await backend.read(lambda conn: conn.set_trace_callback(trace.append))

        for claim in (store.claim_next_run, lambda: store.claim_runs(5)):
            trace.clear()
            with pytest.raises(CorruptRowError, match=rf"runs\.manifest of row {bad.id}"):
                await claim()
            # Undone by rolling back its transaction, then run again in another.
            assert trace[0] == "BEGIN IMMEDIATE"
            assert trace[2:4] == ["ROLLBACK", "BEGIN IMMEDIATE"]
            assert trace[4] == trace[1]  # the claim again
            assert trace[5:] == ["ROLLBACK"]

        trace.clear()
        extra = make_run()
        ahead = await group_in_flight(store)
        claimed = asyncio.ensure_future(store.claim_runs(5))
        inserted = asyncio.ensure_future(store.insert_run(extra))
        await ahead
        refused, stored = await asyncio.gather(claimed, inserted, return_exceptions=True)
        assert isinstance(refused, CorruptRowError), refused
        assert str(bad.id) in str(refused)
        assert stored is None
        # In the group, only the claim's savepoint was undone before it ran again.
        group = trace[trace.index("SAVEPOINT group_commit") :]
        claims = [i for i, sql in enumerate(group) if "SET status = 'running'" in sql]
        assert len(claims) == 2
        assert group[claims[0] + 1] == "ROLLBACK TO group_commit"
        assert group[-1] == "COMMIT"

        await backend.read(lambda conn: conn.set_trace_callback(None))
        assert await backend.read(lambda conn: conn.text_factory is str)
        statuses = await backend.read(
            lambda conn: dict(conn.execute("SELECT id, status FROM runs").fetchall())
        )
        assert set(statuses.values()) == {"queued"}
        assert str(extra.id) in statuses
        assert len(statuses) == 4  # bad, good, extra and the run of the write ahead


async def test_a_run_id_spelt_otherwise_is_refused_until_rewritten(db_path: Path) -> None:
    """A hand edit upper-cases a run's id (and its jobs' run_id, to keep them attached): lists
    and claims refuse the row, naming it and where the repair is, and the refused claims
    change nothing. check() reports it once; after its rewrite, the run is claimed as itself.
    Taken as it was, the run would be claimed, and then found by no call given its id."""
    run, _ = await stored_run(db_path)
    spelt = str(run.id).upper()
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = upper(id)")
        conn.execute("UPDATE jobs SET run_id = upper(run_id)")
    async with Store.connect(db_path) as store:
        calls = (store.list_runs, store.claim_next_run, lambda: store.claim_runs(3))
        for call in calls:
            with pytest.raises(CorruptRowError, match=rf"runs\.id of row {spelt} .*canonical"):
                await call()
        [problem] = await store.check()
        assert (problem.table, problem.row_id) == ("runs", spelt)
        assert f"rewrite it as '{run.id}'" in problem.message
    with raw_db(db_path) as conn:
        assert conn.execute("SELECT status FROM runs").fetchall() == [("queued",)]
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("UPDATE runs SET id = lower(id)")
        conn.execute("UPDATE jobs SET run_id = lower(run_id)")
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        claimed = await store.claim_next_run()
        assert claimed is not None
        assert claimed.id == run.id
