"""Parallel execution of pure layer functions: kernels inside shard_map, and later pipelines and experts."""
