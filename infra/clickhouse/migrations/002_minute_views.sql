-- Per-minute rollups for dashboards: per (base_model, adapter_id, adapter_version, tenant_id)
-- and per (base_model, worker_id), fed by materialized views on the raw tables.
--
-- A materialized view sees every inserted block, duplicates included (it runs before any
-- ReplacingMergeTree merge). Counts stay exact anyway because they are uniqExact(event_id)
-- states: a replayed event adds an id that is already in the set. Percentiles are t-digest
-- states (bounded memory, mergeable over any time range); after a crash replay they may weigh
-- a duplicated sample twice, so exact percentiles come from the query pack, which reads the
-- raw tables with FINAL and quantileExact. ClickHouse 18.16 requires a view's SELECT to
-- produce every column of its TO table, hence one rollup table per source table.
--
-- Derived metrics (ratios) are computed at read time from the merged states:
--   hot_adapter_hit_rate = gpu_hits / requests
--   cold_load_fail_ratio = load_failures / (loads + load_failures)

CREATE TABLE IF NOT EXISTS {db}.adapter_requests_1m (
    minute DateTime('UTC'),
    base_model {lowcard_string},
    adapter_id {lowcard_string},
    adapter_version {lowcard_string},
    tenant_id {lowcard_string},
    requests AggregateFunction(uniqExact, String),
    gpu_hits AggregateFunction(uniqExactIf, String, UInt8),
    host_hits AggregateFunction(uniqExactIf, String, UInt8),
    cold AggregateFunction(uniqExactIf, String, UInt8),
    base_fallbacks AggregateFunction(uniqExactIf, String, UInt8),
    errors AggregateFunction(uniqExactIf, String, UInt8),
    ttft_ms AggregateFunction(quantilesTDigestIf(0.5, 0.95, 0.99), Float64, UInt8)
) ENGINE = AggregatingMergeTree()
PARTITION BY toYYYYMMDD(minute)
ORDER BY (base_model, adapter_id, adapter_version, tenant_id, minute)
{ttl_agg:minute}
SETTINGS index_granularity = 8192;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.adapter_requests_1m_mv TO {db}.adapter_requests_1m
AS SELECT
    toStartOfMinute(ts) AS minute,
    base_model, adapter_id, adapter_version, tenant_id,
    uniqExactState(event_id) AS requests,
    uniqExactIfState(event_id, tier = 'gpu') AS gpu_hits,
    uniqExactIfState(event_id, tier = 'host') AS host_hits,
    uniqExactIfState(event_id, tier = 'cold') AS cold,
    uniqExactIfState(event_id, tier = 'base_fallback') AS base_fallbacks,
    uniqExactIfState(event_id, status = 'error') AS errors,
    quantilesTDigestIfState(0.5, 0.95, 0.99)(assumeNotNull(ttft_ms), isNotNull(ttft_ms))
        AS ttft_ms
FROM {db}.request_log
GROUP BY minute, base_model, adapter_id, adapter_version, tenant_id;

CREATE TABLE IF NOT EXISTS {db}.adapter_cache_1m (
    minute DateTime('UTC'),
    base_model {lowcard_string},
    adapter_id {lowcard_string},
    adapter_version {lowcard_string},
    tenant_id {lowcard_string},
    loads AggregateFunction(uniqExactIf, String, UInt8),
    load_failures AggregateFunction(uniqExactIf, String, UInt8),
    evictions AggregateFunction(uniqExactIf, String, UInt8),
    kv_namespace_conflicts AggregateFunction(uniqExactIf, String, UInt8),
    swap_ms AggregateFunction(quantilesTDigestIf(0.5, 0.95, 0.99), Float64, UInt8)
) ENGINE = AggregatingMergeTree()
PARTITION BY toYYYYMMDD(minute)
ORDER BY (base_model, adapter_id, adapter_version, tenant_id, minute)
{ttl_agg:minute}
SETTINGS index_granularity = 8192;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.adapter_cache_1m_mv TO {db}.adapter_cache_1m
AS SELECT
    toStartOfMinute(ts) AS minute,
    base_model, adapter_id, adapter_version, tenant_id,
    uniqExactIfState(event_id, kind = 'load') AS loads,
    uniqExactIfState(event_id, kind IN ('fail', 'refuse')) AS load_failures,
    uniqExactIfState(event_id, kind IN ('unload', 'evict')) AS evictions,
    uniqExactIfState(event_id, kind = 'kv_namespace_conflict') AS kv_namespace_conflicts,
    quantilesTDigestIfState(0.5, 0.95, 0.99)(swap_ms, kind = 'load') AS swap_ms
