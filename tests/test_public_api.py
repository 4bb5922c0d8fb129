"""The public surface: what `control_store` exports, and that it is all documented."""

from __future__ import annotations

import copy
import inspect
import itertools
import pickle
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Hashable
from pathlib import Path

import pytest

import control_store
from control_store import ConfigurationError, ConnectOptions, Store, errors


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, every name in it exists, and every public name is in it."""
    assert control_store.__all__ == sorted(control_store.__all__)
    for name in control_store.__all__:
        assert hasattr(control_store, name), name
    public = {
        name
        for name, value in vars(control_store).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert public == set(control_store.__all__)


def test_every_error_is_a_control_error_and_drawn_in_the_tree() -> None:
    """Each exported error derives from ControlError and appears in errors.py's docstring."""
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, control_store.ControlError), name
        assert name in doc, f"{name} is missing from the tree in errors.py"
        assert getattr(control_store, name) is cls


def test_the_store_api_of_the_design_card() -> None:
    """The methods the design card promises exist and are coroutines."""
    for name in (
        "insert_run",
        "get_run",
        "insert_jobs",
        "get_job",
        "list_jobs",
        "claim_next_run",
        "record_job_outcome",
        "close",
    ):
        assert inspect.iscoroutinefunction(getattr(control_store.Store, name)), name


