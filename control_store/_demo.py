"""The demo fleet behind ``control-store demo``: schedulers in OS processes, at-least-once workers.

The parent submits the runs, starts scheduler processes (each with its own ``Store`` on the same
SQLite file), watches shared counters for live progress, and at the end verifies the invariants
against the database. Each scheduler claims runs until none is queued and dispatches a run's
jobs to simulated workers (asyncio tasks). Workers deliver at-least-once: a share of outcomes is
delivered twice, and some workers die after delivering but before acknowledging, so the
scheduler dispatches that job again. The store must absorb every duplicate.

Not imported by ``control_store`` itself: only the CLI uses it, and the spawned children
import it by name (``multiprocessing``'s spawn start method pickles the target by reference).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Final, Protocol

if sys.platform != "win32":
    import fcntl

import msgspec

from ._show import counted
from ._store import Store
from .errors import ControlError, CorruptRowError
from .models import EvalJob, Job, JobOutcome, JobStatus, Run, RunStatus

# Slots of the counters the scheduler processes share with the parent: a multiprocessing
# RawArray of COUNTERS slots per process, each process adding to its own only, in one thread.
DELIVERIES: Final = 0  # record_job_outcome calls that returned
RECORDED: Final = 1  # ... that returned True: the job was newly recorded
ABSORBED: Final = 2  # ... that returned False: a duplicate the store absorbed
REDISPATCHED: Final = 3  # jobs dispatched again because their worker died before acknowledging
RUNS_DONE: Final = 4  # runs whose every job a scheduler saw acknowledged
COUNTERS: Final = 5

_MODEL_NAMES: Final = (
    "atlas-7b",
    "borealis-13b",
    "cirrus-34b",
    "dune-70b",
    "ember-8x7b",
    "fjord-3b",
    "glacier-405b",
    "harbor-1b",
)
ERROR_TEXT: Final = "sandbox timed out after 30 s"


class Counters(Protocol):
    """What the demo needs of a ``multiprocessing.RawArray('q', COUNTERS * processes)``.

    No lock: a lock is a named semaphore, which multiprocessing's resource tracker warns of
    ("leaked semaphore objects") when the parent ends by os._exit (a stop stuck in a lock wait,
    see cli._exit_now) before releasing it. One writer a slot needs none; the parent's live
    reads may mix one moment's slots with the next's, and its final read comes after every
    child has ended.
    """

    def __getitem__(self, index: int) -> int: ...
    def __setitem__(self, index: int, value: int) -> None: ...


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Every size and rate of a demo; picklable, so it travels to the spawned processes."""

    url: str
    runs: int = 8
    models: int = 5
    samples: int = 25
    epochs: int = 2
    schedulers: int = 4
    processes: int = 2
    workers: int = 8
    duplicate_rate: float = 0.10
    death_rate: float = 0.05
    error_rate: float = 0.02
    latency_ms: float = 2.0
    seed: int = 0
    busy_timeout: float = 30.0

    @property
    def jobs_per_run(self) -> int:
        """models x samples x epochs."""
        return self.models * self.samples * self.epochs

    @property
    def total_jobs(self) -> int:
        """Jobs over every run."""
        return self.runs * self.jobs_per_run

    def model_names(self) -> list[str]:
        """The demo's model names, as many as ``models``."""
        names = list(_MODEL_NAMES[: self.models])
        names += [f"model-{i + 1}" for i in range(len(names), self.models)]
        return names

    def schedulers_of(self, process: int) -> int:
        """How many of the schedulers process number ``process`` runs (spread evenly)."""
        base, extra = divmod(self.schedulers, self.processes)
        return base + (1 if process < extra else 0)


# ---------------------------------------------------------------------------------------------
# The pretend evaluation: deterministic, so the parent can tell which delivery was stored.


def _unit(text: str) -> tuple[float, float]:
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return (
        int.from_bytes(digest[:8], "big") / 2**64,
        int.from_bytes(digest[8:], "big") / 2**64,
    )


