"""Fixtures: a store per test, on every backend, from a migrated template."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from control_store import EvalJob, Job, Run, Store

BACKENDS = ["memory", "file"]


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database file migrated once; each file-backed test gets a copy of it."""
    path = tmp_path_factory.mktemp("template") / "template.db"

    async def migrate() -> None:
        store = await Store.connect(path)
        await store.close()  # the last close checkpoints the WAL into the file

    asyncio.run(migrate())
    return path


@pytest.fixture
def db_path(tmp_path: Path, template_db: Path) -> Path:
    """A fresh, migrated database file for this test."""
    path = tmp_path / "control.db"
    shutil.copyfile(template_db, path)
    return path


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, db_path: Path) -> AsyncIterator[Store]:
    """An open store, on each backend in turn; closed after the test."""
    if request.param == "memory":
        opened = await Store.in_memory()
    else:
        opened = await Store.connect(db_path)
    try:
        yield opened
    finally:
        await opened.close()


@contextlib.contextmanager
def raw_db(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain sqlite3 connection to ``path``: commits on success, and always closes.

    (``with sqlite3.connect(...)`` only commits; Python 3.13 warns about the unclosed handle.)
    """
    conn = sqlite3.connect(path)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


def make_run(job_count: int = 3, *, created_at: datetime | None = None) -> Run:
    """A queued run with ``job_count`` jobs over two models."""
    if created_at is None:
        return Run("suite.yaml", ["model-a", "model-b"], 1, job_count)
    return Run("suite.yaml", ["model-a", "model-b"], 1, job_count, created_at=created_at)


def make_jobs(run: Run, count: int | None = None) -> list[Job]:
    """``count`` (default: the run's job_count) jobs for ``run``."""
    n = run.job_count if count is None else count
    return [Job(run.id, EvalJob(run.models[i % len(run.models)], f"s{i}", 0)) for i in range(n)]
