-- cache_summary: what the workers did to each adapter's tiers.
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id) over [since, until):
--   loads (host -> GPU), adapter_swap_ms p50/p95/p99 of those loads (exact), load failures
--   (fail + refuse), cold_load_fail_ratio = failures / (loads + failures), evictions
--   (unload + evict) and kv_namespace_conflict count.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version, tenant_id,
    countIf(kind = 'load') AS loads,
    quantileExactIf(0.5)(swap_ms, kind = 'load') AS swap_p50_ms,
    quantileExactIf(0.95)(swap_ms, kind = 'load') AS swap_p95_ms,
    quantileExactIf(0.99)(swap_ms, kind = 'load') AS swap_p99_ms,
    countIf(kind IN ('fail', 'refuse')) AS load_failures,
    round(if(loads + load_failures = 0, 0, load_failures / (loads + load_failures)), 4)
        AS cold_load_fail_ratio,
    countIf(kind IN ('unload', 'evict')) AS evictions,
    countIf(kind = 'kv_namespace_conflict') AS kv_namespace_conflicts
FROM cache_events FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, tenant_id
ORDER BY loads + load_failures DESC, adapter_id
LIMIT %(limit)s
