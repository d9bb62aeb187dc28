"""Shared paged KV: each node's page arena and store, the cluster's page directory,
and the vLLM connector that loads and saves pages.
"""
