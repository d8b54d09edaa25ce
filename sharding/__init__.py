"""Mesh sharding: logical axis names for parameters and activations, and their mesh rules."""

from sharding.rules import DEFAULT_RULES, logical_spec, shard, named_sharding

__all__ = ["DEFAULT_RULES", "logical_spec", "shard", "named_sharding"]
