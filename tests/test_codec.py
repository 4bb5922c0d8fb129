"""The codec's fast paths agree with its checked paths, and bad values still get diagnosed."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from functools import partial
from typing import Any, cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_store import (
    CorruptRowError,
    EvalJob,
    InvalidInputError,
    Job,
    JobId,
    JobOutcome,
    JobStatus,
    Run,
    RunId,
    RunStatus,
    Store,
    _codec,
    _store,
)

from conftest import make_run, sized


def test_fast_and_checked_paths_encode_and_decode_alike() -> None:
    """run_params/job_params/outcome_json and the decoders give what the checked paths give."""
    run = Run("m", ["a", "b"], 2, 5, status=RunStatus.RUNNING)
    row = _codec.run_params(run)
    assert row == _codec._checked_run_params(run)
    assert _codec.decode_run(row) == _codec._checked_run(row) == run
    job = Job(run.id, EvalJob("a", "s", -3), attempt=2)
    job_row = _codec.job_params(job)
    assert job_row == _codec._checked_job_params(job)
    assert _codec.decode_job(job_row) == _codec._checked_job(job_row) == job
    outcome = JobOutcome(job.id, score=0.25, output="x", error="e")
    assert _codec.outcome_json(outcome) == _codec._checked_outcome_params(outcome)[1]
    assert _codec._ID_IN_JSON  # the batch path cuts the id from the JSON: see outcomes_params
    rows: list[tuple[str, str]] = []
    _codec.outcomes_params([outcome, JobOutcome(job.id), outcome], rows)
    assert rows == [
        _codec._checked_outcome_params(outcome),
        _codec._checked_outcome_params(JobOutcome(job.id)),
        _codec._checked_outcome_params(outcome),
    ]


def _outcomes_refusal(value: object) -> str:
    """outcomes_params' refusal of ``value`` as the second of a batch, which keeps the first."""
    rows: list[tuple[str, str]] = []
    first = JobOutcome(uuid.uuid4())
    batch: list[Any] = [first, value]
    with pytest.raises(InvalidInputError) as caught:
        _codec.outcomes_params(batch, rows)
    assert rows == [_codec.outcome_params(first)]  # len(rows): where the batch was refused
    return str(caught.value)


def _refusal(encode: Callable[[Any], object], value: object) -> str:
    with pytest.raises(InvalidInputError) as caught:
        encode(value)
    return str(caught.value)


def test_fast_and_checked_paths_refuse_a_lone_surrogate_alike() -> None:
    """Every text field UTF-8 cannot encode is refused by the fast path with the checked path's
    own message, wherever it is: bound as is (manifest) or inside JSON (the rest)."""
    bad = "x\udc80"
    run = Run("m", ["a"], 1, 1)
    job = Job(run.id, EvalJob("a", "s", 0))
    outcome = JobOutcome(job.id)
    for field, value in [("manifest", bad), ("models", ["a", bad])]:
        subject = msgspec.structs.replace(run, **{field: value})
        message = _refusal(_codec._checked_run_params, subject)
        assert "lone surrogate" in message
        assert _refusal(_codec.run_params, subject) == message
    for field in ("model", "sample_id"):
        spec = msgspec.structs.replace(job.spec, **{field: bad})
        subject_job = msgspec.structs.replace(job, spec=spec)
        message = _refusal(_codec._checked_job_params, subject_job)
        assert f"spec.{field} holds" in message
        assert _refusal(_codec.job_params, subject_job) == message
    for field in ("output", "error"):
        subject_outcome = msgspec.structs.replace(outcome, **{field: bad})
        message = _refusal(_codec._checked_outcome_params, subject_outcome)
        assert f"{field} holds" in message
        assert _refusal(_codec.outcome_params, subject_outcome) == message
        assert _outcomes_refusal(subject_outcome) == message


class _UUIDSubclass(uuid.UUID):
    """A uuid.UUID subclass: the fast paths leave it to the checked path and its str()."""


