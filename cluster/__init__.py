"""Cluster-wide facts: the configuration, the environment and the built-in model."""
