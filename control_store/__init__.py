"""control_store: the durable control plane of an evaluation orchestrator.

Runs fan out into jobs; schedulers claim runs atomically; workers report job outcomes, which
the store records transactionally and idempotently, so at-least-once delivery never counts a
job twice.
"""

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
