"""KV transfer between a prefill (producer) and a decode (consumer) engine, pyzmq over TCP.

`protocol` (wire format), `cache_blocks` (gather/scatter of blocks of the KV tensor), `leases`
(producer lease table), `producer` (serving thread), `consumer` (pulls), `params` (signed
kv_transfer_params), `metrics`.
"""
