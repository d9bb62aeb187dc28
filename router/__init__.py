"""Admission and placement: the DeepSeekRouter's pure decision logic and its Ray actor.

Everything but ``actor.py`` is plain Python with an injected clock (no Ray, no torch,
no vLLM), so each policy, queue and breaker is unit-tested exactly.
"""
