"""The DeepSeekRouter: admission and placement decided by a pure, clocked core with
plain settings (no Ray, torch or vLLM outside ``actor.py`` and ``metrics.py``), made
awaitable by ``service.py`` and run as a Ray actor by ``actor.py``.
"""
