"""Memory worker: every optimizer's state per rank on FSDP2 and ZeRO-2 at this world size, measured from the
tensors it really holds after two steps, against the single-process state of the same model.

A small LLaMA-like model (4 blocks of q/k/v/o and a SwiGLU MLP, hidden 64, vocabulary 16x the hidden size:
LLaMA-7B has 7.8x, LLaMA-60M 62x) so that parameters, not per-row/column vectors, carry the state as in real
models: RACS and DASGO keep their O(m + n) row/column statistics on every rank by design (a rank that holds
rows of a matrix touches all of its columns, so it needs the whole column vector at every step). SUMO and Alice run at
rank 8 (their state is low-rank, as in real use). Each record: bytes per rank, the planner's prediction per rank
(``planned_state_elements``, which the scale benchmark relies on), and the single-process bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import toy_models  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402
from shardopt.optim.registry import OPTIMIZERS  # noqa: E402

LM = toy_models.LMSetup(1024, 64, 176, 4, 8, 4)  # vocab, dim, ffn, blocks, seq, batch
BATCH = LM.batch_size
WHOLE_MATRIX = ("swan", "asgo", "sumo", "alice", "alice0")
EXTRA = {"sumo": {"rank": 8}, "alice": {"rank": 8, "leading": 4}, "alice0": {"rank": 8, "leading": 4}}


def state_bytes(opt) -> int:
    """Bytes of every state tensor this rank holds (DTensor: its local shard)."""
    total = 0

    def walk(v):
        nonlocal total
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()

    for st in opt.state.values():
        for k, v in st.items():
            if k != "step":
                walk(v)
    return total


def kwargs(name: str, strategy: str | None) -> dict:
    kw = dict(EXTRA.get(name, {}))
    if strategy:
        kw["matrix_ops"] = {"strategy": strategy, **({"team_size": 2} if strategy == "team" else {})}
    return kw


def single_process_bytes(name: str) -> int:
    torch.manual_seed(0)
    model = LM.model()
    opt = shardopt.create_optimizer(model, name, **kwargs(name, None))
    for s in range(2):
        opt.zero_grad()
        LM.loss(model, LM.batch(s)).backward()
        opt.step()
    return state_bytes(opt)


def sharded(name: str, engine: str, strategy: str | None) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = LM.model()
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = shardopt.create_optimizer(model, name, **kwargs(name, strategy))
        for s in range(2):
            opt.zero_grad()
            LM.loss(model, LM.batch(s)).backward()
            opt.step()
    else:
        kw = kwargs(name, strategy)
        config = {
            "train_batch_size": BATCH * dist.get_world_size(),
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "shardopt": {"optimizer": name, "params": kw},
        }
        eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
        opt = eng.optimizer.optimizer
        for s in range(2):
            loss = LM.loss(eng, LM.batch(s))
            eng.backward(loss)
            eng.step()
    planned = sum(opt.planned_state_elements().values()) * 4
    return state_bytes(opt), planned, written_bytes(opt)


def written_bytes(opt) -> int:
    """Bytes of the checkpoint files this rank wrote: its own pieces only (rank 0: the main file)."""
    import glob
    import tempfile

    import shardopt.checkpoint as ckpt

    root = [tempfile.mkdtemp(prefix="shardopt-mem-")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(root, src=0)
    main = ckpt.save(root[0], opt)
    mine = glob.glob(os.path.join(root[0], f"*.r{dist.get_rank():05d}.*.safetensors"))
    if dist.get_rank() == 0:
        mine.append(main)
    size = sum(os.path.getsize(f) for f in mine)
    dist.barrier()
    return size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    records = []
    for name in OPTIMIZERS:
        single = single_process_bytes(name)
        for engine in ("fsdp2", "zero2"):
            for strategy in ("gather", "distributed", "team") if name in WHOLE_MATRIX else (None,):
                rec = {"optimizer": name, "engine": engine, "strategy": strategy, "single": single}
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        result = sharded(name, engine, strategy)
                    got: list = [None] * dist.get_world_size()
                    dist.all_gather_object(got, result)
                    rec["per_rank"] = [g[0] for g in got]
                    rec["planned"] = [g[1] for g in got]
                    rec["written"] = [g[2] for g in got]
                    rec["params"] = sum(p.numel() for p in LM.model().parameters()) * 4
                except Exception:
                    rec["error"] = traceback.format_exc()
                records.append(rec)
                dist.barrier()
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
