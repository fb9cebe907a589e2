-- decisions: which cache commands the planner issued, and why.
-- Answers: per (base_model, adapter_id, adapter_version, tenant_id, action, rule) over
--   [since, until): commands issued, workers targeted, average/max planner score, the last
--   time and one example of the rule's detail text.
-- Params: since, until (unix seconds); base_model, tenant_id, adapter_id, adapter_version
--   ('' = all); limit.
SELECT
    base_model, adapter_id, adapter_version, tenant_id, action, rule,
    count() AS commands,
    uniqExact(worker_id) AS workers,
    round(avg(score), 4) AS avg_score,
    max(score) AS max_score,
    max(ts) AS last_issued,
    any(detail) AS example_detail
FROM decisions FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND (%(base_model)s = '' OR base_model = %(base_model)s)
    AND (%(tenant_id)s = '' OR tenant_id = %(tenant_id)s)
    AND (%(adapter_id)s = '' OR adapter_id = %(adapter_id)s)
    AND (%(adapter_version)s = '' OR adapter_version = %(adapter_version)s)
GROUP BY base_model, adapter_id, adapter_version, tenant_id, action, rule
ORDER BY commands DESC, adapter_id, action
LIMIT %(limit)s