def pseudo_outcome(job: Job, attempt: int, error_rate: float) -> JobOutcome:
    """The outcome a worker reports for ``job`` on its ``attempt``-th dispatch.

    Score and error depend only on the spec (a model's quality, a sample's difficulty); the
    output names the attempt, so a stored ``"attempt 1"`` proves the first delivery won.
    """
    spec = job.spec
    quality, _ = _unit(f"quality:{spec.model}")
    draw, failure = _unit(f"{spec.model}|{spec.sample_id}|{spec.epoch}")
    output = f"attempt {attempt}"
    if failure < error_rate:
        return JobOutcome(job.id, output=output, error=ERROR_TEXT)
    # Pass/fail against a model quality between 0.35 and 0.95: the mean score is an accuracy.
    return JobOutcome(job.id, score=1.0 if draw < 0.35 + 0.6 * quality else 0.0, output=output)


class Stopped(Exception):
    """The demo was stopped while a run's jobs were being generated: they are not inserted."""


def make_runs(
    config: DemoConfig, stop: threading.Event | None = None
) -> Iterator[tuple[Run, Iterable[Job]]]:
    """The demo's runs, each with its jobs: every model on every sample in every epoch.

    The jobs are generated as they are read, not listed: a run may hold a million jobs (see
    the CLI's size limits), whose list would take seconds to build on the event loop, deaf to
    signals meanwhile, and a gigabyte to hold. insert_jobs reads them on the store's thread,
    one job at a time. Once ``stop`` is set, the generator raises Stopped at its next job, so
    the insert rolls back instead of running on after the demo was interrupted.
    """
    models = config.model_names()
    for index in range(config.runs):
        run = Run(f"demo/suite-{index + 1}.yaml", models, config.epochs, config.jobs_per_run)
        yield run, _RunJobs(run, config, models, stop or threading.Event())


@dataclass(frozen=True, slots=True)
class _RunJobs(Collection[Job]):
    """A run's jobs, made anew each time they are iterated: a collection (it has a length),
    not a one-shot generator, so that an insert failing part-way leaves them whole, and its
    error does not tell the operator to pass the store a new generator, which only a caller of
    the library could do. The store reads any iterable that is no collection as one-shot; a class
    is one by subclassing Collection, not by having __len__ and __contains__."""

    run: Run
    config: DemoConfig
    models: list[str]
    stop: threading.Event

    def __iter__(self) -> Iterator[Job]:
        return _jobs_of(self.run, self.config, self.models, self.stop)

    def __len__(self) -> int:
        return self.run.job_count

    def __contains__(self, item: object) -> bool:
        # By run and spec: each iteration makes the jobs anew, each with a fresh id.
        if not isinstance(item, Job) or item.run_id != self.run.id:
            return False
        jobs = _jobs_of(self.run, self.config, self.models, threading.Event())
        return any(job.spec == item.spec for job in jobs)


def _jobs_of(
    run: Run, config: DemoConfig, models: list[str], stop: threading.Event
) -> Iterator[Job]:
    for epoch in range(config.epochs):
        for model in models:
            for sample in range(config.samples):
                if stop.is_set():
                    raise Stopped(f"the demo stopped while the jobs of run {run.id} were inserted")
                yield Job(run.id, EvalJob(model, f"sample-{sample:04d}", epoch))


# ---------------------------------------------------------------------------------------------
# A scheduler process (runs in the child).


class ProcessReport(msgspec.Struct, frozen=True):
    """What a scheduler process sends the parent when it ends."""

    claimed: list[str] = []
    """Run ids this process's schedulers claimed."""
    first_deliveries: list[str] = []
    """Job ids for which record_job_outcome returned True in this process."""
    error: str | None = None
    """Why the process failed, if it did."""
    retryable: bool = False
    """Whether ``error`` is a ControlError a retry may cure (a lock held past busy_timeout)."""


@dataclass
class _Tally:
    counters: Counters
    process: int = 0  # which COUNTERS slots of ``counters`` are this process's
    claimed: list[str] = field(default_factory=list)
    first_deliveries: list[str] = field(default_factory=list)

    def add(self, slot: int, amount: int = 1) -> None:
        self.counters[self.process * COUNTERS + slot] += amount


