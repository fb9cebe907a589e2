#!/usr/bin/env bash
# Binaries and jars of the local stack (loraplane stack up): ClickHouse and Prometheus from
# Debian, Kafka and s3proxy jars from Maven Central into ~/.m2 (classpaths cached under
# .loraplane/cache). Skips what is done.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo

# A Debian service package whose own instance we never use: ClickHouse's would take the
# default ports, Prometheus' would listen on 0.0.0.0:9090 (we run ours on 127.0.0.1). Without
# systemd, a package's postinst starts its service through invoke-rc.d unless a policy-rc.d
# says no, so one says no for the install (and only for it); with systemd it is disabled.
install_service_package() {
  local service=$1; shift
  local guard=""
  $SUDO apt-get update -q
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    guard=1
  fi
  local rc=0
  $SUDO apt-get install -y -q --no-install-recommends "$@" || rc=$?
  [ -z "$guard" ] || $SUDO rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || exit "$rc"
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now "$service" || true
  fi
}

if [ ! -x /usr/sbin/clickhouse-server ] && ! command -v clickhouse-server >/dev/null; then
  echo "installing clickhouse-server (Debian package; we run it ourselves, not its service)"
  install_service_package clickhouse-server clickhouse-server clickhouse-client
fi
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "installing prometheus + promtool (Debian package; tests start their own on loopback)"
  install_service_package prometheus prometheus
fi
if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then
  echo "installing a JRE and Maven for Kafka and s3proxy"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends openjdk-17-jre-headless maven
fi
.venv/bin/loraplane stack fetch
