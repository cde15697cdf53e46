"""The CLI is generated from EngineConfig and matches the contract; the metrics doc is complete."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from baton_engine import contract
from baton_engine.cli import build_parser, config_from_args, flag_name
from baton_engine.config import EngineConfig
from tests.server.server_process import BATON_ENGINE

ROOT = Path(__file__).resolve().parents[2]


def _serve_options() -> dict[str, str | None]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return {opt: action.help for action in serve._actions for opt in action.option_strings}


def test_every_contract_flag_is_a_serve_option() -> None:
    options = _serve_options()
    # FLAG_ROUTER_* are the router's flags (baton-router), checked by the router's tests.
    flags = {
        v for k, v in vars(contract).items() if k.startswith("FLAG_") and not k.startswith("FLAG_ROUTER_")
    }
    assert len(flags) >= 26
    assert sorted(flags - set(options)) == []


def test_every_config_field_is_a_flag_with_its_description() -> None:
    options = _serve_options()
    for name, info in EngineConfig.model_fields.items():
        help_text = options[flag_name(name)]
        assert help_text is not None and (info.description or "").replace("%", "%%") in help_text
        if info.annotation is bool:
            assert "--no-" + flag_name(name)[2:] in options


def test_flags_parse_into_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "/m", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--dtype", "float64"]
    )
    config = config_from_args(args)
    assert (config.model, config.max_num_seqs, config.enable_prefix_caching, config.dtype) == (
        "/m",
        8,
        False,
        "float64",
    )
    assert config.max_model_len == EngineConfig().max_model_len  # untouched fields keep defaults


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], message: str) -> None:
    done = subprocess.run([BATON_ENGINE, "serve", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_version() -> None:
    import baton_engine

    done = subprocess.run([BATON_ENGINE, "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"baton-engine {baton_engine.__version__}\n",
        "",
    )


@pytest.mark.parametrize(
    ("model", "line"),
    [
        ("/nonexistent/model", "baton-engine serve: error: --model: model '/nonexistent/model' not found: "
         "expected builtin:<name>, hf:org/name, a directory or a .gguf file"),
        ("builtin:gpt-17", "baton-engine serve: error: --model: unknown builtin model 'gpt-17' "
         "(known: smollm2-135m-instruct)"),
    ],
)  # fmt: skip
def test_a_bad_model_is_one_clear_line(model: str, line: str) -> None:
    done = subprocess.run(
        [BATON_ENGINE, "serve", "--model", model], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(line)


def test_help_documents_flags() -> None:
    done = subprocess.run([BATON_ENGINE, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "--max-queued-requests" in done.stdout and "--shutdown-grace-seconds" in done.stdout
    assert "Waiting requests beyond which new requests get HTTP 429." in " ".join(done.stdout.split())


def test_metrics_doc_maps_every_engine_metric() -> None:
    doc = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    for baton_name, vllm_name in contract.VLLM_EQUIVALENT.items():
        assert f"| `{baton_name}` |" in doc
        assert f"`{vllm_name}`" in doc
