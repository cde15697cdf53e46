from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from baton_engine import contract
from baton_engine.kv_transfer.metrics import KVTransferMetrics, TransferStats


def test_stats_delta_becomes_prometheus_samples() -> None:
    stats = TransferStats()
    stats.sent(1000, 0.02)
    stats.received(1000, 0.03)
    stats.received(24, 0.004)
    stats.failed("timeout")
    stats.failed("timeout")
    stats.failed("spec_mismatch")
    stats.lease_expired(3)
    delta = stats.take()
    assert stats.take().is_empty()

    registry = CollectorRegistry()
    metrics = KVTransferMetrics("smollm2", registry)
    metrics.apply(delta)
    metrics.apply(delta)  # deltas add up

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "smollm2", **labels})

    assert value(contract.M_KV_TRANSFER_BYTES, direction="sent") == 2000
    assert value(contract.M_KV_TRANSFER_BYTES, direction="received") == 2048
    assert value(contract.M_KV_TRANSFER_SECONDS + "_count", role="consumer") == 4
    assert value(contract.M_KV_TRANSFER_SECONDS + "_count", role="producer") == 2
    assert value(contract.M_KV_TRANSFER_SECONDS + "_bucket", role="consumer", le="0.005") == 2
    assert value(contract.M_KV_TRANSFER_FAILURES, reason="timeout") == 4
    assert value(contract.M_KV_TRANSFER_FAILURES, reason="spec_mismatch") == 2
    assert value(contract.M_KV_LEASES_EXPIRED) == 6
    text = generate_latest(registry).decode()
    for name in (
        contract.M_KV_TRANSFER_BYTES,
        contract.M_KV_TRANSFER_SECONDS + "_bucket",
        contract.M_KV_TRANSFER_FAILURES,
        contract.M_KV_LEASES_EXPIRED,
    ):
        assert f"\n{name}{{" in text
