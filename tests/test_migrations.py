"""Migrations: applied once, tracked with checksums, refused when edited or unknown."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from control_store import (
    ConstraintError,
    CorruptRowError,
    DirtyMigrationError,
    MigrationChangedError,
    MigrationError,
    PendingMigrationError,
    StorageError,
    Store,
    UnknownMigrationError,
    _migrate,
)
from control_store._codec import job_params, run_params
from control_store._migrate import checksum, load_migrations, pending
from control_store._sqlite import INSERT_JOB, INSERT_RUN

from conftest import (
    NEXT_VERSION,
    SHIPPED,
    assert_sound,
    follow_advice,
    make_jobs,
    make_run,
    raw_db,
    traced,
    with_second_migration,
)

TRACKING = "_control_store_migrations"


def tracking_rows(path: Path) -> list[tuple[object, ...]]:
    with raw_db(path) as conn:
        return conn.execute(
            f"SELECT version, description, checksum, success, installed_on, execution_time "
            f"FROM {TRACKING} ORDER BY version"
        ).fetchall()


async def test_fresh_file_is_migrated_and_tracked(tmp_path: Path) -> None:
    """Connecting to a new file creates the schema and one tracking row per migration."""
    path = tmp_path / "fresh.db"
    async with Store.connect(path):
        pass
    known = load_migrations("sqlite")
    rows = tracking_rows(path)
    assert [r[0] for r in rows] == [m.version for m in known]
    version, description, digest, success, installed_on, elapsed = rows[0]
    assert (version, description, success) == (1, "init", 1)
    assert digest == known[0].checksum
    assert isinstance(digest, bytes)
    assert len(digest) == 48  # SHA-384
    assert isinstance(installed_on, str)
    assert installed_on.endswith("Z")
    assert isinstance(elapsed, int)
    assert elapsed >= 0
    with raw_db(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema")}
    assert {"runs", "jobs", "idx_runs_status", "idx_jobs_run"} <= names


async def test_reconnect_applies_nothing_again(tmp_path: Path) -> None:
    """A second connect leaves the tracking table and the data as they were."""
    path = tmp_path / "again.db"
    async with Store.connect(path) as store:
        assert await store.migrate() == []
    before = tracking_rows(path)
    async with Store.connect(path) as store:
        statuses = await store.migration_status()
    assert tracking_rows(path) == before
    assert all(s.installed_on is not None for s in statuses)


async def test_edited_migration_is_refused(db_path: Path) -> None:
    """An applied migration whose checksum no longer matches its file is refused, named."""
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE {TRACKING} SET checksum = ? WHERE version = 1", (b"\0" * 48,))
    with pytest.raises(MigrationChangedError, match=r"migration 1 \(init\).*new migration"):
        await Store.connect(db_path)


async def test_database_from_a_newer_release_is_refused(db_path: Path) -> None:
    """A database holding a migration this library lacks is refused, saying to upgrade."""
    with raw_db(db_path) as conn:
        conn.execute(f"INSERT INTO {TRACKING} VALUES (9999, 'from the future', 'x', 1, x'00', 0)")
    with pytest.raises(UnknownMigrationError, match=r"9999.*upgrade control-store"):
        await Store.connect(db_path)


@pytest.mark.parametrize(
    ("edit", "cell", "fix"),
    [
        (
            f"UPDATE {TRACKING} SET checksum = hex(checksum) WHERE version = 2",
            "checksum of row 2",
            "checksum X'",
        ),
        (
            f"UPDATE {TRACKING} SET checksum = 48 WHERE version = 2",
            "checksum of row 2 holds 48",
            "checksum X'",
        ),
        (
            f"UPDATE {TRACKING} SET success = 'yes' WHERE version = 2",
            "success of row 2",
            "success 1",
        ),
        (
            f"UPDATE {TRACKING} SET description = x'ff' WHERE version = 1",
            "description of row 1",
            "'init'",
        ),
        (
            f"UPDATE {TRACKING} SET description = CAST(x'ff' AS TEXT) WHERE version = 1",
            "description of row 1 holds b'\\xff'",
            "'init'",
        ),
        (
            f"UPDATE {TRACKING} SET installed_on = x'00ff' WHERE version = 2",
            "installed_on of row 2",
            "checksum X'",
        ),
        (
            f"INSERT INTO {TRACKING} VALUES (-1, 'neg', 'x', 1, x'00', 1)",
            "version of row -1 holds -1",
            f"DELETE FROM {TRACKING} WHERE typeof(version) = 'integer' AND version = -1",
        ),
    ],
    ids=[
        "checksum-as-hex",
        "checksum-as-int",
        "success-as-text",
        "description-blob",
        "description-not-utf8",
        "installed-on-blob",
        "version-below-1",
    ],
)
@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read-only"])
async def test_a_hand_edited_tracking_row_is_named_with_its_repair(
    db_path: Path, edit: str, cell: str, fix: str, *, read_only: bool
) -> None:
    """A tracking row edited by hand is a CorruptRowError naming its cell and the value this
    release would have written, not a raw TypeError or another migration's error; the file is
    untouched."""
    with raw_db(db_path) as conn:
        conn.execute(edit)
    before = db_path.read_bytes()
    with pytest.raises(CorruptRowError) as caught:
        await Store.connect(db_path, read_only=read_only)
    assert f"{TRACKING}.{cell}" in str(caught.value)
    assert fix in str(caught.value)
    assert db_path.read_bytes() == before


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("NULL", "version IS NULL"),
        ("x'00ff'", "typeof(version) IN ('blob', 'text') AND CAST(version AS BLOB) = X'00ff'"),
        # The blob "1" and the real 1.0: a DELETE by value alone took migration 1's row too.
        ("x'31'", "typeof(version) IN ('blob', 'text') AND CAST(version AS BLOB) = X'31'"),
        ("1.0", "typeof(version) = 'real' AND version = 1.0"),
        ("'tw''o'", "typeof(version) = 'text' AND CAST(version AS BLOB) = X'7477276f'"),
        # By its bytes: a NUL in a quoted literal cut the statement short.
        (
            "CAST(x'610062' AS TEXT)",
            "typeof(version) = 'text' AND CAST(version AS BLOB) = X'610062'",
        ),
        (  # no UTF-8: read leniently as its bytes
            "CAST(x'ff41' AS TEXT)",
            "typeof(version) IN ('blob', 'text') AND CAST(version AS BLOB) = X'ff41'",
        ),
    ],
)
async def test_a_tracking_rows_version_of_any_type_gets_a_delete_that_works(
    db_path: Path, value: str, where: str
) -> None:
    """A history rebuilt by hand without its INTEGER PRIMARY KEY can hold a version that is
    NULL, a blob, a real or text (UTF-8 or not): the repair's DELETE names it in SQL (it gave
    "version = None" or "b'...'", Python's repr, which SQLite refuses), by its storage class too
    (SQLite finds the integer 1 equal to 1.0, and its bytes equal to the blob "1"), and
    followed as written it deletes that row alone."""
    with raw_db(db_path) as conn:
        conn.executescript(
            f"""
            ALTER TABLE {TRACKING} RENAME TO history_before;
            CREATE TABLE {TRACKING} (version, description TEXT NOT NULL, installed_on TEXT NOT
                NULL, success INTEGER NOT NULL, checksum BLOB NOT NULL, execution_time INTEGER
                NOT NULL);
            INSERT INTO {TRACKING} SELECT * FROM history_before;
            DROP TABLE history_before;
            INSERT INTO {TRACKING} VALUES ({value}, 'x', 'y', 1, x'00', 0);
            """
        )
    with pytest.raises(CorruptRowError) as caught:
        await Store.connect(db_path)
    assert f"(DELETE FROM {TRACKING} WHERE {where})" in str(caught.value)
    follow_advice(db_path, caught.value, r"delete the row \((DELETE FROM .*?)\) if no")
    with raw_db(db_path) as conn:
        assert conn.execute(f"SELECT count(*) FROM {TRACKING}").fetchone() == (len(SHIPPED),)


async def test_a_view_standing_for_the_history_is_named_and_its_repair_works(
    db_path: Path,
) -> None:
    """The history table renamed and a view of its rows put under its name: read as no
    history at all, connect ran migration 0001 again ("table runs already exists") and the CLI
    said the history's rows were deleted. A MigrationError names the view; its repair, made as
    written, gives back a history connect takes, with nothing to find."""
    with raw_db(db_path) as conn:
        conn.executescript(
            f"ALTER TABLE {TRACKING} RENAME TO kept; CREATE VIEW {TRACKING} AS SELECT * FROM kept"
        )
    with pytest.raises(MigrationError) as caught:
        await Store.connect(db_path)
    assert f"has a view named {TRACKING} where this release keeps its migration" in str(
        caught.value
    )
    repair = re.search(r"make them a table again: (.*?); else restore", str(caught.value))
    assert repair is not None
    with raw_db(db_path) as conn:
        conn.executescript(repair[1])
    async with Store.connect(db_path) as store:
        states = await store.migration_status()
        assert [s.version for s in states if s.installed_on] == [v for v, _ in SHIPPED]
        assert await store.check() == []


@pytest.mark.parametrize("edit", ["DROP COLUMN success", "RENAME COLUMN checksum TO digest"])
async def test_a_tracking_table_missing_a_column_gives_its_repair(db_path: Path, edit: str) -> None:
    """A column of the tracking table dropped or renamed by hand: connect cannot read which
    migrations made the schema, and says so of this file, with the repair (rename it back, or
    restore), not check() (which cannot connect either); the same as a migration that fails
    on it says."""
    with raw_db(db_path) as conn:
        conn.execute(f"ALTER TABLE {TRACKING} {edit}")
    for read_only in (False, True):
        with pytest.raises(MigrationError, match=r"migration history of database") as caught:
            await Store.connect(db_path, read_only=read_only)
        message = str(caught.value)
        assert repr(str(db_path)) in message
        assert "rename a renamed column back" in message
        assert "restore the database from a backup" in message
        assert "check()" not in message


async def test_check_finds_a_dropped_execution_time_and_its_repair_works(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """execution_time dropped from the history of a current schema: nothing reads it until the
    next migration, so the store connects, and check() is what finds it, with the ALTER that
    puts it back; made as given, check() finds nothing and the next migration applies."""
    async with Store.connect(db_path):
        pass
    with raw_db(db_path) as conn:
        conn.execute(f"ALTER TABLE {TRACKING} DROP COLUMN execution_time")
    async with Store.connect(db_path) as store:
        (problem,) = await store.check()
    assert problem.table == "database"
    assert "lacks column execution_time" in problem.message
    follow_advice(db_path, problem.message, r"back with (ALTER TABLE .*?);")
    with_second_migration(monkeypatch)
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        applied = [m.version for m in await store.migration_status() if m.installed_on]
        assert applied == [*(version for version, _ in SHIPPED), NEXT_VERSION]


@pytest.mark.parametrize(
    ("lost", "refusals"),
    # 0003 makes its index IF NOT EXISTS: run again, it just records itself, so the refusals
    # are for 0002, and 0001.
    [("version >= 2", 1), ("1 = 1", 2)],
    ids=["newest-rows", "every-row"],
)
async def test_a_lost_tracking_row_gets_its_insert_as_the_repair(
    db_path: Path, lost: str, refusals: int
) -> None:
    """Tracking rows deleted by hand, the newest or all: the migration runs again and meets
    what it made ("duplicate column", "already exists"). The error gives the INSERT that puts
    the row back (one migration at a time); made as given, connect works and check() finds
    nothing."""
    run = make_run()
    async with Store.connect(db_path) as store:
        await store.insert_run(run)
    with raw_db(db_path) as conn:
        conn.execute(f"DELETE FROM {TRACKING} WHERE {lost}")
    if lost == "1 = 1":  # no row at all: read-only, it is not taken for an empty file
        with pytest.raises(
            PendingMigrationError, match=f"its rows in {TRACKING} were lost"
        ) as lost_rows:
            await Store.connect(db_path, read_only=True)
        assert lost_rows.value.tables == ("jobs", "runs")  # the tables it holds, for the CLI
    for _ in range(refusals):
        with pytest.raises(MigrationError, match=f"its row in {TRACKING} was lost") as caught:
            await Store.connect(db_path)
        insert = re.search(r"put the row back: (INSERT INTO .*?\)); else", str(caught.value))
        assert insert is not None
        with raw_db(db_path) as conn:
            conn.execute(insert[1])
    async with Store.connect(db_path) as store:
        assert await store.get_run(run.id) == run
        assert await store.check() == []
        applied = [m.version for m in await store.migration_status() if m.installed_on]
        assert applied == [version for version, _ in SHIPPED]


async def test_failed_migration_is_refused(db_path: Path) -> None:
    """A migration recorded as failed stops the connect with what to repair; here what it
    makes is all there (a later migration is recorded after it), and the UPDATE the message
    gives for that case, run as written, makes the database sound again."""
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE {TRACKING} SET success = 0 WHERE version = 1")
    with pytest.raises(DirtyMigrationError, match="recorded as failed") as caught:
        await Store.connect(db_path)
    # What to compare the schema with is named where it is (check() cannot open such a file).
    named = re.search(r"what it makes is the SQL in (\S+):", str(caught.value))
    assert named is not None
    assert named[1] == str(load_migrations("sqlite")[0].path)
    assert Path(named[1]).is_file()
    follow_advice(db_path, caught.value, r"mark it done \((UPDATE .*?)\)")
    async with Store.connect(db_path) as store:
        assert await store.check() == []


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            f"INSERT INTO {TRACKING} VALUES (9999, 'from the future', 'x', 1, x'00', 0)",
            UnknownMigrationError,
        ),
        (f"UPDATE {TRACKING} SET success = 0 WHERE version = 1", DirtyMigrationError),
        (f"UPDATE {TRACKING} SET checksum = zeroblob(48) WHERE version = 1", MigrationChangedError),
    ],
    ids=["newer-release", "failed", "edited"],
)
async def test_a_history_it_cannot_vouch_for_is_refused_before_the_file_changes(
    db_path: Path, edit: str, error: type[MigrationError]
) -> None:
    """A file holding a newer release's migration, a failed one or an edited one is refused at
    connect, migrating or not (migrate=False: no call could use it), with the same error and
    fix, and before anything changes: a copy switched out of WAL mode stays as it is."""
    with raw_db(db_path) as conn:
        conn.execute(edit)
        conn.execute("PRAGMA journal_mode = DELETE")
    before = db_path.read_bytes()
    messages = set()
    for migrate in (True, False):
        with pytest.raises(error) as caught:
            await Store.connect(db_path, migrate=migrate)
        messages.add(str(caught.value))
    assert len(messages) == 1
    assert db_path.read_bytes() == before
    assert sorted(p.name for p in db_path.parent.iterdir()) == [db_path.name]


async def test_a_checksum_cell_edited_to_another_sha384_gives_the_update_that_restores_it(
    db_path: Path,
) -> None:
    """A checksum cell given another 48-byte value (another row's, say) cannot be told from an
    edited file: the error must give the cell's repair too, not only "restore the file"."""
    async with Store.connect(db_path):
        pass
    mine = {m.version: m.checksum for m in load_migrations("sqlite")}
    with raw_db(db_path) as conn:
        conn.execute(
            f"UPDATE {TRACKING} SET checksum = (SELECT checksum FROM {TRACKING} WHERE version = 1)"
            " WHERE version = 2"
        )
    with pytest.raises(MigrationChangedError) as caught:
        await Store.connect(db_path)
    repair = f"UPDATE {TRACKING} SET checksum = X'{mine[2].hex()}' WHERE version = 2"
    assert repair in str(caught.value)
    with raw_db(db_path) as conn:
        conn.execute(repair)
    async with Store.connect(db_path) as store:
        assert await store.check() == []


@pytest.mark.parametrize("blob", ["x'00'", "zeroblob(32)", "x''"])
async def test_a_checksum_cell_that_is_no_sha384_is_a_corrupt_row_with_its_repair(
    db_path: Path, blob: str
) -> None:
    """A checksum blob of another length than a SHA-384 was edited in the database, not in
    the migration file (which still hashes to 48 bytes): a CorruptRowError naming the cell,
    not "restore the file". Its UPDATE, followed as written, makes the database sound."""
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE {TRACKING} SET checksum = {blob} WHERE version = 1")
    with pytest.raises(CorruptRowError) as caught:
        await Store.connect(db_path)
    assert "checksum" in str(caught.value)
    assert "0001_init.sql, 48 bytes" in str(caught.value)
    follow_advice(db_path, caught.value, r"write back this release's checksum \((UPDATE .*?)\)")
    async with Store.connect(db_path) as store:
        assert await store.check() == []


async def test_a_checksum_cast_to_text_that_is_no_utf8_still_lists_the_history(
    db_path: Path,
) -> None:
    """A checksum CAST to TEXT by hand holds the same bytes, which are no UTF-8: connect and
    check() accept the row (it is read leniently, as those bytes), and migration_status() and
    migrate() list it too, where they failed with sqlite3's "Could not decode to UTF-8"."""
    with raw_db(db_path) as conn:
        conn.execute(f"UPDATE {TRACKING} SET checksum = CAST(checksum AS TEXT) WHERE version = 1")
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        states = await store.migration_status()
        assert [state.version for state in states if state.installed_on] == [
            version for version, _ in SHIPPED
        ]
        assert await store.migrate() == []


async def test_a_column_dropped_from_the_tracking_table_is_named_with_its_repair(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column dropped from the migration history by hand fails the next migration, and the
    error gives the repair itself (check() could not: on a schema behind this release it says
    to migrate). Followed as written, the migration applies and check() finds nothing."""
    with raw_db(db_path) as conn:
        conn.execute(f"ALTER TABLE {TRACKING} DROP COLUMN execution_time")
    with_second_migration(monkeypatch)
    with pytest.raises(MigrationError, match="migration history of database") as caught:
        await Store.connect(db_path)
    assert "run store.check()" not in str(caught.value)
    follow_advice(
        db_path, caught.value, r"put a dropped execution_time back with (ALTER TABLE .*?);"
    )
    async with Store.connect(db_path) as store:
        assert await store.check() == []
        applied = [m.version for m in await store.migration_status() if m.installed_on]
        assert applied == [*(version for version, _ in SHIPPED), NEXT_VERSION]


async def test_migrate_false_leaves_a_fresh_file_pending(tmp_path: Path) -> None:
    """With migrate=False nothing is applied, and the status shows every migration pending."""
    path = tmp_path / "pending.db"
    async with Store.connect(path, migrate=False) as store:
        statuses = await store.migration_status()
        assert [s.installed_on for s in statuses] == [None] * len(statuses)
        assert await store.migrate() == [m.version for m in load_migrations("sqlite")]
        assert all(s.installed_on for s in await store.migration_status())


def test_checksum_ignores_line_endings() -> None:
    """A file checked out with CRLF or CR line endings has the same checksum as with LF."""
    lf = b"CREATE TABLE t (x);\n-- note\n"
    assert (
        checksum(lf) == checksum(lf.replace(b"\n", b"\r\n")) == checksum(lf.replace(b"\n", b"\r"))
    )
    assert checksum(lf) != checksum(lf + b"\n")


def test_migration_files_are_found_and_ordered(tmp_path: Path) -> None:
    """Files named NNNN_description.sql load in version order; others are refused."""
    (tmp_path / "0002_add_leases.sql").write_text("SELECT 2;")
    (tmp_path / "0001_init.sql").write_text("SELECT 1;")
    (tmp_path / "README.txt").write_text("not a migration")
    found = load_migrations("sqlite", tmp_path)
    assert [(m.version, m.description) for m in found] == [(1, "init"), (2, "add leases")]
    assert pending(found, [], database="db") == found
    (tmp_path / "3-bad-name.sql").write_text("SELECT 3;")
    with pytest.raises(MigrationError, match=r"NNNN_description\.sql"):
        load_migrations("sqlite", tmp_path)


def test_shipped_migrations_have_lf_line_endings() -> None:
    """The migration files in the package are LF-only (pinned by .gitattributes)."""
    for migration in load_migrations("sqlite"):
        assert b"\r" not in migration.path.read_bytes(), migration.path


_MIGRATE_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from control_store import Store

    async def main() -> None:
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        sys.stdin.readline()  # start together
        async with Store.connect(sys.argv[1], busy_timeout=30):
            pass

    asyncio.run(main())
    """
)


def test_processes_migrating_one_fresh_file_apply_each_migration_once(tmp_path: Path) -> None:
    """Several processes connecting to a new file at once apply every migration exactly once."""
    path = tmp_path / "race.db"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _MIGRATE_CHILD, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for child in children:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    for child in children:
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
    rows = tracking_rows(path)
    assert [r[0] for r in rows] == [m.version for m in load_migrations("sqlite")]
    with raw_db(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    asyncio.run(assert_sound(path))  # SQLite's integrity check, then store.check()


async def test_a_failing_migration_applies_nothing_of_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration that fails midway leaves neither its statements nor its row behind."""
    migrations = tmp_path / "migrations"
    migrations.mkdir()
    (migrations / "0001_first.sql").write_text("CREATE TABLE a (x INTEGER);\n")
    (migrations / "0002_broken.sql").write_text(
        "CREATE TABLE b (x INTEGER);\nINSERT INTO b VALUES (1);\nINSERT INTO nowhere VALUES (1);\n"
    )
    monkeypatch.setattr("control_store._migrate.migrations_dir", lambda backend: migrations)
    path = tmp_path / "partial.db"
    with pytest.raises(MigrationError, match=r"migration 2 \(broken\).*nowhere.*none of it"):
        await Store.connect(path)
    assert [r[0] for r in tracking_rows(path)] == [1]
    with raw_db(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
    assert "a" in tables
    assert "b" not in tables


async def test_job_rows_counts_the_jobs_of_runs_stored_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0002_job_rows on a database holding runs and jobs: each run's count is its jobs, so the
    job_count guard holds for runs stored before the migration too."""
    path = tmp_path / "v1.db"
    monkeypatch.setattr(_migrate, "load_migrations", lambda b, d=None: load_migrations(b, d)[:1])
    async with Store.connect(path):
        pass
    monkeypatch.undo()
    full, empty = make_run(job_count=3), make_run(job_count=2)
    with raw_db(path) as conn:  # as version 1 of the library would have stored them
        conn.executemany(INSERT_RUN, [run_params(full), run_params(empty)])
        conn.executemany(INSERT_JOB, [job_params(job) for job in make_jobs(full, 2)])
    async with Store.connect(path) as store:
        applied = [m.version for m in await store.migration_status() if m.installed_on]
        assert applied == [version for version, _ in SHIPPED]
        with raw_db(path) as conn:
            counts = dict(conn.execute("SELECT id, job_rows FROM runs").fetchall())
        assert counts == {str(full.id): 2, str(empty.id): 0}
        with pytest.raises(ConstraintError, match="has job_count 3 and 2 jobs already"):
            await store.insert_jobs(make_jobs(full, 2))
        await store.insert_jobs(make_jobs(full, 1))
        await store.insert_jobs(make_jobs(empty, 2))
        assert await store.check() == []


@pytest.mark.parametrize("place", ["fresh file", "previous release", "memory"])
async def test_migrate_false_refuses_calls_until_migrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, place: str
) -> None:
    """migrate=False on a schema behind this library's: every call but migrate() and
    migration_status() is a PendingMigrationError saying to call migrate(), instead of a bare
    SQL error; after migrate() the store works."""
    url: str | Path = tmp_path / "db.db"
    if place == "previous release":
        monkeypatch.setattr(
            _migrate, "load_migrations", lambda b, d=None: load_migrations(b, d)[:1]
        )
        async with Store.connect(url):
            pass
        monkeypatch.undo()
    elif place == "memory":
        url = "sqlite::memory:"
    run = make_run(job_count=1)
    async with Store.connect(url, migrate=False) as store:
        for call in (
            store.get_run(run.id),
            store.insert_run(run),
            store.claim_next_run(),
            store.check(),
        ):
            with pytest.raises(PendingMigrationError, match=r"await store\.migrate\(\)") as caught:
                await call
            assert caught.value.needed == SHIPPED[-1][0]
        assert [s.version for s in await store.migration_status()] == [v for v, _ in SHIPPED]
        await store.migrate()
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
        assert await store.get_run(run.id) == run
        assert await store.check() == []


async def test_a_refused_call_reads_the_schema_again_once_another_store_migrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """migrate=False on an empty file that other connections then migrate: each refusal
    describes the file as it is now (at migration 1, not "empty"), and once it is current the
    call proceeds and the store stops reading the schema before its calls."""
    url = tmp_path / "db.db"
    run = make_run(job_count=1)
    async with Store.connect(url, migrate=False) as store:
        with pytest.raises(PendingMigrationError, match=r"\(it is empty\)") as caught:
            await store.insert_run(run)
        assert caught.value.found == 0
        assert caught.value.tables == ()
        monkeypatch.setattr(
            _migrate, "load_migrations", lambda b, d=None: load_migrations(b, d)[:1]
        )
        async with Store.connect(url):  # another release, one migration behind this one
            pass
        monkeypatch.undo()
        first = SHIPPED[0]
        for call in (store.insert_run(run), store.get_run(run.id), anext(store.iter_jobs(run.id))):
            with pytest.raises(PendingMigrationError) as caught:
                await call
            assert f"is at migration {first[0]} ({first[1]})" in str(caught.value)
            assert "empty" not in str(caught.value)
            assert (caught.value.found, caught.value.pending) == (first[0], tuple(SHIPPED[1:]))
        async with Store.connect(url):  # this release: the file is current
            pass
        await store.insert_run(run)
        await store.insert_jobs(make_jobs(run))
        async with traced(store) as trace:
            assert await store.get_run(run.id) == run
        assert len(trace) == 1  # the run's SELECT alone: no schema read before it
        assert await store.migrate() == []
        assert await store.check() == []


async def test_an_index_made_by_hand_under_0003s_name_is_no_lost_migration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database of the release before 0003_runs_created, with an index of the same name made
    by hand (for the same slow listing), other columns: the migration applies (not "its row
    was lost"), check() names the index as not made as this release makes it, and its repair,
    made as given, leaves nothing to find."""
    path = tmp_path / "v2.db"
    before = [m for m in load_migrations("sqlite") if m.version < 3]
    monkeypatch.setattr(_migrate, "load_migrations", lambda b, d=None: before)
    async with Store.connect(path):
        pass
    monkeypatch.undo()
    with raw_db(path) as conn:
        conn.execute("CREATE INDEX idx_runs_created ON runs (created_at DESC, id)")
    async with Store.connect(path) as store:
        assert [m.version for m in await store.migration_status() if m.installed_on] == [
            version for version, _ in SHIPPED
        ]
        (problem,) = await store.check()
    assert "lacks index idx_runs_created" in problem.message
    follow_advice(path, problem.message, r"make it again: (DROP INDEX \w+); ")
    follow_advice(path, problem.message, r"; (CREATE INDEX .*)$")
    async with Store.connect(path) as store:
        assert await store.check() == []


def test_a_migrations_directory_that_cannot_be_read_is_a_storage_error_no_retry_cures(
    tmp_path: Path,
) -> None:
    """A broken install (the migrations directory gone) is a StorageError naming it and the
    fix, not retryable: only running out of descriptors or memory is (exit 3 in the CLI would
    tell a user to retry what no retry cures)."""
    missing = tmp_path / "gone"
    with pytest.raises(StorageError, match=r"gone.*reinstall control-store") as caught:
        _migrate.load_migrations("sqlite", missing)
    assert caught.value.retryable is False


def test_a_migration_file_that_is_not_utf8_is_a_migration_error(tmp_path: Path) -> None:
    """A damaged install (a migration file that is not UTF-8) is a MigrationError naming the
    file and the fix, not a raw UnicodeDecodeError from connect."""
    (tmp_path / "0001_init.sql").write_bytes(b"\xff CREATE TABLE x (a);")
    with pytest.raises(MigrationError, match=r"0001_init\.sql is not UTF-8.*reinstall"):
        _migrate.load_migrations("sqlite", tmp_path)


# 0003_runs_created as first shipped (b42f6ba), before it became CREATE INDEX IF NOT EXISTS.
_FIRST_0003 = """\
-- 0003_runs_created: the newest runs of any status, in one index scan. list_runs() without a
-- status (and `control-store runs`) orders every run by created_at: without this index SQLite
-- reads and sorts the whole table for each call (about 1 s at a million runs, holding the
-- store's one connection meanwhile). The index carries the rowid that breaks created_at ties,
-- so "ORDER BY created_at DESC, rowid DESC" walks it backwards. A claim or a record never
-- changes created_at, so only insert_run pays for it.

CREATE INDEX idx_runs_created ON runs (created_at);
"""


async def test_a_database_migrated_by_0003_as_first_shipped_is_not_refused(
    db_path: Path,
) -> None:
    """A release shipped 0003 without IF NOT EXISTS (same schema): the files it migrated hold
    that file's checksum, and must open (and list as applied), not be called edited."""
    async with Store.connect(db_path) as store:
        await store.insert_run(make_run())
    with raw_db(db_path) as conn:
        conn.execute(
            f"UPDATE {TRACKING} SET checksum = ? WHERE version = 3",
            (checksum(_FIRST_0003.encode()),),
        )
    async with Store.connect(db_path) as store:
        assert len(await store.list_runs()) == 1
        assert [m.installed_on is not None for m in await store.migration_status()] == [True] * 3
        assert await store.check() == []
    async with Store.connect(db_path, read_only=True) as store:
        assert len(await store.list_runs()) == 1


# Every shipped migration's checksum, as the databases it migrated record it: editing a
# shipped file (even a comment) makes every such database refuse to open, so this pin must
# fail first. A new migration adds its line; an existing line never changes.
_SHIPPED_CHECKSUMS = {
    1: "e2f4e4cd3ef162c86c09890e59432bb56c8a9b93516cc22565184087a580f665"
    "ab883b044c26c1b1d53da8415c874314",
    2: "4d2bf2c7f3df654b734a33182106891596fa39e2e340a0441a10c79a3d61ade2"
    "912cf82f11725e528b1aa2e6b0942238",
    3: "a9d6fa05553ad5b4428cfa3d5b5c6f73483f1a3366d9381798b20303271da3a0"
    "7be5c0fbd5e36616102470f9853d7c28",
}


def test_shipped_migration_files_are_never_edited() -> None:
    shipped = {m.version: m.checksum.hex() for m in load_migrations("sqlite")}
    assert {v: shipped[v] for v in _SHIPPED_CHECKSUMS} == _SHIPPED_CHECKSUMS


def _grow_past_the_page_limit() -> _migrate.Migration:
    """A migration after the shipped ones that a full disk stops: it cannot grow the file."""
    sql = (
        "PRAGMA max_page_count = 1;\n"  # never below the file's size: the file cannot grow
        "CREATE TABLE filler AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 "
        "FROM n WHERE i < 100000) SELECT randomblob(100) AS b FROM n;\n"
    )
    return _migrate.Migration(
        NEXT_VERSION, "grow", sql, checksum(sql.encode()), Path(f"{NEXT_VERSION:04d}_grow.sql")
    )


async def test_a_migration_failing_after_others_committed_says_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade cut short by a full disk after earlier migrations of the same connect
    committed leaves the file at the last of those: its error must say so, not that nothing
    was written, and that the release upgraded from refuses the file from then on."""
    path = tmp_path / "v1.db"
    original = _migrate.load_migrations
    monkeypatch.setattr(_migrate, "load_migrations", lambda b, d=None: original(b, d)[:1])
    async with Store.connect(path):
        pass
    grow = _grow_past_the_page_limit()
    monkeypatch.setattr(_migrate, "load_migrations", lambda b, d=None: [*original(b, d), grow])
    with pytest.raises(StorageError) as info:
        await Store.connect(path)
    assert info.value.retryable
    message = str(info.value)
    assert "nothing of this call was written" not in message
    shipped = ", ".join(f"{v} ({d})" for v, d in SHIPPED[1:])
    assert f"the migrations before it, {shipped}, were applied and committed" in message
    assert f"at migration {SHIPPED[-1][0]} now, which the release upgraded from refuses" in message
    assert [row[0] for row in tracking_rows(path)] == [v for v, _ in SHIPPED]


async def test_a_new_file_cut_short_between_migrations_names_no_release_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new file had no release before this one: its cut-short first connect says which
    migrations committed, and not that a release upgraded from refuses it."""
    path = tmp_path / "new.db"
    original = _migrate.load_migrations
    grow = _grow_past_the_page_limit()
    monkeypatch.setattr(_migrate, "load_migrations", lambda b, d=None: [*original(b, d), grow])
    with pytest.raises(StorageError) as info:
        await Store.connect(path)
    message = str(info.value)
    shipped = ", ".join(f"{v} ({d})" for v, d in SHIPPED)
    assert f"the migrations before it, {shipped}, were applied and committed" in message
    assert f"at migration {SHIPPED[-1][0]} now; the next connect" in message
    assert "upgraded from" not in message
    assert [row[0] for row in tracking_rows(path)] == [v for v, _ in SHIPPED]
