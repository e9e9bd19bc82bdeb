"""DeepSpeed's checkpoint scenarios (its ``tests/unit/checkpoint/``) on shardopt's engine: a 24-40-36-8 MLP with a
frozen layer, tied weights, a persistent buffer and a call counter, WarmupLR, global batch 12 over the ranks.

``--phase save`` (world size 2, ZeRO-2): train 3 steps, save (also a copy with ``exclude_frozen_parameters``),
keep the saved weights and buffers, run on to step 6 (the uninterrupted run), and build the references at the same
world size: a fresh optimizer on the saved weights with the saved scheduler (``load_optimizer_states=False``),
without it (``load_module_only=True``), and DeepSpeed's own load without the scheduler. Each of DeepSpeed's own
loads (same world size and stage) is recorded against its reference. ``ds_to_universal`` on the checkpoint.
``--phase load --stage S`` (any world size): each variant loaded into a model with another random init, through
shardopt's resharding path: frozen weights and buffers against the saved ones, then 3 steps against the reference;
the return value, strictness, ``exclude_frozen_parameters`` and ``custom_load_fn``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from parity_worker import OPTIMIZERS  # noqa: E402
from tiers import selected  # noqa: E402

import shardopt  # noqa: E402
from launch import finish_worker  # noqa: E402

GLOBAL_BATCH, SPLIT, TOTAL = 12, 3, 6
SAVED_SEED, OTHER_SEED = 0, 7
CLIENT = {"epoch": 7, "note": "client state"}
#: every load option DeepSpeed's tests exercise, by name
VARIANTS = {
    "full": {},
    "no_optimizer": {"load_optimizer_states": False},
    "module_only": {"load_module_only": True},
    "no_scheduler": {"load_lr_scheduler_states": False},
}


class Net(nn.Module):
    """24-40-36-8: ``frozen`` never trains, ``tied_b`` shares ``tied_a``'s weight, ``shift`` is a persistent
    buffer the forward uses, ``calls`` counts training forwards, ``scratch`` is not persistent (never saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 40)
        self.frozen = nn.Linear(40, 40)
        self.frozen.requires_grad_(False)
        self.tied_a = nn.Linear(40, 40, bias=False)
        self.tied_b = nn.Linear(40, 40, bias=False)
        self.tied_b.weight = self.tied_a.weight
        self.fc2 = nn.Linear(40, 36)
        self.fc3 = nn.Linear(36, 8)
        self.register_buffer("shift", torch.randn(40))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        h = torch.tanh(self.fc1(x)) + self.shift
        h = h + torch.tanh(self.frozen(h))
        h = torch.tanh(self.tied_b(torch.tanh(self.tied_a(h))))
        return self.fc3(torch.tanh(self.fc2(h)))


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(GLOBAL_BATCH, 24, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
    per = GLOBAL_BATCH // dist.get_world_size()
    lo = dist.get_rank() * per
    return x[lo : lo + per], y[lo : lo + per]


def options(opt_name: str) -> dict:
    return {k: v for k, v in OPTIMIZERS[opt_name].items() if k != "routing"}


def engine(opt_name: str, stage: int, model: nn.Module):
    kw = options(opt_name)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **({"sub_group_size": 100} if stage == 3 else {})},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": kw["lr"], "warmup_num_steps": 5, "warmup_type": "linear"},
        },
        "shardopt": {"optimizer": opt_name, "params": kw},
    }
    eng, _, _, _ = shardopt.deepspeed.initialize(model=model, config=config)
    return eng


def train(eng, start: int, stop: int) -> None:
    for s in range(start, stop):
        x, y = local_batch(s)
        loss = nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()


