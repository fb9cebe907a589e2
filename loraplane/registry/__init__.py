"""The adapter registry, one home per layer. The wire model is ``loraplane.schemas.registry``;
here the pure decisions (``fold``: lifecycle events into versions; ``evidence``: a view
re-derived from its signed events; ``vouch``: whether a verified view names a lora name) and
the runtime side (``topic``: reading the compacted topic; ``live``: a consumer's verified
copy; ``decisions``: the registry's verdicts on published events, from the audit topic).
The Faust agent that folds the lifecycle topic is ``loraplane.streams.registry_agent``."""
