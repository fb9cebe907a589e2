-- never_hot: adapters that were requested but never got hot.
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id) with requests in
--   [since, until) but no GPU-tier request and no successful load event in that range:
--   requests, cold arrivals, base-model fallbacks, first/last request.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version, tenant_id,
    count() AS requests,
    countIf(tier = 'cold') AS cold,
    countIf(tier = 'base_fallback') AS base_fallbacks,
    min(ts) AS first_request,
    max(ts) AS last_request
FROM request_log FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
    AND (base_model, adapter_id, adapter_version) NOT IN (
        SELECT base_model, adapter_id, adapter_version FROM cache_events FINAL
        WHERE kind = 'load' AND ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s))
GROUP BY base_model, adapter_id, adapter_version, tenant_id
HAVING countIf(tier = 'gpu') = 0
ORDER BY requests DESC, adapter_id
LIMIT %(limit)s
