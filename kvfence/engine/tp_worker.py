"""A tensor-parallel rank other than 0 (`python -m kvfence.engine.tp_worker`, started by rank 0's
TpLeader): build this rank's slice of the model and KV pool, then run each step rank 0 sends
until its pipe ends, and any RankCall between steps (in a PD role, the KV slices of rank 0's
transfers: the call names the role's function, so this module knows no role).
It holds no scheduler, no tokenizer and no HTTP side; it never samples.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from kvfence.engine.tp_group import RankCall, RankSetup, rank_device, read_frame
from kvfence.engine.tp_runner import FollowerRunner, StepPlan
from kvfence.faults import Faults
from kvfence.kv.pool import KVPool
from kvfence.model.config import ModelConfig
from kvfence.model.loader import TORCH_DTYPES, load_model
from kvfence.model.tp import RankGroup, install_collectives, shard_model
from kvfence.tp_layout import TpLayout

log = logging.getLogger("kvfence.tp")


def run_rank(setup: RankSetup, pipe: object) -> int:
    cfg = setup.cfg
    torch.set_num_threads(setup.threads)
    device = rank_device(cfg.device, setup.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators bind to the current device
    store = dist.FileStore(setup.store_path, cfg.tp_size)
    store.set(f"joining{setup.rank}", "1")  # rank 0's _await_ranks
    group = RankGroup(
        store,
        setup.rank,
        cfg.tp_size,
        device,
        cfg.tp_timeout,
    )
    mc = ModelConfig.from_dir(cfg.model)
    layout = TpLayout.of(mc, setup.rank, cfg.tp_size)
    model = load_model(cfg.model, cfg.dtype, device)
    model.init_rope(setup.context_length, device)
    shard_model(model, layout)
    pool = KVPool(
        num_layers=mc.num_layers,
        num_pages=setup.pool_pages,
        page_size=cfg.page_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=TORCH_DTYPES[setup.kv_cache_dtype],
        device=device,
        poison_on_free=cfg.kv_poison_on_free,
    )
    runner = FollowerRunner(
        model,
        pool,
        device,
        cfg.seed,
        cfg.attention_backend,
        cfg.linear_backend,
        Faults.from_env(),
        group=group,
    )
    install_collectives(model, group, layout)
    store.set(f"built{setup.rank}", "1")  # rank 0's ready(); the plan pipe waits with no bound
    while True:
        plan = read_frame(pipe)  # type: ignore[arg-type]
        if plan is None:
            return 0  # rank 0 closed the pipe (shutdown) or died
        if isinstance(plan, StepPlan):
            runner.step(plan)
        elif isinstance(plan, RankCall):  # a role's work between steps (a PD room's KV slices)
            plan.fn(plan.arg, pool, group)
        else:
            log.error("tensor-parallel rank: unexpected frame %s", type(plan).__name__)
            return 2


def main() -> int:
    # Rank 0 owns this process's life: its pipe ending stops the loop, and rank 0 kills a rank that
    # outstays close(). A SIGTERM or Ctrl-C sent to the node's process group (a rolling restart's
    # drain, `kvfence up` stopping) must reach rank 0 alone, or the ranks die under a drain that
    # still has steps to run and every admitted request fails instead of finishing.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(message)s")
    pipe = sys.stdin.buffer
    setup = read_frame(pipe)
    if not isinstance(setup, RankSetup):
        log.error("tensor-parallel rank: no setup on stdin")
        return 2
    return run_rank(setup, pipe)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except pickle.UnpicklingError:
        sys.exit(2)
