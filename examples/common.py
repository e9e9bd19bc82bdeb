"""What the examples share: a small LLaMA (``shardopt.train.model``) and learnable synthetic token batches,
so every example runs in seconds on a CPU; swap in your own model and data."""

from __future__ import annotations

import os
import socket
from typing import Iterator

import torch
import torch.distributed as dist

from shardopt.train.model import Llama, model_config

VOCAB, SEQ = 512, 32


def init_distributed() -> tuple[int, int, torch.device]:
    """The default process group (nccl on GPUs, else gloo); a plain ``python examples/...`` gets one process."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def tiny_llama() -> Llama:
    """The same initial weights on every rank and every run (seeded)."""
    torch.manual_seed(0)
    return Llama(
        model_config("tiny", VOCAB, hidden_size=64, intermediate_size=176, num_heads=4, num_layers=2, max_seq_len=SEQ)
    )


def token_batches(
    start: int, stop: int, batch_size: int, rank: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, next-token labels) for steps ``[start, stop)``: arithmetic token sequences (learnable), a fixed
    function of (step, rank) so a resumed run reads what an uninterrupted one would."""
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step * 100_003 + rank)
        first = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        tokens = (first + stride * torch.arange(SEQ + 1)) % VOCAB
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def finish() -> None:
    """Tear the process group down once every rank is done and the engines' wrappers are gone (gloo can abort a
    process that exits while another rank still talks to it)."""
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
