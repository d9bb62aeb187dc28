"""An engine replica: vLLM's arguments, the ``AsyncLLM`` adapter, the Serve deployment,
KV events, router reports, expert load and stream batching.
"""
