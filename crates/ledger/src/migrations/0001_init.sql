-- The decision ledger: one row per request, plus the queue lifecycle events derived from it.
-- Runs inside the migration transaction with search_path set to the ledger's schema.

CREATE TABLE decisions (
    request_id                text             NOT NULL,
    received_at_ms            bigint           NOT NULL,
    -- received_at_ms + latency: the SLA window is measured on completion.
    completed_at_ms           bigint           NOT NULL,
    replica                   text             NOT NULL,
    tenant                    text             NOT NULL,
    tier                      text             NOT NULL,
    method                    text             NOT NULL,
    path                      text             NOT NULL,
    decision                  text             NOT NULL,
    reason                    text             NOT NULL,
    state                     text             NOT NULL,
    pool                      text,
    route_reason              text,
    backend                   text,
    requested_model           text,
    routed_model              text,
    requested_max_tokens      bigint,
    applied_max_tokens        bigint,
    stream                    boolean          NOT NULL,
    queue_wait_ms             double precision,
    status                    integer          NOT NULL,
    latency_ms                double precision NOT NULL,
    ttfb_ms                   double precision,
    overhead_us               double precision,
    prompt_tokens             bigint,
    completion_tokens         bigint,
    sla_target_ms             bigint,
    sla_violated              boolean,
    signal_pressure           double precision,
    signal_queue_depth        double precision,
    signal_sla_violation_rate double precision,
    queue_outcome             text,
    error                     text,
    -- A client may resend its own x-request-id, so the id alone does not name one request;
    -- with the arrival time it does, and a replayed row still conflicts with itself.
    PRIMARY KEY (request_id, received_at_ms)
);

-- /decisions/recent: newest first, optionally by tenant, tier or decision; retention.
CREATE INDEX decisions_received_idx ON decisions (received_at_ms DESC);
CREATE INDEX decisions_tenant_idx ON decisions (tenant, received_at_ms DESC);
CREATE INDEX decisions_tier_idx ON decisions (tier, received_at_ms DESC);
CREATE INDEX decisions_decision_idx ON decisions (decision, received_at_ms DESC);
-- The SLA window: completed proxied requests only, answered from the index alone.
CREATE INDEX decisions_sla_window_idx ON decisions (completed_at_ms DESC)
    INCLUDE (tier, sla_violated) WHERE sla_violated IS NOT NULL;

CREATE TABLE queue_events (
    request_id     text             NOT NULL,
    received_at_ms bigint           NOT NULL,
    event          text             NOT NULL
        CHECK (event IN ('queue_queued', 'queue_released', 'queue_timed_out', 'queue_dropped')),
    at_ms          bigint           NOT NULL,
    wait_ms        double precision,
    tenant         text             NOT NULL,
    tier           text             NOT NULL,
    PRIMARY KEY (request_id, received_at_ms, event)
);

CREATE INDEX queue_events_at_idx ON queue_events (at_ms);
CREATE INDEX queue_events_received_idx ON queue_events (received_at_ms);
