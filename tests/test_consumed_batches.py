"""insert_jobs given a one-shot iterable (a generator): a failed call says whether it consumed it.

A retryable error invites the same call again; with the same generator, consumed by the failed
attempt, that call would insert only what the generator has left (nothing, once it ran to its
end) and succeed, leaving the run short of jobs with nothing to report it. So every error of an
insert_jobs whose one-shot iterable was read says so, and how to retry; one that failed before
reading it (a lock never taken) does not, and the same generator then inserts every job.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import contextlib
import copy
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import pytest

from control_store import (
    AlreadyExistsError,
    ConstraintError,
    ControlError,
    DatabaseBusyError,
    InvalidInputError,
    Job,
    JobOutcome,
    MissingRunError,
    Run,
    StorageError,
    Store,
)

from conftest import group_in_flight, make_jobs, make_run

T = TypeVar("T")
RETRY_WITH_NEW = "a retry must pass a new iterable of the same jobs"

# One-shot iterables of jobs, by their type's name: each is consumed by one reading.
ONE_SHOT: dict[str, Callable[[list[Job]], Iterable[Job]]] = {
    "generator": lambda jobs: (job for job in jobs),
    "map": lambda jobs: map(copy.copy, jobs),
    "list_iterator": iter,
}


async def _execute(store: Store, sql: str) -> list[tuple[object, ...]]:
    """Run ``sql`` on the store's own connection (its per-connection max_page_count)."""
    backend = store._backend
    assert backend is not None
    return await backend.read(lambda conn: conn.execute(sql).fetchall())


async def _nearly_full(store: Store, room: int) -> None:
    """Let the database grow by only ``room`` pages (PRAGMA max_page_count)."""
    [(pages,)] = await _execute(store, "PRAGMA page_count")
    assert isinstance(pages, int)
    await _execute(store, f"PRAGMA max_page_count = {pages + room}")


async def _unlimited(store: Store) -> None:
    await _execute(store, "PRAGMA max_page_count = 1073741823")


@pytest.mark.parametrize("kind", sorted(ONE_SHOT))
async def test_a_full_database_says_the_one_shot_jobs_were_consumed(
    store: Store, kind: str
) -> None:
    """insert_jobs of a one-shot iterable that fills the database part-way: the retryable
    StorageError says the iterable was consumed and the retry needs a new one; retrying with a
    new one stores every job."""
    run = make_run(job_count=3_000)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await _nearly_full(store, 0)
    with pytest.raises(StorageError, match="free space and retry") as caught:
        await store.insert_jobs(ONE_SHOT[kind](jobs))
    assert caught.value.retryable
    message = str(caught.value)
    assert f"one-shot iterable ({kind})" in message  # the iterable's type, as Python names it
    assert RETRY_WITH_NEW in message
    assert isinstance(caught.value.__cause__, sqlite3.Error)  # the driver's error stays chained
    assert await store.list_jobs(run.id) == []
    await _unlimited(store)
    await store.insert_jobs(ONE_SHOT[kind](jobs))
    assert await store.list_jobs(run.id) == jobs
    assert await store.check() == []


async def test_a_list_that_fails_says_nothing_of_consuming(store: Store) -> None:
    """A list can be read again: its error advises retrying the same call, and that works."""
    run = make_run(job_count=3_000)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await _nearly_full(store, 0)
    with pytest.raises(StorageError, match="free space and retry") as caught:
        await store.insert_jobs(jobs)
    assert "one-shot" not in str(caught.value)
    await _unlimited(store)
    await store.insert_jobs(jobs)
    assert await store.list_jobs(run.id) == jobs


def _refused(run: Run, stored: list[Job]) -> dict[str, tuple[type[ControlError], list[Job]]]:
    """Batches for ``run`` (which holds ``stored`` already) that insert_jobs refuses after
    reading some of them, by the error each gets."""
    fresh = make_jobs(run, 2)
    orphan = make_jobs(make_run(), 1)
    return {
        "duplicate id": (AlreadyExistsError, [*fresh, stored[0]]),
        "missing run": (MissingRunError, [*fresh, *orphan]),
        "not a job": (InvalidInputError, [*fresh, "not a job"]),  # type: ignore[list-item]
        "past job_count": (ConstraintError, make_jobs(run, run.job_count)),
    }


