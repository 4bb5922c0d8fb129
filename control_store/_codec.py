"""Models to column values and back, with every check at this one boundary.

Writing: a model is validated (a value SQLite or JSON cannot keep faithfully is an
``InvalidInputError`` before anything is written) and turned into a parameter tuple.
Reading: a row becomes a model, and any value this version cannot read becomes a
``CorruptRowError`` naming the table, the column, the row id and the value.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction
from typing import Annotated, Any, Concatenate, Final, ParamSpec, TypeVar, cast

import msgspec

from ._show import _type_name, failure, is_a, shown, typed
from .errors import CorruptRowError, InvalidInputError
from .models import EvalJob, Job, JobId, JobOutcome, JobStatus, Run, RunId, RunStatus

# Built once: msgspec encoders and decoders are reusable and much faster than per-call ones.
_encode: Final = msgspec.json.Encoder().encode
_decode_models: Final = msgspec.json.Decoder(list[str]).decode
_decode_spec: Final = msgspec.json.Decoder(EvalJob).decode
_decode_outcome: Final = msgspec.json.Decoder(JobOutcome).decode
# What each JSON column holds, as the message for a value that is not it says: msgspec's own
# ("Expected `array`, got `object`") names neither the column's form nor what to write.
_JSON_FORMS: Final = {
    "models": 'a JSON array of model names, like ["gpt-4o", "llama-3"]',
    "spec": 'a JSON object like {"model": "gpt-4o", "sample_id": "q1", "epoch": 0}',
    "outcome": (
        'NULL or a JSON object like {"job_id": "<this job\'s id>", "score": 0.5, "output": "", '
        '"error": null}'
    ),
}
# msgspec parses UUID text ~3x faster than uuid.UUID(), and RFC 3339 text; a failure is a
# msgspec.ValidationError.
_convert: Final = msgspec.convert
# Batch decoding: a column at a time, each step a C call over the whole column. The columns'
# types are the fields of array-like structs, never a tuple[...] or list[...] type: msgspec
# keeps a struct's compiled field types on its class, and compiles any other type again on
# every call (measured: ~4-8 us a call for the six run columns' tuple type, before a value is
# read, against ~0.4 us for the same types as this struct's).
_COUNT: Final = msgspec.Meta(ge=0)


class _UuidColumn(msgspec.Struct, array_like=True, frozen=True, gc=False):
    values: list[uuid.UUID]


class _RunColumns(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """id, manifest, epochs, job_count, created_at, done_count: see _runs_of_columns."""

    ids: list[uuid.UUID]
    manifests: list[str]
    epochs: list[Annotated[int, msgspec.Meta(ge=1)]]
    job_counts: list[Annotated[int, _COUNT]]
    created: list[datetime]
    done_counts: list[Annotated[int, _COUNT]]


_ONLY_INT: Final = {int}
_ONLY_STR: Final = {str}
# From this many rows on, decoding a column at a time beats decoding row by row.
_BATCH: Final = 8
# At most this many rows per column-wide decode. Each column step (zip(*rows), msgspec's
# convert, map of a C decoder) is one C call that holds the GIL from start to end, so the
# event loop's thread cannot run meanwhile: a list_jobs of a million jobs decoded whole froze
# every task of the loop for 1.3 s (a 100k-job iter_jobs page, 160 ms). In chunks the GIL is
# handed over between them (sys.getswitchinterval(), 5 ms), for the same results.
_DECODE_CHUNK: Final = 4096


def _chunked(
    decode: Callable[[Sequence[Sequence[Any]]], list[_T]], rows: Sequence[Sequence[Any]]
) -> list[_T]:
    """``decode(rows)``, a chunk of _DECODE_CHUNK rows at a time (see there)."""
    decoded: list[_T] = []
    for start in range(0, len(rows), _DECODE_CHUNK):
        decoded.extend(decode(rows[start : start + _DECODE_CHUNK]))
    return decoded


# msgspec also formats a UUID in C, in a quarter of the instructions of str() (a Python-level
# __str__), and always from its 128-bit value: the canonical text, also for a subclass whose
# __str__ says something else (stored as that, its row could never be found by a plain UUID).
uuid_text: Callable[[uuid.UUID], str] = msgspec.to_builtins
_UUID: Final = uuid.UUID
# The number a UUID holds in its slot, whatever a subclass's own ``int`` says.
uuid_number: Final[Callable[[uuid.UUID], int]] = vars(uuid.UUID)["int"].__get__

if sys.version_info >= (3, 13):
    # There msgspec formats a uuid.UUID whose slot holds a number out of range (a crafted
    # pickle's __setstate__ does not check it) without an error: 2**128 as the nil id, -1 as
    # ffffffff-...: a wrong id stored. On older Pythons it raises OverflowError, which every
    # caller explains: raised here first, as that.
    _UUID_END: Final = 1 << 128
    _to_builtins: Final = msgspec.to_builtins

    def uuid_text(value: uuid.UUID) -> str:
        if not 0 <= uuid_number(value) < _UUID_END:
            raise OverflowError("a UUID's number must be from 0 to 2**128 - 1")
        text: str = _to_builtins(value)
        return text


# What msgspec raises on stored JSON it cannot read. Its DecodeError (and ValidationError, a
# DecodeError) is a ValueError from msgspec 0.21 on only: named for older ones. JSON nested
# deeper than Python's recursion limit (an unknown field holding [[[[...]]]], which msgspec
# parses to skip) raises RecursionError instead, in any column.
_UNREADABLE_JSON: Final = (msgspec.DecodeError, RecursionError)

# What a batch decoder's fast path raises on a row it cannot take, sending the batch row by row.
_REFUSED: Final = (TypeError, ValueError, KeyError, *_UNREADABLE_JSON)

_FLOAT_MAX: Final = int(sys.float_info.max)  # an int beyond it has no float
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1

# Fixed width, always with microseconds: text order is time order. msgspec and a plain
# isoformat() both drop a zero fraction, so neither output is stored as is.
_TIMESTAMP_LENGTH: Final = len("2026-01-01T00:00:00.000000Z")

# Every status by its value, for the hot paths (RunStatus(value) is a slower call).
_RUN_STATUS: Final = {s.value: s for s in RunStatus}
_JOB_STATUS: Final = {s.value: s for s in JobStatus}
_RUNNING: Final = RunStatus.RUNNING.value  # an enum's .value is a property: 0.35 us a call
_QUEUED: Final = JobStatus.QUEUED  # every new job's status: checked by identity first
# The statuses a new run or job may be inserted with: never done (see _checked_run_params).
_NEW_RUN: Final = {s.value: s for s in RunStatus if s is not RunStatus.DONE}
_NEW_JOB: Final = {s.value: s for s in JobStatus if s is not JobStatus.DONE}
# The status types the fast paths look up: their hashing is known not to fail. Any other
# value (a str subclass, whose __hash__ may raise) goes through _status, which explains.
_PLAIN_RUN_STATUS: Final = {str, RunStatus}
_PLAIN_JOB_STATUS: Final = {str, JobStatus}

# Columns, in the order every SELECT and RETURNING lists them (see _sqlite.py).
RUN_COLUMNS: Final = "id, manifest, models, epochs, job_count, status, created_at, done_count"
JOB_COLUMNS: Final = "id, run_id, spec, status, attempt, outcome"


_TZINFO: Final = datetime.tzinfo.__get__  # a datetime's own tzinfo, whatever a subclass says
_FOLD: Final = datetime.fold.__get__
# A datetime's own fields, as its constructor takes them.
_DATETIME_FIELDS: Final = (
    datetime.year,
    datetime.month,
    datetime.day,
    datetime.hour,
    datetime.minute,
    datetime.second,
    datetime.microsecond,
)


_astuple: Final = msgspec.structs.astuple

# What a fast path's reads raise on a value the checked path explains: a field unset through
# its slot (AttributeError), and an exact uuid.UUID whose slot holds no 128-bit number (set by
# object.__setattr__ or a crafted __setstate__: msgspec's formatting raises TypeError or
# OverflowError, which reached the caller raw, or read as "a value too long for SQLite").
UNSET_OR_UNREADABLE: Final = (AttributeError, TypeError, OverflowError)


def struct_fields(value: Any, kind: type[msgspec.Struct], *, what: str) -> tuple[Any, ...]:
    """The fields ``kind`` defines, of ``value``, a ``kind`` or a subclass (taken as a
    ``kind``: fields of its own are not kept), in ``kind``'s order, read from the struct itself
    (msgspec.structs.astuple): never through a subclass's properties or ``__getattribute__``,
    which could raise, or say one thing now and another later. A field unset through its slot
    descriptor is an InvalidInputError naming ``what``."""
    try:
        values = _astuple(value)
    except AttributeError as exc:  # a field unset through its slot descriptor
        raise InvalidInputError(
            f"{what} is a {_type_name(value)} with a field that holds no value ({exc}); "
            f"nothing was stored: build it with {kind.__name__}(...)"
        ) from None
    names = type(value).__struct_fields__
    if names == kind.__struct_fields__:
        return values
    by_name = dict(zip(names, values, strict=True))
    return tuple(by_name[name] for name in kind.__struct_fields__)


def format_timestamp(value: datetime, *, what: str) -> str:
    """``value`` as fixed-width RFC 3339 UTC text; a naive datetime is refused."""
    # datetime's own methods and attributes, never a subclass's (which could raise, or lie
    # about the time: a tzinfo property saying UTC of a naive time would store text no read
    # takes back, or an aware one at the wrong instant).
    zone = _TZINFO(value)
    if zone is UTC:  # the common case (utc_now()), no offset arithmetic
        return datetime.isoformat(value, timespec="microseconds")[:-6] + "Z"
    if type(value) is not datetime:
        # A plain copy, made from datetime's own fields: the conversion below makes new
        # datetimes of the value's own type, whose constructor a subclass may have made raise
        # (which was reported as its time zone raising).
        year, month, day, hour, minute, second, micro = (
            field.__get__(value) for field in _DATETIME_FIELDS
        )
        value = datetime(
            year, month, day, hour, minute, second, micro, tzinfo=zone, fold=_FOLD(value)
        )
    try:
        # The caller's tzinfo runs here: its utcoffset() may raise, or return what is no
        # timedelta.
        aware = zone is not None and datetime.utcoffset(value) is not None
        if aware:
            value = datetime.astimezone(value, UTC)
    except OverflowError:
        raise InvalidInputError(
            f"{what} {shown(value)} is outside 0001-01-01..9999-12-31 once in UTC, the range "
            "a datetime can hold; pass a time within it"
        ) from None
    except Exception as exc:
        raise InvalidInputError(
            f"{what} {shown(value)} cannot be turned into UTC: its time zone raised "
            f"{failure(exc)}; pass a datetime with a working tzinfo, e.g. datetime.timezone.utc"
        ) from exc
    if not aware:
        raise InvalidInputError(
            f"{what} {shown(value)} has no time zone; pass an aware datetime, "
            "e.g. datetime.now(timezone.utc)"
        )
    # isoformat, not strftime: it is ~3x faster on the insert path and always pads the year to
    # four digits (glibc's %Y writes year 999 as "999", which would break the fixed width).
    return datetime.isoformat(datetime.replace(value, tzinfo=None), timespec="microseconds") + "Z"


def _parse_timestamp(text: str) -> datetime:
    # msgspec parses RFC 3339 ~40x faster than strptime, but takes several forms (a space for
    # "T", offsets, any number of fractional digits): the positional checks admit only the one
    # form format_timestamp writes. _timestamps_in_form makes them on a whole column at once.
    if (
        len(text) != _TIMESTAMP_LENGTH
        or text[10] != "T"
        or text[19] != "."
        or text[26] != "Z"
        or text[4] != "-"
        or text[7] != "-"
        or text[13] != ":"
        or text[16] != ":"
        or not text[:4].isdigit()
    ):
        raise ValueError("not fixed-width RFC 3339 UTC")
    return _convert(text, datetime)  # as _runs_of_columns converts a whole column


# The form of every stored timestamp with each digit written as 0, and the table that writes
# ASCII digits so (see _timestamps_in_form).
_TIMESTAMP_FORM: Final = b"0000-00-00T00:00:00.000000Z,"
_DIGITS_AS_ZERO: Final = bytes.maketrans(b"123456789", b"000000000")


def _timestamps_in_form(texts: Sequence[str]) -> bool:
    """_parse_timestamp's positional checks over a column of str, in a few C calls: joined by
    commas, encoded, and each ASCII digit written as 0, the column must read as the form once
    for each text (a non-str is a TypeError of join). ~1.9 us for 64 texts, where a slice of
    the joined texts per checked position took ~5.3 us.

    Stricter than the positional checks, never laxer: every digit of the form must be an ASCII
    digit, not only the year's (msgspec refuses any other there anyway). The form holds no
    comma, so each comma that joins two texts falls where the form's does: no text is longer
    or shorter than the form (one holding a comma, two forms, leaves the column a form short).
    """
    expected = _TIMESTAMP_FORM * len(texts)
    return ",".join(texts).encode().translate(_DIGITS_AS_ZERO) == expected[:-1]


def _int_fix(value: object) -> str:
    """The fix for ``value`` where an int is expected, one that works as written: int() of
    None, of a float that is not finite or of text that spells no whole number raises."""
    if value is None:
        return "give it a whole number: None is no value for it"
    if is_a(value, float):
        real = float.__float__(value)
        if not math.isfinite(real):
            return "give it a whole number: a float that is not finite (nan, inf) has no int"
        if not real.is_integer():
            return "give it a whole number (int(...) of it would drop the fraction)"
    elif is_a(value, str):
        text = str.__str__(value)
        try:
            int(text)
        except ValueError:
            if text.strip().lstrip("+-").replace("_", "").isdecimal():  # past int()'s digits
                return (
                    "give it a whole number in SQLite's 64-bit range: this text spells one far "
                    "past it"
                )
            return "give it a whole number: this text spells none"
    elif not is_a(value, bool):
        # Anything else (a Decimal, a Fraction, a list, a numpy scalar): int() of it may drop a
        # fraction or raise, and its methods are not called to tell.
        return "give it a whole number as an int (int(...) of it drops a fraction, or raises)"
    return "pass int(...) of it"


def _float_fix(value: object) -> str:
    """The fix for a score that is no float, one that works as written: float() of text that
    spells no number raises, and of "nan" or "inf" gives a score that is refused too."""
    if is_a(value, str):
        try:
            real = float(str.__str__(value))
        except ValueError:
            return "give it a number: this text spells none (or None for no score)"
        if not math.isfinite(real):
            return "give it a finite number (or None for no score, with error=...)"
    elif type(value) in (Decimal, Fraction):
        # The standard library's own exact types (never a subclass, whose float() is its own
        # code): float() of one may raise (too large a Fraction, a signalling NaN) or give a
        # score refused too (Decimal('NaN'), Decimal('1E+400') gives inf).
        try:
            real = float(cast(Decimal | Fraction, value))
        except ValueError:  # a signalling NaN
            real = math.nan
        except OverflowError:
            real = math.inf
        if math.isnan(real):
            return "give it a number: this one is NaN (or None for no score, with error=...)"
        if math.isinf(real):
            return (
                f"give it a finite number a float holds (none is beyond "
                f"{sys.float_info.max:.3g}), or None for no score, with error=..."
            )
    elif not is_a(value, bool):
        # Anything else (a list, a numpy scalar, a type of the caller's): its float() is its
        # own code, not called to tell.
        return "give it a finite number as a float (float(...) of it may raise, or give inf or nan)"
    return "pass float(...) of it"


def _check_int(
    value: object, *, what: str, minimum: int = _INT64_MIN, why_minimum: str = ""
) -> int:
    """``value`` as a plain int (an int subclass's value): msgspec encodes only exact ints.
    ``why_minimum``: why a value below ``minimum`` cannot be, for its message."""
    if not is_a(value, int) or is_a(value, bool):
        raise InvalidInputError(f"{what} must be an int, got {typed(value)}; {_int_fix(value)}")
    plain = int.__index__(value)  # for a subclass, a plain int copy: never its own methods
    if plain < minimum:
        raise InvalidInputError(
            f"{what} is {shown(plain)}, below {minimum}{why_minimum}; nothing was stored: "
            f"pass at least {minimum}"
        )
    if plain > _INT64_MAX or plain < _INT64_MIN:
        raise InvalidInputError(
            f"{what} is {shown(plain)}, outside {minimum}..{_INT64_MAX}; "
            "SQLite stores 64-bit integers, so pass a value in that range"
        )
    return plain


_S = TypeVar("_S", RunStatus, JobStatus)


def _status(value: object, kind: type[_S], *, what: str, also: str = "") -> _S:
    """``value`` as a member of ``kind``: a member, or its value ('queued'...). ``also``: an
    alternative the fix offers besides a member."""
    example = f"{kind.__name__}.QUEUED{also}"
    if is_a(value, str) and not is_a(value, kind):
        # A str subclass (another StrEnum's member too) by its plain value, as every other text
        # field takes one: never by its own __eq__ or __hash__, which may raise, or lie.
        value = str.__str__(value)
    try:
        # The enum lookup takes any value (a non-member is a ValueError); the hint says str.
        return kind(value)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidInputError(
            f"{what} {shown(value)} is not one of {[s.value for s in kind]}; pass a "
            f"{kind.__name__}, e.g. {example}"
        ) from None
    except Exception as exc:  # the value's own __hash__ or __eq__ failed (not a plain str)
        raise InvalidInputError(
            f"{what} {shown(value)} cannot be compared with the statuses ({failure(exc)}); "
            f"pass a {kind.__name__}, e.g. {example}"
        ) from None


def run_status(value: object, *, what: str, also: str = "") -> RunStatus:
    """``value`` as a RunStatus, or the InvalidInputError that explains why it is none."""
    return _status(value, RunStatus, what=what, also=also)


def _check_models(models: object, *, where: str) -> list[str]:
    """A run's models as a plain list of plain str."""
    if not is_a(models, list):
        fix = (
            "wrap a single model name in a list: [name]"
            if is_a(models, str)
            else "pass a list of model names, e.g. ['model-a', 'model-b']"
        )
        raise InvalidInputError(
            f"{where}: models must be a list of str, got {typed(models)}; {fix}"
        )
    try:
        items = list(models)  # a list subclass's own __iter__, once
    except Exception as exc:
        raise InvalidInputError(
            f"{where}: models is a {type(models).__name__} that cannot be iterated "
            f"({failure(exc)}); nothing was stored: pass a plain list of model names"
        ) from None
    return [_check_str(model, what=f"{where}: models[{i}]") for i, model in enumerate(items)]


def check_uuid(value: object, *, what: str, otherwise: str = "pass a uuid.UUID") -> str:
    """The canonical text of ``value``, a uuid.UUID (for a subclass with its own __str__ too),
    else InvalidInputError naming ``what``. The fix: a str is told to wrap itself; anything
    else gets ``otherwise``."""
    if not is_a(value, uuid.UUID):
        if not is_a(value, str):
            fix = otherwise
        elif spelt_uuid(text := str.__str__(value)) is None:  # a subclass: its plain text
            fix = f"that is no UUID's text either: {otherwise}"
        else:
            fix = f"wrap it as uuid.UUID({shown(text)})"
        raise InvalidInputError(f"{what} must be a uuid.UUID, got {typed(value)}; {fix}")
    try:
        if type(value) is _UUID:
            return uuid_text(value)
        # A subclass by the value uuid.UUID holds in its slot, never through the subclass's
        # own ``int`` (msgspec reads that, and on Python 3.13 an unset slot read as 0, storing
        # the nil id).
        return uuid_text(_UUID(int=uuid_number(value)))
    except AttributeError:  # a subclass made with UUID.__new__ alone holds no value
        raise InvalidInputError(
            f"{what} is a {type(value).__name__} that holds no value (made without "
            f"uuid.UUID.__init__, or with an int of its own that took the value); {otherwise}"
        ) from None
    except Exception as exc:  # a subclass whose own ``int`` fails
        raise InvalidInputError(
            f"{what} is a {type(value).__name__} whose value cannot be read (reading it "
            f"raised {failure(exc)}); {otherwise}"
        ) from exc


def _check_str(value: object, *, what: str) -> str:
    """``value`` as a plain str (a str subclass's text, numpy.str_ say): msgspec encodes only
    exact strs, and the round trip gives a str back anyway."""
    if not is_a(value, str):
        fix = (
            "give it a value: None is no text (str(None) would store the text 'None')"
            if value is None
            else "pass str(...) of it"
        )
        raise InvalidInputError(f"{what} must be a str, got {typed(value)}; {fix}")
    # For a subclass, a plain str copy, checked as that: never its own __str__, isascii() or
    # encode(), which could say anything (an isascii() that says True of a lone surrogate
    # would let the text reach the driver, and its UnicodeEncodeError the caller).
    text = str.__str__(value)
    if not text.isascii():  # O(1): CPython knows; only other text needs the full check
        _check_utf8(text, what=what)
    return text


def _check_utf8(value: str, *, what: str) -> None:
    """Refuse text that UTF-8, and so SQLite and JSON, cannot hold: a lone surrogate."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        pair = value[exc.start : exc.start + 2]
        if len(pair) == 2 and "\ud800" <= pair[0] <= "\udbff" and "\udc00" <= pair[1] <= "\udfff":
            # A UTF-16 surrogate pair left as two code points (unicode_escape-decoded text, a
            # bridge handing over UTF-16 code units): it names one character, which 'replace'
            # would destroy; joined, it is that character.
            raise InvalidInputError(
                f"{what} holds {pair!r} at index {exc.start}, a UTF-16 surrogate pair left as "
                "two code points, which UTF-8 cannot encode, so it cannot be stored; join "
                "each pair into the character it stands for: "
                "text.encode('utf-16', 'surrogatepass').decode('utf-16')"
            ) from None
        raise InvalidInputError(
            f"{what} holds {value[exc.start]!r} at index {exc.start}, a lone surrogate that "
            "UTF-8 cannot encode, so it cannot be stored (text decoded with "
            "errors='surrogateescape' keeps undecodable bytes this way); decode the bytes with "
            "errors='replace' or errors='backslashreplace' instead"
        ) from None


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8; the fast paths' form of _check_utf8."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _json(value: object, *, what: str) -> str:
    try:
        return _encode(value).decode()
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise InvalidInputError(f"{what} cannot be stored as JSON: {exc}") from exc


def run_params(run: Run) -> tuple[str, str, str, int, int, str, str, int]:
    """The ``runs`` row inserting ``run``, in RUN_COLUMNS order: a new run, queued or running
    with none of its jobs done."""
    # The hot path: _checked_run_params's checks, inline, with no message built; anything it
    # does not accept goes to _checked_run_params, which raises the error that explains it.
    try:  # a field unset through its slot reads as AttributeError: explained below
        if type(run) is Run:
            run_id, epochs, job_count, done_count = (
                run.id,
                run.epochs,
                run.job_count,
                run.done_count,
            )
            created_at, models = run.created_at, run.models
            if (
                type(run_id) is _UUID
                and type(run.manifest) is str
                and (run.manifest.isascii() or _utf8(run.manifest))  # bound as is: see _check_utf8
                and type(models) is list
                and all(type(m) is str for m in models)
                and type(epochs) is int
                and 1 <= epochs <= _INT64_MAX
                and type(job_count) is int
                and 1 <= job_count <= _INT64_MAX
                and type(done_count) is int
                and done_count == 0  # a new run: see _checked_run_params
                and type(run.status) in _PLAIN_RUN_STATUS  # hashed next: no subclass's __hash__
                and run.status in _NEW_RUN
                and type(created_at) is datetime
                and created_at.tzinfo is UTC
            ):
                try:
                    return (
                        uuid_text(run_id),
                        run.manifest,
                        _encode(models).decode(),
                        epochs,
                        job_count,
                        _RUN_STATUS[run.status].value,
                        created_at.isoformat(timespec="microseconds")[:-6] + "Z",
                        done_count,
                    )
                except UnicodeEncodeError:  # a model name with a lone surrogate: explained below
                    pass
    except UNSET_OR_UNREADABLE:
        pass
    return _checked_run_params(run)


def _checked_run_params(run: Run) -> tuple[str, str, str, int, int, str, str, int]:
    if not is_a(run, Run):
        raise InvalidInputError(
            f"expected a Run, got {typed(run)}; pass Run(manifest, models, epochs, job_count)"
        )
    (
        given_manifest,
        given_models,
        given_epochs,
        given_job_count,
        given_id,
        given_status,
        given_created_at,
        given_done_count,
    ) = struct_fields(run, Run, what="the run")
    run_id = check_uuid(given_id, what="Run.id")
    where = f"run {run_id}"
    manifest = _check_str(given_manifest, what=f"{where}: manifest")
    models = _check_models(given_models, where=where)
    epochs = _check_int(
        given_epochs,
        what=f"{where}: epochs",
        minimum=1,
        why_minimum=" (a run evaluates at least once)",
    )
    job_count = _check_int(
        given_job_count,
        what=f"{where}: job_count",
        minimum=1,
        why_minimum=(
            " (a run is done when its last job's outcome is recorded, so a run of no jobs "
            "could never be done)"
        ),
    )
    done_count = _check_int(
        given_done_count, what=f"{where}: done_count", minimum=0, why_minimum=" (a count of jobs)"
    )
    # A run is inserted before its jobs (they refer to it), so it has none done yet, and only
    # the outcomes recorded later may count them and finish it: any other start would leave
    # its counters disagreeing with its jobs (what check() reports).
    if done_count != 0:
        raise InvalidInputError(
            f"{where}: done_count is {shown(done_count)}, but a new run has no jobs yet, so "
            "none done; nothing was stored: insert it with done_count=0 (record_job_outcome(s) "
            "count its jobs as they are done)"
        )
    status = run_status(given_status, what=f"{where}: status")
    if status is RunStatus.DONE:
        raise InvalidInputError(
            f"{where}: status is 'done', but a new run has no jobs yet; nothing was stored: "
            "insert it queued (or running): it is done when its last job's outcome is recorded"
        )
    if not is_a(given_created_at, datetime):
        raise InvalidInputError(
            f"{where}: created_at must be a datetime, got {typed(given_created_at)}; pass an aware "
            "datetime, e.g. datetime.now(timezone.utc), or leave it out (Run sets the time it "
            "was made)"
        )
    created_at = format_timestamp(given_created_at, what=f"{where}: created_at")
    return (
        run_id,
        manifest,
        _json(models, what=f"{where}: models"),
        epochs,
        job_count,
        status.value,
        created_at,
        0,  # done_count, checked above
    )


def outcome_json(outcome: JobOutcome) -> str:
    """The ``outcome`` column for ``outcome``."""
    return outcome_params(outcome)[1]


def outcome_params(outcome: JobOutcome) -> tuple[str, str]:
    """``(job id, outcome JSON)``: what recording ``outcome`` binds, checked once for both."""
    rows: list[tuple[str, str]] = []
    outcomes_params((outcome,), rows)
    return rows[0]


# An outcome's JSON begins with its job id's text: msgspec encodes a struct's fields in their
# order, job_id first, and an exact uuid.UUID as its 36-character canonical text (checked
# here, once: if a msgspec release ever spells either otherwise, the id is formatted apart).
_ID_AT: Final = slice(len('{"job_id":"'), len('{"job_id":"') + 36)
_PROBE_ID: Final = uuid.UUID("0123abcd-4567-89ef-0123-456789abcdef")
_ID_IN_JSON: Final = _encode(JobOutcome(_PROBE_ID, score=0.5)).decode()[_ID_AT] == str(_PROBE_ID)
# Cut there, unless uuid_text does more than msgspec's formatting (on 3.13 it checks the range).
_CUT_ID: Final = _ID_IN_JSON and uuid_text is msgspec.to_builtins


def outcomes_params(outcomes: Iterable[JobOutcome], rows: list[tuple[str, str]]) -> None:
    """``(job id, outcome JSON)`` of each outcome, appended to ``rows`` as it goes: on an
    InvalidInputError, ``len(rows)`` is the position of the outcome refused.

    One loop for the batch (record_job_outcomes' 64 outcomes cost a function call each
    before), with the job id cut from the outcome's JSON rather than formatted a second time.
    """
    append = rows.append
    isfinite = math.isfinite
    encode = _encode
    exact_uuid = _UUID
    cut = _CUT_ID
    id_at = _ID_AT
    for outcome in outcomes:
        # Hot path as in run_params; _checked_outcome_params explains what this does not accept.
        try:  # a field unset through its slot reads as AttributeError: explained below
            if type(outcome) is JobOutcome:
                job_id, score, error = outcome.job_id, outcome.score, outcome.error
                if (
                    type(job_id) is exact_uuid
                    and (score is None or (type(score) is float and isfinite(score)))
                    and type(outcome.output) is str
                    and (error is None or type(error) is str)
                ):
                    try:
                        if cut:
                            text = encode(outcome).decode()
                            append((text[id_at], text))
                        else:
                            append((uuid_text(job_id), encode(outcome).decode()))
                        continue
                    except UnicodeEncodeError:  # a lone surrogate: explained below
                        pass
        except UNSET_OR_UNREADABLE:
            pass
        append(_checked_outcome_params(outcome))


def _checked_outcome_params(outcome: JobOutcome) -> tuple[str, str]:
    """As outcome_params, each field read once (a subclass's job_id could name one job for the
    row's key and another in the payload, a row no read takes), then encoded as plain values."""
    if not is_a(outcome, JobOutcome):
        raise InvalidInputError(
            f"expected a JobOutcome, got {typed(outcome)}; nothing of this call was recorded: "
            "pass JobOutcome(job_id, score=...)"
        )
    given_job_id, score, given_output, error = struct_fields(
        outcome, JobOutcome, what="the outcome"
    )
    job_text = check_uuid(given_job_id, what="JobOutcome.job_id")
    where = f"outcome for job {job_text}"
    if score is not None:
        score = _check_score(score, where=where)
    output = _check_str(given_output, what=f"{where}: output")
    if error is not None:
        error = _check_str(error, what=f"{where}: error")
    # Encoded from plain values: msgspec refuses subclasses (numpy.float64, numpy.str_).
    plain = JobOutcome(uuid.UUID(job_text), score, output, error)
    return job_text, _json(plain, what=where)


def _check_score(score: object, *, where: str) -> float | int:
    """A score as a plain float, or an int that one holds exactly (read back as that float,
    it compares equal): anything else would not survive the round trip."""
    if not (is_a(score, int) or is_a(score, float)) or is_a(score, bool):
        raise InvalidInputError(
            f"{where}: score must be a float or None, got {typed(score)}; {_float_fix(score)}"
        )
    # A subclass's plain value, checked and stored as that: never its own methods.
    if is_a(score, int):
        whole = int.__index__(score)
        in_range = -_FLOAT_MAX <= whole <= _FLOAT_MAX
        if not in_range or float(whole) != whole:
            fix = (
                "pass float(...) of it"
                if in_range
                else f"no float holds it (none is beyond {sys.float_info.max:.3g}): pass a "
                "smaller score"
            )
            raise InvalidInputError(
                f"{where}: score is {shown(whole)}, an int that a float (what a score is kept "
                f"as) cannot hold exactly; {fix}"
            )
        return whole
    real = float.__float__(cast(float, score))
    if not math.isfinite(real):
        raise InvalidInputError(
            f"{where}: score {shown(real)} is not finite and JSON cannot hold it; "
            "report a failed evaluation with error=... and score=None"
        )
    return real


JobRow = tuple[str, str, str, str, int, str | None]


def job_params(job: Job) -> JobRow:
    """The ``jobs`` row inserting ``job``, in JOB_COLUMNS order: a new job, not done, with no
    outcome."""
    encode, _, _ = job_encoder()
    return encode(job)


def in_batch(exc: InvalidInputError, what: str, position: int) -> None:
    """Make ``exc``, which refuses the item at ``position`` of the batch argument ``what``, say
    so: an item of a generator, or one with no id (None), is found by no other clue."""
    exc.args = (f"{what}[{position}]: {exc}", *exc.args[1:])


def job_encoder() -> tuple[
    Callable[[Job], JobRow], Callable[[], JobRow | None], Callable[[], dict[str, int]]
]:
    """``(encode, last, per_run)``: job_params for a stream of jobs, the row encode returned
    last, and how many rows it returned for each run id (text).

    insert_jobs maps encode over its jobs, a million of them at a time; last() is then the
    row being inserted when a constraint fails (None before the first), and per_run() what
    each run's job count grows by. Jobs of one run usually share its id object
    (``Job(run.id, ...)``): while a job's run_id is the very object the previous job's was, its
    text is reused instead of formatted again, and it is counted in a local, not a dict. A
    uuid.UUID is immutable, so the same object always has the same text; any other object,
    equal or not, is checked and formatted afresh.
    """
    last: JobRow | None = None
    run_id_seen: object = object()  # no job's run_id: the first job formats its own
    run_text = ""
    counted: dict[str, int] = {}  # rows per run id, but those of the current run's streak
    streak = 0  # rows of run_text since run_id_seen last changed

    def encode(job: Job) -> JobRow:
        # Hot path: _checked_job_params's checks, inline, as in run_params.
        nonlocal last, run_id_seen, run_text, streak
        try:  # a field unset through its slot reads as AttributeError: explained below
            if type(job) is Job:
                job_id, run_id, spec = job.id, job.run_id, job.spec
                status, attempt = job.status, job.attempt
                if run_id is not run_id_seen and type(run_id) is _UUID:
                    text = uuid_text(run_id)  # may raise (no value): before any count moves
                    if streak:
                        counted[run_text] = counted.get(run_text, 0) + streak
                    run_id_seen, run_text, streak = run_id, text, 0
                if (
                    run_id is run_id_seen  # an exact uuid.UUID, whose text run_text is
                    and job.outcome is None
                    and type(job_id) is _UUID
                    and type(spec) is EvalJob
                    and type(spec.model) is str
                    and type(spec.sample_id) is str
                    and type(spec.epoch) is int
                    and _INT64_MIN <= spec.epoch <= _INT64_MAX
                    and (
                        status is _QUEUED
                        or (type(status) in _PLAIN_JOB_STATUS and status in _NEW_JOB)
                    )
                    and type(attempt) is int
                    and 0 <= attempt <= _INT64_MAX
                ):
                    try:
                        row: JobRow = (
                            uuid_text(job_id),
                            run_text,
                            _encode(spec).decode(),
                            "queued" if status is _QUEUED else _JOB_STATUS[status].value,
                            attempt,
                            None,
                        )
                    except UnicodeEncodeError:  # a lone surrogate: _checked_job_params explains
                        pass
                    else:
                        last = row
                        streak += 1
                        return row
        except UNSET_OR_UNREADABLE:
            pass
        last = row = _checked_job_params(job)
        counted[row[1]] = counted.get(row[1], 0) + 1
        return row

    def last_row() -> JobRow | None:
        return last

    def per_run() -> dict[str, int]:
        rows = dict(counted)
        if streak:
            rows[run_text] = rows.get(run_text, 0) + streak
        return rows

    return encode, last_row, per_run


def _checked_job_params(job: Job) -> JobRow:
    if not is_a(job, Job):
        raise InvalidInputError(
            f"expected a Job, got {typed(job)}; no job of this call was inserted: pass "
            "Job(run_id, EvalJob(...))"
        )
    given_run_id, spec, given_id, given_status, given_attempt, given_outcome = struct_fields(
        job, Job, what="the job"
    )
    job_id = check_uuid(given_id, what="Job.id")
    where = f"job {job_id}"
    run_id = check_uuid(given_run_id, what=f"{where}: run_id")
    if not is_a(spec, EvalJob):
        raise InvalidInputError(
            f"{where}: spec must be an EvalJob, got {typed(spec)}; pass "
            "EvalJob(model, sample_id, epoch)"
        )
    # Encoded from plain values: msgspec refuses subclasses (numpy.str_, an IntEnum).
    model, sample_id, epoch = struct_fields(spec, EvalJob, what=f"{where}: spec")
    spec = EvalJob(
        _check_str(model, what=f"{where}: spec.model"),
        _check_str(sample_id, what=f"{where}: spec.sample_id"),
        _check_int(epoch, what=f"{where}: spec.epoch"),
    )
    status = _status(given_status, JobStatus, what=f"{where}: status")
    attempt = _check_int(
        given_attempt, what=f"{where}: attempt", minimum=0, why_minimum=" (a count of tries)"
    )
    # Only a recorded outcome marks a job done, and counts it in its run's done_count: a job
    # inserted done, or with an outcome, would leave the two disagreeing (see check()).
    if status is JobStatus.DONE or given_outcome is not None:
        given = "status is 'done'" if status is JobStatus.DONE else "it has an outcome"
        raise InvalidInputError(
            f"{where}: {given}, but a new job has no outcome yet; no job of this call was "
            "inserted: insert it queued (or running) without one, then record its outcome "
            "with record_job_outcome(s), which marks it done and counts it in its run"
        )
    return (job_id, run_id, _json(spec, what=f"{where}: spec"), status.value, attempt, None)


def lenient_text(data: bytes) -> str | bytes:
    """A TEXT value as str, or as its raw bytes when it is not UTF-8 (a hand-edited row).

    Used as the connection's ``text_factory`` when a strict read failed: the reader then sees
    bytes where it expects text and reports the row, instead of sqlite3 failing the whole query.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


_BY_HAND: Final = "repair the row by hand or restore it from a backup"


def id_text(value: object) -> str:
    """A stored id as a message shows it: text as is, anything else (bytes, a number) as
    shown() shows it."""
    return value if isinstance(value, str) else shown(value)


def _unpadded_year_fix(row: Any, column: str, value: str) -> str:
    """The repair of a timestamp of a year below 1000 that early releases wrote without its
    leading zeros (glibc's strftime("%Y"): '5-01-01T...'); _BY_HAND for any other text."""
    year, dash, rest = value.partition("-")
    padded = year.rjust(4, "0") + dash + rest
    if not (year.isascii() and year.isdigit() and len(year) < 4 and dash):
        return _BY_HAND
    try:
        _parse_timestamp(padded)
    except (ValueError, msgspec.DecodeError):
        return _BY_HAND
    if type(row.row[0]) is not str or "\0" in row.row[0]:
        # An id that is no text (a BLOB, or text that is no UTF-8, read as its bytes) has no
        # literal that matches it alone: its repr in quotes matches no row, or another row
        # whose id is that text. check() reports the id too; once that is fixed, it gives this
        # UPDATE.
        return _BY_HAND
    row_id = row.row[0].replace("'", "''")
    return (
        f"an early version of control_store wrote it without the year's leading zeros; "
        f"rewrite it as {padded!r}: UPDATE {row.table} SET {column} = '{padded}' "
        f"WHERE id = '{row_id}'"
    )


def corrupt_row(
    table: str,
    column: str,
    row_id: object,
    value: object,
    why: str,
    fix: str = _BY_HAND,
    *,
    verdict: str = "which this version cannot read",
) -> CorruptRowError:
    """The error for a stored value this version cannot read (or, as ``verdict`` says, one it
    reads but cannot be the row's)."""
    row = id_text(row_id)
    return CorruptRowError(
        f"{table}.{column} of row {row} holds {shown(value)}, {verdict} ({why}); {fix}",
        table=table,
        column=column,
        row_id=row,
        value=value,
    )


# Every lookup by id binds the canonical text: an id spelt otherwise (upper case, no hyphens,
# braces) would come back from a list or a claim, and then be found by no call given it.
NOT_CANONICAL: Final = (
    "expected canonical UUID text, lower case and hyphenated: an id spelt otherwise is never "
    "found by id"
)
_RESPELL: Final = (
    "rewrite it, or delete it if it is a second copy, as Store.check() (control-store check) says"
)
_UUID_LENGTH: Final = 36


def _canonical_column(texts: Sequence[str]) -> bool:
    """Whether texts that msgspec has parsed as UUIDs are all canonical, in a few C calls
    (formatting each UUID to compare would cost five times as much). msgspec takes only the
    hyphenated 36 characters and the bare 32 hex digits, so they are canonical exactly when
    all are 36 characters long and none holds upper case."""
    joined = "".join(texts)
    return len(joined) == _UUID_LENGTH * len(texts) and joined.lower() == joined


_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")


def spelt_uuid(text: str) -> uuid.UUID | None:
    """The UUID ``text`` spells in a form uuid.UUID() reads (hex digits in either case, hyphens,
    braces, a urn:uuid: prefix); None for any other text. Stricter than uuid.UUID(), which
    reads its 32 digits with int(x, 16): that also takes whitespace, '+', '_' and non-ASCII
    digits, and reads text holding them as another UUID."""
    digits = text.replace("urn:", "").replace("uuid:", "").strip("{}").replace("-", "")
    if len(digits) != 32 or not _HEX_DIGITS.issuperset(digits):
        return None
    return uuid.UUID(hex=digits)


def stored_uuid(table: str, column: str, row_id: object, value: object) -> uuid.UUID:
    """A stored id, as the decoders read one: canonical UUID text, else the CorruptRowError
    naming the row (for code that reads an id without decoding its whole row)."""
    return _Reader(table, (row_id, value)).uuid(1, column)


def stored_job_status(job_id: str, value: object) -> JobStatus:
    """A stored job status, as the decoders read one, else the CorruptRowError naming the row."""
    status: JobStatus = _Reader("jobs", (job_id, value)).enum(1, "status", JobStatus)
    return status


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _collecting(
    read: Callable[Concatenate[_Reader, _P], _T],
) -> Callable[Concatenate[_Reader, _P], _T]:
    """A column read of _Reader that, while the reader collects errors, adds a refused cell's
    CorruptRowError to them and reads None instead of raising."""

    @functools.wraps(read)
    def collecting(reader: _Reader, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return read(reader, *args, **kwargs)
        except CorruptRowError as exc:
            if reader.errors is None:
                raise
            reader.errors.append(exc)
            return cast(_T, None)  # the row being judged, not read: its value is thrown away

    return collecting


class _Reader:
    """Reads one row's columns, turning any failure into a CorruptRowError.

    ``canonical=False`` takes an id spelt otherwise than canonically (for check(), which
    reports the spelling itself, and judges the rest of the row as it stands). Given
    ``errors``, the reader adds each refused cell's error to it and reads on, so that one
    pass finds every bad cell of a row (for check(): a repair of the first alone would leave
    the next to a second check()).
    """

    __slots__ = ("canonical", "errors", "row", "table")

    def __init__(
        self,
        table: str,
        row: Sequence[Any],
        *,
        canonical: bool = True,
        errors: list[CorruptRowError] | None = None,
    ) -> None:
        self.table = table
        self.row = row
        self.canonical = canonical
        self.errors = errors

    def corrupt(
        self, column: str, value: object, why: str, fix: str = _BY_HAND, **verdict: str
    ) -> CorruptRowError:
        return corrupt_row(self.table, column, self.row[0], value, why, fix, **verdict)

    @_collecting
    def uuid(self, index: int, column: str) -> uuid.UUID:
        value = self.row[index]
        if not isinstance(value, str):
            raise self.corrupt(column, value, "expected UUID text")
        parsed = spelt_uuid(value)
        if parsed is None:
            raise self.corrupt(column, value, "expected a UUID")
        if self.canonical and str(parsed) != value:
            raise self.corrupt(column, value, NOT_CANONICAL, _RESPELL)
        return parsed

    @_collecting
    def text(self, index: int, column: str) -> str:
        value = self.row[index]
        if not isinstance(value, str):
            raise self.corrupt(column, value, "expected text")
        return value

    @_collecting
    def integer(self, index: int, column: str, minimum: int = 0) -> int:
        value = self.row[index]
        if not isinstance(value, int) or value < minimum:
            raise self.corrupt(column, value, f"expected an integer >= {minimum}")
        return value

    @_collecting
    def timestamp(self, index: int, column: str) -> datetime:
        value = self.row[index]
        why = "expected RFC 3339 UTC text like 2026-01-01T00:00:00.000000Z"
        if not isinstance(value, str):
            raise self.corrupt(column, value, why)
        try:
            return _parse_timestamp(value)
        except (ValueError, msgspec.DecodeError) as exc:
            raise self.corrupt(column, value, why, _unpadded_year_fix(self, column, value)) from exc

    @_collecting
    def json(self, index: int, column: str, decode: Any) -> Any:
        value = self.row[index]
        form = _JSON_FORMS[column]
        if not isinstance(value, str | bytes):
            raise self.corrupt(column, value, f"expected {form}, as text")
        try:
            return decode(value)
        except _UNREADABLE_JSON as exc:
            raise self.corrupt(column, value, f"expected {form}; {exc}") from exc

    @_collecting
    def outcome(self, index: int) -> JobOutcome | None:
        """A job's outcome, which must be that job's: one naming another job (a hand edit, a
        row copied over another) would be reported as this job's result."""
        recorded: JobOutcome | None = self.json(index, "outcome", _decode_outcome)
        own = spelt_uuid(self.row[0]) if isinstance(self.row[0], str) else None
        if recorded is not None and own is not None and recorded.job_id != own:
            raise self.corrupt(
                "outcome",
                self.row[index],
                f"it is the outcome of job {recorded.job_id}, and this row is job {own}: one "
                "job's result would be reported as another's",
                "give the row its own job's outcome, or restore it from a backup; with "
                "neither to be had, set its outcome to NULL and its status to 'queued' (the "
                "job runs again), then check again: its run's counters change with it",
                verdict="which cannot be this row's",
            )
        return recorded

    @_collecting
    def enum(self, index: int, column: str, kind: type[RunStatus] | type[JobStatus]) -> Any:
        value = self.row[index]
        try:
            return kind(value)
        except ValueError as exc:
            allowed = [s.value for s in kind]
            raise self.corrupt(column, value, f"expected one of {allowed}") from exc


def decode_runs(rows: Sequence[Sequence[Any]]) -> list[Run]:
    """Runs from rows selected as RUN_COLUMNS.

    The batch fast path: each column is checked and converted whole, in a few C calls
    (msgspec, set(), min(), str.join), then the runs are built. It admits exactly what
    decode_run admits; any row it cannot take sends every row through decode_run, which
    raises the CorruptRowError naming the bad cell.
    """
    if len(rows) < _BATCH:
        return [decode_run(row) for row in rows]
    if len(rows) > _DECODE_CHUNK:
        return _chunked(decode_runs, rows)
    try:
        ids, manifests, models, epochs, job_counts, statuses, created, done_counts = zip(
            *rows, strict=True
        )
        status_of = _RUN_STATUS
        return _runs_of_columns(
            ids,
            manifests,
            models,
            epochs,
            job_counts,
            [status_of[s] for s in statuses],
            created,
            done_counts,
        )
    except _REFUSED:
        return [decode_run(row) for row in rows]


# What a claim returns: the rowid (to sort by), then RUN_COLUMNS but status, which the claim
# has just set to 'running' (fetching it would only cost time).
CLAIMED_COLUMNS: Final = "rowid, id, manifest, models, epochs, job_count, created_at, done_count"


def decode_claimed(rows: Sequence[Sequence[Any]]) -> list[Run]:
    """Runs from rows selected as CLAIMED_COLUMNS, all running; the fast path of decode_runs."""
    if len(rows) < _BATCH:
        return [_decode_claimed_row(row) for row in rows]
    if len(rows) > _DECODE_CHUNK:
        return _chunked(decode_claimed, rows)
    try:
        _, ids, manifests, models, epochs, job_counts, created, done_counts = zip(
            *rows, strict=True
        )
        statuses = itertools.repeat(RunStatus.RUNNING, len(rows))
        return _runs_of_columns(
            ids, manifests, models, epochs, job_counts, statuses, created, done_counts
        )
    except _REFUSED:
        return [_decode_claimed_row(row) for row in rows]


def _decode_claimed_row(row: Sequence[Any]) -> Run:
    return decode_run((*row[1:6], _RUNNING, *row[6:]))


def _runs_of_columns(
    ids: Sequence[Any],
    manifests: Sequence[Any],
    models: Sequence[Any],
    epochs: Sequence[Any],
    job_counts: Sequence[Any],
    statuses: Iterable[RunStatus],
    created: Sequence[Any],
    done_counts: Sequence[Any],
) -> list[Run]:
    # One msgspec call checks and converts every column but models, and a few C calls the
    # text it reads more loosely than decode_run (~16 us for 64 rows, where a set of types and
    # a min() per column, then a conversion per column took ~24 us). What msgspec takes that
    # decode_run does not is refused after it: a UUID or its 16 bytes for an id, and a datetime
    # for created_at, by the joins of _canonical_column and _timestamps_in_form (str only). It
    # takes no bool or float for an int (strict), and no bytes for a str. It takes a subclass
    # of int or str (sqlite3 returns none), as _checked_run does: the runs hold the columns' own
    # values, as decode_run's do, and only the ids and times it converted.
    columns: _RunColumns = _convert(
        (ids, manifests, epochs, job_counts, created, done_counts), _RunColumns
    )
    if not _canonical_column(ids):
        raise ValueError("an id is not canonical UUID text")
    if not _timestamps_in_form(created):
        raise ValueError("a created_at is not fixed-width RFC 3339 UTC text")
    model_lists = _json_column(_decode_models, models)
    return [
        Run(m, ml, e, j, id=i, status=s, created_at=c, done_count=d)
        for i, m, ml, e, j, s, c, d in zip(
            columns.ids,
            manifests,
            model_lists,
            epochs,
            job_counts,
            statuses,
            columns.created,
            done_counts,
            strict=True,
        )
    ]


def _json_column(decode: Any, texts: Sequence[str]) -> list[Any]:
    """Decode a column of JSON texts, each on its own, in C calls (map): what a text holds that
    the per-row decoder refuses raises here too, and the caller goes row by row.

    Not as one array of the texts joined by commas, which took 0-20% less time but let crafted
    texts make up values: one opening a string that the next closes, with a third holding two
    values to keep the count, read as values no row holds."""
    return list(map(decode, texts))


def decode_run(row: Sequence[Any]) -> Run:
    """A Run from a ``runs`` row selected as RUN_COLUMNS."""
    # The hot path (every claim returns runs): the same checks as _checked_run, inline, with
    # no per-column method calls. Anything unexpected goes to _checked_run for the diagnosis.
    run_id, manifest, models, epochs, job_count, status, created_at, done_count = row
    if (
        type(manifest) is str
        and type(models) is str
        and type(epochs) is int
        and epochs >= 1
        and type(job_count) is int
        and job_count >= 0
        and type(done_count) is int
        and done_count >= 0
        and type(run_id) is str
        and type(created_at) is str
        and status in _RUN_STATUS
        and (parsed := _uuid_if_canonical(run_id)) is not None
    ):
        try:
            return Run(
                manifest,
                _decode_models(models),
                epochs,
                job_count,
                id=RunId(parsed),
                status=_RUN_STATUS[status],
                created_at=_parse_timestamp(created_at),
                done_count=done_count,
            )
        except (ValueError, *_UNREADABLE_JSON):
            pass
    return _checked_run(row)


def _uuid_if_canonical(text: str) -> uuid.UUID | None:
    """The UUID whose canonical text ``text`` is; None for any other text (by the same test
    as the batch paths': see _canonical_column)."""
    try:
        parsed: uuid.UUID = _convert(text, uuid.UUID)
    except (ValueError, msgspec.DecodeError):
        return None
    return parsed if _canonical_column((text,)) else None


def _checked_run(
    row: Sequence[Any], *, canonical: bool = True, errors: list[CorruptRowError] | None = None
) -> Run:
    r = _Reader("runs", row, canonical=canonical, errors=errors)
    return Run(
        r.text(1, "manifest"),
        r.json(2, "models", _decode_models),
        r.integer(3, "epochs", minimum=1),
        r.integer(4, "job_count"),
        id=RunId(r.uuid(0, "id")),
        status=r.enum(5, "status", RunStatus),
        created_at=r.timestamp(6, "created_at"),
        done_count=r.integer(7, "done_count"),
    )


def run_cell_errors(row: Sequence[Any]) -> list[CorruptRowError]:
    """The CorruptRowError of every cell decode_run refuses, but an id spelt otherwise than
    canonically, naming the row by its id as stored (for check())."""
    errors: list[CorruptRowError] = []
    _checked_run(row, canonical=False, errors=errors)
    return errors


def decode_jobs(rows: Sequence[Sequence[Any]]) -> list[Job]:
    """Jobs from rows selected as JOB_COLUMNS; the batch fast path, as decode_runs."""
    if len(rows) < _BATCH:
        return [decode_job(row) for row in rows]
    if len(rows) > _DECODE_CHUNK:
        return _chunked(decode_jobs, rows)
    try:
        return _jobs_of_columns(list(zip(*rows, strict=True)))
    except _REFUSED:
        return [decode_job(row) for row in rows]


def decode_keyed_jobs(rows: Sequence[Sequence[Any]]) -> list[Job]:
    """Jobs from rows selected as ``rowid, JOB_COLUMNS`` (a page of iter_jobs), as decode_jobs.

    The rowid is dropped column-wise on the fast path, with no per-row slice; the slow path
    slices each row and lets decode_job name the bad cell.
    """
    if len(rows) > _DECODE_CHUNK:
        return _chunked(decode_keyed_jobs, rows)
    if len(rows) >= _BATCH:
        try:
            return _jobs_of_columns(list(zip(*rows, strict=True))[1:])
        except _REFUSED:
            pass
    return [decode_job(row[1:]) for row in rows]


def _jobs_of_columns(columns: list[tuple[Any, ...]]) -> list[Job]:
    ids, run_ids, specs, statuses, attempts, outcomes = columns
    if not (
        set(map(type, ids)) == _ONLY_STR  # msgspec would take bytes for a UUID too
        and set(map(type, run_ids)) == _ONLY_STR
        and set(map(type, specs)) == _ONLY_STR
        and set(map(type, attempts)) == _ONLY_INT
        and min(attempts) >= 0
        and set(map(type, outcomes)) <= {str, type(None)}
    ):
        raise ValueError("a column holds a value decode_job would refuse")
    job_ids = _convert((ids,), _UuidColumn).values
    distinct = set(run_ids)
    if len(distinct) == 1:  # the usual case, one run's jobs: parse its id once
        run_id = _convert(run_ids[0], uuid.UUID)
        canonical = _canonical_column(run_ids[:1])
        parents: Iterable[uuid.UUID] = itertools.repeat(run_id, len(run_ids))
    else:
        parents = _convert((run_ids,), _UuidColumn).values
        canonical = _canonical_column(run_ids)
    if not canonical or not _canonical_column(ids):
        raise ValueError("an id is not canonical UUID text")
    spec_list = _json_column(_decode_spec, specs)
    recorded = [o for o in outcomes if o is not None]
    decoded_list: list[JobOutcome] = _json_column(_decode_outcome, recorded)
    owners = [i.int for i, o in zip(job_ids, outcomes, strict=True) if o is not None]
    if [o.job_id.int for o in decoded_list] != owners:
        raise ValueError("an outcome names another job than the row it is stored in")
    if [st == "done" for st in statuses] != [o is not None for o in outcomes]:
        raise ValueError("a job's status disagrees with its outcome")
    decoded = iter(decoded_list)
    status_of = _JOB_STATUS
    return [
        Job(
            r,
            sp,
            id=i,
            status=status_of[st],
            attempt=a,
            outcome=None if o is None else next(decoded),
        )
        for i, r, sp, st, a, o in zip(
            job_ids, parents, spec_list, statuses, attempts, outcomes, strict=True
        )
    ]


def decode_job(row: Sequence[Any]) -> Job:
    """A Job from a ``jobs`` row selected as JOB_COLUMNS."""
    # Fast path as in decode_run; _checked_job explains whatever it does not accept.
    job_id, run_id, spec, status, attempt, outcome = row
    if (
        type(job_id) is str
        and type(run_id) is str
        and type(spec) is str
        and type(attempt) is int
        and attempt >= 0
        and status in _JOB_STATUS
        and (outcome is None or type(outcome) is str)
        and (parent := _uuid_if_canonical(run_id)) is not None
        and (parsed := _uuid_if_canonical(job_id)) is not None
    ):
        try:
            recorded = None if outcome is None else _decode_outcome(outcome)
            # Else of another job, or a status that disagrees with the outcome.
            if (recorded is None or recorded.job_id.int == parsed.int) and (outcome is None) is (
                status != "done"
            ):
                return Job(
                    parent,
                    _decode_spec(spec),
                    id=JobId(parsed),
                    status=_JOB_STATUS[status],
                    attempt=attempt,
                    outcome=recorded,
                )
        except (ValueError, *_UNREADABLE_JSON):
            pass
    return _checked_job(row)


def job_cell_errors(row: Sequence[Any]) -> list[CorruptRowError]:
    """As run_cell_errors, for a job."""
    errors: list[CorruptRowError] = []
    _checked_job(row, canonical=False, errors=errors)
    return errors


def _checked_job(
    row: Sequence[Any], *, canonical: bool = True, errors: list[CorruptRowError] | None = None
) -> Job:
    r = _Reader("jobs", row, canonical=canonical, errors=errors)
    outcome = None if row[5] is None else r.outcome(5)
    job = Job(
        r.uuid(1, "run_id"),
        r.json(2, "spec", _decode_spec),
        id=JobId(r.uuid(0, "id")),
        status=r.enum(3, "status", JobStatus),
        attempt=r.integer(4, "attempt"),
        outcome=outcome,
    )
    if errors is None and (job.outcome is None) is (job.status is JobStatus.DONE):
        raise status_disagrees(id_text(row[0]), row[3], has_outcome=job.outcome is not None)
    return job


def status_disagrees(job_id: str, status: object, *, has_outcome: bool) -> CorruptRowError:
    """The error for a job whose status disagrees with its outcome (check() reports each such
    job too): a job is 'done' exactly when it holds an outcome. The status follows the outcome,
    never the reverse: a recorded outcome stands, and a job without one has not run."""
    if has_outcome:
        why = "the job holds an outcome, so it is done"
        fix = "set its status to 'done', then run check() for its run's counters"
    else:
        why = "the job holds no outcome, so it has not run"
        fix = (
            "set its status to 'queued' for it to run again, then run check() for its run's "
            "counters"
        )
    return corrupt_row(
        "jobs", "status", job_id, status, why, fix, verdict="which cannot be this row's"
    )
