-- worker_summary: the per-worker view from the per-minute worker rollups.
-- Answers: per (base_model, worker_id) over [since, until): requests, hot_adapter_hit_rate,
--   cold arrivals, loads, load failures, kv conflicts, TTFT and swap p95 (t-digest).
-- Params: since, until (unix seconds); base_model ('' = all); limit. The adapter filters
--   do not apply (worker rollups are not split by adapter).
SELECT
    r.base_model AS base_model, r.worker_id AS worker_id,
    requests_n, round(gpu_hits_n / requests_n, 4) AS hot_adapter_hit_rate, cold_n,
    loads_n, load_failures_n, kv_namespace_conflicts_n, ttft_p95_ms, swap_p95_ms
FROM (
    SELECT base_model, worker_id,
        uniqExactMerge(requests) AS requests_n,
        uniqExactIfMerge(gpu_hits) AS gpu_hits_n,
        uniqExactIfMerge(cold) AS cold_n,
        round(quantilesTDigestIfMerge(0.5, 0.95, 0.99)(ttft_ms)[2], 1) AS ttft_p95_ms
    FROM worker_requests_1m
    WHERE minute >= toStartOfMinute(toDateTime(%(since)s)) AND minute < toDateTime(%(until)s)
        AND (%(base_model)s = '' OR base_model = %(base_model)s)
    GROUP BY base_model, worker_id
) AS r
ANY LEFT JOIN (
    SELECT base_model, worker_id,
        uniqExactIfMerge(loads) AS loads_n,
        uniqExactIfMerge(load_failures) AS load_failures_n,
        uniqExactIfMerge(kv_namespace_conflicts) AS kv_namespace_conflicts_n,
        round(quantilesTDigestIfMerge(0.5, 0.95, 0.99)(swap_ms)[2], 1) AS swap_p95_ms
    FROM worker_cache_1m
    WHERE minute >= toStartOfMinute(toDateTime(%(since)s)) AND minute < toDateTime(%(until)s)
        AND (%(base_model)s = '' OR base_model = %(base_model)s)
    GROUP BY base_model, worker_id
) AS c USING (base_model, worker_id)
ORDER BY requests_n DESC, worker_id
LIMIT %(limit)s
