"""The `tandem` command: RL training of Search-R1 search agents, with rollout and training overlapped.

One subcommand per job, each implemented by a `run_*(args) -> int` function in the module that owns
the concept. Modules are imported only when their subcommand runs, so `tandem config show` never
imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import sys

from tandemrl.config.engine import add_engine_flags
from tandemrl.config.schema import ConfigError
from tandemrl.host.files import InputFileError


def _number(kind: type, low: float, high: float = math.inf):
    """An argparse type: a finite `kind` within [low, high] (a server flag's NaN, inf or 0 refused in one
    line by argparse, not met later as a traceback or a server that never answers)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not (math.isfinite(value) and low <= value <= high):
            bound = f"from {low:g} to {high:,.0f}" if math.isfinite(high) else f">= {low:g}"
            word = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"{text!r}: must be {word} {bound}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


MAX_REQUEST_MB = 1_000_000  # a request body limit beyond a TB is no limit


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="YAML config file, e.g. examples/searchr1/config/embedded_cpu_async.yaml"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.rollout_batch_size=64")


def _add_servers(sub) -> None:
    """`serve-retrieval` and `serve-engine`: the two HTTP servers a run launches (or an operator runs)."""
    serve_retrieval = sub.add_parser("serve-retrieval", help="the Search-R1 /retrieve HTTP server")
    serve_retrieval.add_argument("--index", required=True)
    serve_retrieval.add_argument("--host", default="127.0.0.1")
    serve_retrieval.add_argument("--port", type=_number(int, 0, 65535), default=8000)
    serve_retrieval.add_argument("--mode", default=None, choices=["dense", "bm25", "hybrid"])
    serve_retrieval.add_argument(
        "--fusion",
        default="zscore",
        choices=["zscore", "rrf"],
        help="how hybrid merges its dense and BM25 lists (docs/RETRIEVAL.md)",
    )
    serve_retrieval.add_argument("--qdrant-url", default=None)
    serve_retrieval.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /retrieve (default: $TANDEM_RETRIEVAL_API_KEY); "
        "needed when --host is not a loopback address",
    )
    serve_retrieval.add_argument(
        "--max-request-mb",
        type=_number(float, 1e-3, MAX_REQUEST_MB),
        default=4.0,
        help="larger bodies get 413",
    )
    serve_retrieval.add_argument(
        "--num-threads",
        type=_number(int, 0),
        default=0,
        help="cap the BLAS, OpenMP and torch thread pools (0: their default, one thread per core)",
    )
    serve_retrieval.set_defaults(handler="tandemrl.retrieval.server:run_serve")

    serve_engine = sub.add_parser("serve-engine", help="the embedded rollout engine (SGLang HTTP protocol)")
    serve_engine.add_argument("--model", required=True)
    serve_engine.add_argument("--host", default="127.0.0.1")
    serve_engine.add_argument("--port", type=_number(int, 0, 65535), required=True)
    serve_engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    serve_engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve_engine.add_argument("--max-running-requests", type=_number(int, 1), default=64)
    serve_engine.add_argument("--max-context-len", type=_number(int, 1), default=4096)
    serve_engine.add_argument("--seed", type=int, default=0)
    add_engine_flags(serve_engine)  # one flag per rollout.engine key, same name (tandemrl/config/engine.py)
    serve_engine.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every endpoint but /health, as SGLang's --api-key "
        "(default: $TANDEM_ENGINE_API_KEY; prefer the variable: a flag shows in the process list)",
    )
    serve_engine.add_argument(
        "--max-request-mb",
        type=_number(float, 1e-3, MAX_REQUEST_MB),
        default=16.0,
        help="larger bodies get 413",
    )
    serve_engine.add_argument(
        "--health-stall-s",
        type=_number(float, 1e-3),
        default=60.0,
        help="/health answers 503 once the engine loop is stuck this long in one step or command",
    )
    serve_engine.add_argument(
        "--weight-update-timeout-s",
        type=_number(float, 1e-3),
        default=600.0,
        help="a weight-group join or an announced update whose tensors do not arrive in time is aborted",
    )
    serve_engine.set_defaults(handler="tandemrl.engine.server:run_serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n")[0])  # one whole sentence
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="inspect a configuration").add_subparsers(
        dest="action", required=True
    )
    show = config.add_parser("show", help="print the resolved configuration, derived values marked")
    _add_config_args(show)
    show.add_argument(
        "--check",
        action="store_true",
        help="also run every check `tandem train` makes before it starts a service: the data files read "
        "whole, the retrieval index, the model directory, placeholder paths",
    )
    show.set_defaults(handler="tandemrl.commands.show:run_show")

    train = sub.add_parser("train", help="RL training (sync or async runner)")
    _add_config_args(train)
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the placement plan (each process with its node and GPUs), the derived limits and the "
        "weight-sync route, then exit without starting anything",
    )
    train.set_defaults(handler="tandemrl.commands.train:run_train")

    demo = sub.add_parser("demo", help="prepare the embedded defaults and run a short async training on them")
    demo.add_argument(
        "--cold-start",
        default="auto",
        choices=["auto", "always", "never"],
        help="the small SFT before RL: auto runs it when $TANDEM_HOME's coldstart model is missing, "
        "always redoes it, never trains the base SmolLM2 (whose reward is all zeros)",
    )
    demo.add_argument("overrides", nargs="*")
    demo.set_defaults(handler="tandemrl.commands.demo:run_demo")

    sft = sub.add_parser("sft", help="supervised cold start on knowledge-base demonstrations")
    _add_config_args(sft)
    sft.set_defaults(handler="tandemrl.commands.sft:run_sft")

    evaluate = sub.add_parser("eval", help="greedy evaluation: EM per data source")
    _add_config_args(evaluate)
    evaluate.add_argument("--split", default="test", choices=["train", "val", "test"])
    evaluate.add_argument("--limit", type=int, default=None)
    evaluate.add_argument("--out", default=None, help="jsonl of trajectories (default: next to the run)")
    evaluate.set_defaults(handler="tandemrl.commands.evaluate:run_eval")

    export = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face directory")
    export.add_argument("checkpoint")
    export.add_argument("--out", required=True)
    export.set_defaults(handler="tandemrl.trainer.export:run_export")

    plot = sub.add_parser(
        "plot",
        help="overlay runs' logs as PNGs (step time, reward, ratio, staleness, val EM, searches; per source)",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runner.output_dir of each run")
    plot.add_argument("--out", default="tandem_plots", help="folder for the PNGs (default: ./tandem_plots)")
    plot.set_defaults(handler="tandemrl.metrics.plots:run_plot")

    prepare = sub.add_parser("prepare", help="prepare the embedded defaults").add_subparsers(
        dest="what", required=True
    )
    for what, helptext in (
        ("model", "SmolLM2 HF directory"),
        ("retriever", "MiniLM retriever"),
        ("all", "model, retriever, knowledge base and index"),
    ):
        p = prepare.add_parser(what, help=helptext)
        p.set_defaults(handler=f"tandemrl.commands.prepare:run_prepare_{what}")
    kb = prepare.add_parser("kb", help="generate a knowledge base with questions")
    kb.add_argument("--seed", type=int, default=0)
    kb.add_argument("--num-entities", type=int, default=5000)
    kb.add_argument("--out", required=True)
    kb.set_defaults(handler="tandemrl.commands.prepare:run_prepare_kb")

    index = sub.add_parser("index", help="retrieval index").add_subparsers(dest="action", required=True)
    build = index.add_parser("build", help="encode a corpus into Qdrant")
    build.add_argument("--corpus", required=True)
    build.add_argument("--index", required=True)
    build.add_argument("--encoder", default="minilm", help="minilm | e5 | a sentence-transformers directory")
    build.add_argument("--sparse", default=None, choices=["bm25"])
    build.add_argument("--qdrant-url", default=None)
    build.add_argument("--batch-size", type=int, default=256)
    build.set_defaults(handler="tandemrl.retrieval.build:run_build")

    _add_servers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `tandem` command; `argv` None: this process is the command (not a caller's), so a second
    Ctrl-C may end it whatever it waits on (runner/exit_guard.py)."""
    if argv is None:
        from tandemrl.runner import exit_guard

        exit_guard.enable()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after a flag (`train CONFIG --dry-run a=1`): argparse leaves them over
        if getattr(args, "overrides", None) is None or any(item.startswith("-") for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    module_name, func_name = args.handler.split(":")
    try:
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except ConfigError as error:
        print(f"tandem: configuration error: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as error:
        print(f"tandem: {error}", file=sys.stderr)
        return 2
    except InputFileError as error:  # a data or log file the user named: the message names file and line
        print(f"tandem {args.command}: {error}", file=sys.stderr)
        return 2
    # `tandem train` reports its own (commands/train.py); the others have unwound their services
    except KeyboardInterrupt:
        from tandemrl.runner import exit_guard

        print(f"tandem {args.command}: interrupted; what it started is stopped.", file=sys.stderr)
        exit_guard.arm(130, exit_guard.STILL_RUNNING)
        return 130


if __name__ == "__main__":
    sys.exit(main())
