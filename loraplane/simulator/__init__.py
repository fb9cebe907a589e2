"""The policy simulator: replays a request stream against a modelled fleet, once per cache
policy, and scores every policy on the same requests (``loraplane simulate``).

Pure code except ``trace`` (reads a CSV) and ``report`` (writes JSON and PNG files).
"""
