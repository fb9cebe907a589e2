-- kv_conflicts: KV / prefix-cache namespace conflicts (one LoRA name, different weights).
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id, worker_id, lora_name)
--   over [since, until): conflict count, first/last seen and one example detail. Any row
--   here is a bug to chase: names must be content-addressed.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version, tenant_id, worker_id, lora_name,
    count() AS conflicts,
    min(ts) AS first_seen,
    max(ts) AS last_seen,
    any(detail) AS example_detail
FROM cache_events FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND kind = 'kv_namespace_conflict'
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, tenant_id, worker_id, lora_name
ORDER BY conflicts DESC, adapter_id
LIMIT %(limit)s
