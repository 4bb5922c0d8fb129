"""control_store against raw sqlite3 and an aiosqlite no-op round trip, interleaved in one run.

    nox -s bench                  # or: python bench/run.py [--rounds N] [--json PATH] [--peers]

Every workload runs in rounds; in each round the library and its baseline run back to back on
fresh databases with the same pragmas (the baseline connection is configured by the library's
own `configure`, so journal mode, synchronous and busy_timeout are identical). The table shows
the median ops/s over rounds and the median of the per-round ratios, which pairs measurements
taken seconds apart on this noisy machine. Baselines:

- raw sqlite3: the same SQL statements the library runs, in the same transactions (every
  write in BEGIN IMMEDIATE ... COMMIT; reads as single statements), starting from the same
  model objects: a raw record encodes the outcome with msgspec as the library does. Reads and
  claims stop at sqlite3's tuples (RAW_* below: plain columns, as a hand-written client would
  select them), so the whole of the library's row decode is part of what is measured.
- no-op: `await aiosqlite.Connection._execute(f)` with f doing nothing: one round trip to
  aiosqlite's worker thread, the floor under any single call.

Peak RSS growth for 1M generated jobs is measured in a fresh child process: VmRSS before the
call, then the peak (VmHWM, reset through /proc/self/clear_refs just before) during it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import inspect
import json
import math
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiosqlite
import msgspec

from control_store import EvalJob, Job, JobOutcome, Run, Store, _codec, _sqlite

Timed = Callable[[], Awaitable[tuple[int, float]]]  # -> (items, seconds)

ENCODE = msgspec.json.Encoder().encode
# Ids as text, on both sides the way the library makes them: msgspec formats a UUID in C, in a
# quarter of the time of str(uuid). The baseline gets it too, so that the ratio measures what
# the library adds, not a formatting trick it knows and a hand-written client may not.
ID_TEXT = _codec.uuid_text

# What a hand-written client would run to read and claim: plain columns, left as tuples.
RAW_SELECT_RUN = f"SELECT {_codec.RUN_COLUMNS} FROM runs WHERE id = ?"
RAW_SELECT_JOB = f"SELECT {_codec.JOB_COLUMNS} FROM jobs WHERE id = ?"
_OLDEST_QUEUED = "SELECT rowid FROM runs WHERE status = 'queued' ORDER BY created_at, rowid"
RAW_CLAIM_NEXT_RUN = (
    f"UPDATE runs SET status = 'running' WHERE rowid = ({_OLDEST_QUEUED} LIMIT 1) "
    f"RETURNING {_codec.RUN_COLUMNS}"
)
RAW_CLAIM_RUNS = (
    f"UPDATE runs SET status = 'running' WHERE rowid IN ({_OLDEST_QUEUED} LIMIT ?) "
    f"RETURNING rowid, {_codec.RUN_COLUMNS}"
)


@dataclass(frozen=True)
class Setting:
    """Where a workload runs: memory, or a WAL file at a synchronous level."""

    name: str
    file: bool
    synchronous: str
    single: int  # items per measured segment of single calls
    batch_runs: int  # claim_runs(64) / record_job_outcomes(64) calls per segment


@dataclass
class Row:
    """One line of the table: a workload in a setting, the library against a baseline."""

    setting: str
    workload: str
    baseline: str
    target: float | None
    lib: list[float] = field(default_factory=list)
    base: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(a / b for a, b in zip(self.lib, self.base, strict=True))

    @property
    def met(self) -> str:
        if self.target is None:
            return ""
        return "yes" if self.ratio >= self.target else "NO"


# ---------------------------------------------------------------------------------------------
# Databases and data


class Databases:
    """Fresh databases per segment: a store or a raw connection with the library's pragmas."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0

    def path(self, setting: Setting) -> str:
        if not setting.file:
            return _sqlite.MEMORY
        self.count += 1
        return str(self.root / f"bench-{self.count}.db")

    async def store(self, setting: Setting) -> Store:
        path = self.path(setting)
        url = _sqlite.MEMORY_URL if path == _sqlite.MEMORY else path  # ":memory:" is refused
        return await Store.connect(url, synchronous=setting.synchronous)  # type: ignore[arg-type]

    def raw(self, setting: Setting) -> sqlite3.Connection:
        path = self.path(setting)
        conn = sqlite3.connect(path, isolation_level=None)
        options = _sqlite.parse_options({"synchronous": setting.synchronous})
        _sqlite.configure(conn, path=path, options=options, database=path)
        _sqlite.migrate(conn, database=path)
        return conn

    def clean(self) -> None:
        for path in self.root.glob("bench-*"):
            path.unlink()


def make_runs(n: int, job_count: int = 1) -> list[Run]:
    return [Run("bench.yaml", ["model-a", "model-b"], 1, job_count) for _ in range(n)]


def make_jobs(run: Run, n: int) -> list[Job]:
    return [Job(run.id, EvalJob("model-a", f"sample-{i}", 0)) for i in range(n)]


def one_job_runs(n: int) -> tuple[list[Run], list[Job]]:
    """n runs of one job each, and those jobs: one item of claim plus record apiece."""
    runs = make_runs(n)
    return runs, [make_jobs(run, 1)[0] for run in runs]


async def setup_store(store: Store, runs: list[Run], jobs: list[Job]) -> None:
    """Load rows untimed, in one transaction (the bench's only use of the backend itself)."""
    backend = store._backend
    assert backend is not None
    run_rows = [_codec.run_params(r) for r in runs]
    job_rows = [_codec.job_params(j) for j in jobs]

    def load(conn: sqlite3.Connection) -> None:
        _load(conn, run_rows, job_rows)

    await backend.write(load)


