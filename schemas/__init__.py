"""Wire contracts: one pydantic v2 model per message on Kafka, shared by every component.

Every model is strict (unknown fields are errors), frozen, and carries ``schema_version`` so
that producers in other languages can be checked against the exported JSON Schema in
``schemas/json/``.
"""
