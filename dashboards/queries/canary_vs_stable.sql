-- canary_vs_stable: does the canary version serve as fast as stable?
-- Answers: per (base_model, adapter_id, adapter_version, track) over [since, until), where
--   track = 'canary' for canary-class requests and 'stable' for the rest: requests, error
--   rate and TTFT p50/p95/p99 (exact), so a canary's latency is compared with stable's.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version,
    if(request_class = 'canary', 'canary', 'stable') AS track,
    count() AS requests,
    round(countIf(status = 'error') / requests, 4) AS error_rate,
    quantileExact(0.5)(ttft_ms) AS ttft_p50_ms,
    quantileExact(0.95)(ttft_ms) AS ttft_p95_ms,
    quantileExact(0.99)(ttft_ms) AS ttft_p99_ms
FROM request_log FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND request_class != 'shadow'
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, track
ORDER BY adapter_id, adapter_version, track
LIMIT %(limit)s
