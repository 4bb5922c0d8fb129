"""Messages about a caller's values: any value refused is a ControlError that shows it safely,
names the field and says what to pass instead, and nothing changes."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
import pytest

from control_store import (
    ConfigurationError,
    ConstraintError,
    ControlError,
    EvalJob,
    InvalidInputError,
    Job,
    JobId,
    JobOutcome,
    MigrationError,
    Run,
    RunId,
    RunStatus,
    Store,
)
from control_store._show import shown
from control_store.models import _RunFields

from conftest import SHIPPED, follow_advice, make_jobs, make_run, raw_db

# Past Python's 4300-digit limit on int-to-text conversion: str() or repr() of it raises
# "ValueError: Exceeds the limit (4300 digits) for integer string conversion".
HUGE = 10**5000
TRACKING = "_control_store_migrations"


class _BadRepr:
    """A value whose __repr__ raises."""

    def __repr__(self) -> str:
        raise RuntimeError("repr broke")


class _LyingStr(str):
    """A str subclass whose isascii() says True of any text."""

    def isascii(self) -> bool:
        return True


class _UnhashableStatus(str):
    """A str subclass whose __hash__ raises (so does any dict or enum lookup of it)."""

    def __hash__(self) -> int:
        raise RuntimeError("hash broke")


class _UniterableList(list[str]):
    """A list subclass whose __iter__ raises."""

    def __iter__(self) -> Any:
        raise RuntimeError("iter broke")


def _any_run(*args: Any, **fields: Any) -> Run:
    """A Run of fields its hints do not admit, as a caller without a type checker makes one."""
    return Run(*args, **fields)


async def _snapshot(store: Store) -> tuple[list[Run], list[list[Job]]]:
    runs = await store.list_runs()
    return runs, [await store.list_jobs(run.id) for run in runs]


async def _walk(store: Store, run_id: uuid.UUID, page_size: Any) -> list[Job]:
    return [job async for job in store.iter_jobs(run_id, page_size=page_size)]


def _calls_taking(
    value: Any, store: Store, run: Run, job: Job
) -> dict[str, Callable[[], Awaitable[object]]]:
    """Every int-taking argument of the public API, given ``value``."""
    return {
        "Run.epochs": lambda: store.insert_run(Run("m", ["a"], value, 1)),
        "Run.job_count": lambda: store.insert_run(Run("m", ["a"], 1, value)),
        "Run.done_count": lambda: store.insert_run(Run("m", ["a"], 1, 1, done_count=value)),
        "Job.attempt": lambda: store.insert_jobs(
            [Job(run.id, EvalJob("a", "t", 0), attempt=value)]
        ),
        "EvalJob.epoch": lambda: store.insert_jobs([Job(run.id, EvalJob("a", "t", value))]),
        "JobOutcome.score": lambda: store.record_job_outcome(run.id, JobOutcome(job.id, value)),
        "claim_runs(limit)": lambda: store.claim_runs(value),
        "list_runs(limit=)": lambda: store.list_runs(limit=value),
        "iter_jobs(page_size=)": lambda: _walk(store, run.id, value),
        "connect(busy_timeout=)": lambda: Store.in_memory(busy_timeout=value),
    }


_INT_ARGUMENTS = list(_calls_taking(0, None, make_run(), None))  # type: ignore[arg-type]


@pytest.mark.parametrize("argument", _INT_ARGUMENTS)
async def test_an_int_too_long_to_print_is_refused_by_its_size(store: Store, argument: str) -> None:
    """An int of more than 4300 digits, which str() refuses to print, is a ControlError that
    gives its size instead of a raw ValueError; nothing changes."""
    run = make_run(2)
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    before = await _snapshot(store)
    with pytest.raises(ControlError, match="an int of about 5001 digits"):
        await _calls_taking(HUGE, store, run, job)[argument]()
    assert await _snapshot(store) == before


@pytest.mark.parametrize("argument", _INT_ARGUMENTS)
async def test_a_value_whose_repr_raises_is_refused_by_its_type(
    store: Store, argument: str
) -> None:
    """A value whose __repr__ raises, passed where an int is expected, is a ControlError that
    names its type; the __repr__'s own exception does not escape, and nothing changes."""
    run = make_run(2)
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    before = await _snapshot(store)
    with pytest.raises(ControlError, match=r"a _BadRepr whose repr\(\) raised RuntimeError"):
        await _calls_taking(_BadRepr(), store, run, job)[argument]()
    assert await _snapshot(store) == before


