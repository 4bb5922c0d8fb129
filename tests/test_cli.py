"""The control-store command: each command on a real store, its JSON, its errors, the demo."""

from __future__ import annotations

import argparse
import asyncio
import collections.abc
import contextlib
import errno
import fcntl
import importlib.abc
import importlib.metadata
import io
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import termios
import time
import tomllib
import unicodedata
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_store import (
    ControlError,
    DatabaseBusyError,
    EvalJob,
    Job,
    JobOutcome,
    Run,
    RunStatus,
    StorageError,
    Store,
    cli,
)
from control_store import _demo as demo
from control_store._migrate import TRACKING_TABLE
from control_store._sqlite import parse_url

from conftest import (
    CALL_TIMEOUT,
    NEXT_VERSION,
    SHIPPED,
    WORKERS,
    make_jobs,
    make_run,
    raw_db,
    with_second_migration,
)

Result = tuple[int, str, str]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    """``main(argv)`` in this process: the exit code, stdout and stderr."""
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_subprocess(*argv: str, cwd: Path | None = None) -> Result:
    """``python -m control_store argv`` as a real process."""
    done = subprocess.run(
        [sys.executable, "-m", "control_store", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_clean_env(),
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cli.URL_ENV}
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def assert_one_line_error(result: Result, *fragments: str) -> None:
    """Exit 1, nothing on stdout, one line on stderr naming every fragment, no traceback."""
    code, out, err = result
    assert code == 1, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("control-store: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


async def _populate(path: Path) -> tuple[Run, Run]:
    """Two runs: an older one with three of four jobs recorded, a newer one untouched."""
    base = datetime.now(UTC) - timedelta(hours=2)
    older, newer = make_run(4, created_at=base), make_run(2, created_at=base + timedelta(hours=1))
    async with Store.connect(path) as store:
        for run in (older, newer):
            await store.insert_run(run)
            await store.insert_jobs(make_jobs(run))
        await store.claim_next_run()
        jobs = await store.list_jobs(older.id)
        await store.record_job_outcome(older.id, JobOutcome(jobs[0].id, score=1.0))
        await store.record_job_outcome(older.id, JobOutcome(jobs[1].id, score=0.0))
        await store.record_job_outcome(older.id, JobOutcome(jobs[2].id, error="boom\nat line 2"))
    return older, newer


@pytest.fixture
def populated(db_path: Path) -> tuple[Path, Run, Run]:
    """A migrated database holding the two runs of ``_populate``."""
    older, newer = asyncio.run(_populate(db_path))
    return db_path, older, newer


def _stored_runs(path: Path) -> list[Run]:
    async def read() -> list[Run]:
        async with Store.connect(path) as store:
            return await store.list_runs()

    return asyncio.run(read())


# ---------------------------------------------------------------------------------------------
# runs


def test_runs_lists_newest_first_with_progress(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """runs prints a header and one row per run, newest first, with done/job_count and age."""
    path, older, newer = populated
    code, out, err = run_cli(capsys, "runs", "--url", str(path))
    assert (code, err) == (0, "")
    header, first, second = out.splitlines()
    assert header.split() == ["RUN", "ID", "STATUS", "PROGRESS", "AGE", "MANIFEST", "MODELS"]
    assert first.startswith(str(newer.id))
    assert second.startswith(str(older.id))
    assert "running" in second
    assert "3/4  75%" in second
    assert " 2h " in second
    assert "model-a, model-b" in second


@pytest.mark.parametrize("page_size", [1000, 3], ids=["one page", "pages of 3"])
def test_runs_lines_up_the_progress_of_runs_of_different_sizes(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    page_size: int,
) -> None:
    """The counts and percentages of runs of 1, 5,000, 50 and 5 jobs stand in one column each:
    every run's counts are padded to the widest job_count of the table, not to its own, and a
    table printed a page at a time pads a later page's to the widest printed before it."""
    db = tmp_path / "sizes.db"

    async def fill() -> None:
        async with Store.connect(db) as store:
            for count in (1, 5_000, 50, 5):  # newest last: the run of 1 job is printed last
                await store.insert_run(make_run(job_count=count))

    asyncio.run(fill())
    monkeypatch.setattr(cli, "RUNS_PAGE_SIZE", page_size)
    code, out, err = run_cli(capsys, "runs", "--all", "--url", str(db))
    assert (code, err) == (0, "")
    rows = out.splitlines()[1:]
    assert len(rows) == 4
    assert len({row.index("/") for row in rows}) == 1, out
    assert len({row.index("%") for row in rows}) == 1, out


def test_runs_json_parses_back_to_the_stored_runs(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """runs --json is a list that decodes into Run structs equal to the store's."""
    path, _, _ = populated
    code, out, _ = run_cli(capsys, "runs", "--json", "--url", str(path))
    assert code == 0
    assert isinstance(json.loads(out), list)
    assert msgspec.json.decode(out, type=list[Run]) == _stored_runs(path)


def test_runs_json_is_written_a_page_at_a_time_as_the_same_document(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runs --json over more than a page (RUNS_PAGE_SIZE, 2 here) is the one document a single
    encode of the list makes, and --all's too; each is written a page at a time, since one
    encode of hundreds of thousands of runs could crash the process when memory ran out."""

    async def store_runs() -> None:
        async with Store.connect(db_path) as store:
            for _ in range(5):
                await store.insert_run(make_run())

    asyncio.run(store_runs())
    monkeypatch.setattr(cli, "RUNS_PAGE_SIZE", 2)
    whole = cli._json([cli._run_json(run) for run in _stored_runs(db_path)]) + "\n"
    for argv in (["--limit", "5"], ["--limit", "9"], ["--all"]):
        code, out, err = run_cli(capsys, "runs", "--json", *argv, "--url", str(db_path))
        assert (code, err, out) == (0, "", whole), argv
    code, out, _ = run_cli(capsys, "runs", "--json", "--status", "done", "--url", str(db_path))
    assert (code, out) == (0, "[]\n")


def test_runs_filters_by_status_and_says_when_there_are_more(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """--status keeps only matching runs; --limit cuts the list and the footer says so."""
    path, older, newer = populated
    code, out, _ = run_cli(capsys, "runs", "--status", "running", "--json", "--url", str(path))
    assert code == 0
    assert [r["id"] for r in json.loads(out)] == [str(older.id)]
    code, out, _ = run_cli(capsys, "runs", "--limit", "1", "--url", str(path))
    assert code == 0
    assert str(newer.id) in out
    assert str(older.id) not in out
    assert "--limit N for more" in out
    code, out, _ = run_cli(capsys, "runs", "--all", "--url", str(path))
    assert str(older.id) in out
    assert "for more" not in out


def test_runs_on_an_empty_store_says_there_are_none(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """An empty store lists no runs and says so; --json gives an empty list."""
    assert run_cli(capsys, "runs", "--url", str(db_path))[:2] == (0, f"no runs in {db_path}\n")
    assert run_cli(capsys, "runs", "--json", "--url", str(db_path))[1] == "[]\n"


async def _populate_many(path: Path, count: int) -> list[Run]:
    """``count`` runs, a second apart, oldest first."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    runs = [make_run(2, created_at=base + timedelta(seconds=i)) for i in range(count)]
    async with Store.connect(path) as store:
        for run in runs:
            await store.insert_run(run)
    return runs


def test_runs_json_says_on_stderr_when_runs_were_left_out(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """runs --json past its limit stays a list, of the newest runs, and says on stderr in one
    line that there are more and how to get them all (--all); nothing when none was left out."""
    runs = asyncio.run(_populate_many(db_path, cli.DEFAULT_LIMIT + 1))
    note = f"(newest {cli.DEFAULT_LIMIT} shown; --limit N for more, --all for every run)\n"
    code, out, err = run_cli(capsys, "runs", "--json", "--url", str(db_path))
    assert (code, err) == (0, note)
    assert [r["id"] for r in json.loads(out)] == [str(r.id) for r in runs[:0:-1]]
    code, out, err = run_cli(capsys, "runs", "--json", "--all", "--url", str(db_path))
    assert (code, err) == (0, "")
    assert len(json.loads(out)) == len(runs)
    limit = str(len(runs))  # exactly as many as there are: none left out
    code, out, err = run_cli(capsys, "runs", "--json", "--limit", limit, "--url", str(db_path))
    assert (code, err) == (0, "")
    assert len(json.loads(out)) == len(runs)
    code, out, err = run_cli(capsys, "runs", "--json", "--limit", "1", "--url", str(db_path))
    assert (code, err) == (0, "(newest 1 shown; --limit N for more, --all for every run)\n")
    assert [r["id"] for r in json.loads(out)] == [str(runs[-1].id)]


@pytest.mark.parametrize("count", [0, 3, 7])
def test_runs_all_is_read_and_written_a_page_at_a_time(
    capsys: pytest.CaptureFixture[str],
    db_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    count: int,
) -> None:
    """runs --all walks the runs a page at a time (never list_runs, which would hold them all:
    1.5 GB for a million), and prints as it goes: --json is the very document a single list
    gives, and the table has one heading, every run once, newest first, its columns aligned."""
    runs = asyncio.run(_populate_many(db_path, count))[::-1]
    monkeypatch.setattr(cli, "RUNS_PAGE_SIZE", 3)

    async def no_whole_list(*args: Any, **kwargs: Any) -> list[Run]:
        raise AssertionError("runs --all read every run at once")

    monkeypatch.setattr(Store, "list_runs", no_whole_list)
    code, out, err = run_cli(capsys, "runs", "--json", "--all", "--url", str(db_path))
    assert (code, err) == (0, "")
    expected = asyncio.run(_stored_in_order(db_path))
    assert expected == runs
    assert out == cli._json([cli._run_json(run) for run in expected]) + "\n"
    code, out, err = run_cli(capsys, "runs", "--all", "--url", str(db_path))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    if not runs:
        assert lines == [f"no runs in {db_path}"]
        return
    assert lines[0].split()[:2] == ["RUN", "ID"]
    assert [line.split()[0] for line in lines[1:]] == [str(run.id) for run in runs]
    assert len({line.index(" queued") for line in lines[1:]}) == 1


def test_runs_all_exits_1_naming_a_row_a_later_page_cannot_read(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runs --all meeting a row it cannot read on a later page exits 1 with the error naming
    the row on stderr, after the pages before it were printed."""
    runs = asyncio.run(_populate_many(db_path, 7))  # oldest first: the last page's is runs[0]
    with raw_db(db_path) as conn:
        conn.execute("UPDATE runs SET epochs = 'many' WHERE id = ?", (str(runs[0].id),))
    monkeypatch.setattr(cli, "RUNS_PAGE_SIZE", 3)
    for json_flag in ([], ["--json"]):
        code, out, err = run_cli(capsys, "runs", "--all", *json_flag, "--url", str(db_path))
        assert code == 1
        assert str(runs[-1].id) in out  # the first page was printed
        assert str(runs[0].id) in err
        assert "epochs" in err
        assert len(err.splitlines()) == 1


async def _stored_in_order(path: Path) -> list[Run]:
    """Every run at ``path``, newest first, read through iter_runs."""
    async with Store.connect(path) as store:
        return [run async for run in store.iter_runs()]


def test_json_gives_created_at_as_the_store_writes_it(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """runs --json and show --json give created_at as the fixed-width text the store writes
    (microseconds even when they are zero), so sorting it as text sorts runs by time."""
    whole = make_run(2, created_at=datetime(2026, 1, 1, tzinfo=UTC))
    half = make_run(2, created_at=datetime(2026, 1, 1, 0, 0, 0, 500_000, tzinfo=UTC))

    async def populate() -> None:
        async with Store.connect(db_path) as store:
            for run in (whole, half):
                await store.insert_run(run)

    asyncio.run(populate())
    with raw_db(db_path) as conn:
        stored = dict(conn.execute("SELECT id, created_at FROM runs").fetchall())
    assert stored[str(whole.id)] == "2026-01-01T00:00:00.000000Z"
    code, out, _ = run_cli(capsys, "runs", "--json", "--url", str(db_path))
    assert code == 0
    shown = json.loads(out)
    assert {r["id"]: r["created_at"] for r in shown} == stored
    by_text = [r["id"] for r in sorted(shown, key=lambda r: r["created_at"])]
    assert by_text == [str(whole.id), str(half.id)]
    assert msgspec.json.decode(out, type=list[Run]) == _stored_runs(db_path)  # still Runs
    for run in (whole, half):
        code, out, _ = run_cli(capsys, "show", str(run.id), "--json", "--url", str(db_path))
        assert code == 0
        assert json.loads(out)["run"]["created_at"] == stored[str(run.id)]


def test_fit_names_keeps_its_output_for_small_lists() -> None:
    """_fit_names gives as many names as fit, then +N for the rest, else "N models"."""
    abc = ["a", "bb", "ccc"]
    assert cli._fit_names([], 0) == ""
    assert cli._fit_names([], 100) == ""
    assert cli._fit_names(abc, 100) == "a, bb, ccc"
    assert cli._fit_names(abc, 10) == "a, bb, ccc"  # exactly 10 characters
    assert cli._fit_names(abc, 9) == "a, bb +1"  # 8 characters
    assert cli._fit_names(abc, 8) == "a, bb +1"
    assert cli._fit_names(abc, 7) == "a +2"  # "a, bb +1" is 8
    assert cli._fit_names(abc, 4) == "a +2"
    assert cli._fit_names(abc, 3) == "3 models"  # even "a +2" is 4: the count, whatever its size
    assert cli._fit_names(abc, -5) == "3 models"
    assert cli._fit_names(["abcdef"], 6) == "abcdef"
    assert cli._fit_names(["abcdef"], 5) == "abcd…"  # the name cut, not "1 model" cut
    assert cli._fit_names(["abcdef", "g"], 6) == "ab… +1"
    assert cli._fit_names(["abcdef"], 5, "...") == "ab..."
    assert cli._fit_names(["abcdef"], 1) == "1 model"
    # Twelve names n0..n11: "n0, n1, n2 +9" is 13 characters, "n0, n1 +10" is 10.
    twelve = [f"n{i}" for i in range(12)]
    assert cli._fit_names(twelve, 13) == "n0, n1, n2 +9"
    assert cli._fit_names(twelve, 12) == "n0, n1 +10"
    # An empty last name: all of "a, " (3) fits where "a +1" (4) does not.
    assert cli._fit_names(["a", ""], 3) == "a, "
    assert cli._fit_names(["a", ""], 2) == "2 models"


def test_a_narrow_terminal_still_shows_a_short_model_name() -> None:
    """On an 80-column terminal the fixed columns leave the MODELS column no more than its
    heading: a name that fits the heading's width is shown, not cut down to "1 mod…"."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=True, unicode=True, color=False, width=80)
    when = datetime(2026, 1, 1, tzinfo=UTC)
    runs = [
        Run("suite.yaml", models, 1, 10, created_at=when)
        for models in (["a"], ["llama-3"], ["claude-3-haiku", "gpt-4o"])
    ]
    cli._runs_table(term, runs, datetime(2026, 1, 2, tzinfo=UTC))
    header, *rows = stream.getvalue().splitlines()
    assert header.endswith("MODELS")
    assert [row.rsplit("  ", 1)[1] for row in rows] == ["a", "llama…", "cl… +1"], rows


@pytest.mark.parametrize("unicode", [True, False], ids=["utf-8", "ascii"])
def test_a_runs_table_fits_its_width_with_wide_or_unencodable_text(unicode: bool) -> None:
    """Cells are measured as the stream shows them: a CJK character takes two columns, and on
    a stream that cannot encode it, its escape takes six (the manifest was cut before it was
    escaped, into a 114-column cell, and the models fitted by characters)."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=True, unicode=unicode, color=False, width=140, encoding="ascii")
    when = datetime(2026, 1, 1, tzinfo=UTC)
    runs = [Run("評価" * 30, ["模型" * 4, "gpt"], 1, 10, created_at=when)]
    cli._runs_table(term, runs, datetime(2026, 1, 2, tzinfo=UTC))
    _, row = stream.getvalue().splitlines()
    assert cli._columns(row) <= 140, row
    start = "評" if unicode else "\\u8a55\\u4fa1"
    manifest, models = row[row.index(start) :].split("  ")
    assert 39 <= cli._columns(manifest) <= 40, row  # a wide character is not cut in two
    assert row.isascii() is not unicode
    assert cli._columns(row) == 140 or models == "模型模型模型模型, gpt", row


class _CountingNames(list[str]):
    """A list of names that counts the names it hands out in slices, and refuses to hand out
    more than ``budget`` in all (so a quadratic walk fails at once instead of taking minutes)."""

    def __init__(self, names: list[str], budget: int) -> None:
        super().__init__(names)
        self.sliced = 0
        self.budget = budget

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        if isinstance(index, slice):
            self.sliced += len(item)
            assert self.sliced <= self.budget, f"{self.sliced} names sliced out of {len(self)}"
        return item


def test_fit_names_takes_a_long_list_in_linear_work() -> None:
    """_fit_names on 50,000 names gives the right text, reading each name a bounded number of
    times (it used to join every prefix in turn: quadratic, 3.7 s a row for 20,000)."""
    count = 50_000
    names = _CountingNames([f"m{i:05d}" for i in range(count)], budget=count)
    # Each name is 6 characters and 2 for ", ": 4 names are 30, " +49996" 7 more; 5 are 45.
    assert cli._fit_names(names, 40) == "m00000, m00001, m00002, m00003 +49996"
    ones = _CountingNames(["x"] * count, budget=3 * count)
    everything = count + 2 * (count - 1)  # every name and ", " between them: 149,998
    assert cli._fit_names(ones, everything) == ", ".join(["x"] * count)
    # One short: all but the last with " +1" is 149,998 too; all but two with " +2" is 149,995.
    assert cli._fit_names(ones, everything - 1) == ", ".join(["x"] * (count - 2)) + " +2"
    assert cli._fit_names(ones, 3) == f"{count} models"


def test_url_comes_from_option_anywhere_then_environment_then_default(
    capsys: pytest.CaptureFixture[str],
    populated: tuple[Path, Run, Run],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """--url before or after the command, else $CONTROL_STORE_URL, else control.db here."""
    path, older, _ = populated
    for argv in (["--url", str(path), "runs", "--json"], ["runs", "--json", "--url", str(path)]):
        assert str(older.id) in run_cli(capsys, *argv)[1]
    monkeypatch.setenv(cli.URL_ENV, f"sqlite://{path}")  # sqlite:///abs/path
    assert str(older.id) in run_cli(capsys, "runs")[1]
    monkeypatch.delenv(cli.URL_ENV)
    monkeypatch.chdir(path.parent)
    assert path.name == "control.db"
    assert str(older.id) in run_cli(capsys, "runs")[1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert_one_line_error(run_cli(capsys, "runs"), "'control.db'", "control-store migrate")
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# show


def test_show_counts_jobs_by_status_and_summarises_outcomes(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """show --json gives the run, jobs by status, mean score, errors and a per-model split."""
    path, older, _ = populated
    code, out, err = run_cli(capsys, "show", str(older.id), "--json", "--url", str(path))
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert msgspec.convert(shown["run"], Run) == next(
        r for r in _stored_runs(path) if r.id == older.id
    )
    assert shown["jobs"] == {"queued": 1, "running": 0, "done": 3}
    assert shown["outcomes"] == {
        "done": 3,
        "scored": 2,
        "errors": 1,
        "mean_score": 0.5,
        "min_score": 0.0,
        "max_score": 1.0,
    }
    assert shown["models"]["model-a"]["scored"] == 1
    assert shown["errors"] == [{"error": "boom\nat line 2", "count": 1}]


@pytest.mark.parametrize(
    ("models", "listed"),
    [
        (["a", "b"], "a, b"),
        (["a, b"], "'a, b'"),
        (["b +1"], "'b +1'"),
        (["it's", "x"], "'it\\'s', x"),
        ([" lead", "trail "], "\\x20lead, trail\\x20"),
    ],
    ids=["two", "comma", "plus", "quote", "spaces"],
)
def test_a_list_of_models_quotes_a_name_holding_what_the_list_writes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, models: list[str], listed: str
) -> None:
    """The runs table's MODELS cell and show's models line join the names with ", " (and the
    table adds " +N"): the one model "a, b" showed as the models "a" and "b". A name holding a
    comma, a plus sign or a quote is quoted, and a space at either end of a name is shown as
    in a table's cell, in show's line too."""
    path = tmp_path / "models.db"
    run = Run("m", models, 1, 1)

    async def fill() -> None:
        async with Store.connect(path) as store:
            await store.insert_run(run)

    asyncio.run(fill())
    code, out, _ = run_cli(capsys, "runs", "--url", str(path))
    assert code == 0
    assert out.splitlines()[1].endswith(f"  {listed}"), out
    code, out, _ = run_cli(capsys, "show", str(run.id), "--url", str(path))
    assert code == 0
    assert f"\nmodels    {listed}\n" in out, out


def test_show_prints_the_run_for_a_person(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """show prints the run's fields, counts, the mean score and errors on one line each."""
    path, older, _ = populated
    code, out, _ = run_cli(capsys, "show", str(older.id), "--url", str(path))
    assert code == 0
    assert f"run       {older.id}" in out
    assert "queued 1  running 0  done 3  (of 4)" in out
    assert "3 recorded, 2 scored, mean score 0.500 (min 0.000, max 1.000), 1 error" in out
    assert "boom\\nat line 2" in out  # one line: its newline escaped


def test_show_tallies_an_error_with_an_empty_message(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """An outcome with error="" (str() of a TimeoutError() or a KeyError() is empty) counts
    as an error in the totals and in the tally by message, so the tally adds up to the total:
    in --json as "", for a person as "(no message)"."""

    async def fill() -> Run:
        async with Store.connect(db_path) as store:
            run = make_run(job_count=3)
            jobs = make_jobs(run, 3)
            await store.insert_run(run, jobs=jobs)
            await store.record_job_outcomes(
                run.id,
                [JobOutcome(jobs[0].id, error=""), JobOutcome(jobs[1].id, error="")],
            )
            return run

    run = asyncio.run(fill())
    code, out, err = run_cli(capsys, "show", str(run.id), "--json", "--url", str(db_path))
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert shown["outcomes"]["errors"] == 2
    assert shown["errors"] == [{"error": "", "count": 2}]
    code, out, _ = run_cli(capsys, "show", str(run.id), "--url", str(db_path))
    assert code == 0
    assert "most common errors:\n       2  (no message)\n" in out


def test_show_writes_a_year_before_1000_with_four_digits(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """The created time reads as the stored text does: year 1 is 0001 (glibc's strftime %Y
    wrote "1-01-01")."""

    async def insert() -> Run:
        run = Run("m", ["a"], 1, 1, created_at=datetime(1, 2, 3, 4, 5, 6, 7, tzinfo=UTC))
        async with Store.connect(db_path) as store:
            await store.insert_run(run)
        return run

    run = asyncio.run(insert())
    code, out, err = run_cli(capsys, "show", str(run.id), "--url", str(db_path))
    assert (code, err) == (0, "")
    assert "created   0001-02-03 04:05:06 UTC (" in out


HOSTILE = "x\nFORGED-ROW  done  9/9\x1b[2J\x1b]0;title\x07\x9b\x7f"


async def _populate_hostile(path: Path) -> Run:
    """One run whose manifest, model and error message hold control characters."""
    run = Run(HOSTILE, ["m\r\x1b[31mred", "n\u202e1.0\u2028"], 1, 1)
    async with Store.connect(path) as store:
        await store.insert_run(run)
        (job,) = make_jobs(run, 1)
        await store.insert_jobs([job])
        await store.claim_next_run()
        await store.record_job_outcome(run.id, JobOutcome(job.id, error="e\x1b[2J\nline 2"))
    return run


def test_control_characters_in_stored_text_are_escaped_for_people(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """runs and show print a control character of a manifest, a model or an error as its
    escape, and a bidirectional override or line separator too: no forged row, no terminal
    escape sequence, no text reordered; --json keeps the exact text."""
    run = asyncio.run(_populate_hostile(db_path))
    code, out, err = run_cli(capsys, "runs", "--url", str(db_path))
    assert (code, err) == (0, "")
    assert len(out.splitlines()) == 2  # the header and one row: nothing forged
    assert "x\\nFORGED-ROW" in out
    assert "\\x1b[2J\\x1b]0;title\\x07\\x9b\\x7f" in out
    assert "m\\r\\x1b[31mred" in out
    assert "n\\u202e1.0\\u2028" in out  # a bidi override reorders what follows it
    code, out, err = run_cli(capsys, "show", str(run.id), "--url", str(db_path))
    assert (code, err) == (0, "")
    assert "e\\x1b[2J\\nline 2" in out
    for text in (out,):
        assert not any(ch in text for ch in "\x1b\r\x07\x9b\x7f")
    code, out, err = run_cli(capsys, "runs", "--json", "--url", str(db_path))
    assert json.loads(out)[0]["manifest"] == HOSTILE


def test_show_gives_the_mean_of_scores_whose_sum_is_past_the_largest_float(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """show of a run whose finite scores sum past the largest float gives their finite mean,
    in text and in JSON, instead of failing with a traceback."""
    run = Run("huge.yaml", ["m"], 1, 2)

    async def populate() -> None:
        async with Store.connect(db_path) as store:
            await store.insert_run(run)
            jobs = make_jobs(run)
            await store.insert_jobs(jobs)
            await store.record_job_outcomes(
                run.id, [JobOutcome(job.id, score=1.7e308) for job in jobs]
            )

    asyncio.run(populate())
    code, out, err = run_cli(capsys, "show", str(run.id), "--json", "--url", str(db_path))
    assert (code, err) == (0, "")
    shown = json.loads(out)
    assert shown["outcomes"]["mean_score"] == 1.7e308
    assert shown["models"]["m"]["mean_score"] == 1.7e308
    code, out, err = run_cli(capsys, "show", str(run.id), "--url", str(db_path))
    assert (code, err) == (0, "")
    # Three significant digits past a billion: three decimals would be 309 digits wide.
    assert "mean score 1.700e+308 (min 1.700e+308, max 1.700e+308)" in out
    assert "m      2     2       1.700e+308  0" in out.splitlines()


def _exact_mean(scores: list[float]) -> float:
    """The exact mean of ``scores``, rounded once (Fraction to float rounds correctly)."""
    return float(sum(map(Fraction, scores), Fraction(0)) / len(scores))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=20))
def test_the_mean_of_any_finite_scores_is_finite_and_exact(scores: list[float]) -> None:
    """_Tally's mean of any finite scores, however near the largest float, is finite, between
    the least and the greatest, and the exact mean rounded once."""
    tally = cli._Tally()
    for score in scores:
        tally.add(JobOutcome(uuid.UUID(int=1), score=score))
    mean = tally.scores().mean_score
    assert mean is not None
    assert math.isfinite(mean)
    assert min(scores) <= mean <= max(scores)
    assert mean == _exact_mean(scores)


@pytest.mark.parametrize(
    ("scores", "mean"),
    [
        ([1.7e308, 1.7e308], 1.7e308),
        ([-1.7e308, -1.7e308], -1.7e308),
        ([sys.float_info.max] * 3, sys.float_info.max),
        ([sys.float_info.max, sys.float_info.max, -sys.float_info.max / 2], sys.float_info.max / 2),
        ([5.174716367880626e16] * 3, 5.174716367880626e16),  # fsum / len: ...625e16
    ],
)
def test_the_mean_is_the_exact_mean_rounded_once(scores: list[float], mean: float) -> None:
    """Scores whose sum no float holds, or equal scores, have the exact mean, rounded once."""
    tally = cli._Tally()
    for score in scores:
        tally.add(JobOutcome(uuid.UUID(int=1), score=score))
    assert tally.scores().mean_score == mean


# Invisible and reordering characters: each as output for people shows it.
INVISIBLE = {
    "\u061c": "\\u061c",  # ARABIC LETTER MARK: a bidi mark
    "\u200b": "\\u200b",  # ZERO WIDTH SPACE
    "\u200d": "\\u200d",  # ZERO WIDTH JOINER
    "\u2060": "\\u2060",  # WORD JOINER
    "\ufeff": "\\ufeff",  # ZERO WIDTH NO-BREAK SPACE (a BOM)
    "\xad": "\\xad",  # SOFT HYPHEN
    "\U000e0041": "\\U000e0041",  # TAG LATIN CAPITAL LETTER A
    "\U000e0001": "\\U000e0001",  # LANGUAGE TAG
    "\u180e": "\\u180e",  # MONGOLIAN VOWEL SEPARATOR
    "\U0001d173": "\\U0001d173",  # MUSICAL SYMBOL BEGIN BEAM
    "\ufe0f": "\\ufe0f",  # VARIATION SELECTOR-16 (Mn, but default ignorable)
    "\U000e0100": "\\U000e0100",  # VARIATION SELECTOR-17
    "\u034f": "\\u034f",  # COMBINING GRAPHEME JOINER
    "\u3164": "\\u3164",  # HANGUL FILLER (Lo, but default ignorable)
    "\u2029": "\\u2029",  # PARAGRAPH SEPARATOR
    "\udc80": "\\udc80",  # a lone surrogate, as an undecodable argument byte becomes
}


@pytest.mark.parametrize(("char", "escape"), INVISIBLE.items())
def test_invisible_characters_are_shown_as_escapes(char: str, escape: str) -> None:
    """_printable shows a format character, a separator or a default-ignorable one as its
    escape, in the \\xNN, \\uNNNN or \\UNNNNNNNN form repr uses."""
    assert cli._printable(f"gpt-x{char}!") == f"gpt-x{escape}!"


def test_every_control_format_surrogate_and_separator_character_is_escaped() -> None:
    """No character of Unicode category Cc, Cf, Cs, Zl or Zp, and no default-ignorable one,
    survives _printable: each becomes a backslash escape of printable ASCII."""
    escaped = {"Cc", "Cf", "Cs", "Zl", "Zp"}
    ignorable = [0x34F, 0x115F, 0x1160, 0x17B4, 0x17B5, *range(0x180B, 0x1810), 0x2065, 0x3164]
    ignorable += [*range(0xFE00, 0xFE10), 0xFFA0, *range(0xFFF0, 0xFFF9), *range(0xE0000, 0xE1000)]
    chars = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) in escaped]
    chars += [chr(c) for c in ignorable]
    assert {"\u061c", "\U000e007f"} <= set(chars)
    for char in chars:
        shown = cli._printable(char)
        assert re.fullmatch(r"\\[\x21-\x7e]+", shown), hex(ord(char))


def test_visible_text_is_shown_as_it_is() -> None:
    """_printable keeps letters, marks, symbols and spaces of any script as they are."""
    for text in ("évals/日本語.yaml", "modèle-ñ", "délai dépassé ⏱", "a b", "e\u0301", "👍"):
        assert cli._printable(text) == text


def test_a_plain_space_at_either_end_is_escaped() -> None:
    """A plain space at either end of a text vanishes in a padded cell ("gpt-x " would show as
    "gpt-x"): it is escaped there, and only there."""
    assert cli._printable("gpt-x ") == "gpt-x\\x20"
    assert cli._printable("  gpt x") == "\\x20\\x20gpt x"
    assert cli._printable(" \u200b ") == "\\x20\\u200b\\x20"
    assert cli._printable("   ") == "\\x20" * 3
    assert cli._printable("") == ""


def test_spaces_other_than_the_plain_space_and_blank_symbols_are_escaped() -> None:
    """A no-break, thin, ideographic or ogham space, or the braille blank, looks like a plain
    space or like nothing: "gpt x" and "gpt\u00a0x", or "gpt-x" and "gpt-x\u2009", would show
    the same. They are shown as escapes."""
    for char, shown in [
        ("\u00a0", "\\xa0"),
        ("\u2009", "\\u2009"),
        ("\u3000", "\\u3000"),
        ("\u1680", "\\u1680"),
        ("\u2800", "\\u2800"),
    ]:
        assert cli._printable(f"gpt{char}x") == f"gpt{shown}x"


def test_a_name_holding_a_backslash_never_shows_as_one_holding_an_escape(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """A model named with a backslash and "u200b", beside one holding a zero width space (shown
    as its escape \\u200b), and one with a backslash and "n" beside one holding a line break:
    four rows, four names, in `show` and `runs`, the backslash doubled as repr() doubles it."""
    models = ["gpt-x\u200b", "gpt-x\\u200b", "a\nb", "a\\nb"]
    run = Run("C:\\suite.yaml", models, 1, 4)

    async def populate() -> None:
        async with Store.connect(db_path) as store:
            jobs = [Job(run.id, EvalJob(model, "q", 0)) for model in models]
            await store.insert_run(run, jobs=jobs)
            await store.record_job_outcomes(run.id, [JobOutcome(job.id) for job in jobs])

    asyncio.run(populate())
    code, out, err = run_cli(capsys, "show", str(run.id), "--url", str(db_path))
    assert (code, err) == (0, "")
    shown = [line.split()[0] for line in out.splitlines() if line.startswith(("gpt-x", "a"))]
    assert shown == ["gpt-x\\u200b", "gpt-x\\\\u200b", "a\\nb", "a\\\\nb"]
    assert "manifest  C:\\\\suite.yaml\n" in out
    code, out, err = run_cli(capsys, "runs", "--url", str(db_path))
    assert (code, err) == (0, "")
    assert "gpt-x\\u200b, gpt-x\\\\u200b, a\\nb, a\\\\nb" in out


def test_names_that_differ_by_an_invisible_character_show_differently(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """Two models that differ only by a zero width space show as two different rows, and a
    manifest's Arabic letter mark and soft hyphen are shown as escapes; --json keeps them."""
    models = ["gpt-x", "gpt-x\u200b"]
    run = Run("eval\xad.yaml\u061c 12 34", models, 1, 2)

    async def populate() -> None:
        async with Store.connect(db_path) as store:
            await store.insert_run(run)
            jobs = [Job(run.id, EvalJob(model, "q", 0)) for model in models]
            await store.insert_jobs(jobs)
            await store.record_job_outcomes(
                run.id, [JobOutcome(jobs[0].id, score=0.1), JobOutcome(jobs[1].id, score=0.9)]
            )

    asyncio.run(populate())
    code, out, err = run_cli(capsys, "show", str(run.id), "--url", str(db_path))
    assert (code, err) == (0, "")
    assert "eval\\xad.yaml\\u061c 12 34" in out
    assert "models    gpt-x, gpt-x\\u200b\n" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("gpt-x")]
    assert rows == [["gpt-x", "1", "1", "0.100", "0"], ["gpt-x\\u200b", "1", "1", "0.900", "0"]]
    assert not any(char in out for char in "\u200b\u061c\xad")
    code, out, err = run_cli(capsys, "runs", "--url", str(db_path))
    assert (code, err) == (0, "")
    assert "eval\\xad.yaml\\u061c 12 34" in out
    assert "gpt-x, gpt-x\\u200b" in out
    code, out, _ = run_cli(capsys, "show", str(run.id), "--json", "--url", str(db_path))
    assert list(json.loads(out)["models"]) == models


def test_show_an_unknown_run_fails_in_one_line(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """show of a run id the store lacks exits 1 naming the id and how to list runs."""
    ghost = uuid.uuid4()
    result = run_cli(capsys, "show", str(ghost), "--url", str(db_path))
    assert_one_line_error(result, str(ghost), "control-store runs")


# ---------------------------------------------------------------------------------------------
# check


def test_check_passes_a_sound_store(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """check exits 0 on a sound store, and --json says ok with no problems."""
    path, _, _ = populated
    code, out, _ = run_cli(capsys, "check", "--url", str(path))
    assert code == 0
    assert "no problems found" in out
    code, out, _ = run_cli(capsys, "check", "--json", "--url", str(path))
    assert (code, json.loads(out)) == (0, {"ok": True, "problems": []})


def test_check_lists_problems_and_exits_1(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """check prints each inconsistency with its row and exits 1; --json lists them too."""
    path, older, _ = populated
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE runs SET done_count = 1 WHERE id = ?", (str(older.id),))
    code, out, _ = run_cli(capsys, "check", "--url", str(path))
    assert code == 1
    assert f"runs {older.id}: run {older.id} has done_count 1 but 3 of its jobs are done" in out
    assert out.endswith(f"1 problem found in {path}\n")
    code, out, _ = run_cli(capsys, "check", "--json", "--url", str(path))
    report = json.loads(out)
    assert code == 1
    assert report["ok"] is False
    assert report["problems"][0]["row_id"] == str(older.id)


# ---------------------------------------------------------------------------------------------
# migrate


def test_migrate_creates_applies_then_reports_up_to_date(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """migrate creates and migrates a new file; a second migrate applies nothing."""
    url = f"sqlite://{tmp_path / 'new.db'}"  # sqlite:///abs/path
    code, out, _ = run_cli(capsys, "migrate", "--url", url)
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("applied migration")] == [
        f"applied migration {version} ({description})" for version, description in SHIPPED
    ]
    newest = SHIPPED[-1][0]
    code, out, _ = run_cli(capsys, "migrate", "--url", url)
    assert (code, out) == (0, f"database is up to date (migration {newest}); nothing to apply\n")
    code, out, _ = run_cli(capsys, "migrate", "--json", "--url", url)
    assert (code, json.loads(out)) == (0, {"applied": [], "version": newest})


def test_migrate_status_lists_pending_then_applied(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """migrate --status changes nothing: pending on an empty file, applied after migrate."""
    path = tmp_path / "empty.db"
    path.touch()
    code, out, _ = run_cli(capsys, "migrate", "--status", "--json", "--url", str(path))
    assert code == 0
    assert json.loads(out) == [
        {
            "version": version,
            "description": description,
            "state": "pending",
            "installed_on": None,
            "applied": False,
        }
        for version, description in SHIPPED
    ]
    code, out, _ = run_cli(capsys, "migrate", "--status", "--url", str(path))
    assert [line.split() for line in out.splitlines()[1:]] == [
        [str(version), *description.split(), "pending"] for version, description in SHIPPED
    ]
    assert run_cli(capsys, "migrate", "--url", str(path))[0] == 0
    code, out, _ = run_cli(capsys, "migrate", "--status", "--json", "--url", str(path))
    states = json.loads(out)
    assert [state["applied"] for state in states] == [True] * len(SHIPPED)
    assert [state["state"] for state in states] == ["applied"] * len(SHIPPED)
    assert all(datetime.fromisoformat(s["installed_on"]).tzinfo is not None for s in states)


@pytest.mark.parametrize(
    ("edit", "version", "state", "error"),
    [
        (
            f"UPDATE {TRACKING_TABLE} SET success = 0 WHERE version = 2",
            2,
            "failed",
            "recorded as failed",
        ),
        (
            f"UPDATE {TRACKING_TABLE} SET checksum = zeroblob(48) WHERE version = 1",
            1,
            "changed",
            "checksum",
        ),
        (
            f"UPDATE {TRACKING_TABLE} SET checksum = x'00' WHERE version = 1",
            1,
            "unreadable",
            "expected the SHA-384 of 0001_init.sql",
        ),
        # Cells of the wrong type were refused with nothing listed.
        (
            f"UPDATE {TRACKING_TABLE} SET checksum = 'abc' WHERE version = 2",
            2,
            "unreadable",
            "checksum of row 2 holds 'abc'",
        ),
        (
            f"UPDATE {TRACKING_TABLE} SET success = 'yes' WHERE version = 1",
            1,
            "unreadable",
            "success of row 1 holds 'yes'",
        ),
        (
            f"INSERT INTO {TRACKING_TABLE} VALUES (99, 'from the future', "
            "'2026-01-01T00:00:00.000000Z', 1, x'00', 0)",
            99,
            "unknown",
            "newer release",
        ),
    ],
    ids=["failed", "changed", "unreadable", "text-checksum", "text-success", "unknown"],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_migrate_status_lists_a_history_it_refuses(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    edit: str,
    version: int,
    state: str,
    error: str,
    as_json: bool,
) -> None:
    """On a failed, edited or unknown migration migrate --status still lists every migration,
    the bad one with its state, then exits 1 with the refusal and its fix; nothing changes."""
    path = tmp_path / "history.db"
    assert run_cli(capsys, "migrate", "--url", str(path))[0] == 0
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(edit)
    before = path.read_bytes()
    argv = ["migrate", "--status", *(["--json"] if as_json else []), "--url", str(path)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: ")
    assert error in line
    if as_json:
        states = {s["version"]: s["state"] for s in json.loads(out)}
    else:
        # VERSION DESCRIPTION... STATE INSTALLED-ON: every row here has its time.
        states = {int(row.split()[0]): row.split()[-2] for row in out.splitlines()[1:]}
    expected = {v: "applied" for v, _ in SHIPPED} | {version: state}
    assert states == expected
    assert path.read_bytes() == before


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_migrate_status_lists_a_migration_whose_row_was_lost_as_missing(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    as_json: bool,
) -> None:
    """A migration whose tracking row was deleted below one still recorded: migrate --status
    lists it as missing (it listed nothing before), then exits 1 with the refusal, whose fix
    puts the row back; nothing changes."""
    with_second_migration(monkeypatch)
    path = tmp_path / "history.db"
    assert run_cli(capsys, "migrate", "--url", str(path))[0] == 0
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(f"DELETE FROM {TRACKING_TABLE} WHERE version = 1")
    before = path.read_bytes()
    argv = ["migrate", "--status", *(["--json"] if as_json else []), "--url", str(path)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    (line,) = err.splitlines()
    assert "not migration 1 (init), which comes before it" in line
    assert f"INSERT INTO {TRACKING_TABLE}" in line
    later = [version for version, _ in SHIPPED[1:]] + [NEXT_VERSION]
    if as_json:
        states = {s["version"]: s["state"] for s in json.loads(out)}
    else:
        # VERSION DESCRIPTION... STATE [INSTALLED-ON]: the missing one has no time.
        rows = [row.split() for row in out.splitlines()[1:]]
        states = {int(row[0]): row[-1] if row[0] == "1" else row[-2] for row in rows}
    assert states == {1: "missing"} | dict.fromkeys(later, "applied")
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# Expected failures: one line on stderr, exit 1, nothing created


def _garbage(migrated: Path) -> str:
    path = migrated.parent / "garbage.db"
    path.write_bytes(b"this is not a database, " * 100)
    return str(path)


def _unmigrated(migrated: Path) -> str:
    path = migrated.parent / "empty.db"
    path.touch()
    return str(path)


def _unmigrated_escaped(migrated: Path) -> str:
    """An empty file named by a URL that spells a space %20."""
    (migrated.parent / "empty x.db").touch()
    return f"sqlite://{migrated.parent}/empty%20x.db"


def _foreign(migrated: Path) -> str:
    """Another application's SQLite database."""
    path = migrated.parent / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    return str(path)


def _corrupt_row(path: Path) -> str:
    asyncio.run(_populate(path))
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE runs SET models = '{oops' WHERE rowid = 1")
    return str(path)


def _schema_name_not_utf8(path: Path) -> str:
    """A flipped byte in a schema row's name: SQLite's message quotes the name's raw bytes,
    which CPython's sqlite3 fails to decode (UnicodeDecodeError, not a DatabaseError)."""
    asyncio.run(_populate(path))
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")  # every page in the one file
    data = bytearray(path.read_bytes())
    at = data.index(b"idx_runs_created")
    data[at + 4 : at + 6] = b"\xd2 "  # 'idx_runs_created' -> 'idx_\xd2 ns_created'
    path.write_bytes(bytes(data))
    return str(path)


def _emptied_history(path: Path) -> str:
    """The schema and the rows, but every migration's row deleted by hand."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(f"DELETE FROM {TRACKING_TABLE}")
    return str(path)


def _dangling_link(path: Path) -> str:
    link = path.parent / "link.db"
    link.symlink_to(path.parent / "nowhere" / "x.db")
    return str(link)


def _newer_schema(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(
            "INSERT INTO _control_store_migrations VALUES (999, 'future', '', 1, x'00', 0)"
        )
    return str(path)


@pytest.mark.parametrize(
    ("argv", "make", "fragments"),
    [
        (["runs"], lambda p: str(p.parent / "missing.db"), ["no database at", "migrate"]),
        (["runs"], lambda p: "mysql://host/db", ["unknown scheme 'mysql'", "sqlite://"]),
        (
            ["check"],
            lambda p: str(p.parent / "nodir" / "x.db"),
            [
                "no database at",
                f": directory '{{dir}}{os.sep}nodir' does not exist; check --url",
                f"or create the directory '{{dir}}{os.sep}nodir' (mkdir -p), then create one",
            ],
        ),
        (
            ["runs"],
            _dangling_link,
            ["no database at", ": it is a symlink to '{dir}", "which does not exist; check --url"],
        ),
        (["runs"], _garbage, ["not a SQLite database"]),
        (["check"], _garbage, ["not a SQLite database"]),
        (["runs"], _unmigrated, ["holds no control_store schema", "control-store migrate"]),
        (
            ["runs"],
            _unmigrated_escaped,
            ["empty x.db' (the URL 'sqlite://", "empty%20x.db') holds no control_store schema"],
        ),
        (["runs"], _foreign, ["not a control_store database", "'notes'", "left untouched"]),
        (["migrate"], _foreign, ["not a control_store database", "'notes'", "left untouched"]),
        (
            ["migrate", "--status"],
            _foreign,
            ["not a control_store database", "'notes'", "left untouched"],
        ),
        (["runs"], _corrupt_row, ["runs.models", "{oops", "repair"]),
        (["runs"], _schema_name_not_utf8, ["is corrupt", "malformed database schema (idx_\\xd2"]),
        (["check"], _schema_name_not_utf8, ["is corrupt", "malformed database schema"]),
        (["migrate"], _schema_name_not_utf8, ["is corrupt", "malformed database schema"]),
        (
            ["check"],
            _emptied_history,
            ["has the tables jobs, runs but an empty migration history", "put the rows back"],
        ),
        (["show", str(uuid.uuid4())], _newer_schema, ["migration 999", "upgrade"]),
        (["migrate"], _newer_schema, ["migration 999", "upgrade"]),
    ],
    ids=[
        "missing-file",
        "bad-scheme",
        "missing-directory",
        "dangling-link",
        "not-a-database",
        "check-not-a-database",
        "unmigrated",
        "unmigrated-escaped-url",
        "foreign",
        "migrate-foreign",
        "migrate-status-foreign",
        "corrupt-row",
        "schema-name-not-utf8",
        "check-schema-name-not-utf8",
        "migrate-schema-name-not-utf8",
        "emptied-history",
        "newer-schema-show",
        "newer-schema-migrate",
    ],
)
def test_expected_failures_are_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str],
    db_path: Path,
    argv: list[str],
    make: Callable[[Path], str],
    fragments: list[str],
) -> None:
    """A bad URL, a missing, foreign, unmigrated or corrupt database: one clear line, exit 1."""
    url = make(db_path)
    before = _databases(db_path.parent)
    fragments = [fragment.replace("{dir}", str(db_path.parent)) for fragment in fragments]
    assert_one_line_error(run_cli(capsys, *argv, "--url", url), *fragments)
    assert _databases(db_path.parent) == before  # no command created a database file


@pytest.mark.parametrize(
    ("argv", "make", "fragment"),
    [
        (["runs"], lambda p: "mysql://host/db", "unknown scheme 'mysql'"),
        (["show", str(uuid.uuid4())], lambda p: "mysql://host/db", "unknown scheme 'mysql'"),
        (["check"], lambda p: str(p.parent / "nodir" / "x.db"), "does not exist"),
        (["migrate"], lambda p: "mysql://host/db", "unknown scheme 'mysql'"),
        (["migrate", "--status"], lambda p: "sqlite://x.db?mode=ro", "query parameters"),
        (["demo"], lambda p: "postgres://ops:hunter2@db/control", "PostgreSQL"),
        (["runs"], _garbage, "not a SQLite database"),
        (["runs"], _unmigrated, "holds no control_store schema"),
        (["runs"], lambda p: str(p.parent / "missing.db"), "no database at"),
    ],
    ids=[
        "runs-scheme",
        "show-scheme",
        "check-missing-directory",
        "migrate-scheme",
        "migrate-status-query",
        "demo-postgres",
        "not-a-database",
        "unmigrated",
        "missing-file",
    ],
)
def test_url_errors_say_when_the_url_came_from_the_environment(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    db_path: Path,
    argv: list[str],
    make: Callable[[Path], str],
    fragment: str,
) -> None:
    """An error about the URL's database says the URL came from $CONTROL_STORE_URL when it
    did (the user typed no --url), and does not when --url gave it."""
    url = make(db_path)
    note = "(the URL came from $CONTROL_STORE_URL; --url overrides it)"
    monkeypatch.setenv(cli.URL_ENV, url)
    assert_one_line_error(run_cli(capsys, *argv), fragment, note)
    monkeypatch.setenv(cli.URL_ENV, str(db_path))  # a good one, overridden by --url
    code, out, err = run_cli(capsys, *argv, "--url", url)
    assert_one_line_error((code, out, err), fragment)
    assert "CONTROL_STORE_URL;" not in err


def test_the_demo_in_memory_from_the_environment_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """demo refusing sqlite::memory: from $CONTROL_STORE_URL says where the URL came from."""
    monkeypatch.setenv(cli.URL_ENV, "sqlite::memory:")
    code, _, err = run_cli(capsys, "demo")
    assert code == 2
    assert err.rstrip().endswith("(the URL came from $CONTROL_STORE_URL; --url overrides it)")


def _suggested(line: str, before: str) -> str:
    """The command ``line`` suggests, in the quotes that frame it, just before ``before`` (or
    at the end of the line, for "")."""
    after = f" {re.escape(before)}" if before else "$"
    match = re.search(rf"""(["'])((?:set -- .*?; )?control-store .*)\1{after}""", line.rstrip("\n"))
    assert match is not None, line
    return match.group(2)


@pytest.mark.parametrize(
    "name",
    [
        "my dir/o ld.db",
        "it's here/o.db",
        "t\tab 50%/o.db",
        "new\nline/-o\u200b.db",
        "vs\ufe0f \u2800\u3164/o.db",  # printable to Python, shown as escapes
        "-dash/o.db",  # argparse would take "--url -dash/o.db" for an option
        "ends/o.db\n\n",  # "$(...)" drops a trailing newline
        "d//u:p@x.db",  # a plain path, though a URL there would hold a password
    ],
)
@pytest.mark.parametrize("empty", [True, False], ids=["empty-file", "missing-file"])
def test_a_suggested_command_works_when_pasted_into_a_shell(
    tmp_path: Path, name: str, empty: bool
) -> None:
    """The migrate command an error suggests names the --url given, quoted for the shell
    (/bin/sh, dash here): with a space, a quote, a tab, a newline (even at the end) or an
    invisible character in the path, or a dash before it, pasted as printed it creates that
    database (not the default one, nor one named otherwise), and the failed command then
    works."""
    path = tmp_path / name
    path.parent.mkdir()
    if empty:
        path.touch()  # an empty file: no schema yet
    code, out, err = run_subprocess("runs", f"--url={name}", cwd=tmp_path)
    assert_one_line_error((code, out, err), "no control_store schema" if empty else "no database")
    command = _suggested(err, "" if empty else "(or")
    assert re.search(r"(^|; )control-store migrate --url", command), command
    pasted = command.replace("control-store", shlex.quote(sys.executable) + " -m control_store", 1)
    done = subprocess.run(
        ["/bin/sh", "-c", pasted], cwd=tmp_path, env=_clean_env(), capture_output=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert run_subprocess("runs", f"--url={name}", cwd=tmp_path)[:1] == (0,)
    assert not (tmp_path / "control.db").exists()
    made = {p.name for p in path.parent.iterdir()}
    assert made <= {path.name, f"{path.name}-wal", f"{path.name}-shm"}, made


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
@pytest.mark.parametrize("name", ["\xe9t\xe9/o.db", "\u65e5\u672c.db", "\xe9\u65e5/o.db"])
def test_a_suggested_command_works_pasted_from_a_stream_of_another_encoding(
    tmp_path: Path, name: str, encoding: str
) -> None:
    """On a stream that cannot write a character of the path (PYTHONIOENCODING=ascii), the
    suggested command makes that character with printf: written raw, the stream showed it as
    the escape \\xe9, which pasted inside single quotes named another file ('\\xe9t...'), and
    the failed command then still failed. On a latin-1 stream under a UTF-8 locale, an é
    written raw is the one byte 0xe9, which pasted is another name than the UTF-8 file's."""
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    env = _clean_env() | {"PYTHONIOENCODING": encoding}
    argv = [sys.executable, "-m", "control_store", "runs", f"--url={name}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, check=False)
    assert done.returncode == 1, done
    # As a terminal in the stream's encoding shows the line, and pastes it back: its bytes.
    command = _suggested(done.stderr.decode(encoding), "(or")
    pasted = command.replace("control-store", shlex.quote(sys.executable) + " -m control_store", 1)
    made = subprocess.run(
        [b"/bin/sh", b"-c", pasted.encode(encoding)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, check=False)
    assert again.returncode == 0, again.stderr
    assert path.exists()


def test_a_demo_suggested_for_a_file_named_with_a_colon_names_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """demo on a file with queued runs suggests a new file beside it; for run:1.db that is
    ./run:1-demo.db, which the URL parser reads as that file, not as the scheme 'run'."""
    monkeypatch.chdir(tmp_path)
    asyncio.run(_populate(tmp_path / "run:1.db"))
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", "./run:1.db")
    assert_one_line_error((code, out, err), "queued runs")
    argv = shlex.split(_suggested(err, ""))
    assert argv[:3] == ["control-store", "demo", "--url"]
    assert Path(parse_url(argv[3])).resolve() == tmp_path / "run:1-demo.db"


def test_demo_json_on_a_path_that_is_not_utf8_is_a_json_document(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """demo --json --url $'\\xff.db': the URL, decoded with surrogateescape, is in the
    document's config. msgspec cannot encode a lone surrogate: the demo ran, then ended in a
    UnicodeEncodeError traceback instead of its JSON."""
    path = tmp_path / os.fsdecode(b"\xff.db")
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--json", "--url", str(path))
    assert code == 0, err
    document = json.loads(out)
    assert document["ok"] is True
    assert os.fsencode(document["config"]["url"]) == os.fsencode(str(path))


def test_demo_heading_shows_the_urls_control_characters_as_escapes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The demo's first line names its --url: a newline in it split the line, and an ESC in it
    reached the terminal, where every other message shows them as \\n and \\x1b."""
    path = tmp_path / "a\nb\x1b[2J.db"
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("control-store demo on "), first
    assert "a\\nb\\x1b[2J.db: " in first
    assert "\x1b" not in out


def test_the_migrate_command_suggested_for_a_path_with_a_space_is_quoted(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pending migrations on a file whose path holds a space: the suggested migrate command
    splits, as a shell would, into the very URL, and applying it lets runs read the file."""
    path = tmp_path / "my dir" / "o ld.db"
    path.parent.mkdir()
    asyncio.run(_populate(path))
    with_second_migration(monkeypatch)
    code, out, err = run_cli(capsys, "runs", "--url", str(path))
    assert_one_line_error((code, out, err), "pending migrations")
    command = _suggested(err, "(on a copy")
    assert shlex.split(command) == ["control-store", "migrate", "--url", str(path)]
    assert run_cli(capsys, *shlex.split(command)[1:])[0] == 0
    assert run_cli(capsys, "runs", "--url", str(path))[0] == 0


def _databases(directory: Path) -> list[str]:
    """The database files in ``directory`` (SQLite's -wal and -shm companions aside)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(("-wal", "-shm")))


def test_a_locked_database_fails_in_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str], db_path: Path
) -> None:
    """migrate on a database whose write lock another connection holds: one line, and exit 3,
    which tells a script that running it again may work."""
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        code, out, err = run_cli(capsys, "migrate", "--busy-timeout", "0.05", "--url", str(db_path))
    finally:
        holder.close()
    assert code == cli.EXIT_RETRY == 3
    assert_one_line_error((1, out, err), "is locked", "--busy-timeout SECONDS")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["runs", "--limit", "0"],
        ["runs", "--limit", "9223372036854775808"],
        ["runs", "--status", "paused"],
        ["runs", "--limit", "3", "--all"],
        ["show"],
        ["show", "not-a-uuid"],
        # uuid.UUID() would read these as other ids: int(x, 16) takes ' ', '+' and '_'.
        ["show", "0f8fad5b-d9cb-469f-a165-70867728950 "],
        ["show", "+f8fad5b-d9cb-469f-a165-70867728950e"],
        ["show", "0f8fad5b-_9cb-469f-a165-70867728950e"],
        ["demo", "--death-rate", "1.5"],
        ["demo", "--runs", "many"],
        # int() and float() read these as numbers: each is a typo on a command line.
        ["runs", "--limit", "\u0663"],
        ["runs", "--limit", "1_000"],
        ["runs", "--limit", " 5"],
        ["runs", "--limit", "+5"],
        ["demo", "--runs", "\uff18"],
        ["demo", "--death-rate", "nan"],
        ["demo", "--duplicate-rate", "1e-1"],
        ["demo", "--latency-ms", "\u0663.5"],
        ["check", "--busy-timeout", "infinity"],
        ["demo", "--seed", "\u0663"],
        ["demo", "--seed", "1_000"],
        ["demo", "--seed", "+5"],
        ["check", "--busy-timeout", "-1"],
    ],
    ids=lambda argv: " ".join(argv) or "no-command",
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """A malformed command line prints usage and the reason, and exits 2."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("usage: control-store")
    assert "error:" in err
    assert "Traceback" not in err


def test_a_limit_of_thousands_of_digits_is_refused_saying_the_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Past int()'s 4,300 digits, argparse said "invalid _positive_int value", the parser's
    own name; the refusal says the range, as for any number out of it."""
    code, out, err = run_cli(capsys, "runs", "--limit", "9" * 5000)
    assert (code, out) == (2, "")
    assert err.endswith(
        "error: argument --limit: a number of 5,000 digits must be from 1 to 9223372036854775807\n"
    ), err[-200:]
    # Leading zeros count toward int()'s limit: read without them, this is 1.
    result = run_cli(capsys, "runs", "--limit", "0" * 5000 + "1", "--url", "sqlite::memory:")
    assert result == (0, "no runs in sqlite::memory:\n", "")
    # A seed is any int Python reads; past that, the refusal says the limit.
    assert cli._seed("1" * 101) == int("1" * 101)
    assert cli._seed("-0042") == -42
    with pytest.raises(argparse.ArgumentTypeError, match="give at most 4,300 digits"):
        cli._seed("1" * 4301)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["runs", "--limit", "-1"], "argument --limit: -1 must be from 1 to 9223372036854775807"),
        (["demo", "--runs", "-20"], "argument --runs: -20 must be from 1 to 9223372036854775807"),
        (["demo", "--duplicate-rate", "-0.1"], "argument --duplicate-rate: -0.1 must be between"),
        (["check", "--busy-timeout", "-1"], "argument --busy-timeout: -1 must be between 0 and"),
        (["demo", "--latency-ms", "10001"], "argument --latency-ms: 10001 must be between 0 and"),
    ],
)
def test_a_negative_number_is_refused_saying_the_range(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    """A number below the range is a number all the same: the refusal gives the range, as for
    one above it (it said "'-1' is not a whole number")."""
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (2, "")
    assert reason in err.splitlines()[-1], err


@pytest.mark.parametrize("zero", ["-0", "-0.0", "-.0"])
def test_minus_zero_is_zero(zero: str) -> None:
    """-0 is 0, in range: it was refused as "-0 must be between 0 and 86400.0"."""
    assert cli._seconds(zero) == 0.0
    assert cli._rate(1.0)(zero) == 0.0


def test_an_empty_url_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--url "" names nothing: exit 2 saying so, instead of quietly creating ./control.db."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "migrate", "--url", "")
    assert (code, out) == (2, "")
    assert err.startswith("control-store: error: --url is empty")
    assert list(tmp_path.iterdir()) == []
    # argparse before 3.13 reads "--url=--" as no value at all: it was taken for no --url,
    # and migrate made ./control.db; 3.13's argparse gives "--", refused alike.
    for argv in (["--url=--"], ["--url", "x.db", "--url=--"]):
        code, out, err = run_cli(capsys, "migrate", *argv)
        assert (code, out) == (2, "")
        assert err.startswith("control-store: error: --url=-- names no database"), err
        assert "give --url ./--" in err
        assert list(tmp_path.iterdir()) == []


def test_the_largest_limit_is_taken(capsys: pytest.CaptureFixture[str], db_path: Path) -> None:
    """--limit up to SQLite's largest integer works (the command asks for one more run than
    it shows, to tell whether there are more)."""
    code, _, err = run_cli(capsys, "runs", "--limit", str(2**63 - 1), "--url", str(db_path))
    assert (code, err) == (0, "")


def test_help_exits_0_and_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """--help lists the commands and exits 0."""
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("migrate", "runs", "show", "check", "demo"):
        assert command in out


def test_version_names_the_release_and_the_sqlite_and_python_it_runs_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--version prints the installed release, SQLite's version and Python's, and exits 0."""
    code, out, err = run_cli(capsys, "--version")
    release = importlib.metadata.version("control-store")
    python = platform.python_version()
    assert (code, err) == (0, "")
    assert out == f"control-store {release} (SQLite {sqlite3.sqlite_version}, Python {python})\n"


def test_the_version_is_read_only_when_asked() -> None:
    """Building the command line reads no package metadata: importing importlib.metadata and
    reading it cost every command ~45 ms at start-up, for --version alone."""
    code = (
        "import sys; from control_store import cli; cli._parser(); "
        "print('importlib.metadata' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "False\n"


def test_each_commands_help_states_its_own_busy_timeout_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--busy-timeout's help gives the default the command uses: the demo's 30 s, not 5."""
    defaults = {"demo": cli.DEMO_BUSY_TIMEOUT, "runs": 5.0, "check": 5.0, "migrate": 5.0}
    for command, default in defaults.items():
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0
        help_text = " ".join(out.split())
        assert f"write lock (default: {default:g})" in help_text, command
    code, out, _ = run_cli(capsys, "--help")
    assert f"(default: 5; demo: {cli.DEMO_BUSY_TIMEOUT:g})" in " ".join(out.split())


# ---------------------------------------------------------------------------------------------
# Read commands on a database this user may not write


def run_cli_obeying_permissions(*argv: str) -> Result:
    """The command as a process subject to file permissions even as root (no CAP_DAC_*)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from _workers import obey_file_permissions; obey_file_permissions(); "
        "from control_store import cli; sys.exit(cli.main(sys.argv[2:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(WORKERS.parent), *argv],
        capture_output=True,
        text=True,
        env=_clean_env(),
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def _digests(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _read_only_file(db: Path) -> Path:
    """The database itself made read-only, in its writable directory."""
    db.chmod(0o444)
    return db


def _read_only_media(db: Path) -> Path:
    """A copy out of WAL mode in a read-only directory: what a copy on read-only media is."""
    media = db.parent / "media"
    media.mkdir()
    copy = media / db.name
    with (
        contextlib.closing(sqlite3.connect(db)) as source,
        contextlib.closing(sqlite3.connect(copy)) as target,
    ):
        source.backup(target)
        target.execute("PRAGMA journal_mode = DELETE")
    copy.chmod(0o444)
    media.chmod(0o555)
    return copy


@pytest.mark.slow
@pytest.mark.usefixtures("permissions_obeyed")
@pytest.mark.parametrize("make", [_read_only_file, _read_only_media], ids=["file", "media"])
def test_read_commands_work_on_a_database_the_user_may_not_write(
    populated: tuple[Path, Run, Run], make: Callable[[Path], Path]
) -> None:
    """runs, show, check and migrate --status read it and leave every file as it was."""
    db, older, newer = populated
    path = make(db)
    before = _digests(path.parent)
    try:
        code, out, err = run_cli_obeying_permissions("runs", "--url", str(path))
        assert (code, err) == (0, "")
        assert [line.split()[0] for line in out.splitlines()[1:]] == [str(newer.id), str(older.id)]
        code, out, err = run_cli_obeying_permissions("show", str(older.id), "--url", str(path))
        assert (code, err) == (0, "")
        assert "3 recorded" in out
        code, out, err = run_cli_obeying_permissions("check", "--url", str(path))
        assert (code, out, err) == (0, f"no problems found in {path}\n", "")
        code, out, err = run_cli_obeying_permissions("migrate", "--status", "--url", str(path))
        assert (code, err) == (0, "")
        assert out.splitlines()[1].split()[:3] == ["1", "init", "applied"]
        # migrate writes: on a file it may not write, it fails in one line, and writes nothing;
        # exit 3, as the error is retryable (once the file is made writable).
        code, out, err = run_cli_obeying_permissions("migrate", "--url", str(path))
        assert code == cli.EXIT_RETRY
        assert_one_line_error((1, out, err), "read-only")
        after = _digests(path.parent)
    finally:
        path.parent.chmod(0o755)
        path.chmod(0o644)
    # SQLite may add the -shm and -wal files a WAL reader needs where the directory is writable.
    assert {name: after[name] for name in before} == before
    assert all(not after[name] for name in after if name.endswith("-wal"))


@pytest.mark.usefixtures("permissions_obeyed")
@pytest.mark.parametrize(
    ("suffix", "mode"),
    [("", 0o000), ("", 0o200), ("-wal", 0o000), ("-shm", 0o200)],
    ids=["no-access", "write-only", "wal", "shm"],
)
def test_a_database_the_user_may_not_read_is_named_so(
    populated: tuple[Path, Run, Run], suffix: str, mode: int
) -> None:
    """A file this user may not read, the database or its -wal or -shm: one line naming it
    and what to do, exit 3 (retryable, once the file is readable), where SQLite's
    SQLITE_CANTOPEN read as a full or failing disk; the files are left as they were."""
    db, _, _ = populated
    unreadable = Path(f"{db}{suffix}")
    unreadable.touch()
    before = _digests(db.parent)
    unreadable.chmod(mode)
    try:
        results = [
            run_cli_obeying_permissions(*command, "--url", str(db))
            for command in (["runs"], ["check"], ["migrate"])
        ]
    finally:
        unreadable.chmod(0o644)
    which = f"its {suffix} file '{unreadable}'" if suffix else "it"
    for code, out, err in results:
        assert code == cli.EXIT_RETRY, err
        assert_one_line_error(
            (1, out, err), f"this user may not read {which} (permission denied)", "readable"
        )
        assert "disk" not in err
    assert _digests(db.parent) == before


@pytest.mark.slow
@pytest.mark.usefixtures("permissions_obeyed")
def test_a_wal_copy_without_its_sidecars_on_read_only_media_says_what_to_copy(
    populated: tuple[Path, Run, Run],
) -> None:
    """A WAL database alone in a read-only directory: one line saying what to copy, exit 1."""
    db, _, _ = populated
    media = db.parent / "media"
    media.mkdir()
    shutil.copyfile(db, media / db.name)
    media.chmod(0o555)
    try:
        result = run_cli_obeying_permissions("runs", "--url", str(media / db.name))
    finally:
        media.chmod(0o755)
    assert_one_line_error(
        result, "in WAL mode", "-wal and -shm files", "may write", "journal_mode=DELETE"
    )


def test_read_commands_on_an_older_schema_point_at_migrate(
    capsys: pytest.CaptureFixture[str],
    populated: tuple[Path, Run, Run],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A database behind the library: runs says to migrate; migrate --status lists what is due."""
    db, _, _ = populated
    with_second_migration(monkeypatch)
    before = db.read_bytes()
    assert_one_line_error(
        run_cli(capsys, "runs", "--url", str(db)),
        f"pending migrations: {NEXT_VERSION} (add leases)",
        f"'control-store migrate --url {db}'",
        f"release whose newest migration is {SHIPPED[-1][0]}",
    )
    code, out, _ = run_cli(capsys, "migrate", "--status", "--url", str(db))
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:]]
    for row, (version, description) in zip(rows, SHIPPED, strict=False):
        words = description.split()
        assert row[: 2 + len(words)] == [str(version), *words, "applied"]
    assert rows[len(SHIPPED) :] == [[str(NEXT_VERSION), "add", "leases", "pending"]]
    assert db.read_bytes() == before
    assert run_cli(capsys, "migrate", "--url", str(db))[0] == 0
    assert run_cli(capsys, "runs", "--url", str(db))[0] == 0


# ---------------------------------------------------------------------------------------------
# Output details


def test_bar_falls_back_to_ascii_off_unicode_streams() -> None:
    """The progress bar uses block characters on UTF-8 streams and # and - elsewhere."""
    ascii_stream = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    utf8_stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    assert cli.Terminal.of(ascii_stream).bar(1, 2, 4) == "##--"
    assert cli.Terminal.of(utf8_stream).bar(3, 4, 4) == "███░"
    assert cli.Terminal.of(utf8_stream).bar(0, 0, 2) == "██"  # a run with no jobs is complete


def _snapshot(recorded: int, elapsed: float) -> demo.Snapshot:
    return demo.Snapshot(recorded + 1, recorded, 1, 0, 0, elapsed)


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    """On a terminal each update rewrites the line in place; finish ends it."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=True, unicode=True, color=False, width=200)
    progress = cli._Progress(term, jobs=10, runs=2, enabled=True)
    progress.update(_snapshot(3, 0.1))
    progress.update(_snapshot(7, 0.2))
    progress.finish()
    text = stream.getvalue()
    assert text.count("\r\x1b[K") == 2
    assert text.endswith(" 7/10 jobs recorded  runs done 0/2  duplicates absorbed 1  35 jobs/s\n")


def test_progress_counts_runs_as_it_counts_jobs() -> None:
    """The progress line writes run counts with the separators of its job counts."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=False, unicode=True, color=False, width=200)
    progress = cli._Progress(term, jobs=16_000, runs=8_000, enabled=True)
    progress.update(demo.Snapshot(1_235, 1_234, 1, 0, 1_001, 1.0))
    progress.finish()
    assert " 1,234/16,000 jobs recorded  runs done 1,001/8,000  " in stream.getvalue()


def test_progress_fits_a_terminal_narrower_than_the_tables_floor() -> None:
    """Tables are laid out to at least 60 columns; the progress line, rewritten in place, is
    cut to the terminal's own width: a line that wrapped left a row behind at every update."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=True, unicode=True, color=False, width=60, columns=20)
    progress = cli._Progress(term, jobs=10, runs=2, enabled=True)
    progress.update(_snapshot(3, 0.1))
    progress.update(_snapshot(7, 0.2))
    drawn = stream.getvalue().split("\r\x1b[K")[1:]
    assert len(drawn) == 2
    assert all(cli._columns(line) == 19 and line.endswith("…") for line in drawn), drawn


def test_only_a_runs_table_paints_its_status_column() -> None:
    """On a colour terminal a runs table's STATUS is in colour; show's per-model table, whose
    second column is a count, is printed as it is (it was wrapped in reset codes)."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=True, unicode=True, color=True, width=100)
    cli._table(term, ["MODEL", "DONE"], [["atlas", "50"], ["done", "done"]])
    body = stream.getvalue().splitlines()[1:]
    assert body == ["atlas  50", "done   done"]
    stream.seek(0)
    stream.truncate()
    cli._table(term, ["RUN ID", "STATUS", "AGE"], [["r1", "done", "1s"]], status=1)
    assert stream.getvalue().splitlines()[1] == "r1      \x1b[32mdone  \x1b[0m  1s"


def test_progress_on_a_dumb_terminal_covers_the_last_line_with_spaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TERM=dumb takes no escape sequence, ESC[K included: each update returns to the start
    of the line and covers what is left of the longer line before with spaces."""
    monkeypatch.setenv("TERM", "dumb")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    term = cli.Terminal.of(stream)
    assert (term.dumb, term.color) == (True, False)
    progress = cli._Progress(term, jobs=1000, runs=2, enabled=True)
    progress.update(demo.Snapshot(1001, 1000, 1, 0, 0, 0.1))  # 10,000 jobs/s
    progress.update(demo.Snapshot(1001, 1000, 1, 0, 0, 100.0))  # 10 jobs/s: a shorter line
    progress.finish()
    text = stream.getvalue()
    assert "\x1b" not in text
    first, second = text.rstrip("\n").split("\r")[1:]
    assert second.endswith("10 jobs/s" + " " * (len(first) - len(second.rstrip(" "))))
    assert len(second) == len(first)


@pytest.mark.parametrize(
    ("no_color", "color"), [(None, True), ("", True), ("1", False), ("0", False)]
)
def test_colour_on_a_terminal_unless_no_color_is_set_and_not_empty(
    monkeypatch: pytest.MonkeyPatch, no_color: str | None, color: bool
) -> None:
    """no-color.org: NO_COLOR set to any value but the empty string turns colour off (an empty
    one is how a shell unsets it for one command, ``NO_COLOR= control-store runs``)."""
    monkeypatch.setenv("TERM", "xterm")
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = cli.Terminal.of(Tty())
    assert term.color is color
    assert ("\x1b[" in term.paint("done", "32")) is color


def test_progress_prints_plain_lines_at_most_each_second_off_a_terminal() -> None:
    """Off a terminal progress is plain lines, no carriage returns, about one per second."""
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=False, unicode=False, color=False, width=200)
    progress = cli._Progress(term, jobs=10, runs=2, enabled=True)
    for recorded, elapsed in [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.1)]:
        progress.update(_snapshot(recorded, elapsed))
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert [line.split()[1] for line in lines] == ["2/10", "4/10"]


def _into_closed_pipe(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m control_store argv`` writing its output into a pipe nobody reads."""
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails with EPIPE
    try:
        return subprocess.run(
            [sys.executable, "-m", "control_store", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=_clean_env(),
            check=False,
        )
    finally:
        os.close(write)


def test_broken_pipe_exits_quietly(populated: tuple[Path, Run, Run]) -> None:
    """A reader that went away (runs | head) stops the command without a traceback."""
    path, _, _ = populated
    for argv in (["runs"], ["--version"], ["--help"]):
        done = _into_closed_pipe(*argv, "--url", str(path))
        assert done.returncode == 1
        assert done.stderr == ""


@pytest.mark.parametrize("json_output", [False, True])
def test_a_migrate_whose_reader_is_gone_says_the_migrate_succeeded(
    tmp_path: Path, json_output: bool
) -> None:
    """migrate | true: the migrations are applied, the output cannot be written (exit 1). Not a
    read command, so not quiet: the line says the migrate succeeded, as it does on a full disk
    (it said nothing, and exit 1 read as a migrate that failed)."""
    path = tmp_path / "new.db"
    done = _into_closed_pipe("migrate", "--url", str(path), *(["--json"] if json_output else []))
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("control-store: error: cannot write to standard output"), line
    assert line.endswith(f"; the migrate succeeded: database is at migration {SHIPPED[-1][0]}")


def test_json_cut_short_by_its_reader_is_no_success(tmp_path: Path) -> None:
    """JSON larger than a pipe holds, its reader gone after 100 bytes: exit 1, not 0. Written
    in one piece, the write cut short lost the rest without an error, and a script trusting
    exit 0 got a fragment of JSON."""
    path = tmp_path / "many.db"

    async def many() -> None:
        async with Store.connect(path) as store:
            for _ in range(300):
                await store.insert_run(Run("m" * 200, ["a"], 1, 1))

    asyncio.run(many())
    child = subprocess.Popen(
        [sys.executable, "-m", "control_store", "runs", "--all", "--json", "--url", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_clean_env(),
    )
    assert child.stdout is not None
    assert child.stderr is not None
    assert len(child.stdout.read(100)) == 100
    child.stdout.close()  # the reader goes away with the child's write under way
    assert child.wait(timeout=60) == 1
    assert child.stderr.read() == b""
    child.stderr.close()


_SIGNAL_WHILE_STARTING = """
import os, signal, sys
from control_store import _launch

url, signum, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class SignalAtImport:
    # Sends the signal as the command's own module starts to load: the ~0.2 s of imports
    # (asyncio, sqlite3, msgspec) a Ctrl-C at the prompt lands in.
    def find_spec(self, name, path, target=None):
        if name == "control_store.cli":
            os.kill(os.getpid(), signum)
        return None

if how == "ignored":
    signal.signal(signum, signal.SIG_IGN)
sys.meta_path.insert(0, SignalAtImport())
sys.argv = ["control-store", "migrate", "--url", url]
sys.exit(_launch.main())
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_the_command_starts_is_one_line(tmp_path: Path, signum: int) -> None:
    """Ctrl-C, SIGTERM or SIGHUP while the command is still importing: one line and the exit
    code of a stopped command (Python printed a KeyboardInterrupt traceback, or died of the
    signal without a word), and nothing opened; a signal the caller ignores stays ignored."""
    path = tmp_path / "new.db"
    stopped = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_STARTING, str(path), str(int(signum)), "answered"],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )
    name = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
    assert (stopped.returncode, stopped.stdout) == (128 + signum, "")
    assert stopped.stderr == f"control-store: interrupted{name} while starting; nothing was done\n"
    assert not path.exists()
    ignored = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_STARTING, str(path), str(int(signum)), "ignored"],
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
    )
    assert ignored.returncode == 0, ignored.stderr
    assert "database is at migration" in ignored.stdout


def test_the_command_is_launched_by_the_module_that_answers_signals_first() -> None:
    """The control-store script and python -m control_store both start at _launch.main, which
    answers stop signals before the command's imports (which importing it does not make: see
    test_public_api's test of a light import)."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="control-store")
    assert script.value == "control_store._launch:main"  # as installed
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    if pyproject.exists():  # a checkout (the packaging session runs the tests without one)
        declared = tomllib.loads(pyproject.read_text())["project"]["scripts"]
        assert declared == {"control-store": "control_store._launch:main"}
    main_module = Path(cli.__file__).with_name("__main__.py").read_text()
    assert "from control_store._launch import main" in main_module


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_ends_a_command_whose_reader_stalls(tmp_path: Path, signum: int) -> None:
    """Output blocked on a full pipe whose reader stalls (ssh, a paused consumer): a stop signal
    still ends the command at once, as documented, with its line and 128 + signum. asyncio's
    handler only wakes the loop, which a blocked write(2) never returns to: the signal waited for
    as long as the reader stalled, and was lost when the reader then went away (exit 1)."""
    path = tmp_path / "big.db"

    async def fill() -> None:
        async with Store.connect(path) as store:
            await store.insert_run(Run("m" * 300_000, ["a"], 1, 1))  # more than a pipe holds

    asyncio.run(fill())
    read, write = os.pipe()  # never read until the child has ended
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "control_store", "runs", "--url", str(path)],
            stdout=write,
            stderr=subprocess.PIPE,
            env=_clean_env(),
        )
        os.close(write)
        deadline = time.monotonic() + 60
        while int.from_bytes(fcntl.ioctl(read, termios.FIONREAD, bytes(4)), sys.byteorder) < 60_000:
            assert time.monotonic() < deadline, "the child never filled the pipe"
            time.sleep(0.05)
        time.sleep(0.3)  # the child is blocked in write(2)
        child.send_signal(signum)
        try:
            _, err = child.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            pytest.fail(f"still running 10 s after {signal.Signals(signum).name}")
        assert child.returncode == 128 + signum, err
        (line,) = err.decode().splitlines()
        assert line.startswith("control-store: interrupted")
    finally:
        os.close(read)


def test_a_hot_rollback_journal_is_named_not_called_a_permission_problem(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """A file switched out of WAL mode (README's recipe for read-only media) whose writer died
    inside a transaction keeps a hot -journal, which a read-only connection may not roll back
    (SQLITE_READONLY_ROLLBACK). The read commands said "is read-only ... make the file, its
    -wal and -shm files and its directory writable ..., then retry", exit 3, of a writable file
    that no retry cures; they name the journal and the cure, exit 1, and change nothing."""
    db, _, _ = populated
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    crash = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA cache_size=1'); c.execute('BEGIN IMMEDIATE')\n"
        'c.execute("UPDATE runs SET manifest = manifest || zeroblob(100000)")\n'
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", crash, str(db)], check=True)
    assert Path(f"{db}-journal").exists()
    before = _digests(db.parent)
    for command in (["runs"], ["check"], ["migrate", "--status"]):
        assert_one_line_error(
            run_cli(capsys, *command, "--url", str(db)), "hot rollback journal", "for writing"
        )
    assert _digests(db.parent) == before


@pytest.mark.parametrize("unicode", [True, False], ids=["utf-8", "ascii"])
def test_show_cuts_an_error_to_the_width_as_the_stream_shows_it(
    tmp_path: Path, unicode: bool
) -> None:
    """show's most common errors fit the terminal on a stream that cannot encode them too: they
    were cut to the width before their characters became escapes, six columns each, so a line
    of CJK on an ASCII terminal of 80 columns took 211 and wrapped."""
    path = tmp_path / "errors.db"
    run = make_run(1)

    async def fill() -> None:
        async with Store.connect(path) as store:
            await store.insert_run(run)
            (job,) = make_jobs(run)
            await store.insert_jobs([job])
            await store.record_job_outcome(run.id, JobOutcome(job.id, error="漢" * 60))

    asyncio.run(fill())
    stream = io.StringIO()
    term = cli.Terminal(stream, tty=True, unicode=unicode, color=False, width=80, encoding="ascii")
    args = argparse.Namespace(url=str(path), run_id=run.id, json=False, open_stores=[])
    assert asyncio.run(cli.cmd_show(args, term)) == 0
    lines = stream.getvalue().splitlines()
    error = lines[lines.index("most common errors:") + 1]
    assert ("漢" in error) is unicode
    assert cli._columns(error) <= 80, error


def _shell(command: str, *argv: str) -> Result:
    """``python -m control_store argv`` run by sh with ``command``'s redirections: ``$@``."""
    done = subprocess.run(
        ["/bin/sh", "-c", command, "sh", sys.executable, "-m", "control_store", *argv],
        capture_output=True,
        text=True,
        env=_clean_env(),
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def test_a_usage_error_goes_to_stderr_only_with_its_argument_escaped() -> None:
    """argparse's own errors keep the CLI's rules: with stderr closed, the usage went to
    stdout (into a pipe meant for JSON); and an argument's terminal escapes reached the
    terminal raw, where every other error escapes them."""
    code, out, err = _shell('exec "$@" 2>&-', "runs", "--json", "--limit", "x")
    assert (code, out, err) == (cli.EXIT_USAGE, "", "")
    code, out, err = _shell('exec "$@"', "runs", "x\x1b]0;owned\x07\x1b[2J")
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert "\x1b" not in err
    assert err.splitlines()[-1] == (
        "control-store: error: unrecognized arguments: x\\x1b]0;owned\\x07\\x1b[2J"
    )


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        ("sqlite://x.db?busy_timeout=9", "give options as the command's own: --busy-timeout"),
        (":memory:", "for a file named ':memory:', give --url ./:memory: (sqlite::memory: is"),
        ("sqlite://:memory:", "give --url ./:memory:"),
        ("run:1.db", "or, if it names a file, give --url ./run:1.db"),
        ("sqlite://%FF.db", "or give the path itself as --url (a plain path is not decoded)"),
    ],
)
@pytest.mark.parametrize("command", ["runs", "check", "migrate", "demo"])
def test_a_url_refused_gives_the_fix_in_the_command_lines_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, url: str, fix: str, command: str
) -> None:
    """The library's own refusals of these URLs give a Python caller's fix (keyword arguments,
    pathlib, Store.in_memory()); the command line gives --url and --busy-timeout. Nothing is
    created."""
    with contextlib.chdir(tmp_path):
        result = run_cli(capsys, command, "--url", url)
    assert_one_line_error(result, fix)
    for python in ("Store.", "pathlib", "keyword argument", "Path.cwd"):
        assert python not in result[2]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("json_output", [False, True])
def test_a_migrate_whose_output_fails_says_the_migrate_succeeded(
    tmp_path: Path, json_output: bool
) -> None:
    """migrate with its output on a full disk: the error says the migrations were applied (it
    said only that stdout could not be written, which reads as the migrate failed)."""
    path = tmp_path / "new.db"
    argv = ["migrate", "--url", str(path), *(["--json"] if json_output else [])]
    code, _, err = _shell('exec "$@" > /dev/full', *argv)
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: cannot write to standard output"), line
    assert line.endswith(f"; the migrate succeeded: database is at migration {SHIPPED[-1][0]}"), (
        line
    )
    code, out, _ = _shell('exec "$@"', "migrate", "--url", str(path))
    assert (code, out) == (
        0,
        f"database is up to date (migration {SHIPPED[-1][0]}); nothing to apply\n",
    )


def test_closed_stdout_fails_in_one_line(populated: tuple[Path, Run, Run]) -> None:
    """Started with stdout closed (>&-), a command does nothing and says why, in one line."""
    path, _, _ = populated
    code, _, err = _shell('exec "$@" >&-', "runs", "--url", str(path))
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: standard output is closed")
    code, _, err = _shell('exec "$@" >&-', "--version")  # printed while parsing, not a command
    assert code == 1
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: standard output is closed")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_under_stdout_fails_in_one_line(populated: tuple[Path, Run, Run]) -> None:
    """Output to a full disk (/dev/full) is told in one line naming the error, exit 1."""
    path, _, _ = populated
    for argv in (["runs"], ["migrate", "--status", "--json"], ["--version"], ["demo", "--help"]):
        code, _, err = _shell('exec "$@" > /dev/full', *argv, "--url", str(path))
        assert code == 1
        (line,) = err.splitlines()
        assert line.startswith("control-store: error: cannot write to standard output")
        assert "No space left on device" in line


def test_demo_whose_reader_went_away_says_what_it_left(tmp_path: Path) -> None:
    """demo | head -1: the demo stops, exit 1, and says in one line why and what it left."""
    done = _into_closed_pipe("demo", *SMALL_DEMO, cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("control-store: error: cannot write to standard output")
    assert "the demo stopped" in line
    assert "it had submitted no runs" in line


# ---------------------------------------------------------------------------------------------
# As shipped: a real process, the console script, and the library's import path


async def _populate_unicode(path: Path) -> Run:
    """One run whose manifest, models and error message are not ASCII."""
    run = Run("évals/日本語.yaml", ["modèle-ñ", "モデル"], 1, 2)
    async with Store.connect(path) as store:
        await store.insert_run(run)
        jobs = make_jobs(run)
        await store.insert_jobs(jobs)
        await store.claim_next_run()
        await store.record_job_outcome(run.id, JobOutcome(jobs[0].id, error="délai dépassé ⏱"))
    return run


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_output_survives_a_stream_that_cannot_encode_the_data(
    tmp_path: Path, encoding: str
) -> None:
    """With PYTHONIOENCODING=ascii or latin-1, every command prints non-ASCII data (and a
    non-ASCII path) as escapes, and its JSON stays valid and decodes to the stored text."""
    path = tmp_path / "日本.db"
    run = asyncio.run(_populate_unicode(path))
    env = _clean_env() | {"PYTHONIOENCODING": encoding}

    def cli_output(*argv: str) -> tuple[int, str]:
        done = subprocess.run(
            [sys.executable, "-m", "control_store", *argv, "--url", str(path)],
            capture_output=True,
            env=env,
            check=False,
        )
        assert b"Traceback" not in done.stderr, done.stderr
        return done.returncode, done.stdout.decode(encoding)

    code, out = cli_output("runs")
    assert code == 0
    assert "\\u65e5" in out or "\\xe9" in out  # the manifest, escaped
    code, out = cli_output("runs", "--json")
    assert code == 0
    (shown,) = json.loads(out)
    assert (shown["manifest"], shown["models"]) == (run.manifest, run.models)
    code, out = cli_output("show", str(run.id))
    assert code == 0
    assert "d\\xe9lai" in out or "délai" in out
    code, out = cli_output("show", str(run.id), "--json")
    assert json.loads(out)["errors"] == [{"error": "délai dépassé ⏱", "count": 1}]
    code, out = cli_output("check")
    assert code == 0
    assert out.startswith("no problems found in ")


def _columns_before(line: str, text: str) -> int:
    """The terminal columns ``line`` takes before ``text``: two for a wide character, none for
    a combining one."""
    before = line[: line.index(text)]
    return sum(
        0
        if unicodedata.category(c) in ("Mn", "Me")
        else 2
        if unicodedata.east_asian_width(c) in "WF"
        else 1
        for c in before
    )


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_runs_aligns_wide_and_combining_characters_by_the_columns_they_take(
    tmp_path: Path, encoding: str
) -> None:
    """A manifest in CJK (two columns a character) or with a combining accent (none) keeps the
    next column in line, on a UTF-8 stream and on an ASCII one (where each is an escape)."""
    path = tmp_path / "wide.db"
    models = {
        "plain.yaml": "alpha",
        "日本語の評価.yaml": "beta",
        "e\u0301vals.yaml": "gamma",
        "ที่นี่.yaml": "delta",  # Thai vowel and tone marks: non-spacing, of combining class 0
    }

    async def populate() -> None:
        async with Store.connect(path) as store:
            for manifest, model in models.items():
                await store.insert_run(Run(manifest, [model], 1, 1))

    asyncio.run(populate())
    done = subprocess.run(
        [sys.executable, "-m", "control_store", "runs", "--url", str(path)],
        capture_output=True,
        env=_clean_env() | {"PYTHONIOENCODING": encoding},
        check=True,
    )
    header, *rows = done.stdout.decode(encoding).splitlines()
    assert len(rows) == 4
    newest_first = reversed(models.values())
    starts = {_columns_before(row, model) for row, model in zip(rows, newest_first, strict=True)}
    assert starts == {_columns_before(header, "MODELS")}


def test_clip_cuts_by_columns() -> None:
    """A cell cut to fit takes at most its width in columns, wide characters counted twice,
    marks none, and the ellipsis as wide as it is shown ("..." where "…" cannot be)."""
    assert cli._clip("日本語の評価", 7) == "日本語…"
    assert cli._clip("abcdef", 4) == "abc…"
    assert cli._clip("abcdefgh", 6, "...") == "abc..."
    assert cli._clip("e\u0301e\u0301e\u0301", 3) == "e\u0301e\u0301e\u0301"  # 3 columns
    assert cli._columns("ที่นี่") == 2  # two consonants, four marks
    assert cli._columns("हिंदी") == 4  # ह, ि and ी spacing (Mc), ं not (Mn), द


def test_python_dash_m_runs_the_command(populated: tuple[Path, Run, Run]) -> None:
    """python -m control_store is the CLI: JSON on stdout, exit 0; errors one line, exit 1."""
    path, older, _ = populated
    code, out, err = run_subprocess("show", str(older.id), "--json", "--url", str(path))
    assert (code, err) == (0, "")
    assert json.loads(out)["jobs"]["done"] == 3
    assert_one_line_error(run_subprocess("runs", "--url", str(path.parent / "missing.db")))


def test_console_script_is_installed(populated: tuple[Path, Run, Run]) -> None:
    """The control-store script next to this interpreter runs the CLI."""
    path, _, _ = populated
    script = Path(sys.executable).parent / "control-store"
    done = subprocess.run(
        [str(script), "check", "--url", str(path)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert "no problems found" in done.stdout


def test_importing_the_library_does_not_import_the_cli() -> None:
    """import control_store loads neither the CLI nor the demo (nor argparse for them)."""
    code = (
        "import sys, control_store; "
        "loaded = sorted(m for m in ('control_store.cli', 'control_store._demo') "
        "if m in sys.modules); print(loaded)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# The demo

SMALL_DEMO = [
    "--runs",
    "3",
    "--models",
    "2",
    "--samples",
    "10",
    "--epochs",
    "1",
    "--schedulers",
    "3",
    "--processes",
    "2",
    "--workers",
    "3",
    "--duplicate-rate",
    "0.3",
    "--death-rate",
    "0.3",
    "--latency-ms",
    "0.5",
    "--seed",
    "7",
]


@pytest.mark.slow
def test_small_demo_verifies_every_invariant(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A small demo in two OS processes passes every check, and the database agrees."""
    path = tmp_path / "demo.db"
    code, out, err = run_cli(
        capsys, "demo", *SMALL_DEMO, "--json", "--url", str(path), "--busy-timeout", "7"
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["ok"] is True
    assert report["config"]["busy_timeout"] == 7  # as given, not raised to the demo's default
    assert all(check["ok"] for check in report["checks"])
    assert len(report["checks"]) == 7
    assert report["recorded"] == 60
    assert report["duplicates_absorbed"] == report["deliveries"] - 60
    assert report["duplicates_absorbed"] > 0
    assert report["redispatched"] > 0

    async def inspect() -> None:
        async with Store.connect(path) as store:
            runs = await store.list_runs()
            assert {str(r.id) for r in runs} == set(report["runs"])
            assert all(r.status is RunStatus.DONE and r.done_count == 20 for r in runs)
            assert await store.check() == []

    asyncio.run(inspect())


@pytest.mark.slow
def test_demo_as_a_process_shows_progress_and_summary(tmp_path: Path) -> None:
    """python -m control_store demo, off a terminal: plain lines, a summary, every check passed."""
    code, out, err = run_subprocess("demo", *SMALL_DEMO, cwd=tmp_path)
    assert (code, err) == (0, "")
    assert "\r" not in out
    assert "verified against the database:" in out
    assert out.count("✓") == 7
    assert "✗" not in out
    assert (tmp_path / "control.db").exists()  # the default URL: a file in the current dir
    assert out.splitlines()[-1] == (
        "look inside: control-store runs   then   control-store show <RUN ID>"
    )


def test_commands_suggested_after_a_given_url_name_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With --url given, the commands a message suggests name it, quoted, so that pasted they
    look at that database and not at the default one."""
    path = tmp_path / "my demo.db"
    code, out, _ = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 0
    quoted = f"--url '{path}'"
    assert out.splitlines()[-1] == (
        f"look inside: control-store runs {quoted}   then   control-store show <RUN ID> {quoted}"
    )
    code, _, err = run_cli(capsys, "show", str(uuid.uuid4()), "--url", str(path))
    assert code == 1
    assert err.rstrip().endswith(f'list the runs with "control-store runs {quoted}"')


def test_demo_refuses_a_database_with_queued_runs(
    capsys: pytest.CaptureFixture[str], populated: tuple[Path, Run, Run]
) -> None:
    """The demo's schedulers would claim someone's queued run: it refuses, in one line."""
    path, _, newer = populated
    result = run_cli(capsys, "demo", "--url", str(path))
    assert_one_line_error(result, "queued runs", str(newer.id), "--url")
    assert len(_stored_runs(path)) == 2


def test_demo_refuses_a_database_another_demo_is_running_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Two demos on one file would claim each other's runs, and both could pass the queued-runs
    check before either submits: the second is refused by the first's lock, in one line naming
    its process, and submits nothing. Once the first has ended, its lock file is gone."""
    path = tmp_path / "shared.db"
    with demo.only_demo_on(str(path)):
        assert (tmp_path / "shared.db-demo.lock").read_text() == f"{os.getpid()}\n"
        result = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
        assert_one_line_error(
            result,
            f"another demo is running on {path} (process {os.getpid()})",
            "claim each other's runs",
            f"a new file: 'control-store demo --url {tmp_path / 'shared-demo.db'}'",
        )
        assert _stored_runs(path) == []
    assert not (tmp_path / "shared.db-demo.lock").exists()


def test_every_name_of_one_database_shares_the_demo_lock(tmp_path: Path) -> None:
    """A symlink to the database is the same database: its demo lock is the file's."""
    (tmp_path / "real.db").touch()
    (tmp_path / "alias.db").symlink_to(tmp_path / "real.db")
    with demo.only_demo_on(str(tmp_path / "real.db")):
        lock = demo.only_demo_on(str(tmp_path / "alias.db"))
        with pytest.raises(demo.DemoRunning):
            lock.__enter__()


def test_a_demo_that_cannot_make_its_lock_file_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A database name SQLite takes, but too long for "-demo.lock" beside it: one line naming
    the lock file, not a traceback."""
    path = tmp_path / ("x" * 243 + ".db")
    result = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert_one_line_error(result, "cannot make its lock file", "-demo.lock", "File name too long")
    assert _stored_runs(path) == []


def test_a_lock_file_left_by_a_killed_demo_blocks_no_demo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """flock's lock ends with its process, however it ended: the file a killed demo left (no
    one holding it) is taken over, and removed at the end."""
    path = tmp_path / "demo.db"
    (tmp_path / "demo.db-demo.lock").write_text("999999\n")
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 0, err
    assert not (tmp_path / "demo.db-demo.lock").exists()


@pytest.mark.parametrize("from_env", [False, True])
def test_demo_refuses_an_in_memory_database_as_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, from_env: bool
) -> None:
    """demo on sqlite::memory: (option or environment) exits 2 before starting anything, naming
    a file URL as the fix: each scheduler process would get its own empty database."""
    launched: list[object] = []
    monkeypatch.setattr(demo, "run_fleet", lambda *a: launched.append(a))
    if from_env:
        monkeypatch.setenv(cli.URL_ENV, "sqlite::memory:")
        argv = ["demo"]
    else:
        monkeypatch.delenv(cli.URL_ENV, raising=False)
        argv = ["demo", "--url", "sqlite::memory:"]
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: the demo cannot run on an in-memory database")
    assert "--url sqlite://demo.db" in line
    assert launched == []


def test_demo_exits_1_when_the_fleet_did_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet that recorded nothing fails the verification: exit 1, the failed checks named."""

    async def idle_fleet(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        reports = [demo.ProcessReport() for _ in range(config.processes)]
        return demo.FleetResult(_snapshot(0, 0.1), reports, [0] * config.processes)

    monkeypatch.setattr(demo, "run_fleet", idle_fleet)
    path = tmp_path / "idle.db"
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 1
    # The jobs recorded, and their rate: not those submitted, as if they had all been done.
    assert "\n0 of 60 jobs in 0.1 s: 0 jobs/s, 1 delivery," in out
    assert (
        "✗ every run claimed by exactly one scheduler: 3 claimed by no scheduler that reported"
        in out
    )
    assert err.splitlines() == [
        "control-store: error: demo invariant failed: every run claimed by exactly one "
        "scheduler; every run done with done_count == job count; every job recorded exactly once"
    ]


def _first_process_failed(config: demo.DemoConfig, report: demo.ProcessReport) -> demo.FleetResult:
    """A fleet whose first scheduler process exited 1 with ``report``, the others with nothing
    done, and nothing recorded."""
    reports = [report, *(demo.ProcessReport() for _ in range(config.processes - 1))]
    exit_codes: list[int | None] = [1]
    exit_codes += [0] * (config.processes - 1)
    return demo.FleetResult(_snapshot(0, 0.1), reports, exit_codes)


@pytest.mark.parametrize("retryable", [True, False])
def test_a_fleet_stopped_by_a_retryable_error_exits_3(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    retryable: bool,
) -> None:
    """A scheduler process that stopped on a ControlError a retry may cure (a lock held past
    --busy-timeout) fails the demo with exit 3, as any command failing so does; another, 1."""

    async def locked_fleet(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        error = "sqlite://x.db is locked: another connection held a lock on it"
        return _first_process_failed(config, demo.ProcessReport(error=error, retryable=retryable))

    monkeypatch.setattr(demo, "run_fleet", locked_fleet)
    path = tmp_path / "x.db"
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == (3 if retryable else 1)
    assert "✗ every scheduler process finished cleanly" in out
    assert "is locked" in out
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: demo invariant failed: every scheduler process")
    # The demo's runs are queued, so a retry on this file would be refused: it names another.
    retry = f"run the demo again on a new file, 'control-store demo --url {tmp_path / 'x-demo.db'}'"
    assert (retry in line) == retryable


def test_a_failed_fleet_queues_again_the_runs_its_schedulers_held(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler process that died on an error left its claimed run 'running': the demo
    verifies the database as it was (the run is not done), then queues it again."""

    async def dying_fleet(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        async with Store.connect(config.url) as scheduler:
            claimed = await scheduler.claim_next_run()
        assert claimed is not None
        report = demo.ProcessReport(claimed=[str(claimed.id)], error="it died")
        return _first_process_failed(config, report)

    monkeypatch.setattr(demo, "run_fleet", dying_fleet)
    path = tmp_path / "died.db"
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 1
    assert "✗ every run done with done_count == job count" in out
    assert _run_statuses(path) == {"queued": 3}
    # Its line says so, as a stopped demo's does (it said nothing of the held runs).
    (line,) = err.splitlines()
    assert "demo invariant failed: every scheduler process" in line
    assert "(the run its schedulers held was queued again)" in line

    async def failing(store: Store, runs: list[Run]) -> int:
        raise StorageError("disk I/O error")

    monkeypatch.setattr(demo, "requeue_stranded", failing)
    path = tmp_path / "stuck.db"
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 1
    (line,) = err.splitlines()
    assert "; the runs its schedulers held stay 'running': queueing them again failed" in line
    assert "README's recipe for runs a killed scheduler left" in line
    assert f"control-store runs --status running --all --url {path}" in line
    assert _run_statuses(path) == {"queued": 2, "running": 1}

    # Schedulers that failed before claiming any run (another connection's write lock held
    # past --busy-timeout), and the give-back failing on that lock too: the line said the runs
    # they held stay 'running', with the recipe for them, when they held none.
    async def idle_fleet(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        return _first_process_failed(config, demo.ProcessReport(error="is locked"))

    monkeypatch.setattr(demo, "run_fleet", idle_fleet)
    path = tmp_path / "idle.db"
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 1
    (line,) = err.splitlines()
    assert "demo invariant failed: every scheduler process" in line
    assert "stay 'running'" not in line
    assert "README's recipe" not in line
    assert _run_statuses(path) == {"queued": 3}


async def test_a_scheduler_dispatches_a_run_a_page_at_a_time(store: Store) -> None:
    """Ten jobs to do in pages of 3, the last page short: every job not yet done is recorded
    once, the jobs done before are not dispatched again, and a job whose worker died goes out
    again."""
    config = demo.DemoConfig(
        url="unused", runs=1, models=1, samples=12, epochs=1, latency_ms=0.0, death_rate=0.3
    )
    (run,) = await demo.submit(store, config)
    jobs = await store.list_jobs(run.id)
    for job in jobs[2:4]:  # recorded before this scheduler claims the run
        assert await store.record_job_outcome(run.id, demo.pseudo_outcome(job, 1, 0.0))
    tally = demo._Tally(multiprocessing.RawArray("q", demo.COUNTERS))

    await demo._dispatch(store, run, config, random.Random(0), tally, page_size=3)

    assert sorted(tally.first_deliveries) == sorted(str(j.id) for j in jobs[:2] + jobs[4:])
    assert tally.counters[demo.REDISPATCHED] > 0  # the seed makes some workers die
    stored = await store.get_run(run.id)
    assert stored is not None
    assert stored.done_count == stored.job_count == 12
    assert await store.check() == []


# The verifier itself must be able to fail: a fleet's report is built by hand here, over a
# database written directly, then one fact at a time is made false.

VERIFY_CONFIG = demo.DemoConfig(
    url="unused", runs=1, models=1, samples=3, epochs=1, processes=1, schedulers=1
)


async def _recorded_fleet(store: Store) -> tuple[list[Run], demo.FleetResult]:
    """One run of three jobs recorded through the store, one of them delivered twice."""
    runs = await demo.submit(store, VERIFY_CONFIG)
    (run,) = runs
    assert await store.claim_next_run() == msgspec.structs.replace(run, status=RunStatus.RUNNING)
    jobs = await store.list_jobs(run.id)
    for job in jobs:
        assert await store.record_job_outcome(run.id, demo.pseudo_outcome(job, 1, 0.02))
    assert not await store.record_job_outcome(run.id, demo.pseudo_outcome(jobs[0], 2, 0.02))
    report = demo.ProcessReport([str(run.id)], [str(job.id) for job in jobs])
    return runs, demo.FleetResult(demo.Snapshot(4, 3, 1, 1, 1, 0.1), [report], [0])


async def test_verify_passes_a_faithful_fleet(store: Store) -> None:
    """Every check passes when the reports and the database agree."""
    runs, result = await _recorded_fleet(store)
    checks = await demo.verify(store, VERIFY_CONFIG, runs, result)
    assert [c.name for c in checks if not c.ok] == []


@pytest.mark.parametrize(
    ("tamper", "failed"),
    [
        ("process-failed", "every scheduler process finished cleanly"),
        ("claimed-twice", "every run claimed by exactly one scheduler"),
        ("recorded-twice", "every job recorded exactly once"),
        ("first-delivery-unreported", "every job recorded exactly once"),
        ("job-undone", "every job recorded exactly once"),
        ("job-deleted", "every job recorded exactly once"),
        ("miscounted-duplicates", "every duplicate absorbed"),
        ("second-delivery-stored", "first delivery kept for every job"),
        ("job-undone", "store.check() finds no problems"),
    ],
)
async def test_verify_catches_each_broken_invariant(
    db_path: Path, tamper: str, failed: str
) -> None:
    """Each invariant, made false in the reports or the database, is reported as failed."""
    async with Store.connect(db_path) as store:
        runs, result = await _recorded_fleet(store)
        report = result.reports[0]
        (job, *_) = await store.list_jobs(runs[0].id)
        if tamper == "process-failed":
            result.exit_codes[0] = 1
        elif tamper == "claimed-twice":
            result.reports.append(demo.ProcessReport(claimed=report.claimed))
            result.exit_codes.append(0)
        elif tamper == "recorded-twice":
            twice = [*report.first_deliveries, report.first_deliveries[0]]
            result.reports[0] = demo.ProcessReport(report.claimed, twice)
        elif tamper == "first-delivery-unreported":
            result.reports[0] = demo.ProcessReport(report.claimed, report.first_deliveries[1:])
        elif tamper == "job-deleted":
            with contextlib.closing(sqlite3.connect(db_path)) as conn, conn:
                conn.execute("DELETE FROM jobs WHERE id = ?", (str(job.id),))
        elif tamper == "miscounted-duplicates":
            result.snapshot = demo.Snapshot(4, 3, 0, 1, 1, 0.1)
        elif tamper == "second-delivery-stored":
            later = msgspec.json.encode(demo.pseudo_outcome(job, 2, 0.02)).decode()
            with (
                contextlib.closing(sqlite3.connect(db_path)) as conn,
                conn,
            ):  # behind the store's back
                conn.execute("UPDATE jobs SET outcome = ? WHERE id = ?", (later, str(job.id)))
        else:
            with contextlib.closing(sqlite3.connect(db_path)) as conn, conn:
                conn.execute("UPDATE jobs SET status = 'queued' WHERE id = ?", (str(job.id),))
        checks = await demo.verify(store, VERIFY_CONFIG, runs, result)
    assert failed in [c.name for c in checks if not c.ok]


def test_interrupted_demo_exits_130_with_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the demo: exit 130, one line saying where its unfinished runs stay."""

    async def interrupted(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        async with Store.connect(config.url) as scheduler:  # a scheduler that claims, then dies
            assert await scheduler.claim_next_run() is not None
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_fleet", interrupted)
    path = tmp_path / "demo.db"
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 130
    (line,) = err.splitlines()
    assert line.startswith("control-store: interrupted after ")
    assert f"unfinished runs stay in {path} (the run its schedulers held was queued again)" in line
    assert "another --url" in line
    assert _run_statuses(path) == {"queued": 3}  # none left 'running' with nobody on it


def test_a_stop_that_reaches_the_demo_after_its_schedulers_queues_their_runs_again(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop sent to the whole process group ends the schedulers first: the fleet returns
    (their exit codes the signal's) before the stop reaches the demo, which it does while the
    demo verifies. The line said its runs "had all finished", and the run a scheduler held
    stayed 'running'; it is queued again, and the line says so (seen once in a full run of the
    suite, in test_a_demo_stopped_with_its_process_group_queues_its_runs_again)."""

    async def killed_by_the_group_stop(
        config: demo.DemoConfig, on_progress: object
    ) -> demo.FleetResult:
        async with Store.connect(config.url) as scheduler:  # claims, then the signal ends it
            assert await scheduler.claim_next_run() is not None
        reports = [demo.ProcessReport() for _ in range(config.processes)]
        codes: list[int | None] = [-signal.SIGTERM] * config.processes
        return demo.FleetResult(_snapshot(0, 0.1), reports, codes)

    async def stopped_while_verifying(*args: object) -> list[demo.Check]:
        raise KeyboardInterrupt  # the stop, reaching the demo now

    monkeypatch.setattr(demo, "run_fleet", killed_by_the_group_stop)
    monkeypatch.setattr(demo, "verify", stopped_while_verifying)
    path = tmp_path / "demo.db"
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 130
    (line,) = err.splitlines()
    assert "had all finished" not in line
    assert f"unfinished runs stay in {path} (the run its schedulers held was queued again)" in line
    assert _run_statuses(path) == {"queued": 3}


def test_a_demo_whose_processes_cannot_start_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler processes cannot be started (too many open files, a read-only /dev/shm):
    one line saying so, what would help, and what the demo left; exit 1, no traceback, and no
    run left 'running' by a scheduler that got as far as a claim."""

    async def no_processes(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        async with Store.connect(config.url) as scheduler:
            assert await scheduler.claim_next_run() is not None
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(demo, "run_fleet", no_processes)
    path = tmp_path / "demo.db"
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == cli.EXIT_FAILURE
    (line,) = err.splitlines()
    assert line.startswith(
        "control-store: error: the demo's scheduler processes could not be started or watched "
        "([Errno 24] Too many open files); with fewer --processes"
    ), line
    assert f"so the demo stopped; its unfinished runs stay in {path}" in line
    assert _run_statuses(path) == {"queued": 3}


def test_a_stopped_demo_ends_its_progress_line_before_its_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal the progress line is ended before the stop's line is written: the error
    was glued to the end of the progress bar ("... 595 jobs/scontrol-store: interrupted")."""

    async def failing_fleet(
        config: demo.DemoConfig, on_progress: Callable[[demo.Snapshot], None]
    ) -> demo.FleetResult:
        on_progress(_snapshot(3, 0.5))
        raise OSError(errno.EMFILE, "Too many open files")

    def as_terminal(stream: Any) -> cli.Terminal:
        return cli.Terminal(stream, tty=True, unicode=True, color=False, width=100)

    monkeypatch.setattr(demo, "run_fleet", failing_fleet)
    monkeypatch.setattr(cli.Terminal, "of", as_terminal)
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(tmp_path / "demo.db"))
    assert code == cli.EXIT_FAILURE
    assert "\r\x1b[K" in out  # the progress line was drawn
    assert out.endswith(" jobs/s\n"), out[-80:]
    assert err.startswith("control-store: error: the demo's scheduler processes could not")


def test_the_demo_hands_each_runs_jobs_to_the_store_as_a_collection() -> None:
    """A run's jobs in the demo are a collection (the store reads anything else as one-shot,
    and would tell the operator to make a generator again): its length is the run's
    job_count, it makes the same specs each time it is read, and holds a job by its run and
    spec."""
    config = demo.DemoConfig(url="sqlite::memory:", runs=2, models=2, samples=3, epochs=2)
    for run, jobs in demo.make_runs(config):
        assert isinstance(jobs, collections.abc.Collection)
        first, again = list(jobs), list(jobs)
        assert len(jobs) == len(first) == run.job_count == 12
        assert [job.spec for job in first] == [job.spec for job in again]
        assert first[5] in jobs
        assert msgspec.structs.replace(first[5], run_id=uuid.uuid4()) not in jobs
        spec = msgspec.structs.replace(first[5].spec, epoch=2)
        assert msgspec.structs.replace(first[5], spec=spec) not in jobs


def test_a_demo_whose_submission_fails_says_what_it_wrote(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The store refuses a write while the demo writes its runs (here a trigger, as a full disk
    or a lock held past --busy-timeout would): the error, then what the file now holds and what
    the next demo needs, in one line; nothing of the library's advice to a caller about a
    consumed generator, which an operator cannot act on."""
    path = tmp_path / "demo.db"
    code, _, _ = run_cli(capsys, "migrate", "--url", str(path))
    assert code == 0
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        # The second run's third job is refused: SMALL_DEMO's runs have 20 jobs each.
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON jobs WHEN (SELECT count(*) FROM jobs) >= 22 "
            "BEGIN SELECT RAISE(ABORT, 'refused for the test'); END"
        )
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == cli.EXIT_FAILURE
    (line,) = err.splitlines()
    assert line.startswith(f"control-store: error: database '{path}' refused the write"), line
    assert "refused for the test" in line
    assert "so the demo stopped; it had written 1 of its 3 runs with their jobs" in line
    assert "without its jobs" in line
    assert "another --url" in line
    assert "one-shot" not in line
    assert "generator" not in line
    assert _run_statuses(path) == {"queued": 2}


def test_the_resource_tracker_is_not_started_where_there_is_no_sighup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows has no SIGHUP (nor multiprocessing's resource tracker): the demo's early start
    of the tracker is skipped there, not an AttributeError before any scheduler starts."""
    monkeypatch.delattr(signal, "SIGHUP")
    started: list[bool] = []
    monkeypatch.setattr(
        "multiprocessing.resource_tracker.ensure_running", lambda: started.append(True)
    )
    demo._start_resource_tracker()
    assert started == []


def _run_statuses(path: Path) -> dict[str, int]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall()
    return dict(rows)


def test_a_demo_that_cannot_requeue_its_runs_says_what_to_do(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped, the demo queues its held runs again; if that fails, its one line says so and
    how to find them, and the stop is still the error told."""

    async def interrupted(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        async with Store.connect(config.url) as scheduler:
            assert await scheduler.claim_next_run() is not None
        raise KeyboardInterrupt

    async def refused(store: Store, runs: object) -> int:
        raise DatabaseBusyError("the file is locked")

    monkeypatch.setattr(demo, "run_fleet", interrupted)
    monkeypatch.setattr(demo, "requeue_stranded", refused)
    path = tmp_path / "demo.db"
    code, _, err = run_cli(capsys, "demo", *SMALL_DEMO, "--url", str(path))
    assert code == 130
    (line,) = err.splitlines()
    assert (
        f"its unfinished runs stay in {path}, and those its schedulers held stay 'running': "
        "queueing them again failed (the file is locked); queue them again with the UPDATE of "
        "README's recipe for runs a killed scheduler left (find them with 'control-store runs "
        f"--status running --all --url {path}'); a later demo refuses that file"
    ) in line
    assert _run_statuses(path) == {"queued": 2, "running": 1}


def test_a_demo_whose_requeue_meets_a_held_lock_tells_no_retry_of_a_generator(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requeue's own error, as the store gives it (another connection holds the write lock
    past --busy-timeout), is told to a user who never passed release_runs anything: it must
    not say to make a generator again, as release_runs says to a caller whose generator it
    consumed."""
    path = tmp_path / "demo.db"
    holder = sqlite3.connect(path, isolation_level=None)

    async def interrupted(config: demo.DemoConfig, on_progress: object) -> demo.FleetResult:
        async with Store.connect(config.url) as scheduler:
            assert await scheduler.claim_next_run() is not None
        holder.execute("BEGIN IMMEDIATE")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_fleet", interrupted)
    try:
        code, _, err = run_cli(
            capsys, "demo", *SMALL_DEMO, "--url", str(path), "--busy-timeout", "0.05"
        )
    finally:
        holder.close()
    assert code == 130
    (line,) = err.splitlines()
    assert "queueing them again failed (" in line
    assert "is locked" in line
    assert "generator" not in line
    assert "consumed" not in line
    assert _run_statuses(path) == {"queued": 2, "running": 1}


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (
            ["--samples", "100000000000"],
            [
                "--samples 100000000000",
                "8,000,000,000,000 jobs",
                "at most 1,000,000",
                "minutes of work",
            ],
        ),
        (
            ["--runs", "1000", "--models", "10", "--samples", "1000"],
            ["--runs 1000", "20,000,000 jobs", "at most 1,000,000", "lower --models, --samples"],
        ),
        (
            ["--schedulers", "64", "--processes", "33"],
            ["--processes 33", "limit of 32", "Python interpreter"],
        ),
        (["--schedulers", "1001"], ["--schedulers 1001", "limit of 1,000", "write lock"]),
        (["--workers", str(2**63 - 1)], [f"--workers {2**63 - 1}", "limit of 1,000", "start"]),
    ],
    ids=["samples", "product", "processes", "schedulers", "workers"],
)
def test_demo_refuses_sizes_that_cannot_be_a_demo(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    fragments: list[str],
) -> None:
    """A size whose work cannot be a demo exits 2 at once, in one line naming the option, its
    value, the limit and why; nothing is generated, no file is created."""

    def generated(*args: object) -> object:
        raise AssertionError("the demo generated jobs")

    monkeypatch.setattr(demo, "make_runs", generated)
    code, out, err = run_cli(capsys, "demo", *argv, "--url", str(tmp_path / "demo.db"))
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: ")
    for fragment in fragments:
        assert fragment in line
    assert list(tmp_path.iterdir()) == []


def test_demo_takes_sizes_up_to_its_limits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest sizes the limits allow pass the check (the fleet itself is stubbed out)."""
    submitted: list[demo.DemoConfig] = []

    async def submit(store: Store, config: demo.DemoConfig, *done: object) -> list[Run]:
        submitted.append(config)
        raise cli.Failure("stop here")

    monkeypatch.setattr(demo, "submit", submit)
    argv = ["--runs", "2", "--models", "5", "--samples", "50000", "--epochs", "2"]
    argv += ["--schedulers", "1000", "--processes", "32", "--workers", "1000"]
    path = tmp_path / "demo.db"
    code, _, err = run_cli(capsys, "demo", *argv, "--url", str(path))
    stopped = f"so the demo stopped; it had submitted no runs to {path}"
    assert (code, err) == (1, f"control-store: error: stop here; {stopped}\n")
    (config,) = submitted
    assert config.total_jobs == cli.MAX_DEMO_JOBS
    assert (config.processes, config.workers) == (32, demo.DISPATCH_PAGE)


def test_demo_out_of_memory_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MemoryError (a ulimit -v, a full machine) ends the demo with one line and exit 1,
    saying what it left in the database, not a traceback."""

    async def submit(*args: object) -> list[Run]:
        raise MemoryError

    monkeypatch.setattr(demo, "submit", submit)
    path = tmp_path / "demo.db"
    code, out, err = run_cli(capsys, "demo", *SMALL_DEMO, "--json", "--url", str(path))
    assert (code, out) == (1, "")
    (line,) = err.splitlines()
    assert line.startswith("control-store: error: out of memory after ")
    assert f"it had submitted no runs to {path}" in line
    assert "smaller sizes" in line


def test_demo_stopped_while_generating_jobs_exits_at_once_saying_what_it_wrote(
    tmp_path: Path,
) -> None:
    """SIGTERM while the demo generates a run's jobs (slowly here: 10 ms a job) stops it at
    once, not after the generation, exit 143, with one line that says what the database holds:
    the runs written with their jobs, and the run whose jobs were cut short without them.
    In a child process: a signal sent to the test runner itself could stop more than the demo."""
    path = tmp_path / "demo.db"
    per_run = 20_000  # the third run would take 200 s to generate: it must not be waited for
    argv = ["demo", "--url", str(path), "--runs", "3", "--models", "1", "--epochs", "1"]
    argv += ["--samples", str(per_run)]
    script = f"""
import sys, time
from control_store import _demo, cli
from control_store.models import EvalJob

made = 0

def slow_spec(*args):
    global made
    made += 1
    if made > {2 * per_run}:  # the third run's jobs: say so, then take 10 ms each
        if made == {2 * per_run + 1}:
            print("third run", flush=True)
        time.sleep(0.01)
    return EvalJob(*args)

_demo.EvalJob = slow_spec
sys.exit(cli.main({argv!r}))
"""
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    try:
        assert child.stdout is not None
        while (line := child.stdout.readline()) != "third run\n":
            assert line, "the demo ended before its third run"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 143, err
    (line,) = err.splitlines()
    assert line.startswith("control-store: interrupted by SIGTERM after ")
    assert "stopped while waiting" not in line  # the generation stopped; no forced exit
    with contextlib.closing(sqlite3.connect(path)) as conn:
        jobs = dict(
            conn.execute(
                "SELECT runs.id, count(jobs.id) FROM runs LEFT JOIN jobs ON jobs.run_id = runs.id"
                " GROUP BY runs.id"
            ).fetchall()
        )
    (empty,) = [run_id for run_id, count in jobs.items() if count == 0]
    assert sorted(jobs.values()) == [0, per_run, per_run]
    assert f"it had written 2 of its 3 runs with their jobs to {path}" in line
    assert f"and run {empty} without its jobs" in line
    assert "delete the file (and any -wal and -shm left beside it), or give the next" in line


def _wait_for(predicate: Callable[[], object], what: str) -> object:
    """Poll ``predicate`` until it is true, and return its value; a hang fails the test."""
    deadline = time.monotonic() + 60.0
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)
    return value


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The state letter and parent id of process ``pid``, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def _scheduler_processes(parent: int) -> list[int]:
    """The children of ``parent`` that multiprocessing spawned (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if stat is not None and stat[1] == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _started_runs(path: Path) -> int:
    """How many runs in ``path`` a scheduler claimed (0 while the file is not ready)."""
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=5.0)) as conn:
            (count,) = conn.execute("SELECT count(*) FROM runs WHERE status != 'queued'").fetchone()
    except sqlite3.Error:
        return 0
    return int(count)


def _kill_all(demo_process: subprocess.Popen[str], children: list[int]) -> None:
    """A test's clean-up: the demo and its scheduler processes gone, whatever the test did."""
    demo_process.kill()
    demo_process.wait()
    for pid in children:
        if not _ended(pid):
            os.kill(pid, signal.SIGKILL)


def _long_demo(path: Path, *, own_group: bool = False) -> subprocess.Popen[str]:
    """A demo of 200 runs on ``path``, far from done when a test stops it; ``own_group``: in
    a process group of its own, for a signal sent to the group."""
    return subprocess.Popen(
        [sys.executable, "-m", "control_store", "demo", "--url", str(path), "--runs", "200"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
        start_new_session=own_group,
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_demo_scheduler_processes_stop_with_their_parent(tmp_path: Path, signum: int) -> None:
    """SIGTERM, SIGHUP or SIGKILL to a running demo: its scheduler processes end too, instead
    of running on as orphans that claim runs; a caught signal is told in one line."""
    path = tmp_path / "demo.db"
    demo_process = _long_demo(path)
    children: list[int] = []
    try:
        _wait_for(lambda: _started_runs(path), "a scheduler to claim a run")
        children = _scheduler_processes(demo_process.pid)
        assert len(children) == 2
        demo_process.send_signal(signum)
        _, err = demo_process.communicate(timeout=60)
        if signum == signal.SIGKILL:
            assert demo_process.returncode == -signal.SIGKILL
        else:
            assert demo_process.returncode == 128 + signum
            (line,) = err.splitlines()
            assert line.startswith(f"control-store: interrupted by {signal.Signals(signum).name}")
        _wait_for(lambda: all(_ended(pid) for pid in children), "the scheduler processes to end")
        assert _started_runs(path) < 200  # they stopped claiming: runs are left queued
    finally:
        _kill_all(demo_process, children)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_demo_stopped_with_its_process_group_queues_its_runs_again(
    tmp_path: Path, signum: int
) -> None:
    """Ctrl-C, a SIGTERM or a closed terminal reach the whole process group, the schedulers
    and multiprocessing's resource tracker too: one line, the signal's exit code, and no run
    left 'running' with no scheduler."""
    path = tmp_path / "demo.db"
    demo_process = _long_demo(path, own_group=True)  # as a shell's job is
    try:
        _wait_for(lambda: _started_runs(path), "a scheduler to claim a run")
        os.killpg(demo_process.pid, signum)
        _, err = demo_process.communicate(timeout=60)
        assert demo_process.returncode == 128 + signum
        (line,) = err.splitlines()  # no warning or traceback from the resource tracker
        assert re.search(
            r"\(the (run its schedulers held was|[\d,]+ runs its schedulers held "
            r"were) queued again\)",
            line,
        ), line
        assert "running" not in _run_statuses(path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo_process.pid, signal.SIGKILL)
        demo_process.wait()


@pytest.mark.slow
def test_a_demo_started_under_nohup_goes_on_when_its_terminal_closes(tmp_path: Path) -> None:
    """A stop signal the caller ignored (nohup ignores SIGHUP; a script's background job,
    SIGINT) stays ignored: the closed terminal's SIGHUP to the whole group stops nothing, and
    the demo finishes and verifies as it would have (it stopped with exit 129 before)."""
    path = tmp_path / "demo.db"
    command = [sys.executable, "-m", "control_store", "demo", "--url", str(path), "--runs", "12"]
    demo_process = subprocess.Popen(
        ["/bin/sh", "-c", 'trap "" HUP; exec "$@"', "sh", *command],  # as nohup starts it
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
        start_new_session=True,
    )
    try:
        _wait_for(lambda: _started_runs(path), "a scheduler to claim a run")
        os.killpg(demo_process.pid, signal.SIGHUP)
        out, err = demo_process.communicate(timeout=120)
        assert (demo_process.returncode, err) == (0, ""), (out, err)
        assert "verified" in out, out
        assert set(_run_statuses(path)) == {"done"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo_process.pid, signal.SIGKILL)
        demo_process.wait()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_demo_started_with_sigterm_ignored_still_stops_its_schedulers(tmp_path: Path) -> None:
    """SIGTERM ignored where the demo started: its scheduler processes inherit that through
    exec, and the stop's terminate() of each did nothing (the demo hung in join()). They take
    SIGTERM back, so Ctrl-C stops the demo as ever."""
    path = tmp_path / "demo.db"
    command = [sys.executable, "-m", "control_store", "demo", "--url", str(path), "--runs", "200"]
    demo_process = subprocess.Popen(
        ["/bin/sh", "-c", 'trap "" TERM; exec "$@"', "sh", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    children: list[int] = []
    try:
        _wait_for(lambda: _started_runs(path), "a scheduler to claim a run")
        children = _scheduler_processes(demo_process.pid)
        assert children
        demo_process.send_signal(signal.SIGINT)
        _, err = demo_process.communicate(timeout=60)
        assert demo_process.returncode == 130, err
        (line,) = err.splitlines()
        assert line.startswith("control-store: interrupted after "), line
        _wait_for(lambda: all(_ended(pid) for pid in children), "the scheduler processes to end")
    finally:
        _kill_all(demo_process, children)


@pytest.mark.slow
def test_a_demo_whose_stop_is_stuck_on_a_lock_exits_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C while another process holds the write lock: the demo's clean-up waits on it,
    and STOP_GRACE_SECONDS later the demo ends at once (os._exit). Its stderr is the one line
    that says so: no warning from multiprocessing's resource tracker about what os._exit
    left (the counters' lock once was a named semaphore, "leaked" by such an exit)."""
    path = tmp_path / "demo.db"
    demo_process = _long_demo(path)
    try:
        _wait_for(lambda: _started_runs(path), "a scheduler to claim a run")
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as holder:
            holder.execute("BEGIN IMMEDIATE")
            demo_process.send_signal(signal.SIGINT)
            _, err = demo_process.communicate(timeout=60)
        assert demo_process.returncode == 130, err
        (line,) = err.splitlines()
        assert line.startswith("control-store: interrupted after "), line
        assert line.endswith("(stopped while waiting for the database)"), line
        assert "queueing them again did not finish" in line
    finally:
        demo_process.kill()
        demo_process.wait()


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone, or a zombie nobody reaped yet."""
    stat = _proc_stat(pid)
    return stat is None or stat[0] == "Z"


# A statement that runs for minutes unless interrupted: SQLite counts to 10**9.
ENDLESS_SQL = (
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000000) "
    "SELECT count(*) FROM n"
)


async def test_backend_interrupt_stops_the_running_statement(db_path: Path) -> None:
    """SqliteBackend.interrupt() from the event loop's thread makes the statement running on
    the worker thread fail at once, as a ControlError, and the store stays usable."""
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def endless(conn: sqlite3.Connection) -> object:
        loop.call_soon_threadsafe(started.set)
        return conn.execute(ENDLESS_SQL).fetchone()

    async with Store.connect(db_path) as store:
        backend = store._backend
        assert backend is not None
        call = asyncio.ensure_future(backend.read(endless))
        await started.wait()
        deadline = loop.time() + CALL_TIMEOUT
        while not call.done():  # an interrupt before the statement starts has no effect
            assert loop.time() < deadline, "the statement was not interrupted"
            backend.interrupt()
            await asyncio.sleep(0.01)
        with pytest.raises(ControlError, match="interrupted"):
            await call
        assert await store.list_runs() == []
    backend.interrupt()  # closed: nothing to interrupt, no error


def test_ctrl_c_interrupts_a_long_check(db_path: Path) -> None:
    """SIGINT during a long check interrupts its SQLite statement (not waiting for its end, nor
    for the grace before a forced exit) and exits 130 with one line. In a child process: a
    signal sent to the test runner itself could stop more than the command."""
    script = f"""
import sys
from control_store import _sqlite, cli

def endless_check(conn):
    print("started", flush=True)
    conn.execute({ENDLESS_SQL!r}).fetchone()
    return []

_sqlite.op_check = endless_check
sys.exit(cli.main(["check", "--url", {str(db_path)!r}]))
"""
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "started\n"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=CALL_TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err
    (line,) = err.splitlines()
    assert line.startswith("control-store: interrupted after ")
    assert "stopped while waiting" not in line  # the statement ended; no forced exit


def test_messages_never_show_a_password(capsys: pytest.CaptureFixture[str]) -> None:
    """A URL with credentials is shown with its password replaced."""
    result = run_cli(capsys, "runs", "--url", "postgres://ops:hunter2@db/control")
    assert_one_line_error(result, "ops:***@db")
    assert "hunter2" not in result[2]


def test_a_score_that_rounds_to_a_billion_is_shown_as_a_billion_is() -> None:
    """Scientific notation starts where three decimals would show a billion: a score just
    below it was shown as 1000000000.000, beside 1.000e+09 for a billion itself."""
    assert cli._score(999_999_999.9996) == cli._score(1e9) == "1.000e+09"
    assert cli._score(-999_999_999.9996) == "-1.000e+09"
    assert cli._score(999_999_999.9994) == "999999999.999"


class _NoDescriptors(importlib.abc.MetaPathFinder):
    """A finder failing the import of the demo's module as a process out of descriptors does."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "control_store._demo":
            raise OSError(errno.EMFILE, "Too many open files", "_demo.py")


def test_a_demo_whose_code_cannot_be_loaded_says_why_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo imports its module only when it runs: at the limit of open files that import
    failed with a traceback (OSError, exit 1). It is the store's refusal at that limit: one
    line, retryable (exit 3), with the fix; nothing is made."""
    import control_store

    monkeypatch.delitem(sys.modules, "control_store._demo", raising=False)
    monkeypatch.delattr(control_store, "_demo", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoDescriptors(), *sys.meta_path])
    db = tmp_path / "demo.db"
    code, out, err = run_cli(capsys, "demo", "--url", str(db), "--runs", "1", "--samples", "1")
    assert out == ""
    assert code == 3, err
    assert err.count("\n") == 1, err
    assert "Too many open files" in err
    assert "raise the limit of open files (ulimit -n)" in err
    assert not db.exists()


def test_runs_limit_past_a_page_is_read_a_page_at_a_time(
    capsys: pytest.CaptureFixture[str], db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runs --limit N past a page walks the runs as --all does (never list_runs, which holds
    them all: --limit 200000 took 296 MB where --all took 39 MB), with the same output: the
    newest N, and the note that more were left out only when some were."""
    runs = asyncio.run(_populate_many(db_path, 7))[::-1]
    for json_flag in ([], ["--json"]):
        for limit in (3, 7, 9):
            wanted = run_cli(
                capsys, "runs", *json_flag, "--limit", str(limit), "--url", str(db_path)
            )
            monkeypatch.setattr(cli, "RUNS_PAGE_SIZE", 2)

            async def no_whole_list(*args: Any, **kwargs: Any) -> list[Run]:
                raise AssertionError("runs --limit read every run at once")

            with monkeypatch.context() as patch:
                patch.setattr(Store, "list_runs", no_whole_list)
                got = run_cli(
                    capsys, "runs", *json_flag, "--limit", str(limit), "--url", str(db_path)
                )
            monkeypatch.setattr(cli, "RUNS_PAGE_SIZE", 1000)
            assert got[0] == wanted[0] == 0
            assert got[2] == wanted[2], (json_flag, limit)
            if json_flag:
                assert got[1] == wanted[1]
                assert [r["id"] for r in json.loads(got[1])] == [str(r.id) for r in runs[:limit]]
            else:
                ids = [
                    line.split()[0]
                    for line in got[1].splitlines()[1:]
                    if not line.startswith(("RUN", "("))
                ]
                assert ids == [str(r.id) for r in runs[:limit]]
                assert ("for more" in got[1]) == (limit < len(runs))
