"""A store that is never closed: its process still exits, and dropping it says so."""

from __future__ import annotations

import contextlib
import gc
import sqlite3
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import aiosqlite
import pytest

from control_store import ConfigurationError, Store, _sqlite

from conftest import make_run

EXIT_WAIT = 120.0  # seconds; only a bound on a hang, never an expectation of speed

_FORGETFUL = textwrap.dedent(
    """
    import asyncio, sys
    from control_store import Run, Store

    async def main() -> Store:
        store = await Store.connect(sys.argv[1])
        run = Run("m.yaml", ["m"], 1, 1)
        await store.insert_run(run)
        print(run.id, flush=True)
        return store

    # No close(), and the store still referenced when the interpreter begins to exit, as a
    # module-level store would be: the process must end all the same.
    STORE = asyncio.run(main())
    """
)


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_process_that_never_closes_its_store_exits(tmp_path: Path, where: str) -> None:
    """A script that forgets close() ends normally, and what it wrote to a file is kept."""
    db = tmp_path / "forgetful.db" if where == "file" else "sqlite::memory:"
    done = subprocess.run(
        [sys.executable, "-c", _FORGETFUL, str(db)],
        capture_output=True,
        text=True,
        timeout=EXIT_WAIT,  # before the fix, the process hung here forever
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip()
    assert run_id
    if where == "file":
        with contextlib.closing(sqlite3.connect(db)) as conn:
            assert conn.execute("SELECT id FROM runs").fetchall() == [(run_id,)]


@pytest.mark.parametrize("where", ["file", "memory"])
async def test_a_store_dropped_unclosed_warns_and_stops_its_thread(
    tmp_path: Path, where: str
) -> None:
    """Collecting an unclosed store warns, naming the database, and ends its worker thread."""
    db = str(tmp_path / "dropped.db") if where == "file" else "sqlite::memory:"
    store = await Store.connect(db)
    await store.insert_run(make_run())
    assert await store.claim_next_run() is not None  # a write, last thing before the drop
    backend = store._backend
    assert backend is not None
    thread = backend._conn._thread
    assert thread.daemon
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del store, backend  # the last references: collected here, by reference counting
        gc.collect()  # or here, if a cycle held it
    name = "in-memory database" if where == "memory" else db
    every = [(w.category, str(w.message)) for w in seen]
    ours = [m for c, m in every if c is ResourceWarning and "was never closed" in m]
    # A recorded warning keeps its source (the backend) alive, and with it the aiosqlite
    # connection whose collection stops the thread: let the record go first.
    del seen
    gc.collect()
    assert len(ours) == 1, every
    assert not [m for _, m in every if "deleted before being closed" in m], every  # aiosqlite's
    assert name in ours[0]
    assert "await store.close()" in ours[0]
    thread.join(EXIT_WAIT)
    assert not thread.is_alive()


async def test_a_closed_store_is_collected_without_a_warning(tmp_path: Path) -> None:
    """close() then dropping the store warns about nothing."""
    store = await Store.connect(tmp_path / "closed.db")
    await store.close()
    del store
    gc.collect()  # under -W error, a ResourceWarning here would fail the test


async def test_daemon_worker_refuses_a_started_worker() -> None:
    """The adapter fails loudly if aiosqlite has already started the worker it must change."""
    conn = await aiosqlite.connect(":memory:")
    try:
        assert isinstance(conn._thread, threading.Thread)
        with pytest.raises(ConfigurationError, match=r"_thread.*install an aiosqlite"):
            _sqlite.daemon_worker(conn)
    finally:
        await conn.close()


async def test_a_store_dropped_in_a_reference_cycle_warns_once(tmp_path: Path) -> None:
    """An exception that skipped close() leaves the store reachable only through a cycle (the
    traceback's frames). The garbage collector finalizes everything in it in any order: the
    one warning is still ours, naming the database, never aiosqlite's nameless one too."""
    db = str(tmp_path / "dropped.db")

    async def use_and_fail() -> None:
        store = await Store.connect(db)
        await store.insert_run(make_run())
        raise ValueError("the caller's own bug, before close()")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            await use_and_fail()
        except ValueError as exc:
            cycle: list[object] = [exc, exc.__traceback__]
            cycle.append(cycle)
        del cycle
        gc.collect()
    every = [(w.category.__name__, str(w.message)) for w in seen]
    del seen
    gc.collect()
    assert [m for c, m in every if c == "ResourceWarning"] == [
        f"the store for database {db!r} was never closed; close it with "
        "'async with Store.connect(...) as store' or 'await store.close()'"
    ], every


async def test_a_store_collected_after_its_module_was_torn_down_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit a module's globals may be None before an unclosed store is
    collected (measured: a module-level store next to a hypothesis test, its loop left open):
    the finalizer then still stops the worker, with no "Exception ignored in ... __del__"
    traceback (an unraisable exception, which pytest reports under -W error)."""
    store = await Store.connect(tmp_path / "late.db")
    backend = store._backend
    assert backend is not None
    thread = backend._conn._thread
    monkeypatch.setattr(_sqlite, "_Process", None)  # as module teardown leaves them
    monkeypatch.setattr(_sqlite, "stop_worker", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del store, backend
        gc.collect()
    assert any(w.category is ResourceWarning for w in seen), [str(w.message) for w in seen]
    del seen
    gc.collect()
    thread.join(EXIT_WAIT)
    assert not thread.is_alive()