async def test_every_kind_of_argument_with_a_broken_repr_is_refused(store: Store) -> None:
    """Ids, records, batches, text fields, statuses and the URL: a value whose __repr__ raises
    is refused as a ControlError naming the field, wherever it is passed."""
    run = make_run(2)
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    before = await _snapshot(store)
    bad: Any = _BadRepr()
    calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("expected a Run", lambda: store.insert_run(bad)),
        ("Run.id", lambda: store.insert_run(Run("m", ["a"], 1, 1, id=bad))),
        ("manifest", lambda: store.insert_run(Run(bad, ["a"], 1, 1))),
        ("models[0]", lambda: store.insert_run(Run("m", [bad], 1, 1))),
        ("models", lambda: store.insert_run(Run("m", bad, 1, 1))),
        ("status", lambda: store.insert_run(Run("m", ["a"], 1, 1, status=bad))),
        ("created_at", lambda: store.insert_run(Run("m", ["a"], 1, 1, created_at=bad))),
        ("expected a Job", lambda: store.insert_jobs([bad])),
        ("spec", lambda: store.insert_jobs([Job(run.id, bad)])),
        ("spec.model", lambda: store.insert_jobs([Job(run.id, EvalJob(bad, "s", 0))])),
        ("expected a JobOutcome", lambda: store.record_job_outcome(run.id, bad)),
        ("JobOutcome.job_id", lambda: store.record_job_outcome(run.id, JobOutcome(bad))),
        ("output", lambda: store.record_job_outcome(run.id, JobOutcome(job.id, output=bad))),
        ("run_id", lambda: store.get_run(bad)),
        ("status", lambda: store.list_runs(status=bad)),
        ("expected a URL string or a path", lambda: Store.connect(bad)),
        ("synchronous=", lambda: Store.in_memory(synchronous=bad)),
    ]
    for field, call in calls:
        with pytest.raises(ControlError, match=r"a _BadRepr whose repr\(\) raised") as caught:
            await call()
        assert field in str(caught.value), (field, str(caught.value))
    assert await _snapshot(store) == before


class _HostileText(str):
    """Text whose own methods raise: only its plain text may be used."""

    def _boom(self, *args: object, **kwargs: object) -> Any:
        raise RuntimeError("hostile")

    replace = strip = upper = lower = startswith = __getitem__ = __repr__ = _boom


class _RaisingZone(tzinfo):
    """A time zone whose utcoffset() raises."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise RuntimeError("no offset")

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)

    def tzname(self, dt: datetime | None) -> str:
        return "raising"


class _ComparesBadly(float):
    """A number whose comparisons raise: only its plain value may be compared."""

    def _boom(self, other: object) -> bool:
        raise RuntimeError("hostile")

    __lt__ = __le__ = __gt__ = __ge__ = _boom


async def test_values_whose_own_methods_raise_are_used_by_their_plain_value(store: Store) -> None:
    """A str or float subclass is read by its plain value, so its own methods never run: an
    id in such text is told to wrap exactly that text, a synchronous level or busy_timeout of
    such a kind works. A time zone that raises, or a UUID subclass holding no value, is an
    InvalidInputError naming the field, never the raw error."""
    text = str(uuid.uuid4())
    with pytest.raises(InvalidInputError, match=rf"wrap it as uuid\.UUID\('{text}'\)"):
        await store.get_run(_HostileText(text))  # type: ignore[arg-type]
    async with Store.in_memory(
        synchronous=_HostileText("normal"),  # type: ignore[arg-type]
        busy_timeout=_ComparesBadly(2.5),
    ) as other:
        assert await other.list_runs() == []
    async with Store.connect(_HostileText("sqlite::memory:")) as other:  # startswith() raises
        assert await other.list_runs() == []
    with pytest.raises(InvalidInputError, match=r"created_at .* its time zone raised RuntimeError"):
        await store.insert_run(
            Run("m", ["a"], 1, 1, created_at=datetime(2026, 1, 1, tzinfo=_RaisingZone()))
        )
    empty = _EmptyId.__new__(_EmptyId)
    with pytest.raises(InvalidInputError, match=r"Run\.id is a _EmptyId that holds no value"):
        await store.insert_run(Run("m", ["a"], 1, 1, id=RunId(empty)))
    assert await store.list_runs() == []


class _LyingInt(int):
    """An int whose comparisons lie (every one says yes) and whose bit_length() raises."""

    def _yes(self, other: object) -> bool:
        return True

    def bit_length(self) -> int:
        raise RuntimeError("hostile")

    __lt__ = __le__ = __gt__ = __ge__ = _yes


class _LyingTime(datetime):
    """A datetime whose isoformat() tells another time."""

    def isoformat(self, sep: str = "T", timespec: str = "auto") -> str:
        return "1999-01-01T00:00:00.000000+00:00"


async def test_counts_scores_and_times_are_read_by_their_plain_value(store: Store) -> None:
    """A limit, page size or score whose comparisons lie is judged by its value (-1 is no
    limit to SQLite: refused, not taken for one); a huge one whose bit_length() raises is
    still shown; a datetime subclass's own isoformat() is not what is stored."""
    run = make_run(1)
    await store.insert_run(run)
    for call in (
        lambda: store.claim_runs(_LyingInt(-1)),
        lambda: store.list_runs(limit=_LyingInt(-1)),
        lambda: store.iter_jobs(run.id, page_size=_LyingInt(0)).__anext__(),
    ):
        with pytest.raises(InvalidInputError, match=r"must be an int from"):
            await call()
    assert (await store.get_run(run.id)) == run  # not claimed
    (job,) = make_jobs(run, 1)
    await store.insert_jobs([job])
    with pytest.raises(InvalidInputError, match=r"score is an int of about \d+ digits"):
        await store.record_job_outcome(run.id, JobOutcome(job.id, score=_LyingInt(2**200 + 1)))
    when = _LyingTime(2024, 1, 1, tzinfo=UTC)
    timed = Run("m", ["a"], 1, 1, created_at=when)
    await store.insert_run(timed)
    stored = await store.get_run(timed.id)
    assert stored is not None
    assert stored.created_at == datetime(2024, 1, 1, tzinfo=UTC)


