"""control_store: the durable control plane of an evaluation orchestrator.

Runs fan out into jobs; schedulers claim runs atomically; workers report job outcomes, which
the store records transactionally and idempotently, so at-least-once delivery never counts a
job twice.
"""

# Lazy (PEP 562): `import control_store` loads none of the store's modules (asyncio, sqlite3,
# msgspec: ~0.2 s), so the control-store command answers a stop signal from its first
# moments (see _launch); each name is imported from its module when first asked for.
import importlib as _importlib

TYPE_CHECKING = False  # typing's own costs 14 ms to import; type checkers read this one too
if TYPE_CHECKING:
    from ._store import ConnectOptions, MigrationState, Store
    from .errors import (
        AlreadyExistsError,
        ConfigurationError,
        ConstraintError,
        ControlError,
        CorruptRowError,
        DatabaseBusyError,
        DirtyMigrationError,
        InvalidInputError,
        MigrationChangedError,
        MigrationError,
        MissingRunError,
        NotFoundError,
        PendingMigrationError,
        ReadOnlyStoreError,
        StorageError,
        StoreClosedError,
        UnknownMigrationError,
        WrongEventLoopError,
        WrongRunError,
    )
    from .models import EvalJob, Job, JobId, JobOutcome, JobStatus, Problem, Run, RunId, RunStatus

__all__ = [
    "AlreadyExistsError",
    "ConfigurationError",
    "ConnectOptions",
    "ConstraintError",
    "ControlError",
    "CorruptRowError",
    "DatabaseBusyError",
    "DirtyMigrationError",
    "EvalJob",
    "InvalidInputError",
    "Job",
    "JobId",
    "JobOutcome",
    "JobStatus",
    "MigrationChangedError",
    "MigrationError",
    "MigrationState",
    "MissingRunError",
    "NotFoundError",
    "PendingMigrationError",
    "Problem",
    "ReadOnlyStoreError",
    "Run",
    "RunId",
    "RunStatus",
    "StorageError",
    "Store",
    "StoreClosedError",
    "UnknownMigrationError",
    "WrongEventLoopError",
    "WrongRunError",
]

# Where each name is: the module whose own __all__ holds it, lightest first, so that asking
# for an error or a model never loads the store (asyncio, sqlite3).
_HOMES = (".errors", ".models", "._store")
# The public submodules, attributes of the package as they were when it imported them eagerly:
# `import control_store` then `control_store.models.new_run_id()` (README, "API").
_SUBMODULES = frozenset({"errors", "models"})

if not TYPE_CHECKING:  # to a type checker, the imports above are the names

    def __getattr__(name: str) -> object:
        if name in _SUBMODULES:
            return _importlib.import_module(f".{name}", __name__)  # sets the attribute itself
        if name in __all__:
            for home in _HOMES:
                module = _importlib.import_module(home, __name__)
                if name in module.__all__:
                    value = getattr(module, name)
                    globals()[name] = value  # asked once
                    return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)


del TYPE_CHECKING  # not a name of the package