@pytest.mark.parametrize(
    "value",
    [
        uuid.UUID(int=0),
        uuid.UUID(int=2**128 - 1),
        uuid.UUID("0123ABCD-89AB-4DEF-8123-456789ABCDEF"),
        uuid.uuid4(),
        _UUIDSubclass(int=2**127 + 12345),
    ],
    ids=["nil", "max", "upper-case-input", "random", "subclass"],
)
def test_ids_are_written_as_str_writes_them(value: uuid.UUID) -> None:
    """The fast paths format ids in C; the text is exactly str()'s, as the checked paths write."""
    text = str(value)
    run = Run("m", ["a"], 1, 1, id=RunId(value))
    assert _codec.run_params(run)[0] == text
    assert _codec.run_params(run) == _codec._checked_run_params(run)
    job = Job(value, EvalJob("a", "s", 0), id=JobId(value))
    assert _codec.job_params(job)[:2] == (text, text)
    assert _codec.job_params(job) == _codec._checked_job_params(job)
    outcome = JobOutcome(value, score=1.0)
    assert _codec.outcome_json(outcome) == _codec._checked_outcome_params(outcome)[1]
    assert _codec.outcome_params(outcome) == _codec._checked_outcome_params(outcome)
    rows: list[tuple[str, str]] = []
    _codec.outcomes_params([outcome], rows)
    assert rows == [_codec._checked_outcome_params(outcome)]
    assert rows[0][0] == text
    assert _store._id(value, what="run_id") == text


@pytest.mark.parametrize("status", [JobStatus.QUEUED, JobStatus.RUNNING, "queued", "running"])
def test_every_job_status_is_written_as_its_value(status: str) -> None:
    """A new job's status, a JobStatus member or its plain value, is stored as text."""
    job = Job(uuid.uuid4(), EvalJob("a", "s", 0), status=cast(JobStatus, status))
    row = _codec.job_params(job)
    assert row[3] == JobStatus(status).value
    assert type(row[3]) is str
    assert row == _codec._checked_job_params(job)


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (
            Job(uuid.uuid4(), EvalJob("a", "s", 0), status=JobStatus.DONE),
            "a new job has no outcome",
        ),
        (Job(uuid.uuid4(), EvalJob("a", "s", 0), status=cast(JobStatus, "done")), "no outcome"),
        (Job(uuid.uuid4(), EvalJob("a", "s", 0), outcome=JobOutcome(uuid.uuid4())), "no outcome"),
        (Run("m", ["a"], 1, 2, done_count=1), "but a new run has no jobs yet"),
        (Run("m", ["a"], 1, 1, status=RunStatus.DONE), "but a new run has no jobs yet"),
        (Run("m", ["a"], 1, 1, status=cast(RunStatus, "done")), "but a new run has no jobs yet"),
    ],
    ids=[
        "job-done",
        "job-done-value",
        "job-outcome",
        "run-done-count",
        "run-done",
        "run-done-value",
    ],
)
def test_fast_and_checked_paths_refuse_a_record_in_progress_alike(
    record: Job | Run, says: str
) -> None:
    """A new job cannot be done or carry an outcome, and a new run has none done: both paths
    refuse, in the same words."""
    fast: Callable[[Any], object]
    checked: Callable[[Any], object]
    if isinstance(record, Job):
        fast, checked = _codec.job_params, _codec._checked_job_params
    else:
        fast, checked = _codec.run_params, _codec._checked_run_params
    message = _refusal(checked, record)
    assert says in message
    assert _refusal(fast, record) == message


@pytest.mark.parametrize(
    ("index", "value", "column"),
    [
        (0, "not-a-uuid", "id"),
        (2, "[1]", "models"),
        (3, 0, "epochs"),
        (5, "paused", "status"),
        (6, "2026-01-01 00:00:00.000000Z", "created_at"),
        (6, "2026-01-01T00:00:00,000000Z", "created_at"),
        (6, "2026-01-01T00:00:00.000000+00:00", "created_at"),
    ],
)
def test_a_corrupt_run_row_is_diagnosed(index: int, value: object, column: str) -> None:
    """A value the fast path refuses reaches the checked path and names its column."""
    row = list(_codec.run_params(make_run()))
    row[index] = value
    with pytest.raises(CorruptRowError, match=rf"runs\.{column} of row") as caught:
        _codec.decode_run(tuple(row))
    assert caught.value.column == column


