-- timeseries_cache: per-minute cache series per adapter, for dashboards.
-- Answers: per (minute, adapter_id) over [since, until): loads, load failures,
--   cold_load_fail_ratio, kv_namespace_conflict count and adapter_swap_ms p50/p95/p99.
--   Reads the materialized rollup adapter_cache_1m (exact counts, t-digest percentiles).
-- Series: the 20 adapters with the most load attempts in the window, failed ones counted
--   (an adapter whose loads all fail is the one the fail ratio is for; a chart of more is
--   unreadable, and a writer of the cache-events topic can name any number of adapters),
--   newest minutes first, so a limit cuts the oldest minutes, never the latest.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit (max rows).
SELECT
    minute, adapter_id,
    uniqExactIfMerge(loads) AS loads_n,
    uniqExactIfMerge(load_failures) AS load_failures_n,
    round(if(loads_n + load_failures_n = 0, 0, load_failures_n / (loads_n + load_failures_n)),
          4) AS cold_load_fail_ratio,
    uniqExactIfMerge(kv_namespace_conflicts) AS kv_namespace_conflicts_n,
    quantilesTDigestIfMerge(0.5, 0.95, 0.99)(swap_ms) AS swap_q,
    round(swap_q[1], 1) AS swap_p50_ms,
    round(swap_q[2], 1) AS swap_p95_ms,
    round(swap_q[3], 1) AS swap_p99_ms
FROM adapter_cache_1m
WHERE minute >= toStartOfMinute(toDateTime(%(since)s)) AND minute < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
    AND adapter_id IN (
        SELECT adapter_id FROM adapter_cache_1m
        WHERE minute >= toStartOfMinute(toDateTime(%(since)s)) AND minute < toDateTime(%(until)s)
        AND (%(base_model)s = '' OR base_model = %(base_model)s)
        AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
        AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
        AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
        GROUP BY adapter_id
        ORDER BY uniqExactIfMerge(loads) + uniqExactIfMerge(load_failures) DESC, adapter_id
        LIMIT 20)
GROUP BY minute, adapter_id
ORDER BY minute DESC, adapter_id
LIMIT %(limit)s
