#!/usr/bin/env bash
# The CI example's checkers, for tests/unit/test_ci_example.py: actionlint (GitHub Actions
# workflows) built from its Go module with the machine's Go (the Go module proxy; no prebuilt
# binary is downloaded) into $LORAPLANE_HOME/cache/actionlint-VERSION/, and shellcheck from
# Debian (the example's shell script, and actionlint's check of each `run:` block).
# Idempotent: skips what answers already. A build that fails leaves its log in
# build-failed.log there and does not stop the set-up: the test then skips, saying why.
set -euo pipefail
ACTIONLINT_VERSION=v1.7.12
HOME_DIR="${LORAPLANE_HOME:-$(pwd)/.loraplane}"
TARGET="$HOME_DIR/cache/actionlint-$ACTIONLINT_VERSION"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive

if ! command -v shellcheck >/dev/null; then
  echo "installing shellcheck (Debian package) for the CI example's checks"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends shellcheck
fi
if [ -x "$TARGET/actionlint" ] && "$TARGET/actionlint" -version >/dev/null 2>&1; then
  echo "actionlint: $ACTIONLINT_VERSION already in $TARGET"
  exit 0
fi
if ! command -v go >/dev/null; then
  echo "installing Go (Debian package) to build actionlint"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends golang-go
fi
mkdir -p "$TARGET"
rm -f "$TARGET/build-failed.log"
# GOBIN puts the one binary here; nothing is installed globally. -trimpath: no local paths
# in the binary. Go's own build and module caches are reused by a later clone.
if ! GOBIN="$TARGET" GOFLAGS="-buildvcs=false -trimpath" \
    go install "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION" \
    > "$TARGET/build.log" 2>&1; then
  mv "$TARGET/build.log" "$TARGET/build-failed.log"
  echo "actionlint: the build failed (the workflow check will skip); its log:" >&2
  tail -20 "$TARGET/build-failed.log" >&2
  exit 0
fi
"$TARGET/actionlint" -version
echo "actionlint: $ACTIONLINT_VERSION ready in $TARGET"
