"""The HTTP server's check of kv_transfer_params (torch-free, before the core sees them)."""

from __future__ import annotations

import pytest

from baton_engine import contract
from baton_engine.contract import KVTransferParamsError
from baton_engine.kv_transfer.request_params import check_request_params

KEY = "server-side-key"
PROMPT = [[5, 6, 7, 8, 9]]


def _signed(**overrides: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "engine_id": "e",
        "host": "127.0.0.1",
        "port": 5600,
        "transfer_id": "t",
        "block_ids": [3],
        "num_tokens": 5,
        "first_token": 1,
        "block_size": 16,
        "dtype": "float32",
        **overrides,
    }
    return contract.sign_dict(raw, KEY.encode())


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ENV_KV_TRANSFER_KEY, KEY)


def test_producer_leg() -> None:
    assert check_request_params(None, role="producer", prompts=PROMPT, n=1) is None
    wanted = {"do_remote_decode": True}
    assert check_request_params({"do_remote_decode": True}, role="producer", prompts=PROMPT, n=1) == wanted
    both = {"do_remote_decode": True, "do_remote_prefill": False}
    assert check_request_params(both, role="both", prompts=PROMPT, n=1) == wanted


#: The prefill leg's params vLLM's P/D proxies send (its toy proxy; newer ones add the list of
#: requests they aborted on that prefiller).
VLLM_PROXY_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.mark.parametrize(
    "raw",
    [
        VLLM_PROXY_PREFILL,
        {**VLLM_PROXY_PREFILL, "aborted_request": []},
        {**VLLM_PROXY_PREFILL, "aborted_request": ["cmpl-1"]},
        {"do_remote_decode": True, "do_remote_prefill": None},
    ],
    ids=["toy-proxy", "no-aborts", "aborts", "null-prefill"],
)
def test_a_vllm_proxys_prefill_leg_is_a_producer_leg(raw: dict[str, object]) -> None:
    assert check_request_params(raw, role="producer", prompts=PROMPT, n=1) == {"do_remote_decode": True}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"remote_host": "10.0.0.7"}, "kv_transfer_params.remote_host: must be null on a prefill leg"),
        ({"remote_block_ids": [1, 2]}, "kv_transfer_params.remote_block_ids: must be null on a prefill leg"),
        ({"do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill: must be false or null"),
        ({"aborted_request": "cmpl-1"}, "kv_transfer_params.aborted_request: must be a list of request ids"),
        ({"remote_tp_size": 1}, "kv_transfer_params.remote_tp_size: unknown field for a prefill leg"),
    ],
)
def test_a_malformed_prefill_leg_names_its_field(patch: dict[str, object], message: str) -> None:
    with pytest.raises(KVTransferParamsError) as info:
        check_request_params({**VLLM_PROXY_PREFILL, **patch}, role="producer", prompts=PROMPT, n=1)
    assert str(info.value).startswith(message)


def test_consumer_leg_returns_the_verified_params() -> None:
    signed = _signed()
    assert check_request_params(signed, role="consumer", prompts=PROMPT, n=1) == signed


@pytest.mark.parametrize(
    ("raw", "role", "prompts", "n", "message"),
    [
        ({"do_remote_decode": True}, "consumer", PROMPT, 1, "kv_role is 'consumer', not producer"),
        (VLLM_PROXY_PREFILL, "consumer", PROMPT, 1, "kv_role is 'consumer', not producer"),
        ({"do_remote_decode": True}, "producer", PROMPT, 2, "needs exactly one prompt and n=1"),
        (_signed(), "producer", PROMPT, 1, "kv_role is 'producer', not consumer"),
        (_signed(), "none", PROMPT, 1, "kv_role is 'none', not consumer"),
        (_signed(num_tokens=4), "consumer", PROMPT, 1, "num_tokens: 4 != this request's 5 prompt tokens"),
        ({**_signed(), "port": 5601}, "consumer", PROMPT, 1, "signature: does not match"),
        ("params", "consumer", PROMPT, 1, "kv_transfer_params: must be an object"),
    ],
)
def test_refusals(raw: object, role: str, prompts: list[list[int]], n: int, message: str) -> None:
    with pytest.raises(KVTransferParamsError, match=message.replace("(", r"\(")):
        check_request_params(raw, role=role, prompts=prompts, n=n)


def test_no_key_refuses_every_consumer_leg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.ENV_KV_TRANSFER_KEY)
    with pytest.raises(KVTransferParamsError, match="BATON_KV_TRANSFER_KEY unset"):
        check_request_params(_signed(), role="consumer", prompts=PROMPT, n=1)


def test_server_side_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import baton_engine.kv_transfer.request_params, baton_engine.kv_transfer.metrics\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
