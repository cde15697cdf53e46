"""The torch-free engine core: requests, the KV-cache manager, the persistent batch, the scheduler
and the step loop (`engine_core`). Imports numpy and the standard library only."""
