"""control-store show walks a run page by page and prints what it printed from one list."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_store import EvalJob, Job, JobOutcome, JobStatus, Run, Store, _sqlite, cli

from conftest import raw_db

# Several of show's pages (cli.SHOW_PAGE_SIZE jobs each), and a last one that is not full.
JOBS = 2 * cli.SHOW_PAGE_SIZE + 345
# Scores whose naive running sum differs from the exact one, and zeros of both signs.
SCORES = [1e16, 1.0, -1e16, 0.1, 0.7, -0.0, 0.0, 1 / 3, 2.5e-310, 0.2]
ERRORS = ["boom\nat line 2", "timeout", "rate limited", ""]
_ID = uuid.UUID(int=1)


def _reference_scores(jobs: Sequence[Job]) -> cli._Scores:
    """show's summary of a list of jobs computed from the whole list, with the mean as exact
    fractions give it, rounded once (Fraction to float rounds correctly)."""
    outcomes = [job.outcome for job in jobs if job.outcome is not None]
    scores = [o.score for o in outcomes if o.score is not None]
    return cli._Scores(
        done=len(outcomes),
        scored=len(scores),
        errors=sum(1 for o in outcomes if o.error is not None),
        mean_score=float(sum(map(Fraction, scores), Fraction(0)) / len(scores)) if scores else None,
        min_score=min(scores, default=None),
        max_score=max(scores, default=None),
    )


async def _reference_summarise(store: Store, run: Run) -> cli._Summary:
    """show's whole summary as it was computed before: list_jobs, then the list formulas."""
    jobs = await store.list_jobs(run.id)
    by_status = Counter(job.status.value for job in jobs)
    counts = {status.value: by_status.get(status.value, 0) for status in JobStatus}
    per_model = {
        model: _reference_scores([job for job in jobs if job.spec.model == model])
        for model in dict.fromkeys([*run.models, *(job.spec.model for job in jobs)])
    }
    errors = Counter(
        job.outcome.error
        for job in jobs
        if job.outcome is not None and job.outcome.error is not None
    )
    return cli._Summary(counts, _reference_scores(jobs), per_model, errors, 0)


