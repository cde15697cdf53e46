"""Baton's router (``baton-router``): an OpenAI-compatible proxy that sends each request through a
prefill pod and a decode pod (or to one pod of an aggregated pool).

Torch-free: besides its own modules it imports only torch-free parts of ``baton_engine``
(``contract``, ``prefix`` — block keys, the KV-event subscriber and index — and the tokenizer
loading of ``text`` and ``model.loader``), as import-linter checks.

Modules:
    cli           flags -> settings, discovery, prefix scoring; runs uvicorn
    app           FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health,
                  /ready, /metrics; API key; request ids
    proxy         one request's legs (prefill -> decode, fallback, aggregated) relayed unchanged,
                  cancelled when the client goes away
    core          router state: registry + load + prefix scores + in-flight counts -> pod choice
    policy        pure pod-ranking functions (prefix, load, round-robin)
    endpoints     Endpoint and the registry discovery keeps current (added/removed events)
    discovery     static URL lists; Kubernetes Pod watch (pod -> endpoint extraction is pure)
    load          /metrics scraper (queue depth, running, KV usage)
    prefix        seams: RequestTokenizer, BlockHasher, PrefixMatcher; PrefixScorer combines them
                  (block keys: ``prefix.hashing.EventKeyHasher``)
    kv_index      PrefixMatcher fed by the pods' KV events (subscriber follows the registry)
    metrics       baton_router_* Prometheus metrics (names in contract's router section)
    errors        OpenAI-shaped error bodies
"""
