"""Shared paged KV: the per-node page arena, its directory and the vLLM connector."""