async def _populate(path: Path) -> Run:
    """A run of JOBS jobs over three models and one model the run does not list, most of them
    recorded with tricky scores and errors whose counts tie."""
    # Days old: the "(3d ago)" in the text stays the same between two shows.
    created = datetime.now(UTC) - timedelta(days=3, hours=12)
    run = Run("suite.yaml", ["m-b", "m-a", "m-c"], 2, JOBS, created_at=created)
    models = ["m-a", "m-b", "m-c", "stray"]
    jobs = [Job(run.id, EvalJob(models[i % 7 % 4], f"s{i}", i % 2)) for i in range(JOBS)]
    outcomes = [
        JobOutcome(
            job.id,
            score=None if i % 5 == 4 else SCORES[i % len(SCORES)] * (1 + i % 3),
            error=ERRORS[i % 11 % 4] if i % 3 == 0 else None,
        )
        for i, job in enumerate(jobs)
        if i % 13 != 0  # some stay queued
    ]
    async with Store.connect(path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
        await store.claim_next_run()
        await store.record_job_outcomes(run.id, outcomes)
    return run


def _show(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["show", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_show_prints_what_the_list_way_printed_for_a_run_of_several_pages(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text and JSON of show over several pages equal, byte for byte, the list-based output."""
    run = asyncio.run(_populate(db_path))
    argv = [str(run.id), "--url", str(db_path)]
    with monkeypatch.context() as patch:
        patch.setattr(cli, "_summarise", _reference_summarise)
        before = _show(capsys, *argv), _show(capsys, *argv, "--json")
    after = _show(capsys, *argv), _show(capsys, *argv, "--json")
    assert after == before
    shown = json.loads(after[1])
    assert sum(shown["jobs"].values()) == JOBS
    assert list(shown["models"]) == ["m-b", "m-a", "m-c", "stray"]
    assert {e["error"] for e in shown["errors"]} == set(ERRORS)  # "" too: an error all the same
    assert sum(e["count"] for e in shown["errors"]) == shown["outcomes"]["errors"]
    assert "errors_not_tallied" not in shown
    assert "most common errors:" in after[0]


def test_show_never_reads_the_whole_run_at_once(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """show walks the run with iter_jobs in pages of SHOW_PAGE_SIZE and never calls list_jobs."""
    run = asyncio.run(_populate(db_path))
    pages: list[int] = []
    walk = Store.iter_jobs

    def iter_jobs(self: Store, run_id: object, *, page_size: int = 1000) -> object:
        pages.append(page_size)
        return walk(self, run_id, page_size=page_size)  # type: ignore[arg-type]

    async def list_jobs(self: Store, run_id: object) -> list[Job]:
        raise AssertionError("show called list_jobs")

    monkeypatch.setattr(Store, "iter_jobs", iter_jobs)
    monkeypatch.setattr(Store, "list_jobs", list_jobs)
    assert str(JOBS) in _show(capsys, str(run.id), "--url", str(db_path), "--json")
    assert pages == [cli.SHOW_PAGE_SIZE]


def test_show_tallies_a_bounded_number_of_distinct_errors_and_says_so(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_DISTINCT_ERRORS messages, new ones are counted in all, not by message, and said."""
    run = Run("suite.yaml", ["m"], 1, 8)
    jobs = [Job(run.id, EvalJob("m", f"s{i}", 0)) for i in range(8)]
    messages = ["a", "b", "a", "c", "d", "a", "e", "d"]

    async def populate() -> None:
        async with Store.connect(db_path) as store:
            await store.insert_run(run)
            await store.insert_jobs(jobs)
            outcomes = [JobOutcome(j.id, error=m) for j, m in zip(jobs, messages, strict=True)]
            await store.record_job_outcomes(run.id, outcomes)

    asyncio.run(populate())
    monkeypatch.setattr(cli, "MAX_DISTINCT_ERRORS", 3)
    argv = [str(run.id), "--url", str(db_path)]
    shown = json.loads(_show(capsys, *argv, "--json"))
    assert shown["errors"] == [
        {"error": "a", "count": 3},
        {"error": "b", "count": 1},
        {"error": "c", "count": 1},
    ]
    assert shown["errors_not_tallied"] == 3  # d, e, d: first seen after a, b, c
    assert shown["outcomes"]["errors"] == 8
    text = _show(capsys, *argv)
    assert "3  more, not tallied by message: only the first 3 distinct messages" in text
    monkeypatch.setattr(cli, "MAX_DISTINCT_ERRORS", 10)
    monkeypatch.setattr(cli, "MAX_ERROR_CHARS", 2)  # "a" and "b" fit, "c" would not
    shown = json.loads(_show(capsys, *argv, "--json"))
    assert [e["error"] for e in shown["errors"]] == ["a", "b"]
    assert shown["errors_not_tallied"] == 4


def test_show_of_a_corrupt_job_fails_in_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """A job show cannot read mid-walk exits 1 with the CorruptRowError naming the row."""
    run = asyncio.run(_populate(db_path))
    with raw_db(db_path) as conn:
        (bad,) = conn.execute("SELECT id FROM jobs ORDER BY rowid LIMIT 1 OFFSET 1500").fetchone()
        conn.execute("UPDATE jobs SET status = 'lost' WHERE id = ?", (bad,))
    code = cli.main(["show", str(run.id), "--url", str(db_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert captured.err.startswith("control-store: error: jobs.status of row " + bad)


finite = st.floats(allow_nan=False, allow_infinity=False, max_value=1e300, min_value=-1e300)


@given(st.lists(st.one_of(st.none(), finite), max_size=60))
def test_a_streamed_tally_equals_the_list_formulas_bit_for_bit(scores: list[float | None]) -> None:
    """_Tally's mean, min and max are the very floats the exact mean, min and max give, signs
    included."""
    outcomes = [JobOutcome(_ID, score=s) for s in scores]
    tally = cli._Tally()
    for outcome in outcomes:
        tally.add(outcome)
    jobs = [Job(_ID, EvalJob("m", "s", 0), outcome=o) for o in outcomes]
    expected = _reference_scores(jobs)
    got = tally.scores()
    assert repr(got) == repr(expected)  # repr tells -0.0 from 0.0, which == does not


def test_show_reads_the_run_and_every_page_in_one_snapshot(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outcomes recorded by another store while show walks the run's pages change none of
    its numbers: its progress (the run's done_count), its job counts and its tallies are of
    one moment, so they agree with each other."""
    run = asyncio.run(_populate(db_path))
    job_page = _sqlite.op_job_page
    pages = 0

    def op_job_page(run_id: str, after: int | None, limit: int, conn: object) -> object:
        nonlocal pages
        pages += 1
        if pages == 2:  # between the first page and the second: another store records
            asyncio.run(_record_the_rest(db_path, run))
        return job_page(run_id, after, limit, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(_sqlite, "op_job_page", op_job_page)
    shown = json.loads(_show(capsys, str(run.id), "--url", str(db_path), "--json"))
    assert pages > 2
    assert shown["run"]["done_count"] == shown["jobs"]["done"] == shown["outcomes"]["done"]
    assert shown["run"]["status"] == "running"


async def _record_the_rest(path: Path, run: Run) -> None:
    """Every job of ``run`` still queued recorded, from a store of its own: the run is done."""
    async with Store.connect(path) as store:
        queued = [job async for job in store.iter_jobs(run.id) if job.outcome is None]
        await store.record_job_outcomes(run.id, [JobOutcome(job.id, score=0.5) for job in queued])
        done = await store.get_run(run.id)
        assert done is not None
        assert done.status == "done"


def test_show_of_a_file_out_of_wal_mode_lets_writers_in_between_its_pages(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of WAL mode (a copy switched for read-only media) a read transaction holds SQLite's
    SHARED lock, which keeps every writer out: show there reads page by page as before, and a
    write between its pages goes through without waiting."""
    run = asyncio.run(_populate(db_path))
    with raw_db(db_path) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    job_page = _sqlite.op_job_page
    pages = 0

    def op_job_page(run_id: str, after: int | None, limit: int, conn: object) -> object:
        nonlocal pages
        pages += 1
        if pages == 2:
            writer = sqlite3.connect(db_path, timeout=0, isolation_level=None)
            try:
                writer.execute("UPDATE runs SET manifest = manifest")
            finally:
                writer.close()
        return job_page(run_id, after, limit, conn)  # type: ignore[arg-type]

    monkeypatch.setattr(_sqlite, "op_job_page", op_job_page)
    shown = json.loads(_show(capsys, str(run.id), "--url", str(db_path), "--json"))
    assert pages > 2
    assert sum(shown["jobs"].values()) == JOBS
