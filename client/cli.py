"""``swap-state``: the operator's command line (status, snapshots, export).

Examples::

    swap-state status --server unix:///run/swap-state/swap-state.sock
    swap-state snapshots --server unix:///run/swap-state/swap-state.sock --job-id run1
    swap-state export /snapshots/run1/step-000000001000 --format torch out.pt

``status`` and ``snapshots`` talk to a running server; ``export`` reads a snapshot directory
and needs neither the server nor anything of swap-state at load time.
"""

from __future__ import annotations

import argparse
import os
import sys

from swap_state.client.export.cli import add_export_arguments, run_export
from swap_state.common.addresses import default_listen

__all__ = ["main", "build_parser"]


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get("SWAP_STATE_SERVER") or default_listen(),
        help="server address: unix:///path/to.sock or tcp://host:port (default: $SWAP_STATE_SERVER, "
        f"else the server's own default, {default_listen()})",
    )
    parser.add_argument(
        "--token-file", default=None, help="file holding the server's --token-file secret"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="RPC deadline in seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swap-state", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="sessions, budget and running snapshots")
    _add_server_args(status)
    snaps = sub.add_parser("snapshots", help="list durable snapshots, in the server's --snapshot-dir and its --snapshot-store")
    _add_server_args(snaps)
    snaps.add_argument("--job-id", default="", help="only this job (default: all)")
    snaps.add_argument(
        "snapshot", nargs="?", default="", metavar="SNAPSHOT",
        help="only this snapshot: an id such as run1/step-1000 (the step with or without the "
        "directory's zero padding: run1/step-000000001000 is the same) or run1/latest; "
        "step-1000 or latest with --job-id",
    )  # fmt: skip
    export = sub.add_parser(
        "export",
        help="write a snapshot as a standard torch or DCP checkpoint, or a snapshot-mode "
        "torchtitan checkpoint as a plain one (--format torchtitan)",
    )
    add_export_arguments(export)
    return parser


def _client(args):
    from swap_state.client.remote.rpc import ClientConfig, SwapStateClient

    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    return SwapStateClient(ClientConfig(args.server, token=token, timeout_s=args.timeout))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def _amount(n: int) -> str:
    """GiB like the rest of the line, unless that would read 0.000 (small copy slots)."""
    from swap_state.common.sizes import format_size

    return _gib(n) if n == 0 or n >= (1 << 30) // 2000 else format_size(n)


def budget_rest(stats) -> str:
    """The budget that is neither used nor free, said: ``free F; P held for the
    copy-before-write pool (--cow-budget)`` (the pool's slots sessions hold count as used), and
    what restores hold while they run."""
    parts = [f"free {_gib(stats.budget_free_bytes)}"]
    held = stats.budget_total_bytes - stats.budget_used_bytes - stats.budget_free_bytes
    pool_held = stats.cow_pool_bytes - stats.cow_pool_used_bytes
    if stats.cow_pool_bytes:
        pool = f"{_amount(pool_held)} held for the copy-before-write pool (--cow-budget)"
        if stats.cow_pool_used_bytes:
            pool += f", whose other {_amount(stats.cow_pool_used_bytes)} are sessions' copy slots (in used)"
        parts.append(pool)
    if held > pool_held:  # a server without the pool fields says nothing of it: all is "held"
        what = "restores in progress" if stats.cow_pool_bytes else "the copy-before-write pool (--cow-budget) and restores"
        parts.append(f"{_amount(held - pool_held)} held by {what}")
    return "; ".join(parts)