@pytest.mark.parametrize("case", ["duplicate id", "missing run", "not a job", "past job_count"])
@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
async def test_every_error_of_a_consumed_generator_says_so(
    store: Store, case: str, grouped: bool
) -> None:
    """Whatever refuses a generator's batch after reading part of it (a duplicate, a missing
    run, a bad item, too many jobs), alone or in a group, its error says the generator was
    consumed; the same batch as a list gets the error without it."""
    run = make_run(job_count=4)
    await store.insert_run(run)
    stored = make_jobs(run, 1)
    await store.insert_jobs(stored)
    error, batch = _refused(run, stored)[case]
    for source, consumed in ((lambda: (job for job in batch), True), (lambda: batch, False)):
        if grouped:
            ahead = await group_in_flight(store)
            other = make_run()
            results = await asyncio.gather(
                store.insert_run(other), store.insert_jobs(source()), return_exceptions=True
            )
            await ahead
            assert results[0] is None
            assert await store.get_run(other.id) == other
            failed = results[1]
        else:
            with pytest.raises(error) as caught:
                await store.insert_jobs(source())
            failed = caught.value
        assert type(failed) is error
        assert ("one-shot iterable (generator)" in str(failed)) is consumed
        assert (RETRY_WITH_NEW in str(failed)) is consumed
    assert await store.list_jobs(run.id) == stored


async def test_a_generator_whose_group_fills_the_database_is_told_it_was_consumed(
    db_path: Path,
) -> None:
    """A generator's insert that succeeded in its group, whose transaction another call's
    insert then ended (a full database): the others run again alone, the generator cannot, and
    its error says it was consumed; the one whose insert filled the database, a generator too,
    says so as well; a list grouped with them commits."""
    async with Store.connect(db_path) as store:
        run, big = make_run(job_count=4), make_run(job_count=20_000)
        for each in (run, big):
            await store.insert_run(each)
        jobs = make_jobs(run)
        await _nearly_full(store, 30)
        ahead = await group_in_flight(store)
        small, too_big, listed = await asyncio.gather(
            store.insert_jobs(job for job in jobs[:2]),
            store.insert_jobs(job for job in make_jobs(big)),
            store.insert_jobs(jobs[2:]),
            return_exceptions=True,
        )
        await ahead
        assert isinstance(small, StorageError)
        assert isinstance(too_big, StorageError)
        assert small.retryable
        assert too_big.retryable
        for failed in (small, too_big):
            assert "one-shot iterable (generator)" in str(failed)
            assert RETRY_WITH_NEW in str(failed)
        assert small is not too_big
        assert listed is None
        assert await store.list_jobs(run.id) == jobs[2:]
        await _unlimited(store)
        await store.insert_jobs(job for job in jobs[:2])  # the generator made again
        assert await store.list_jobs(run.id) == [*jobs[2:], *jobs[:2]]
        assert await store.check() == []


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
async def test_a_lock_never_taken_leaves_the_generator_unread(db_path: Path, grouped: bool) -> None:
    """insert_jobs of a generator refused because another connection holds the write lock
    never read it: the DatabaseBusyError says nothing of consuming it, and retrying with the
    same generator stores every job."""
    async with Store.connect(db_path, busy_timeout=0.05) as store:
        run = make_run(job_count=5)
        await store.insert_run(run)
        jobs = make_jobs(run)
        generator = (job for job in jobs)
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            if grouped:
                ahead = asyncio.ensure_future(store.insert_run(make_run()))
                await asyncio.sleep(0)
                results = await asyncio.gather(
                    store.insert_jobs(generator), ahead, return_exceptions=True
                )
                failed = results[0]
            else:
                with pytest.raises(DatabaseBusyError) as caught:
                    await store.insert_jobs(generator)
                failed = caught.value
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert isinstance(failed, DatabaseBusyError)
        assert "one-shot" not in str(failed)
        await store.insert_jobs(generator)
        assert await store.list_jobs(run.id) == jobs


