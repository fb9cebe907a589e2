#!/usr/bin/env bash
# Helm, built from its Go module (helm.sh/helm/v4, the version in infra/helm_chart.py), for
# the chart's tests (tests/unit/test_helm_chart.py: lint --strict, template, the manifests
# against Kubernetes' schemas). Into the stack's cache folder, .loraplane/cache/helm-VERSION;
# skipped when it is there. Without a Go toolchain the chart's tests skip, saying why.
set -euo pipefail
if ! command -v go >/dev/null; then
  echo "helm: not built (no Go toolchain on PATH); tests/unit/test_helm_chart.py will skip"
  exit 0
fi
.venv/bin/python -m loraplane.infra.helm_chart install
