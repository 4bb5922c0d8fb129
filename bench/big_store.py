"""insert_jobs into a growing store file, with the default (time-ordered) ids and with uuid4 ids.

    python bench/big_store.py [--jobs 1200000] [--batch 100000]

Each kind of id fills a fresh WAL file at the library's defaults, one run of `--batch` jobs per
`insert_jobs` call, until it holds `--jobs` jobs, and prints the rate of the first and the last
calls. A job's id is its table's primary key: a random id (uuid4) lands on a random page of
that index, and once the index outgrows SQLite's page cache every insert reads a page back;
a time-ordered id (UUID version 7, the default) lands at the index's end. Takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from control_store import EvalJob, Job, Run, Store, models


def jobs(run: Run, n: int, new_id: Callable[[], uuid.UUID]) -> Iterator[Job]:
    for k in range(n):
        yield Job(run.id, EvalJob("model-a", f"q-{k:07d}", 0), id=models.JobId(new_id()))


async def fill(path: Path, total: int, batch: int, new_id: Callable[[], uuid.UUID]) -> list[float]:
    """The jobs/s of each insert_jobs call, filling ``path`` to ``total`` jobs."""
    rates = []
    async with Store.connect(path) as store:
        for _ in range(total // batch):
            run = Run("big.yaml", ["model-a"], epochs=1, job_count=batch, id=models.RunId(new_id()))
            await store.insert_run(run)
            started = time.perf_counter()
            await store.insert_jobs(jobs(run, batch, new_id))
            rates.append(batch / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_200_000)
    parser.add_argument("--batch", type=int, default=100_000)
    args = parser.parse_args()
    if args.jobs < 2 * args.batch:
        sys.exit("--jobs must be at least two --batch")
    kinds = {"default (UUIDv7)": models.new_job_id, "uuid4": uuid.uuid4}
    with tempfile.TemporaryDirectory() as root:
        for name, new_id in kinds.items():
            rates = asyncio.run(fill(Path(root, f"{name[:7]}.db"), args.jobs, args.batch, new_id))
            last = statistics.median(rates[-3:])
            print(
                f"{name:>17}: first call {rates[0]:>9,.0f} jobs/s, "
                f"last three (median) {last:>9,.0f} jobs/s at {args.jobs:,} jobs"
            )


if __name__ == "__main__":
    main()
