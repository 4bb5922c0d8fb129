"""Development sessions: `nox` runs lint, typecheck and tests; stress, packaging, bench by name."""

from __future__ import annotations

import pathlib
import re
import shutil
import tempfile
import zipfile

import nox
from packaging.requirements import Requirement  # nox's own dependency

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
LINT_DEPS = nox.project.dependency_groups(PYPROJECT, "lint")


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest, with bytecode cached for it and the processes it starts. The suite starts
    hundreds of Python processes (the CLI, the workers of the multi-process tests); where the
    machine sets PYTHONDONTWRITEBYTECODE, as this one's image does, each of them compiled the
    package from source, and every run rewrote every test module's assertions: seconds per
    session. The cache is under .nox, shared by the sessions of one Python and apart from
    the checkout's own files, so nothing is written beside the source."""
    cache = {
        "PYTHONDONTWRITEBYTECODE": "",  # empty is unset, to Python
        "PYTHONPYCACHEPREFIX": str(session.cache_dir / "pycache"),
    }
    session.run("pytest", *args, env=cache | (env or {}))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: the linter and the formatter, checked."""
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and this file, and the README's example."""
    session.install("-e", ".", *TEST_DEPS, *LINT_DEPS)
    session.run("mypy")
    readme = pathlib.Path("README.md").read_text(encoding="utf-8")
    example = pathlib.Path(session.create_tmp()) / "readme_example.py"
    example.write_text(re.findall(r"```python\n(.*?)```", readme, re.S)[0], encoding="utf-8")
    session.run("mypy", "--strict", str(example))  # what a user pastes must typecheck too


# 3.11 is the floor (its sqlite3 commits before executescript; we never rely on either).
PYTHONS = ["3.11", "3.12", "3.13"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The test suite against the source tree (editable install), on every supported Python."""
    session.install("-e", ".", *TEST_DEPS)
    _pytest(session, *session.posargs)


def _oldest(requirement: str, python: str) -> str | None:
    """``name>=X`` as ``name==X``: a dependency at the lowest version pyproject.toml admits on
    ``python``; None where its marker leaves it out there."""
    parsed = Requirement(requirement)
    if parsed.marker is not None and not parsed.marker.evaluate({"python_version": python}):
        return None
    floors = list(parsed.specifier)
    if len(floors) != 1 or floors[0].operator != ">=":
        raise ValueError(f"{requirement!r}: give each dependency as name>=version, a floor only")
    return f"{parsed.name}=={floors[0].version}"


@nox.session(python=PYTHONS)
def oldest(session: nox.Session) -> None:
    """The test suite on every supported Python with the oldest dependencies pyproject.toml
    admits there, so that a floor it declares is a floor that was tested (msgspec's differs
    by Python). All of it on the oldest Python; elsewhere without the slow multi-process
    tests, which use the dependencies as the rest do, and would add minutes to CI."""
    python = str(session.python)
    found = (_oldest(r, python) for r in PYPROJECT["project"]["dependencies"])
    session.install("-e", ".", *TEST_DEPS, *(floor for floor in found if floor))
    quick = [] if python == PYTHONS[0] else ["-m", "not slow"]
    _pytest(session, *(session.posargs or quick))


@nox.session(python=PYTHONS[0])
def uvloop(session: nox.Session) -> None:
    """The test suite on uvloop, the event loop many asyncio services run, in place of
    asyncio's own: in the test process and in the worker processes of the multi-process,
    crash and fault tests (tests/_workers.py). On the oldest Python only: the loop, not the
    Python, is what this session tests, and the policy it sets is deprecated from 3.14 on."""
    session.install("-e", ".", *TEST_DEPS, "uvloop")  # only here: no dependency of the library
    _pytest(session, *session.posargs, env={"CONTROL_STORE_LOOP": "uvloop"})


@nox.session
def stress(session: nox.Session) -> None:
    """The multi-process, crash, cancellation and property tests at larger sizes."""
    session.install("-e", ".", *TEST_DEPS)
    _pytest(
        session,
        "tests/test_processes.py",
        "tests/test_crash.py",
        "tests/test_cancellation.py",
        "tests/test_faults.py",
        "tests/test_hostile_rows.py",
        "tests/test_codec.py",  # its hypothesis tests are sized(300, 2000) too
        "tests/test_model.py",
        "tests/test_concurrent_model.py",
        *session.posargs,
        env={"CONTROL_STORE_STRESS": "1"},
    )


@nox.session
def packaging(session: nox.Session) -> None:
    """Build sdist and wheel, check the wheel carries every file of the package, install it
    alone, and run the suite against it (but the slow tests)."""
    session.install("build")
    dist = pathlib.Path(tempfile.mkdtemp(prefix="control-store-dist-"))
    session.run("python", "-m", "build", "--outdir", str(dist))
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every file of the package's tree (py.typed among them), and the migrations, which
    # pyproject.toml has the wheel carry inside the package.
    package = _files("control_store") | {f"control_store/{f}" for f in _files("migrations")}
    if "control_store/migrations/sqlite/0001_init.sql" not in package:
        session.error("migrations/sqlite/0001_init.sql is not where this session looks")
    if missing := sorted(package - names):
        session.error(f"{wheel.name} does not carry {missing}")
    session.install(str(wheel), *TEST_DEPS)
    # A reused venv already holds a wheel of the same version, which pip would keep.
    session.install("--force-reinstall", "--no-deps", str(wheel))
    # Run from a directory without the source tree, so the installed wheel is what is tested.
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="control-store-wheel-test-"))
    shutil.copytree("tests", workdir / "tests")
    shutil.copy("pyproject.toml", workdir / "pyproject.toml")
    shutil.copy("README.md", workdir / "README.md")  # tests/test_readme.py runs its example
    shutil.copytree("bench", workdir / "bench")  # tests/test_bench.py runs it, on the wheel
    session.chdir(workdir)
    session.run(
        "python",
        "-c",
        "import control_store, sys; "
        "assert 'site-packages' in control_store.__file__, control_store.__file__",
    )
    # Not the slow tests: they start processes that import what the rest imports, from the
    # same wheel, and would add minutes to CI; `-- tests` runs them all.
    _pytest(session, *(session.posargs or ["-m", "not slow"]))


def _files(top: str) -> set[str]:
    """The files under ``top``, as paths relative to the checkout, but bytecode caches."""
    found = pathlib.Path(top).rglob("*")
    return {p.as_posix() for p in found if p.is_file() and "__pycache__" not in p.parts}


PEERS = ["huey", "persist-queue", "litequeue"]


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark (bench/run.py); `-- --peers` adds huey, persist-queue and litequeue."""
    session.install("-e", ".")
    if "--peers" in session.posargs:
        session.install(*PEERS)  # only here: they are no dependency of the library or its tests
    session.run("python", "bench/run.py", *session.posargs)
