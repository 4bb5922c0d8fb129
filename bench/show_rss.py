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

from control_store import EvalJob, Job, JobOutcome, JobStatus, Run, RunStatus, Store

MODELS = ["model-a", "model-b", "model-c", "model-d"]
ERRORS = ["timeout after 60s", "rate limited", "context length exceeded"]


def _jobs(run: Run, count: int, rng: random.Random) -> Iterator[Job]:
    for i in range(count):
        spec = EvalJob(MODELS[i % len(MODELS)], f"sample-{i // len(MODELS)}", i % 10)
        if i % 10 == 9:
            yield Job(run.id, spec)
            continue
        job = Job(run.id, spec, status=JobStatus.DONE)
        if rng.random() < 0.02:
            outcome = JobOutcome(job.id, output="", error=rng.choice(ERRORS))
        else:
            outcome = JobOutcome(job.id, score=rng.random(), output="ok")
        yield Job(run.id, spec, id=job.id, status=JobStatus.DONE, outcome=outcome)


async def build(path: Path, count: int) -> Run:
    done = count - count // 10
    run = Run("suite.yaml", MODELS, 10, count, status=RunStatus.RUNNING, done_count=done)
    async with Store.connect(path, synchronous="NORMAL") as store:
        await store.insert_run(run)
        rng = random.Random(7)  # noqa: S311 - reproducible made-up scores, not cryptography
        await store.insert_jobs(_jobs(run, count, rng))
    return run


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