def _status(args) -> int:
    client = _client(args)
    try:
        stats = client.stats()
    finally:
        client.close()
    print(
        f"budget: used {_gib(stats.budget_used_bytes)} / {_gib(stats.budget_total_bytes)} "
        f"({budget_rest(stats)}); steps committed: {stats.steps_committed_total}"
    )
    if stats.stage_threads or stats.persist_bytes_per_second:
        how = "measured" if stats.persist_bandwidth_measured else "assumed"
        print(
            f"snapshots: persist {stats.persist_bytes_per_second / 1e9:.2f} GB/s ({how}), forward/backward "
            f"{stats.assumed_fwd_bwd_seconds:g} s (assumed), {stats.stage_threads} staging thread(s)"
        )
    adopted = (f" ({stats.sessions_adopted_total} adopted from the previous server, "
               f"{stats.reconnects_total} trainer reconnects)") if stats.sessions_adopted_total else ""
    print(f"sessions: {len(stats.sessions)}{adopted}")
    warnings = []
    for s in stats.sessions:
        step = s.last_committed_step if s.has_committed_step else "-"
        model = f" (model {_gib(s.model_bytes)})" if s.model_bytes else ""  # whole-state snapshots
        budget = ""
        if s.copy_slot_bytes or s.copy_budget_needed_bytes:
            budget = (f" copy slots {_gib(s.copy_slot_bytes)} (needed {_gib(s.copy_budget_needed_bytes)}"
                      f"{', SHORT' if s.copy_budget_warning else ''})")
        print(
            f"  {s.job_id}/rank {s.rank}/{s.world_size} gen {s.generation} {s.state}"
            f"{' (adopted)' if s.adopted else ''} {_gib(s.segment_bytes)}{model} last step {step}{budget}"
        )
        if s.copy_budget_warning:
            warnings.append(f"{s.job_id}/rank {s.rank}: {s.copy_budget_warning}")
    for snap in stats.snapshots_in_progress:
        pct = 100.0 * snap.bytes_persisted / max(1, snap.bytes_total)
        print(
            f"  snapshot {snap.snapshot_id} rank {snap.rank}: {snap.state} {pct:.1f}%; server staged "
            f"{snap.server_staged_chunks} chunks, trainer copied {snap.cow_copies}, "
            f"back-pressure waits {snap.backpressure_waits}"
        )
    for warning in warnings:
        print(f"WARNING {warning}")
    return 0


def _snapshots(args) -> int:
    from swap_state.common.errors import InvalidArgument
    from swap_state.common.names import parse_snapshot_id

    ref = None
    if args.snapshot:
        try:
            ref = parse_snapshot_id(args.snapshot, args.job_id or None)
        except InvalidArgument as e:
            print(f"swap-state snapshots: {e}", file=sys.stderr)
            return 2
    client = _client(args)
    try:
        reply = client.list_snapshots(ref.job_id if ref else args.job_id)
    finally:
        client.close()
    snapshots = [s for s in reply.snapshots if ref is None or (s.latest if ref.latest else s.step == ref.step)]
    for snap in snapshots:
        marker = " (latest)" if snap.latest else ""
        held = list(snap.ranks)
        if held and len(held) < snap.world_size:
            ranks = f"ranks {','.join(map(str, held))} of {snap.world_size}"
        else:
            ranks = f"{snap.world_size} ranks"
        print(f"{snap.snapshot_id}\t{ranks}\t{_gib(snap.bytes)}\t{_where(snap)}{marker}")
    if not snapshots:
        print(f"no snapshot {ref}" if ref is not None else "no snapshots")
    return 0


def _where(snap) -> str:
    """Which tiers hold the snapshot, and where: ``local <dir>``, ``store <uri>``, or both
    (``local+store``); only the directory when the snapshot is not in a store."""
    if not snap.stored:
        return snap.path
    if not snap.local:
        return f"store {snap.store_path}"
    return f"local+store {snap.path} {snap.store_path}"


def _export(args) -> int:
    return run_export(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from swap_state.client.remote.rpc import SwapStateError

    handlers = {"status": _status, "snapshots": _snapshots, "export": _export}
    try:
        return handlers[args.command](args)
    except SwapStateError as e:
        print(f"swap-state: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
