"""What verifying checkpoint checksums costs a load, at 350M parameters (issue 57).

``python -m benchmarks.checkpoint_verify [--params 350e6] [--repeat 3]``: one process, a stack of 4096x4096
Linear layers (350M parameters: 21 of them, 352M) under AdamW-routed SCALE (parameters, exp_avg and exp_avg_sq
saved: 4.2 GB of fp32), one step, ``shardopt.checkpoint.save``; then ``shardopt.checkpoint.load`` timed with
checksums verified and skipped (``SHARDOPT_CHECKPOINT_VERIFY=0``), files in the page cache (the warm case: the
verification's own cost, not the disk's), best of ``--repeat`` alternated runs. Also the save with and without
the CRC-32 it now computes, and both checksum passes alone (the saves' and loads' totals include fsync and the
disk, which vary from run to run on a shared machine by more than the checksums cost). Prints a table; CPU only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    import shardopt
    import shardopt.checkpoint as ckpt
    from shardopt.checkpoint import files

    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=350e6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    layers = max(1, round(args.params / args.width**2))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(layers)])
    opt = shardopt.create_optimizer(model, "scale", routing={"*": "adamw"})
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="shardopt-verify-") as d:
        real_crc = files._crc
        ckpt.save(d, opt)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        t = {"save": [], "save_plain": [], "verified": [], "skipped": []}
        for rep in range(args.repeat):  # alternated, each first every other time: drift (page cache, writeback,
            for crc in (True, False) if rep % 2 == 0 else (False, True):  # other load) hits both alike
                files._crc = real_crc if crc else (lambda x: 0)
                try:
                    t["save" if crc else "save_plain"].append(_best(lambda: ckpt.save(d, opt), 1))
                finally:
                    files._crc = real_crc
            ckpt.save(d, opt)
            for verify in ("1", "0") if rep % 2 == 0 else ("0", "1"):
                os.environ["SHARDOPT_CHECKPOINT_VERIFY"] = verify
                t["verified" if verify == "1" else "skipped"].append(_best(lambda: ckpt.load(d, opt), 1))
            os.environ.pop("SHARDOPT_CHECKPOINT_VERIFY")
        save_s, save_plain_s, verified, skipped = (min(t[k]) for k in ("save", "save_plain", "verified", "skipped"))
        tensors = [x.detach().contiguous() for x in model.parameters()]
        tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
        crc = _best(lambda: [real_crc(x) for x in tensors], args.repeat)
        check = _best(lambda: files.verify_file(os.path.join(d, files.STATE_FILE)), args.repeat)
    print(f"{n / 1e6:.0f}M parameters, checkpoint {nbytes / 1e9:.2f} GB, torch threads {torch.get_num_threads()}")
    print("| | seconds |\n|---|---|")
    print(f"| save (with CRC-32) | {save_s:.2f} |\n| save (CRC-32 replaced by 0) | {save_plain_s:.2f} |")
    print(f"| load, checksums verified | {verified:.2f} |\n| load, SHARDOPT_CHECKPOINT_VERIFY=0 | {skipped:.2f} |")
    print(f"| CRC-32 of the saved tensors alone (the save's added work) | {crc:.2f} |")
    print(
        f"| verification alone (verify_file, files in the page cache) | {check:.2f} ({nbytes / 1e9 / check:.1f} GB/s) |"
    )


if __name__ == "__main__":
    main()