def test_a_corrupt_job_row_is_diagnosed() -> None:
    """A job row with a bad spec names the column and the value."""
    job = Job(uuid.uuid4(), EvalJob("a", "s", 0))
    row = list(_codec.job_params(job))
    row[2] = '{"model": 1}'
    with pytest.raises(CorruptRowError, match=r"jobs\.spec of row"):
        _codec.decode_job(tuple(row))


@pytest.mark.parametrize(
    "created_at",
    [
        datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
        datetime(2026, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=1))),
    ],
    ids=["year-999", "year-1", "offset"],
)
async def test_early_years_keep_the_fixed_width(store: Store, created_at: datetime) -> None:
    """Years before 1000 are stored with four digits and read back as the same instant."""
    run = make_run(created_at=created_at)
    assert len(_codec.run_params(run)[6]) == len("2026-01-01T00:00:00.000000Z")
    await store.insert_run(run)
    assert await store.get_run(run.id) == run


# --- batch decoders: exactly what the per-row decoders admit --------------------------------

# A run in progress, as the store keeps it once one of its jobs is done (run_params only writes
# new runs, with done_count 0).
_GOOD_RUN = (*_codec.run_params(Run("m", ["a", "b"], 2, 5, status=RunStatus.RUNNING))[:7], 1)
_GOOD_JOB = _codec.job_params(Job(uuid.uuid4(), EvalJob("a", "s", 3), attempt=1))
_DONE_JOB = (
    *_GOOD_JOB[:3],
    "done",
    0,
    _codec.outcome_json(JobOutcome(uuid.UUID(_GOOD_JOB[0]), score=0.5)),
)


class _Int(int):
    """An int subclass, which sqlite3 never returns: msgspec takes one for an int."""


class _Str(str):
    """A str subclass, which sqlite3 never returns: msgspec takes one for a str."""


_TIMESTAMP = _GOOD_RUN[6]


def _near_misses() -> list[object]:
    """Values a hand edit could leave in a cell, close to what each column holds, and values
    of other types that msgspec would take for what the column holds."""
    return [
        "",
        " ",
        "null",
        "[]",
        '["a"],["b"]',
        '["a"',
        '"b"]',
        "{}",
        '{"model":"a"}, {}',
        "queued",
        "running",
        "paused",
        "2026-01-01T00:00:00.000000Z",
        "2026-01-01 00:00:00.000000Z",
        "2026-01-01T00:00:00.000000+00:00",
        "2026-02-30T00:00:00.000000Z",
        "\uff12026-01-01T00:00:00.000000Z",
        str(uuid.uuid4()),
        uuid.uuid4().hex,
        # The sound rows' own ids, spelt otherwise: the same UUIDs, never found by id.
        _GOOD_RUN[0].upper(),
        "{" + _GOOD_JOB[0] + "}",
        "urn:uuid:" + _GOOD_JOB[1],
        _GOOD_JOB[1].replace("-", ""),
        0,
        -1,
        1,
        2**62,
        1.0,
        b"\x00" * 16,
        # Two JSON values in one text: joined into one array, they would shift the rows after.
        f"{_DONE_JOB[5]},{_DONE_JOB[5]}",
        '{"model":"a","sample_id":"s","epoch":1},{"model":"b","sample_id":"s","epoch":1}',
        None,
        "abc",
        b"abc",
        # Other RFC 3339 forms that msgspec reads (or nearly does), beside the stored one.
        _TIMESTAMP.lower(),
        _TIMESTAMP.replace("Z", "+00:00"),
        _TIMESTAMP.replace(".000000", ""),
        _TIMESTAMP.replace(".000000", ".00000"),
        _TIMESTAMP.replace(".000000", ".0000000"),
        "2026-01-01T23:59:60.000000Z",
        "2026-01-0\u0661T00:00:00.000000Z",
        f"{_TIMESTAMP},{_TIMESTAMP}",
        _TIMESTAMP.encode(),
        datetime(2026, 1, 1, tzinfo=UTC),
        # Values msgspec takes for a UUID but no row may hold.
        uuid.UUID(_GOOD_RUN[0]),
        uuid.UUID(_GOOD_RUN[0]).bytes,
        _GOOD_RUN[0].encode(),
        # Values msgspec takes for an int, or refuses as a strict conversion does.
        True,
        False,
        0.0,
        2**64,
        -(2**64),
    ]


