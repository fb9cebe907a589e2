-- cold_start_cost: cold loads on the request path and what they cost in TTFT; the top
-- adapters by cold-start cost come first.
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id) over [since, until):
--   cold_requests (arrived while the adapter was only in the artifact tier), their TTFT
--   p50/p95, the hot (GPU-tier) TTFT p50 of the same adapter, and
--   cold_cost_ms = sum(cold TTFT) - cold_requests_with_ttft * hot p50 (the extra time users
--   waited; the full cold TTFT when the adapter was never served hot).
--   The hot p50 of no GPU request is nan on 18.16 and NULL on current ClickHouse (ttft_ms is
--   Nullable): the count decides, so one text gives the same answer on both.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version, tenant_id,
    countIf(tier = 'cold') AS cold_requests,
    quantileExactIf(0.5)(ttft_ms, tier = 'cold') AS cold_ttft_p50_ms,
    quantileExactIf(0.95)(ttft_ms, tier = 'cold') AS cold_ttft_p95_ms,
    quantileExactIf(0.5)(ttft_ms, tier = 'gpu') AS hot_ttft_p50_ms,
    round(sumIf(ttft_ms, tier = 'cold')
          - countIf(tier = 'cold' AND isNotNull(ttft_ms))
            * if(countIf(tier = 'gpu' AND isNotNull(ttft_ms)) = 0, 0, hot_ttft_p50_ms), 3)
          AS cold_cost_ms
FROM request_log FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, tenant_id
HAVING cold_requests > 0
ORDER BY cold_cost_ms DESC, adapter_id
LIMIT %(limit)s
