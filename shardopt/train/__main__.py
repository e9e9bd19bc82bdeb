"""``python -m shardopt.train --config configs/train/demo.json [--resume] [--set train.steps=50]``

Works under ``torchrun`` (any number of nodes) and the ``deepspeed`` launcher (``--local_rank`` is accepted).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m shardopt.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="trainer JSON config (see configs/train/)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of the run")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (JSON-parsed), e.g. --set train.steps=50 (repeatable)",
    )
    p.add_argument("--run_dir", "--run-dir", default=None, help="shortcut for --set run_dir=...")
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="passed by the deepspeed launcher; LOCAL_RANK from the environment is used",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    from .config import TrainConfigError, load_train_config

    overrides = list(args.set) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    try:
        cfg = load_train_config(args.config, overrides)
    except TrainConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: OK")
        return 0
    from .trainer import Trainer

    trainer = Trainer(cfg, resume=args.resume)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