def _cell_values(good: object) -> st.SearchStrategy[object]:
    """A column's good value, a near miss, or anything at all."""
    return st.one_of(
        st.just(good),
        st.sampled_from(_near_misses()),
        st.text(max_size=12),
        st.integers(-(2**63), 2**63 - 1),
        st.binary(max_size=16),
        st.none(),
    )


@st.composite
def _damaged(draw: st.DrawFn, good: tuple[object, ...]) -> tuple[object, ...]:
    """``good`` with one or two cells replaced: rows that get far enough to test each check."""
    row = list(good)
    for index in draw(st.sets(st.integers(0, len(good) - 1), min_size=1, max_size=2)):
        row[index] = draw(_cell_values(good[index]))
    return tuple(row)


def _rows(good: tuple[object, ...], extra: list[tuple[object, ...]]) -> st.SearchStrategy[Any]:
    sound = st.sampled_from([good, *extra])
    # Mostly batches long enough for the column-at-a-time path, sometimes shorter ones.
    return st.lists(
        st.one_of(sound, *(_damaged(g) for g in [good, *extra])), max_size=_codec._BATCH + 4
    )


def _each(decode: Any, rows: list[Any]) -> object:
    """The per-row decoder over ``rows``: the list, or the error it raises first."""
    try:
        return [decode(row) for row in rows]
    except CorruptRowError as exc:
        return (type(exc), str(exc))


def _batch(decode: Any, rows: list[Any], caught: type[Exception] = CorruptRowError) -> object:
    """What ``decode(rows)`` returns, or the type and message of the ``caught`` it raises."""
    try:
        return decode(rows)
    except caught as exc:
        return (type(exc), str(exc))


@settings(max_examples=sized(300, 2000), deadline=None, derandomize=True)
@given(rows=_rows(_GOOD_RUN, []))
def test_decode_runs_admits_exactly_what_decode_run_admits(rows: list[Any]) -> None:
    """A batch of run rows decodes as its rows one by one do, or fails with the same error."""
    assert _batch(_codec.decode_runs, rows) == _each(_codec.decode_run, rows)


@settings(max_examples=sized(300, 2000), deadline=None, derandomize=True)
@given(rows=_rows((7, *_GOOD_RUN[:5], *_GOOD_RUN[6:]), []))
def test_decode_claimed_admits_exactly_what_decode_run_admits(rows: list[Any]) -> None:
    """Claimed rows (rowid first, no status) decode as decode_run reads them as running."""

    def one(row: Any) -> Run:
        return _codec.decode_run((*row[1:6], "running", *row[6:]))

    assert _batch(_codec.decode_claimed, rows) == _each(one, rows)


@settings(max_examples=sized(300, 2000), deadline=None, derandomize=True)
@given(rows=_rows(_GOOD_JOB, [_DONE_JOB]))
def test_decode_jobs_admits_exactly_what_decode_job_admits(rows: list[Any]) -> None:
    """A batch of job rows decodes as its rows one by one do, or fails with the same error."""
    assert _batch(_codec.decode_jobs, rows) == _each(_codec.decode_job, rows)


