-- Raw event tables, one per Kafka topic the metrics sink consumes.
--
-- Exactness: every table is a ReplacingMergeTree whose sorting key ends in the event's id
-- (command_id for decisions) and whose partition depends only on the event's own timestamp, so
-- a message the sink inserts twice (a crash between insert and offset commit) collapses to one
-- row. Merges are eventual; the query pack reads these tables with FINAL, which gives exact
-- answers before any merge has happened (checked on ClickHouse 18.16).
--
-- Placeholders, filled by loraplane.metrics.migrations from the server's version():
--   {db} database, {lowcard_string} LowCardinality(String) or String, {timestamp} DateTime64(3)
--   or DateTime, {ttl_raw:COL} a TTL clause or nothing (18.16 has no TTL: use
--   `loraplane metrics retention --days N`, which drops old daily partitions).

CREATE TABLE IF NOT EXISTS {db}.request_log (
    event_id String,
    ts {timestamp},
    request_id String,
    tenant_id {lowcard_string},
    base_model {lowcard_string},
    adapter_id {lowcard_string},
    adapter_version {lowcard_string},
    lora_name String,
    worker_id {lowcard_string},
    request_class {lowcard_string},
    tier {lowcard_string},
    ttft_ms Nullable(Float64),
    swap_ms Float64,
    queue_ms Float64,
    prompt_tokens UInt32,
    output_tokens UInt32,
    status {lowcard_string},
    error String
) ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMMDD(ts)
ORDER BY (base_model, adapter_id, event_id)
{ttl_raw:ts}
SETTINGS index_granularity = 8192;

CREATE TABLE IF NOT EXISTS {db}.cache_events (
    event_id String,
    ts {timestamp},
    worker_id {lowcard_string},
    base_model {lowcard_string},
    tenant_id {lowcard_string},
    adapter_id {lowcard_string},
    adapter_version {lowcard_string},
    lora_name String,
    kind {lowcard_string},
    swap_ms Float64,
    bytes UInt64,
    reason {lowcard_string},
    detail String,
    command_id String
) ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMMDD(ts)
ORDER BY (base_model, adapter_id, event_id)
{ttl_raw:ts}
SETTINGS index_granularity = 8192;

CREATE TABLE IF NOT EXISTS {db}.decisions (
    command_id String,
    ts {timestamp},
    deadline {timestamp},
    worker_id {lowcard_string},
    action {lowcard_string},
    base_model {lowcard_string},
    tenant_id {lowcard_string},
    adapter_id {lowcard_string},
    adapter_version {lowcard_string},
    sha256 String,
    lora_name String,
    rule {lowcard_string},
    score Nullable(Float64),
    detail String,
    warmup_requests UInt16
) ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMMDD(ts)
ORDER BY (base_model, adapter_id, command_id)
{ttl_raw:ts}
SETTINGS index_granularity = 8192;

CREATE TABLE IF NOT EXISTS {db}.lifecycle_audit (
    event_id String,
    ts {timestamp},
    component {lowcard_string},
    action {lowcard_string},
    decision {lowcard_string},
    reason {lowcard_string},
    subject_event_id String,
    tenant_id {lowcard_string},
    adapter_id {lowcard_string},
    adapter_version {lowcard_string},
    actor String,
    detail String
) ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMMDD(ts)
ORDER BY (adapter_id, event_id)
{ttl_raw:ts}
SETTINGS index_granularity = 8192;

CREATE TABLE IF NOT EXISTS {db}.dead_letters (
    event_id String,
    ts {timestamp},
    source_topic {lowcard_string},
    partition Int32,
    offset Int64,
    component {lowcard_string},
    reason {lowcard_string},
    detail String,
    key_b64 String,
    raw_b64 String
) ENGINE = ReplacingMergeTree()
PARTITION BY toYYYYMMDD(ts)
ORDER BY (source_topic, event_id)
{ttl_raw:ts}
SETTINGS index_granularity = 8192;
