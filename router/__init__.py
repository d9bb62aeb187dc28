"""Admission and placement: QoS classes, and (growing here) the DeepSeekRouter."""
