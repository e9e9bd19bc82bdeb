"""The default process group of every engine, built so that a restarted torchrun attempt never meets the dead
attempt's store keys.

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the workers of every attempt are clients of one TCPStore
that the elastic agent hosts for the whole job, with the static rendezvous and with c10d alike (torch 2.13).
``init_process_group("env://")`` keys the default group on that store with no per-attempt prefix, so the
restarted attempt can read a dead worker's gloo address (``Gloo connectFullMesh failed ... Connection refused``)
or NCCL unique id (pytorch/pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent
counts its own restarts, so after a worker on one node dies, that node's new workers see 1 while the other
node's, restarted for the membership change, see 0 (observed with the c10d rendezvous; pytorch/pytorch#108158).

So the workers of an attempt agree on a fresh generation number through the agent's store first (rank 0 draws
it; each other rank posts a nonce of its own and waits for rank 0's answer to that nonce, which no earlier
attempt can have written) and build the default group on ``PrefixStore("shardopt/attempt/<generation>")``. Every
later group (``new_group``, device meshes, DeepSpeed's data-parallel groups) is keyed under the default group's
store, so it is fresh too. NCCL keeps its unique-id exchange on the same store, so the cure covers it unchanged.
Without the agent's store (a plain ``python`` run, the ``deepspeed`` launcher, ``srun``) rank 0 hosts a new store
for each launch and nothing is stale: the group is built on it as ``env://`` would.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

__all__ = ["init_default_group", "agree_generation", "uses_agent_store"]

_ROOT = "shardopt/attempt"


def uses_agent_store() -> bool:
    """Whether this worker's ``MASTER_ADDR:MASTER_PORT`` is the elastic agent's store, shared by every attempt."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def agree_generation(store: dist.Store, rank: int, world: int, timeout: timedelta = default_pg_timeout) -> int:
    """A number that every rank of this attempt returns and no earlier attempt on ``store`` used.

    Rank 0 draws it (a counter on the store). Each other rank posts a nonce of its own under ``hello/<rank>`` and
    waits for ``welcome/<nonce>``; rank 0 answers every nonce it finds there (stale ones of dead workers too,
    harmlessly) until each rank has confirmed under its generation. No rank reads a key an earlier attempt wrote
    and takes it for this one's, whatever the agents' restart counts and whoever starts first."""
    if rank == 0:
        generation = store.add(f"{_ROOT}/generation", 1)
        answered: set[bytes] = set()
        pending = set(range(1, world))
        deadline = time.monotonic() + timeout.total_seconds()
        while pending:
            for r in sorted(pending):
                if store.check([f"{_ROOT}/{generation}/joined/{r}"]):
                    pending.discard(r)
                elif store.check([f"{_ROOT}/hello/{r}"]):
                    posted = store.get(f"{_ROOT}/hello/{r}")
                    if posted not in answered:
                        store.set(f"{_ROOT}/welcome/{posted.decode()}", str(generation))
                        answered.add(posted)
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(pending)} did not join attempt generation {generation} within {timeout} "
                        "(did every node's torchrun restart its workers?)"
                    )
                time.sleep(0.01)
        return generation
    nonce = uuid.uuid4().hex
    store.set(f"{_ROOT}/hello/{rank}", nonce)
    generation = int(store.get(f"{_ROOT}/welcome/{nonce}"))  # blocks up to the store's timeout
    store.set(f"{_ROOT}/{generation}/joined/{rank}", "1")
    return generation


def init_default_group(backend: str, device: torch.device | None = None, timeout: timedelta | None = None) -> None:
    """``dist.init_process_group(backend)`` from torchrun's (or any launcher's) environment, restart-safe.

    ``device``: bound to the group for NCCL (eager communicator creation, as DeepSpeed does on CUDA); ``timeout``:
    the group's (None: torch's default for the backend). DeepSpeed takes the group as it is
    (``deepspeed.init_distributed`` on an initialized default group builds nothing of its own)."""
    store_timeout = timeout or default_pg_timeout
    store, rank, world = next(dist.rendezvous("env://", timeout=store_timeout))
    store.set_timeout(store_timeout)
    if uses_agent_store():
        generation = agree_generation(store, rank, world, store_timeout)
        store = dist.PrefixStore(f"{_ROOT}/{generation}/", store)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if device is not None and device.type == "cuda" else None,
    )
