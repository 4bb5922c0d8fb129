"""A caller's value as an error message shows it: never raising, never unbounded.

Every message that quotes a value the caller passed goes through ``shown``: formatting the
value must not itself fail, or the caller would get that failure (a raw ``ValueError``, or
whatever a broken ``__repr__`` raises) instead of the ``ControlError`` that explains the value.
"""

from __future__ import annotations

import math
from typing import Any, Final, TypeGuard, TypeVar, overload

_T = TypeVar("_T")

# Python refuses to turn an int of more than 4300 digits into text (sys.int_max_str_digits,
# since 3.11: "Exceeds the limit (4300 digits) for integer string conversion"), and a message
# of thousands of digits helps nobody anyway: an int past this many bits (about 49 digits; an
# int64 has 19) is shown by its size.
_INT_BITS_SHOWN: Final = 160
_LOG10_2: Final = math.log10(2)
# A repr longer than this is cut: a message quoting a million-element list would be megabytes.
_REPR_CHARS_SHOWN: Final = 500


@overload
def is_a(value: object, kind: type[_T]) -> TypeGuard[_T]: ...
@overload
def is_a(value: object, kind: Any) -> bool: ...  # an abstract class: Iterable, os.PathLike
def is_a(value: object, kind: Any) -> bool:
    """Whether ``value`` is of ``kind`` by its type, not by isinstance(): isinstance() also
    reads an object's ``__class__``, which an object can set to claim any class (a property
    returning str), and that class's own methods then fail on it, or make raise."""
    return issubclass(type(value), kind)


def shown(value: object) -> str:
    """``repr(value)`` for a message, safe for any value.

    An int too long to print becomes "an int of about N digits" (N from its bit length, which
    costs nothing); a repr that raises becomes a description of the value's type; a very long
    repr is cut, saying how long it was.
    """
    return _shown(value)[0]


def typed(value: object) -> str:
    """``"<type name>: <shown value>"``, for a message about a value of the wrong type (just
    the description, when the value is shown by one: it names the type already)."""
    text, is_repr = _shown(value)
    return f"{_type_name(value)}: {text}" if is_repr else text


def _shown(value: object) -> tuple[str, bool]:
    """shown(value), and whether it is the value's repr (else a description of the value)."""
    # int's own methods, never a subclass's (which could raise).
    if is_a(value, int) and int.bit_length(value) > _INT_BITS_SHOWN:
        digits = int(int.bit_length(value) * _LOG10_2) + 1
        sign = "a negative" if int.__index__(value) < 0 else "an"
        return f"{sign} int of about {digits} digits", False
    try:
        # repr() may give a str subclass, whose own methods (len, slicing) may raise: its
        # plain text, by str's own method.
        text = str.__str__(repr(value))
    except Exception as exc:  # any failure of a caller's __repr__ is described, not raised
        return f"a {_type_name(value)} whose repr() raised {_type_name(exc)}", False
    if len(text) > _REPR_CHARS_SHOWN:
        return f"{text[:_REPR_CHARS_SHOWN]}... ({len(text)} characters in all)", True
    return text, True


def _type_name(value: object) -> str:
    # type(value).__name__ is a plain attribute of the class (a metaclass could make even it
    # a property that raises, so it is read defensively too).
    try:
        name = type(value).__name__
    except Exception:
        return "value"
    return name if isinstance(name, str) else "value"


def failure(exc: BaseException) -> str:
    """``"<type name>: <message>"`` of an exception a caller's object raised, safe as shown."""
    try:
        message = str.__str__(str(exc))  # plain text, as _shown reads a repr
    except Exception:
        return f"{_type_name(exc)} (whose message could not be read)"
    if len(message) > _REPR_CHARS_SHOWN:
        message = f"{message[:_REPR_CHARS_SHOWN]}..."
    return f"{_type_name(exc)}: {message}" if message else _type_name(exc)


def counted(count: int, noun: str, plural: str = "") -> str:
    """``count`` and ``noun`` agreeing: "1 run", "2,000 runs", "2 processes" (``plural``)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
