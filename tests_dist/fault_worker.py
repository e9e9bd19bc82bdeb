"""Fault injection into checkpoint saves (issue 57): a rank SIGKILLed at one point of saving checkpoint B, then a
restart that must resume from the last complete checkpoint, or stop on every rank naming B as incomplete.

``--phase crash``: train 2 steps, save A, train 2 more, write the parameters (the uninterrupted run's at step 4:
B's, and A's resumed for 2 steps), then save B with the kill armed at ``--point``; the launch ends when the rank
dies (``--engine fsdp2``: ``shardopt.checkpoint.save`` of A and B, no pointer). ``--phase resume`` (one launch for
several crash directories): for each, a fresh engine loads what a restart would, trains up to step 4 and reports
the parameters' difference from the uninterrupted run; a load that names B explicitly reports its error; copies
of A with bytes flipped in shardopt's files report theirs.

Kill points (``POINTS``): DeepSpeed's files (``ds_before``: before rank 1 writes any; ``ds_half``: halfway through
rank 1's optimizer file), shardopt's files (``part_half``: halfway through rank 1's part file; ``part_after``:
rank 1 right after its part file; ``main_half``: halfway through rank 0's main file), and the commit
(``marker_before``: rank 0 before the completion marker; ``latest_before``/``latest_after``: rank 0 just before
and just after the pointer ``latest``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import OPTIMIZERS, local_batch  # noqa: E402
from toy_models import GLOBAL_BATCH, loss_fn, make_model  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402
from shardopt import checkpoint as ckpt  # noqa: E402

#: kill point -> (rank killed, what ``load_checkpoint(dir)`` resumes, whether B itself is complete: after its
#: marker, B loads when named even though ``latest`` still names A)
POINTS = {
    "ds_before": (1, "A", False),
    "ds_half": (1, "A", False),
    "part_half": (1, "A", False),
    "part_after": (1, "A", False),
    "main_half": (0, "A", False),
    "marker_before": (0, "A", False),
    "latest_before": (0, "A", True),
    "latest_after": (0, "B", True),
}
OPTIMIZER = "racs"
STEPS_A, STEPS_B = 2, 4


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _write_half(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())


def arm(point: str, engine) -> None:
    """Patch the writers so that this rank dies at ``point`` (only the rank ``POINTS`` names)."""
    import io

    import safetensors.torch

    from shardopt.checkpoint import commit, logical

    victim = POINTS[point][0]
    if dist.get_rank() != victim:
        return
    if point in ("ds_before", "ds_half"):
        ce = engine.checkpoint_engine
        real = ce.save

        def ds_save(state_dict, path, *a, **k):
            if point == "ds_before":
                _die()
            if "optim_states" in os.path.basename(path):
                buf = io.BytesIO()
                torch.save(state_dict, buf)
                _write_half(path, buf.getvalue())
                _die()
            return real(state_dict, path, *a, **k)

        ce.save = ds_save
    elif point in ("part_half", "main_half"):
        real_st = safetensors.torch.save_file

        def save_file(tensors, filename, metadata=None):
            real_st(tensors, filename, metadata=metadata)
            is_main = metadata is not None and "shardopt" in metadata
            if is_main == (point == "main_half"):
                data = open(filename, "rb").read()
                _write_half(filename, data)
                _die()

        safetensors.torch.save_file = save_file
    elif point == "part_after":
        real_wp = logical.write_part

        def write_part(path, tensors, meta=None):
            real_wp(path, tensors, meta)
            _die()

        logical.write_part = write_part
    elif point == "marker_before":
        commit.write_marker = lambda *a, **k: _die()
    else:
        real_wa = commit.write_atomic

        def write_atomic(path, text):
            if os.path.basename(path) == "latest" and point == "latest_before":
                _die()
            real_wa(path, text)
            if os.path.basename(path) == "latest":
                _die()

        commit.write_atomic = write_atomic


#: the kill points of ``shardopt.checkpoint.save`` (FSDP2): there is no pointer, B is complete once its main file is
FSDP2_POINTS = ("part_half", "part_after", "main_half")


class Fsdp2:
    """FSDP2 with ``shardopt.checkpoint``: the restart loads A by name (the caller keeps its own pointer)."""

    def __init__(self):
        from reliability_worker import fsdp2

        torch.manual_seed(0)
        self.model = fsdp2(make_model())
        self.opt = shardopt.create_optimizer(self.model, OPTIMIZER, **OPTIMIZERS[OPTIMIZER])
        self.step = 0

    def train(self, start: int, stop: int) -> None:
        for s in range(start, stop):
            self.opt.zero_grad()
            loss_fn(self.model, local_batch(s)).backward()
            self.opt.step()
        self.step = stop

    def params(self) -> dict[str, list]:
        return {n: p.full_tensor().detach().reshape(-1).tolist() for n, p in self.model.named_parameters()}


def build(stage: int):
    kw = dict(OPTIMIZERS[OPTIMIZER])
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "shardopt": {
            "optimizer": OPTIMIZER,
            "params": {k: v for k, v in kw.items() if k != "routing"},
            "routing": kw.get("routing", {}),
        },
    }
    torch.manual_seed(0)
    eng, opt, _, _ = shardopt.deepspeed.initialize(model=make_model(), config=config)
    return eng, opt


def train(eng, start: int, stop: int) -> None:
    for s in range(start, stop):
        loss = loss_fn(eng, local_batch(s))
        eng.backward(loss)
        eng.step()


def params(eng, stage: int) -> dict[str, list]:
    import contextlib

    from deepspeed import zero

    ps = list(eng.module.parameters())
    with zero.GatheredParameters(ps) if stage == 3 else contextlib.nullcontext():
        return {n: p.detach().float().reshape(-1).tolist() for n, p in eng.module.named_parameters()}


def crash_fsdp2(args) -> None:
    run = Fsdp2()
    run.train(0, STEPS_A)
    ckpt.save(os.path.join(args.dir, "A"), run.opt, extra={"step": STEPS_A})
    run.train(STEPS_A, STEPS_B)
    want = run.params()
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, "uninterrupted.json"), "w") as f:
            json.dump(want, f)
    dist.barrier()
    arm(args.point, None)
    ckpt.save(os.path.join(args.dir, "B"), run.opt, extra={"step": STEPS_B})
    raise SystemExit(f"the kill at {args.point} did not happen")


def resume_fsdp2(args) -> list:
    out = []
    for d in args.dirs:
        rec: dict = {"dir": d, "rank": dist.get_rank()}
        try:
            run = Fsdp2()
            try:
                ckpt.load(os.path.join(d, "B"), run.opt)
                rec["named_b"] = None
            except ckpt.CheckpointError as err:
                rec["named_b"] = str(err)
            meta = ckpt.load(os.path.join(d, "A"), run.opt)
            rec["loaded"], rec["resumed_at"] = "A", int(meta["extra"]["step"])
            run.train(rec["resumed_at"], STEPS_B)
            got, want = run.params(), json.load(open(os.path.join(d, "uninterrupted.json")))
            rec["diff"] = max((torch.tensor(got[n]) - torch.tensor(want[n])).abs().max().item() for n in want)
        except Exception:
            rec["error"] = traceback.format_exc()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rec)
        out.append(everyone)
    return out


def crash(args, stage: int) -> None:
    eng, _ = build(stage)
    train(eng, 0, STEPS_A)
    eng.save_checkpoint(args.dir, tag="A")
    train(eng, STEPS_A, STEPS_B)
    want = params(eng, stage)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, "uninterrupted.json"), "w") as f:
            json.dump(want, f)
    dist.barrier()
    arm(args.point, eng)
    eng.save_checkpoint(args.dir, tag="B")
    raise SystemExit(f"the kill at {args.point} did not happen")


def _flipped_copy(src: str, dst: str, main: bool) -> tuple[str, str]:
    """A copy of tag directory ``src`` with 16 bytes flipped in the largest tensor of shardopt's main file (or
    of a part file): (the file, the tensor)."""
    from shardopt.checkpoint import files

    shutil.copytree(src, dst)
    names = sorted(n for n in os.listdir(dst) if n.endswith(".safetensors") and (n == files.STATE_FILE) == main)
    path = os.path.join(dst, names[0])
    end, header = files._data_end(path)
    base = end - max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    tensor = max(
        (k for k in header if k != "__metadata__"),
        key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0],
    )
    a, b = header[tensor]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(base + (a + b) // 2)
        data = f.read(16)
        f.seek(base + (a + b) // 2)
        f.write(bytes(x ^ 0xFF for x in data))
    return path, tensor


def resume(args, stage: int) -> list:
    from shardopt.checkpoint import CheckpointError

    out = []
    for d in args.dirs:
        rec: dict = {"dir": d, "rank": dist.get_rank()}
        try:
            eng, opt = build(stage)
            try:
                eng.load_checkpoint(d, tag="B")
                rec["named_b"] = None
            except CheckpointError as err:
                rec["named_b"] = str(err)
            path, _ = eng.load_checkpoint(d)
            rec["loaded"] = os.path.basename(path if os.path.isdir(path) else os.path.dirname(path))
            rec["resumed_at"] = int(eng.global_steps)
            train(eng, int(eng.global_steps), STEPS_B)
            got = params(eng, stage)
            want = json.load(open(os.path.join(d, "uninterrupted.json")))
            rec["diff"] = max((torch.tensor(got[n]) - torch.tensor(want[n])).abs().max().item() for n in want)
            if args.flip:
                flips = {}
                for main in (True, False):
                    dst = os.path.join(d, f"A_flipped_{'main' if main else 'part'}")
                    holder = [_flipped_copy(os.path.join(d, "A"), dst, main) if dist.get_rank() == 0 else None]
                    dist.broadcast_object_list(holder, src=0)
                    for how in ("shardopt", "engine"):  # shardopt.checkpoint.load; the engine's (DeepSpeed's files)
                        try:
                            if how == "shardopt":
                                ckpt.load(dst, getattr(opt, "optimizer", opt))  # the shardopt one in the wrapper
                            else:
                                eng.load_checkpoint(d, tag=os.path.basename(dst))
                            error = None
                        except CheckpointError as err:
                            error = str(err)
                        flips[f"{'main' if main else 'part'} via {how}"] = {"error": error, "where": holder[0]}
                        dist.barrier()
                rec["flipped"] = flips
            del eng, opt
        except Exception:
            rec["error"] = traceback.format_exc()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rec)
        out.append(everyone)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["crash", "resume"], required=True)
    ap.add_argument("--engine", default="zero2", choices=["zero2", "zero3", "fsdp2"])
    ap.add_argument("--point", choices=sorted(POINTS))
    ap.add_argument("--dir", help="crash: the save directory")
    ap.add_argument("--dirs", nargs="*", default=[], help="resume: the crash directories")
    ap.add_argument("--flip", action="store_true", help="resume: also load copies of A with flipped bytes")
    ap.add_argument("--out")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if args.engine == "fsdp2":
        crash_fsdp2(args) if args.phase == "crash" else finish_worker(resume_fsdp2(args), args.out)
    elif args.phase == "crash":
        crash(args, int(args.engine[-1]))
    else:
        finish_worker(resume(args, int(args.engine[-1])), args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