class _ZoneClaimingTime(datetime):
    """A datetime whose tzinfo attribute claims a zone its value does not hold."""

    tzinfo = property(lambda self: UTC)


class _OneOffTime(datetime):
    """A datetime subclass that can be made once: a conversion making another of its type
    (astimezone does) raises."""

    made = False

    def __new__(cls, *args: Any, **kwargs: Any) -> _OneOffTime:
        if cls.made:
            raise RuntimeError("no second instance")
        cls.made = True
        return super().__new__(cls, *args, **kwargs)


class _ShiftyOutcome(JobOutcome, frozen=True):
    """An outcome whose job_id names one job at first and another from its third read on."""

    def __getattribute__(self, name: str) -> Any:
        if name == "job_id":
            _SHIFTY_READS.append(None)
            return _SHIFTY_IDS[len(_SHIFTY_READS) >= 3]
        return super().__getattribute__(name)


_SHIFTY_READS: list[None] = []
_SHIFTY_IDS: list[uuid.UUID] = []


def _faking(kind: type) -> Any:
    """An object that claims to be a ``kind`` (isinstance() reads its __class__)."""

    class Fake:
        __class__ = property(lambda self: kind)

    return Fake()


def _hostile(*args: object) -> Any:
    raise ValueError("hostile")


class _UnreadableId(uuid.UUID):
    """A UUID subclass whose own int raises once made (uuid.UUID.__init__ sets it)."""

    int = property(_hostile, lambda self, value: None)  # type: ignore[misc]


async def test_each_field_of_a_call_is_read_once_and_by_its_own_class(store: Store) -> None:
    """What a call checks is what it stores: a field read again later (a subclass's value
    that changes, a Run changed by the caller's own jobs generator) or through a subclass's
    attribute could store a row no read takes back (a created_at text with no offset, which
    then stopped every claim; an outcome naming another job than its row) or a run short of
    its jobs. An object that fakes its class, or an id whose value cannot be read, is an
    InvalidInputError, never its own exception."""
    with pytest.raises(InvalidInputError, match=r"created_at .* has no time zone"):
        await store.insert_run(Run("m", ["a"], 1, 1, created_at=_ZoneClaimingTime(2026, 1, 1)))
    plus_five = timezone(timedelta(hours=5))
    aware = Run("m", ["a"], 1, 1, created_at=_ZoneClaimingTime(2026, 1, 1, 12, tzinfo=plus_five))
    await store.insert_run(aware)
    stored = await store.get_run(aware.id)
    assert stored is not None
    assert stored.created_at == datetime(2026, 1, 1, 7, tzinfo=UTC)  # the instant, in UTC
    # Converted as a plain datetime: it was refused as "its time zone raised".
    _OneOffTime.made = False
    once = Run("m", ["a"], 1, 1, created_at=_OneOffTime(2026, 1, 1, 12, tzinfo=plus_five))
    await store.insert_run(once)
    stored = await store.get_run(once.id)
    assert stored is not None
    assert stored.created_at == datetime(2026, 1, 1, 7, tzinfo=UTC)

    run = make_run(2)
    first, second = make_jobs(run, 2)
    await store.insert_run(run, jobs=[first, second])
    _SHIFTY_IDS[:] = [first.id, second.id]
    assert await store.record_job_outcome(run.id, _ShiftyOutcome(first.id, score=1.0))
    jobs = {job.id: job for job in await store.list_jobs(run.id)}  # every row reads
    assert jobs[first.id].outcome == JobOutcome(first.id, score=1.0)
    assert jobs[second.id].outcome is None

    short = Run("m", ["a"], 1, 3)

    def shrinking() -> Iterator[Job]:
        yield Job(short.id, EvalJob("a", "0", 0))
        yield Job(short.id, EvalJob("a", "1", 0))
        # A frozen struct changed all the same, by its field's slot (msgspec.structs.
        # force_setattr does this too, from msgspec 0.19 on).
        vars(_RunFields)["job_count"].__set__(short, 2)

    with pytest.raises(ConstraintError, match=r"job_count 3, but insert_run was given 2 jobs"):
        await store.insert_run(short, jobs=shrinking())
    assert await store.get_run(short.id) is None

    fake = JobOutcome(second.id, output=_faking(str))
    unreadable = Job(run.id, EvalJob("a", "2", 0), id=JobId(_UnreadableId(int=2)))
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: store.record_job_outcome(run.id, fake), "output must be a str"),
        (lambda: store.record_job_outcome(run.id, _faking(JobOutcome)), "expected a JobOutcome"),
        (lambda: store.insert_run(Run("m", ["a"], _faking(int), 1)), "epochs must be an int"),
        (
            lambda: store.insert_run(Run("m", ["a"], 1, 1, created_at=_faking(datetime))),
            "created_at must be a datetime",
        ),
        (lambda: store.insert_jobs([_faking(Job)]), "expected a Job"),
        # An int of its own took the value from uuid.UUID's slot, which the store reads.
        (lambda: store.get_run(_UnreadableId(int=1)), "that holds no value"),
        (lambda: store.insert_jobs([unreadable]), "that holds no value"),
    ]
    for call, words in calls:
        with pytest.raises(InvalidInputError, match=words):
            await call()
    assert await store.check() == []


