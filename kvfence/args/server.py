"""An HTTP listener's options (serve, router, up): one field of ServerConfig each."""

from __future__ import annotations

from kvfence.args.option import Option, field_options
from kvfence.config import ServerConfig

_server = field_options(ServerConfig)

HOST = _server(("--host",), "host")
PORT = _server(("--port",), "port", type=int)
API_KEY_FILE = _server(
    ("--api-key-file",), "api_key_file", help="lines of `key tenant`; enables auth"
)
LOG_LEVEL = _server(("--log-level",), "log_level")
DRAIN_TIMEOUT = _server(
    ("--drain-timeout",),
    "drain_timeout",
    type=float,
    metavar="SECONDS",
    help="on SIGTERM: admit nothing new and give what is in flight this long to finish; the "
    "rest gets a 503 (a second SIGTERM stops at once)",
)
ADMIN_API_KEY_FILE = _server(
    ("--admin-api-key-file",),
    "admin_api_key_file",
    metavar="FILE",
    help="the operator key (or KVFENCE_ADMIN_API_KEY), separate from tenant keys: it alone "
    "reads /metrics, /pd/info and /health's detail, and signs the router's word to a decode",
)
SERVER_OPTIONS: tuple[Option, ...] = (
    HOST,
    PORT,
    API_KEY_FILE,
    LOG_LEVEL,
    DRAIN_TIMEOUT,
    ADMIN_API_KEY_FILE,
)
# Why the engine process is not the default: ServerConfig.engine_process.
ENGINE_PROCESS = _server(
    ("--engine-process",),
    "engine_process",
    switch=True,
    help="run the engine in a process of its own, as vLLM's EngineCore and SGLang's scheduler "
    "run: the HTTP server never shares the engine's GIL nor maps its KV pool (costs one core's "
    "share of the HTTP work on small hosts)",
)
# Chat answers with tool_choice "auto" are read for calls in this model family's format.
TOOL_CALL_PARSER = _server(
    ("--tool-call-parser",),
    "tool_call_parser",
    choices=("hermes", "qwen", "llama3_json"),
    help="how the model writes tool calls (vLLM's names); needed for tool_choice auto",
)
MAX_TOOL_CALLS = _server(
    ("--max-tool-calls",),
    "max_tool_calls",
    type=int,
    help="the most tool calls one answer may make when parallel_tool_calls is not false "
    "(false: exactly one)",
)
