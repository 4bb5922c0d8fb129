"""Fixtures: a store per test, on every backend, from a migrated template."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from control_store import EvalJob, Job, Run, Store, _migrate, _sqlite

from _loops import use_requested_loop

use_requested_loop()

# The command's stop signals stay ignored where its caller ignored them (nohup; a script's
# background job ignores SIGINT), and every child inherits an ignored signal: a suite started
# so would see its demos and checks go on through the signals its tests send. Caught here,
# they reach the children as the default.
for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_signum) is signal.SIG_IGN:
        signal.signal(
            _signum, signal.default_int_handler if _signum == signal.SIGINT else signal.SIG_DFL
        )

BACKENDS = ["memory", "file"]

# `nox -s stress` sets this: the same tests, at sizes too slow for every run.
STRESS = os.environ.get("CONTROL_STORE_STRESS") == "1"
WORKERS = Path(__file__).with_name("_workers.py")
# Only a guard against a hung child; no assertion depends on how long anything takes.
HANG_GUARD_SECONDS = 600


def sized(default: int, stress: int) -> int:
    """``default``, or ``stress`` under ``CONTROL_STORE_STRESS=1``."""
    return stress if STRESS else default


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


def held_by_no_connection(path: Path) -> bool:
    """Whether no connection (of this process or another) holds the database at ``path``:
    leaving WAL mode needs every other connection closed."""
    conn = sqlite3.connect(path, timeout=0)
    try:
        mode: tuple[str] = conn.execute("PRAGMA journal_mode = DELETE").fetchone()
    except sqlite3.OperationalError:  # "database is locked"
        return False
    finally:
        conn.close()
    return mode == ("delete",)


class FailingStatements:
    """A store's sqlite3 connection (put in place of ``_worker.raw``), its next statements
    starting with given words raising given errors: those in ``after`` once they ran (their
    rows written into the open transaction: a failing disk's error at the statement's end),
    those in ``before`` without running (a ROLLBACK that fails; a Ctrl-C before a COMMIT).
    Each error is raised once."""

    def __init__(
        self,
        raw: sqlite3.Connection,
        *,
        after: dict[str, BaseException] | None = None,
        before: dict[str, BaseException] | None = None,
    ) -> None:
        self._raw = raw
        self._after = dict(after or {})
        self._before = dict(before or {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    @staticmethod
    def _fail(sql: str, fails: dict[str, BaseException]) -> None:
        for words, error in list(fails.items()):
            if sql.lstrip().startswith(words):
                del fails[words]
                raise error

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self._fail(sql, self._before)
        cursor = self._raw.execute(sql, params)
        self._fail(sql, self._after)
        return cursor

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        self._fail(sql, self._before)
        cursor = self._raw.executemany(sql, rows)
        self._fail(sql, self._after)
        return cursor


@dataclasses.dataclass
class HeldStore:
    """A store connected on a loop run by hand, its worker thread held by a call (``held``)
    until ``hold`` is set: what is queued next waits behind it."""

    store: Store
    backend: _sqlite.SqliteBackend
    worker: threading.Thread
    hold: threading.Event
    held: asyncio.Task[None]


def held_store(loop: asyncio.AbstractEventLoop, path: Path) -> HeldStore:
    """A HeldStore on ``loop`` (not running) for the database at ``path``."""
    store = loop.run_until_complete(Store.connect(path))
    backend = store._backend
    assert backend is not None
    hold = threading.Event()

    async def hold_worker() -> None:
        await backend.read(lambda conn: hold.wait(CALL_TIMEOUT))

    held = loop.create_task(hold_worker())
    return HeldStore(store, backend, backend._conn._thread, hold, held)


@contextlib.asynccontextmanager
async def thread_held(backend: _sqlite.SqliteBackend) -> AsyncIterator[None]:
    """The store's thread kept busy until the block ends: calls made in it wait behind."""
    gate = threading.Event()
    occupied = _sqlite.on_thread(backend._conn, lambda: gate.wait(CALL_TIMEOUT))
    try:
        yield
    finally:
        gate.set()
    await occupied