class _RaisingClass:
    """An object whose __class__ raises: isinstance() of it raises too."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("__class__ raised")


class _Proxy:
    """A proxy whose target is gone: every attribute it does not have raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"proxy target gone ({name})")


class _UnmeasurableText(str):
    """Text whose len() raises: a repr() may return one."""

    def __len__(self) -> int:
        raise RuntimeError("len raised")


class _ReprOfUnmeasurableText:
    def __repr__(self) -> str:
        return _UnmeasurableText("<value>")


class _OverflowingId(uuid.UUID):
    """A UUID subclass whose own int is no 128-bit number."""

    int = property(lambda self: 2**200, lambda self, value: None)  # type: ignore[misc]


async def test_arguments_that_fake_or_hide_their_class_are_refused_naming_them(
    store: Store, tmp_path: Path
) -> None:
    """Arguments read by type, never by isinstance(), which reads a __class__ that may claim
    int, list or bool (whose own methods then fail on it) or raise; a batch's fix found without
    the object's own __getattr__; a repr() giving a str subclass read as plain text; an id
    subclass whose number is out of range. Each was a raw TypeError, RuntimeError or
    ValueError (a faked bool for migrate= or read_only= after the file was created); each is
    now the ControlError naming the argument, and nothing is written or created."""
    run = make_run(2)
    await store.insert_run(run)
    before = await _snapshot(store)
    fake_int, fake_list = _faking(int), _faking(list)
    hidden: Any = _RaisingClass()
    proxy: Any = _Proxy()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    odd_repr: Any = _ReprOfUnmeasurableText()
    other = make_run(1)
    overflowing = Job(RunId(_OverflowingId(int=3)), EvalJob("a", "s", 0))
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: store.claim_runs(fake_int), "limit must be an int"),
        (lambda: store.list_runs(limit=fake_int), "limit must be"),
        (lambda: store.iter_jobs(run.id, page_size=fake_int).__anext__(), "page_size must be"),
        (lambda: store.iter_runs(page_size=fake_int).__anext__(), "page_size must be"),
        (lambda: store.insert_jobs(fake_list), "jobs must be an iterable of Job"),
        (lambda: store.record_job_outcomes(run.id, fake_list), "outcomes must be an iterable"),
        (lambda: store.get_run(hidden), "run_id must be a uuid.UUID"),
        (lambda: store.record_job_outcome(hidden, JobOutcome(uuid.uuid4())), "run_id must be"),
        (lambda: store.insert_jobs(hidden), "jobs must be an iterable of Job"),
        (lambda: store.insert_jobs(proxy), "jobs must be an iterable of Job, got _Proxy"),
        (lambda: store.insert_run(other, jobs=proxy), "jobs must be an iterable of Job"),
        (lambda: store.record_job_outcomes(run.id, proxy), "outcomes must be an iterable"),
        (lambda: store.get_run(odd_repr), "run_id must be a uuid.UUID, got "),
        (lambda: store.claim_runs(odd_repr), "limit must be an int"),
        (lambda: store.insert_run(Run("m", ["a"], odd_repr, 1)), "epochs must be an int"),
        (lambda: store.insert_run(other, jobs=[overflowing]), "run_id is a _OverflowingId"),
        (lambda: Store.connect(hidden), "expected a URL string or a path"),
        (lambda: Store.connect(odd_repr), "expected a URL string or a path"),
        (lambda: Store.in_memory(busy_timeout=fake_int), "busy_timeout="),
        (lambda: Store.in_memory(synchronous=_faking(str)), "synchronous="),
        (lambda: Store.connect(fresh / "x.db", migrate=_faking(bool)), "migrate="),
        (lambda: Store.connect(fresh / "x.db", read_only=_faking(bool)), "read_only="),
    ]
    for call, words in calls:
        with pytest.raises(ControlError, match=re.escape(words)):
            await call()
    assert await _snapshot(store) == before
    assert list(fresh.iterdir()) == []


class _RaisingRunId(Job, frozen=True):
    """A Job subclass whose run_id is a property that raises: the struct's own slot still
    holds the value Job(...) was given."""

    @property  # type: ignore[misc]
    def run_id(self) -> uuid.UUID:
        raise RuntimeError("run_id raised")