_BATCH_DECODERS = [
    ("runs", _GOOD_RUN, _codec.decode_runs, _codec.decode_run),
    (
        "claimed",
        (7, *_GOOD_RUN[:5], *_GOOD_RUN[6:]),
        _codec.decode_claimed,
        lambda row: _codec.decode_run((*row[1:6], "running", *row[6:])),
    ),
    ("jobs", _GOOD_JOB, _codec.decode_jobs, _codec.decode_job),
    ("done jobs", _DONE_JOB, _codec.decode_jobs, _codec.decode_job),
    (
        "keyed jobs",
        (7, *_GOOD_JOB),
        _codec.decode_keyed_jobs,
        lambda row: _codec.decode_job(row[1:]),
    ),
    (
        "keyed done jobs",
        (7, *_DONE_JOB),
        _codec.decode_keyed_jobs,
        lambda row: _codec.decode_job(row[1:]),
    ),
]


@pytest.mark.parametrize(
    ("good", "batch", "one"), [d[1:] for d in _BATCH_DECODERS], ids=[d[0] for d in _BATCH_DECODERS]
)
def test_every_near_miss_in_every_column_decodes_as_row_by_row(
    good: tuple[object, ...], batch: Any, one: Any
) -> None:
    """Exhaustively: each near miss in each column, between sound rows, batch == row by row."""
    for index in range(len(good)):
        for value in _near_misses():
            damaged = (*good[:index], value, *good[index + 1 :])
            rows = [good] * 4 + [damaged] + [good] * (_codec._BATCH - 5)  # a batch, not row by row
            assert _batch(batch, rows) == _each(one, rows), (index, value)


# The run decoders of _BATCH_DECODERS (runs, claimed), whose rows hold the same cells at
# different places: a test finds a column by its sound cell, good.index(cell).
_RUN_DECODERS = pytest.mark.parametrize(
    ("good", "batch", "one"),
    [decoders[1:] for decoders in _BATCH_DECODERS[:2]],
    ids=[decoders[0] for decoders in _BATCH_DECODERS[:2]],
)


@_RUN_DECODERS
def test_subclass_values_decode_as_row_by_row(
    good: tuple[object, ...], batch: Any, one: Any
) -> None:
    """An int or str subclass, which msgspec takes as its value, in any run column but models
    (whose decoder takes no str subclass, in a batch or not): the batch decodes as row by row,
    and to the very values _checked_run reads."""
    values = [_Int(0), _Int(1), _Int(7), _Str(_GOOD_RUN[0]), _Str(_TIMESTAMP), _Str("m")]
    for index in range(len(good)):
        if index == good.index(_GOOD_RUN[2]):  # models
            continue
        for value in values:
            damaged = (*good[:index], value, *good[index + 1 :])
            rows = [good] * 4 + [damaged] + [good] * (_codec._BATCH - 5)
            assert _batch(batch, rows) == _each(one, rows), (index, value)


@pytest.mark.parametrize("good", [_GOOD_JOB, _DONE_JOB], ids=["jobs", "done jobs"])
def test_subclass_values_in_job_columns_decode_as_row_by_row(good: tuple[object, ...]) -> None:
    """An int or str subclass, which msgspec takes as its value, in any job column, between
    sound rows and in every row: the batch decodes as row by row, or fails as it does (a str
    subclass is a TypeError of msgspec's JSON decoders, which the per-row path lets through)."""
    values = [
        _Int(0),
        _Int(1),
        _Int(7),
        *(_Str(cell) for cell in _DONE_JOB if isinstance(cell, str)),
        _Str(_GOOD_JOB[3]),
    ]

    def each(rows: list[Any]) -> list[Job]:
        return [_codec.decode_job(row) for row in rows]

    for index in range(len(good)):
        for value in values:
            damaged = (*good[:index], value, *good[index + 1 :])
            between = [good] * 4 + [damaged] + [good] * (_codec._BATCH - 5)
            for rows in (between, [damaged] * _codec._BATCH):
                found = _batch(_codec.decode_jobs, rows, Exception)
                assert found == _batch(each, rows, Exception), (index, value)


