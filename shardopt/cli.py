"""``shardopt`` command line: ``shardopt --version``, ``shardopt checkpoint inspect PATH``,
``shardopt checkpoint convert SRC DST``, ``shardopt checkpoint clean DIR`` (leftovers of interrupted saves) and
``shardopt roles MODEL OPTIMIZER`` (each parameter's role and rule for a Hugging Face model config)."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from ._version import __version__
from .checkpoint.locate import ACCEPTED
from .checkpoint.logical import SEP, CheckpointError


def _counters(meta: dict) -> str:
    extra = meta.get("extra") or {}
    step = extra.get("global_steps")
    sched = extra.get("lr_scheduler")
    if step is None and not sched:
        return "no step counter or LR-scheduler state saved"
    where = sched.get("last_epoch", sched.get("last_batch_iteration")) if isinstance(sched, dict) else None
    return f"global step {step if step is not None else 'not saved'}, LR scheduler " + (
        f"at step {where}" if where is not None else "state saved" if sched else "state not saved"
    )


def _inspect(path: str) -> int:
    from .checkpoint.convert import read

    ck = read(path)
    meta, tensors = ck.meta, ck.tensors
    for note in ck.notes:
        print(f"{path}: {note}")
    optimizer = meta.get("optimizer") or "not a shardopt optimizer"
    print(
        f"{ck.path}: {ck.kind} checkpoint, optimizer {optimizer}, engine {meta.get('engine')}, "
        f"saved at world size {meta.get('world_size') or 'unknown'}"
    )
    per_param: dict[str, list[str]] = defaultdict(list)
    total = 0
    steps = set()
    for k in sorted(tensors):
        name, key = k.split(SEP)
        t = tensors[k]
        size = t.numel() * t.element_size()
        total += size
        if key == "step":
            steps.add(float(t))
        per_param[name].append(f"{key}{tuple(t.shape)} [{meta['kinds'].get(key, '?')}, {size} B]")
    for name, entries in per_param.items():
        print(f"  {name}: " + ", ".join(entries))
    print(f"{len(per_param)} parameters, {len(tensors)} tensors, {total} bytes; step {sorted(steps) or 'n/a'}")
    print(f"counters: {_counters(meta)}")
    return 0


def _convert(src: str, dst: str, to: str) -> int:
    from .checkpoint import convert

    ck = convert.read(src)
    for note in ck.notes:
        print(f"{src}: {note}", file=sys.stderr)
    if to == "file":
        out = convert.write_logical(dst, ck.tensors, ck.meta)
    elif to == "deepspeed":
        out = convert.write_deepspeed(dst, ck.tensors, ck.meta)
    else:
        out = convert.write_dcp(dst, ck.tensors, ck.meta)
    print(f"converted {ck.kind} checkpoint {ck.path} -> {to} {out} ({len(ck.tensors)} tensors; {_counters(ck.meta)})")
    return 0


def _roles(model: str, optimizer: str, routing: list[str]) -> int:
    """Build the Hugging Face model from its config on the meta device (no weights read) and print the table."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .optim.describe import describe_roles

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    table = dict(r.split("=", 1) for r in routing)
    print(describe_roles(net, optimizer, table))
    return 0


def _clean(path: str, dry_run: bool) -> int:
    """Remove the leftovers of interrupted saves under ``path`` (never a complete checkpoint's file)."""
    import os

    from .checkpoint import commit

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory; give the directory checkpoints are saved in")
    found = commit.leftovers(path) if dry_run else commit.clean(path)
    for f in found:
        print(f"{'would remove' if dry_run else 'removed'} {f}")
    print(f"{path}: {len(found)} leftover file(s) of interrupted saves {'found' if dry_run else 'removed'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shardopt")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("checkpoint", help="inspect, convert or clean checkpoints")
    cks = ck.add_subparsers(dest="action", required=True)
    ins = cks.add_parser("inspect", help="parameters, state tensors, shapes, bytes, step")
    ins.add_argument("path", help=f"the checkpoint: {ACCEPTED}")
    cln = cks.add_parser("clean", help="remove what interrupted saves left (.tmp-* files, orphan part files)")
    cln.add_argument("path", help="a checkpoint directory (DeepSpeed save_dir, trainer checkpoints/, a shardopt dir)")
    cln.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    conv = cks.add_parser("convert", help="DeepSpeed ZeRO <-> FSDP2 DCP <-> single file (also from trainer DDP files)")
    conv.add_argument("src", help="as for inspect")
    conv.add_argument("dst")
    conv.add_argument("--to", choices=["file", "deepspeed", "dcp"], required=True)
    roles = sub.add_parser("roles", help="each parameter's role and rule for a Hugging Face model (config only)")
    roles.add_argument("model", help="a directory or hub id with config.json (extra 'transformers')")
    roles.add_argument("optimizer", help="a shardopt optimizer name, e.g. scale")
    roles.add_argument(
        "--routing",
        action="append",
        default=[],
        metavar="PATTERN=ROLE",
        help="routing declaration, e.g. '*.c_attn.weight=matrix_transposed' (repeatable)",
    )
    args = ap.parse_args(argv)
    if args.command == "roles":
        from .optim.registry import ConfigError

        try:
            return _roles(args.model, args.optimizer, args.routing)
        except ConfigError as err:
            print(f"shardopt: error: {err}", file=sys.stderr)
            return 2
    try:
        if args.action == "inspect":
            return _inspect(args.path)
        if args.action == "clean":
            return _clean(args.path, args.dry_run)
        return _convert(args.src, args.dst, args.to)
    except CheckpointError as err:
        print(f"shardopt: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