class _TaggedJob(Job, frozen=True):
    """A Job subclass with a field of its own, which msgspec puts between run_id/spec and id."""

    tag: str = ""


async def test_fields_are_read_from_the_struct_never_through_a_subclass_or_an_unset_slot(
    store: Store,
) -> None:
    """A model's fields are read from its slots: a subclass's property over a field (which
    may raise) is not asked, a field unset through its slot descriptor and an exact
    uuid.UUID made without __init__ are InvalidInputErrors, and insert_run(jobs=) judges a
    job by its type (not isinstance(), which a faked __class__ passes): never the object's
    own AttributeError or RuntimeError, and nothing stored."""
    run = make_run(3)
    await store.insert_run(run)
    hollow = uuid.UUID.__new__(uuid.UUID)  # an exact UUID holding no value
    unset = make_run(1)
    vars(_RunFields)["manifest"].__delete__(unset)
    other = make_run(1)
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: store.insert_run(make_run(1), jobs=[_faking(Job)]), "expected a Job"),
        (lambda: store.insert_run(Run("m", ["a"], 1, 1, id=RunId(hollow))), "holds no value"),
        (
            lambda: store.insert_jobs([Job(run.id, EvalJob("a", "x", 0), id=JobId(hollow))]),
            "holds no value",
        ),
        (lambda: store.record_job_outcome(run.id, JobOutcome(hollow)), "holds no value"),
        (
            lambda: store.record_job_outcomes(run.id, [JobOutcome(hollow)]),
            "holds no value",
        ),
        (lambda: store.insert_run(unset), "a field that holds no value"),
        (
            # The tag sits where a job's id is for Job itself: read by position, the wrong
            # run's job would be taken for its id.
            lambda: store.insert_run(other, jobs=[_TaggedJob(run.id, EvalJob("a", "y", 0))]),
            "belongs to run",
        ),
    ]
    for call, words in calls:
        with pytest.raises(InvalidInputError, match=words):
            await call()
    assert await store.list_runs() == [run]
    assert await store.list_jobs(run.id) == []
    # The place given is the job's: the run's count moved before the id was read, and counted
    # the jobs before it twice (jobs[2] for the second job).
    batch = [Job(run.id, EvalJob("a", "p", 0)), Job(RunId(hollow), EvalJob("a", "q", 0))]
    with pytest.raises(InvalidInputError, match=r"^jobs\[1\]"):
        await store.insert_jobs(batch)

    shadowed = _RaisingRunId(run.id, EvalJob("a", "0", 0))
    await store.insert_jobs([shadowed])
    await store.insert_run(other, jobs=[_RaisingRunId(other.id, EvalJob("a", "0", 0))])
    (stored,) = await store.list_jobs(run.id)
    assert stored.id == shadowed.id
    assert len(await store.list_jobs(other.id)) == 1
    assert await store.check() == []


class _EmptyId(uuid.UUID):
    """A UUID subclass, made without UUID.__init__ in the test: it holds no value."""


def test_shown_is_repr_for_ordinary_values_and_bounded_for_the_rest() -> None:
    """shown() is repr() of an ordinary value; it never raises, and never runs long."""
    assert shown(2**63) == repr(2**63)
    assert shown("x") == "'x'"
    assert shown(-HUGE) == "a negative int of about 5001 digits"
    assert shown([HUGE]) == "a list whose repr() raised ValueError"
    long = shown("y" * 10_000)
    assert len(long) < 600
    assert long.endswith("... (10002 characters in all)")


# ---------------------------------------------------------------------------------------------
# Objects that misbehave


async def test_a_str_whose_isascii_lies_is_still_checked_for_utf8(store: Store) -> None:
    """A str subclass whose isascii() says True of a lone surrogate is checked as the plain
    text it holds: an InvalidInputError naming the field, not the driver's UnicodeEncodeError."""
    run = make_run(2)
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    before = await _snapshot(store)
    liar = _LyingStr("a\udcff")
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "manifest": lambda: store.insert_run(Run(liar, ["a"], 1, 1)),
        "models[0]": lambda: store.insert_run(Run("m", [liar], 1, 1)),
        "spec.sample_id": lambda: store.insert_jobs([Job(run.id, EvalJob("a", liar, 0))]),
        "output": lambda: store.record_job_outcome(run.id, JobOutcome(job.id, output=liar)),
    }
    for field, call in calls.items():
        pattern = re.escape(f"{field} holds '\\udcff' at index 1")
        with pytest.raises(InvalidInputError, match=pattern):
            await call()
    assert await _snapshot(store) == before


class _UnhashableValue:
    """A value of no str type whose __hash__ raises."""

    def __hash__(self) -> int:
        raise RuntimeError("hash broke")

    def __repr__(self) -> str:
        return "'queued'"


