"""Crash and resume under torchrun: rank 1 SIGKILLs itself mid-training on the first attempt; torchrun
(--max-restarts 1) restarts every worker, which resume from the last checkpoint (FSDP2 + DCP, written every
2 steps) and finish. Rank 0 writes the final parameters and the step it resumed from.

Each attempt builds its process group on a fresh TCPStore: with torchelastic's shared agent store, process
groups created after a restart (device meshes, DeepSpeed's data-parallel group) read the dead attempt's keys
and hang or fail to connect (observed with torch 2.13 + gloo; see docs/reliability.md, "Restarts under torchrun",
which also says why the trainer agrees on the attempt through the store instead: the restart count is per node)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import OPTIMIZERS, local_batch  # noqa: E402
from toy_models import loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402

TOTAL, EVERY, KILL_AT = 8, 2, 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--optimizer", default="racs")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A fresh TCPStore per attempt (hosted by rank 0): with torchelastic's agent store, sub-groups created in
    # the restarted attempt (device mesh, DeepSpeed) find the dead attempt's keys and hang or fail to connect.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]) + 1 + attempt,
        world,
        is_master=rank == 0,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    import torch.distributed.checkpoint as dcp
    from reliability_worker import fsdp2
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fsdp2(make_model())
    opt = shardopt.create_optimizer(model, args.optimizer, **OPTIMIZERS[args.optimizer])
    latest = os.path.join(args.dir, "latest")
    start = 0
    if os.path.isfile(latest):
        start = int(open(latest).read())
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(args.dir, f"step{start}"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for s in range(start, TOTAL):
        if attempt == 0 and s == KILL_AT and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss_fn(model, local_batch(s)).backward()
        opt.step()
        if (s + 1) % EVERY == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(args.dir, f"step{s + 1}"))
            if dist.get_rank() == 0:  # publish only complete checkpoints
                with open(latest + ".tmp", "w") as f:
                    f.write(str(s + 1))
                os.replace(latest + ".tmp", latest)
            dist.barrier()
    params = {n: p.full_tensor().detach().tolist() for n, p in model.named_parameters()}
    # finish_worker: the ranks meet before the group goes. Rank 1, with nothing to write, used to reach the
    # interpreter's exit while gloo's worker thread still released the last gather's tensors; that release takes
    # the GIL, which a finalizing interpreter refuses by ending the thread, and libstdc++ then aborts the process
    # ("terminate called without an active exception"; from a core dump; about 1 run in 10 under load).
    del model, opt
    finish_worker({"attempt": attempt, "resumed_from": start, "params": params}, os.path.join(args.dir, "result.json"))


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
