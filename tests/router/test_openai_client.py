"""The official openai client talks to the router (fake engine legs behind it)."""

from __future__ import annotations

import openai
import pytest


def test_openai_client_streams_and_sees_api_errors(start_engine, start_router) -> None:
    _, prefill_url = start_engine("p0")
    decode, decode_url = start_engine("d0", chunks=4)
    router = start_router(prefill=[prefill_url], decode=[decode_url], api_key="k1")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k1", max_retries=0)

    stream = client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, stream=True)
    texts = [chunk.choices[0].text for chunk in stream]

    assert texts == ["t0", "t1", "t2", "t3"]
    assert decode.posts()[0].body["stream"] is True
    with pytest.raises(openai.AuthenticationError) as denied:
        openai.OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert denied.value.code == "invalid_api_key"
    assert [m.id for m in client.models.list()] == ["smollm2"]
