"""The test launcher (``launch.run_ranks`` on ``rank_server.py``) behaves as ``torch.distributed.run`` where the
suites rely on it: the ranks' environment and output, a failed rank ending the launch, and a timeout ending
every rank."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from launch import run_ranks

#: the launch timeout of test_a_timeout_ends_every_rank, which the test waits out (seconds): the ranks, forks of the
#: warm rank server, write their pid files in well under a second; under torchrun (SHARDOPT_TEST_LAUNCHER=torchrun)
#: the launcher and each rank start a new interpreter first
TIMEOUT = 10 if os.environ.get("SHARDOPT_TEST_LAUNCHER", "fork").strip().lower() == "torchrun" else 4
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(body)
    return str(path)


def test_ranks_get_torchruns_environment_and_arguments(tmp_path):
    fields = ", ".join(f"os.environ[{k!r}]" for k in ENV_KEYS)
    script = _script(
        tmp_path,
        "import os, sys\n"  # one write per line: the ranks share the output
        f"sys.stdout.write(' '.join(map(str, [sys.argv[1:], __name__, {fields}])) + '\\n')\n",
    )
    proc = run_ranks(script, 3, ["--out", "x"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert len(lines) == 3
    port = lines[0].split()[-2]
    for rank, line in enumerate(lines):
        assert line == f"['--out', 'x'] __main__ {rank} {rank} 3 3 127.0.0.1 {port} 1", line


def test_a_process_group_forms_and_reduces(tmp_path):
    script = _script(
        tmp_path,
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "x = torch.ones(2) * (dist.get_rank() + 1)\ndist.all_reduce(x)\nprint(x.tolist())\n"
        "dist.destroy_process_group()\n",
    )
    proc = run_ranks(script, 3, [], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("[6.0, 6.0]") == 3, proc.stdout


def test_a_failed_rank_fails_the_launch_and_ends_the_others(tmp_path):
    script = _script(
        tmp_path, "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(300)\n"
    )
    start = time.monotonic()
    proc = run_ranks(script, 3, [], timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 1
    named = "rank 1 " in proc.stderr and "exited with code 3" in proc.stderr  # rank_server's summary
    assert named or "exitcode  : 3" in proc.stderr, proc.stderr  # or torchrun's


def test_an_exception_is_printed_and_fails_the_launch(tmp_path):
    script = _script(tmp_path, "raise ValueError('worker broke')\n")
    proc = run_ranks(script, 2, [], timeout=120)
    assert proc.returncode == 1 and "ValueError: worker broke" in proc.stderr


def test_a_timeout_ends_every_rank(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = _script(
        tmp_path,
        f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\ntime.sleep(300)\n",
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks(script, 2, [], timeout=TIMEOUT)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 2
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in started)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent to read its exit."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
