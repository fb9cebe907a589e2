"""The local backbone: Kafka, ClickHouse and an S3 endpoint run as our own loopback processes."""
