"""The ``trainer`` command (the FlowGRPO loop lands in the trainer issue; for now: help and version)."""

from __future__ import annotations

import argparse
import sys

from boogu_trainer import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainer",
        description="FlowGRPO post-training for Boogu-Image (LoRA). The training loop is not built yet.",
    )
    parser.add_argument("--version", action="version", version=f"boogu-trainer {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
