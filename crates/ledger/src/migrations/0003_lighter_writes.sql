-- Less work per row (issue 13): every index on `decisions` is paid on each insert, the replay
-- inputs were converted to jsonb on each insert, and the SLA window rescanned every row of its
-- last minute every 1.25 s.
-- Runs inside the migration transaction with search_path set to the ledger's schema. On an
-- existing table it rewrites the table once and builds its indexes once (time proportional to
-- the table; writers queue behind the lock, Sluice spools meanwhile).
LOCK TABLE decisions IN ACCESS EXCLUSIVE MODE;

-- The SLA window: completions and violations per second and tier, added by the writer in the
-- same transaction as the rows (a COPY's counts computed on its side; a replay's INSERT … ON
-- CONFLICT counts only the rows it did insert, so a replayed row is not counted twice). A
-- window then reads at most one row per second and tier, plus the rows of its partial first
-- second, instead of every row in it. Not a trigger: its transition table copies every row
-- (~1 KB with the replay inputs) to count it: 1.6 µs a row more, measured.
CREATE TABLE sla_seconds (
    -- completed_at_ms rounded down to the second
    second_ms bigint NOT NULL,
    tier      text   NOT NULL,
    completed bigint NOT NULL,
    violated  bigint NOT NULL,
    PRIMARY KEY (second_ms, tier)
);

-- The rows already there, for the longest window there can be (sla_window_seconds <= 86400).
-- The table is locked, so no row is missed; rows that a Sluice from before this migration
-- writes afterwards (during a rolling upgrade) are not counted.
INSERT INTO sla_seconds (second_ms, tier, completed, violated)
SELECT completed_at_ms / 1000 * 1000, tier, count(*), count(*) FILTER (WHERE sla_violated)
FROM decisions
WHERE sla_violated IS NOT NULL
  AND completed_at_ms >= (extract(epoch FROM clock_timestamp()) * 1000)::bigint - 90000000
GROUP BY 1, 2;

-- Every index goes before the rewrite below and the ones kept are built once after it.
ALTER TABLE decisions DROP CONSTRAINT decisions_pkey;
DROP INDEX decisions_received_idx;
DROP INDEX decisions_tenant_idx;
DROP INDEX decisions_tier_idx;
DROP INDEX decisions_decision_idx;
DROP INDEX decisions_sla_window_idx;

-- The replay inputs (~0.8 KB a row) as `json`, not `jsonb`: PostgreSQL then only checks the
-- text instead of converting it to its binary tree, ~4 µs less per row, and nothing in the
-- ledger queries inside it (replay reads it back whole; `->` and `->>` work on `json` too).
ALTER TABLE decisions ALTER COLUMN inputs TYPE json USING inputs::json;

-- The primary key leads with the arrival time: inserts append at the right edge of one index
-- instead of landing at random request ids, and the same index answers /decisions/recent
-- (newest first, `since`), replay's export and retention, so decisions_received_idx is gone.
-- ON CONFLICT (request_id, received_at_ms) still finds it: the arbiter is matched regardless
-- of column order.
ALTER TABLE decisions ADD CONSTRAINT decisions_pkey PRIMARY KEY (received_at_ms, request_id);

-- /decisions/recent?tier=: a handful of tiers, each a large share of the traffic, so the newest
-- rows of a tier are found by walking the primary key backwards; an index of its own cost more
-- per insert than it saved. No decisions_tier_idx.

-- /decisions/recent?decision=: `pass` is most rows and found the same way; the decisions worth
-- searching for (reject, error, degrade, queue, fallback) keep an index, which a passed request
-- never touches.
CREATE INDEX decisions_decision_idx ON decisions (decision, received_at_ms)
    WHERE decision <> 'pass';

-- /decisions/recent?tenant=: a tenant can be any share of the traffic, or none; kept, ascending
-- (each tenant's newest entries append at the end of its range instead of splitting pages).
CREATE INDEX decisions_tenant_idx ON decisions (tenant, received_at_ms);

-- Only the SLA window's partial first second (and a `sla_window_requests` cap's boundary
-- second) is still read row by row. Ascending: completions arrive roughly in order, so inserts
-- append.
CREATE INDEX decisions_completed_idx ON decisions (completed_at_ms)
    WHERE sla_violated IS NOT NULL;
