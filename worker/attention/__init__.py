"""Paged attention: the backends (pure Paddle: the reference; the custom C++ and CUDA ops), their per-step
metadata, and the KV cache they read and write."""
