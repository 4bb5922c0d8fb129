-- 0001_init: runs and the jobs they fan out into.
--
-- Ids are canonical UUID text, so an operator can paste them from a log into a query.
-- created_at is fixed-width RFC 3339 UTC with microseconds ("2026-11-29T07:57:53.000000Z"):
-- text order is time order, so the claim can ORDER BY it through idx_runs_status. Both tables
-- keep SQLite's implicit rowid, which breaks created_at ties in insertion order; the index
-- carries it at no cost.
-- JSON columns (models, spec, outcome) hold msgspec-encoded structs.

CREATE TABLE runs (
    id          TEXT    PRIMARY KEY NOT NULL,
    manifest    TEXT    NOT NULL,
    models      TEXT    NOT NULL,
    epochs      INTEGER NOT NULL,
    job_count   INTEGER NOT NULL,
    status      TEXT    NOT NULL DEFAULT 'queued',
    created_at  TEXT    NOT NULL,
    done_count  INTEGER NOT NULL DEFAULT 0
);

-- The claim's "oldest queued run" is one index seek: status, then time, then rowid.
CREATE INDEX idx_runs_status ON runs (status, created_at);

CREATE TABLE jobs (
    id       TEXT    PRIMARY KEY NOT NULL,
    run_id   TEXT    NOT NULL REFERENCES runs (id),
    spec     TEXT    NOT NULL,
    status   TEXT    NOT NULL DEFAULT 'queued',
    attempt  INTEGER NOT NULL DEFAULT 0,
    outcome  TEXT
);

CREATE INDEX idx_jobs_run ON jobs (run_id);