def snapshot(eng) -> dict[str, torch.Tensor]:
    """Every tensor of the module's state dict, whole (ZeRO-3's gathered), fp32, on every rank."""
    from deepspeed import zero

    module = eng.module
    with zero.GatheredParameters([p for p in module.parameters() if hasattr(p, "ds_id")]):
        out = {n: p.detach().float().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({n: b.detach().float().clone() for n, b in module.state_dict().items() if n not in out})
    return out


def diff(a: dict, b: dict, names) -> float:
    return max(((a[n] - b[n]).abs().max().item() for n in names), default=0.0)


def frozen_and_buffers(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters() if not p.requires_grad]
    return names + [n for n, _ in model.named_buffers() if n != "scratch"]


def trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def quiet():
    return contextlib.redirect_stdout(io.StringIO())


def phase_save(root: str, names: list[str], records: list) -> None:
    for opt_name in names:
        base = os.path.join(root, opt_name)
        rec = {"phase": "save", "optimizer": opt_name, "world_size": dist.get_world_size()}
        try:
            with quiet():
                first = engine(opt_name, 2, make_net(SAVED_SEED))
                train(first, 0, SPLIT)
                first.save_checkpoint(base, tag="step3", client_state=CLIENT)
                first.save_checkpoint(
                    base, tag="nofrozen", client_state=CLIENT, exclude_frozen_parameters=True, save_latest=False
                )
                saved = snapshot(first)
                sched = first.lr_scheduler.state_dict()
                train(first, SPLIT, TOTAL)
                refs = {"full": snapshot(first)}
                for variant, with_sched in (("no_optimizer", True), ("module_only", False)):
                    model = make_net(OTHER_SEED)
                    model.load_state_dict({n: v for n, v in saved.items() if n in model.state_dict()})
                    ref = engine(opt_name, 2, model)
                    if with_sched:
                        ref.lr_scheduler.load_state_dict(sched)
                    train(ref, SPLIT, TOTAL)
                    refs[variant] = snapshot(ref)
                native = {}
                for variant, kw in VARIANTS.items():  # DeepSpeed's own load: same world size and stage
                    eng = engine(opt_name, 2, make_net(OTHER_SEED))
                    path, client = eng.load_checkpoint(base, tag="step3", **kw)
                    rec[f"native_{variant}_path"] = os.path.relpath(path, base)
                    rec[f"native_{variant}_client"] = sorted(client)
                    train(eng, SPLIT, TOTAL)
                    native[variant] = snapshot(eng)
                refs["no_scheduler"] = native["no_scheduler"]
                for variant in ("full", "no_optimizer", "module_only"):
                    rec[f"native_{variant}_vs_reference"] = diff(native[variant], refs[variant], refs["full"])
                rec["no_scheduler_differs_from_full"] = diff(native["no_scheduler"], refs["full"], refs["full"])
            if dist.get_rank() == 0:
                torch.save({"saved": saved, "refs": refs}, os.path.join(base, "expected.pt"))
                rec["universal"] = ds_to_universal(base, os.path.join(root, f"{opt_name}-universal"))
        except Exception:
            rec["error"] = traceback.format_exc()
        records.append(rec)
        if dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
        dist.barrier()


def ds_to_universal(base: str, out: str, tag: str = "step3") -> str:
    """DeepSpeed's converter on the checkpoint: the message it stops with."""
    from deepspeed.checkpoint import ds_to_universal as conv

    argv = sys.argv
    sys.argv = [
        "ds_to_universal",
        "--input_folder",
        os.path.join(base, tag),
        "--output_folder",
        out,
        "--inject_missing_state",
    ]
    try:
        with quiet():
            conv.main(conv.parse_arguments())
        return "converted"
    except Exception as err:  # the message is the claim
        return f"{type(err).__name__}: {err}"
    finally:
        sys.argv = argv


def phase_load(root: str, names: list[str], stage: int, records: list) -> None:
    for opt_name in names:
        base = os.path.join(root, opt_name)
        expected = torch.load(os.path.join(base, "expected.pt"), weights_only=True)
        saved, refs = expected["saved"], expected["refs"]
        ws = dist.get_world_size()
        for variant, kw in VARIANTS.items():
            rec = {"phase": "load", "optimizer": opt_name, "variant": variant, "world_size": ws, "stage": stage}
            try:
                with quiet():
                    eng = engine(opt_name, stage, make_net(OTHER_SEED))
                    kept = frozen_and_buffers(eng.module)
                    path, client = eng.load_checkpoint(base, tag="step3", **kw)
                    now = snapshot(eng)
                    rec["frozen_buffers_vs_saved"] = diff(now, saved, kept)
                    rec["trained_vs_saved"] = diff(now, saved, trainable(eng.module))
                    rec["global_steps"] = eng.global_steps
                    rec["lr_scheduler_position"] = eng.lr_scheduler.state_dict().get("last_batch_iteration")
                    rec["path"] = os.path.relpath(path, base)
                    rec["client"] = sorted(client)
                    rec["client_epoch"] = client.get("epoch")
                    train(eng, SPLIT, TOTAL)
                    after = snapshot(eng)
                    rec["vs_reference"] = diff(after, refs[variant], refs[variant])
                    rec["calls"] = int(after["calls"])
            except Exception:
                rec["error"] = traceback.format_exc()
            records.append(rec)
            if dist.get_rank() == 0:
                print(json.dumps(rec), flush=True)
            dist.barrier()
        records.append(options_record(opt_name, base, stage, saved, refs))
        dist.barrier()


def options_record(opt_name: str, base: str, stage: int, saved: dict, refs: dict) -> dict:
    """``load_module_strict`` against a checkpoint without frozen weights, and ``custom_load_fn``."""
    rec = {"phase": "options", "optimizer": opt_name, "world_size": dist.get_world_size(), "stage": stage}
    try:
        with quiet():
            eng = engine(opt_name, stage, make_net(OTHER_SEED))
            try:
                eng.load_checkpoint(base, tag="nofrozen")
                rec["strict_error"] = None
            except RuntimeError as err:
                rec["strict_error"] = str(err)
            eng = engine(opt_name, stage, make_net(OTHER_SEED))
            own = snapshot(eng)
            eng.load_checkpoint(base, tag="nofrozen", load_module_strict=False)
            now = snapshot(eng)
            frozen = [n for n, p in eng.module.named_parameters() if not p.requires_grad]
            rec["nofrozen_frozen_vs_own"] = diff(now, own, frozen)
            rec["nofrozen_trained_vs_saved"] = diff(now, saved, trainable(eng.module))
            rec["nofrozen_buffers_vs_saved"] = diff(
                now, saved, [n for n, _ in eng.module.named_buffers() if n != "scratch"]
            )
            seen: list = []

            def custom(src, dst):
                seen.append(sorted(src))
                dst.load_state_dict(src)

            eng = engine(opt_name, stage, make_net(OTHER_SEED))
            eng.load_checkpoint(base, tag="step3", load_optimizer_states=False, custom_load_fn=custom)
            rec["custom_calls"] = len(seen)
            rec["custom_keys_match"] = bool(seen) and seen[0] == sorted(eng.module.state_dict())
            train(eng, SPLIT, TOTAL)
            rec["custom_vs_reference"] = diff(snapshot(eng), refs["no_optimizer"], refs["no_optimizer"])
    except Exception:
        rec["error"] = traceback.format_exc()
    if dist.get_rank() == 0:
        print(json.dumps(rec), flush=True)
    return rec


CI_OPTIMIZER = "scale"


def ci_save(root: str) -> dict:
    """CI's case, in ``checkpoint_worker``'s save launch (world size 2): the model above saved at ZeRO-2 after 3
    steps, the reference of ``load_optimizer_states=False`` (a fresh optimizer on the saved weights with the saved
    scheduler), and that option after a stage change (ZeRO-2 -> ZeRO-3): frozen weights and buffers against the
    saved ones, 3 steps against the reference; the ZeRO-3 engine saved in turn, and ``ds_to_universal`` on it."""
    base = os.path.join(root, "options")
    rec = {"phase": "options", "case": "zero2 -> zero3", "world_size": dist.get_world_size()}
    start = time.perf_counter()
    try:
        with quiet():
            first = engine(CI_OPTIMIZER, 2, make_net(SAVED_SEED))
            train(first, 0, SPLIT)
            first.save_checkpoint(base, tag="step3", client_state=CLIENT)
            saved, sched = snapshot(first), first.lr_scheduler.state_dict()
            model = make_net(OTHER_SEED)
            model.load_state_dict({n: v for n, v in saved.items() if n in model.state_dict()})
            ref = engine(CI_OPTIMIZER, 2, model)
            ref.lr_scheduler.load_state_dict(sched)
            train(ref, SPLIT, TOTAL)
            refs = {"no_optimizer": snapshot(ref)}
            if dist.get_rank() == 0:
                torch.save({"saved": saved, "refs": refs}, os.path.join(base, "expected.pt"))
            rec.update(check_load(base, 3, saved, refs["no_optimizer"]))
    except Exception:
        rec["error"] = traceback.format_exc()
    dist.barrier()
    if dist.get_rank() == 0 and "error" not in rec:
        rec["universal_zero3"] = ds_to_universal(base, os.path.join(root, "options-universal"), tag="zero3")
        rec.update(converted(base, saved))
    rec["seconds"] = time.perf_counter() - start
    return rec


def converted(base: str, saved: dict) -> dict:
    """What ``shardopt checkpoint convert`` reads from the ZeRO-2 and ZeRO-3 tags: frozen weights and buffers
    from DeepSpeed's model-states files beside shardopt's (ZeRO-3's tag was saved 3 steps later: its frozen
    weights and ``shift`` are the saved ones, ``calls`` is 6)."""
    from shardopt.checkpoint.convert import read

    out = {}
    fixed = ["frozen.weight", "frozen.bias", "shift"]
    for tag, names in (("step3", fixed + ["calls"]), ("zero3", fixed)):
        tensors = read(os.path.join(base, tag)).tensors
        got = {n: tensors.get(f"{n}::param") for n in names + ["calls"]}
        missing = [n for n, v in got.items() if v is None]
        out[f"convert_{tag}_missing"] = missing
        if not missing:
            out[f"convert_{tag}_vs_saved"] = max(
                (got[n].reshape(-1) - saved[n].reshape(-1)).abs().max().item() for n in names
            )
            out[f"convert_{tag}_calls"] = int(got["calls"])
    return out


def check_load(base: str, stage: int, saved: dict, ref: dict) -> dict:
    """``load_optimizer_states=False`` into another random init at ``stage``, then 3 steps (ZeRO-3: saved again
    under tag ``zero3``, for ``ds_to_universal``)."""
    rec: dict = {}
    eng = engine(CI_OPTIMIZER, stage, make_net(OTHER_SEED))
    path, client = eng.load_checkpoint(base, tag="step3", load_optimizer_states=False)
    now = snapshot(eng)
    rec["frozen_buffers_vs_saved"] = diff(now, saved, frozen_and_buffers(eng.module))
    rec["trained_vs_saved"] = diff(now, saved, trainable(eng.module))
    rec["global_steps"], rec["client_epoch"] = eng.global_steps, client.get("epoch")
    rec["path"] = os.path.relpath(path, base)
    train(eng, SPLIT, TOTAL)
    after = snapshot(eng)
    rec["vs_reference"] = diff(after, ref, ref)
    rec["calls"] = int(after["calls"])
    if stage == 3:
        eng.save_checkpoint(base, tag="zero3", save_latest=False)
    return rec


def ci_load(root: str) -> dict:
    """CI's case at another world size (``checkpoint_worker``'s resume launch): the ZeRO-2 checkpoint of
    ``ci_save`` with ``load_optimizer_states=False``."""
    base = os.path.join(root, "options")
    rec = {"phase": "options", "case": f"ws 2 -> {dist.get_world_size()}", "world_size": dist.get_world_size()}
    start = time.perf_counter()
    try:
        expected = torch.load(os.path.join(base, "expected.pt"), weights_only=True)
        with quiet():
            rec.update(check_load(base, 2, expected["saved"], expected["refs"]["no_optimizer"]))
    except Exception:
        rec["error"] = traceback.format_exc()
    dist.barrier()
    rec["seconds"] = time.perf_counter() - start
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--optimizers", default="")
    args = ap.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    names = [n for n in args.optimizers.split(",") if n] or selected(OPTIMIZERS, ("scale",))
    records: list = []
    if args.phase == "save":
        phase_save(args.dir, names, records)
    else:
        phase_load(args.dir, names, args.stage, records)
    finish_worker(records, args.out)


if __name__ == "__main__":
    from launch import settle_heap

    settle_heap()
    main()
