-- load_failures: why adapters failed to load, by reason code.
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id, kind, reason) over
--   [since, until): failures (kind fail = I/O, refuse = verification/policy), the workers it
--   happened on, first/last occurrence and one example detail.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version, tenant_id, kind, reason,
    count() AS failures,
    uniqExact(worker_id) AS workers,
    min(ts) AS first_seen,
    max(ts) AS last_seen,
    any(detail) AS example_detail
FROM cache_events FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND kind IN ('fail', 'refuse')
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, tenant_id, kind, reason
ORDER BY failures DESC, adapter_id, reason
LIMIT %(limit)s
