-- What each decision was decided on (the request's facts, the policy state it read, the
-- policy's own answer), for `sluice replay`. Nullable: rows written before it have none, and
-- replay skips them with a count. Adding a nullable column rewrites no existing row.
ALTER TABLE decisions ADD COLUMN inputs jsonb;
