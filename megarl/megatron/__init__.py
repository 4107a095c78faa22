"""Megatron-core side of megarl: CPU compatibility, parallel state, model building, forward/backward steps."""
