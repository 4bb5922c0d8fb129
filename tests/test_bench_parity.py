"""The benchmark's raw sqlite3 baselines run what their labels say: the library's own SQL, at
the library's pragmas, with as many commits where a label says "same".

Every pair the bench times against raw sqlite3 is run once at a tiny scale with sqlite3's trace
callback on both connections (the library's through its backend): the statements each side
executed, literals masked, are compared as multisets.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sqlite3
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import bench_module

PRAGMAS = (
    "journal_mode",
    "synchronous",
    "busy_timeout",
    "foreign_keys",
    "cache_size",
    "temp_store",
    "mmap_size",
    "wal_autocheckpoint",
    "locking_mode",
    "journal_size_limit",
)
_KEEP = {"'queued'", "'running'", "'done'", "'integer'"}


def _shape(sql: str) -> str:
    """A traced statement with its bound values masked, and the two claims' RETURNING lists
    (the library skips the status column it has just set: documented) cut off."""
    sql = re.sub(r"\s+", " ", sql).strip()
    sql = re.sub(r"'(?:[^']|'')*'", lambda m: m[0] if m[0] in _KEEP else "?", sql)
    sql = re.sub(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])", "N", sql)
    sql = sql.replace("( ", "(").replace(" )", ")")
    return re.sub(r" RETURNING .*", " RETURNING ...", sql)


def _traced_pairs(
    bench: ModuleType, root: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[tuple[str, str, str], Any]:
    """(setting, workload, baseline) -> {"lib"/"raw": (pragmas, Counter of statements)}."""
    opened: list[tuple[str, Any]] = []
    store, raw = bench.Databases.store, bench.Databases.raw

    async def traced_store(self: Any, s: Any) -> Any:
        made = await store(self, s)
        opened.append(("lib", made))
        return made

    def traced_raw(self: Any, s: Any) -> sqlite3.Connection:
        made: sqlite3.Connection = raw(self, s)
        opened.append(("raw", made))
        return made

    monkeypatch.setattr(bench.Databases, "store", traced_store)
    monkeypatch.setattr(bench.Databases, "raw", traced_raw)
    seen: dict[tuple[str, str, str], Any] = {}
    measure = bench.measure
    current: list[tuple[str, str, str]] = []

    async def traced_measure(lib: Any, base: Any, chunk: int) -> tuple[float, float]:
        logs: dict[str, Any] = {}
        for kind, obj in opened:
            log: list[str] = []

            def setup(conn: sqlite3.Connection, log: list[str] = log) -> dict[str, object]:
                found = {p: (conn.execute(f"PRAGMA {p}").fetchone() or [None])[0] for p in PRAGMAS}
                conn.set_trace_callback(log.append)
                return found

            pragmas = await obj._backend.read(setup) if kind == "lib" else setup(obj)
            logs[kind] = (pragmas, log)
        opened.clear()
        try:
            timed: tuple[float, float] = await measure(lib, base, chunk)
            return timed
        finally:
            if len(logs) == 2:
                seen[current[-1]] = {
                    kind: (pragmas, Counter(_shape(s) for s in log if "count(*)" not in s))
                    for kind, (pragmas, log) in logs.items()
                }

    monkeypatch.setattr(bench, "measure", traced_measure)
    row = bench.Row

    def named_row(setting: str, workload: str, baseline: str, target: Any) -> Any:
        current.append((setting, workload, baseline))  # pair() makes one per key, then times
        return row(setting, workload, baseline, target)

    monkeypatch.setattr(bench, "Row", named_row)

    async def run() -> None:
        noop = await bench.aiosqlite.connect(":memory:", isolation_level=None)
        try:
            dbs = bench.Databases(root)
            args = argparse.Namespace(only=None, rounds=1, insert_jobs=2000)
            await bench._run_rounds(args, dbs, bench.Bench(dbs, noop), lambda: None)
        finally:
            await noop.close()

    asyncio.run(run())
    return seen


def test_every_raw_baseline_runs_the_librarys_statements_at_its_pragmas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = bench_module(monkeypatch)
    monkeypatch.setattr(
        bench,
        "SETTINGS",
        [bench.Setting(s.name, s.file, s.synchronous, 64, 4) for s in bench.SETTINGS],
    )
    seen = _traced_pairs(bench, tmp_path, monkeypatch)
    raw_rows = [key for key in seen if key[2].startswith("raw")]
    assert len(raw_rows) == 3 * 7 + 3, raw_rows  # every raw pair of every setting was traced
    for key in raw_rows:
        (lib_pragmas, lib), (raw_pragmas, raw) = seen[key]["lib"], seen[key]["raw"]
        assert lib_pragmas == raw_pragmas, key
        if key[2] in ("raw, 1 record/commit", "raw, 2 commits/item"):
            # Group commit against a commit per record (and per claim): the same statements,
            # the library's in fewer transactions, each in a savepoint.
            data = {s for s in raw if not s.startswith(("BEGIN", "COMMIT"))}
            assert {s: lib[s] for s in data} == {s: raw[s] for s in data}, key
            writes = sum(
                n for s, n in raw.items() if s.startswith("UPDATE") and "done_count" not in s
            )
            assert raw["COMMIT"] == writes, key  # one per record, and one per claim
            assert lib["COMMIT"] <= raw["COMMIT"], key
            continue
        # "raw sqlite3", "raw executemany", "raw, same 2 commits": the same statements, as
        # many times each, commits and savepoints included.
        assert lib == raw, (key, lib - raw, raw - lib)
