"""The GPU worker side: the agent beside each vLLM server, its host tier and artifact checks."""
