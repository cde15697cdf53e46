"""Baton's data plane: the paged-KV inference engine, its server, KV events, KV transfer, router."""

__version__ = "0.1.0"