async def _worker(
    store: Store,
    run: Run,
    todo: collections.deque[tuple[Job, int]],
    config: DemoConfig,
    rng: random.Random,
    tally: _Tally,
    redispatch: Callable[[Job, int], None],
) -> None:
    while todo:
        job, attempt = todo.popleft()
        await asyncio.sleep(rng.uniform(0.0, 2.0 * config.latency_ms) / 1000.0)
        outcome = pseudo_outcome(job, attempt, config.error_rate)
        copies = 2 if rng.random() < config.duplicate_rate else 1
        for _ in range(copies):
            newly = await store.record_job_outcome(run.id, outcome)
            if newly:
                tally.first_deliveries.append(str(job.id))
            tally.add(RECORDED if newly else ABSORBED)
            tally.add(DELIVERIES)
        if rng.random() < config.death_rate:
            # Delivered, then died before acknowledging: the scheduler never hears back, so it
            # dispatches the job again (to a fresh worker), and that delivery is a duplicate.
            redispatch(job, attempt + 1)
            return


async def _scheduler(store: Store, config: DemoConfig, rng: random.Random, tally: _Tally) -> None:
    while (run := await store.claim_next_run()) is not None:
        tally.claimed.append(str(run.id))
        await _dispatch(store, run, config, rng, tally)
        tally.add(RUNS_DONE)


# Jobs a scheduler holds at once: it walks a run with iter_jobs a page at a time, so a run of a
# million jobs costs it no more memory than one of a thousand.
DISPATCH_PAGE = 1000


async def _dispatch(
    store: Store,
    run: Run,
    config: DemoConfig,
    rng: random.Random,
    tally: _Tally,
    *,
    page_size: int = DISPATCH_PAGE,
) -> None:
    """Hand a run's jobs that are not done yet to workers, ``page_size`` jobs at a time."""
    page: list[Job] = []
    async for job in store.iter_jobs(run.id, page_size=page_size):
        if job.status is not JobStatus.DONE:
            page.append(job)
        if len(page) == page_size:
            await _dispatch_page(store, run, page, config, rng, tally)
            page = []
    if page:
        await _dispatch_page(store, run, page, config, rng, tally)


async def _dispatch_page(
    store: Store,
    run: Run,
    jobs: list[Job],
    config: DemoConfig,
    rng: random.Random,
    tally: _Tally,
) -> None:
    """Hand ``jobs`` to ``config.workers`` workers; a job whose worker died goes out again."""
    todo = collections.deque((job, 1) for job in jobs)
    async with asyncio.TaskGroup() as group:

        def redispatch(job: Job, attempt: int) -> None:
            tally.add(REDISPATCHED)
            todo.append((job, attempt))
            group.create_task(_worker(store, run, todo, config, rng, tally, redispatch))

        for _ in range(min(config.workers, len(todo))):
            group.create_task(_worker(store, run, todo, config, rng, tally, redispatch))


# How often a scheduler process looks whether its parent is still there.
PARENT_POLL_SECONDS: Final = 0.2


class ParentGoneError(Exception):
    """The demo's parent process ended: its scheduler processes must stop too."""


async def _watch_parent(parent: int) -> None:
    """Raise ParentGoneError once this process's parent is no longer ``parent``.

    A parent killed with SIGKILL cannot terminate its children, and the pipe to it tells a
    child nothing until the child writes; but the kernel re-parents an orphan at once, so
    os.getppid() changes, on every POSIX system.
    """
    # Polled: no event or signal tells a process that its parent died (PR_SET_PDEATHSIG is
    # Linux only).
    while os.getppid() == parent:  # noqa: ASYNC110
        await asyncio.sleep(PARENT_POLL_SECONDS)
    raise ParentGoneError(
        f"the demo's process {parent} is gone: this scheduler process stopped claiming runs"
    )


