"""Where every runtime's Kafka events go without waiting for the broker and without being
lost: the sink, its durable spool and the journal written before an answer leaves."""