async def test_an_insert_that_fails_before_taking_a_job_says_nothing_of_its_generator(
    db_path: Path,
) -> None:
    """The insert's statement failing as it is prepared (here the jobs table renamed by hand)
    fails before the first job is taken: the error does not claim the generator was consumed,
    and the generator still holds every job."""
    run = make_run(job_count=3)
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
    with contextlib.closing(sqlite3.connect(db_path)) as other, other:
        other.execute("ALTER TABLE jobs RENAME TO jobs_moved")
    async with Store.connect(db_path) as store:  # a connection that knows the schema as it is
        jobs = make_jobs(run)
        generator = (job for job in jobs)
        with pytest.raises(ControlError) as caught:
            await store.insert_jobs(generator)
        assert "no such table: jobs" in str(caught.value)
        assert RETRY_WITH_NEW not in str(caught.value)
        assert list(generator) == jobs


@pytest.mark.parametrize("kind", [set, collections.deque])
async def test_a_collection_read_by_a_failed_insert_is_not_called_consumed(
    store: Store, kind: Callable[[list[Job]], Iterable[Job]]
) -> None:
    """A collection that is not its own iterator (a set, a deque) is not consumed by being
    read: a failed insert says nothing of it, and the same collection, retried once the cause
    is gone, stores every job."""
    run = make_run(job_count=3)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await store.insert_jobs(jobs[:1])
    batch = kind(jobs)
    with pytest.raises(AlreadyExistsError) as caught:
        await store.insert_jobs(batch)
    assert RETRY_WITH_NEW not in str(caught.value)
    await store.insert_jobs(kind(jobs[1:]))
    assert len(await store.list_jobs(run.id)) == 3
    assert sorted(job.id for job in batch) == sorted(job.id for job in jobs)


RETRY_OUTCOMES = "a retry must pass a new iterable of the same outcomes"


# One-shot batches of outcomes, by the name the error gives them: a generator, and an
# iterable that is no iterator but reads a shared source (_Feed, below).
ONE_SHOT_OUTCOMES: dict[str, Callable[[list[JobOutcome]], Iterable[JobOutcome]]] = {
    "generator": lambda outcomes: (o for o in outcomes),
    "_Feed": lambda outcomes: _Feed(outcomes),
}


