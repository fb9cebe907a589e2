#!/usr/bin/env bash
# ajv, the JavaScript JSON Schema validator, for tests/unit/test_schemas_ajv.py: the exported
# schemas (schemas/json/) must accept the product's real messages and reject broken ones in a
# validator that is not pydantic. Node.js from apt when missing; ajv + ajv-formats from the npm
# registry into the plain folder .venv-node (never global). Idempotent (stamp file).
set -euo pipefail
AJV_VERSION=8.20.0
AJV_FORMATS_VERSION=3.0.1
TARGET=.venv-node
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "installing Node.js and npm (Debian packages) for the ajv schema check"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends nodejs npm
fi
stamp="$TARGET/.ajv-$AJV_VERSION-formats-$AJV_FORMATS_VERSION.done"
if [ -f "$stamp" ]; then
  echo "ajv: ajv $AJV_VERSION + ajv-formats $AJV_FORMATS_VERSION already in $TARGET"
  exit 0
fi
rm -rf "$TARGET"
mkdir -p "$TARGET"
# Node trusts only the CAs it was built with: a registry reached through a TLS-inspecting
# proxy (whose CA is in the system's bundle, as pip and apt use) needs that bundle too.
if [ -z "${NODE_EXTRA_CA_CERTS:-}" ] && [ -r /etc/ssl/certs/ca-certificates.crt ]; then
  export NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
fi
npm install --prefix "$TARGET" --no-audit --no-fund --no-save \
  "ajv@$AJV_VERSION" "ajv-formats@$AJV_FORMATS_VERSION"
(cd "$TARGET" && node -e 'require("ajv/dist/2020"); require("ajv-formats")')
touch "$stamp"
echo "ajv: ajv $AJV_VERSION + ajv-formats $AJV_FORMATS_VERSION ready in $TARGET"
