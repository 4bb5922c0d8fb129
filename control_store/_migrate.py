"""Embedded, versioned SQL migrations with sqlx's semantics.

Files are ``NNNN_description.sql`` under ``migrations/<backend>/``. Each applied migration is
tracked in ``_control_store_migrations`` with its version, description, SHA-384 checksum of the
file (line endings normalised to LF, so a Windows checkout does not look "edited"), when it was
installed, whether it succeeded and how long it took. This module finds and checks migrations;
applying them is the backend's job (each in one write transaction with its bookkeeping row).
"""

from __future__ import annotations

import errno
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from . import _codec
from .errors import (
    DirtyMigrationError,
    MigrationChangedError,
    MigrationError,
    StorageError,
    UnknownMigrationError,
)
from .models import utc_now

TRACKING_TABLE: Final = "_control_store_migrations"
_FILE_NAME: Final = re.compile(r"^(\d+)_(\w+)\.sql$")
_PACKAGE: Final = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file."""

    version: int
    description: str
    sql: str
    checksum: bytes
    path: Path


@dataclass(frozen=True, slots=True)
class AppliedMigration:
    """One row of the tracking table."""

    version: int
    description: str
    checksum: bytes
    success: bool


def migrations_dir(backend: str) -> Path:
    """Where ``backend``'s migration files are.

    In a wheel they are inside the package (``control_store/migrations``, put there by the
    build); in a source checkout or an editable install they are at the repository's top.
    """
    for root in (_PACKAGE / "migrations", _PACKAGE.parent / "migrations"):
        if (root / backend).is_dir():
            return root / backend
    raise MigrationError(
        f"no migrations for {backend!r} found in {_PACKAGE / 'migrations'} or "
        f"{_PACKAGE.parent / 'migrations'}; the installation is incomplete: reinstall control-store"
    )


# Checksums an earlier state of a shipped migration file had, whose schema is the one the file
# makes now (only comments or an IF NOT EXISTS changed): a database it migrated is sound, and
# must not be refused as edited. 0003_runs_created was first shipped without IF NOT EXISTS.
EARLIER_CHECKSUMS: Final = {
    3: frozenset(
        {
            bytes.fromhex(
                "29f4363057b33d9b13fff85c1e28952cda3286895485037927268ba8b8b8fb4d"
                "47cdc04823bbf84f14a54516c360b34e"
            )
        }
    ),
}


def same_migration(migration: Migration, recorded: bytes) -> bool:
    """Whether ``recorded`` is the checksum of ``migration``'s file, now or as first shipped."""
    return recorded == migration.checksum or recorded in EARLIER_CHECKSUMS.get(
        migration.version, ()
    )


def checksum(sql_bytes: bytes) -> bytes:
    """SHA-384 of a migration file with CRLF and CR line endings normalised to LF."""
    normalised = sql_bytes.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return hashlib.sha384(normalised).digest()


# The errors of an OSError that a retry may cure, once files are closed or memory freed: a
# process out of descriptors (its own, or the system's), or memory, or interrupted.
RETRYABLE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR})
# The fix for a process at its limit of open files.
OUT_OF_FILES_FIX: Final = (
    "close some files (each open store holds three) or raise the limit (ulimit -n), then retry"
)


def load_migrations(backend: str, directory: Path | None = None) -> list[Migration]:
    """Every migration of ``backend``, in version order.

    Read at each connect (and by migrate(), migration_status(), check()): a process at its
    limit of open files, or a file system failing, makes that read fail, which is a
    StorageError (retryable only for want of descriptors or memory), never the raw OSError.
    """
    root = migrations_dir(backend) if directory is None else directory
    try:
        return _load_migrations(root)
    except OSError as exc:
        # Out of descriptors or memory, a retry may cure; a directory gone or unreadable (a
        # broken install) no retry cures.
        transient = exc.errno in RETRYABLE_ERRNOS
        fix = (
            OUT_OF_FILES_FIX
            if transient
            else "make the directory readable, or reinstall control-store"
        )
        error = StorageError(
            f"could not read control_store's migration files in {str(root)!r} [{exc}]; "
            f"no migration was applied and no row written (a connect may already have created "
            f"the file or switched it to WAL mode, which is harmless): {fix}"
        )
        error.retryable = transient
        raise error from exc