def setup_raw(conn: sqlite3.Connection, runs: list[Run], jobs: list[Job]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    _load(conn, [_codec.run_params(r) for r in runs], [_codec.job_params(j) for j in jobs])
    conn.execute("COMMIT")


def _load(conn: sqlite3.Connection, run_rows: list[Any], job_rows: list[Any]) -> None:
    """The rows, and each run's count of jobs (runs.job_rows) as insert_jobs would keep it."""
    conn.executemany(_sqlite.INSERT_RUN, run_rows)
    conn.executemany(_sqlite.INSERT_JOB, job_rows)
    for run_id, added in Counter(row[1] for row in job_rows).items():
        conn.execute(_sqlite.ADD_JOB_ROWS, (added, run_id, added))


# ---------------------------------------------------------------------------------------------
# Raw sqlite3: the library's statements, in the library's transactions


def raw_tx(conn: sqlite3.Connection, body: Callable[[], Any]) -> Any:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = body()
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def raw_record(conn: sqlite3.Connection, run_id: str, outcome: JobOutcome) -> bool:
    payload = ENCODE(outcome).decode()
    job_id = ID_TEXT(outcome.job_id)

    def body() -> bool:
        if conn.execute(_sqlite.MARK_JOB_DONE, (payload, job_id, run_id)).rowcount == 1:
            conn.execute(_sqlite.ADVANCE_RUN, (run_id,))
            return True
        return False

    return bool(raw_tx(conn, body))


def raw_record_many(conn: sqlite3.Connection, run_id: str, outcomes: list[JobOutcome]) -> int:
    rows = [(ENCODE(o).decode(), ID_TEXT(o.job_id)) for o in outcomes]

    def body() -> int:
        new = 0
        cursor = conn.cursor()  # one for the batch, as the library's op uses
        for payload, job_id in rows:
            if cursor.execute(_sqlite.MARK_JOB_DONE, (payload, job_id, run_id)).rowcount == 1:
                new += 1
        if new:
            cursor.execute(_sqlite.ADVANCE_RUN_BY, (new, new, run_id))
        return new

    return int(raw_tx(conn, body))


def raw_claim_runs(conn: sqlite3.Connection, limit: int) -> list[Any]:
    rows: list[Any] = raw_tx(conn, lambda: conn.execute(RAW_CLAIM_RUNS, (limit,)).fetchall())
    rows.sort(key=lambda row: (row[7], row[0]))
    return rows


def raw_job_rows(jobs: list[Job]) -> Iterator[tuple[str, str, str, str, int, None]]:
    """The rows of one run's jobs: its id formatted once, as the library does for a streak of
    jobs of one run."""
    run_id = ID_TEXT(jobs[0].run_id)
    for job in jobs:
        yield (ID_TEXT(job.id), run_id, ENCODE(job.spec).decode(), "queued", 0, None)


# ---------------------------------------------------------------------------------------------
# Workloads: each returns (library, baseline) segment functions for a setting


@dataclass
class Side:
    """One side of a pair: units of work, run a chunk at a time; ops counted per unit."""

    units: list[Any]
    chunk: Callable[[list[Any]], Awaitable[None]]
    close: Callable[[], Awaitable[None]]
    ops_per_unit: int = 1


async def measure(lib: Side, base: Side, chunk: int) -> tuple[float, float]:
    """Run both sides in alternating chunks (which goes first alternates too): ops/s each.

    Chunks of a few dozen calls interleave the two sides finely, so a change in the shared
    machine's load hits both alike instead of skewing their ratio.
    """
    assert len(lib.units) == len(base.units)
    spent = {id(lib): 0.0, id(base): 0.0}
    try:
        for n, start in enumerate(range(0, len(lib.units), chunk)):
            for side in (lib, base) if n % 2 == 0 else (base, lib):
                units = side.units[start : start + chunk]
                began = time.perf_counter()
                await side.chunk(units)
                spent[id(side)] += time.perf_counter() - began
    finally:
        await lib.close()
        await base.close()
    return (
        len(lib.units) * lib.ops_per_unit / spent[id(lib)],
        len(base.units) * base.ops_per_unit / spent[id(base)],
    )


async def _done() -> None:
    return None


def closing_checked(store: Store, sql: str, expected: int) -> Callable[[], Awaitable[None]]:
    """A Side's close that first checks the store holds what the workload wrote (after the
    timing, before closing): a library that skipped its writes must not look fast."""

    async def close() -> None:
        backend = store._backend
        assert backend is not None
        try:
            found = await backend.read(lambda conn: conn.execute(sql).fetchone()[0])
            assert found == expected, f"{sql}: {found}, expected {expected}"
        finally:
            await store.close()

    return close


class Bench:
    """Builds the two sides of each workload on fresh databases of a setting."""

    def __init__(self, dbs: Databases, noop_conn: aiosqlite.Connection) -> None:
        self.dbs = dbs
        self.noop_conn = noop_conn

    def noop(self, n: int) -> Side:
        conn = self.noop_conn
        nothing = _nothing

        async def chunk(units: list[Any]) -> None:
            for _ in units:
                await conn._execute(nothing)  # type: ignore[no-untyped-call]

        return Side(list(range(n)), chunk, _done)

    async def fsync_side(self, n: int, *, hop: bool) -> Side:
        """A 4 KiB write and fsync, as a commit at FULL does: on aiosqlite's thread (``hop``:
        one hop, the store's way) or on this thread (raw sqlite3's way). Their difference is
        what a hop costs around a wait on the disk, beside the no-op hop's cost around nothing.
        Each side opens the file for itself, when it is built: a side never built (--only)
        opens nothing."""
        conn = self.noop_conn
        fd = os.open(self.dbs.root / f"fsync-{n}", os.O_RDWR | os.O_CREAT, 0o600)
        block = b"\0" * 4096

        def sync() -> None:
            os.pwrite(fd, block, 0)
            os.fsync(fd)

        async def hopping(units: list[Any]) -> None:
            for _ in units:
                await conn._execute(sync)  # type: ignore[no-untyped-call]

        async def direct(units: list[Any]) -> None:
            for _ in units:
                sync()

        async def close() -> None:
            os.close(fd)

        return Side(list(range(n)), hopping if hop else direct, close)

    async def store(self, s: Setting, runs: list[Run], jobs: list[Job]) -> Store:
        store = await self.dbs.store(s)
        try:
            await setup_store(store, runs, jobs)
        except BaseException:
            await store.close()  # an open aiosqlite thread would keep the process alive
            raise
        return store

    def raw(self, s: Setting, runs: list[Run], jobs: list[Job]) -> sqlite3.Connection:
        conn = self.dbs.raw(s)
        setup_raw(conn, runs, jobs)
        return conn

    @staticmethod
    def closer(conn: sqlite3.Connection) -> Callable[[], Awaitable[None]]:
        async def close() -> None:
            conn.close()

        return close

    # --- single calls from one task ---

    @staticmethod
    def single_rows(what: str, n: int) -> tuple[list[Run], list[Job]]:
        """What a single-call workload starts from: a run of n jobs to record (one run only,
        as the concurrent records load), else n runs of one job each."""
        if what == "record_job_outcome":
            (run,) = make_runs(1, job_count=n)
            return [run], make_jobs(run, n)
        return one_job_runs(n)

    async def lib_single(self, s: Setting, what: str, n: int) -> Side:
        runs, jobs = self.single_rows(what, n)
        empty = what == "insert_run"
        store = await self.store(s, [] if empty else runs, [] if empty else jobs)
        run_id = runs[0].id

        async def chunk(units: list[Any]) -> None:
            if what == "insert_run":
                for run in units:
                    await store.insert_run(run)
            elif what == "get_run":
                for run in units:
                    assert await store.get_run(run.id) is not None
            elif what == "get_job":
                for job in units:
                    assert await store.get_job(job.id) is not None
            elif what == "claim_next_run":
                for _ in units:
                    assert await store.claim_next_run() is not None
            else:
                for outcome in units:
                    assert await store.record_job_outcome(run_id, outcome)

        units: list[Any] = runs
        if what == "get_job":
            units = jobs
        elif what == "record_job_outcome":
            units = [JobOutcome(job.id, score=1.0) for job in jobs]
        close: Callable[[], Awaitable[None]] = store.close
        if what == "insert_run":
            close = closing_checked(store, "SELECT count(*) FROM runs", len(runs))
        return Side(units, chunk, close)

    async def raw_single(self, s: Setting, what: str, n: int) -> Side:
        runs, jobs = self.single_rows(what, n)
        empty = what == "insert_run"
        conn = self.raw(s, [] if empty else runs, [] if empty else jobs)
        run_id = str(runs[0].id)
        execute = conn.execute

        async def chunk(units: list[Any]) -> None:
            if what == "insert_run":
                for run in units:
                    raw_tx(conn, partial(execute, _sqlite.INSERT_RUN, _codec.run_params(run)))
            elif what == "get_run":
                for run in units:
                    assert execute(RAW_SELECT_RUN, (ID_TEXT(run.id),)).fetchone()
            elif what == "get_job":
                for job in units:
                    assert execute(RAW_SELECT_JOB, (ID_TEXT(job.id),)).fetchone()
            elif what == "claim_next_run":
                for _ in units:
                    assert raw_tx(conn, lambda: execute(RAW_CLAIM_NEXT_RUN).fetchall())
            else:
                for outcome in units:
                    assert raw_record(conn, run_id, outcome)

        units: list[Any] = runs
        if what == "get_job":
            units = jobs
        elif what == "record_job_outcome":
            units = [JobOutcome(job.id, score=1.0) for job in jobs]
        return Side(units, chunk, self.closer(conn))

    # --- a lone task on runs of many jobs: one unit is one run, its jobs are the items ---

    def run_batches(self, n: int) -> tuple[list[Run], list[Job], dict[Any, list[JobOutcome]]]:
        runs = make_runs(max(1, n // RUN_JOBS), job_count=RUN_JOBS)
        jobs = [job for run in runs for job in make_jobs(run, RUN_JOBS)]
        outcomes: dict[Any, list[JobOutcome]] = {run.id: [] for run in runs}
        for job in jobs:
            outcomes[job.run_id].append(JobOutcome(job.id, score=1.0))
        return runs, jobs, outcomes

    async def lib_claim_record_runs(self, s: Setting, n: int) -> Side:
        """Peer workload, as a lone scheduler meets it: claim a run, record its jobs' outcomes
        in one call; the items are the jobs (two commits per RUN_JOBS items)."""
        runs, jobs, outcomes = self.run_batches(n)
        store = await self.store(s, runs, jobs)

        async def chunk(units: list[Any]) -> None:
            for _ in units:
                run = await store.claim_next_run()
                assert run is not None
                assert all(await store.record_job_outcomes(run.id, outcomes[run.id]))

        return Side(list(range(len(runs))), chunk, store.close, RUN_JOBS)

    async def raw_claim_record_runs(self, s: Setting, n: int) -> Side:
        runs, jobs, outcomes = self.run_batches(n)
        conn = self.raw(s, runs, jobs)

        async def chunk(units: list[Any]) -> None:
            for _ in units:
                (row,) = raw_tx(conn, lambda: conn.execute(RAW_CLAIM_NEXT_RUN).fetchall())
                run_id = row[0]
                assert raw_record_many(conn, run_id, outcomes[uuid.UUID(run_id)]) == RUN_JOBS

        return Side(list(range(len(runs))), chunk, self.closer(conn), RUN_JOBS)

    # --- concurrent records: `tasks` tasks share each chunk ---

    async def lib_concurrent(self, s: Setting, n: int, tasks: int) -> Side:
        (run,) = make_runs(1, job_count=n)
        jobs = make_jobs(run, n)
        store = await self.store(s, [run], jobs)

        async def worker(part: list[JobOutcome]) -> None:
            for outcome in part:
                assert await store.record_job_outcome(run.id, outcome)

        async def chunk(units: list[Any]) -> None:
            await asyncio.gather(*(worker(units[i::tasks]) for i in range(tasks)))

        return Side([JobOutcome(j.id, score=1.0) for j in jobs], chunk, store.close)

    async def raw_record_side(self, s: Setting, n: int) -> Side:
        return await self.raw_single(s, "record_job_outcome", n)

    async def raw_claim_record(self, s: Setting, n: int) -> Side:
        """lib_claim_record's baseline: the same claim and record per item, each its own
        transaction and commit, as the library's are (two fsyncs an item at FULL)."""
        runs, jobs = one_job_runs(n)
        conn = self.raw(s, runs, jobs)
        job_of = {ID_TEXT(job.run_id): job.id for job in jobs}

        async def chunk(units: list[Any]) -> None:
            for _ in units:
                (row,) = raw_tx(conn, lambda: conn.execute(RAW_CLAIM_NEXT_RUN).fetchall())
                assert raw_record(conn, row[0], JobOutcome(job_of[row[0]]))

        return Side(list(range(n)), chunk, self.closer(conn))

    async def lib_claim_record(self, s: Setting, n: int, tasks: int) -> Side:
        """Peer workload: per item, claim a run and record its one job's outcome."""
        runs, jobs = one_job_runs(n)
        store = await self.store(s, runs, jobs)
        job_of = {job.run_id: job.id for job in jobs}

        async def worker(count: int) -> None:
            for _ in range(count):
                run = await store.claim_next_run()
                assert run is not None
                assert await store.record_job_outcome(run.id, JobOutcome(job_of[run.id]))

        async def chunk(units: list[Any]) -> None:
            share, extra = divmod(len(units), tasks)
            await asyncio.gather(*(worker(share + (i < extra)) for i in range(tasks)))

        return Side(list(range(n)), chunk, store.close)

    # --- batches: one unit is one call of 64 ---

    async def lib_claim_runs(self, s: Setting, calls: int) -> Side:
        store = await self.store(s, make_runs(calls * 64), [])

        async def chunk(units: list[Any]) -> None:
            for _ in units:
                assert len(await store.claim_runs(64)) == 64

        return Side(list(range(calls)), chunk, store.close, 64)

    async def raw_claim_runs(self, s: Setting, calls: int) -> Side:
        conn = self.raw(s, make_runs(calls * 64), [])

        async def chunk(units: list[Any]) -> None:
            for _ in units:
                assert len(raw_claim_runs(conn, 64)) == 64

        return Side(list(range(calls)), chunk, self.closer(conn), 64)

    async def lib_record_many(self, s: Setting, calls: int) -> Side:
        (run,) = make_runs(1, job_count=calls * 64)
        jobs = make_jobs(run, calls * 64)
        store = await self.store(s, [run], jobs)
        outcomes = [JobOutcome(job.id, score=1.0) for job in jobs]
        batches = [outcomes[i : i + 64] for i in range(0, len(outcomes), 64)]

        async def chunk(units: list[Any]) -> None:
            for batch in units:
                assert all(await store.record_job_outcomes(run.id, batch))

        return Side(batches, chunk, store.close, 64)

    async def raw_record_many(self, s: Setting, calls: int) -> Side:
        (run,) = make_runs(1, job_count=calls * 64)
        jobs = make_jobs(run, calls * 64)
        conn = self.raw(s, [run], jobs)
        outcomes = [JobOutcome(job.id, score=1.0) for job in jobs]
        batches = [outcomes[i : i + 64] for i in range(0, len(outcomes), 64)]
        run_id = str(run.id)

        async def chunk(units: list[Any]) -> None:
            for batch in units:
                assert raw_record_many(conn, run_id, batch) == 64

        return Side(batches, chunk, self.closer(conn), 64)

    # --- insert_jobs: one unit is one call of n jobs ---

    async def lib_insert_jobs(self, s: Setting, n: int, calls: int) -> Side:
        runs = make_runs(calls, job_count=n)
        store = await self.store(s, runs, [])
        units = [make_jobs(run, n) for run in runs]

        async def chunk(units: list[Any]) -> None:
            for jobs in units:
                await store.insert_jobs(jobs)

        close = closing_checked(store, "SELECT count(*) FROM jobs", n * calls)
        return Side(units, chunk, close, n)

    async def raw_insert_jobs(self, s: Setting, n: int, calls: int) -> Side:
        runs = make_runs(calls, job_count=n)
        conn = self.raw(s, runs, [])
        units = [make_jobs(run, n) for run in runs]

        async def chunk(units: list[Any]) -> None:
            for jobs in units:
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(_sqlite.INSERT_JOB, raw_job_rows(jobs))
                run_id, added = ID_TEXT(jobs[0].run_id), len(jobs)  # one run per call
                conn.execute(_sqlite.ADD_JOB_ROWS, (added, run_id, added))
                conn.execute("COMMIT")

        return Side(units, chunk, self.closer(conn), n)


def _nothing() -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Peers (nox -s bench -- --peers): dequeue + ack of one item per iteration, WAL file

# Workers per peer, beside control_store's claim+record x1 and x64 tasks. One worker is the
# main thread in the peer's default mode; more are threads in the peer's own multi-threaded
# mode, described here for the table.
PEER_WORKERS = (1, 64)
PEER_MODES = {
    "huey": "threads share one SqliteStorage (one connection, one lock)",
    "persist-queue": "threads share one SQLiteAckQueue(multithreading=True)",
    "litequeue": "a LiteQueue per thread on one file, busy timeout 60 s",
}
CONTROL_STORE_MODE = "64 asyncio tasks share one Store"
# The lone scheduler's own shape of the peer workload: its items are the jobs of runs of
# RUN_JOBS jobs, each run claimed with claim_next_run and its outcomes recorded in one
# record_job_outcomes call. Every claim and every record is still durable when it returns.
RUN_JOBS = 64
BATCHED_CLAIM_RECORD = f"claim+record x1, runs of {RUN_JOBS}"

Peer = Callable[[int], float]  # workers -> seconds for n dequeue+ack, every item acked once


class PeerFailed(Exception):
    """A peer could not get through the items at this many workers; the message says why."""


@dataclass
class PeerResult:
    """A peer's items/s per worker count over rounds, and why any round failed."""

    version: str
    rates: dict[int, list[float]] = field(default_factory=dict)
    failed: dict[int, list[str]] = field(default_factory=dict)

    def median(self, workers: int) -> float | None:
        if workers in self.failed or workers not in self.rates:
            return None
        return statistics.median(self.rates[workers])


def drive(n: int, workers: int, work: Callable[[int, int], None]) -> float:
    """Seconds for `work(worker, count)` to get through n items with this many workers.

    One worker runs inline. More run in threads, which share out the n items as
    lib_claim_record shares them among its tasks; the clock starts once every thread is up and
    stops when the last is done. Any worker's error fails the run: it never just shortens it.
    """
    if workers == 1:
        started = time.perf_counter()
        work(0, n)
        return time.perf_counter() - started
    share, extra = divmod(n, workers)
    ready = threading.Barrier(workers + 1)
    errors: list[Exception] = []

    def target(worker: int) -> None:
        ready.wait()
        try:
            work(worker, share + (worker < extra))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        kinds = Counter(f"{type(e).__name__}: {e}" for e in errors)
        why = "; ".join(f"{kind} (x{count})" for kind, count in kinds.most_common())
        raise PeerFailed(f"{len(errors)} of {workers} workers failed: {why}")
    return seconds


def acked_once(acked: list[Any], n: int, left: int) -> None:
    """Each of the n items enqueued was acked exactly once, and none is left in the queue."""
    distinct = len(set(acked) - {None})
    if len(acked) != n or distinct != n or left:
        raise PeerFailed(
            f"{len(acked)} acks of {distinct} distinct items for {n} enqueued; {left} left"
        )


def peer_workloads(root: Path, n: int) -> dict[str, Peer]:
    """Each peer, if installed: enqueue n items (untimed), then time n dequeue+ack."""
    found: dict[str, Peer] = {}
    counter = iter(range(1_000_000))

    def fresh(name: str) -> Path:
        path = root / f"peer-{name}-{next(counter)}"
        path.mkdir()
        return path

    with contextlib.suppress(ImportError):
        from huey.storage import SqliteStorage

        def huey(workers: int) -> float:
            # fsync=True: huey's durable setting (synchronous=FULL), WAL is its default. Its
            # thread workers share one storage: in huey 3 one connection, every call under
            # one lock (older releases kept a connection per thread).
            storage = SqliteStorage("bench", filename=str(fresh("huey") / "h.db"), fsync=True)
            for i in range(n):
                storage.enqueue(b"item %d" % i)
            acked: list[Any] = []

            def work(_: int, count: int) -> None:
                # huey deletes on dequeue: its ack.
                acked.extend([storage.dequeue() for _ in range(count)])

            seconds = drive(n, workers, work)
            acked_once(acked, n, storage.queue_size())
            storage.close()
            return seconds

        found["huey"] = huey

    with contextlib.suppress(ImportError):
        import persistqueue

        def persist_queue(workers: int) -> float:
            # multithreading=True, its mode for threads: one connection to get and one to
            # put, shared by all threads behind its locks. One worker keeps the default.
            queue: Any = persistqueue.SQLiteAckQueue(  # Any: its connections are untyped
                str(fresh("persistqueue")), auto_commit=True, multithreading=workers > 1
            )
            for conn in (queue._getter, queue._putter):
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
            for i in range(n):
                queue.put(f"item {i}")
            acked: list[Any] = []

            def work(_: int, count: int) -> None:
                # ack returns the item's id, None if it did not know the item.
                acked.extend([queue.ack(queue.get(block=False)) for _ in range(count)])

            seconds = drive(n, workers, work)
            acked_once(acked, n, n - queue.acked_count())
            queue.close()
            return seconds

        found["persist-queue"] = persist_queue

    with contextlib.suppress(ImportError):
        from litequeue import LiteQueue

        def litequeue(workers: int) -> float:
            # One LiteQueue cannot be shared by threads: its one connection, opened with
            # check_same_thread=False and no lock, interleaves their BEGIN IMMEDIATE and
            # COMMIT ("cannot start a transaction within a transaction"). So each thread has
            # its own on the same file, as separate consumer processes would, and SQLite's
            # write lock arbitrates. Its waiters poll, and with 64 threads sqlite3's default
            # 5 s busy timeout runs out ("database is locked"); LiteQueue passes `timeout` on
            # to sqlite3.connect, so they wait up to 60 s. The same for one worker.
            path = str(fresh("litequeue") / "q.db")
            queues: list[Any] = [LiteQueue(path, timeout=60.0) for _ in range(workers)]
            for queue in queues:
                queue.conn.execute("PRAGMA synchronous = FULL")  # Any: conn is untyped
            for i in range(n):
                queues[0].put(f"item {i}")
            acked: list[Any] = []

            def work(worker: int, count: int) -> None:
                queue, done = queues[worker], []
                for _ in range(count):
                    message = queue.pop()
                    if message is None:
                        raise PeerFailed("pop() found no item")
                    queue.done(message.message_id)
                    done.append(message.message_id)
                acked.extend(done)

            seconds = drive(n, workers, work)
            left = queues[0].qsize() + len(list(queues[0].list_failed()))
            acked_once(acked, n, left)
            for queue in queues:
                queue.close()
            return seconds

        found["litequeue"] = litequeue

    return found


# ---------------------------------------------------------------------------------------------
# Peak RSS for 1M generated jobs, in a child process


RSS_WARM_MANIFEST = "warm.yaml"  # the run of the jobs inserted before the measured call


def rss_child(path: str, n: int) -> None:
    """Insert n generated jobs through insert_jobs into a fresh WAL file; print RSS in KiB."""

    async def main() -> dict[str, Any]:
        store = await Store.connect(path)
        (run,) = make_runs(1, job_count=n)
        await store.insert_run(run)
        warm = Run(RSS_WARM_MANIFEST, ["m"], 1, 10)
        await store.insert_run(warm)
        await store.insert_jobs(make_jobs(warm, 10))  # import and cache everything first
        before = _status_kib("VmRSS")
        # Reset the peak (VmHWM) to the current RSS, so the peak read after is this call's.
        _reset_peak()
        spec = EvalJob("model-a", "sample", 0)
        run_id = run.id
        started = time.perf_counter()
        await store.insert_jobs(Job(run_id, spec) for _ in range(n))
        elapsed = time.perf_counter() - started
        after = _status_kib("VmHWM")
        await store.close()
        return {
            "seconds": elapsed,
            "rss_before_kib": before,
            "rss_peak_kib": after,
        }

    print(json.dumps(asyncio.run(main())))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def measure_rss(root: Path, n: int) -> dict[str, Any]:
    path = root / "rss.db"
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(path), str(n)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    conn = sqlite3.connect(path)
    # The measured call's jobs: those of its run, not the warm-up's.
    result["jobs"] = conn.execute(
        "SELECT count(*) FROM jobs JOIN runs ON runs.id = jobs.run_id WHERE runs.manifest <> ?",
        (RSS_WARM_MANIFEST,),
    ).fetchone()[0]
    conn.close()
    result["growth_mib"] = (result["rss_peak_kib"] - result["rss_before_kib"]) / 1024
    for leftover in root.glob("rss.db*"):
        leftover.unlink()
    return result


# ---------------------------------------------------------------------------------------------
# The run


SETTINGS = [
    Setting("memory", file=False, synchronous="FULL", single=3000, batch_runs=60),
    Setting("WAL FULL", file=True, synchronous="FULL", single=1500, batch_runs=40),
    Setting("WAL NORMAL", file=True, synchronous="NORMAL", single=3000, batch_runs=60),
]


# insert_jobs calls per side and round, alternating: each takes about a second, and one call a
# side left a round's ratio to whichever side a burst of the shared machine's load hit
# (0.59-1.29x in memory across runs of one commit; three per round halve that spread).
INSERT_CALLS = 3

SINGLE_CALLS = ("insert_run", "get_run", "get_job", "claim_next_run", "record_job_outcome")


async def run_rounds(
    args: argparse.Namespace, root: Path, after_round: Callable[[], None]
) -> dict[str, Any]:
    dbs = Databases(root)
    noop_conn = await aiosqlite.connect(":memory:", isolation_level=None)
    try:
        return await _run_rounds(args, dbs, Bench(dbs, noop_conn), after_round)
    finally:
        await noop_conn.close()


async def _run_rounds(
    args: argparse.Namespace, dbs: Databases, bench: Bench, after_round: Callable[[], None]
) -> dict[str, Any]:
    """Every workload pair, round after round; after_round runs at the end of each (the
    peers: so that each round of theirs meets the disk as that round's claim+record did)."""
    rows: dict[tuple[str, str, str], Row] = {}

    async def pair(
        setting: str,
        workload: str,
        baseline: str,
        target: float | None,
        lib: Awaitable[Side],
        base: Awaitable[Side],
        chunk: int,
    ) -> None:
        if args.only and args.only not in workload:
            for pending in (lib, base):
                if inspect.iscoroutine(pending):
                    pending.close()  # never started: nothing to clean up
            return
        key = (setting, workload, baseline)
        if key not in rows:
            rows[key] = Row(setting, workload, baseline, target)
        lib_rate, base_rate = await measure(await lib, await base, chunk)
        rows[key].lib.append(lib_rate)
        rows[key].base.append(base_rate)
        dbs.clean()

    for round_number in range(args.rounds):
        print(f"round {round_number + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for s in SETTINGS:
            n = s.single
            mem = not s.file
            for what in (
                "insert_run",
                "get_run",
                "get_job",
                "claim_next_run",
                "record_job_outcome",
            ):
                await pair(
                    s.name,
                    what,
                    "aiosqlite no-op",
                    0.8 if mem else None,
                    bench.lib_single(s, what, n),
                    _ready(bench.noop(n)),
                    50,
                )
                if what in ("claim_next_run", "record_job_outcome"):
                    await pair(
                        s.name,
                        what,
                        "raw sqlite3",
                        None,
                        bench.lib_single(s, what, n),
                        bench.raw_single(s, what, n),
                        50,
                    )
            for tasks in (8, 64):
                target = 1.0 if (tasks == 64 and s.name == "WAL FULL") else None
                await pair(
                    s.name,
                    f"record_job_outcome x{tasks} tasks",
                    "raw, 1 record/commit",
                    target,
                    bench.lib_concurrent(s, n * 2, tasks),
                    bench.raw_record_side(s, n * 2),
                    256,
                )
            await pair(
                s.name,
                "claim_runs(64)",
                "raw sqlite3",
                0.8,
                bench.lib_claim_runs(s, s.batch_runs),
                bench.raw_claim_runs(s, s.batch_runs),
                4,
            )
            await pair(
                s.name,
                "record_job_outcomes(64)",
                "raw sqlite3",
                0.8,
                bench.lib_record_many(s, s.batch_runs),
                bench.raw_record_many(s, s.batch_runs),
                4,
            )
            await pair(
                s.name,
                f"insert_jobs({args.insert_jobs // 1000}k)",
                "raw executemany",
                0.9,
                bench.lib_insert_jobs(s, args.insert_jobs, INSERT_CALLS),
                bench.raw_insert_jobs(s, args.insert_jobs, INSERT_CALLS),
                1,
            )
            if s.name == "WAL FULL":
                for tasks in PEER_WORKERS:
                    await pair(
                        s.name,
                        f"claim+record x{tasks} tasks",
                        # Many tasks share the library's commits (group commit): its baseline
                        # is raw's two commits an item, not the same commits.
                        "raw, same 2 commits" if tasks == 1 else "raw, 2 commits/item",
                        None,
                        bench.lib_claim_record(s, n, tasks),
                        bench.raw_claim_record(s, n),
                        128 if tasks > 1 else 25,
                    )
                await pair(
                    s.name,
                    "fsync 4 KiB, hop to thread",
                    "fsync on this thread",
                    None,
                    bench.fsync_side(n, hop=True),
                    bench.fsync_side(n, hop=False),
                    50,
                )
                await pair(
                    s.name,
                    BATCHED_CLAIM_RECORD,
                    "raw, same 2 commits",
                    None,
                    bench.lib_claim_record_runs(s, n * 4),
                    bench.raw_claim_record_runs(s, n * 4),
                    4,
                )
        after_round()
    return {"rows": list(rows.values())}


async def _ready(side: Side) -> Side:
    return side


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "aiosqlite": aiosqlite.__version__,
        "os": platform.platform(),
        "cpu_idle": cpu_idle(),
    }


# Linux's idle driver, and the haltpoll driver's polling window: a VM's idle vCPU that halts at
# once (0 ns) costs the host tens of microseconds to wake, and every hop wakes one or two.
_CPUIDLE_DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")
_HALT_POLL_NS = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def cpu_idle() -> str:
    """How an idle CPU waits here, as Linux reports it; "unknown" where it does not."""
    try:
        driver = _CPUIDLE_DRIVER.read_text().strip()
    except OSError:
        return "unknown"
    if driver != "haltpoll":
        return driver
    try:
        return f"haltpoll, guest_halt_poll_ns={_HALT_POLL_NS.read_text().strip()}"
    except OSError:
        return driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--insert-jobs", type=int, default=100_000)
    parser.add_argument("--rss-jobs", type=int, default=1_000_000)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the calls per segment (quick runs)"
    )
    parser.add_argument("--peers", action="store_true", help="add huey, persist-queue, litequeue")
    parser.add_argument(
        "--only", help="run only the workloads whose name contains this, e.g. claim_runs"
    )
    parser.add_argument("--json", default="bench-results.json")
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only and args.peers:
        parser.error("--only and --peers do not combine: the peers are compared with every row")
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]))
        return

    if args.scale != 1.0:
        SETTINGS[:] = [
            Setting(
                s.name,
                s.file,
                s.synchronous,
                max(64, int(s.single * args.scale)),
                max(4, int(s.batch_runs * args.scale)),
            )
            for s in SETTINGS
        ]
    root = Path(tempfile.mkdtemp(prefix="control-store-bench-"))
    began = time.perf_counter()
    try:
        peers: dict[str, PeerResult] = {}
        peer_root = root / "peers"  # emptied after each peer run; the rounds' files are beside
        peer_root.mkdir()
        # As many items as control_store's claim+record rows claim and record.
        n = next(s.single for s in SETTINGS if s.name == "WAL FULL")
        workloads = peer_workloads(peer_root, n) if args.peers else {}

        def peers_round() -> None:
            for name, peer in workloads.items():
                if name not in peers:
                    peers[name] = PeerResult(importlib.metadata.version(name))
                result = peers[name]
                for workers in PEER_WORKERS:
                    print(f"peer {name} x{workers}", file=sys.stderr, flush=True)
                    try:
                        seconds = peer(workers)
                    except PeerFailed as e:
                        result.failed.setdefault(workers, []).append(str(e))
                    else:
                        result.rates.setdefault(workers, []).append(n / seconds)
                    finally:
                        shutil.rmtree(peer_root)
                        peer_root.mkdir()

        results = asyncio.run(run_rounds(args, root, peers_round))
        rows: list[Row] = results["rows"]
        if not rows:
            parser.error(f"--only {args.only!r} matches no workload; see the table's names")
        rss: dict[str, Any] | None = None
        if not args.only:
            print("measuring peak RSS for insert_jobs of generated jobs...", file=sys.stderr)
            rss = measure_rss(root, args.rss_jobs)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    lines = report(rows, peers, rss, machine(), time.perf_counter() - began)
    print("\n".join(lines))
    payload = {
        "machine": machine(),
        "rounds": args.rounds,
        "seconds": round(time.perf_counter() - began, 1),
        "rows": [
            {
                "setting": r.setting,
                "workload": r.workload,
                "baseline": r.baseline,
                "lib_ops_per_s": round(statistics.median(r.lib)),
                "baseline_ops_per_s": round(statistics.median(r.base)),
                "ratio": round(r.ratio, 3),
                "target": r.target,
                "met": r.met or None,
                "lib_rounds": [round(x) for x in r.lib],
                "baseline_rounds": [round(x) for x in r.base],
            }
            for r in rows
        ],
        "claim_record_per_s": {str(k): round(v) for k, v in claim_record(rows).items()},
        "claim_record_runs_per_s": _rounded(claim_record_runs(rows)),
        "peers_dequeue_ack_per_s": {
            name: {str(w): _rounded(result.median(w)) for w in PEER_WORKERS}
            for name, result in peers.items()
        },
        "peers_versions": {name: result.version for name, result in peers.items()},
        "peers_failed": {
            name: {str(w): why for w, why in result.failed.items()}
            for name, result in peers.items()
            if result.failed
        },
        "rss": rss,
        "table": lines,
    }
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)


