#!/usr/bin/env bash
# Publish one adapter version from its release tag, as a CI job runs it: the GitHub Actions
# workflow beside it (github-actions/publish-adapter.yml) calls this script, and the suite
# runs it end to end against the local stack (tests/integration/test_ci_publish.py).
#
#   publish-adapter.sh TAG
#
# TAG is adapter/<adapter_id>/v<version> ("refs/tags/" in front is accepted):
# adapter/support-bot/v1.4.0 publishes version 1.4.0 of support-bot from the folder
# $PUBLISH_ADAPTERS_DIR/support-bot (as PEFT saved it). loraplane checks the id and version.
#
# Environment (the first three are required; loraplane's own settings, LORAPLANE_KAFKA__*,
# LORAPLANE_S3__* and so on, pass through to it):
#   PUBLISH_TENANT         the tenant that owns the adapter
#   PUBLISH_BASE_MODEL     the base model id it was trained for
#   PUBLISH_KEY_FILE       the CI signing key file, mode 0600 (`loraplane keys generate`)
#   PUBLISH_ADAPTERS_DIR   one folder per adapter id in it (default: adapters)
#   PUBLISH_PRIORITY       bronze | silver | gold | platinum (default: silver)
#   PUBLISH_CANARY_PERCENT also start a canary at this percent (default: none)
#   PUBLISH_MODEL_CONFIG   the base model's config.json, to check tensor shapes (default: none)
#   PUBLISH_WAIT_S         seconds to wait for the registry's decision; 0: exit once Kafka
#                          acknowledged the events (default: 120)
#   PUBLISH_RESULT_FILE    also write the JSON result to this file (default: none)
#   PUBLISH_CLI            the loraplane command (default: loraplane)
#
# stdout: the JSON result of `loraplane publish --json`, nothing else
#         (schemas/json/publish_result.schema.json).
# stderr: loraplane's progress, then one summary line.
# exit:   loraplane publish's code: 0 published, 1 internal error, 2 invalid input,
#         3 artifact refused, 4 registry rejected, 5 unavailable (nothing sent: re-run),
#         6 undecided (events sent, outcome unknown: look before re-running);
#         also 2 for a tag or an environment this script cannot use (stdout then empty).
# In GitHub Actions the result's outcome, lora_name, sha256, event_id and artifact_uri
# become step outputs ($GITHUB_OUTPUT) and a line of the job summary ($GITHUB_STEP_SUMMARY).
set -uo pipefail

say() { echo "publish-adapter: $*" >&2; }

tag=${1:-}
tag=${tag#refs/tags/}
if [[ ! $tag =~ ^adapter/([^/]+)/v([^/]+)$ ]]; then
  say "tag '$tag' is not adapter/<adapter_id>/v<version>"
  exit 2
fi
adapter_id=${BASH_REMATCH[1]}
version=${BASH_REMATCH[2]}
for name in PUBLISH_TENANT PUBLISH_BASE_MODEL PUBLISH_KEY_FILE; do
  if [ -z "${!name:-}" ]; then
    say "$name is not set"
    exit 2
  fi
done

args=(publish --json
      --adapter-id "$adapter_id" --version "$version"
      --tenant "$PUBLISH_TENANT" --base-model "$PUBLISH_BASE_MODEL"
      --artifact "${PUBLISH_ADAPTERS_DIR:-adapters}/$adapter_id"
      --key "$PUBLISH_KEY_FILE" --priority "${PUBLISH_PRIORITY:-silver}"
      --wait-s "${PUBLISH_WAIT_S:-120}"
      --reason "tag $tag${GITHUB_SHA:+ at ${GITHUB_SHA:0:12}}")
if [ -n "${PUBLISH_CANARY_PERCENT:-}" ]; then args+=(--canary "$PUBLISH_CANARY_PERCENT"); fi
if [ -n "${PUBLISH_MODEL_CONFIG:-}" ]; then args+=(--model-config "$PUBLISH_MODEL_CONFIG"); fi

result=$("${PUBLISH_CLI:-loraplane}" "${args[@]}")
rc=$?
if [ -z "$result" ]; then
  # Nothing on stdout: the options never reached publish (click refused them) or
  # loraplane could not start; its own message is on stderr above.
  say "$adapter_id $version: no result from loraplane (exit $rc)"
  exit $((rc == 0 ? 1 : rc))
fi
printf '%s\n' "$result"
if [ -n "${PUBLISH_RESULT_FILE:-}" ]; then printf '%s\n' "$result" > "$PUBLISH_RESULT_FILE"; fi

# key=value lines of the fields a later step uses, from the one JSON object.
fields=$(python3 - "$result" <<'PY'
import json
import sys

result = json.loads(sys.argv[1])
print("outcome=" + result["outcome"])
for key in ("lora_name", "sha256", "event_id", "artifact_uri"):
    print(f"{key}={result.get(key) or ''}")
message = (result.get("error") or {}).get("message", "")
print("message=" + " ".join(message.split())[:300])
PY
) || { say "$adapter_id $version: the result is not JSON (exit $rc)"; exit $((rc == 0 ? 1 : rc)); }
field() { printf '%s\n' "$fields" | sed -n "s/^$1=//p"; }

if [ "$rc" = 0 ]; then
  line="$adapter_id $version published as $(field lora_name)"
else
  line="$adapter_id $version not published ($(field outcome), exit $rc): $(field message)"
fi
say "$line"
if [ -n "${GITHUB_OUTPUT:-}" ]; then printf '%s\n' "$fields" | grep -v '^message=' >> "$GITHUB_OUTPUT"; fi
if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then echo "- $line" >> "$GITHUB_STEP_SUMMARY"; fi
exit "$rc"
