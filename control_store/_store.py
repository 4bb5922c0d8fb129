"""The public ``Store``: validates arguments, then hands each call to the backend."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
import warnings
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Sized,
)
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypedDict, TypeVar, Unpack, cast

from . import _codec, _sqlite
from ._show import is_a, shown, typed
from .errors import (
    ConfigurationError,
    ControlError,
    InvalidInputError,
    ReadOnlyStoreError,
    StoreClosedError,
)
from .models import Job, JobOutcome, Problem, Run, RunStatus

__all__ = ["ConnectOptions", "MigrationState", "Store"]

MigrationState = _sqlite.MigrationState


# The records that hold another's id, by the field that holds it: (record, id of what).
_HOLDING: dict[tuple[type, str], str] = {
    (Job, "run"): "job.run_id",
    (JobOutcome, "job"): "outcome.job_id",
}


def _id(value: object, *, what: str) -> str:
    """An id argument (``run_id`` or ``job_id``)'s canonical text; refused, with the fix, if it
    is no uuid.UUID."""
    if type(value) is uuid.UUID:  # the common case, without building the fix below
        try:
            return _codec.uuid_text(value)
        except _codec.UNSET_OR_UNREADABLE:  # a slot holding no 128-bit number: explained below
            pass
    owner = what.removesuffix("_id")
    kind = type(value)
    if (kind, owner) in _HOLDING:  # a record that holds the id meant
        otherwise = f"pass {_HOLDING[kind, owner]}, not the {kind.__name__} itself"
    elif is_a(value, Run) or is_a(value, Job):  # the record where its id was meant
        otherwise = f"pass {owner}.id, not the {kind.__name__} itself"
    else:
        otherwise = f"pass the {owner}'s id (a uuid.UUID), e.g. {owner}.id"
    return _codec.check_uuid(value, what=what, otherwise=otherwise)


_INT64_MAX = 2**63 - 1


# A list or a tuple is an iterable of items, never one item itself, nor an iterator.
_PLAIN_BATCHES = frozenset({list, tuple})


def _check_batch(
    value: object, *, what: str, item: type[object], single: str, nothing: str = "stored"
) -> None:
    """Refuse a batch argument ``what`` that is not an iterable of ``item``s.

    One ``item`` is not a batch of them, nor is a str or bytes: an iterable, but of characters
    or ints, each of which would be refused as "expected a Job, got str: 'a'", blaming an item
    the caller never made. ``single``: the fix for one item; ``nothing``: what nothing was
    ("stored", "given back").
    """
    if type(value) in _PLAIN_BATCHES:  # the common case: a batch, whatever it holds
        return
    # By type, never isinstance(), which reads __class__: an object can fake any class there
    # (and then fail that class's methods), or make reading it raise.
    name = item.__name__
    if any(is_a(value, kind) for kind in (str, bytes, bytearray, memoryview)):
        raise InvalidInputError(
            f"{what} must be an iterable of {name}, got a {typed(value)}, which iterates over "
            f"its characters (or bytes); nothing was {nothing}: pass a list of {name}"
        )
    if is_a(value, item) or not is_a(value, Iterable):
        raise InvalidInputError(
            f"{what} must be an iterable of {name}, got {type(value).__name__}; nothing was "
            f"{nothing}: {_not_iterable_fix(value, item, single)}"
        )


def _not_iterable_fix(value: object, item: type[object], single: str) -> str:
    """The fix for a batch argument that is not a plain iterable: ``single`` for one item."""
    if hasattr(type(value), "__aiter__"):  # an async generator: the batch is read on a thread
        return (
            "collect an async iterator first, e.g. [x async for x in it], or pass its items a "
            "list at a time"
        )
    if is_a(value, Awaitable):
        return "await it first: this is a coroutine or other awaitable, not the items"
    if is_a(value, item):
        return single
    if item is uuid.UUID and is_a(value, Run):
        return "pass [run.id]: a list of the runs' ids, not a Run"
    return f"pass a list (or any iterable) of {item.__name__}"


def _int_from(value: object, low: int, high: int) -> int | None:
    """``value`` as a plain int if it is an int (not a bool) from ``low`` to ``high`` (a count
    argument), else None. A subclass's plain value, compared and used as that: its own
    comparisons could raise, or lie (a limit of -1 is no limit to SQLite)."""
    if not is_a(value, int) or is_a(value, bool):
        return None
    plain = int.__index__(value)
    return plain if low <= plain <= high else None


# Calls touching at most this many rows are "small": an in-memory store may run them inline on
# the event loop's thread (about 1 ms at most), where bigger ones go to the worker thread.
_SMALL_BATCH = 256


# iter_jobs' and iter_runs' page sizes: at least one row; at most a page whose decoded rows
# stay a few tens of MB even with large outputs, which is what bounding the walk's memory is for.
_MAX_PAGE_SIZE = 100_000


def _page_size(page_size: object, *, rows: str) -> int:
    """A walk's ``page_size``, checked; ``rows``: what a page holds, for the message."""
    size = _int_from(page_size, 1, _MAX_PAGE_SIZE)
    if size is None:
        raise InvalidInputError(
            f"page_size must be an int from 1 to {_MAX_PAGE_SIZE}, got {shown(page_size)}; "
            f"pages of a few hundred to a few thousand {rows} amortise each read's thread hop"
        )
    return size