def _split(text: str) -> list[tuple[str, str]]:
    """Pairs of texts that, put together (or around a comma), spell ``text`` twice: cells that
    only a check of each text's own length can tell from two sound ones."""
    twice = text + text
    pairs = [(twice[:k], twice[k:]) for k in range(1, len(twice))]
    return [*pairs, (f"{text},{text}", ""), (f"{text},", text), (text[:-1], f"{text[-1]},{text}")]


@_RUN_DECODERS
def test_timestamps_split_across_rows_decode_as_row_by_row(
    good: tuple[object, ...], batch: Any, one: Any
) -> None:
    """Two created_at texts that together hold two sound ones, side by side in a batch, decode
    as row by row: refused, for the texts are not each the stored form."""
    index = good.index(_TIMESTAMP)
    for first, second in _split(_TIMESTAMP):
        rows = [good] * _codec._BATCH
        rows[3] = (*good[:index], first, *good[index + 1 :])
        rows[4] = (*good[:index], second, *good[index + 1 :])
        assert _batch(batch, rows) == _each(one, rows), (first, second)


@pytest.mark.parametrize("good", [_GOOD_JOB, _DONE_JOB], ids=["jobs", "done jobs"])
def test_run_ids_split_across_rows_decode_as_row_by_row(good: tuple[object, ...]) -> None:
    """Two run_id texts that together hold two copies of the one run id every other row holds,
    side by side in a batch, decode as row by row: refused, though the column joined without a
    separator would read as that id once per row."""
    for first, second in _split(_GOOD_JOB[1]):
        rows = [good] * _codec._BATCH
        rows[3] = (good[0], first, *good[2:])
        rows[4] = (good[0], second, *good[2:])
        assert _batch(_codec.decode_jobs, rows) == _each(_codec.decode_job, rows), (first, second)


def test_runs_decoded_from_one_models_text_each_have_their_own_list() -> None:
    """A batch whose runs all name the same models: no two runs share the list, so a change to
    one run's models is no change to another's."""
    runs = _codec.decode_runs([_GOOD_RUN] * _codec._BATCH)
    assert [r.models for r in runs] == [["a", "b"]] * _codec._BATCH
    assert len({id(r.models) for r in runs}) == _codec._BATCH


_SPELLINGS: list[Callable[[str], str]] = [
    str.upper,
    lambda text: text.replace("-", ""),
    lambda text: "{" + text + "}",
    lambda text: "urn:uuid:" + text,
]


@pytest.mark.parametrize("spell", _SPELLINGS, ids=["upper", "no-hyphens", "braces", "urn"])
def test_an_id_spelt_otherwise_than_canonically_is_refused_by_every_decoder(
    spell: Callable[[str], str],
) -> None:
    """Each id column, spelt as another text of the same UUID, in one row, in a batch with
    sound rows, and in a batch of only such rows (one run's jobs parse their run id once):
    refused with the error that says where the repair is. Taken, such a row would be listed
    and claimed, and then found by no call given its id."""
    run = (spell(_GOOD_RUN[0]), *_GOOD_RUN[1:])
    claimed = (7, *run[:5], *run[6:])
    job_id = (spell(_GOOD_JOB[0]), *_GOOD_JOB[1:])
    run_id = (_GOOD_JOB[0], spell(_GOOD_JOB[1]), *_GOOD_JOB[2:])
    sound_claimed = (7, *_GOOD_RUN[:5], *_GOOD_RUN[6:])
    cases: list[tuple[str, Any, Any, tuple[object, ...], tuple[object, ...] | None]] = [
        ("id", _codec.decode_runs, _codec.decode_run, run, _GOOD_RUN),
        ("id", _codec.decode_claimed, None, claimed, sound_claimed),
        ("id", _codec.decode_jobs, _codec.decode_job, job_id, _GOOD_JOB),
        ("run_id", _codec.decode_jobs, _codec.decode_job, run_id, _GOOD_JOB),
    ]
    for column, batch, one, bad, good in cases:
        batches = [[bad], [good] * (_codec._BATCH - 1) + [bad], [bad] * _codec._BATCH]
        calls = [partial(batch, rows) for rows in batches]
        if one is not None:
            calls.append(partial(one, bad))
        for call in calls:
            with pytest.raises(CorruptRowError, match="canonical UUID text") as caught:
                call()
            assert caught.value.column == column
            message = str(caught.value)
            assert message.endswith("as Store.check() (control-store check) says")
            assert "backup" not in message