FROM {db}.cache_events
GROUP BY minute, base_model, adapter_id, adapter_version, tenant_id;

CREATE TABLE IF NOT EXISTS {db}.worker_requests_1m (
    minute DateTime('UTC'),
    base_model {lowcard_string},
    worker_id {lowcard_string},
    requests AggregateFunction(uniqExact, String),
    gpu_hits AggregateFunction(uniqExactIf, String, UInt8),
    host_hits AggregateFunction(uniqExactIf, String, UInt8),
    cold AggregateFunction(uniqExactIf, String, UInt8),
    base_fallbacks AggregateFunction(uniqExactIf, String, UInt8),
    errors AggregateFunction(uniqExactIf, String, UInt8),
    ttft_ms AggregateFunction(quantilesTDigestIf(0.5, 0.95, 0.99), Float64, UInt8)
) ENGINE = AggregatingMergeTree()
PARTITION BY toYYYYMMDD(minute)
ORDER BY (base_model, worker_id, minute)
{ttl_agg:minute}
SETTINGS index_granularity = 8192;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.worker_requests_1m_mv TO {db}.worker_requests_1m
AS SELECT
    toStartOfMinute(ts) AS minute,
    base_model, worker_id,
    uniqExactState(event_id) AS requests,
    uniqExactIfState(event_id, tier = 'gpu') AS gpu_hits,
    uniqExactIfState(event_id, tier = 'host') AS host_hits,
    uniqExactIfState(event_id, tier = 'cold') AS cold,
    uniqExactIfState(event_id, tier = 'base_fallback') AS base_fallbacks,
    uniqExactIfState(event_id, status = 'error') AS errors,
    quantilesTDigestIfState(0.5, 0.95, 0.99)(assumeNotNull(ttft_ms), isNotNull(ttft_ms))
        AS ttft_ms
FROM {db}.request_log
GROUP BY minute, base_model, worker_id;

CREATE TABLE IF NOT EXISTS {db}.worker_cache_1m (
    minute DateTime('UTC'),
    base_model {lowcard_string},
    worker_id {lowcard_string},
    loads AggregateFunction(uniqExactIf, String, UInt8),
    load_failures AggregateFunction(uniqExactIf, String, UInt8),
    evictions AggregateFunction(uniqExactIf, String, UInt8),
    kv_namespace_conflicts AggregateFunction(uniqExactIf, String, UInt8),
    swap_ms AggregateFunction(quantilesTDigestIf(0.5, 0.95, 0.99), Float64, UInt8)
) ENGINE = AggregatingMergeTree()
PARTITION BY toYYYYMMDD(minute)
ORDER BY (base_model, worker_id, minute)
{ttl_agg:minute}
SETTINGS index_granularity = 8192;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.worker_cache_1m_mv TO {db}.worker_cache_1m
AS SELECT
    toStartOfMinute(ts) AS minute,
    base_model, worker_id,
    uniqExactIfState(event_id, kind = 'load') AS loads,
    uniqExactIfState(event_id, kind IN ('fail', 'refuse')) AS load_failures,
    uniqExactIfState(event_id, kind IN ('unload', 'evict')) AS evictions,
    uniqExactIfState(event_id, kind = 'kv_namespace_conflict') AS kv_namespace_conflicts,
    quantilesTDigestIfState(0.5, 0.95, 0.99)(swap_ms, kind = 'load') AS swap_ms
FROM {db}.cache_events
GROUP BY minute, base_model, worker_id;
