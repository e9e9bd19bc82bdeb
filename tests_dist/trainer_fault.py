"""The reference trainer with a rank killed mid-save (issue 57): ``python trainer_fault.py <shardopt.train args>``
under torchrun. Rank ``FAULT_RANK`` SIGKILLs itself halfway through writing its file of checkpoint ``FAULT_TAG``
(``torch.save`` of DeepSpeed's optimizer file or the trainer's DDP ``rank<N>.pt``); without ``FAULT_TAG`` it is
the trainer as is."""

from __future__ import annotations

import io
import os
import signal
import sys

import torch


def _arm(tag: str, rank: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real = torch.save

    def save(obj, f, *args, **kwargs):
        name = os.path.basename(str(f)) if isinstance(f, (str, os.PathLike)) else ""
        parent = os.path.basename(os.path.dirname(str(f))) if name else ""
        if parent == tag and ("optim_states" in name or name == f"rank{rank}.pt"):
            buf = io.BytesIO()
            real(obj, buf, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                out.flush()
                os.fsync(out.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *args, **kwargs)

    torch.save = save


if __name__ == "__main__":
    if os.environ.get("FAULT_TAG"):
        _arm(os.environ["FAULT_TAG"], int(os.environ.get("FAULT_RANK", "1")))
    from shardopt.train.__main__ import main

    sys.exit(main(sys.argv[1:]))