class _OwnKindText(str):
    """A str subclass equal only to its own kind: its own __eq__ finds no status equal."""

    def __eq__(self, other: object) -> bool:
        return type(other) is _OwnKindText and str.__eq__(self, other)

    def __hash__(self) -> int:
        return hash(("own", str.__str__(self)))


async def test_a_status_whose_hash_raises_is_refused_naming_the_field(store: Store) -> None:
    """A status whose __hash__ raises (a dict or enum lookup hashes it) is an InvalidInputError
    naming the status and the fix, in insert_run, insert_jobs and list_runs; nothing changes.
    A str subclass is taken by its plain value, as every text field takes one (its own
    __hash__ and __eq__ never run): one whose hash raises, or whose __eq__ equals no status,
    is that status. The second was refused as "status 'queued' is not one of ['queued', ...]"."""
    run = make_run(2)
    await store.insert_run(run)
    before = await _snapshot(store)
    status: Any = _UnhashableValue()
    with pytest.raises(InvalidInputError, match=r"status 'queued' cannot be compared.*hash broke"):
        await store.insert_run(Run("m", ["a"], 1, 1, status=status))
    with pytest.raises(InvalidInputError, match=r": status 'queued'.*pass a JobStatus"):
        await store.insert_jobs([Job(run.id, EvalJob("a", "s", 0), status=status)])
    with pytest.raises(InvalidInputError, match=r"status 'queued'.*pass a RunStatus.*or None"):
        await store.list_runs(status=status)
    assert await _snapshot(store) == before
    for text in (_UnhashableStatus("queued"), _OwnKindText("queued")):
        plain: Any = text
        other = Run("m", ["a"], 1, 1, status=plain)
        await store.insert_run(other)
        assert await store.get_run(other.id) == msgspec.structs.replace(
            other, status=RunStatus.QUEUED
        )
        assert other.id in [r.id for r in await store.list_runs(status=plain)]


async def test_a_models_list_that_cannot_be_iterated_is_refused(store: Store) -> None:
    """A models list whose __iter__ raises is an InvalidInputError naming models and what
    went wrong; nothing is stored."""
    models: Any = _UniterableList(["a"])
    with pytest.raises(InvalidInputError, match=r"models is a _UniterableList that cannot be"):
        await store.insert_run(Run("m", models, 1, 1))
    assert await store.list_runs() == []


# ---------------------------------------------------------------------------------------------
# Each message says what to pass instead


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: _any_run("m", None, 1, 1),
            r"models must be a list of str, got NoneType: None; pass",
        ),
        (lambda: _any_run("m", "abc", 1, 1), r"models .* got str: 'abc'; wrap a single model name"),
        (lambda: _any_run("m", ["a", 1], 1, 1), r"models\[1\] must be a str, got int: 1; pass str"),
        (
            lambda: _any_run("m", ["a"], 1, 1, created_at=None),
            r"created_at must be a datetime, got NoneType: None; pass an aware datetime",
        ),
        (
            lambda: _any_run("m", ["a"], 1, 1, status="bogus"),
            r"status 'bogus' is not one of \['queued', 'running', 'done'\]; pass a RunStatus",
        ),
    ],
    ids=["models-None", "models-str", "models-item", "created_at-None", "status-bogus"],
)
async def test_a_bad_run_field_is_refused_with_what_to_pass(
    store: Store, make: Callable[[], Run], match: str
) -> None:
    """Each refused Run field says what was given and what to pass instead; nothing is stored."""
    with pytest.raises(InvalidInputError, match=match):
        await store.insert_run(make())
    assert await store.list_runs() == []


async def test_a_bad_job_field_is_refused_with_what_to_pass(store: Store) -> None:
    """A job's spec or status that cannot be stored says what to pass instead."""
    run = make_run()
    await store.insert_run(run)
    none: Any = None
    with pytest.raises(
        InvalidInputError, match=r"spec must be an EvalJob, got NoneType: None; pass EvalJob\("
    ):
        await store.insert_jobs([Job(run.id, none)])
    with pytest.raises(
        InvalidInputError, match=r"status 'bogus' is not one of .*; pass a JobStatus"
    ):
        await store.insert_jobs([Job(run.id, EvalJob("a", "s", 0), status="bogus")])  # type: ignore[arg-type]
    assert await store.list_jobs(run.id) == []


@pytest.mark.parametrize(
    ("batch", "shown_as"),
    [("abc", "a str: 'abc'"), (b"abc", "a bytes: b'abc'"), (bytearray(b"ab"), "a bytearray")],
)
async def test_a_str_or_bytes_is_not_taken_for_a_batch(
    store: Store, batch: object, shown_as: str
) -> None:
    """insert_jobs and record_job_outcomes refuse a str or bytes as the batch itself (an
    iterable of characters or ints), instead of blaming its first character; nothing changes."""
    run = make_run()
    await store.insert_run(run)
    bad: Any = batch
    with pytest.raises(
        InvalidInputError, match=rf"^jobs must be an iterable of Job, got {shown_as}"
    ):
        await store.insert_jobs(bad)
    with pytest.raises(
        InvalidInputError, match=rf"^outcomes must be an iterable of JobOutcome, got {shown_as}"
    ):
        await store.record_job_outcomes(run.id, bad)
    assert await store.list_jobs(run.id) == []


