"""Every reason code a message can carry, one ``StrEnum`` per kind of reason.

Code branches on these members, never on free text; the JSON Schema export lists their
values, so producers in other languages see the closed set; and unit tests check that the
docs' reason tables list exactly these values (tests/unit/test_reason_docs.py). A member is
a ``str``, so the bytes on the wire and in ClickHouse are the values below, unchanged.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

__all__ = [
    "NO_REASON",
    "AdmissionRefusal",
    "ArtifactReason",
    "AuditReason",
    "CacheEventReason",
    "CommandRejection",
    "CommandRule",
    "ConsumerFault",
    "DeadLetterReason",
    "DecodeReason",
    "ForeignChange",
    "IntentRefusal",
    "LoadDeferral",
    "PublishFailure",
    "QueueRefusal",
    "RegistryRejection",
    "RegistryViewRejection",
    "RequestRefusal",
    "ResolverRefusal",
    "RouterRefusal",
    "ServerRefusal",
    "ServingRefusal",
    "SignerProblem",
    "TenantLimit",
    "UnloadReason",
    "VllmErrorCode",
    "VllmFailure",
    "WaitReason",
]

NO_REASON: Literal[""] = ""
"""The reason of a message that records a success (an accepted event, a load)."""


class DecodeReason(StrEnum):
    """Why bytes off Kafka are not a message (``schemas.codec.SchemaError``)."""

    malformed = "malformed"  # empty, not JSON, not a JSON object
    invalid = "invalid"  # schema validation failed
    too_large = "too_large"  # over the message size limit
    key_mismatch = "key_mismatch"  # the Kafka key is not the message's own id
    wrong_partition = "wrong_partition"  # on a partition its Kafka key does not hash to


class RegistryRejection(StrEnum):
    """Why the registry rejected a lifecycle event (``registry.fold.evaluate``), in the
    order its checks run."""

    # the bytes
    malformed = "malformed"
    invalid = "invalid"
    too_large = "too_large"
    canary_percent_out_of_range = "canary_percent_out_of_range"
    key_mismatch = "key_mismatch"  # Kafka key != adapter_id
    wrong_partition = "wrong_partition"  # not on the partition its Kafka key hashes to
    # trust
    keyring_unavailable = "keyring_unavailable"
    unknown_key = "unknown_key"
    key_role_mismatch = "key_role_mismatch"  # a planner (command) key signed an event
    key_publisher_mismatch = "key_publisher_mismatch"
    key_revoked = "key_revoked"
    key_expired = "key_expired"
    key_not_yet_valid = "key_not_yet_valid"
    bad_signature = "bad_signature"
    action_out_of_scope = "action_out_of_scope"
    tenant_out_of_scope = "tenant_out_of_scope"
    priority_above_ceiling = "priority_above_ceiling"  # keyring's per-tenant max_priority
    # freshness and order
    event_expired = "event_expired"
    event_from_future = "event_from_future"
    event_lifetime_too_long = "event_lifetime_too_long"
    seq_from_future = "seq_from_future"  # seq above the now-derived ceiling
    replayed_event_id = "replayed_event_id"
    stale_seq = "stale_seq"
    # ownership and registry rules
    tenant_mismatch = "tenant_mismatch"
    base_model_mismatch = "base_model_mismatch"
    artifact_outside_prefix = "artifact_outside_prefix"  # not under TENANT/ADAPTER/V-SHA8/
    version_not_newer = "version_not_newer"
    unknown_version = "unknown_version"
    version_revoked = "version_revoked"
    rollback_to_unknown = "rollback_to_unknown"
    rollback_to_never_served = "rollback_to_never_served"
    invalid_transition = "invalid_transition"
    # the view's evidence (every accepted event of the adapter) would exceed its bound
    history_full = "history_full"


class CommandRejection(StrEnum):
    """Why a worker refused a cache command before (or instead of) folding it
    (``workers.command_trust.check_command``, then the fold's own refusals), in check order.
    Every one is dead-lettered (component ``worker-agent``) and counted; none is applied."""

    # whose command it is
    wrong_worker = "wrong_worker"  # Kafka key or worker_id is another worker
    # trust
    unsigned = "unsigned"
    keyring_unavailable = "keyring_unavailable"
    unknown_key = "unknown_key"
    key_role_mismatch = "key_role_mismatch"  # not a planner key (a CI key, say)
    key_revoked = "key_revoked"
    key_expired = "key_expired"
    key_not_yet_valid = "key_not_yet_valid"
    bad_signature = "bad_signature"
    tenant_out_of_scope = "tenant_out_of_scope"
    # freshness
    command_expired = "command_expired"  # past its deadline
    command_from_future = "command_from_future"  # issued_at ahead of the worker's clock
    command_lifetime_too_long = "command_lifetime_too_long"  # deadline too far after issue
    replayed_command = "replayed_command"  # a command_id this worker already applied
    # the worker's own rules, after the fold
    protected_copy = "protected_copy"  # it would unpin, demote or evict a never-evict copy
    pinned_copy = "pinned_copy"  # it would demote or evict a pinned copy


class ConsumerFault(StrEnum):
    """Dead-letter reasons that are not about the message's own bytes or rules."""

    internal_error = "internal_error"  # the consumer itself raised on this message
    out_of_range = "out_of_range"  # valid, but a value ClickHouse's column cannot hold
    outside_window = "outside_window"  # valid, but stamped further from now than the sink keeps
    clickhouse_rejected = "clickhouse_rejected"  # ClickHouse refused the row on insert


class SignerProblem(StrEnum):
    """Why a signed message's key cannot vouch for it (``Keyring.signer``), in check order;
    shared by the registry's and the worker's checks, each of which reports it as the
    member of the same value in its own enum (``RegistryRejection``, ``CommandRejection``)."""

    keyring_unavailable = "keyring_unavailable"
    unknown_key = "unknown_key"
    key_role_mismatch = "key_role_mismatch"
    key_publisher_mismatch = "key_publisher_mismatch"
    key_revoked = "key_revoked"
    key_expired = "key_expired"
    key_not_yet_valid = "key_not_yet_valid"
    bad_signature = "bad_signature"


class RegistryViewRejection(StrEnum):
    """Why a consumer of the registry topic (a worker, the fleet router) refused a record:
    it re-derives the view from the signed lifecycle events it carries
    (``registry.evidence.verify_view``) with its own keyring."""

    malformed = "view_malformed"  # the value is not an AdapterView (or its key is not its id)
    keyring_unavailable = "view_keyring_unavailable"  # our keyring is missing or invalid
    no_evidence = "view_no_evidence"  # the view carries no signed events
    foreign_evidence = "view_foreign_evidence"  # an event of another adapter
    evidence_rejected = "view_evidence_rejected"  # an event the lifecycle fold refuses
    mismatch = "view_mismatch"  # the events fold into another view than the one carried
    rollback = "view_rollback"  # older than, or forking from, a view already accepted
    tombstone = "view_tombstone"  # a record without a value over an adapter held


class ArtifactReason(StrEnum):
    """Why an adapter artifact was refused, or could not be fetched (``is_failure``)."""

    # where the artifact comes from
    source_not_allowed = "source_not_allowed"
    outside_owner_prefix = "outside_owner_prefix"  # not s3://B/tenant/adapter/version-sha8/
    artifact_store_unavailable = "artifact_store_unavailable"
    fetch_failed = "fetch_failed"
    adapter_revoked = "adapter_revoked"
    host_budget_exceeded = "host_budget_exceeded"
    host_io_error = "host_io_error"
    host_disk_full = "host_disk_full"  # ENOSPC/EDQUOT: the disk is smaller than the budget
    install_error = "install_error"  # the install raised an error no other reason names
    # the manifest and the files it pins
    manifest_missing = "manifest_missing"
    manifest_invalid = "manifest_invalid"
    manifest_digest_mismatch = "manifest_digest_mismatch"
    file_missing = "file_missing"
    file_not_in_manifest = "file_not_in_manifest"
    size_mismatch = "size_mismatch"
    sha256_mismatch = "sha256_mismatch"
    too_large = "too_large"
    # names and kinds of files
    unsafe_path = "unsafe_path"
    symlink = "symlink"
    pickle_weights = "pickle_weights"
    disallowed_file = "disallowed_file"
    # adapter_config.json against the worker and the registry record
    config_missing = "config_missing"
    config_invalid = "config_invalid"
    rank_too_high = "rank_too_high"
    record_mismatch = "record_mismatch"
    base_model_mismatch = "base_model_mismatch"
    # safetensors weights
    weights_missing = "weights_missing"
    header_too_large = "header_too_large"
    header_invalid = "header_invalid"
    tensor_dtype_invalid = "tensor_dtype_invalid"
    tensor_offsets_invalid = "tensor_offsets_invalid"
    tensor_name_invalid = "tensor_name_invalid"
    tensor_shape_mismatch = "tensor_shape_mismatch"
    module_not_targeted = "module_not_targeted"
    module_not_in_model = "module_not_in_model"
    target_module_missing = "target_module_missing"
    lora_pair_incomplete = "lora_pair_incomplete"
    tensor_value_nonfinite = "tensor_value_nonfinite"  # a NaN or an infinity in a float tensor
    tensor_value_overflows = "tensor_value_overflows"  # finite, an infinity once vLLM serves it
    model_shape_unknown = "model_shape_unknown"  # the worker has no base-model shapes to check
    # the OpenSSF model-signing bundle (model.sig) against the keyring's model_signers
    model_signature_required = "model_signature_required"  # the tenant requires one; none
    model_signature_invalid = "model_signature_invalid"  # malformed, or no trusted key verifies
    model_signer_out_of_scope = "model_signer_out_of_scope"  # a trusted signer of other tenants
    model_signer_revoked = "model_signer_revoked"
    model_signature_mismatch = "model_signature_mismatch"  # signed digests != the artifact's
    model_signing_unavailable = "model_signing_unavailable"  # no model-signing package here

    @property
    def against_worker(self) -> bool:
        """True for a refusal of the artifact against the refusing worker's own limits (its
        ``max_lora_rank``, its host-tier budget, its base model's shapes), not of the bytes
        alone: a worker with other limits may take the same artifact."""
        return self in (
            ArtifactReason.rank_too_high,
            ArtifactReason.host_budget_exceeded,
            ArtifactReason.model_shape_unknown,
        )

    @property
    def is_failure(self) -> bool:
        """True for transient trouble (CacheEvent kind ``fail``), False for a refusal: I/O,
        or a worker without the model-signing package (installing it lets a retry pass)."""
        return self in (
            ArtifactReason.artifact_store_unavailable,
            ArtifactReason.fetch_failed,
            ArtifactReason.host_io_error,
            ArtifactReason.host_disk_full,
            ArtifactReason.install_error,
            ArtifactReason.model_signing_unavailable,
        )


class ResolverRefusal(StrEnum):
    """Why the host-tier LoRA resolver in vLLM (``workers/vllm_resolver.py``) handed vLLM
    no folder for a name a request asked for, in the order its checks run."""

    unsafe_name = "unsafe_name"  # not a lora name: a path, `..`, an absolute path, odd bytes
    served_model_mismatch = "served_model_mismatch"  # vLLM serves a model it was not set up for
    not_in_host_tier = "not_in_host_tier"  # no entry of that name in the host tier
    unverified = "unverified"  # an entry without a readable record of its own name, a link
    unvouched = "unvouched"  # no view the keyring verifies names this lora name (the digest)
    withdrawn = "withdrawn"  # the verified view has the version retired or revoked
    other_base_model = "other_base_model"  # the record or its config names another base model
    model_shape_unknown = "model_shape_unknown"  # vLLM's --model has no local config.json
    tampered = "tampered"  # the files fail verification against the signed record
    io_error = "io_error"  # the entry could not be read or copied


class VllmErrorCode(StrEnum):
    """Why a call to vLLM failed: its answer's class, or the transport's trouble."""

    already_loaded = "already_loaded"
    bad_request = "bad_request"
    not_found = "not_found"
    rank_too_large = "rank_too_large"
    adapter_refused = "adapter_refused"  # vLLM's LoRA loader refused the folder (a 5xx)
    server_error = "server_error"
    unexpected_status = "unexpected_status"
    timeout = "timeout"
    unreachable = "unreachable"  # refused, reset, closed mid-answer
    bad_response = "bad_response"  # not HTTP/1.1
    wrong_base_model = "wrong_base_model"  # another base model than adapters are checked for

    @property
    def failure(self) -> VllmFailure:
        """The reason a cache event or a load outcome carries: ``vllm_<code>``."""
        return VllmFailure(f"vllm_{self.value}")

    @property
    def refuses_load(self) -> bool:
        """True when vLLM's answer to a load refuses the adapter's bytes themselves: a
        retry of the same version gets the same answer (its loader's rank limit, a module
        or weights file it cannot load, any other 400 but ``already_loaded``). Every other
        code is transient trouble (busy, down, slow, a name taken) that a retry can pass."""
        return self in (
            VllmErrorCode.bad_request,
            VllmErrorCode.rank_too_large,
            VllmErrorCode.adapter_refused,
        )


class VllmFailure(StrEnum):
    """A vLLM failure as a cache-event reason: ``vllm_`` + its VllmErrorCode (written out so
    type checkers and the JSON Schema see the members; a unit test keeps the two in step)."""

    vllm_already_loaded = "vllm_already_loaded"
    vllm_bad_request = "vllm_bad_request"
    vllm_not_found = "vllm_not_found"
    vllm_rank_too_large = "vllm_rank_too_large"
    vllm_adapter_refused = "vllm_adapter_refused"
    vllm_server_error = "vllm_server_error"
    vllm_unexpected_status = "vllm_unexpected_status"
    vllm_timeout = "vllm_timeout"
    vllm_unreachable = "vllm_unreachable"
    vllm_bad_response = "vllm_bad_response"
    vllm_wrong_base_model = "vllm_wrong_base_model"


class UnloadReason(StrEnum):
    """Why the agent unloads a name from vLLM or deletes it from the host tier."""

    revoked = "revoked"  # at once, in-flight requests or not
    demote = "demote"  # intent host, after draining
    evict = "evict"  # intent gone, after draining
    kv_namespace_conflict = "kv_namespace_conflict"  # a name the agent cannot vouch for
    slot_needed = "slot_needed"  # the worker's own LRU: a load needed its GPU slot


class ForeignChange(StrEnum):
    """A change to vLLM's adapters that this worker's agent did not make, found by reconcile
    within one tick: counted on ``/metrics`` and dead-lettered (docs/worker.md)."""

    unvouched_copy = "unvouched_copy"  # a name served from bytes the agent cannot vouch for
    copy_vanished = "copy_vanished"  # a copy the agent loaded is gone from vLLM


class IntentRefusal(StrEnum):
    """Why the agent drops an intent that the registry cannot back (a ``refuse`` event)."""

    not_in_registry = "not_in_registry"
    revoked = "revoked"
    base_model_mismatch = "base_model_mismatch"
    tenant_mismatch = "tenant_mismatch"


class LoadDeferral(StrEnum):
    """Why a cold load has not happened yet, for a waiting request (not a refusal)."""

    busy_retry = "busy_retry"  # the worker's cold-load budget is spent
    load_queued = "load_queued"  # still loading when the request's wait ran out
    batch_cold_loads_busy = "batch_cold_loads_busy"  # no batch cold-load slot freed
    superseded_by_command = "superseded_by_command"  # a command moved the version away
    no_free_slot = "no_free_slot"  # every GPU slot holds a pinned, protected or busy copy
    # every copy that could give its slot had more recent demand at this worker
    busier_copies = "busier_copies"
    # every copy that could give its slot was loaded for the planner within min_residency_s
    min_residency = "min_residency"


class RequestRefusal(StrEnum):
    """Why the gateway refused a request body before it reached vLLM (a 400 or 413 whose
    ``error.param`` names the field; ``frontdoor.request_fields.admit``)."""

    field_not_allowed = "field_not_allowed"  # not on the endpoint's allowlist
    bad_field = "bad_field"  # an allowed field of the wrong type or shape
    too_many_choices = "too_many_choices"  # n / best_of over the class's cap
    max_tokens_too_large = "max_tokens_too_large"
    too_many_prompts = "too_many_prompts"  # a list prompt counts each
    logprobs_too_large = "logprobs_too_large"  # logprobs / top_logprobs over the cap
    too_many_stop = "too_many_stop"  # stop sequences over the cap (count or length)
    body_too_large = "body_too_large"  # over the class's body cap (413)


class AdmissionRefusal(StrEnum):
    """Why the front door refused a request, at the router or the gateway alike
    (``frontdoor.admission``), besides a field's ``RequestRefusal`` and a ``TenantLimit``."""

    unauthorized = "unauthorized"  # no or an unknown API key, or a forward not signed (401)
    forward_outdated = "forward_outdated"  # a forward signed in an older form (401)
    forward_replayed = "forward_replayed"  # a forward's signature taken before (401)
    repeated_header = "repeated_header"  # a header the door reads was sent twice (400)
    bad_request_class = "bad_request_class"  # an unknown X-Request-Class (400)
    invalid_json = "invalid_json"  # the body is not JSON (400)
    model_not_adapter_id = "model_not_adapter_id"  # model is not wholly an adapter id (400)
    unknown_adapter = "unknown_adapter"  # no verified version of that adapter here (404)
    forbidden = "forbidden"  # another tenant's: answered as unknown_adapter (404)
    base_model_not_allowed = "base_model_not_allowed"  # the key is scoped to others (403)
    no_serving_version = "no_serving_version"  # neither active nor canary (404)
    version_unknown = "version_unknown"  # the router's version is not in this view yet (503)
    version_revoked = "version_revoked"  # the router's version was revoked since (410)


class ServerRefusal(StrEnum):
    """What a front door's HTTP server answers outside its handlers (``kernel.http_server``:
    ``ERROR_ANSWER``), besides a body read past the server's cap (``body_too_large``) or one
    whose ``Content-Encoding`` does not decode (``invalid_json``)."""

    unknown_route = "unknown_route"  # no route of that path: vLLM's others included (404)
    method_not_allowed = "method_not_allowed"  # a route, not for that method (405)
    bad_expectation = "bad_expectation"  # an Expect other than 100-continue (417)
    malformed_request = "malformed_request"  # a head the HTTP parser refuses (400)
    internal_error = "internal_error"  # a handler failed (500): a bug, never the input's


class ServingRefusal(StrEnum):
    """Why a worker's gateway answered an admitted request without the adapter's output
    (``workers.gateway``), besides vLLM's own failures (``VllmFailure``)."""

    adapter_cold = "adapter_cold"  # not loaded within the class's budget (429 + Retry-After)
    canary_warming = "canary_warming"  # only a warming canary could serve (429 + Retry-After)
    adapter_unavailable = "adapter_unavailable"  # vLLM lost the name under us (503)
    adapter_unavailable_permanent = "adapter_unavailable_permanent"  # artifact refused (424)
    # this worker cannot load it (its vLLM, its own limits); another worker may (424)
    adapter_refused_by_worker = "adapter_refused_by_worker"


class RouterRefusal(StrEnum):
    """Why the fleet router answered a request itself after its front door admitted it
    (``router.server``), besides a ``QueueRefusal``."""

    no_live_worker = "no_live_worker"  # no live worker of the base model fits (503)
    worker_lost = "worker_lost"  # the chosen worker closed mid-answer (503 + Retry-After)
    client_gone = "client_gone"  # the client left while its request was queued (499)
    answers_full = "answers_full"  # the router holds its bound of answer bytes (503)
    # the workers' gateways refused the router's own forward (401 there), none served (502)
    forward_refused = "forward_refused"


class TenantLimit(StrEnum):
    """Why the gateway answered 429 + Retry-After for a tenant's own limits."""

    tenant_concurrency = "tenant_concurrency"  # the tenant has max_concurrent in flight
    tenant_token_rate = "tenant_token_rate"  # the tenant's token bucket is empty


class QueueRefusal(StrEnum):
    """Why the fleet router answered a request from its flow-control queues
    (``router.flow_control``) instead of forwarding it."""

    queue_full = "queue_full"  # the (base model, band) queue holds its maximum (429)
    tenant_queue_full = "tenant_queue_full"  # the tenant holds its share of the band (429)
    queue_timeout = "queue_timeout"  # the class's TTL passed while it waited (503)


class CommandRule(StrEnum):
    """Which planner rule issued a command (``CommandReason.rule``)."""

    protected_over_capacity = "protected_over_capacity"
    no_longer_protected = "no_longer_protected"
    revoke = "revoke"
    not_serving = "not_serving"
    demote = "demote"
    hot_score = "hot_score"
    slot_needed = "slot_needed"
    hot_score_displace = "hot_score_displace"
    replica_demand = "replica_demand"
    replica_surplus = "replica_surplus"
    never_evict = "never_evict"
    hbm_watermark = "hbm_watermark"
    host_tier = "host_tier"
    host_pressure = "host_pressure"


class WaitReason(StrEnum):
    """Why a hot-set version could not be loaded this tick (the planner's ``refused``)."""

    cold_load_budget = "cold_load_budget"  # free or displaceable slots exist, budget blocks
    no_gpu_slot = "no_gpu_slot"  # nothing can be displaced
    min_residency = "min_residency"  # only copies within the policy's min_residency_s could
    no_worker_fits_rank = "no_worker_fits_rank"  # every worker's max_lora_rank is below its rank
    worker_not_run = "worker_not_run"  # only workers whose state says not_run fit or have room


class PublishFailure(StrEnum):
    """Why ``loraplane publish`` did not publish (``error.code`` of its JSON result); each
    belongs to one outcome, and so one exit code (``schemas.publish_result``)."""

    options_invalid = "options_invalid"  # missing, conflicting or unknown-value options
    key_unusable = "key_unusable"  # the --key file is missing, malformed or not mode 0600
    settings_invalid = "settings_invalid"  # settings or their secret files are unusable
    release_invalid = "release_invalid"  # adapter id, version, tenant... refused by the schema
    model_config_invalid = "model_config_invalid"  # --model-config unreadable or not a config
    extra_missing = "extra_missing"  # a signed folder, without loraplane[signing] installed
    artifact_refused = "artifact_refused"  # the workers' verifier (or publish) refused it
    artifact_store_unavailable = "artifact_store_unavailable"  # S3 failed; nothing produced
    bus_unavailable = "bus_unavailable"  # Kafka did not acknowledge; nothing produced
    follow_up_not_acknowledged = "follow_up_not_acknowledged"  # publish sent, canary/promote not
    registry_rejected = "registry_rejected"  # --wait-s: the registry rejected an event
    registry_undecided = "registry_undecided"  # --wait-s: no decision in time
    internal_error = "internal_error"  # a bug: the traceback is on stderr


CacheEventReason = (
    Literal[""] | ArtifactReason | VllmFailure | UnloadReason | IntentRefusal | LoadDeferral
)
"""A cache event's reason: empty for a success, else the code of what happened."""

DeadLetterReason = (
    DecodeReason
    | RegistryRejection
    | RegistryViewRejection
    | CommandRejection
    | ConsumerFault
    | ForeignChange
)
"""Why a message went to the dead-letter topic."""

AuditReason = Literal[""] | RegistryRejection | CommandRule | WaitReason
"""An audit record's reason: the registry's rejection, the planner's rule or wait, or empty."""
