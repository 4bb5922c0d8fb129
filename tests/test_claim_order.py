"""op_claim_runs orders the claimed rows by two one-key sorts: exactly as the one
(created_at, rowid) key orders them, and, where a created_at cannot be compared, as that key
leaves them."""

from __future__ import annotations

import contextlib
import operator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from control_store import _sqlite

_KEY = operator.itemgetter(6, 0)


def _one_key(rows: list[Any]) -> list[Any]:
    ordered = list(rows)
    with contextlib.suppress(TypeError):
        ordered.sort(key=_KEY)
    return ordered


_CREATED = st.one_of(
    st.sampled_from(["2026-01-01T00:00:00.000000Z", "2026-01-01T00:00:00.000001Z"]),
    st.text(max_size=3),
    st.binary(max_size=2),  # str and bytes do not compare: the sort fails
)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 50), _CREATED), max_size=20, unique_by=lambda c: c[0]))
def test_claimed_rows_are_ordered_as_the_one_key_orders_them(
    cells: list[tuple[int, object]],
) -> None:
    rows = [(rowid, "id", "m", "[]", 1, 1, created, 0) for rowid, created in cells]
    sorted_rows = list(rows)
    _sqlite._sort_claimed(sorted_rows)
    assert sorted_rows == _one_key(rows)
