"""Triton kernels for the paged KV cache, each beside the pure-torch reference it must match."""
