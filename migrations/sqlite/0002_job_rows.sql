-- 0002_job_rows: how many jobs each run has, kept by insert_jobs in the transaction that
-- inserts them. A run must never get more jobs than its job_count: its job_count-th outcome
-- marks it done while jobs are still to run, and later outcomes count past job_count. Counting
-- a run's jobs on every insert would walk its index (about 65 ms for a million jobs, on every
-- call of a run inserted in chunks); this counter makes the guard one row update.

ALTER TABLE runs ADD COLUMN job_rows INTEGER NOT NULL DEFAULT 0;

-- Runs that existed before this migration: their jobs, counted once.
UPDATE runs SET job_rows = (SELECT count(*) FROM jobs WHERE jobs.run_id = runs.id);
