"""Tensor parallelism across processes: rank 0 (HTTP, scheduler) and its follower ranks."""
