"""``swap-state export``: its arguments and its run, shared by the admin CLI
(``swap-state export``) and ``python -m swap_state.client.export``.

torch is imported only when an export runs, so ``swap-state status`` stays light.
"""

from __future__ import annotations

import argparse
import re
import sys

from swap_state.common.errors import ConfigError
from swap_state.common.object_store import STORE_FLAG
from swap_state.common.snapshot_errors import SnapshotError, SnapshotStoreUnavailable

__all__ = ["EXPORT_FORMATS", "add_export_arguments", "main", "run_export"]

#: ``swap-state export --format``: swap_state.client.export.snapshot.FORMATS, and a torchtitan checkpoint.
EXPORT_FORMATS = ("torch", "dcp", "torchtitan")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``swap-state export`` (also ``python -m swap_state.client.export``)."""
    parser.add_argument(
        "snapshot", help="a snapshot directory (e.g. /snapshots/run1/step-000000001000, or "
        "/snapshots/run1/step-1000: a step with or without the directory's zero padding, here and "
        "in ids), or with --snapshot-dir or --snapshot-store an id such as run1/step-1000 or "
        "run1/latest; with --format torchtitan a torchtitan checkpoint directory saved in "
        "snapshot mode (e.g. outputs/checkpoint/step-1000)",
    )  # fmt: skip
    parser.add_argument("out", help="output file (torch) or directory (dcp; torchtitan: must not exist yet)")
    parser.add_argument(
        "--format", choices=EXPORT_FORMATS, default="torch",
        help="torch: one torch.save file of the optimizer state; dcp: a DCP directory of it; "
        "torchtitan: a plain torchtitan checkpoint (model, optimizer, small states) that "
        "torchtitan without swap-state resumes from (default: torch)",
    )  # fmt: skip
    parser.add_argument(
        "--snapshot-dir", default=None, help="the --snapshot-dir of the server that took the snapshot "
        "(with --format torchtitan: this or --snapshot-store is required; the embedded server's is "
        "<job.dump_folder>/swap-state-snapshots)",
    )  # fmt: skip
    parser.add_argument(
        "--snapshot-store", default=None, metavar="URI",
        help="read the snapshot from this snapshot store (the servers' --snapshot-store) instead: "
        "s3://BUCKET/PREFIX on any S3-compatible store, with endpoint, region and credentials from "
        "the standard AWS environment (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), or file:///PATH or a PATH on a shared "
        "filesystem. SNAPSHOT is then an id (run1/step-1000, run1/latest); with --format "
        "torchtitan the checkpoint names it. Every byte read is verified. Not with --snapshot-dir",
    )  # fmt: skip
    parser.add_argument(
        "--snapshot-store-timeout", type=float, default=60.0, metavar="SECONDS",
        help="seconds one request to --snapshot-store may take, retries included (default: 60)",
    )  # fmt: skip


def _one_line(exc: Exception, store: str | None) -> str:
    """The error on one line, an object not named twice (``reading X failed: X: why``); a
    failing store's names the flag and the URI, and for S3 where its settings come from."""
    message = re.sub(r"reading (\S+) failed: \1: ", r"reading \1 failed: ", " ".join(str(exc).split()))
    if store is not None and isinstance(exc, SnapshotStoreUnavailable):
        if not message.startswith(STORE_FLAG):
            message = f"{STORE_FLAG} {store}: {message}"
        if store.startswith("s3://"):
            message += " (endpoint and credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)"
    return message


def run_export(args: argparse.Namespace) -> int:
    """Run parsed ``swap-state export`` arguments: 0, or 1 with the error on stderr."""
    from swap_state.client.export.snapshot import ExportError, export_snapshot

    try:
        if not args.snapshot_store_timeout > 0:
            raise ExportError("--snapshot-store-timeout must be > 0 seconds")
        if args.format == "torchtitan":
            from swap_state.client.export.torchtitan import export_torchtitan_checkpoint

            titan = export_torchtitan_checkpoint(
                args.snapshot, args.out, args.snapshot_dir, snapshot_store=args.snapshot_store,
                store_timeout_s=args.snapshot_store_timeout,
            )
            print(
                f"exported {args.snapshot} with snapshot {titan.snapshot_id} (ranks "
                f"{list(titan.ranks)}: {titan.model_tensors} model tensors, "
                f"{titan.optimizer_entries} optimizer entries) to {titan.out} (torchtitan)"
            )
            return 0
        result = export_snapshot(
            args.snapshot, args.out, args.format, snapshot_dir=args.snapshot_dir,
            snapshot_store=args.snapshot_store, store_timeout_s=args.snapshot_store_timeout,
        )
    except (SnapshotError, ConfigError) as exc:  # not found, corrupt, not exportable: no traceback
        print(f"swap-state export: {_one_line(exc, args.snapshot_store)}", file=sys.stderr)
        return 1
    share = ""
    if len(result.ranks) < result.world_size:
        share = f", ranks {list(result.ranks)} of world_size {result.world_size}"
    print(
        f"exported {result.snapshot_id} ({result.tensors} tensors, {result.entries} entries"
        f"{share}) to {result.out} ({result.format})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``swap-state export SNAPSHOT OUT [--format torch|dcp|torchtitan] [--snapshot-dir DIR |
    --snapshot-store URI]``."""
    parser = argparse.ArgumentParser(
        prog="swap-state export",
        description="write a snapshot as a standard torch or DCP checkpoint, or a snapshot-mode "
        "torchtitan checkpoint as a plain one",
    )
    add_export_arguments(parser)
    return run_export(parser.parse_args(argv))
