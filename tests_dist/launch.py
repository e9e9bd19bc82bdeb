"""Launch a worker script under ``torch.distributed.run`` on CPU/gloo with a free port and a timeout."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(ROOT / "tests_dist" / script), *args]
    return run_bounded(cmd, env=env, timeout=timeout)


def run_bounded(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose timeout ends the launcher's workers too.

    ``subprocess.run`` kills only its child, and the ranks ``torch.distributed.run`` started keep the output
    pipes open, so the call then waits for them however long they run. Killing the child's process group is
    not enough either: the launcher starts every rank in a session of its own (a Megatron launch ran 19
    minutes past its 900 s that way). On a timeout every descendant of the child is killed (``psutil``, which
    DeepSpeed already requires, lists them before any of them dies), then the child's group.
    """
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            import psutil

            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def finish_worker(records: list, out: str) -> None:
    """End of every distributed worker: rank 0 writes the records as JSON, then the group is torn down."""
    import gc
    import json

    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
    # release every engine (DDP reducers, FSDP/DeepSpeed hooks) and let all ranks arrive before the group goes:
    # tearing gloo down under live wrappers can abort the process at exit on a loaded machine
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def record_case(records: list, rec: dict, body) -> None:
    """One case of a worker: the fields ``body()`` returns go into ``rec`` (its prints swallowed), or its
    traceback under ``"error"`` (every rank raises alike, so the cases after it still run); then all ranks
    meet before the next case."""
    import contextlib
    import io
    import traceback

    import torch.distributed as dist

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rec.update(body())
    except Exception:
        rec["error"] = traceback.format_exc()
    records.append(rec)
    dist.barrier()


def max_abs_diff(got: dict, want: dict) -> float:
    """Largest elementwise difference over the parameters of ``want`` (``got``'s compared in fp32)."""
    return max((got[n].float() - want[n]).abs().max().item() for n in want)


def settle_heap() -> None:
    """Freeze what the imports left alive, first thing in every worker.

    DeepSpeed runs ``gc.collect()`` at each engine it builds (ZeRO-3's ``defragment``, its GC policy). With torch
    and DeepSpeed imported that scans about 200k objects: 0.3 s a call on a 2-core machine, a fifth of a
    checkpoint worker's time. Frozen objects are never scanned; everything created later is collected as before.
    """
    import gc

    gc.collect()
    gc.freeze()