async def test_list_runs_refusals_say_what_to_pass(store: Store) -> None:
    """list_runs' limit and status refusals name the value and the fix."""
    with pytest.raises(InvalidInputError, match=r"got -1; pass the most runs you want, or None"):
        await store.list_runs(limit=-1)
    with pytest.raises(InvalidInputError, match=r"'bogus' is not one of .*, or None for every run"):
        await store.list_runs(status="bogus")  # type: ignore[arg-type]


async def test_a_score_no_float_holds_shows_its_value(store: Store) -> None:
    """An int score a float cannot hold exactly is shown in the refusal (not just its digit
    count), with the fix."""
    run = make_run()
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    with pytest.raises(InvalidInputError, match=r"score is 9007199254740993, an int that a float"):
        await store.record_job_outcome(run.id, JobOutcome(job.id, score=2**53 + 1))
    assert await store.get_job(job.id) == job


@pytest.mark.parametrize(
    ("url", "match"),
    [
        (b"x.db", r"got bytes: b'x.db'; decode it first: os.fsdecode"),
        (None, r"got NoneType: None; pass a sqlite:// URL string, or a path"),
    ],
)
async def test_a_url_of_the_wrong_type_says_what_to_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: object, match: str
) -> None:
    """A URL that is neither a str nor a path is refused with what to pass instead."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=match):
        await Store.connect(url)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


async def test_migrate_option_says_what_each_value_does() -> None:
    """migrate= that is not a bool says what True and False do."""
    with pytest.raises(ConfigurationError, match=r"migrate='yes' must be True or False; True \("):
        await Store.in_memory(migrate="yes")  # type: ignore[arg-type]


async def test_a_lost_tracking_row_is_named_not_called_pending(db_path: Path) -> None:
    """A database whose tracking row for migration 1 is gone, with the later ones' there, is
    refused naming the lost row, read-only or not, and not changed (not "at migration 3, but
    needs migration 3", nor migration 1 run again over its own tables), with migrate=False
    too, as for any other unsound tracking table."""
    with raw_db(db_path) as conn:
        conn.execute(f"DELETE FROM {TRACKING} WHERE version = 1")
    before = db_path.read_bytes()
    newest, description = SHIPPED[-1]
    lost = rf"records migration {newest} \({description}\) as applied, but not migration 1 \(init\)"
    for options in ({"read_only": True}, {}, {"migrate": False}):
        with pytest.raises(MigrationError, match=lost):
            await Store.connect(db_path, **options)  # type: ignore[arg-type]
    assert db_path.read_bytes() == before
    with raw_db(db_path) as conn:
        assert conn.execute(f"SELECT version FROM {TRACKING}").fetchall() == [
            (version,) for version, _ in SHIPPED[1:]
        ]
    # The advice, followed as written: the schema is as migration 1 makes it, so its row goes
    # back with the INSERT the message gives, and the database is sound again.
    with pytest.raises(MigrationError) as caught:
        await Store.connect(db_path)
    follow_advice(db_path, caught.value, r"put the row back: (INSERT INTO .*?); else")
    async with Store.connect(db_path) as store:
        assert await store.check() == []


@pytest.mark.parametrize("number", [2**128, -1, "x", None])
async def test_an_exact_uuid_whose_slot_holds_no_128_bit_number_is_refused(
    store: Store, number: object
) -> None:
    """An exact uuid.UUID whose ``int`` slot was set to something no UUID holds (by
    object.__setattr__, or a crafted pickle's __setstate__) is the InvalidInputError naming
    the field, as a subclass's unreadable value is: never msgspec's raw TypeError or
    OverflowError, nor "a value longer than SQLite keeps"; nothing is stored."""
    run = make_run(3)
    await store.insert_run(run)
    bad = uuid.UUID.__new__(uuid.UUID)
    bad.__setstate__({"int": number})  # type: ignore[attr-defined]
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: store.insert_run(Run("m", ["a"], 1, 1, id=RunId(bad))), r"Run\.id"),
        (lambda: store.insert_jobs([Job(run.id, EvalJob("a", "x", 0), id=JobId(bad))]), r"Job\.id"),
        (lambda: store.insert_jobs([Job(RunId(bad), EvalJob("a", "x", 0))]), "run_id"),
        (lambda: store.record_job_outcome(run.id, JobOutcome(bad)), r"JobOutcome\.job_id"),
        (lambda: store.record_job_outcomes(run.id, [JobOutcome(bad)]), r"JobOutcome\.job_id"),
    ]
    for call, field in calls:
        with pytest.raises(InvalidInputError, match=f"{field}.*cannot be read"):
            await call()
    assert await store.list_runs() == [run]
    assert await store.list_jobs(run.id) == []
    assert await store.check() == []


@pytest.mark.parametrize(
    "given",
    [
        float("nan"),
        float("inf"),
        None,
        "abc",
        1.5,
        "7",
        7.0,
        Decimal("7.5"),
        Fraction(15, 2),
        [7],
    ],
    ids=repr,
)
async def test_an_int_fields_fix_works_as_written(store: Store, given: object) -> None:
    """The fix for a value where an int is expected works when followed: "pass int(...) of it"
    only where int() takes the value and keeps it whole (int(nan), int(None) and int('abc')
    raise; int(1.5) would drop the fraction), else it says to give a whole number."""
    with pytest.raises(InvalidInputError) as caught:
        await store.insert_run(_any_run("m", ["a"], given, 1))
    message = str(caught.value)
    if "pass int(...) of it" in message:
        whole = int(given)  # type: ignore[call-overload]
        assert whole == given or str(whole) == given
    else:
        assert "give it a whole number" in message, message
    assert await store.list_runs() == []


@pytest.mark.parametrize(
    "given",
    [
        Decimal("1E+400"),
        Decimal("NaN"),
        Decimal("sNaN"),
        Decimal("-Infinity"),
        Fraction(10**400),
        [0.5],
        Decimal("0.5"),
        Fraction(1, 4),
        True,
    ],
    ids=lambda given: repr(given)[:20],
)
async def test_a_scores_fix_works_as_written(store: Store, given: object) -> None:
    """A score of another type is told to "pass float(...) of it" only where float() takes it
    and gives a score the store keeps (of Decimal('1E+400') it gives inf, of a huge Fraction
    it raises), else to give a finite number; nothing is recorded either way."""
    run = make_run()
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    with pytest.raises(InvalidInputError) as caught:
        await store.record_job_outcome(run.id, JobOutcome(job.id, score=given))  # type: ignore[arg-type]
    message = str(caught.value)
    if "pass float(...) of it" in message:
        assert math.isfinite(float(given))  # type: ignore[arg-type]
    elif "NaN" in repr(given):
        assert "this one is NaN" in message, message
    else:
        assert "give it a finite number" in message, message
    assert await store.get_job(job.id) == job


async def test_text_and_score_fixes_work_as_written(store: Store) -> None:
    """None where text is expected is not told to become str(None), the text 'None'; a score
    of text that is no number, or an int beyond every float, is not told to pass float() of it
    (which raises)."""
    with pytest.raises(InvalidInputError) as caught:
        await store.insert_run(_any_run(None, ["a"], 1, 1))
    assert "pass str(...) of it" not in str(caught.value)
    assert "None is no text" in str(caught.value)
    run = make_run()
    job = make_jobs(run, 1)[0]
    await store.insert_run(run)
    await store.insert_jobs([job])
    for score in ("abc", "nan", "-inf", 2**1024):
        with pytest.raises(InvalidInputError) as caught:
            await store.record_job_outcome(run.id, JobOutcome(job.id, score=score))  # type: ignore[arg-type]
        assert "pass float(...) of it" not in str(caught.value), caught.value
    assert await store.get_job(job.id) == job


async def test_a_record_passed_for_an_id_is_told_which_of_its_fields_to_pass(
    store: Store,
) -> None:
    """A Job where a run's id is meant is told job.run_id, a JobOutcome where a job's id is
    meant outcome.job_id, a Run or Job where its own id is meant run.id or job.id: the call
    made with what the message names succeeds."""
    run = make_run(job_count=1)
    [job] = make_jobs(run)
    outcome = JobOutcome(job.id, score=1.0)
    await store.insert_run(run, jobs=[job])
    names = {"run": run, "job": job, "outcome": outcome}
    calls: list[tuple[Callable[[Any], Awaitable[object]], object]] = [
        (store.list_jobs, job),
        (store.get_run, job),
        (store.list_jobs, run),
        (store.get_job, job),
        (store.get_job, outcome),
        (lambda run_id: store.record_job_outcome(run_id, outcome), job),
    ]
    for call, record in calls:
        with pytest.raises(InvalidInputError) as caught:
            await call(record)
        told = re.search(r"pass (\w+\.\w+), not the", str(caught.value))
        assert told is not None, caught.value
        owner, field = told[1].split(".")
        await call(getattr(names[owner], field))


async def test_a_list_given_to_record_job_outcome_is_pointed_to_the_batch_call(
    store: Store,
) -> None:
    """record_job_outcome given a list (or a tuple) of outcomes says to call
    record_job_outcomes, which the call then made as told records them."""
    run = make_run(job_count=2)
    jobs = make_jobs(run)
    await store.insert_run(run, jobs=jobs)
    outcomes = [JobOutcome(job.id, score=1.0) for job in jobs]
    for batch in (outcomes, tuple(outcomes)):
        with pytest.raises(InvalidInputError, match=r"got a \w+ of 2.*call record_job_outcomes"):
            await store.record_job_outcome(run.id, batch)  # type: ignore[arg-type]
    assert await store.get_run(run.id) == run
    assert await store.record_job_outcomes(run.id, outcomes) == [True, True]
