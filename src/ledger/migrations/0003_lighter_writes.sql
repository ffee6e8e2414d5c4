-- Less work per row (issue 13): every index on `decisions` is paid on each insert, and the SLA
-- window used to rescan every row of its last minute every 1.25 s.
-- Runs inside the migration transaction with search_path set to the ledger's schema. On an
-- existing table it rebuilds the primary key (time proportional to the table; writers queue
-- behind the lock, Sluice spools meanwhile).

-- The primary key leads with the arrival time: inserts append at the right edge of one index
-- instead of landing at random request ids, and the same index now answers /decisions/recent
-- (newest first, `since`) and retention, so decisions_received_idx goes. ON CONFLICT
-- (request_id, received_at_ms) still finds it: the arbiter is matched regardless of column order.
ALTER TABLE decisions DROP CONSTRAINT decisions_pkey;
ALTER TABLE decisions ADD CONSTRAINT decisions_pkey PRIMARY KEY (received_at_ms, request_id);
DROP INDEX decisions_received_idx;

-- /decisions/recent?tier=: a handful of tiers, each a large share of the traffic, so the newest
-- rows of a tier are found by walking the primary key backwards; an index of its own cost more
-- per insert than it saved.
DROP INDEX decisions_tier_idx;

-- /decisions/recent?decision=: `pass` is most rows and found the same way; the decisions worth
-- searching for (reject, error, degrade, queue, fallback) keep an index, which a passed request
-- never touches.
DROP INDEX decisions_decision_idx;
CREATE INDEX decisions_decision_idx ON decisions (decision, received_at_ms)
    WHERE decision <> 'pass';

-- /decisions/recent?tenant=: a tenant can be any share of the traffic, or none; kept, ascending
-- (each tenant's newest entries append at the end of its range instead of splitting pages).
DROP INDEX decisions_tenant_idx;
CREATE INDEX decisions_tenant_idx ON decisions (tenant, received_at_ms);

-- The SLA window: per-second counts per tier, kept by a statement trigger in the same
-- transaction as the rows (so any writer, COPY or INSERT, old or new Sluice, keeps them exact,
-- and a replayed row skipped by ON CONFLICT is not counted twice: the transition table holds
-- only rows really inserted). A window then reads at most one row per second and tier, plus the
-- rows of its partial first second, instead of every row in it.
CREATE TABLE sla_seconds (
    -- completed_at_ms rounded down to the second
    second_ms bigint NOT NULL,
    tier      text   NOT NULL,
    completed bigint NOT NULL,
    violated  bigint NOT NULL,
    PRIMARY KEY (second_ms, tier)
);

-- SET search_path FROM CURRENT: the ledger's schema, whoever inserts. Buckets are taken in key
-- order, so two writers updating the same seconds cannot deadlock.
CREATE FUNCTION sla_seconds_add() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO sla_seconds AS s (second_ms, tier, completed, violated)
    SELECT completed_at_ms / 1000 * 1000, tier, count(*), count(*) FILTER (WHERE sla_violated)
    FROM new_rows
    WHERE sla_violated IS NOT NULL
    GROUP BY 1, 2
    ORDER BY 1, 2
    ON CONFLICT (second_ms, tier) DO UPDATE
        SET completed = s.completed + excluded.completed,
            violated = s.violated + excluded.violated;
    RETURN NULL;
END
$$;

CREATE TRIGGER decisions_sla_seconds AFTER INSERT ON decisions
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sla_seconds_add();

-- The rows already there, for the longest window there can be (sla_window_seconds <= 86400).
-- The trigger exists and the table is locked, so no row is counted twice or missed.
INSERT INTO sla_seconds (second_ms, tier, completed, violated)
SELECT completed_at_ms / 1000 * 1000, tier, count(*), count(*) FILTER (WHERE sla_violated)
FROM decisions
WHERE sla_violated IS NOT NULL
  AND completed_at_ms >= (extract(epoch FROM clock_timestamp()) * 1000)::bigint - 90000000
GROUP BY 1, 2;

-- Only the window's partial first second (and a `sla_window_requests` cap's boundary second)
-- is still read row by row. Ascending: completions arrive roughly in order, so inserts append.
DROP INDEX decisions_sla_window_idx;
CREATE INDEX decisions_completed_idx ON decisions (completed_at_ms)
    WHERE sla_violated IS NOT NULL;

-- The replay inputs (~0.8 KB a row) as `json`, not `jsonb`: PostgreSQL then only checks the
-- text instead of converting it to its binary tree, ~4 µs less per row, and nothing in the
-- ledger queries inside it (replay reads it back whole; `->` and `->>` work on `json` too).
-- Rewrites an existing table once.
ALTER TABLE decisions ALTER COLUMN inputs TYPE json USING inputs::json;
