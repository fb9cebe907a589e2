"""Ops views over ClickHouse: the SQL query pack, the built-in web dashboard, Grafana JSON."""
