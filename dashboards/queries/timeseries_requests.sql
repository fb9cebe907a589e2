-- timeseries_requests: per-minute request series per adapter, for dashboards.
-- Answers: per (minute, adapter_id) over [since, until): requests, GPU hits, cold arrivals,
--   base fallbacks, hot_adapter_hit_rate and TTFT p50/p95/p99. Reads the materialized
--   rollup adapter_requests_1m: counts are exact (uniqExact of event ids), percentiles are
--   t-digest estimates; use adapter_summary for exact percentiles.
-- Series: the 20 adapters with the most requests in the window (a chart of more is unreadable,
--   and a tenant's refused requests can name any number of adapter ids), newest minutes
--   first, so a limit cuts the oldest minutes, never the latest.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit (max rows).
SELECT
    minute, adapter_id,
    uniqExactMerge(requests) AS requests_n,
    uniqExactIfMerge(gpu_hits) AS gpu_hits_n,
    uniqExactIfMerge(cold) AS cold_n,
    uniqExactIfMerge(base_fallbacks) AS base_fallbacks_n,
    round(gpu_hits_n / requests_n, 4) AS hot_adapter_hit_rate,
    quantilesTDigestIfMerge(0.5, 0.95, 0.99)(ttft_ms) AS ttft_q,
    round(ttft_q[1], 1) AS ttft_p50_ms,
    round(ttft_q[2], 1) AS ttft_p95_ms,
    round(ttft_q[3], 1) AS ttft_p99_ms
FROM adapter_requests_1m
WHERE minute >= toStartOfMinute(toDateTime(%(since)s)) AND minute < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
    AND adapter_id IN (
        SELECT adapter_id FROM adapter_requests_1m
        WHERE minute >= toStartOfMinute(toDateTime(%(since)s)) AND minute < toDateTime(%(until)s)
        AND (%(base_model)s = '' OR base_model = %(base_model)s)
        AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
        AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
        AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
        GROUP BY adapter_id
        ORDER BY uniqExactMerge(requests) DESC, adapter_id
        LIMIT 20)
GROUP BY minute, adapter_id
ORDER BY minute DESC, adapter_id
LIMIT %(limit)s
