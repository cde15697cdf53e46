"""Prefix blocks, torch-free and shared by the engine and the router: block-key hashes
(`hashing`), KV-cache event records (`events`), their wire format (`wire`), the engine's
publisher, the router's subscriber and its pod -> blocks index."""
