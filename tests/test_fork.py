"""A store belongs to the process that opened it: a forked child is refused, and can connect.

A child made by os.fork() (multiprocessing's default start method on Linux before 3.14) gets
a copy of the parent's Store, with its SQLite connection but without the connection's worker
thread. Before the refusal, the child's first call waited forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from control_store import ConfigurationError, Store, StoreClosedError, _sqlite
from control_store.models import Run

from conftest import CALL_TIMEOUT, make_jobs, make_run, one_call_of_each_kind


async def _child(store: Store, run: Run, path: Path | None) -> dict[str, Any]:
    """In the forked child: every kind of call on the inherited store, then a store of its own."""
    refused: dict[str, str] = {}
    calls = one_call_of_each_kind(store, run)
    for name, call in calls.items():
        try:
            await asyncio.wait_for(call(), CALL_TIMEOUT)
        except StoreClosedError as exc:
            refused[name] = str(exc)
    await asyncio.wait_for(store.close(), CALL_TIMEOUT)  # forgets the copy, promptly
    # SQLite does not survive fork(): its locks are not inherited (a store here on the same
    # file would hold none, and the parent's close would delete the -wal under it), and a
    # mutex held at the fork stays held (a connect, even to memory, hung). Refused.
    own = {str(where): await _connect_in_child(where) for where in (path, "sqlite::memory:")}
    return {"refused": refused, "calls": list(calls), "own": own}


async def _connect_in_child(where: Path | str | None) -> str | None:
    """What a store connected in the child gets: "connected", or the refusal's message."""
    if where is None:
        return None
    try:
        async with Store.connect(where):
            return "connected"
    except ConfigurationError as exc:
        return str(exc)


def _fork_and_run(store: Store, run: Run, path: Path | None) -> dict[str, Any]:
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a process with threads may deadlock the child: the
        # very situation under test.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            os.close(read_end)
            found = asyncio.run(_child(store, run, path))
            os.write(write_end, json.dumps(found).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    report: dict[str, Any] = json.loads(out)
    return report


@pytest.mark.parametrize("where", ["memory", "file"])
async def test_a_forked_child_is_refused_and_connects_its_own(tmp_path: Path, where: str) -> None:
    """Every call on the inherited store is a StoreClosedError naming both processes and the
    fix; close() returns; a Store the child connects itself works; the parent carries on."""
    path = tmp_path / "control.db" if where == "file" else None
    async with Store.connect(path or "sqlite::memory:") as store:
        run = make_run()
        await store.insert_run(run)

        report = _fork_and_run(store, run, path)

        assert sorted(report["refused"]) == sorted(report["calls"])
        parent = os.getpid()
        for message in report["refused"].values():
            assert f"was opened by process {parent}, and process " in message
            assert "use stores in a process started by multiprocessing's 'spawn'" in message
        for where, own in report["own"].items():
            if where == "None":
                assert own is None
                continue
            assert f"from process {parent} while that process had a store open" in own, where
            assert "'spawn' or 'forkserver' method, or close every store before forking" in own
        # The parent's store is untouched by the child and goes on working.
        assert await store.list_runs() == [run]
        await store.insert_jobs(make_jobs(run, 3))
        assert len(await store.list_jobs(run.id)) == 3
        assert await store.check() == []


async def test_a_store_still_connecting_has_its_file_on_record(db_path: Path) -> None:
    """The file a store opens is on record (for the fork refusal, and for never opening it
    with a plain open()) from the moment its connection opens it, not once the connect ends:
    a connect waits up to busy_timeout for another process's write lock, and a fork() meanwhile
    went unrefused (the parent's close then deleted the child store's -wal)."""
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as holder:
        holder.execute("BEGIN IMMEDIATE")  # the connect's own BEGIN IMMEDIATE waits on it
        connecting = asyncio.create_task(Store.connect(db_path, busy_timeout=30))
        identity = _sqlite._identity_if_there(str(db_path))
        assert identity is not None
        deadline = asyncio.get_running_loop().time() + CALL_TIMEOUT
        while not _sqlite._held(identity):
            assert not connecting.done(), "the connect ended before its wait"
            assert asyncio.get_running_loop().time() < deadline, "the file was never on record"
            await asyncio.sleep(0.01)
        holder.execute("ROLLBACK")
    store = await asyncio.wait_for(connecting, CALL_TIMEOUT)
    await store.close()
    assert not _sqlite._held(identity)


_FORKS = """
import asyncio, os, sys, warnings
from control_store import ConfigurationError, Store

warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: forking with threads


async def connect(url):
    try:
        async with Store.connect(url) as store:
            await store.list_runs()
        return "connected"
    except ConfigurationError as exc:
        return "refused" if "while that process had a store open" in str(exc) else str(exc)


def in_child(then):
    pid = os.fork()
    if pid == 0:
        try:
            then()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def report(label):
    print(label, asyncio.run(connect(sys.argv[1])), asyncio.run(connect("sqlite::memory:")))
    sys.stdout.flush()


async def parent():
    in_child(lambda: report("before"))  # no store open anywhere yet
    store = await Store.connect("sqlite::memory:")  # another database than the child's
    in_child(lambda: report("while-open"))
    in_child(lambda: in_child(lambda: report("grandchild")))
    await store.close()
    in_child(lambda: report("after-close"))


asyncio.run(parent())
"""


def test_a_child_connects_unless_forked_while_a_store_was_open(tmp_path: Path) -> None:
    """A child forked while no store was open connects stores, to a file and to memory; one
    forked while any store was open (another database, even in memory), and its children,
    are refused: SQLite's mutexes held by that store's thread at the fork stay held, and a
    connect there hung (measured: a few forks in a hundred)."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKS, str(tmp_path / "child.db")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "before connected connected",
        "while-open refused refused",
        "grandchild refused refused",
        "after-close connected connected",
    ], done.stderr
