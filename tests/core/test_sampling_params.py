from __future__ import annotations

import pytest

from baton_engine.core.sampling_params import SamplingParams


def test_defaults_and_normalisation() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[5, 6])  # type: ignore[arg-type]
    assert params.stop == ("END",)
    assert params.stop_token_ids == (5, 6)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1
    assert params.max_tokens == 16 and params.n == 1 and params.logprobs is None
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=20, n=16, seed=0, top_k=0).logprobs == 20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be a finite number in \[0, 10000\], got -0\.1"),
        ({"temperature": float("nan")}, r"temperature must be a finite number in \[0, 10000\], got nan"),
        ({"temperature": True}, r"temperature must be a finite number in \[0, 10000\], got True"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k must be an integer in \[-1, 2147483647\] \(-1 or 0 disables it\), got -2"),
        ({"top_k": 1.5}, r"top_k must be an integer in \[-1, 2147483647\] \(-1 or 0 disables it\), got 1\.5"),
        ({"max_tokens": 0}, r"max_tokens must be an integer in \[1, 2147483647\], got 0"),
        ({"stop": ["ok", 3]}, "stop must be a string or a list of strings"),
        ({"stop": [""]}, "stop must not contain empty strings"),
        (
            {"stop_token_ids": [1, -1]},
            r"stop_token_ids must be a list of integers in \[0, 2147483647\], got \(1, -1\)",
        ),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*63\)"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\]"),
        ({"n": 0}, r"n must be an integer in \[1, 16\]"),
        ({"n": 17}, r"n must be an integer in \[1, 16\]"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
