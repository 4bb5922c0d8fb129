"""A store serves the event loop that opened it; calls from any other loop are refused.

Before the refusal, a store shared by threads running their own loops left some of their calls
waiting forever, and once one of those loops closed with a call in flight, aiosqlite's worker
thread died completing it and every later call, on any loop, waited forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from control_store import Job, JobOutcome, Run, Store, WrongEventLoopError

from _loops import LOOP
from conftest import (
    CALL_TIMEOUT,
    HANG_GUARD_SECONDS,
    WORKERS,
    held_by_no_connection,
    held_store,
    make_jobs,
    make_run,
    one_call_of_each_kind,
    raw_db,
)


async def test_the_tests_run_on_the_event_loop_asked_for() -> None:
    """`nox -s uvloop` runs the suite on uvloop (CONTROL_STORE_LOOP=uvloop): this fails if the
    request were lost and the suite ran on asyncio's own loop without a word."""
    assert type(asyncio.get_running_loop()).__module__.split(".")[0] == LOOP


def test_worker_processes_run_on_the_event_loop_asked_for() -> None:
    """So do the worker processes the multi-process, crash and fault tests start."""
    worker = subprocess.run(
        [sys.executable, str(WORKERS), "event-loop"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
        check=True,
    )
    assert worker.stdout.strip().split(".")[0] == LOOP


def _calls(store: Store, run: Run) -> dict[str, Callable[[], Awaitable[object]]]:
    """One call of each kind, and close()."""
    return {**one_call_of_each_kind(store, run), "close": lambda: store.close()}


async def _refused(calls: dict[str, Callable[[], Awaitable[object]]]) -> dict[str, str]:
    """What each call raised (by type name), each given CALL_TIMEOUT seconds."""
    raised: dict[str, str] = {}
    for name, call in calls.items():
        try:
            await asyncio.wait_for(call(), CALL_TIMEOUT)
            raised[name] = "returned"
        except Exception as exc:  # the test compares what was raised
            raised[name] = type(exc).__name__
    return raised


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "sqlite::memory:" if request.param == "memory" else str(tmp_path / "control.db")


async def test_calls_from_another_threads_loop_are_refused_and_change_nothing(url: str) -> None:
    """Every call from a thread's own event loop is a WrongEventLoopError; nothing is written,
    and the store goes on serving its own loop, close() included."""
    async with Store.connect(url) as store:
        run = make_run()
        await store.insert_run(run)
        raised: dict[str, str] = {}
        thread = threading.Thread(
            target=lambda: raised.update(asyncio.run(_refused(_calls(store, run))))
        )
        thread.start()
        await asyncio.to_thread(thread.join)

        assert raised == dict.fromkeys(_calls(store, run), "WrongEventLoopError")
        assert await store.list_runs() == [run]
        assert await store.list_jobs(run.id) == []
        # Writes, alone and grouped, still work here.
        await asyncio.gather(*(store.insert_run(make_run()) for _ in range(8)))
        assert len(await store.list_runs()) == 9
        assert await store.check() == []


async def test_a_close_refused_from_another_loop_never_closes_the_store_meanwhile(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close() from another thread's loop is refused before it changes anything: it marked
    the store closed while it built its refusal (the owner's calls meanwhile failed with
    StoreClosedError, measured: most of 20,000), then marked it open again, which after the
    owner's own close() left a closed store reading as open. Here the refusal is held until
    the owner has looked."""
    async with Store.connect(url) as store:
        run = make_run()
        await store.insert_run(run)
        backend = store._backend
        assert backend is not None
        owner, refuse = asyncio.get_running_loop(), backend.refuse_foreign
        inside, go = threading.Event(), threading.Event()

        def held_refusal() -> None:
            if asyncio.get_running_loop() is not owner:
                inside.set()
                go.wait(CALL_TIMEOUT)
            refuse()

        monkeypatch.setattr(backend, "refuse_foreign", held_refusal)
        raised: list[BaseException] = []

        def close_from_another_loop() -> None:
            try:
                asyncio.run(store.close())
            except BaseException as exc:  # the test looks at it
                raised.append(exc)

        thread = threading.Thread(target=close_from_another_loop)
        thread.start()
        try:
            assert await asyncio.to_thread(inside.wait, CALL_TIMEOUT)
            assert not store.closed
            assert await store.get_run(run.id) == run
        finally:
            go.set()
            await asyncio.to_thread(thread.join)
        assert [type(exc) for exc in raised] == [WrongEventLoopError]
        assert not store.closed
        assert await store.get_run(run.id) == run
    assert store.closed


async def test_a_batch_refused_from_another_loop_leaves_its_generator_unread(url: str) -> None:
    """A batch call from another loop (or on a closing store) is refused before its items are
    read: the caller's generator is as it was, for the retry through the store's own loop
    that the error tells of, which then records them all."""
    async with Store.connect(url) as store:
        run = make_run(job_count=2)
        jobs = make_jobs(run, 2)
        await store.insert_run(run, jobs=jobs)
        pulled: list[JobOutcome] = []

        def outcomes() -> Iterator[JobOutcome]:
            for job in jobs:
                pulled.append(outcome := JobOutcome(job.id, score=1.0))
                yield outcome

        given = outcomes()
        raised: list[BaseException] = []

        def from_another_loop() -> None:
            try:
                asyncio.run(store.record_job_outcomes(run.id, given))
            except BaseException as exc:  # the test looks at it
                raised.append(exc)

        thread = threading.Thread(target=from_another_loop)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert [type(exc) for exc in raised] == [WrongEventLoopError]
        assert pulled == []
        assert await store.record_job_outcomes(run.id, given) == [True, True]


async def test_async_with_from_another_threads_loop_is_refused_before_its_block(
    url: str,
) -> None:
    """`async with store` from another loop raises WrongEventLoopError on entry: the block
    never runs (it used to, and only the exit's close() refused), and the store stays open."""
    async with Store.connect(url) as store:
        entered: list[bool] = []

        async def enter() -> None:
            async with store:
                entered.append(True)

        raised: list[BaseException] = []

        def elsewhere() -> None:
            try:
                asyncio.run(enter())
            except BaseException as exc:  # the test compares what was raised
                raised.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert entered == []
        (error,) = raised
        assert isinstance(error, WrongEventLoopError)
        assert await store.list_runs() == []  # still open, on its own loop


async def test_a_call_from_inside_a_job_generator_says_it_came_from_the_stores_thread(
    url: str,
) -> None:
    """A generator given to insert_jobs runs on the store's own thread; a call it makes there
    (through a loop of its own) is refused with that said, not with the advice for other loops
    (submit to the store's loop), which would wait forever there. Nothing is inserted."""
    async with Store.connect(url) as store:
        run = make_run(job_count=2)
        await store.insert_run(run)
        jobs = make_jobs(run)

        def generated() -> Iterator[Job]:
            yield jobs[0]
            asyncio.run(store.get_run(run.id))
            yield jobs[1]

        with pytest.raises(WrongEventLoopError, match="came from the store's own thread") as caught:
            await store.insert_jobs(generated())
        assert "run_coroutine_threadsafe" not in str(caught.value)
        assert await store.list_jobs(run.id) == []


async def test_another_thread_reaches_the_store_through_its_own_loop(url: str) -> None:
    """The supported way from another thread: submit the call to the store's loop."""
    async with Store.connect(url) as store:
        run = make_run()
        await store.insert_run(run)
        loop = asyncio.get_running_loop()

        def from_thread() -> Run | None:
            return asyncio.run_coroutine_threadsafe(store.get_run(run.id), loop).result(
                CALL_TIMEOUT
            )

        assert await asyncio.to_thread(from_thread) == run


def test_a_store_is_refused_in_a_later_asyncio_run_and_closes_on_its_own_loop(url: str) -> None:
    """A store kept past the loop run that opened it is refused in the next asyncio.run, with
    the fix in the message, close() included; back on its own loop it works and closes."""
    own = asyncio.new_event_loop()
    try:

        async def open_store() -> tuple[Store, Run]:
            store = await Store.connect(url)
            run = make_run()
            await store.insert_run(run)
            return store, run

        store, run = own.run_until_complete(open_store())
        with pytest.raises(
            WrongEventLoopError,
            match=r"opened on another event loop than the one calling it .*nothing was done: "
            r"connect a Store in each event loop .*asyncio\.run_coroutine_threadsafe",
        ):
            asyncio.run(store.get_run(run.id))
        raised = asyncio.run(_refused(_calls(store, run)))
        assert raised == dict.fromkeys(_calls(store, run), "WrongEventLoopError")
        assert own.run_until_complete(store.list_runs()) == [run]
        own.run_until_complete(store.close())
    finally:
        own.close()


def test_a_store_whose_loop_has_closed_is_closed_from_any_loop(url: str) -> None:
    """A store opened by one asyncio.run, which has ended: its calls are refused, saying that its
    loop closed and that close() works from any loop; close() from a later loop closes it (the
    worker ends, the file is let go), with no warning, and a store connected again finds what
    the first wrote."""
    run = make_run()

    async def open_store() -> Store:
        store = await Store.connect(url)
        await store.insert_run(run)
        return store

    store = asyncio.run(open_store())
    backend = store._backend
    assert backend is not None
    worker = backend._conn._thread
    with pytest.raises(
        WrongEventLoopError,
        match=r"opened on an event loop that has closed since .*nothing was done: connect a "
        r"Store in this loop, and close this one with 'await store.close\(\)' \(from any loop",
    ):
        asyncio.run(store.get_run(run.id))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        asyncio.run(store.close())
        assert store.closed
        asyncio.run(store.close())  # idempotent, as ever
        del store, backend
        gc.collect()
    assert [w for w in seen if w.category is ResourceWarning] == []
    worker.join(CALL_TIMEOUT)
    assert not worker.is_alive()
    if url != "sqlite::memory:":
        assert held_by_no_connection(Path(url))

        async def reopen() -> list[Run]:
            async with Store.connect(url) as again:
                return await again.list_runs()

        assert asyncio.run(reopen()) == [run]


def test_concurrent_closes_after_the_loop_closed_each_return_once_the_file_is_closed(
    tmp_path: Path,
) -> None:
    """Two close()s from a later loop, while the worker still runs what the closed loop gave
    it: each returns only once the worker has closed the file and ended, as a second close()
    does on the store's own loop (it used to return at once, the file still open)."""
    path = tmp_path / "control.db"
    release = threading.Event()
    store = asyncio.run(Store.connect(path))
    backend = store._backend
    assert backend is not None
    worker = backend._conn._thread
    backend._conn._tx.put_nowait((None, lambda: release.wait(CALL_TIMEOUT)))  # busy
    alive_at_return: list[bool] = []

    async def close() -> None:
        await store.close()
        alive_at_return.append(worker.is_alive())

    async def both() -> None:
        closing = [asyncio.ensure_future(close()) for _ in range(2)]
        await asyncio.sleep(0.05)  # both are waiting, the worker still busy
        assert alive_at_return == []
        release.set()
        await asyncio.gather(*closing)

    asyncio.run(both())
    assert alive_at_return == [False, False]
    assert held_by_no_connection(path)


@contextlib.contextmanager
def _unraisable() -> Iterator[list[str]]:
    """What finalizers and the garbage collector raised inside the block, where nothing can
    catch it ("Exception ignored in ..."). asyncio's RuntimeWarning for an abandoned
    coroutine that never finished is expected there, and ignored."""
    raised: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda info: raised.append(f"{info.exc_type.__name__}: {info.exc_value}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield raised
    finally:
        sys.unraisablehook = hook


def test_claims_abandoned_by_a_closed_loop_end_quietly_when_collected(tmp_path: Path) -> None:
    """A loop closed by hand with claims still pending (not cancelled), the store then closed
    from a later loop: the abandoned calls, closed by the garbage collector outside any loop,
    raise nothing inside the store (they used to fail starting the next group, "no running
    event loop", or waking waiters on the closed loop, as "Exception ignored" tracebacks)."""
    path = tmp_path / "control.db"
    loop = asyncio.new_event_loop()
    try:

        async def setup() -> Store:
            store = await Store.connect(path)
            for _ in range(30):
                await store.insert_run(make_run())
            return store

        async def claimer(store: Store) -> None:
            while await store.claim_next_run() is not None:
                pass

        store = loop.run_until_complete(setup())
        tasks = [loop.create_task(claimer(store)) for _ in range(8)]
        for _ in range(3):
            loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    asyncio.run(store.close())
    with _unraisable() as raised:
        del tasks, store, loop
        gc.collect()
    assert raised == []


def test_writes_queued_behind_a_group_of_a_closed_loop_end_quietly_when_collected(
    tmp_path: Path,
) -> None:
    """A loop closed by hand while a group of writes runs on the thread and more wait behind
    it: once the store is closed from a later loop and the abandoned calls are collected,
    the group's task ends without raising (it used to complete the waiting callers' futures
    on the closed loop: "RuntimeError: Event loop is closed")."""
    path = tmp_path / "control.db"
    hold_first, hold_group = threading.Event(), threading.Event()
    loop = asyncio.new_event_loop()
    try:
        store = loop.run_until_complete(Store.connect(path))
        backend = store._backend
        assert backend is not None
        queue = backend._conn._tx
        queue.put_nowait((None, lambda: hold_first.wait(CALL_TIMEOUT)))
        tasks = [loop.create_task(store.insert_run(make_run()))]  # to the thread, held
        loop.run_until_complete(asyncio.sleep(0))
        queue.put_nowait((None, lambda: hold_group.wait(CALL_TIMEOUT)))  # after the first
        tasks += [loop.create_task(store.insert_run(make_run())) for _ in range(2)]
        loop.run_until_complete(asyncio.sleep(0))  # both wait for the first to end
        hold_first.set()
        loop.run_until_complete(tasks[0])  # its end starts the group, held on the thread
        for _ in range(3):
            loop.run_until_complete(asyncio.sleep(0))
        assert backend._flusher is not None
        tasks += [loop.create_task(store.insert_run(make_run())) for _ in range(2)]
        loop.run_until_complete(asyncio.sleep(0))  # queued behind the group
        assert len(backend._pending) == 2
    finally:
        loop.close()
    hold_group.set()
    asyncio.run(store.close())
    with _unraisable() as raised:
        del tasks, store, backend, loop, queue
        gc.collect()
    assert raised == []


def test_a_loop_closed_with_a_call_in_flight_leaves_the_worker_thread_running(
    tmp_path: Path,
) -> None:
    """asyncio.run ending while a call runs on the worker thread: its result has no one to go
    to and is dropped, and the thread lives on (it used to die with a traceback, so that the
    store's own close, when collected, waited forever); collecting the store stops it."""
    release = threading.Event()
    in_flight: list[asyncio.Future[object]] = []

    async def start() -> tuple[Store, threading.Thread]:
        store = await Store.connect(tmp_path / "control.db")
        backend = store._backend
        assert backend is not None
        in_flight.append(asyncio.ensure_future(backend.read(lambda c: release.wait(CALL_TIMEOUT))))
        await asyncio.sleep(0)  # the call is on the worker's queue when the loop ends
        return store, backend._conn._thread

    store, thread = asyncio.run(start())  # the loop closes with the call still pending
    backend = store._backend
    assert backend is not None
    release.set()
    after = threading.Event()  # runs on the worker after the call has been delivered
    backend._conn._tx.put_nowait((None, after.set))
    assert after.wait(CALL_TIMEOUT)
    assert thread.is_alive()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del store, backend
        gc.collect()
    messages = [str(w.message) for w in seen if w.category is ResourceWarning]
    del seen  # a recorded warning keeps the backend, and so the thread's connection, alive
    gc.collect()
    assert any("was never closed" in m for m in messages), messages
    thread.join(CALL_TIMEOUT)
    assert not thread.is_alive()


def _collect_until(done: Callable[[], bool]) -> bool:
    """Collect garbage until ``done()``, for at most CALL_TIMEOUT seconds: a task abandoned in
    a reference cycle is found by the collector, then its coroutine closes, then the worker
    it waited on ends, each step on its own schedule."""
    for _ in range(int(CALL_TIMEOUT / 0.05)):
        gc.collect()
        if done():
            return True
        threading.Event().wait(0.05)
    return False


def test_a_call_left_pending_by_a_loop_closed_without_cancelling_it_lets_its_worker_end(
    tmp_path: Path,
) -> None:
    """A loop run by hand (run_until_complete, stopped by Ctrl-C, then close()) ends without
    cancelling its tasks, one of them a connect still waiting for its worker. Once the
    abandoned task is collected, the worker closes the connection and ends: the file is not
    held for the rest of the process. (The worker kept the call's future in a local while it
    waited for the next call, which kept the task alive for good.)"""
    path = tmp_path / "control.db"
    before = set(threading.enumerate())
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(Store.connect(path))
        loop.run_until_complete(asyncio.sleep(0))  # the task's first step queues the open
        (worker,) = [t for t in threading.enumerate() if t not in before]
        # The open ends on the worker, and its result waits for a loop pass that never comes.
        assert not task.done()
    finally:
        loop.close()
    del task, loop
    assert _collect_until(lambda: not worker.is_alive())
    assert held_by_no_connection(path)  # the connection was closed


def test_a_store_whose_loop_closed_without_cancelling_its_call_warns_when_dropped(
    tmp_path: Path,
) -> None:
    """The same, with a connected store whose write was in flight: the write commits, and
    once the abandoned task (which held the store) is collected, the store is dropped
    unclosed: it warns, naming its database, and its worker ends."""
    path = tmp_path / "control.db"
    run = make_run()
    loop = asyncio.new_event_loop()
    try:
        on = held_store(loop, path)  # the write is still queued when the loop closes
        worker = on.worker
        task = loop.create_task(on.store.insert_run(run))
        loop.run_until_complete(asyncio.sleep(0))
        assert not task.done()
    finally:
        loop.close()
    on.hold.set()
    del on, task, loop
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _collect_until(lambda: not worker.is_alive())
    ours = [str(w.message) for w in seen if w.category is ResourceWarning]
    del seen
    assert len(ours) == 1, ours
    assert "was never closed" in ours[0]
    assert str(path) in ours[0]
    with raw_db(path) as conn:  # the write went on to commit before the worker ended
        assert conn.execute("SELECT id FROM runs").fetchall() == [(str(run.id),)]
