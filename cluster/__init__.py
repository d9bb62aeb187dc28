"""Cluster-wide facts and conventions every other package shares: the configuration,
environment, QoS classes, engine platform, checkpoint facts, singleton-actor options,
periodic jobs and the built-in tiny model, importing no other package.
"""