def _status_key(status: object) -> str | None:
    """list_runs' and iter_runs' ``status``, checked, as the SQL binds it (None: every run)."""
    if status is None:
        return None
    return _codec.run_status(status, what="status", also=", or None for every run").value


T = TypeVar("T")
K = TypeVar("K")  # a walk's key: the last row read, to continue after


class _Walk(Generic[T, K]):
    """The iterator iter_jobs and iter_runs return: rows one page (one read) at a time.

    A plain async iterator, not an async generator: between pages it holds only the current
    page and the key to continue after, so a loop that breaks early or a task cancelled
    mid-walk leaves nothing to finalise, and nothing open in the database. ``page(after)``
    is the read of the page after key ``after`` (None: the first page); it returns the page's
    items and the key to continue after.
    """

    __slots__ = ("_after", "_finished", "_items", "_page", "_page_size", "_store")

    def __init__(
        self,
        store: Store,
        page: Callable[[K | None], _sqlite.Op[tuple[list[T], K | None]]],
        page_size: int,
    ) -> None:
        self._store = store
        self._page = page
        self._page_size = page_size
        self._after: K | None = None  # the key of the last row read; None: from the first
        self._items: Iterator[T] = iter(())
        self._finished = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        for item in self._items:
            return item
        while not self._finished:
            backend = self._store._open()
            if backend.unmigrated is not None:
                await backend.refuse_unmigrated()
            # The state moves only once the page is in hand: a read that fails or is cancelled
            # leaves the walk where it was, and iterating again reads the same page again.
            items, after = await backend.read(
                self._page(self._after), small=self._page_size <= _SMALL_BATCH
            )
            self._after = after
            # A short page is the last one: every later row comes after all those read.
            self._finished = len(items) < self._page_size
            self._items = iter(items)
            for item in self._items:
                return item
        raise StopAsyncIteration


