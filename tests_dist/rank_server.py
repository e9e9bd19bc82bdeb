"""Start each launch's ranks as forks of one process that has imported torch and DeepSpeed already.

On a 2-core machine a ``torchrun`` launch of 3 ranks spends about 30 s before the first collective: the
launcher and every rank import torch, FSDP and DeepSpeed (12-14 s of CPU each). The distributed suites launch
about twenty times, so that was ten minutes of CI. This server imports them (and, where installed, transformers
and accelerate, which the Hugging Face suites' ranks imported at every launch) once per test session; each
request forks a launcher, which forks the ranks with the environment ``torch.distributed.run`` would give
them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...; rank 0 hosts the store),
runs the worker script as ``__main__`` in each, and ends the others when one fails, as ``torchrun`` does.

Only the libraries are shared: the project and the worker are imported in each rank, after the fork, so every
launch runs the checkout's code as a fresh process would. Nothing has started a thread or a process group at
the fork (the server runs no torch op). ``launch.run_ranks`` is the client; ``SHARDOPT_TEST_LAUNCHER=torchrun``
goes back to ``torch.distributed.run`` for every launch. The launches that test ``torchrun`` itself (restarts,
multi-node rendezvous, the README's commands) always use it.

Protocol (JSON lines): a request ``{"script", "argv", "nproc", "env", "cwd", "out", "err"}`` on stdin; the reply
``{"pid": launcher}`` at once, then ``{"rc": code}`` when the launch ends (1 when a rank failed, as
``torchrun``). The launcher leads its own process group, so a client's timeout can end it and its ranks.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

#: the libraries every worker imports, loaded once; ``torch`` reads OMP_NUM_THREADS when loaded, so the
#: server is started with the workers' value (launch.py), and a request's other value is set per rank
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "deepspeed",
    # what a rank's first DeepSpeed engine imports lazily: its ZeRO stages, the Muon module that its optimizer
    # check imports (which loads torch._dynamo) and the JIT op loader of its shared-memory comm op; 7.6 s of CPU
    # per rank and launch on this machine (first ZeRO-2 engine 7.8 s -> 0.2 s), 5.9 s once here. They start no
    # thread, so the forks stay safe.
    "torch._dynamo",
    "torch.utils.cpp_extension",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer",
)
#: loaded too where installed (the transformers extra): the Hugging Face stack of the suites that drive shardopt
#: through it (test_hf_integration, test_lora, test_offload, test_rules_everywhere, test_trainers), which every rank
#: of theirs imported anew at each launch (2-5 s a launch on this machine). Not ``transformers.trainer``: it imports
#: ``datasets``, whose pyarrow starts a thread (jemalloc's), and the server must hold none when it forks. What the
#: imports leave for every rank (checked with transformers 5.25, accelerate 1.16): one warnings filter, UserWarnings of
#: torch.optim.lr_scheduler ignored (no suite checks those); no logger level, thread count or torch default changed
PRELOAD_IF_INSTALLED = (
    "transformers",
    "transformers.training_args",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "accelerate",
)
#: seconds the other ranks get to end after one failed, before they are killed (torchrun's default is 30)
GRACE = 15.0


def main() -> None:
    # the protocol keeps the real stdout; anything the imports print goes to stderr
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import gc
    import importlib
    import importlib.util

    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_IF_INSTALLED:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the forks share these pages; a collection in a rank neither scans nor copies them
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            reply.close()
            _launcher(req)  # never returns
        reply.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


def _launcher(req: dict) -> None:
    """The forked launcher: its own process group, the request's output files and environment, one fork per
    rank; exits 0 when every rank did, else 1 after ending the rest."""
    code = 1
    try:
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(os.devnull)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        n = int(req["nproc"])
        ranks = {}
        for rank in range(n):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _rank(req, rank, n)  # never returns
            ranks[pid] = rank
        code = _wait(ranks)
    except BaseException:
        traceback.print_exc()
    finally:
        _exit(code)


def _wait(ranks: dict[int, int]) -> int:
    """Wait for every rank; after the first failure the others get ``GRACE`` seconds, then SIGKILL."""
    failed: list[str] = []
    deadline = None
    while ranks:
        if deadline is None:
            pid, status = os.wait()
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for p in ranks:
                        _signal(p, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.05)
                continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append(
                f"rank {rank} (pid {pid}) "
                + (f"exited with code {code}" if code > 0 else f"was ended by signal {-code}")
            )
            if deadline is None:
                for p in ranks:
                    _signal(p, signal.SIGTERM)
                deadline = time.monotonic() + GRACE
    if failed:
        print("rank_server: " + "; ".join(failed), file=sys.stderr, flush=True)
        return 1
    return 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _rank(req: dict, rank: int, n: int) -> None:
    """One rank: the environment ``torch.distributed.run`` sets, then the worker as ``__main__``; exits with
    its code after the exit handlers a process would run."""
    code = 1
    try:
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "ROLE_WORLD_SIZE": str(n),
                "GROUP_WORLD_SIZE": "1",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": "rank_server",
            }
        )
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            import torch

            if torch.get_num_threads() != int(threads):
                torch.set_num_threads(int(threads))
        script = os.path.abspath(req["script"])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *[p for p in extra if p not in sys.path], *sys.path[1:]]
        sys.argv = [script, *req["argv"]]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        _exit(code)


def _exit(code: int) -> None:
    """End a forked process with ``code`` once its output is written, without unwinding into the server's
    loop above the fork."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
