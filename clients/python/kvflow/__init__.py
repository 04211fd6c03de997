"""kvflow's Python side: the sidecar client (kvflow.client), the seed's
scheduler rules (kvflow.scheduler), vLLM's KV connector (kvflow.vllm) and a
tiny paged-attention engine used to prove transfers right (kvflow.tiny)."""

__version__ = "0.1.0"
