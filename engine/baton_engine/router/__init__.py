"""Baton's router: an OpenAI-compatible proxy that sends each request through a prefill pod and a
decode pod (or one pod of an aggregated pool). Torch-free: it imports only the contract and
config modules of ``baton_engine``.
"""