async def _scheduler_process(config: DemoConfig, process: int, tally: _Tally, parent: int) -> None:
    async with (
        Store.connect(config.url, busy_timeout=config.busy_timeout) as store,
        asyncio.TaskGroup() as group,
    ):
        watcher = group.create_task(_watch_parent(parent))
        async with asyncio.TaskGroup() as schedulers:  # cancelled if the watcher raises
            for index in range(config.schedulers_of(process)):
                # Fault injection, not cryptography: a seeded generator gives each scheduler
                # its own stream of faults (see new_seed for what a seed does not fix).
                rng = random.Random(f"{config.seed}/{process}/{index}")  # noqa: S311
                schedulers.create_task(_scheduler(store, config, rng, tally))
        watcher.cancel()


def first_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (TaskGroup wraps what its tasks raised)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def scheduler_process(
    config: DemoConfig, process: int, counters: Counters, conn: Connection, parent: int
) -> None:
    """A child's entry point: run its schedulers, then send a ``ProcessReport`` to the parent.

    ``parent`` is the parent's process id: the child stops when the parent is gone (see
    _watch_parent), however the parent ended.
    """
    # The parent owns Ctrl-C (which the terminal sends to the whole process group), as it owns
    # SIGTERM and SIGHUP: it terminates the children, which must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent stops a child with SIGTERM (terminate()): one the demo's caller ignored is
    # inherited ignored through exec, and terminate() then stopped nothing.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    tally = _Tally(counters, process)
    error: str | None = None
    retryable = False
    try:
        asyncio.run(_scheduler_process(config, process, tally, parent))
    except BaseException as exc:  # reported to the parent, which decides how to fail
        leaf = first_error(exc)
        if isinstance(leaf, ControlError):
            error, retryable = str(leaf), leaf.retryable
        else:
            error = "".join(traceback.format_exception(leaf)).strip()
    report = ProcessReport(tally.claimed, tally.first_deliveries, error, retryable)
    with contextlib.suppress(OSError):  # the parent is gone: nobody to tell
        conn.send_bytes(msgspec.msgpack.encode(report))
    conn.close()
    if error is not None:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# The parent: submit, start, watch, verify.


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The shared counters at one moment."""

    deliveries: int
    recorded: int
    absorbed: int
    redispatched: int
    runs_done: int
    elapsed: float


@dataclass(frozen=True, slots=True)
class Check:
    """One invariant, verified against the database."""

    name: str
    ok: bool
    detail: str


@dataclass
class FleetResult:
    """What the fleet did: final counters, per-process reports and exit codes."""

    snapshot: Snapshot
    reports: list[ProcessReport]
    exit_codes: list[int | None]

    @property
    def clean(self) -> bool:
        """Whether every scheduler process exited 0 and reported no error: the fleet did its
        work (a process killed by a signal, a stop sent to the whole process group, did not)."""
        return all(
            code == 0 and report.error is None
            for report, code in zip(self.reports, self.exit_codes, strict=True)
        )


@dataclass
class Submitted:
    """What submit has written so far: only what the store confirmed committed, so that a demo
    stopped part-way says truly what it left in the database."""

    runs: list[Run] = field(default_factory=list)
    """Runs written with every one of their jobs."""
    without_jobs: Run | None = None
    """A run whose row was written, but whose jobs were not (yet, or ever: stopped between)."""


class DemoRunning(Exception):
    """Another demo holds the demo's lock on this database: its process id, if it wrote one."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(pid)
        self.pid = pid


class DemoLockFailed(Exception):
    """The demo's lock file could not be made or locked (a name too long, a read-only
    directory)."""

    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(path, error)
        self.path = path
        self.error = error


