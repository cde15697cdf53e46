"""A producer in its own process (the producer-killed tests kill it by pid).

Run: ``python -m tests.kv_transfer.producer_process SEED NUM_BLOCKS TRANSFER_ID``. It fills a
cache from SEED (`helpers.make_cache`), leases blocks 0..NUM_BLOCKS-1 under TRANSFER_ID, prints
its port on one line and serves until killed. Small chunks and a shallow send queue keep most
of a transfer unsent while the consumer is busy, so a kill lands mid-transfer.
"""

from __future__ import annotations

import sys
import threading

from baton_engine.kv_transfer.producer import KVTransferProducer
from tests.kv_transfer.helpers import make_cache


def main() -> None:
    seed, num_blocks, transfer_id = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    kv = make_cache(seed, num_blocks=num_blocks, layers=8)
    producer = KVTransferProducer(kv, engine_id="producer-proc", port=0, chunk_bytes=1, send_depth=3)
    producer.add_lease(transfer_id, list(range(num_blocks)), 60.0)
    print(producer.port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
