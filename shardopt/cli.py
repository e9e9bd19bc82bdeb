"""``shardopt`` command line: ``shardopt checkpoint inspect PATH`` and ``shardopt checkpoint convert SRC DST``."""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from .checkpoint.logical import SEP, CheckpointError


def _inspect(path: str) -> int:
    from .checkpoint.convert import read_any

    tensors, meta, kind = read_any(path)
    print(f"{path}: {kind} checkpoint, optimizer {meta.get('optimizer')}, engine {meta.get('engine')}, "
          f"saved at world size {meta.get('world_size')}")
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
    return 0


def _convert(src: str, dst: str, to: str) -> int:
    from .checkpoint import convert

    tensors, meta, kind = convert.read_any(src)
    if to == "file":
        out = convert.write_logical(dst, tensors, meta)
    elif to == "deepspeed":
        out = convert.write_deepspeed(dst, tensors, meta)
    else:
        out = convert.write_dcp(dst, tensors, meta)
    print(f"converted {kind} checkpoint {src} -> {to} {out} ({len(tensors)} tensors)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shardopt")
    sub = ap.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("checkpoint", help="inspect or convert checkpoints")
    cks = ck.add_subparsers(dest="action", required=True)
    ins = cks.add_parser("inspect", help="parameters, state tensors, shapes, bytes, step")
    ins.add_argument("path")
    conv = cks.add_parser("convert", help="DeepSpeed ZeRO <-> FSDP2 DCP <-> single file")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--to", choices=["file", "deepspeed", "dcp"], required=True)
    args = ap.parse_args(argv)
    try:
        if args.action == "inspect":
            return _inspect(args.path)
        return _convert(args.src, args.dst, args.to)
    except CheckpointError as err:
        print(f"shardopt: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
