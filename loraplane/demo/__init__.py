"""``loraplane demo`` and ``loraplane loadtest``: the whole system live, as child processes."""