def _load_migrations(root: Path) -> list[Migration]:
    found: dict[int, Migration] = {}
    for path in sorted(root.iterdir()):
        if path.suffix != ".sql":
            continue
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise MigrationError(
                f"migration file {path} is not named NNNN_description.sql; rename it"
            )
        version = int(match.group(1))
        if version in found:
            raise MigrationError(
                f"migration files {found[version].path.name} and {path.name} share version "
                f"{version}; give each migration its own version"
            )
        raw = path.read_bytes()
        try:
            sql = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MigrationError(
                f"migration file {path} is not UTF-8 text [{exc}]; the installation is "
                "damaged: reinstall control-store"
            ) from None
        found[version] = Migration(
            version=version,
            description=match.group(2).replace("_", " "),
            sql=sql,
            checksum=checksum(raw),
            path=path,
        )
    return [found[v] for v in sorted(found)]


def restore_row_sql(migration: Migration) -> str:
    """The INSERT that puts back ``migration``'s lost tracking row, as applied now."""
    now = _codec.format_timestamp(utc_now(), what="installed_on")  # as migrate() writes it
    return (
        f"INSERT INTO {TRACKING_TABLE} (version, description, installed_on, success, checksum, "
        f"execution_time) VALUES ({migration.version}, '{migration.description}', '{now}', 1, "
        f"X'{migration.checksum.hex()}', 0)"
    )


def pending(
    known: Sequence[Migration], applied: Iterable[AppliedMigration], *, database: str
) -> list[Migration]:
    """The known migrations not yet applied, after checking the applied ones are sound.

    Refuses, as sqlx does, a migration recorded as failed, a database holding a version this
    library does not have (it was migrated by a newer release), and an applied migration whose
    file has changed since.
    """
    by_version = {m.version: m for m in known}
    done: set[int] = set()
    for row in applied:
        if not row.success:
            source = by_version.get(row.version)
            compare = (
                ""
                if source is None
                else f" (what it makes is the SQL in {source.path}: compare the sqlite3 shell's "
                ".schema of the file with it)"
            )
            raise DirtyMigrationError(
                f"migration {row.version} ({row.description}) of {database} is recorded as "
                f"failed; inspect the schema: if what the migration makes is all there, mark "
                f"it done (UPDATE {TRACKING_TABLE} SET success = 1 WHERE version = "
                f"{row.version}); if none of it is, and no later migration is recorded, delete "
                "that row to run it again; else repair the schema to what it makes, then mark "
                f"it done{compare}"
            )
        mine = by_version.get(row.version)
        if mine is None:
            newest = max(by_version, default=0)
            raise UnknownMigrationError(
                f"{database} has migration {row.version} ({row.description}) applied, but this "
                f"version of control_store knows migrations only up to {newest}; the database "
                "was migrated by a newer release: upgrade control-store to use it"
            )
        if len(row.checksum) != len(mine.checksum):
            # No SHA-384 at all: the cell was edited, not the file (which would still hash to
            # 48 bytes). Restoring the file would change nothing.
            raise _codec.corrupt_row(
                TRACKING_TABLE,
                "checksum",
                row.version,
                row.checksum,
                f"expected the SHA-384 of {mine.path.name}, {len(mine.checksum)} bytes",
                f"write back this release's checksum (UPDATE {TRACKING_TABLE} SET checksum = "
                f"X'{mine.checksum.hex()}' WHERE version = {row.version}) if the schema is as "
                "the migration makes it, or restore the database from a backup",
            )
        if not same_migration(mine, row.checksum):
            raise MigrationChangedError(
                f"migration {row.version} ({row.description}) of {database} was applied with a "
                f"different checksum than {mine.path.name} has now; applied migrations must "
                "never be edited: restore the file and put the change in a new migration; if "
                f"the file is as this release shipped it, the row's checksum cell was edited "
                f"instead: write back this release's checksum (UPDATE {TRACKING_TABLE} SET "
                f"checksum = X'{mine.checksum.hex()}' WHERE version = {row.version}) if the "
                "schema is as the migration makes it, or restore the database from a backup"
            )
        done.add(row.version)
    # Migrations are applied in order, each with its row: a known one without a row below one
    # with a row is not pending, its row was lost (deleted by hand, or the file pieced
    # together). Treated as pending, connecting would run it again over the tables it made
    # ("table runs already exists"), and a read-only store would call the schema "at migration
    # 2, but needs migration 2".
    newest = max(done, default=0)
    lost = [m for m in known if m.version < newest and m.version not in done]
    if lost:
        raise MigrationError(
            f"{database} records migration {newest} ({by_version[newest].description}) as "
            f"applied, but not migration {lost[0].version} ({lost[0].description}), which "
            f"comes before it: its row in {TRACKING_TABLE} is missing (deleted by hand, or the "
            "file pieced together from two databases); nothing was done: if the schema is as "
            f"that migration makes it (check() compares it once the row is back), put the row "
            f"back: {restore_row_sql(lost[0])}; else restore the database from a backup taken "
            "before the row was lost"
        )
    return [m for m in known if m.version not in done]
