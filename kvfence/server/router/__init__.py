"""The PD router: the OpenAI entry point in front of prefill/decode workers. `workers`: the pools,
least-loaded picks and I7 pairing facts; `state`: shared state and the health poll; `relay`: one
request's trip to a decode and back; `app`: the routes and auth at the first door; `metrics`;
`args`: settings and flags; `launch`: the `kvfence router` command."""

from kvfence.server.hop import HEADER_PREFILL
from kvfence.server.router.app import build_router_app
from kvfence.server.router.args import RouterSettings, add_router_args
from kvfence.server.router.launch import main, run_router
from kvfence.server.router.state import RouterState
from kvfence.server.router.workers import Role, Worker, WorkerPool, normalize_url

__all__ = [
    "HEADER_PREFILL",
    "Role",
    "RouterSettings",
    "RouterState",
    "Worker",
    "WorkerPool",
    "add_router_args",
    "build_router_app",
    "main",
    "normalize_url",
    "run_router",
]