def follow_advice(path: Path, told: BaseException | str, sql: str) -> None:
    """Run, on the database at ``path``, the statement an error's or a check() finding's
    message gives where the pattern ``sql`` (one group: the statement) finds it: a repair
    followed as written."""
    advice = re.search(sql, str(told))
    assert advice is not None, told
    with raw_db(path) as conn:
        conn.execute(advice[1])


def make_run(job_count: int = 3, *, created_at: datetime | None = None) -> Run:
    """A queued run with ``job_count`` jobs over two models."""
    if created_at is None:
        return Run("suite.yaml", ["model-a", "model-b"], 1, job_count)
    return Run("suite.yaml", ["model-a", "model-b"], 1, job_count, created_at=created_at)


def make_jobs(run: Run, count: int | None = None) -> list[Job]:
    """``count`` (default: the run's job_count) jobs for ``run``."""
    n = run.job_count if count is None else count
    return [Job(run.id, EvalJob(run.models[i % len(run.models)], f"s{i}", 0)) for i in range(n)]


async def stored_run(path: Path, job_count: int = 2) -> tuple[Run, list[Job]]:
    """A run and its ``job_count`` jobs, stored at ``path`` through a store that is closed
    again (for a test that then edits the file by hand)."""
    run = make_run(job_count=job_count)
    jobs = make_jobs(run)
    async with Store.connect(path) as store:
        await store.insert_run(run)
        await store.insert_jobs(jobs)
    return run, jobs


async def orphaned_jobs(path: Path) -> tuple[Run, list[Job]]:
    """A run of two jobs stored at ``path``, then its row deleted by hand (foreign keys off):
    jobs whose run is missing."""
    run, jobs = await stored_run(path)
    with raw_db(path) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("DELETE FROM runs")
    return run, jobs


@contextlib.asynccontextmanager
async def traced(store: Store) -> AsyncIterator[list[str]]:
    """Every statement the store's connection runs inside the block, in order (a trace
    callback on it, removed at the block's end)."""
    backend = store._backend
    assert backend is not None
    statements: list[str] = []
    await backend.read(lambda conn: conn.set_trace_callback(statements.append))
    try:
        yield statements
    finally:
        await backend.read(lambda conn: conn.set_trace_callback(None))


def query_plan(sql: str, params: tuple[object, ...]) -> list[str]:
    """EXPLAIN QUERY PLAN's lines for ``sql`` on the schema the shipped migrations make."""
    conn = sqlite3.connect(":memory:")
    try:
        for migration in _migrate.load_migrations("sqlite"):
            conn.executescript(migration.sql)
        return [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
    finally:
        conn.close()


async def group_in_flight(store: Store) -> asyncio.Future[None]:
    """A write that occupies the thread, so calls made now queue for the next group."""
    ahead = asyncio.ensure_future(store.insert_run(make_run()))
    await asyncio.sleep(0)
    return ahead


class Worker:
    """A child process running ``tests/_workers.py MODE ARGS``, read line by line."""

    def __init__(self, mode: str, *args: object) -> None:
        self.mode = mode
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS), mode, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def stop(self) -> None:
        """Kill the child if it still runs and close its pipes (test teardown)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=HANG_GUARD_SECONDS)

    def line(self) -> list[str]:
        """The next line the child printed, split into words; fails if the child ended."""
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(HANG_GUARD_SECONDS)
            assert self.proc.stderr is not None
            raise AssertionError(
                f"worker {self.mode} ended (status {self.proc.returncode}) before printing "
                f"what the test waited for:\n{self.proc.stderr.read()}"
            )
        self.lines.append(text)
        return text.split()

    def expect(self, word: str) -> list[str]:
        """Read lines until one starts with ``word``; return its words."""
        while True:
            words = self.line()
            if words and words[0] == word:
                return words

    def go(self) -> None:
        """Tell the child to take its next step."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> list[list[str]]:
        """kill -9 the child; return every line it printed, split into words."""
        os.kill(self.proc.pid, signal.SIGKILL)
        return self._drain(expect_status=-signal.SIGKILL)

    def finish(self) -> list[list[str]]:
        """Wait for the child to exit cleanly; return every line it printed, split into words."""
        return self._drain(expect_status=0)

    def _drain(self, *, expect_status: int) -> list[list[str]]:
        out, err = self.proc.communicate(timeout=HANG_GUARD_SECONDS)
        self.lines.extend(out.splitlines(keepends=True))
        # A child that finished on its own just before the kill is fine: what it printed counts.
        assert self.proc.returncode in (expect_status, 0), (
            f"worker {self.mode} exited with {self.proc.returncode}:\n{err}"
        )
        return [line.split() for line in self.lines]


