#!/usr/bin/env bash
# Debian's chromium for the dashboard's browser test (headless; no selenium/playwright downloads).
# Idempotent: does nothing when /usr/bin/chromium is already there.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core >/dev/null \
  || { $SUDO apt-get update -q >/dev/null && \
       $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core >/dev/null; }
