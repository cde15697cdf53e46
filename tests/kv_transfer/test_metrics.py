from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from baton_engine import contract
from baton_engine.kv_transfer.metrics import KVTransferCollector, TransferStats, TransferTotals


def _record(stats: TransferStats) -> None:
    stats.sent(1000, 0.02)
    stats.received(1000, 0.03)
    stats.received(24, 0.005)  # exactly on a bucket bound: counted in le="0.005"
    stats.failed("timeout")
    stats.failed("timeout")
    stats.failed("spec_mismatch")
    stats.lease_expired(3)


def test_delta_and_totals() -> None:
    stats = TransferStats()
    _record(stats)
    delta = stats.take()
    assert (delta.bytes_sent, delta.bytes_received, delta.leases_expired) == (1000, 1024, 3)
    assert delta.failures == {"timeout": 2, "spec_mismatch": 1}
    assert delta.pull_seconds == [0.03, 0.005] and delta.serve_seconds == [0.02]
    assert stats.take().is_empty()
    _record(stats)
    totals = stats.totals()
    assert (totals.bytes_sent, totals.bytes_received, totals.leases_expired) == (2000, 2048, 6)
    assert TransferTotals.from_dict(totals.to_dict()) == totals


def test_collector_renders_the_latest_totals() -> None:
    stats = TransferStats()
    _record(stats)
    _record(stats)
    registry = CollectorRegistry()
    collector = KVTransferCollector("smollm2", registry)
    collector.update(stats.totals().to_dict())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "smollm2", **labels})

    assert value(contract.M_KV_TRANSFER_BYTES, direction="sent") == 2000
    assert value(contract.M_KV_TRANSFER_BYTES, direction="received") == 2048
    assert value(contract.M_KV_TRANSFER_SECONDS + "_count", role="consumer") == 4
    assert value(contract.M_KV_TRANSFER_SECONDS + "_count", role="producer") == 2
    assert value(contract.M_KV_TRANSFER_SECONDS + "_bucket", role="consumer", le="0.005") == 2
    assert value(contract.M_KV_TRANSFER_SECONDS + "_bucket", role="consumer", le="0.025") == 2
    assert value(contract.M_KV_TRANSFER_SECONDS + "_bucket", role="consumer", le="0.05") == 4
    assert value(contract.M_KV_TRANSFER_SECONDS + "_sum", role="producer") == 0.04
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