@pytest.mark.parametrize("kind", sorted(ONE_SHOT_OUTCOMES))
async def test_record_job_outcomes_of_a_one_shot_batch_says_it_was_consumed(
    db_path: Path, kind: str
) -> None:
    """record_job_outcomes reads its whole batch before it writes: when the write then fails
    (here a lock held past busy_timeout, retryable), the error says the generator (or a
    single-pass iterable that is no iterator) was consumed and the retry needs a new one,
    which records every outcome (the consumed one would record nothing and return []); the
    same batch as a list gets no such note, and retrying with the list itself works."""
    one_shot = ONE_SHOT_OUTCOMES[kind]
    async with Store.connect(db_path, busy_timeout=0.05) as store:
        run = make_run(job_count=3)
        await store.insert_run(run)
        jobs = make_jobs(run)
        await store.insert_jobs(jobs)
        outcomes = [JobOutcome(job.id, score=1.0) for job in jobs]
        other = sqlite3.connect(db_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(DatabaseBusyError) as from_one_shot:
                await store.record_job_outcomes(run.id, one_shot(outcomes))
            with pytest.raises(DatabaseBusyError) as from_list:
                await store.record_job_outcomes(run.id, outcomes)
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert from_one_shot.value.retryable
        assert f"one-shot iterable ({kind})" in str(from_one_shot.value)
        assert RETRY_OUTCOMES in str(from_one_shot.value)
        assert isinstance(from_one_shot.value.__cause__, sqlite3.Error)
        assert RETRY_OUTCOMES not in str(from_list.value)
        assert await store.record_job_outcomes(run.id, one_shot(outcomes)) == [True] * 3
        assert await store.record_job_outcomes(run.id, outcomes) == [False] * 3


async def test_record_job_outcomes_refusing_an_item_of_a_generator_says_it_was_consumed(
    store: Store,
) -> None:
    """An outcome the store cannot keep, taken from a generator, refuses the batch, naming the
    item; the generator gave up the items before it and that one, so the error says so too.
    What the generator raises itself still reaches the caller as it is."""
    run = make_run(job_count=2)
    await store.insert_run(run)
    jobs = make_jobs(run)
    await store.insert_jobs(jobs)
    good = JobOutcome(jobs[0].id, score=1.0)
    bad = JobOutcome(jobs[1].id, score=float("nan"))
    with pytest.raises(InvalidInputError, match="finite") as caught:
        await store.record_job_outcomes(run.id, iter([good, bad]))
    assert "one-shot iterable (list_iterator)" in str(caught.value)
    assert RETRY_OUTCOMES in str(caught.value)
    own = ValueError("the worker's own feed broke")

    def feed() -> Iterable[JobOutcome]:
        yield good
        raise own

    with pytest.raises(ValueError, match="feed broke") as raised:
        await store.record_job_outcomes(run.id, feed())
    assert raised.value is own
    assert (await store.get_run(run.id)) == run  # nothing recorded by either


class _Feed(Generic[T]):
    """A single-pass iterable that is not an iterator: its ``__iter__`` is a generator over one
    shared source (a file, a queue, a cursor), so each iter() goes on where the last stopped."""

    def __init__(self, items: Iterable[T]) -> None:
        self._source = iter(items)

    def __iter__(self) -> Iterator[T]:
        yield from self._source


async def test_a_single_pass_iterable_that_is_no_iterator_is_told_it_was_consumed(
    store: Store,
) -> None:
    """insert_jobs of an object whose __iter__ reads a shared source, failing part-way with a
    retryable StorageError: the error says the iterable was consumed, since retrying with the
    same object would insert only the jobs it has left, and succeed."""
    run = make_run(job_count=3_000)
    await store.insert_run(run)
    jobs = make_jobs(run)
    feed = _Feed(jobs)
    await _nearly_full(store, 0)
    with pytest.raises(StorageError) as caught:
        await store.insert_jobs(feed)
    assert "one-shot iterable (_Feed)" in str(caught.value)
    assert RETRY_WITH_NEW in str(caught.value)
    await _unlimited(store)
    await store.insert_jobs(_Feed(jobs))
    assert await store.list_jobs(run.id) == jobs


class _Progress:
    """A progress bar over an iterable, of tqdm's shape: ``__len__`` (its total),
    ``__contains__`` and an ``__iter__`` that is a generator over the wrapped iterable. A
    Collection to isinstance(), yet wrapping a generator, each iter() goes on with it."""

    def __init__(self, iterable: Iterable[object], total: int) -> None:
        self.iterable, self.total = iterable, total

    def __len__(self) -> int:
        return self.total

    def __contains__(self, item: object) -> bool:
        return item in self.__iter__()

    def __iter__(self) -> Iterator[object]:
        yield from self.iterable


class _SizedStream:
    """An iterator that knows its length (a reader of a counted source): one-shot, as every
    iterator is, though its __len__ and __contains__ make it a Collection to isinstance()."""

    def __init__(self, items: list[object]) -> None:
        self._items, self._count = iter(items), len(items)

    def __iter__(self) -> _SizedStream:
        return self

    def __next__(self) -> object:
        return next(self._items)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, item: object) -> bool:
        return False


# Iterables that isinstance() calls a Collection, yet one reading consumes.
SIZED_ONE_SHOT: dict[str, Callable[[list[Job]], Iterable[object]]] = {
    "_Progress": lambda jobs: _Progress((job for job in jobs), total=len(jobs)),
    "_SizedStream": lambda jobs: _SizedStream(list(jobs)),
}


@pytest.mark.parametrize("kind", sorted(SIZED_ONE_SHOT))
async def test_a_sized_one_shot_iterable_is_told_it_was_consumed(store: Store, kind: str) -> None:
    """insert_jobs(tqdm(generator, total=n)), or of an iterator with a __len__, failing
    part-way on a full disk: the error must say the jobs were consumed, or the retry with the
    same object inserts only the jobs left, and succeeds, leaving the run short of jobs for
    good (check() clean). (At 735ad3e the iterator was told; the Collection rule lost it.)"""
    run = make_run(job_count=3_000)
    await store.insert_run(run)
    jobs = SIZED_ONE_SHOT[kind](make_jobs(run))
    assert isinstance(jobs, collections.abc.Collection)
    await _nearly_full(store, 0)
    with pytest.raises(StorageError) as caught:
        await store.insert_jobs(jobs)
    assert f"one-shot iterable ({kind})" in str(caught.value)
    assert RETRY_WITH_NEW in str(caught.value)
