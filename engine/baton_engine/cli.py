"""``baton-engine serve --model ... [engine flags]``.

Engine flags are generated from `EngineConfig`: each field becomes a kebab-case flag whose help
is the field's description (booleans get ``--x/--no-x``), so the CLI, the config and the flag
names the operator renders (`baton_engine.contract`) cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any, Literal

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from baton_engine import __version__
from baton_engine.config import EngineConfig

DEFAULT_GRACE_SECONDS = 30.0


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _add_field(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, info: FieldInfo) -> None:
    annotation, optional = _unwrap_optional(info.annotation)
    default = info.default
    help_text = (info.description or "").replace("%", "%%")
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        kwargs["help"] = f"{help_text} (default: {'on' if default else 'off'})"
    else:
        if typing.get_origin(annotation) is Literal:
            choices = typing.get_args(annotation)
            kwargs["choices"] = choices
            kwargs["type"] = type(choices[0])
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
        else:
            raise TypeError(f"EngineConfig.{name}: no CLI mapping for {annotation!r}")
        shown = "unset" if default is None and optional else default
        kwargs["help"] = f"{help_text} (default: {shown})"
        kwargs["metavar"] = name.upper() if "choices" not in kwargs else None
    parser.add_argument(flag_name(name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton-engine", description="Baton inference engine.")
    parser.add_argument("--version", action="version", version=f"baton-engine {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="Serve a model over the OpenAI HTTP API.",
        description="Serve a model over the OpenAI HTTP API (one engine pod).",
    )
    engine = serve.add_argument_group("engine", "Engine settings (EngineConfig).")
    for name, info in EngineConfig.model_fields.items():
        _add_field(engine, name, info)
    server = serve.add_argument_group("server process")
    server.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        help="After SIGTERM: how long in-flight requests may take to finish before the server stops "
        f"(default: {DEFAULT_GRACE_SECONDS:g}).",
    )
    server.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="Log verbosity."
    )
    export = commands.add_parser(
        "export",
        help="Write a GGUF model as a Hugging Face folder (config.json, safetensors, tokenizer).",
        description="Write a GGUF model as a Hugging Face folder that vLLM and transformers load: "
        "the weights Baton dequantizes and the tokenizer Baton rebuilds. A re-run on the same "
        "source and dtype keeps the existing folder; any other non-empty folder is refused.",
    )
    export.add_argument(
        "--model", required=True, help="A GGUF model reference (builtin:<name> or a .gguf path)."
    )
    export.add_argument("--output", required=True, help="The folder to write.")
    export.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="Weights dtype (default: float32).",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {name: getattr(args, name) for name in EngineConfig.model_fields if hasattr(args, name)}
    return EngineConfig(**values)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except ValidationError as exc:
            problems = "; ".join(
                f"{flag_name(str(e['loc'][0])) if e['loc'] else 'config'}: {e['msg']}" for e in exc.errors()
            )
            parser.error(problems)
        from baton_engine.model.loader.reference import ModelNotFoundError, resolve_model

        try:  # before anything starts: a wrong --model is one line, not a failed load
            resolve_model(config.model)
        except ModelNotFoundError as exc:
            print(f"baton-engine serve: error: --model: {exc}", file=sys.stderr)
            return 2
        from baton_engine.server.serve import serve

        return serve(config, grace_seconds=args.shutdown_grace_seconds, log_level=args.log_level)
    if args.command == "export":
        from pathlib import Path

        from baton_engine.model.loader.hf_export import ExportError, export_hf_folder
        from baton_engine.model.loader.reference import ModelNotFoundError

        try:
            print(export_hf_folder(args.model, Path(args.output), args.dtype))
        except (ExportError, ModelNotFoundError) as exc:
            parser.error(str(exc))
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
