-- Objectives in the units users set them: a streamed answer's time to first token and time per
-- output token, the targets it was judged on (its tier's or tighter ones it asked for) and the
-- dimensions it missed (`ttft`, `tpot`, `e2e`, comma-separated); and the edge's account of a
-- request: its upstream attempts (more than 1 when it failed over before its first byte), the
-- replicas that failed it first, and its W3C trace id. Nullable columns, so the ALTER
-- is catalog-only (no table rewrite) and older rows keep their meaning: `sla_violated` still
-- says whether a row missed its objective, which for them was the end-to-end target alone.
ALTER TABLE decisions
    ADD COLUMN IF NOT EXISTS ttft_ms double precision,
    ADD COLUMN IF NOT EXISTS tpot_ms double precision,
    ADD COLUMN IF NOT EXISTS ttft_target_ms bigint,
    ADD COLUMN IF NOT EXISTS tpot_target_ms bigint,
    ADD COLUMN IF NOT EXISTS slo_missed text,
    ADD COLUMN IF NOT EXISTS attempts bigint,
    ADD COLUMN IF NOT EXISTS tried text,
    ADD COLUMN IF NOT EXISTS trace_id text;
