#!/usr/bin/env bash
# Binaries and jars of the local stack (loraplane stack up): ClickHouse from Debian, Kafka and
# s3proxy jars from Maven Central into ~/.m2 (classpaths cached under .loraplane/cache). Skips
# what is done.
set -euo pipefail
if [ ! -x /usr/sbin/clickhouse-server ] && ! command -v clickhouse-server >/dev/null; then
  echo "installing clickhouse-server (Debian package; we run it ourselves, not its service)"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends clickhouse-server clickhouse-client
  # The package may enable and start its own instance on the default ports; we do not use it.
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now clickhouse-server || true
  fi
fi
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "installing prometheus + promtool (Debian package; tests start their own on loopback)"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  # Its service would listen on 0.0.0.0:9090 (infra/prometheus.py runs ours on 127.0.0.1):
  # without systemd, the package's postinst starts it through invoke-rc.d unless a
  # policy-rc.d says no, so one says no for the install (and only for it).
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    guard=1
  fi
  $SUDO apt-get install -y -q --no-install-recommends prometheus || { [ -z "$guard" ] || $SUDO rm -f /usr/sbin/policy-rc.d; exit 1; }
  [ -z "$guard" ] || $SUDO rm -f /usr/sbin/policy-rc.d
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus || true
  fi
fi
if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then
  echo "installing a JRE and Maven for Kafka and s3proxy"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends openjdk-17-jre-headless maven
fi
.venv/bin/loraplane stack fetch
