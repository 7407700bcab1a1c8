"""Pallas kernels. They know nothing of meshes: callers wrap them in shard_map."""
