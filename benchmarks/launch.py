"""Run a benchmark module under ``torch.distributed.run`` on CPU/gloo and collect what its ranks report.

A distributed benchmark is one module with two halves: the launcher (``main``) calls ``run_workers`` for
each world size; the worker half (the same module with ``--worker``) calls ``init_worker`` and, at the end,
``finish_worker`` to hand its per-rank records back through a JSON file written by rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from typing import Any

from .results import REPO_ROOT

__all__ = ["run_workers", "init_worker", "finish_worker", "gather"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(module: str, nproc: int, args: list[str], timeout: float = 1800) -> list[dict[str, Any]]:
    """Launch ``python -m <module> --worker --out FILE <args>`` on ``nproc`` processes; return rank 0's records.

    Raises ``RuntimeError`` with the tail of the workers' output when they fail or time out."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            "-m",
            module,
            "--worker",
            "--out",
            out,
            *args,
        ]
        try:
            proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{module} at world size {nproc} timed out after {timeout:.0f}s") from exc
        if proc.returncode != 0 or not os.path.isfile(out):
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"{module} at world size {nproc} failed (exit {proc.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


def init_worker(timeout_s: float = 600) -> tuple[int, int]:
    """The default gloo group from torchrun's environment; DeepSpeed kept quiet. Returns (rank, world)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
    except ImportError:
        pass
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def finish_worker(records: list[dict[str, Any]], out: str) -> None:
    """Rank 0 writes ``records`` (already gathered) to ``out``; then the group is torn down."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(records, f)
    dist.barrier()
    dist.destroy_process_group()


def gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order, on every rank."""
    import torch.distributed as dist

    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs
