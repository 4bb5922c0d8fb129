"""`nox -s bench` keeps working: its script, at a tiny scale, measures every workload it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BENCH, bench_module

RUN_WAIT = 600.0  # seconds; only a bound on a hang, never an expectation of speed

# Every workload the README's table shows, per setting; the peers (--peers) are not installed
# in the test environment, and their loop is the same code with other libraries.
_EVERY_SETTING = {
    "insert_run",
    "get_run",
    "get_job",
    "claim_next_run",
    "record_job_outcome",
    "record_job_outcome x8 tasks",
    "record_job_outcome x64 tasks",
    "claim_runs(64)",
    "record_job_outcomes(64)",
    "insert_jobs(2k)",
}
_WAL_FULL_ONLY = {
    "claim+record x1 tasks",
    "claim+record x64 tasks",
    "fsync 4 KiB, hop to thread",
    "claim+record x1, runs of 64",
}


def test_the_benchmark_runs_every_workload_and_writes_its_json(tmp_path: Path) -> None:
    """A one-round run at 5% scale measures every workload, with RSS, and writes its JSON."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            *("--rounds", "1", "--scale", "0.05", "--insert-jobs", "2000"),
            *("--rss-jobs", "20000", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_WAIT,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    seen: dict[str, set[str]] = {}
    for row in result["rows"]:
        seen.setdefault(row["setting"], set()).add(row["workload"])
        assert row["lib_ops_per_s"] > 0
        assert row["baseline_ops_per_s"] > 0
        assert row["ratio"] > 0
    assert seen["memory"] == _EVERY_SETTING
    assert seen["WAL NORMAL"] == _EVERY_SETTING
    assert seen["WAL FULL"] == _EVERY_SETTING | _WAL_FULL_ONLY
    assert result["rss"]["jobs"] == 20_000  # the measured call's, not the warm-up's 10
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len({len(line) for line in table}) <= 2  # aligned: the main table, the peers'
    baselines = {row["workload"]: row["baseline"] for row in result["rows"]}
    assert baselines["claim+record x1 tasks"] == "raw, same 2 commits"
    assert set(result["claim_record_per_s"]) == {"1", "64"}
    assert result["claim_record_runs_per_s"] > 0
    assert "| claim_runs(64)" in done.stdout  # the table printed for the README
    # How this machine's idle CPUs wait, which sets a hop's price: in the JSON and the table.
    idle = result["machine"]["cpu_idle"]
    assert idle
    assert f"cpu idle: {idle}" in done.stdout


def test_an_only_that_matches_no_workload_says_so(tmp_path: Path) -> None:
    """--only with a name no workload has is a usage error naming it, not a traceback."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--only", "claims_runs", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=RUN_WAIT,
    )
    assert done.returncode == 2, done.stderr
    assert "--only 'claims_runs' matches no workload" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_the_machine_line_says_how_idle_cpus_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle driver, with haltpoll's polling window (a hop's price on a VM), or "unknown"."""
    bench = bench_module(monkeypatch)
    driver, window = tmp_path / "current_driver", tmp_path / "guest_halt_poll_ns"
    monkeypatch.setattr(bench, "_CPUIDLE_DRIVER", driver)
    monkeypatch.setattr(bench, "_HALT_POLL_NS", window)
    assert bench.cpu_idle() == "unknown"
    driver.write_text("intel_idle\n")
    assert bench.cpu_idle() == "intel_idle"
    driver.write_text("haltpoll\n")
    assert bench.cpu_idle() == "haltpoll"  # its module's parameters not to be read
    window.write_text("200000\n")
    assert bench.cpu_idle() == "haltpoll, guest_halt_poll_ns=200000"