def test_batch_decoders_take_the_fast_path_for_sound_rows() -> None:
    """Sound rows, as many as make a batch, never go row by row (the fast path is used)."""
    runs = [_GOOD_RUN, _codec.run_params(Run("n", [], 1, 1))] * (_codec._BATCH // 2)
    jobs = [_GOOD_JOB, _DONE_JOB] * (_codec._BATCH // 2)
    claimed = [(i, *row[:5], *row[6:]) for i, row in enumerate(runs)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_codec, "decode_run", None)
        patch.setattr(_codec, "decode_job", None)
        assert [r.id for r in _codec.decode_runs(runs)] == [uuid.UUID(r[0]) for r in runs]
        assert {r.status for r in _codec.decode_claimed(claimed)} == {RunStatus.RUNNING}
        assert [j.outcome is None for j in _codec.decode_jobs(jobs)] == [True, False] * (
            _codec._BATCH // 2
        )


@pytest.mark.parametrize(
    ("good", "batch", "one", "columns"),
    [
        (_GOOD_RUN, _codec.decode_runs, _codec.decode_run, "_runs_of_columns"),
        (
            (7, *_GOOD_RUN[:5], *_GOOD_RUN[6:]),
            _codec.decode_claimed,
            lambda row: _codec.decode_run((*row[1:6], "running", *row[6:])),
            "_runs_of_columns",
        ),
        (_DONE_JOB, _codec.decode_jobs, _codec.decode_job, "_jobs_of_columns"),
        (
            (7, *_DONE_JOB),
            _codec.decode_keyed_jobs,
            lambda row: _codec.decode_job(row[1:]),
            "_jobs_of_columns",
        ),
    ],
    ids=["runs", "claimed", "jobs", "keyed jobs"],
)
def test_a_big_batch_is_decoded_a_chunk_at_a_time(
    good: tuple[object, ...], batch: Any, one: Any, columns: str
) -> None:
    """A column-wide decode is C calls that hold the GIL throughout: a list_jobs of a million
    jobs decoded whole froze the event loop for 1.3 s. No column decode takes more than
    _DECODE_CHUNK rows, and the result (a CorruptRowError in a later chunk too) is the same."""
    sizes: list[int] = []
    whole = getattr(_codec, columns)

    def spy(*args: Any) -> Any:
        sizes.append(len(args[0][0] if len(args) == 1 else args[0]))
        return whole(*args)

    rows = [good] * (2 * _codec._DECODE_CHUNK + 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_codec, columns, spy)
        assert _batch(batch, rows) == _each(one, rows)
        assert sizes
        assert max(sizes) <= _codec._DECODE_CHUNK, sizes
        bad = list(rows)
        bad[-2] = tuple(None if i == len(good) - 3 else v for i, v in enumerate(good))
        assert _batch(batch, bad) == _each(one, bad)


def test_a_surrogate_pair_is_told_to_be_joined_not_replaced() -> None:
    """Text holding a UTF-16 surrogate pair as two code points is refused with the fix that
    keeps the character (joining the pair), not errors='replace', which would destroy it."""
    text = b"ok \\ud83d\\ude00".decode("unicode_escape")
    run = Run("m", ["a"], 1, 1)
    job = Job(run.id, EvalJob("a", "s", 0))
    outcome = msgspec.structs.replace(JobOutcome(job.id), output=text)
    message = _refusal(_codec._checked_outcome_params, outcome)
    assert "surrogate pair" in message
    assert "surrogatepass" in message
    assert _refusal(_codec.outcome_params, outcome) == message
    fixed = text.encode("utf-16", "surrogatepass").decode("utf-16")
    assert fixed == "ok \U0001f600"
    _codec.outcome_params(msgspec.structs.replace(outcome, output=fixed))