def test_importing_the_package_stays_light() -> None:
    """`import control_store`, and of the command's launcher, pulls in no module of the store
    (asyncio, sqlite3, msgspec, typing: ~0.2 s, in which the launcher could not yet answer a
    Ctrl-C), nor the CLI, nor any PostgreSQL driver; the names load when first used."""
    heavy = ("asyncio", "sqlite3", "msgspec", "aiosqlite", "typing", "control_store.", "asyncpg")
    code = (
        "import sys, control_store, control_store._launch; "
        f"print(sorted(m for m in sys.modules if m.startswith({heavy!r}) "
        "and m != 'control_store._launch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"


def _an_instance_of(kind: type[errors.ControlError]) -> errors.ControlError:
    """An error as the store raises it: message, keyword fields, an instance attribute."""
    if kind is errors.CorruptRowError:
        return kind("bad cell", table="runs", column="epochs", row_id="r1", value=-1)
    if kind is errors.PendingMigrationError:
        return kind("old schema", found=1, needed=2, pending=((2, "job rows"),))
    error = kind(f"a {kind.__name__}")
    error.retryable = True  # set on the instance, as translate() does for StorageError
    return error


def test_every_error_survives_pickle_and_copy() -> None:
    """Every error, keyword-only fields included, crosses a process boundary (a
    ProcessPoolExecutor pickles what a worker raises) and copy.copy, unchanged."""
    for name in errors.__all__:
        kind = getattr(errors, name)
        original = _an_instance_of(kind)
        # S301: these bytes come from pickle.dumps two calls earlier, not from outside.
        for copied in (pickle.loads(pickle.dumps(original)), copy.copy(original)):  # noqa: S301
            assert type(copied) is kind
            assert copied.args == original.args
            assert vars(copied) == vars(original)


async def test_connect_options_are_typed(tmp_path: Path) -> None:
    """A misspelt or mistyped option of Store.connect is a type error to mypy, not only a
    ConfigurationError at run time: its options are no ``**options: Any``. Each ignore below
    is needed: `nox -s typecheck` (mypy --strict, which warns of an unused one) fails if the
    options lose their types."""
    path = tmp_path / "x.db"
    with pytest.raises(ConfigurationError, match="unknown option busy_timout=5"):
        await Store.connect(path, busy_timout=5)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="busy_timeout='5' must be a number"):
        await Store.connect(path, busy_timeout="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="read_only=1 must be True or False"):
        await Store.in_memory(read_only=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="synchronous='FAST' must be one of"):
        await Store.connect(path, synchronous="FAST")  # type: ignore[arg-type]
    assert not path.exists()
    options: ConnectOptions = {"busy_timeout": 2, "synchronous": "normal", "migrate": True}
    async with Store.connect(path, **options) as store:
        assert await store.list_runs() == []


def test_a_run_is_unhashable_and_the_other_models_hash() -> None:
    """As the README says: key runs by run.id, since hash(run) raises (its models are a list);
    a Job (its outcome too), an EvalJob and a JobOutcome hash, equal ones alike."""
    run = control_store.Run("m", ["a"], 1, 1)

    def hashed(value: Hashable) -> int:
        return hash(value)

    # Unhashable to a type checker too (nox -s typecheck: mypy --strict fails on an unused
    # ignore), so that pyright refuses {run: ...} and {run}, which else fail only when run.
    with pytest.raises(TypeError, match="unhashable"):
        hashed(run)  # type: ignore[arg-type]
    outcome = control_store.JobOutcome(uuid.uuid4(), score=1.0)
    job = control_store.Job(run.id, control_store.EvalJob("a", "s", 0), outcome=outcome)
    for model in (job, job.spec, outcome):
        assert hash(model) == hash(copy.deepcopy(model))


def _drawn_parents(tree: str) -> dict[str, str]:
    """Each error's parent as a tree of ``├──``/``└──`` lines draws it (by indentation)."""
    parents: dict[str, str] = {}
    path = ["ControlError"]
    for line in tree.splitlines():
        drawn = re.match(r"^\s*((?:[│ ]   )*)[├└]── (\w+)", line)
        if drawn is None:
            continue
        depth = len(drawn[1]) // 4 + 1
        path = [*path[:depth], drawn[2]]
        parents[drawn[2]] = path[depth - 1]
    return parents


@pytest.mark.parametrize("where", ["errors.py", "README.md"])
def test_the_error_tree_draws_each_errors_own_parent(where: str) -> None:
    """The tree in errors.py's docstring and in the README draws each error under the class it
    derives from: ``except ConstraintError`` catching AlreadyExistsError and MissingRunError,
    ``except MigrationError`` the four migration errors, is what a caller reads there. A test
    that only found each name in the text passed with any error drawn under any other."""
    readme = Path(__file__).resolve().parent.parent / "README.md"
    tree = (errors.__doc__ or "") if where == "errors.py" else readme.read_text(encoding="utf-8")
    parents = _drawn_parents(tree)
    for name in errors.__all__:
        if name == "ControlError":
            continue
        cls = getattr(errors, name)
        (base,) = [b for b in cls.__bases__ if issubclass(b, errors.ControlError)]
        assert parents.get(name) == base.__name__, (where, name)


def test_default_ids_are_uuid7_ordered_by_the_time_they_were_made() -> None:
    """A fresh Run's or Job's id is a UUID version 7: an id made in a later millisecond sorts
    after an earlier one, as a UUID and as the canonical text the store keeps (so the store's
    primary-key indexes grow at their end), its first 48 bits are the time, and the rest is
    random enough that 100k ids made in a tight loop never clash."""
    rounds: list[list[uuid.UUID]] = []
    for _ in range(4):
        run = control_store.Run("m.yaml", ["a"], epochs=1, job_count=1)
        job = control_store.Job(run.id, control_store.EvalJob("a", "s", 0))
        rounds.append([run.id, job.id])
        time.sleep(0.003)
    for earlier, later in itertools.pairwise(rounds):
        assert max(earlier) < min(later)
        assert max(map(str, earlier)) < min(map(str, later))
    now_ms = time.time_ns() // 1_000_000
    for made in itertools.chain(*rounds):
        assert (made.version, made.variant) == (7, uuid.RFC_4122)
        assert now_ms - 1_000 < made.int >> 80 <= now_ms
    assert len({control_store.models.new_job_id() for _ in range(100_000)}) == 100_000


def test_the_public_submodules_are_attributes_of_the_package_at_once() -> None:
    """`import control_store`, then `control_store.models.new_run_id()` (as README's "Ids"
    names it) in a fresh interpreter: the lazy package must still give its public submodules
    as attributes, as the eager one did, not only once some other name had loaded them."""
    code = (
        "import control_store; "
        "print(control_store.models.new_run_id().version, "
        "control_store.errors.ControlError.__name__, 'models' in dir(control_store))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stdout.split()) == (0, ["7", "ControlError", "True"]), done.stderr


def test_every_readme_section_the_package_cites_is_a_heading_of_the_readme() -> None:
    """A docstring or comment citing (README, "Name") sends its reader to a section of that
    name: help(ConnectOptions) cited "Options", and new_run_id's "Ids", which no heading was."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    headings = {
        m[1].strip("` ")
        for m in re.finditer(r"^#{1,6} (.+)$", readme, re.M)
        if not m[0].startswith("# ") or m.start() == 0  # a "# ..." line in code is no heading
    }
    cited: set[tuple[str, str]] = set()
    for source in sorted(Path(control_store.__file__).parent.glob("*.py")):  # as installed
        text = re.sub(r"\s+", " ", source.read_text(encoding="utf-8").replace("#", " "))
        cited |= {(source.name, name) for name in re.findall(r'README, "([^"]+)"', text)}
    assert cited
    assert {(where, name) for where, name in cited if name not in headings} == set()
