"""``tokenloom serve``'s arguments: vLLM's flag names (catalogued in :mod:`tokenloom.api.flags`)
and a ``--config`` YAML file, parsed and routed onto the engine's arguments and the server's
config (:func:`parse_serve_args`), and the plugin names the flags choose, checked against the
registries before anything loads (:func:`check_plugin_choices`).

Imports nothing heavy at module level: ``tokenloom serve --help`` must answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from tokenloom.api import flags as catalogue
from tokenloom.api.flags import CLI, CPU_NOOP, ENGINE, FLAG_BY_KEY, FLAG_BY_NAME, FLAGS, NOOP, UNIMPLEMENTED, Flag
from tokenloom.api.server_config import ServerConfig
from tokenloom.api.tracing import check_tracing_options
from tokenloom.errors import ConfigError, NotImplementedFlagError

if TYPE_CHECKING:
    from tokenloom.core.config import EngineArgs
    from tokenloom.plugins.manager import PluginSet

DEFAULT_MODEL = "smollm2"
API_KEY_ENV = "TOKENLOOM_API_KEY"
# the log level of tokenloom's loggers (the server reads it); DEBUG also prints start-up tracebacks
LOGGING_LEVEL_ENV = "TOKENLOOM_LOGGING_LEVEL"


@dataclass
class ServeArgs:
    """What ``tokenloom serve`` parsed: the engine's arguments and the server's config.
    ``run_server`` logs ``warnings`` (flags accepted but ignored) once logging is set up."""

    engine_args: EngineArgs
    server: ServerConfig
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the EngineArgs keyword arguments
    warnings: list[str] = field(default_factory=list)
    plugins: PluginSet | None = None  # once the serve command has loaded plugins
    plugins_load_seconds: float | None = None  # how long that took (run_server logs it)


def parse_serve_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServeArgs:
    """Parse ``tokenloom serve`` flags (and a ``--config`` file); raise ConfigError (exit 2)
    for anything wrong, NotImplementedFlagError for a vLLM flag tokenloom does not implement."""
    from tokenloom.core.config import EngineArgs

    environ = os.environ if environ is None else environ
    parser = _serve_parser()
    cli_values, positionals = _parse_tokens(parser, _normalize_tokens(list(argv)), "")
    config_values: dict[str, Any] = {}
    config_path = cli_values.pop("config", None)
    if config_path is not None:
        source = f"config file {config_path}: "
        config_values, extra = _parse_tokens(parser, _config_file_tokens(config_path), source)
        if extra:
            raise ConfigError(f"{source}unexpected value {extra[0]!r}", param="config")

    warnings: list[str] = []
    routed: dict[tuple[str, str], Any] = {}
    for values in (config_values, cli_values):  # the command line wins over the file
        routed.update(_route(values, warnings))
    engine_kwargs = {dest: value for (to, dest), value in routed.items() if to == ENGINE}
    server_kwargs = {dest: value for (to, dest), value in routed.items() if to != ENGINE}

    if len(positionals) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(positionals[1:])} (give one MODEL)")
    if positionals:
        if "model" in cli_values and cli_values["model"] != positionals[0]:
            raise ConfigError(
                f"the model is given twice: {positionals[0]!r} and --model {cli_values['model']!r}", param="model"
            )
        engine_kwargs["model"] = positionals[0]
    engine_kwargs.setdefault("model", DEFAULT_MODEL)
    if "api_key" not in server_kwargs and environ.get(API_KEY_ENV):
        server_kwargs["api_key"] = [environ[API_KEY_ENV]]
    _check_combinations({**config_values, **cli_values}, engine_kwargs, server_kwargs)
    if "data_parallel_rank" in engine_kwargs:
        engine_kwargs["data_parallel_external_lb"] = True  # vLLM: a rank given is external load balancing

    engine_args = EngineArgs(**engine_kwargs)
    engine_args.create_engine_config()  # value checks that need no model files, before anything loads
    check_tracing_options(
        server_kwargs.get("otlp_traces_endpoint"), server_kwargs.get("collect_detailed_traces"), environ
    )
    return ServeArgs(engine_args, ServerConfig(**server_kwargs), engine_kwargs, list(dict.fromkeys(warnings)))


def check_plugin_choices(serve_args: ServeArgs) -> None:
    """Before the model loads: the names the flags choose exist in the loaded registries
    (UnknownNameError lists the known ones), and every target the server will use -- those
    names, every API route and model source, every ``--middleware`` -- imports (a PluginError
    or ConfigError naming the plugin and the name), so that a typo in a ``"module:Class"``
    string fails the start at once rather than a minute in, once the model has loaded."""
    engine, server, plugins = serve_args.engine_kwargs, serve_args.server, serve_args.plugins
    if plugins is None:  # a caller's mistake: the serve command loads them first
        raise RuntimeError("check_plugin_choices needs the loaded plugins in serve_args.plugins")
    backend = engine.get("guided_decoding_backend")
    chosen = [
        ("tool_parser", server.tool_call_parser, None),
        ("reasoning_parser", engine.get("reasoning_parser"), None),
        ("load_format", engine.get("load_format"), "auto"),
        ("quantization", engine.get("quantization"), None),
        ("platform", engine.get("device"), "auto"),
        ("executor", engine.get("distributed_executor_backend"), None),
        # vLLM's option syntax, "xgrammar:disable-any-whitespace", names the backend first
        ("structured_output_backend", backend.split(":")[0] if backend else None, "auto"),
        ("proposer", (engine.get("speculative_config") or {}).get("method"), None),
    ]
    entries = [
        plugins.registry(kind).entry(name) for kind, name, automatic in chosen if name is not None and name != automatic
    ]
    for kind in ("api_route", "model_source"):  # every one of these is used
        entries += plugins.registry(kind).entries()
    for entry in entries:
        entry.resolve()
    if server.middleware:
        from tokenloom.api.middleware import import_object

        for path in server.middleware:
            import_object(path, "--middleware")


def _check_combinations(given: dict[str, Any], engine: dict[str, Any], server: dict[str, Any]) -> None:
    nnodes, node_rank = engine.get("nnodes", 1), engine.get("node_rank", 0)
    if nnodes > 1 and node_rank > 0 and not server.get("headless"):
        raise ConfigError(
            f"--node-rank {node_rank} runs this node's share of the workers of node 0's engine: add --headless "
            "(only node 0 serves the API)",
            param="node-rank",
        )
    if server.get("headless") and nnodes > 1:
        if node_rank == 0:
            raise ConfigError(
                "--headless with --nnodes runs a node's workers for node 0's engine: give this node's "
                "--node-rank (1 or more), or leave out --headless on node 0",
                param="headless",
            )
    elif server.get("headless"):
        size, local = engine.get("data_parallel_size", 1), engine.get("data_parallel_size_local")
        if size < 2 or local is None or not engine.get("data_parallel_address") or "data_parallel_rank" in engine:
            raise ConfigError(
                "--headless runs this node's share of a head node's engines: of a data-parallel group (give "
                "-dp N for the whole group, --data-parallel-size-local L for the replicas here, "
                "--data-parallel-start-rank R for the first one's rank and --data-parallel-address HEAD), or "
                "of one engine's workers (give --nnodes N, --node-rank R and --master-addr HEAD)",
                param="headless",
            )
        if engine.get("data_parallel_hybrid_lb") or engine.get("data_parallel_backend", "mp") != "mp":
            raise ConfigError(
                "--headless serves a head node's API server over the mp backend: leave out "
                "--data-parallel-hybrid-lb and --data-parallel-backend ray",
                param="headless",
            )
    if given.get("enable_reasoning") and not engine.get("reasoning_parser"):
        raise ConfigError(
            "--enable-reasoning needs --reasoning-parser NAME (which alone enables reasoning)", param="enable-reasoning"
        )
    if given.get("disable_log_requests") and server.get("enable_log_requests"):
        raise ConfigError(
            "--enable-log-requests and --disable-log-requests (its deprecated opposite) contradict; give one",
            param="disable-log-requests",
        )
    if server.get("enable_auto_tool_choice") and not server.get("tool_call_parser"):
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME", param="tool-call-parser")
    port = server.get("port")
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--port: must be in 0..65535, got {port}", param="port")


def _route(values: dict[str, Any], warnings: list[str]) -> dict[tuple[str, str], Any]:
    """Given flags (by key) -> {(engine|server, field): value}; warns for no-ops, rejects the
    unimplemented, and rejects two flags that set one field to different values."""
    routed: dict[tuple[str, str], Any] = {}
    setters: dict[tuple[str, str], Flag] = {}
    speculative: dict[str, Any] = {}  # --speculative-config keys, from the JSON and the older flags
    speculative_setters: dict[str, str] = {}

    def put(slot: tuple[str, str], value: Any, flag: Flag) -> None:
        if slot in routed and routed[slot] != value:
            raise ConfigError(
                f"{setters[slot].name} and {flag.name} set {slot[1]} to different values; give one", param=flag.name[2:]
            )
        routed[slot], setters[slot] = value, flag

    for key, value in values.items():
        flag = FLAG_BY_KEY[key]
        if flag.status == UNIMPLEMENTED:
            if value != flag.default:
                raise NotImplementedFlagError(_unimplemented_message(flag), param=flag.name[2:])
            continue
        if flag.status == CPU_NOOP:
            warnings.append(f"{flag.name} has no meaning on the CPU ({flag.note}); ignored")
            continue
        if flag.status == NOOP:
            warnings.append(f"{flag.name} has no effect in tokenloom ({flag.note}); ignored")
            continue
        if flag.note:
            warnings.append(f"{flag.name}: {flag.note}")
        if flag.key == "structured_outputs_config":
            for option, option_value in value.items():
                if option not in catalogue.STRUCTURED_OUTPUTS_KEYS:
                    raise ConfigError(
                        f"--structured-outputs-config: unknown key {option!r}; known: "
                        + ", ".join(catalogue.STRUCTURED_OUTPUTS_KEYS),
                        param="structured-outputs-config",
                    )
                if option_value not in ("", None):  # vLLM writes "no reasoning parser" as ""
                    put((ENGINE, catalogue.STRUCTURED_OUTPUTS_KEYS[option]), option_value, flag)
            continue
        if flag.key == "speculative_config" or flag.key in catalogue.SPECULATIVE_FLAG_KEYS:
            options = value if flag.key == "speculative_config" else {catalogue.SPECULATIVE_FLAG_KEYS[flag.key]: value}
            if options.get("model") == "[ngram]":  # vLLM's older spelling of the n-gram method
                options = {**{k: v for k, v in options.items() if k != "model"}, "method": "ngram"}
            for option, option_value in options.items():
                if option in speculative and speculative[option] != option_value:
                    raise ConfigError(
                        f"{speculative_setters[option]} and {flag.name} set the speculative {option} to "
                        "different values; give one",
                        param=flag.name[2:],
                    )
                speculative[option], speculative_setters[option] = option_value, flag.name
            continue
        if flag.key == "kv_events_config":  # checked key by key by KVEventsConfig.from_dict
            put((ENGINE, "kv_events_config"), value, flag)
            continue
        if flag.key == "kv_transfer_config":  # checked key by key by KVTransferConfig.from_dict
            put((ENGINE, "kv_transfer_config"), value, flag)
            continue
        if flag.to == CLI:
            continue
        if flag.const is not None:
            if not value:
                continue
            value = flag.const
        put((flag.to, flag.dest or flag.key), value, flag)  # implemented() gives every flag a dest
    if speculative.get("disable_logprobs") is True:
        # read by nothing: the logprobs a request asks for are returned while speculating too
        note = FLAG_BY_NAME["--disable-logprobs-during-spec-decoding"].note
        warnings.append(f"--speculative-config: disable_logprobs has no effect in tokenloom ({note}); ignored")
    if speculative:
        routed[(ENGINE, "speculative_config")] = speculative
    return routed


def _unimplemented_message(flag: Flag) -> str:
    message = f"tokenloom does not implement {flag.name} yet"
    if flag.default not in (None, False, ""):
        message += f" (only its default, {flag.name} {format_value(flag.default)}, is accepted)"
    return message + (f"; {flag.note}" if flag.note else "; remove it")


# -- argument parsing -------------------------------------------------------------------------


class ConfigErrorParser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


class _MergeJsonAction(argparse.Action):
    """A JSON flag given more than once (or in vLLM's dotted form) merges its objects."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        value: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        existing = getattr(namespace, self.dest, None)
        if isinstance(existing, dict) and isinstance(value, dict):
            value = _deep_merge(existing, value)
        setattr(namespace, self.dest, value)


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        both_objects = isinstance(merged.get(key), dict) and isinstance(value, dict)
        merged[key] = _deep_merge(merged[key], value) if both_objects else value
    return merged


@functools.cache
def _serve_parser() -> ConfigErrorParser:
    parser = ConfigErrorParser(
        prog="tokenloom serve",
        usage="tokenloom serve [MODEL] [flags]",
        add_help=False,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("model_tag", nargs="?", default=None)
    for flag in FLAGS:
        if flag.kind == "bool":
            # _normalize_tokens has turned `--flag false` / `--flag=no` into --no-flag
            parser.add_argument(flag.name, *flag.aliases, dest=flag.key, action="store_const", const=True)
            if flag.negatable:
                parser.add_argument("--no-" + flag.name[2:], dest=flag.key, action="store_const", const=False)
            continue
        options: dict[str, Any] = {"dest": flag.key, "type": flag.converter(), "metavar": flag.key.upper()}
        if flag.choices:
            options["choices"] = flag.choices
        if flag.repeat:
            options["action"] = "append"
        elif flag.kind in catalogue.JSON_KINDS:
            options["action"] = _MergeJsonAction
        if flag.nargs:
            options["nargs"] = flag.nargs
            if flag.nargs == "?":
                options["const"] = True  # given without a value
        parser.add_argument(flag.name, *flag.aliases, **options)
    return parser


def _parse_tokens(parser: ConfigErrorParser, tokens: list[str], source: str) -> tuple[dict[str, Any], list[str]]:
    """Flag values by key (only the flags given) and the positional arguments."""
    try:
        namespace, extra = parser.parse_known_args(tokens)
    except ConfigError as exc:
        raise ConfigError(source + str(exc)) from None
    for token in extra:
        if token.startswith("-") and len(token) > 1:
            option = token.split("=", 1)[0]
            known = sorted({name for flag in FLAGS for name in flag.option_strings})
            hint = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
            raise ConfigError(
                f"{source}unrecognized argument: {option}"
                + (f"; did you mean {hint[0]}?" if hint else "; see tokenloom serve --help"),
                param=option.lstrip("-"),
            )
    values = vars(namespace)
    model_tag = values.pop("model_tag", None)
    positionals = ([model_tag] if model_tag is not None else []) + [token for token in extra if token != "--"]
    return values, positionals


def _normalize_tokens(tokens: list[str]) -> list[str]:
    """Rewrite vLLM's other spellings into what the parser takes: ``--flag true|false`` and
    ``--flag=false`` for booleans, and the dotted JSON form ``--hf-overrides.key value``
    (``key+`` appends to a list)."""
    normalized: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if token == "--":
            normalized.extend(tokens[index - 1 :])
            break
        if not token.startswith("-"):
            normalized.append(token)
            continue
        name, has_inline, inline = token.partition("=")
        base, dot, path = name.partition(".")
        if base.startswith("--"):  # vLLM takes --max_model_len for --max-model-len
            base = base.replace("_", "-")
            name = base + dot + path
            token = name + has_inline + inline
        flag = FLAG_BY_NAME.get(base)
        if flag is not None and dot and path and flag.kind in catalogue.JSON_KINDS:
            if not has_inline:
                if index >= len(tokens):
                    raise ConfigError(f"{name} needs a value", param=flag.name[2:])
                inline, index = tokens[index], index + 1
            _set_dotted(dotted.setdefault(flag.name, {}), path, inline, name)
            continue
        flag = FLAG_BY_NAME.get(name)
        if flag is None or flag.kind != "bool":
            normalized.append(token)
            continue
        truth = True
        if has_inline:
            truth = _bool_value(inline, name)
        elif index < len(tokens) and tokens[index].lower() in ("true", "false"):
            truth, index = tokens[index].lower() == "true", index + 1
        if name.startswith("--no-") and name not in (flag.name, *flag.aliases):
            truth = not truth
        if truth:
            normalized.append(flag.name)
        elif flag.negatable:
            normalized.append("--no-" + flag.name[2:])
        # a false value of a flag without --no-: its default, nothing to pass
    for name, value in dotted.items():
        normalized.extend([name, json.dumps(value)])
    return normalized


def _bool_value(text: str, option: str) -> bool:
    try:
        return catalogue.parse_bool(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"argument {option}: {exc}", param=option.lstrip("-")) from None


def _set_dotted(target: dict[str, Any], path: str, text: str, option: str) -> None:
    keys = path.split(".")
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{option}: {key!r} is set both as a value and as an object", param=option.lstrip("-"))
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text  # a bare word is a string
    last = keys[-1]
    if last.endswith("+"):  # vLLM's list form: key+ value, or key+=a,b
        items = text.split(",") if isinstance(value, str) else [value]
        target.setdefault(last[:-1], []).extend(items)
    else:
        target[last] = value


def _config_file_tokens(path: str) -> list[str]:
    """A YAML config file as command-line tokens, so its values go through the same checks."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}", param="config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}", param="config") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values", param="config")
    tokens: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        flag = FLAG_BY_NAME.get(name)
        if flag is None or name != flag.name or flag.key == "config":
            known = [f.name[2:] for f in FLAGS if f.key != "config"]
            hint = difflib.get_close_matches(str(key).replace("_", "-"), known, n=1, cutoff=0.6)
            raise ConfigError(
                f"config file {path}: unknown key {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""),
                param="config",
            )
        tokens.extend(_value_tokens(flag, value, path))
    return tokens


def _value_tokens(flag: Flag, value: Any, path: str) -> list[str]:
    if value is None:
        return []
    if flag.kind == "bool":
        truth = value if isinstance(value, bool) else _bool_value(str(value), f"{flag.name} in {path}")
        return [flag.name if truth else "--no-" + flag.name[2:]] if (truth or flag.negatable) else []
    if isinstance(value, dict):
        return [flag.name, json.dumps(value)]
    if isinstance(value, list):
        if flag.repeat:
            return [token for item in value for token in (flag.name, str(item))]
        if flag.nargs == "+":
            return [flag.name, *map(str, value)]
        if flag.kind == "strlist":
            return [flag.name, json.dumps(value)]
        raise ConfigError(f"config file {path}: {flag.name[2:]} takes one value, got a list", param="config")
    return [flag.name, str(value)]


def format_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