@pytest.fixture
def spawn() -> Iterator[Callable[..., Worker]]:
    """Start workers; any still running when the test ends are killed."""
    started: list[Worker] = []

    def start(mode: str, *args: object) -> Worker:
        worker = Worker(mode, *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def acked(lines: list[list[str]], word: str = "ack") -> list[str]:
    """The ids on the lines that start with ``word``."""
    return [words[1] for words in lines if len(words) >= 2 and words[0] == word]


def integrity(path: Path) -> str:
    """SQLite's own integrity check of the file, read through a plain connection."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    return "; ".join(str(row[0]) for row in rows)


async def assert_sound(path: Path) -> None:
    """The file passes SQLite's integrity check, opens cleanly, and store.check() finds nothing."""
    assert integrity(path) == "ok"
    async with Store.connect(path) as store:
        assert await store.check() == []


@pytest.fixture(scope="session")
def permissions_obeyed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip unless a worker is refused writing a read-only file (it drops root's privileges)."""
    path = tmp_path_factory.mktemp("probe") / "read-only"
    path.touch(mode=0o444)
    path.chmod(0o444)
    done = subprocess.run(
        [sys.executable, str(WORKERS), "probe-permissions", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.stdout.split() != ["protected"]:
        pytest.skip(f"cannot run a process that obeys file permissions here: {done.stderr[-300:]}")


# The migrations the library ships, newest last, and the version a test's extra one takes.
SHIPPED = [(m.version, m.description) for m in _migrate.load_migrations("sqlite")]
NEXT_VERSION = SHIPPED[-1][0] + 1


def with_second_migration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the library know a migration NEXT_VERSION ("add leases") that the test databases
    do not have."""
    original = _migrate.load_migrations

    def load(backend: str, directory: Path | None = None) -> list[_migrate.Migration]:
        sql = b"CREATE TABLE leases (job_id TEXT PRIMARY KEY);\n"
        name = f"{NEXT_VERSION:04d}_add_leases.sql"
        extra = _migrate.Migration(
            NEXT_VERSION, "add leases", sql.decode(), _migrate.checksum(sql), Path(name)
        )
        return [*original(backend, directory), extra]

    monkeypatch.setattr(_migrate, "load_migrations", load)


# What each call of the tests that probe who may call a store gets before it counts as hung:
# a hang fails the test instead of stalling CI.
CALL_TIMEOUT = 10.0


async def first_job(store: Store, run: Run) -> Job | None:
    """The first job iter_jobs yields for ``run``: one page read."""
    async for job in store.iter_jobs(run.id):
        return job
    return None


def one_call_of_each_kind(store: Store, run: Run) -> dict[str, Callable[[], Awaitable[object]]]:
    """A read, a list, writes alone and grouped, a claim, a release, a batch insert, an empty
    batch (sent nowhere) and a walk's first page, each ready to be made on ``store`` (for tests
    of who may call a store)."""
    return {
        "get_run": lambda: store.get_run(run.id),
        "list_runs": lambda: store.list_runs(),
        "insert_run": lambda: store.insert_run(make_run()),
        "claim_next_run": lambda: store.claim_next_run(),
        "release_runs": lambda: store.release_runs([run.id]),
        "insert_jobs": lambda: store.insert_jobs(make_jobs(run, 2)),
        "empty record_job_outcomes": lambda: store.record_job_outcomes(run.id, []),
        "concurrent inserts": lambda: asyncio.gather(
            *(store.insert_run(make_run()) for _ in range(8))
        ),
        "iter_jobs": lambda: first_job(store, run),
    }


BENCH = Path(__file__).parent.parent / "bench" / "run.py"


def bench_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/run.py imported, for the duration of one test (its dataclasses look their module
    up in sys.modules while they are made)."""
    spec = importlib.util.spec_from_file_location("control_store_bench", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module
