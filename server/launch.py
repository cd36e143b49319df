"""Building the server from `layerstream serve` flags: the flags (every one can also come from a
LAYERSTREAM_<FLAG> environment variable, e.g. LAYERSTREAM_MAX_DEVICE_MEMORY=4GiB; a flag on the
command line wins), the same flags given as a dict (Ray Serve's `serve run` arguments), and the app
with its engine loop. Both `layerstream serve` (server.cli) and each Ray Serve replica
(server.ray_serve) build their server here, so they serve the same routes; this module imports
neither of them."""

from __future__ import annotations

import argparse
import json
import logging
import os

from engine import EngineArgs
from engine.cli import add_engine_arguments, engine_args_from
from engine.planner import parse_bytes

from .limits import RequestLimits
from .tools import PARSER_CHOICES
from .ray_options import add_ray_arguments

log = logging.getLogger("layerstream.server")

ENV_PREFIX = "LAYERSTREAM_"
_TRUE = ("1", "true", "yes", "on")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [MODEL] [options]"  # as `vllm serve`; argparse would list MODEL after 40 flags
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: MODEL as given)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--tool-call-parser", choices=PARSER_CHOICES, default="auto",
                   help="how the model writes tool calls (vLLM's names): hermes (<tool_call> tags: Qwen, Hermes), "
                        "llama3_json (Llama 3.x bare JSON), mistral ([TOOL_CALLS]); auto: the one the chat template "
                        "teaches")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve over the model (PEFT folders, e.g. `layerstream finetune`'s output), "
                        "as vLLM's: name=path or '{\"name\": ..., \"path\": ...}'; a request's model field picks "
                        "one by name (docs/usage/finetune.md#serving-adapters)")
    p.add_argument("--max-queue", type=int, default=EngineArgs.default("max_queue"),
                   help="requests waiting for a slot (beyond free slots) before new ones get 503 + Retry-After")
    limits = p.add_argument_group("limits (docs/usage/serving.md#limits)")
    limits.add_argument("--max-body-bytes", default=None,
                        help="largest request body, e.g. 8MiB; larger gets 413 before it is read (default: room "
                             "for one prompt of max_model_len tokens, at least 2 MiB)")
    limits.add_argument("--max-prompts", type=int, default=RequestLimits.max_prompts,
                        help="prompts in one /v1/completions request")
    limits.add_argument("--max-n", type=int, default=RequestLimits.max_n, help="largest n (choices per prompt)")
    limits.add_argument("--max-stop", type=int, default=RequestLimits.max_stop, help="stop strings per request")
    limits.add_argument("--max-stop-chars", type=int, default=RequestLimits.max_stop_chars,
                        help="characters per stop string")
    limits.add_argument("--limit-concurrency", type=int, default=512,
                        help="open connections + requests in progress before new ones get 503")
    limits.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open")
    limits.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection may take to send a request's headers before it is closed")
    limits.add_argument("--max-header-bytes", type=int, default=16384,
                        help="request line + headers; larger gets 431")
    limits.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM before their streams are "
                             "ended with an error event")
    add_ray_arguments(p)  # --ray and the replica flags; ray itself is imported only with --ray
    p.epilog = (f"Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG>, e.g. "
                f"{ENV_PREFIX}MAX_DEVICE_MEMORY=4GiB; a flag given on the command line wins.")
    apply_env_defaults(p)


def apply_env_defaults(p: argparse.ArgumentParser) -> None:
    """Turn LAYERSTREAM_<DEST> environment variables into defaults. argparse applies `type` to a
    string default, so the variable is parsed and checked exactly like the flag would be."""
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if value is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
            action.default = value.strip().lower() in _TRUE
        else:
            action.default = value
        # The value is not echoed: it may be a secret (LAYERSTREAM_API_KEY).
        action.help = f"{action.help or ''} [set by {ENV_PREFIX}{action.dest.upper()}]".strip()


def limits_from(ns: argparse.Namespace) -> RequestLimits:
    for flag in ("limit_concurrency", "max_header_bytes"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"{flag} must be >= 1, got {getattr(ns, flag)}")
    for flag in ("timeout_keep_alive", "header_timeout", "shutdown_grace"):
        if not getattr(ns, flag) > 0:
            raise ValueError(f"{flag} must be > 0, got {getattr(ns, flag)}")
    return RequestLimits(max_body_bytes=parse_bytes(ns.max_body_bytes), max_prompts=ns.max_prompts, max_n=ns.max_n,
                         max_stop=ns.max_stop, max_stop_chars=ns.max_stop_chars)


def build_server(ns: argparse.Namespace, on_failed=None):
    """The app and its engine loop (not started) from parsed flags: what `run` serves with uvicorn
    and what each Ray Serve replica (server.ray_serve) wraps, so both serve the same routes."""
    from engine.engine_loop import EngineLoop

    from .app import build_app, check_api_key
    from .metrics import ServerMetrics

    # a bad value: ValueError, one line from main
    args = engine_args_from(ns, max_queue=ns.max_queue, lora_modules=getattr(ns, "lora_modules", None))
    limits = limits_from(ns)
    if ns.api_key:
        check_api_key(ns.api_key)
    name = ns.served_model_name or ns.model
    if name in args.lora_modules:
        raise ValueError(f"--lora-modules: the adapter name {name!r} is the served model's name; choose another")
    metrics = ServerMetrics(name)

    def factory(engine_args):
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(engine_args)
        metrics.set_plan(engine.telemetry().plan)
        if ns.model == "demo" and engine.model.path.suffix != ".gguf":
            log.warning("serving the built-in DEMO model as %r: random weights, output is gibberish; "
                        "it exists for smoke tests. Give one to serve a real model: "
                        "layerstream serve DIR|FILE.gguf|HUB_ID.", name)
        return engine

    engine = EngineLoop(args, observer=metrics, engine_factory=factory, on_failed=on_failed)
    return build_app(engine, name, api_key=ns.api_key or None, metrics=metrics, limits=limits,
                     tool_call_parser=ns.tool_call_parser), engine


def parse_flags(args: dict) -> argparse.Namespace:
    """`serve run` / serveConfigV2 arguments ({"model": "demo", "num_replicas": "2"}) parsed by the
    `layerstream serve` parser, so they are checked (and LAYERSTREAM_* defaults applied) alike."""
    parser = argparse.ArgumentParser(prog="server.ray_serve:app_builder")
    add_arguments(parser)
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    argv, switches = [], {}
    for key, value in args.items():
        action = flags.get(key.replace("-", "_"))
        if action is None or action.dest == "help":
            raise ValueError(f"unknown argument {key!r}: use a `layerstream serve` flag without its dashes, "
                             "e.g. model=demo num_replicas=2")
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            switches[action.dest] = str(value).strip().lower() in _TRUE  # false must beat a LAYERSTREAM_ default
        elif isinstance(value, list):  # a flag of several values (lora_modules: [a=/path, b=/path])
            argv += [action.option_strings[0], *map(str, value)]
        else:  # a dict (speculative_config: {method: ngram} in YAML) goes as the JSON its flag takes
            argv += [action.option_strings[0], json.dumps(value) if isinstance(value, dict) else str(value)]
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed why
        raise ValueError(f"bad arguments {args}") from e
    for dest, on in switches.items():
        setattr(ns, dest, on)
    return ns
