-- adapter_summary: the per-adapter request view (what `loraplane report` prints).
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id) over [since, until):
--   requests, GPU hits, host hits, cold arrivals, base-model fallbacks, errors,
--   hot_adapter_hit_rate = gpu_hits / requests, TTFT p50/p95/p99 (quantileExact: exact).
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
-- Exact: reads the raw table with FINAL, so replayed events count once.
SELECT
    base_model, adapter_id, adapter_version, tenant_id,
    count() AS requests,
    countIf(tier = 'gpu') AS gpu_hits,
    countIf(tier = 'host') AS host_hits,
    countIf(tier = 'cold') AS cold,
    countIf(tier = 'base_fallback') AS base_fallbacks,
    countIf(status = 'error') AS errors,
    round(gpu_hits / requests, 4) AS hot_adapter_hit_rate,
    quantileExact(0.5)(ttft_ms) AS ttft_p50_ms,
    quantileExact(0.95)(ttft_ms) AS ttft_p95_ms,
    quantileExact(0.99)(ttft_ms) AS ttft_p99_ms
FROM request_log FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, tenant_id
ORDER BY requests DESC, adapter_id, adapter_version, tenant_id
LIMIT %(limit)s
