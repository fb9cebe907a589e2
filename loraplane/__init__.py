"""loraplane: keeps the right LoRA adapters hot on a fleet of vLLM workers."""

__version__ = "0.1.0"
