"""iter_runs: runs in keyset pages, one bounded read each, in list_runs' order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from control_store import (
    CorruptRowError,
    InvalidInputError,
    JobOutcome,
    Run,
    RunStatus,
    Store,
    StoreClosedError,
    _sqlite,
)

from conftest import make_jobs, make_run, query_plan, raw_db

BASE = datetime(2026, 1, 1, tzinfo=UTC)


async def _runs(store: Store, count: int, *, ties: int = 1) -> list[Run]:
    """``count`` runs, ``ties`` at a time created in the same microsecond (tie broken by
    insertion order), a third of them claimed; as list_runs returns them, newest first."""
    for i in range(count):
        await store.insert_run(make_run(created_at=BASE + timedelta(seconds=i // ties)))
    if count >= 3:
        await store.claim_runs(count // 3)
    return await store.list_runs()


@pytest.mark.parametrize(
    ("page_size", "count", "ties"), [(4, 10, 1), (4, 8, 3), (4, 0, 1), (3, 12, 12)]
)
async def test_iter_runs_yields_list_runs_in_order_across_pages(
    store: Store, page_size: int, count: int, ties: int
) -> None:
    """Every run, in list_runs' order, with or without a status, whatever the page boundaries,
    also where runs created in the same microsecond straddle a page boundary."""
    expected = await _runs(store, count, ties=ties)
    assert len(expected) == count
    assert [run async for run in store.iter_runs(page_size=page_size)] == expected
    for status in RunStatus:
        walked = [run async for run in store.iter_runs(status=status, page_size=page_size)]
        assert walked == await store.list_runs(status=status)


@pytest.mark.parametrize(("page_size", "count"), [(4, 10), (4, 8), (4, 0)])
async def test_each_page_is_one_read_of_at_most_page_size_rows(
    store: Store, monkeypatch: pytest.MonkeyPatch, page_size: int, count: int
) -> None:
    """A walk is one backend read per page, each of at most page_size runs; a short page ends it."""
    runs = await _runs(store, count)
    backend = store._backend
    assert backend is not None
    sizes: list[int] = []
    real = backend.read

    async def read(op: Any, *, small: bool = False) -> Any:
        result = await real(op, small=small)
        assert op.func is _sqlite.op_run_page
        sizes.append(len(result[0]))
        return result

    monkeypatch.setattr(backend, "read", read)
    assert [run async for run in store.iter_runs(page_size=page_size)] == runs
    full, rest = divmod(count, page_size)
    assert sizes == [page_size] * full + [rest]  # an exact multiple ends on one empty read


def _merged(index: str, where: str = "") -> list[str]:
    """The plan of a next page: two range seeks of ``index`` (the rest of the last created_at,
    then older ones, after ``where``'s own condition) merged."""
    return [
        "MERGE (UNION ALL)",
        "LEFT",
        "CO-ROUTINE (subquery-1)",
        f"SEARCH runs USING INDEX {index} ({where}created_at=? AND rowid<?)",
        "SCAN (subquery-1)",
        "USE TEMP B-TREE FOR ORDER BY",
        "RIGHT",
        "CO-ROUTINE (subquery-3)",
        f"SEARCH runs USING INDEX {index} ({where}created_at<?)",
        "SCAN (subquery-3)",
        "USE TEMP B-TREE FOR ORDER BY",
    ]


@pytest.mark.parametrize(
    ("sql", "params", "plan"),
    [
        (_sqlite.SELECT_FIRST_RUN_PAGE, (9,), ["SCAN runs USING INDEX idx_runs_created"]),
        (
            _sqlite.SELECT_FIRST_RUN_PAGE_BY_STATUS,
            ("done", 9),
            ["SEARCH runs USING INDEX idx_runs_status (status=?)"],
        ),
        (
            _sqlite.SELECT_NEXT_RUN_PAGE,
            ("t", 5, 9, "t", 9, 9),
            _merged("idx_runs_created"),
        ),
        (
            _sqlite.SELECT_NEXT_RUN_PAGE_BY_STATUS,
            ("done", "t", 5, 9, "done", "t", 9, 9),
            _merged("idx_runs_status", "status=? AND "),
        ),
    ],
    ids=["first", "first-by-status", "next", "next-by-status"],
)
def test_a_page_is_range_seeks_from_where_the_last_ended(
    sql: str, params: tuple[object, ...], plan: list[str]
) -> None:
    """Each page seeks to the walk's position and reads on in index order, never re-reading
    what came before: the next page's ties (the last run's created_at, rowids below its) are a
    seek on (created_at, rowid), so a walk over a million runs submitted with one created_at
    costs each page what the first costs (a row value seeking created_at alone re-read every
    tie walked, each page slower than the last)."""
    assert query_plan(sql, params) == plan


async def test_a_walk_yields_each_run_once_in_its_state_when_its_page_was_read(
    store: Store,
) -> None:
    """Writes between pages: runs already read stay as read; a run claimed later shows as
    running; one inserted older than the walk's position comes once, one newer does not."""
    runs = await _runs(store, 6)
    walk = store.iter_runs(page_size=2)
    seen = [await anext(walk), await anext(walk)]
    claimed = await store.claim_runs(10)  # the queued ones, all on later pages
    assert claimed
    older = make_run(created_at=BASE - timedelta(days=1))
    await store.insert_run(older)
    await store.insert_run(make_run(created_at=BASE + timedelta(days=1)))  # before the position
    seen += [run async for run in walk]
    assert [run.id for run in seen] == [run.id for run in [*runs, older]]
    assert seen[:2] == runs[:2]
    assert all(run.status is RunStatus.RUNNING for run in seen[2:6])


async def test_a_status_walk_leaves_out_a_run_whose_status_changed_before_its_page(
    store: Store,
) -> None:
    """A walk of queued runs: a run claimed before its page is read is not yielded (it is
    running by then), one claimed after its page was read was yielded as queued."""
    for i in range(6):
        await store.insert_run(make_run(created_at=BASE + timedelta(seconds=i)))
    queued = await store.list_runs(status=RunStatus.QUEUED)
    walk = store.iter_runs(status=RunStatus.QUEUED, page_size=2)
    seen = [await anext(walk)]
    claimed = await store.claim_next_run()  # the oldest: on the walk's last page
    assert claimed is not None
    assert claimed.id == queued[-1].id
    seen += [run async for run in walk]
    assert [run.id for run in seen] == [run.id for run in queued[:-1]]
    assert all(run.status is RunStatus.QUEUED for run in seen)


async def test_a_status_walk_yields_a_run_that_took_the_status_before_its_page(
    store: Store,
) -> None:
    """A walk of done runs: a run that finishes after the walk began, before its page is
    read, is yielded, once (it is done by then); one that finishes after the walk passed its
    place is not. A run is yielded exactly when it has the walk's status as its page is read."""
    runs, jobs = [], []
    for i in range(5):
        run = make_run(1, created_at=BASE + timedelta(seconds=i))
        runs.append(run)
        jobs.append(make_jobs(run))
        await store.insert_run(run, jobs=jobs[-1])

    async def finish(i: int) -> None:
        await store.record_job_outcome(runs[i].id, JobOutcome(jobs[i][0].id, score=1.0))

    await finish(4)  # the newest
    await finish(2)
    walk = store.iter_runs(status=RunStatus.DONE, page_size=1)
    seen = [await anext(walk)]  # runs[4]
    await finish(0)  # older than the walk's position: its page is still to come
    seen.append(await anext(walk))  # runs[2]: runs[3], not done, is passed
    await finish(3)  # its place passed already
    seen += [run async for run in walk]
    assert [run.id for run in seen] == [runs[i].id for i in (4, 2, 0)]
    assert all(run.status is RunStatus.DONE for run in seen)


async def test_a_corrupt_row_mid_walk_raises_naming_it(db_path: Path) -> None:
    """The pages before a bad row are yielded, then CorruptRowError names it, again if retried."""
    async with Store.connect(db_path) as store:
        runs = await _runs(store, 10)
    bad = runs[5]
    with raw_db(db_path) as conn:
        conn.execute("UPDATE runs SET epochs = 'many' WHERE id = ?", (str(bad.id),))
    async with Store.connect(db_path) as store:
        walk = store.iter_runs(page_size=2)
        walked = [await anext(walk) for _ in range(4)]
        assert walked == runs[:4]
        with pytest.raises(CorruptRowError) as caught:
            await anext(walk)  # the page holding runs 4 and 5 is not yielded at all
        error = caught.value
        assert (error.table, error.column, error.row_id) == ("runs", "epochs", str(bad.id))
        with pytest.raises(CorruptRowError, match=str(bad.id)):
            await anext(walk)


@pytest.mark.parametrize("page_size", [0, -1, 100_001, 1.5, "100", True, None])
async def test_a_bad_page_size_or_status_is_refused_when_the_walk_is_made(
    store: Store, page_size: Any
) -> None:
    """page_size must be an int from 1 to 100000 and status a RunStatus or None: refused at the
    call, naming the value; a closed store is StoreClosedError."""
    with pytest.raises(InvalidInputError) as caught:
        store.iter_runs(page_size=page_size)
    assert "page_size" in str(caught.value)
    assert repr(page_size) in str(caught.value)
    with pytest.raises(InvalidInputError, match="status"):
        store.iter_runs(status="finished")  # type: ignore[arg-type]
    await store.close()
    with pytest.raises(StoreClosedError):
        store.iter_runs()
