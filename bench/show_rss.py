"""Build a run of many jobs for measuring ``control-store show`` (a measurement, not a test).

    python bench/show_rss.py PATH [--jobs N]     # builds PATH, prints the run id
    /usr/bin/time -v control-store show RUN_ID --url PATH > /dev/null   # peak RSS: "Maximum
                                                                        # resident set size"

The run has 4 models; 90% of its jobs are done (most scored, 2% with one of a few errors), the
rest queued. Jobs come from a generator, so building it takes bounded memory too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

from control_store import EvalJob, Job, JobOutcome, Run, Store

MODELS = ["model-a", "model-b", "model-c", "model-d"]
ERRORS = ["timeout after 60s", "rate limited", "context length exceeded"]
PAGE = 10_000


def _jobs(run: Run, count: int) -> Iterator[Job]:
    for i in range(count):
        yield Job(run.id, EvalJob(MODELS[i % len(MODELS)], f"sample-{i // len(MODELS)}", i % 10))


def _outcome(job: Job, rng: random.Random) -> JobOutcome:
    if rng.random() < 0.02:
        return JobOutcome(job.id, output="", error=rng.choice(ERRORS))
    return JobOutcome(job.id, score=rng.random(), output="ok")


async def build(path: Path, count: int) -> Run:
    """The run, its jobs queued, then 9 in 10 of them recorded as a fleet would (a page of
    outcomes per call), so the run's counters agree with its jobs as the store keeps them."""
    run = Run("suite.yaml", MODELS, 10, count)
    async with Store.connect(path, synchronous="NORMAL") as store:
        await store.insert_run(run)
        await store.insert_jobs(_jobs(run, count))
        assert await store.claim_next_run() is not None
        rng = random.Random(7)  # noqa: S311 - reproducible made-up scores, not cryptography
        page: list[JobOutcome] = []
        position = 0
        async for job in store.iter_jobs(run.id, page_size=PAGE):
            if position % 10 != 9:  # every tenth job stays queued
                page.append(_outcome(job, rng))
            position += 1
            if len(page) == PAGE:
                await store.record_job_outcomes(run.id, page)
                page = []
        await store.record_job_outcomes(run.id, page)
        stored = await store.get_run(run.id)
        assert stored is not None
    return stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", type=Path)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.path.exists():
        parser.error(f"{args.path} exists; name a new file")
    run = asyncio.run(build(args.path, args.jobs))
    print(run.id)


if __name__ == "__main__":
    main()