@contextlib.contextmanager
def only_demo_on(path: str) -> Iterator[None]:
    """Hold, for the whole demo, an exclusive lock on ``path``'s demo lock file (the database's
    path + "-demo.lock", holding the holder's process id), or raise DemoRunning.

    Two demos on one database claim each other's runs (claim_next_run takes the oldest queued
    run, whoever submitted it), and each then fails its checks; refusing a database that holds
    queued runs is no guard, since both may look before either submits. The lock is flock's:
    the kernel lets it go when its process ends, however it ends, so one left by a killed demo
    blocks nobody. The file is removed on the way out, still locked: a demo that had opened it
    meanwhile then finds it gone from the path, and locks a new one. Beside the file itself,
    symlinks resolved: every name of one database shares one lock.
    """
    if sys.platform == "win32":  # no flock; and the demo's signals are POSIX's anyway
        yield
        return
    lock_path = f"{os.path.realpath(path)}-demo.lock"
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DemoLockFailed(lock_path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise DemoRunning(int(holder) if holder.isdigit() else None) from None
        except OSError as exc:
            os.close(fd)
            raise DemoLockFailed(lock_path, exc) from exc
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(lock_path).st_ino
        except FileNotFoundError:  # removed by the demo that held it, as it ended
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # that demo's old file: lock the one at the path now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)


async def submit(store: Store, config: DemoConfig, submitted: Submitted | None = None) -> list[Run]:
    """Insert the demo's runs and jobs, recording each write in ``submitted``; return the runs.

    Cancelled (the CLI's stop signal), it stops the job generator and waits for the write in
    flight to commit or roll back before it lets the cancellation through: a write that has
    started on the store's thread finishes either way, and ``submitted`` must say which.
    """
    done = Submitted() if submitted is None else submitted
    stop = threading.Event()
    for run, jobs in make_runs(config, stop):
        writing = asyncio.ensure_future(_submit_run(store, run, jobs, done))
        try:
            await asyncio.shield(writing)
        except asyncio.CancelledError:
            stop.set()
            # Its outcome is in ``done``; its error (Stopped, or the interrupted statement's
            # ControlError) only says it did not commit.
            with contextlib.suppress(Exception):
                await writing
            raise
    return done.runs


async def _submit_run(store: Store, run: Run, jobs: Iterable[Job], done: Submitted) -> None:
    await store.insert_run(run)
    done.without_jobs = run
    await store.insert_jobs(jobs)
    done.without_jobs = None
    done.runs.append(run)


@contextlib.contextmanager
def _blocked(signum: signal.Signals) -> Iterator[None]:
    """``signum`` blocked on this thread for the block: a process started meanwhile keeps it
    blocked (the mask survives fork and exec, as multiprocessing's own resource tracker is
    started with SIGINT and SIGTERM blocked), and one that comes meanwhile is delivered to
    this process after the block."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker before any scheduler process, with SIGHUP
    blocked. Spawning the first child starts it otherwise, inside the SIGINT block around
    that child's start: and starting it unblocks SIGINT and SIGTERM in the calling thread
    (ensure_running blocks them for the tracker's spawn, then unblocks them, whatever they
    were), so the child was spawned with SIGINT deliverable, and a Ctrl-C while it still
    imported raised KeyboardInterrupt there, a traceback after the demo's one line (about one
    stop in thirty). The tracker ignores SIGINT and SIGTERM itself; SIGHUP, sent to the
    process group by a closed terminal, would kill it."""
    if not hasattr(signal, "SIGHUP"):  # Windows: no resource tracker, and no hang-up
        return
    from multiprocessing import resource_tracker

    with _blocked(signal.SIGHUP):
        resource_tracker.ensure_running()


_TERMINATE_WAIT: Final = 1.0


async def run_fleet(config: DemoConfig, on_progress: Callable[[Snapshot], None]) -> FleetResult:
    """Start the scheduler processes and wait for them, reporting progress about every 0.1 s."""
    context = multiprocessing.get_context("spawn")  # no fork: the parent holds an open store
    _start_resource_tracker()
    counters: Counters = context.RawArray("q", COUNTERS * config.processes)
    processes: list[multiprocessing.process.BaseProcess] = []
    pipes: list[Connection] = []
    started = time.perf_counter()

    def snapshot() -> Snapshot:
        values = [
            sum(counters[p * COUNTERS + slot] for p in range(config.processes))
            for slot in range(COUNTERS)
        ]
        deliveries, recorded, absorbed, redispatched, runs_done = values
        elapsed = time.perf_counter() - started
        return Snapshot(deliveries, recorded, absorbed, redispatched, runs_done, elapsed)

    try:
        for index in range(config.processes):
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(
                target=scheduler_process,
                args=(config, index, counters, sender, os.getpid()),
                name=f"control-store-demo-scheduler-{index}",
                daemon=True,
            )
            # SIGINT blocked for good in the child: it ignores Ctrl-C (the parent owns it, see
            # scheduler_process), and one that came while it was still importing raised
            # KeyboardInterrupt there, a traceback after the demo's one line.
            with _blocked(signal.SIGINT):
                child.start()
            sender.close()  # the child holds its end; EOF then means the child is gone
            processes.append(child)
            pipes.append(receiver)
        reports: list[ProcessReport | None] = [None] * len(processes)
        while True:
            for index, pipe in enumerate(pipes):
                reports[index] = _receive(pipe, reports[index])
            if not any(p.is_alive() for p in processes):
                break
            on_progress(snapshot())
            await asyncio.sleep(0.1)
        for index, pipe in enumerate(pipes):
            reports[index] = _receive(pipe, reports[index])
        for process in processes:
            process.join()
    finally:
        for process in processes:  # only ours, and only if still running (interrupted)
            if process.is_alive():
                process.terminate()
                process.join(_TERMINATE_WAIT)
                if process.is_alive():  # SIGTERM still ignored: it was not yet past its start
                    process.kill()
                    process.join()
        for pipe in pipes:
            pipe.close()
    final = snapshot()
    on_progress(final)
    exit_codes = [p.exitcode for p in processes]
    missing = ProcessReport(error="exited without reporting (killed, or crashed)")
    return FleetResult(final, [r or missing for r in reports], exit_codes)


async def requeue_stranded(store: Store, runs: Sequence[Run]) -> int:
    """Queue again those of ``runs`` left 'running', once every scheduler process of the demo
    is gone (run_fleet ends them all before it returns or raises): nobody works on them now.
    README's recipe for the runs of a dead scheduler, with its guard, on the demo's own runs
    only. Returns how many it queued. A list, not a generator: release_runs tells the caller
    of a generator it consumed to make it again, which means nothing to the demo's user."""
    if not runs:
        return 0
    return await store.release_runs([run.id for run in runs])


async def held_runs(store: Store, runs: Sequence[Run]) -> int:
    """How many of ``runs`` are 'running': a read, which goes on while another connection
    holds the write lock that stopped requeue_stranded."""
    ours = {run.id for run in runs}
    return sum([run.id in ours async for run in store.iter_runs(status=RunStatus.RUNNING)])


def _receive(pipe: Connection, current: ProcessReport | None) -> ProcessReport | None:
    if current is not None:
        return current
    try:
        if not pipe.poll():
            return None
        return msgspec.msgpack.decode(pipe.recv_bytes(), type=ProcessReport)
    except (EOFError, OSError):
        return None


async def verify(
    store: Store, config: DemoConfig, runs: Sequence[Run], result: FleetResult
) -> list[Check]:
    """Every invariant of the demo, checked against the database."""
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, ok, detail))

    failed = [
        f"process {i} (exit code {code}): {report.error or 'no error reported'}"
        for i, (report, code) in enumerate(zip(result.reports, result.exit_codes, strict=True))
        if code != 0 or report.error is not None
    ]
    check(
        "every scheduler process finished cleanly",
        not failed,
        "; ".join(failed) or f"{counted(config.processes, 'process', 'processes')} exited 0",
    )

    ids = {str(run.id) for run in runs}
    claims = collections.Counter(i for report in result.reports for i in report.claimed)
    twice = sorted(i for i, n in claims.items() if n > 1)
    unclaimed = sorted(ids - set(claims))
    foreign = sorted(set(claims) - ids)
    check(
        "every run claimed by exactly one scheduler",
        not (twice or unclaimed or foreign),
        _problems(
            [
                ("claimed twice", twice),
                ("claimed by no scheduler that reported", unclaimed),
                ("not ours", foreign),
            ],
            ok=f"{counted(len(ids), 'run')}, {counted(sum(claims.values()), 'claim')}",
        ),
    )

    stored_runs = [await store.get_run(run.id) for run in runs]
    unfinished = [
        f"{run.id} is {stored.status.value} at {stored.done_count}/{stored.job_count}"
        if stored is not None
        else f"{run.id} is missing"
        for run, stored in zip(runs, stored_runs, strict=True)
        if stored is None
        or stored.status is not RunStatus.DONE
        or not stored.done_count == stored.job_count == config.jobs_per_run
    ]
    check(
        "every run done with done_count == job count",
        not unfinished,
        "; ".join(unfinished[:3])
        or f"{len(runs):,}/{counted(len(runs), 'run')} done, "
        f"{counted(config.jobs_per_run, 'job')} each",
    )

    # The jobs are walked a page at a time, as the schedulers walked them: a million jobs
    # cost this check a page of Jobs, not a gigabyte of them, and the loop stays free between
    # pages. Only ids of jobs found wrong are kept.
    firsts = collections.Counter(i for report in result.reports for i in report.first_deliveries)
    stored_jobs = 0
    not_done: list[str] = []
    never: list[str] = []
    overwritten: list[str] = []
    unreadable: list[str] = []  # runs whose walk stopped at a row the store refuses to read
    for run in runs:
        try:
            async for job in store.iter_jobs(run.id):
                stored_jobs += 1
                job_id = str(job.id)
                if job.status is not JobStatus.DONE or not job.outcome:
                    not_done.append(job_id)
                if job_id not in firsts:
                    never.append(job_id)
                if job.outcome is not None and job.outcome != pseudo_outcome(
                    job, 1, config.error_rate
                ):
                    overwritten.append(job_id)
        except CorruptRowError as exc:  # store.check() below names the row and its repair
            unreadable.append(f"{exc.row_id} of run {run.id}")
    counted_twice = sorted(i for i, n in firsts.items() if n > 1)
    check(
        "every job recorded exactly once",
        stored_jobs == config.total_jobs and not (not_done or counted_twice or never),
        _problems(
            [
                ("not done", sorted(not_done)),
                ("recorded twice", counted_twice),
                ("with no first delivery reported", sorted(never)),
            ],
            ok=f"{counted(stored_jobs, 'job')} done, "
            f"{counted(sum(firsts.values()), 'first delivery', 'first deliveries')}",
        )
        if stored_jobs == config.total_jobs
        else _problems(
            [("unreadable jobs, as store.check() below says", unreadable)],
            ok=f"{counted(stored_jobs, 'job')} in the database, expected {config.total_jobs:,}",
        ),
    )
    check(
        "first delivery kept for every job",
        not overwritten,
        _problems([("outcome is not the first delivery", overwritten)], ok="attempt 1 stored"),
    )

    snap = result.snapshot
    recorded = sum(stored.done_count for stored in stored_runs if stored is not None)
    check(
        "every duplicate absorbed",
        snap.absorbed == snap.deliveries - recorded and snap.recorded == recorded,
        f"{counted(snap.absorbed, 'delivery', 'deliveries')} returned False; "
        f"{counted(snap.deliveries, 'delivery', 'deliveries')} - {counted(recorded, 'job')} "
        f"recorded in the database = {snap.deliveries - recorded:,}",
    )

    problems = await store.check()
    check(
        "store.check() finds no problems",
        not problems,
        "; ".join(f"{p.table} {p.row_id}: {p.message}" for p in problems[:3]) or "none",
    )
    return checks


def _problems(found: Sequence[tuple[str, Sequence[str]]], *, ok: str) -> str:
    parts = [f"{len(ids):,} {label} (e.g. {', '.join(ids[:2])})" for label, ids in found if ids]
    return "; ".join(parts) or ok


def new_seed() -> int:
    """A fresh seed, printed by the CLI. It fixes each scheduler's stream of faults; with one
    scheduler and one worker that repeats a run exactly, but with more, which scheduler claims
    which run and which worker takes which job depend on timing, and differ run to run."""
    return uuid.uuid4().int % 1_000_000