def _current_task() -> asyncio.Task[Any] | None:
    """The task running, None outside one (or outside a running event loop)."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop
        return None


class _NotAStoreYet(ConfigurationError, AttributeError):
    """A Store's attribute asked of what Store.connect() returns, before it was awaited: a
    ControlError, as every error of the store is, and an AttributeError, as hasattr() and
    getattr(x, name, default) expect of a missing attribute."""


class _Connecting(Coroutine[Any, Any, "Store"]):
    """What ``Store.connect`` returns: ``await`` it for a store, or ``async with`` it.

    It is a coroutine to asyncio (a ``collections.abc.Coroutine``), so ``create_task``,
    ``TaskGroup.create_task`` and ``asyncio.run`` take it as they take a coroutine; each
    ``await``, and each task made of it, opens a store of its own.
    """

    __slots__ = ("_entered", "_options", "_running", "_url", "_used")

    def __init__(self, url: str | os.PathLike[str], options: dict[str, Any]) -> None:
        self._url = url
        self._options = options
        # The stores opened by ``async with`` and not yet closed, with the task that entered
        # each, in the order entered: one Store.connect(...) may be entered by several tasks
        # at once, or nested in one, and each exit closes the store its own enter opened.
        self._entered: list[tuple[asyncio.Task[Any] | None, Store]] = []
        # The coroutine each task steps through send()/throw() (None: stepped outside a task),
        # until it ends; made at the task's first step, so a Store.connect(...) never awaited
        # or run leaves no "never awaited" warning behind. One per task: a second task made
        # of the same Store.connect(...) stepped the first one's, or one that had finished
        # ("cannot reuse already awaited coroutine").
        self._running: dict[asyncio.Task[Any] | None, Coroutine[Any, Any, Store]] = {}
        # Whether it was ever awaited, run, entered or closed: one dropped unused is a
        # forgotten await (a bare `Store.connect(url)` statement), which a coroutine warns of.
        self._used = False

    def __del__(
        self,
        _warn: Callable[..., None] = warnings.warn,
        _shown: Callable[[object], str] = shown,
        _memory: str = _sqlite.MEMORY_URL,
        _redact: Callable[[str], str] = _sqlite.redact,
    ) -> None:
        # The defaults are bound at definition: at interpreter exit this module's
        # globals may be gone (None) before this runs (see SqliteBackend.__del__).
        if getattr(self, "_used", True):
            return
        url = self._url
        # A URL's password is shown as ***, as every error of the store shows it (README).
        shown_url = _shown(_redact(url) if isinstance(url, str) else url)
        made = "Store.in_memory()" if url is _memory else f"Store.connect({shown_url})"
        _warn(
            f"{made} was never awaited, so no store was opened: use store = await "
            "Store.connect(url), or async with Store.connect(url) as store",
            RuntimeWarning,
            stacklevel=2,
            source=self,
        )

    async def _open(self) -> Store:
        options = _sqlite.parse_options(self._options)
        backend = await _sqlite.SqliteBackend.open(self._url, options)
        return Store(backend)

    def __await__(self) -> Generator[Any, None, Store]:
        self._used = True
        return self._open().__await__()

    if not TYPE_CHECKING:  # to a type checker, a store's method on this is the error it is

        def __getattr__(self, name: str) -> Any:
            # A forgotten await (store = Store.connect(url); await store.get_run(...)) was
            # Python's bare "'_Connecting' object has no attribute 'get_run'".
            if name.startswith("_") or not hasattr(Store, name):
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
                )
            error = _NotAStoreYet(
                f"{name!r} is an attribute of a Store, and this is not one yet: Store.connect() "
                "and Store.in_memory() return what opens one; use store = await "
                "Store.connect(url), or async with Store.connect(url) as store"
            )
            error.name, error.obj = name, self
            self._used = True  # the forgotten await is told here, not again when it is dropped
            raise error

    def _step(self, step: Callable[[Coroutine[Any, Any, Store]], Any]) -> Any:
        self._used = True
        task = _current_task()
        running = self._running.get(task)
        if running is None:
            running = self._running[task] = self._open()
        try:
            return step(running)
        except BaseException:  # StopIteration (its store) included: that coroutine has ended
            self._running.pop(task, None)
            raise

    def send(self, value: Any) -> Any:
        return self._step(lambda running: running.send(value))

    def throw(self, *args: Any) -> Any:
        return self._step(lambda running: running.throw(*args))

    def close(self) -> None:
        self._used = True  # as a coroutine closed unstarted: no warning
        running = self._running.pop(_current_task(), None)
        if running is not None:
            running.close()

    async def __aenter__(self) -> Store:
        self._used = True
        store = await self._open()
        self._entered.append((asyncio.current_task(), store))
        return store

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The innermost store this task entered. An exit may run in another task than its
        # enter (a pytest-asyncio fixture's teardown, an AsyncExitStack closed elsewhere):
        # then the last store entered by a task that has ended, whose block can no longer
        # exit itself; else the last entered by any task. An async with's exit must close one.
        task = asyncio.current_task()
        entered = self._entered
        mine = [i for i, (by, _) in enumerate(entered) if by is task]
        ended = [i for i, (by, _) in enumerate(entered) if by is None or by.done()]
        if entered:
            _, store = entered.pop((mine or ended or [-1])[-1])
            await store.close()


class ConnectOptions(TypedDict, total=False):
    """The keyword options of ``Store.connect`` and ``Store.in_memory``, as a type checker
    sees them (README, "Connecting"), and the type of a dict of them passed as ``**options``.

    Every value is still checked when the store connects (a wrong one, or an unknown name, is
    a ``ConfigurationError``): this lets ``mypy`` see a misspelt option or a wrong type first.
    """

    busy_timeout: float
    synchronous: Literal["FULL", "NORMAL", "EXTRA", "OFF", "full", "normal", "extra", "off"]
    migrate: bool
    read_only: bool


class Store:
    """The durable control plane: runs, their jobs, atomic claims, idempotent outcomes.

    Open one with ``await Store.connect(url)`` or ``async with Store.connect(url) as store``.
    ``async with store`` closes the store on exit; it never means "commit": every call is
    its own committed transaction by the time it returns.
    """

    def __init__(self, backend: _sqlite.SqliteBackend) -> None:
        if not isinstance(backend, _sqlite.SqliteBackend):  # Store(url): a natural first guess
            raise ConfigurationError(
                f"Store() takes the store's backend, which Store.connect makes, not "
                f"{typed(backend)}; nothing was opened: open a store with "
                "'await Store.connect(url)' or 'async with Store.connect(url) as store'"
            )
        self._backend: _sqlite.SqliteBackend | None = backend
        self._closed: _sqlite.SqliteBackend | None = None  # once closing: what close() awaits

    @staticmethod
    def connect(url: str | os.PathLike[str], **options: Unpack[ConnectOptions]) -> _Connecting:
        """Open the store at ``url``, creating the file and migrating it as needed.

        URLs: ``sqlite://relative/path.db``, ``sqlite:///absolute/path.db``, ``sqlite::memory:``,
        or a plain path (a str or a ``pathlib.Path``), which names a file. Only
        ``sqlite::memory:`` (or ``Store.in_memory()``) opens an in-memory database: the path
        ``:memory:``, which SQLite would silently open as one, is a ``ConfigurationError``
        (``./:memory:`` names a file of that name).

        Options: ``busy_timeout`` (seconds to wait for another process's write lock, default
        5), ``synchronous`` (``"FULL"``, the default, survives power loss; ``"NORMAL"``
        survives a process crash), ``migrate`` (apply pending migrations at connect, default
        True; False leaves them to ``store.migrate()``, and calls raise
        ``PendingMigrationError`` until then, or until another process has migrated the file:
        each refused call reads the schema's state again; a file holding an edited, unknown
        or failed migration is refused at connect, as a migrating connect refuses it),
        ``read_only`` (default False; see below).

        ``read_only=True`` opens an existing file for reading only, through SQLite's
        ``mode=ro``: it never creates the file (a missing one is a ``ConfigurationError``),
        never changes its journal mode, never migrates, and every write method raises
        ``ReadOnlyStoreError`` before touching the database. The schema must be exactly at
        this library's newest migration: an older one is a ``PendingMigrationError``, a newer
        one an ``UnknownMigrationError``. A database in WAL mode (every store's) can be read
        only where SQLite finds or may create its -wal and -shm files (README, "Read-only
        stores").
        """
        return _Connecting(url, dict(options))

    @staticmethod
    def in_memory(**options: Unpack[ConnectOptions]) -> _Connecting:
        """A store on a private in-memory database (``sqlite::memory:``)."""
        return _Connecting(_sqlite.MEMORY_URL, dict(options))

    async def __aenter__(self) -> Self:
        # A closed store, or one of another event loop or process: refused here, before the
        # block runs, not at its first call (or at the exit's close()).
        self._connected().refuse_foreign()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def read_only(self) -> bool:
        """True if the store was opened with ``read_only=True`` (and refuses every write); it
        stays so once the store is closed."""
        backend = self._backend or self._closed
        return backend is not None and backend.read_only

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._backend is None

    async def close(self) -> None:
        """Finish the calls in flight, then close the connection. Idempotent.

        Raises StorageError, the store closed all the same, if the pages a failed call's COMMIT
        left in the -wal could not be voided (see the README's "Errors"): the next open may
        apply that call.

        Only from the event loop that opened the store (else WrongEventLoopError, and the store
        stays open), or, once that loop has closed, from any; in a process forked from the
        opener, it only forgets the inherited copy.
        """
        backend = self._backend or self._closed
        if backend is None:
            return
        # Refused before anything changes: a close() from another thread's loop that marked the
        # store closed while it built its refusal failed the owner's calls meanwhile, and could
        # mark it open again after the owner's own close.
        backend.refuse_foreign_close()
        self._backend, self._closed = None, backend
        await backend.close()  # a second close waits for the first (see backend.close)

    def _interrupt(self) -> None:
        """Fail the SQLite statement running now, also while the store closes (the CLI's stop
        signals: a closing store may still wait for a long read); nothing if none runs."""
        backend = self._backend or self._closed
        if backend is not None:
            backend.interrupt()

    def _open(self) -> _sqlite.SqliteBackend:
        """The backend, for a call that needs this library's schema: refused on a closed store.

        On a store opened with migrate=False whose schema was unfit (``backend.unmigrated``),
        the call must then ``await backend.refuse_unmigrated()``, which reads the schema's
        state again (another process may have migrated the file since): that takes a read, so
        it cannot be done here, and every async call does it right after this one. Only the
        attribute test is paid on a store whose schema is current.
        """
        return self._connected()

    def _connected(self) -> _sqlite.SqliteBackend:
        """The backend, whatever its schema: for migrate() and migration_status()."""
        if self._backend is None:
            where = "" if self._closed is None else f" on {self._closed.database}"
            raise StoreClosedError(
                f"the store{where} is closed; open a new one with Store.connect(url)"
            )
        return self._backend

    def _writable(self, method: str) -> _sqlite.SqliteBackend:
        """The backend, for a write: refused at once, before any SQL, on a read-only store."""
        backend = self._open()
        if backend.read_only:
            raise ReadOnlyStoreError(
                f"{method}() writes, and this store on {backend.database} was opened with "
                "read_only=True; nothing was written: connect again without read_only "
                "(Store.connect(url)) to write"
            )
        return backend

    async def insert_run(self, run: Run, *, jobs: Iterable[Job] | None = None) -> None:
        """Store a new run. A run with the same id is refused (``AlreadyExistsError``).

        With ``jobs``, the run and all its jobs in one transaction: exactly ``job_count`` jobs,
        each of this run (else ``ConstraintError``, ``InvalidInputError``), any iterable, as
        insert_jobs takes it. Nothing is inserted unless all of it is, so no claim ever hands
        out the run short of jobs, whatever happens to the caller meanwhile.
        """
        backend = self._writable("insert_run")
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        params = _codec.run_params(run)
        if jobs is None:
            await backend.write(partial(_sqlite.op_insert_run, params), small=True)
            return
        _check_batch(jobs, what="jobs", item=Job, single="wrap a single job in a list")
        await backend.write(_sqlite.insert_run_with_jobs_op(params, jobs))

    async def get_run(self, run_id: uuid.UUID) -> Run | None:
        """The run with this id, or None."""
        backend = self._open()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        key = _id(run_id, what="run_id")
        return await backend.read(partial(_sqlite.op_get_run, key), small=True)

    async def insert_jobs(self, jobs: Iterable[Job]) -> None:
        """Store jobs in one transaction: all of them, or none on any error.

        Any iterable works, a generator included; it is consumed on the store's worker thread,
        in bounded memory, so it must not touch the event loop. A call given an iterator (a
        generator) that fails after it took a job says so in its error, whatever its class: a
        retry must pass a new iterable of the same jobs, since the consumed one would insert
        only what it has left.
        """
        backend = self._writable("insert_jobs")
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        _check_batch(jobs, what="jobs", item=Job, single="wrap a single job in a list")
        if type(jobs) in _PLAIN_BATCHES and not jobs:  # nothing to write: no commit, no fsync
            backend.admit()  # refused as the call would be (another loop, a fork, closing)
            return
        await backend.write(_sqlite.insert_jobs_op(jobs))

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        """The job with this id, or None."""
        backend = self._open()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        key = _id(job_id, what="job_id")
        return await backend.read(partial(_sqlite.op_get_job, key), small=True)

    async def list_jobs(self, run_id: uuid.UUID) -> list[Job]:
        """The jobs of a run, in the order they were inserted (empty if there are none)."""
        backend = self._open()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        key = _id(run_id, what="run_id")
        return await backend.read(lambda conn: _sqlite.op_list_jobs(key, conn))

    def iter_jobs(self, run_id: uuid.UUID, *, page_size: int = 1000) -> AsyncIterator[Job]:
        """The jobs of a run, as ``list_jobs`` orders them, read ``page_size`` at a time.

        ``async for job in store.iter_jobs(run_id): ...`` walks a run of any size in memory
        bounded by ``page_size``. The order is list_jobs' order, insertion order (SQLite's
        rowid), and a walk resumes each page after the last rowid of the page before (keyset
        pagination): each page is one read, one thread hop, of at most ``page_size`` rows,
        decoded as list_jobs decodes them. An unknown run, like a run with no jobs, yields
        nothing (as list_jobs returns []).

        Each page is its own snapshot, not the whole walk: a walk concurrent with writers
        yields every job that existed when it began exactly once, in the state it had when
        its page was read; a job inserted during the walk is yielded at most once. Counting
        over a walk while outcomes are being recorded can thus mix moments.

        Nothing is held open between pages, so breaking out of the loop or cancelling the task
        mid-walk needs no cleanup. A row this version cannot read raises the CorruptRowError
        naming it when the walk reaches its page; an error leaves the walk where it was.
        ``page_size`` is checked here, when the walk is created (``InvalidInputError``). A
        walk is for one task: tasks sharing one may read the same page twice; start one each.
        On a store opened with ``migrate=False`` whose schema is behind (or holds an edited,
        unknown or failed migration), the first page raises the ``MigrationError`` (each page
        reads the schema's state afresh until it is current, as every call does).
        """
        self._open()
        key = _id(run_id, what="run_id")
        size = _page_size(page_size, rows="jobs")
        return _Walk(self, lambda after: partial(_sqlite.op_job_page, key, after, size), size)

    def iter_runs(
        self, *, status: RunStatus | None = None, page_size: int = 1000
    ) -> AsyncIterator[Run]:
        """Runs as ``list_runs`` orders them (newest first), only those with ``status`` if
        given, read ``page_size`` at a time.

        ``async for run in store.iter_runs(): ...`` walks any number of runs in memory bounded
        by ``page_size``, as iter_jobs walks a run's jobs, with the same rules: each page is one
        read of its own snapshot, resuming after the (created_at, rowid) of the last run read
        (keyset pagination: range seeks in an index, so the last page costs what the first
        does, also across runs sharing one created_at); every run that existed when the walk
        began is yielded once (one with ``status`` while it still has it when its page is
        read), in its state then; a run inserted during the walk is yielded at most once (only
        if created before the walk's position). Nothing is held open between pages, a failed
        or cancelled page leaves the walk where it was, ``status`` and ``page_size`` are
        checked when the walk is created (``InvalidInputError``), and a walk is for one task.
        """
        self._open()
        key = _status_key(status)
        size = _page_size(page_size, rows="runs")
        return _Walk(self, lambda after: partial(_sqlite.op_run_page, key, after, size), size)

    async def claim_next_run(self) -> Run | None:
        """Atomically move the oldest queued run to running and return it; None if none.

        No two claimers, in this process or any other on the same database, get the same run.
        """
        backend = self._writable("claim_next_run")
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        return await backend.write(
            _sqlite.op_claim_next_run, small=True, undo=_sqlite.release_claimed
        )

    async def record_job_outcome(self, run_id: uuid.UUID, outcome: JobOutcome) -> bool:
        """Record a job's outcome once; True if newly recorded, False for a redelivery.

        In one transaction: the job becomes done only if it belongs to ``run_id`` and is not
        done yet; only then the run's ``done_count`` advances, and the run becomes done when
        every job is. An outcome for an unknown job (``NotFoundError``) or another run's job
        (``WrongRunError``) changes nothing.
        """
        backend = self._writable("record_job_outcome")
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        run_key = _id(run_id, what="run_id")
        try:
            job_key, payload = _codec.outcome_params(outcome)
        except InvalidInputError:
            given: object = outcome
            if type(given) not in _PLAIN_BATCHES:
                raise
            # Only on the refusal, not on every call: a list of outcomes meant for the batch.
            raise InvalidInputError(
                f"record_job_outcome takes one JobOutcome, got a {type(given).__name__} of "
                f"{len(cast(Sized, given))}; nothing was recorded: for several outcomes of one "
                "run, call record_job_outcomes(run_id, outcomes)"
            ) from None
        op = partial(_sqlite.op_record_outcome, run_key, job_key, payload)
        return await backend.write(op, small=True)

    async def claim_runs(self, limit: int) -> list[Run]:
        """Atomically move up to ``limit`` of the oldest queued runs to running; oldest first.

        One statement under one write lock: the batch is all-or-nothing, and no run is ever in
        two claimers' batches. Returns fewer than ``limit`` runs (or []) when fewer are queued.
        """
        backend = self._writable("claim_runs")
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        count = _int_from(limit, 1, _INT64_MAX)
        if count is None:
            raise InvalidInputError(
                f"limit must be an int from 1 to {_INT64_MAX}, got {shown(limit)}; "
                "use claim_next_run() for a single run"
            )
        op = partial(_sqlite.op_claim_runs, count)
        return await backend.write(op, small=count <= _SMALL_BATCH, undo=_sqlite.release_claimed)

    async def release_runs(self, run_ids: Iterable[uuid.UUID]) -> int:
        """Queue again runs this caller claimed and will not finish (a scheduler shutting down,
        a task cancelled after its claim returned); return how many were given back.

        One transaction, the same guarded UPDATE a cancelled claim's give-back runs: only a
        run still ``running`` goes back to ``queued``, in its place by ``created_at``; a run
        done meanwhile (its workers outlived the claim), or queued, is left as it is. Only
        for runs this caller holds: a run given back while another scheduler works on it
        would be handed to two schedulers.
        """
        backend = self._writable("release_runs")
        # Before the ids are read: a call refused from another loop or process, or on a closing
        # store, must leave the caller's generator as it was, for the retry it is told.
        backend.admit()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        _check_batch(
            run_ids,
            what="run_ids",
            item=uuid.UUID,
            single="wrap a single id in a list",
            nothing="given back",
        )
        one_shot = _sqlite.one_shot(run_ids)
        try:
            keys = list(dict.fromkeys(_id(run_id, what="run_id") for run_id in run_ids))
            if not keys:
                return 0
            return await backend.release(_sqlite.GiveBack(keys))
        except ControlError as exc:
            if not one_shot:
                raise
            told = _sqlite.consumed(exc, type(run_ids).__name__, items="run ids", verb="give back")
        raise told from told.__cause__

    async def record_job_outcomes(
        self, run_id: uuid.UUID, outcomes: Iterable[JobOutcome]
    ) -> list[bool]:
        """Record many outcomes of one run in one transaction; one bool per outcome, in order.

        Each outcome follows ``record_job_outcome``'s rules: True if newly recorded, False for
        a redelivery (including a job id that appears earlier in the same batch: the first
        occurrence wins and the job counts once). All or nothing: an outcome for an unknown job
        (``NotFoundError``) or another run's job (``WrongRunError``), or one that cannot be
        stored (``InvalidInputError``), records none of the batch. The whole batch is read
        before anything is written: any error of a call given an iterator (a generator) says
        that it was consumed, since a retry with it would record nothing, and succeed.
        """
        backend = self._writable("record_job_outcomes")
        # Before the outcomes are read: a call refused from another loop or process, or on a
        # closing store, must leave the caller's generator as it was, for the retry it is told.
        backend.admit()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        run_key = _id(run_id, what="run_id")
        _check_batch(
            outcomes,
            what="outcomes",
            item=JobOutcome,
            single="wrap a single outcome in a list, or call record_job_outcome",
        )
        # Encoded here, before the hop: a bad outcome anywhere fails the call with nothing sent.
        # That reads the whole batch: an iterator's every error from here on says it was
        # consumed (see _sqlite.consumed), or a retry with it would record nothing, and succeed.
        one_shot = _sqlite.one_shot(outcomes)
        rows: list[tuple[str, str]] = []
        raised: Exception | None = None
        failed: ControlError | None = None
        try:
            _codec.outcomes_params(_sqlite.guarded(outcomes), rows)  # one by one
        except InvalidInputError as exc:  # the codec's, refusing the item after those in rows
            _codec.in_batch(exc, "outcomes", len(rows))
            failed = exc
        except _sqlite.RaisedByCaller as exc:
            raised = exc.raised
        if raised is not None:  # raised here, outside the handler, it keeps its own context
            raise raised
        if not rows and failed is None:  # nothing to send
            return []
        try:
            if failed is not None:
                raise failed
            op = partial(_sqlite.op_record_outcomes, run_key, rows)
            return await backend.write(op, small=len(rows) <= _SMALL_BATCH)
        except ControlError as exc:
            if not one_shot:
                raise
            told = _sqlite.consumed(exc, type(outcomes).__name__, items="outcomes", verb="record")
        raise told from told.__cause__  # outside the handler: the error alone, as raised

    async def list_runs(
        self, *, status: RunStatus | None = None, limit: int | None = None
    ) -> list[Run]:
        """Runs, newest first; only those with ``status`` if given, at most ``limit``."""
        backend = self._open()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        key = _status_key(status)
        most = -1 if limit is None else _int_from(limit, 0, _INT64_MAX)  # -1: SQLite's no limit
        if most is None:
            raise InvalidInputError(
                f"limit must be an int from 0 to {_INT64_MAX} or None, got {shown(limit)}; "
                "pass the most runs you want, or None (the default) for all of them"
            )
        op = partial(_sqlite.op_list_runs, key, most)
        return await backend.read(op, small=0 <= most <= _SMALL_BATCH)

    async def check(self) -> list[Problem]:
        """Look for inconsistencies without changing anything; [] means the store is sound.

        Two read snapshots: the integrity check, then the schema and the rows. Each
        ``Problem`` names the table and the row's id, and its message ends with the repair.
        The repairs that set or rewrite a value agree with each other: after all of them the
        next check finds nothing. Repairs that restore, delete or re-index rows may reveal
        more: check again after them. It finds:

        - lines of SQLite's ``PRAGMA integrity_check`` (table "database"): an index missing or
          holding extra entries (repair: ``REINDEX``), a duplicate in a UNIQUE index, a NULL
          in a NOT NULL column, damaged pages (repair: restore a backup, or ``.recover``). If
          there is any, the row checks below are skipped, with a finding saying so: they read
          through the damaged structures;
        - a run or job id stored as UUID text in another spelling than the canonical
          lower-case hyphenated one, which lookups by id cannot find: to rewrite, or, when
          that id is taken, a second copy to delete;
        - a job whose run does not exist (or whose run_id spells its run's id otherwise); past
          the first 100 jobs with one run_id, the rest in one finding, with their DELETE;
        - a value this version cannot read (the column, the value, what was expected);
        - a run whose done_count differs from its jobs with an outcome, whose job_rows differs
          from its jobs, that has more jobs than its job_count, that has job_count 0 and is not
          done, whose jobs are all done but is not 'done', or that is 'done' with jobs left;
        - a job whose status disagrees with its outcome ('done' exactly when it has one).

        A run is judged by its jobs with an outcome, never by its stored done_count, which may
        be the very thing at fault. Findings come in an order in which each repair can be made
        as written: those naming rows by their ids as stored first, the repairs of ids
        (unreadable or to rewrite) and copies to delete last.
        """
        backend = self._open()
        if backend.unmigrated is not None:
            await backend.refuse_unmigrated()
        op, abandon = _sqlite.abandonable(_sqlite.op_check)
        try:
            return await backend.read(op)
        except asyncio.CancelledError:
            abandon()  # its caller is gone: free the store's thread for the calls after it
            raise

    async def migrate(self) -> list[int]:
        """Apply pending migrations, in order; return the versions applied ([]: none pending).

        Connect does this unless ``migrate=False``; on such a store, calls needing the schema
        raise ``PendingMigrationError`` until this ran (or the ``MigrationError`` of an edited,
        unknown or failed migration, which this raises too). Refused on a read-only store
        (``ReadOnlyStoreError``).
        """
        backend = self._connected()
        if backend.read_only:
            self._writable("migrate")  # raises ReadOnlyStoreError, naming the method
        applied = await backend.read(backend.migrate_op())  # withdrawn if cancelled queued
        backend.unmigrated = None
        return applied

    async def migration_status(self) -> list[MigrationState]:
        """Every migration this library has, with when it was applied (None: pending)."""
        backend = self._connected()
        return await backend.read(backend.migration_status_op())


async def connect_any_version(url: str | os.PathLike[str], *, busy_timeout: float) -> Store:
    """A read-only store that accepts a schema of any version (no migration check).

    Only for listing migrations (the CLI's ``migrate --status``) on a database that may be
    behind: its other reads assume the newest schema, which is why ``read_only=True`` alone
    refuses any other version.
    """
    options = _sqlite.parse_options({"busy_timeout": busy_timeout, "read_only": True})
    unchecked = dataclasses.replace(options, check_schema=False)
    return Store(await _sqlite.SqliteBackend.open(url, unchecked))
