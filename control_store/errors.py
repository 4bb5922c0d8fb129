"""Every failure a caller of ``control_store`` can see.

All of them derive from :class:`ControlError`, so ``except ControlError`` catches everything the
store raises on purpose; a driver exception (``sqlite3``, ``aiosqlite``, ``msgspec``) never escapes,
it is chained as ``__cause__`` of the error that explains it. Each message says what happened,
to what (the id, the column, the value), and what to do::

    ControlError
    ├── StoreClosedError          a call on a store after close() or in a forked child
    ├── WrongEventLoopError       a call from an event loop other than the one that opened the store
    ├── ReadOnlyStoreError        a write called on a store opened with read_only=True
    ├── ConfigurationError        bad URL or option, missing directory (or file), not a database
    ├── InvalidInputError         a value the store cannot keep (naive datetime, epochs < 1, ...)
    ├── NotFoundError             an outcome for a job the store does not have
    ├── WrongRunError             an outcome for a job that belongs to another run
    ├── ConstraintError           the database refused a write that breaks its rules
    │   ├── AlreadyExistsError    a run or job id already stored, or given twice in one call
    │   └── MissingRunError       a job whose run does not exist
    ├── CorruptRowError           a stored value this version cannot read (table, column, id, value)
    ├── MigrationError            the schema cannot be brought up to date
    │   ├── MigrationChangedError an applied migration's file was edited afterwards
    │   ├── UnknownMigrationError the database holds a migration this library does not have
    │   ├── PendingMigrationError a schema older than this library's, on a store that does not
    │   │                         migrate: read_only=True (at connect), or migrate=False (at
    │   │                         each call until store.migrate())
    │   └── DirtyMigrationError   a migration was recorded as failed
    ├── DatabaseBusyError         a lock not taken within busy_timeout: others held it (a writer;
    │                             out of WAL mode, a reader too), or kept winning it; retryable
    └── StorageError              the file system refused: disk full, read-only, I/O error

Errors that a retry may cure carry ``retryable = True``.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "ConfigurationError",
    "ConstraintError",
    "ControlError",
    "CorruptRowError",
    "DatabaseBusyError",
    "DirtyMigrationError",
    "InvalidInputError",
    "MigrationChangedError",
    "MigrationError",
    "MissingRunError",
    "NotFoundError",
    "PendingMigrationError",
    "ReadOnlyStoreError",
    "StorageError",
    "StoreClosedError",
    "UnknownMigrationError",
    "WrongEventLoopError",
    "WrongRunError",
]


class ControlError(Exception):
    """The root of every error ``control_store`` raises."""

    retryable: bool = False

    def __reduce__(self) -> tuple[object, ...]:
        # Exception's own pickling calls type(*args): it cannot rebuild an error whose
        # __init__ takes keyword-only fields (CorruptRowError), so an error raised in a
        # ProcessPoolExecutor worker would break the pool instead of reaching the caller.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(
    kind: type[ControlError], args: tuple[object, ...], state: dict[str, object]
) -> ControlError:
    """An error unpickled: its message and attributes, without calling its __init__ again."""
    error = kind.__new__(kind, *args)  # BaseException.__new__ sets .args
    error.__dict__.update(state)
    return error


class StoreClosedError(ControlError):
    """A call was made on a store that has been closed, or in a process forked from the one
    that opened it (connect a new store there)."""


class WrongEventLoopError(ControlError, RuntimeError):
    """A store was called from an event loop other than the one that opened it; nothing was done.

    A store's calls, its group commit and the futures its thread completes belong to the loop
    that opened it. Open a store in each event loop (each thread running asyncio), or submit
    the call to the store's own loop with ``asyncio.run_coroutine_threadsafe``.
    """


class ReadOnlyStoreError(ControlError):
    """A write was called on a store opened with ``read_only=True``; nothing was written.

    Not a StorageError: the file system refused nothing, and no retry of the same call on the
    same store can succeed. Connect again without ``read_only`` to write.
    """


class ConfigurationError(ControlError):
    """The URL or an option given to ``Store.connect`` cannot be used, or this Python's SQLite
    is too old for the store."""


class InvalidInputError(ControlError, ValueError):
    """A value passed in cannot be stored faithfully, or an argument of a read is out of its
    range (a negative ``limit``, a ``page_size`` of 0, a status that is no RunStatus); nothing was
    written."""


class NotFoundError(ControlError, LookupError):
    """The thing a call refers to is not in the store."""


class WrongRunError(ControlError):
    """An outcome names a job that belongs to a different run."""


class ConstraintError(ControlError):
    """The database refused a write that would break one of its constraints."""


class AlreadyExistsError(ConstraintError):
    """A run or job with this id is already stored, or was given twice in one call."""


class MissingRunError(ConstraintError):
    """A job refers to a run that does not exist."""


class CorruptRowError(ControlError):
    """A stored value cannot be read by this version of the library."""

    def __init__(self, message: str, *, table: str, column: str, row_id: str, value: object):
        super().__init__(message)
        self.table = table
        self.column = column
        self.row_id = row_id
        self.value = value


class MigrationError(ControlError):
    """The database schema cannot be brought to the version this library needs."""


class MigrationChangedError(MigrationError):
    """A migration that was applied has been modified since."""


class UnknownMigrationError(MigrationError):
    """The database was migrated by a newer version of the library."""


class PendingMigrationError(MigrationError):
    """The schema is older than this library's latest migration, on a store that will not
    apply the pending ones itself.

    Reading or writing an older schema with newer code could misread it, so: a store opened
    with ``read_only=True``, which never migrates, refuses at connect; a store opened with
    ``migrate=False`` connects, but refuses every call that needs the schema until
    ``await store.migrate()`` applied them (or another process did: each refusal reads the
    schema's state again, and describes the file as it is then). ``found`` is the newest
    migration applied (0: none), ``needed`` the newest one this library has, ``pending`` the
    (version, description) of each one not applied, and ``tables``, where none is recorded,
    the tables the file holds all the same (its history's rows were lost; () for an empty file).
    """

    def __init__(
        self,
        message: str,
        *,
        found: int,
        needed: int,
        pending: tuple[tuple[int, str], ...],
        tables: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.found = found
        self.needed = needed
        self.pending = pending  # (version, description) of each migration not applied
        self.tables = tables


class DirtyMigrationError(MigrationError):
    """A migration is recorded as started but not successfully finished."""


class DatabaseBusyError(ControlError):
    """A lock on the database could not be taken within ``busy_timeout``: another connection held
    it that long (its write lock, or, on a file switched out of WAL mode, any open
    transaction), or other connections kept taking it in turn (SQLite's wait is not fair)."""

    retryable = True


class StorageError(ControlError):
    """The file system refused the database: full, read-only, gone, or failing."""
