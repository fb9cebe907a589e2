"""Every Prometheus series name the project serves, in one place (docs/observability.md).

Names carry the ``loraplane_`` namespace and base units (seconds, bytes; counters end in
``_total``) so ``promtool check metrics`` is clean on each /metrics and the rules in
``dashboards/prometheus/`` read the same strings the code writes. The seed's names
(``adapter_swap_ms``, ``request_ttft_ms`` ...) stay as ClickHouse columns and in reports;
only the Prometheus side is named here. ``LORA_ADAPTER_LOADED`` follows vLLM's proposed
``vllm:lora_adapter_loaded`` (llm-d's lora-load-state scorer reads residency in that
shape); its colon is the one lint ``promtool check metrics`` reports, as on vLLM's own.
"""

from __future__ import annotations

__all__ = [
    "ADAPTER_HITS",
    "ADAPTER_HIT_RATE",
    "ADAPTER_REQUESTS",
    "ADAPTER_SWAP_SECONDS",
    "COLD_LOADS",
    "COLD_LOAD_FAILURES",
    "COLD_LOAD_FAIL_RATIO",
    "COMMANDS_READ_BYTES",
    "COMMANDS_REFUSED",
    "COMMAND_LOOP_ERRORS",
    "CONSUMER_STALLS",
    "CONSUMER_STUCK_SECONDS",
    "HOST_INSTALL_FAILURES",
    "KV_NAMESPACE_CONFLICTS",
    "LORA_ADAPTER_LOADED",
    "NAMESPACE",
    "PLANNER_ACTIVE",
    "REGISTRY_READ_FAILURES",
    "REGISTRY_VIEW_REFUSED",
    "REQUEST_TTFT_SECONDS",
    "ROUTER_ANSWER_BYTES_HELD",
    "ROUTER_DEAD_LETTERS",
    "ROUTER_GATEWAY_PROOFS_FAILED",
    "ROUTER_GATEWAY_REFUSALS",
    "ROUTER_IN_FLIGHT",
    "ROUTER_QUEUE_DEPTH",
    "ROUTER_QUEUE_REJECTIONS",
    "ROUTER_QUEUE_WAIT_SECONDS",
    "ROUTER_QUEUE_WITHDRAWN",
    "ROUTER_REQUESTS",
    "ROUTER_WORKERS",
    "ROUTER_WORKERS_UNPROVEN",
    "SINK_DELIVERED",
    "SINK_DROPPED",
    "SINK_JOURNAL_EVENTS",
    "SINK_RECOVERED",
    "SINK_REFUSED",
    "SINK_REPLAYED",
    "SINK_SPOOLED",
    "SINK_SPOOL_BYTES",
    "SINK_SPOOL_EVENTS",
    "SINK_UNJOURNALED",
    "TOPIC_TAIL_CAUGHT_UP",
    "TOPIC_TAIL_CURRENT",
    "TOPIC_TAIL_FORGOTTEN",
    "TOPIC_TAIL_LAG",
    "VLLM_FOREIGN_CHANGES",
    "VLLM_NAMESPACE",
    "WORKER_HEARTBEAT",
]

NAMESPACE = "loraplane"
VLLM_NAMESPACE = "vllm"


def _n(name: str) -> str:
    return f"{NAMESPACE}_{name}"


# The worker agent: per adapter (adapter_id, adapter_version, tenant_id, base_model).
ADAPTER_REQUESTS = _n("hot_adapter_requests_total")
ADAPTER_HITS = _n("hot_adapter_hits_total")
ADAPTER_HIT_RATE = _n("hot_adapter_hit_rate")
ADAPTER_SWAP_SECONDS = _n("adapter_swap_seconds")
COLD_LOADS = _n("cold_loads_total")
COLD_LOAD_FAILURES = _n("cold_load_failures_total")
COLD_LOAD_FAIL_RATIO = _n("cold_load_fail_ratio")
KV_NAMESPACE_CONFLICTS = _n("kv_namespace_conflict_total")
VLLM_FOREIGN_CHANGES = _n("vllm_foreign_changes_total")
REQUEST_TTFT_SECONDS = _n("request_ttft_seconds")
# The worker agent: by reason, or none.
COMMANDS_REFUSED = _n("commands_refused_total")
HOST_INSTALL_FAILURES = _n("host_install_failures_total")
REGISTRY_VIEW_REFUSED = _n("registry_view_refused_total")
COMMAND_LOOP_ERRORS = _n("command_loop_errors_total")
REGISTRY_READ_FAILURES = _n("registry_read_failures_total")
COMMANDS_READ_BYTES = _n("commands_read_bytes_total")
WORKER_HEARTBEAT = _n("worker_heartbeat_timestamp_seconds")
# Residency in vLLM's proposed shape: {adapter_name, level="gpu"|"cpu", pinned, rank} = 1.
LORA_ADAPTER_LOADED = f"{VLLM_NAMESPACE}:lora_adapter_loaded"

# Every runtime with a consumer loop or a topic tail (kernel.progress_metrics, TailMetrics).
CONSUMER_STUCK_SECONDS = _n("consumer_stuck_seconds")
CONSUMER_STALLS = _n("consumer_stalls_total")
TOPIC_TAIL_CAUGHT_UP = _n("topic_tail_caught_up")
TOPIC_TAIL_LAG = _n("topic_tail_lag")
TOPIC_TAIL_CURRENT = _n("topic_tail_current")
TOPIC_TAIL_FORGOTTEN = _n("topic_tail_forgotten_total")

# The event sink of every producing runtime (eventlog.sink.SinkMetrics).
SINK_DELIVERED = _n("event_sink_delivered_total")
SINK_SPOOLED = _n("event_sink_spooled_total")
SINK_REPLAYED = _n("event_sink_replayed_total")
SINK_DROPPED = _n("event_sink_dropped_total")
SINK_REFUSED = _n("event_sink_refused_total")
SINK_SPOOL_EVENTS = _n("event_sink_spool_events")
SINK_SPOOL_BYTES = _n("event_sink_spool_bytes")
SINK_RECOVERED = _n("event_sink_recovered_total")
SINK_UNJOURNALED = _n("event_sink_unjournaled_total")
SINK_JOURNAL_EVENTS = _n("event_sink_journal_events")

# The streams app's planner.
PLANNER_ACTIVE = _n("planner_active")

# The fleet router.
ROUTER_REQUESTS = _n("router_requests_total")
ROUTER_WORKERS = _n("router_workers")
ROUTER_DEAD_LETTERS = _n("router_dead_letters_total")
ROUTER_IN_FLIGHT = _n("router_in_flight")
ROUTER_QUEUE_DEPTH = _n("router_queue_depth")
ROUTER_QUEUE_WAIT_SECONDS = _n("router_queue_wait_seconds")
ROUTER_QUEUE_REJECTIONS = _n("router_queue_rejections_total")
ROUTER_QUEUE_WITHDRAWN = _n("router_queue_withdrawn_total")
ROUTER_ANSWER_BYTES_HELD = _n("router_answer_bytes_held")
ROUTER_WORKERS_UNPROVEN = _n("router_workers_unproven")
ROUTER_GATEWAY_PROOFS_FAILED = _n("router_gateway_proofs_failed_total")
ROUTER_GATEWAY_REFUSALS = _n("router_gateway_refusals_total")