def claim_record(rows: list[Row]) -> dict[int, float]:
    """control_store's claim+record items/s at WAL FULL, by tasks: what the peers face."""
    ours = {r.workload: statistics.median(r.lib) for r in rows if r.setting == "WAL FULL"}
    found = {tasks: ours.get(f"claim+record x{tasks} tasks") for tasks in PEER_WORKERS}
    return {tasks: rate for tasks, rate in found.items() if rate is not None}  # all but --only


def claim_record_runs(rows: list[Row]) -> float | None:
    """control_store's items/s at WAL FULL for a lone task on runs of RUN_JOBS jobs."""
    for r in rows:
        if r.setting == "WAL FULL" and r.workload == BATCHED_CLAIM_RECORD:
            return statistics.median(r.lib)
    return None


def _rounded(rate: float | None) -> int | None:
    return None if rate is None else round(rate)


def shown_ratio(ratio: float) -> str:
    """A ratio to two decimals, rounded down: 0.798 shows as 0.79, never as the 0.80 it
    misses."""
    # The epsilon: 0.57 is 56.99999... hundredths in binary floating point.
    return f"{math.floor(ratio * 100 + 1e-9) / 100:.2f}"


def report(
    rows: list[Row],
    peers: dict[str, PeerResult],
    rss: dict[str, Any] | None,
    host: dict[str, Any],
    seconds: float,
) -> list[str]:
    wide = max(len(r.baseline) for r in rows)  # the baseline column
    lines = [
        f"machine: {host['cpu']}, {host['cores']} cores; Python {host['python']}, "
        f"SQLite {host['sqlite']}, aiosqlite {host['aiosqlite']}; {host['os']}; "
        f"cpu idle: {host['cpu_idle']}",
        f"medians of {len(rows[0].lib)} interleaved rounds; ratio = median of per-round "
        f"library/baseline; run took {seconds:.0f} s",
        "",
        f"| {'setting':<10} | {'workload':<30} | {'library/s':>9} | {'baseline':<{wide}} "
        f"| {'baseline/s':>10} | {'ratio':>5} | {'target':>6} | met |",
        f"|{'-' * 12}|{'-' * 32}|{'-' * 11}|{'-' * (wide + 2)}|{'-' * 12}|{'-' * 7}|{'-' * 8}"
        "|-----|",
    ]
    for r in rows:
        target = f">={r.target:g}" if r.target is not None else ""
        lines.append(
            f"| {r.setting:<10} | {r.workload:<30} | {statistics.median(r.lib):>9,.0f} "
            f"| {r.baseline:<{wide}} | {statistics.median(r.base):>10,.0f} "
            f"| {shown_ratio(r.ratio):>5} | {target:>6} | {r.met:<3} |"
        )
    if peers:
        ours = claim_record(rows)
        lines += [
            "",
            "Peers, WAL files at synchronous=FULL, items/s: control_store claims a run and "
            "records its job's outcome,",
            "each peer dequeues an item and acks it; 1 worker is one task or the main thread.",
            "",
            f"| {'':<20} | {'1 worker':>9} | {'64 workers':>10} | {'64 workers as':<58} |",
            f"|{'-' * 22}|{'-' * 11}|{'-' * 12}|{'-' * 60}|",
            f"| {'control_store':<20} | {ours[1]:>9,.0f} | {ours[64]:>10,.0f} "
            f"| {CONTROL_STORE_MODE:<58} |",
        ]
        batched = claim_record_runs(rows)
        if batched is not None:
            lines.append(
                f"| {f'  runs of {RUN_JOBS} jobs':<20} | {batched:>9,.0f} | {'':>10} "
                f"| {'1 worker: claim_next_run + record_job_outcomes per run':<58} |"
            )
        failures = []
        for name, result in peers.items():
            cells = []
            for workers in PEER_WORKERS:
                rate = result.median(workers)
                cells.append("FAILED" if rate is None else f"{rate:,.0f}")
                for why in dict.fromkeys(result.failed.get(workers, [])):
                    failures.append(f"  {name} x{workers}: {why}")
            label = f"{name} {result.version}"
            lines.append(
                f"| {label:<20} | {cells[0]:>9} | {cells[1]:>10} | {PEER_MODES[name]:<58} |"
            )
        if failures:
            lines += ["", "Peer runs that failed (any failed round fails the cell):", *failures]
    if rss is None:
        return [*lines, "", "peak RSS: not measured (--only)"]
    lines += [
        "",
        f"insert_jobs of {rss['jobs']:,} generated jobs (WAL FULL, one transaction): "
        f"{rss['seconds']:.1f} s, peak RSS growth {rss['growth_mib']:.1f} MiB "
        f"(target <= 100 MiB: {'yes' if rss['growth_mib'] <= 100 else 'NO'})",
    ]
    return lines


if __name__ == "__main__":
    main()
