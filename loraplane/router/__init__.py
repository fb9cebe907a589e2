"""The fleet router (``loraplane router run``): one front door for every worker, its flow
control and its view of the fleet. A runtime of its own: it shares code with the worker only
through lower layers (``loraplane.frontdoor``, ``loraplane.eventlog``, ``loraplane.registry``)."""
