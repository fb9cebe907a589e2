"""Metrics: the Kafka -> ClickHouse sink, the schema migrations and the ops query pack."""
