-- 0003_runs_created: the newest runs of any status, in one index scan. list_runs() without a
-- status (and `control-store runs`) orders every run by created_at: without this index SQLite
-- reads and sorts the whole table for each call (about 1 s at a million runs, holding the
-- store's one connection meanwhile). The index carries the rowid that breaks created_at ties,
-- so "ORDER BY created_at DESC, rowid DESC" walks it backwards. A claim or a record never
-- changes created_at, so only insert_run pays for it. IF NOT EXISTS: an index of that name made
-- by hand before this release (for the same slow listing) is no lost migration; check() then
-- compares it with this one, and gives its DROP and CREATE if it differs.

CREATE INDEX IF NOT EXISTS idx_runs_created ON runs (created_at);
