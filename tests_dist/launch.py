"""Launch a worker script's ranks on CPU/gloo with a free port and a timeout.

``run_ranks`` forks the ranks from a server that has imported torch and DeepSpeed once per test session
(``rank_server.py``: 30 s less per launch on a 2-core machine); ``SHARDOPT_TEST_LAUNCHER=torchrun`` launches
every worker under ``torch.distributed.run`` instead. Either way the ranks see the same environment.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment of every worker launch: CPU DeepSpeed, one thread a rank, the checkout importable."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_ranks(script: str, nproc: int, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``nproc`` ranks of ``tests_dist/<script>`` with ``args`` on a free port: the completed launch (return code
    0 when every rank exited 0, the ranks' stdout and stderr), or ``TimeoutExpired`` after ``timeout`` seconds
    with every rank ended."""
    env = worker_env()
    port = free_port()
    path = str(ROOT / "tests_dist" / script)
    if os.environ.get("SHARDOPT_TEST_LAUNCHER", "fork").strip().lower() == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            path,
            *args,
        ]
        return run_bounded(cmd, env=env, timeout=timeout)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return _server().launch(path, nproc, list(args), env, timeout)


class _RankServer:
    """The client of one ``rank_server.py`` process (started on first use, ended at exit)."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="shardopt-rank-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests_dist" / "rank_server.py")],
            env=worker_env(),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self._read(600)  # {"ready": pid} once the libraries are imported

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout: float) -> dict | None:
        """The server's next reply, or None when ``timeout`` passed first."""
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests_dist/rank_server.py ended (exit {self.proc.poll()}); its log: {self.log.name}")
        return json.loads(line)

    def launch(
        self, script: str, nproc: int, argv: list[str], env: dict, timeout: float
    ) -> subprocess.CompletedProcess:
        cmd = ["rank_server", f"--nproc={nproc}", script, *argv]
        with tempfile.TemporaryDirectory(prefix="shardopt-ranks-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            req = {"script": script, "argv": argv, "nproc": nproc, "env": env, "cwd": str(ROOT), "out": out, "err": err}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            pid = self._read(60)["pid"]
            done = self._read(timeout)
            if done is None:  # end the launcher's group (and any rank that left it), then collect its exit
                _kill_tree(pid)
                self._read(60)
            texts = [Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err)]
        if done is None:
            raise subprocess.TimeoutExpired(cmd, timeout, *texts)
        return subprocess.CompletedProcess(cmd, done["rc"], *texts)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


_servers: list[_RankServer] = []


def _server() -> _RankServer:
    if not _servers or not _servers[0].alive():
        if _servers:
            _servers.pop().close()
        _servers.append(_RankServer())
        atexit.register(_servers[0].close)
    return _servers[0]


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s descendants (listed before any dies; ``psutil``, which DeepSpeed requires), then its
    process group."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_bounded(
    cmd: list[str], env: dict, timeout: float, cwd: str | os.PathLike = ROOT
) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose timeout ends the launcher's workers too.

    ``subprocess.run`` kills only its child, and the ranks ``torch.distributed.run`` started keep the output
    pipes open, so the call then waits for them however long they run. Killing the child's process group is
    not enough either: the launcher starts every rank in a session of its own (a Megatron launch ran 19
    minutes past its 900 s that way). On a timeout every descendant of the child is killed (``psutil``, which
    DeepSpeed already requires, lists them before any of them dies), then the child's group.
    """
    with subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_killing_rank(
    cmds: list[list[str]], env: dict, timeout: float, rank: int, after: str, cwd: str | os.PathLike = ROOT
) -> tuple[list[subprocess.CompletedProcess], int | None]:
    """Launch ``cmds`` (the ``torch.distributed.run`` commands of one job, one per node) and SIGKILL the worker of
    global rank ``rank`` once a line of their output contains ``after``: a worker dying mid-run, which
    ``--max-restarts`` must survive. Only the first attempt's worker is killed. Returns the completed launches
    (stderr merged into stdout) and the killed worker's pid (None if ``after`` never appeared); on a timeout every
    descendant is killed and ``TimeoutExpired`` raised."""
    import threading
    import time

    import psutil

    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in cmds
    ]
    outs: list[list[str]] = [[] for _ in procs]
    seen = threading.Event()

    def read(i: int) -> None:
        assert procs[i].stdout is not None
        for line in procs[i].stdout:
            outs[i].append(line)
            if after in line:
                seen.set()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    killed: int | None = None
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if killed is None and seen.is_set():
                for p in procs:  # torchrun's workers are its own children
                    for child in psutil.Process(p.pid).children():
                        with contextlib.suppress(psutil.Error):
                            if child.environ().get("RANK") == str(rank):
                                child.kill()
                                killed = child.pid
                killed = killed or -1
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmds[0], timeout, "".join(outs[0]))
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p.pid)
            p.wait()
        for t in readers:
            t.join(timeout=10)
    done = [subprocess.CompletedProcess(p.args, p.returncode, "".join(o), "") for p, o in zip(procs, outs)]
    return done, (killed if killed and killed > 0 else None)


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


def shared_tempdir(prefix: str) -> str:
    """A fresh directory made by rank 0 and named to every rank (checkpoints every rank writes into)."""
    import tempfile

    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


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
