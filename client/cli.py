"""``swap-state``: the operator's command line (status, snapshots, export, plan).

Examples::

    swap-state plan --model llama3:8B --world-size 64 --checkpoint snapshot
    swap-state status --server unix:///run/swap-state/swap-state.sock
    swap-state snapshots --server unix:///run/swap-state/swap-state.sock --job-id run1
    swap-state export /snapshots/run1/step-000000001000 --format torch out.pt

``status`` and ``snapshots`` talk to a running server; ``export`` reads a snapshot offline.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import re
import sys

from swap_state.client.remote.environment import server_from_env
from swap_state.client.remote.rpc import ClientConfig
from swap_state.common.addresses import default_listen
from swap_state.common.errors import ConfigError, InvalidRequestError, SwapStateError
from swap_state.common.names import parse_snapshot_id
from swap_state.common.object_store import STORE_FLAG, STORE_TIMEOUT_S
from swap_state.common.segment import ASSUMED_FWD_BWD_S, ASSUMED_PERSIST_BYTES_PER_S
from swap_state.common.sizes import format_size
from swap_state.common.sizing import plan_sizes, replica_lines
from swap_state.common.snapshot_errors import SnapshotError, StoreUnavailableError

__all__ = ["main", "build_parser", "run_export"]


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=server_from_env() or default_listen(),
                        help="server address: unix:///path/to.sock or tcp://host:port (default: $SWAP_STATE_SERVER, "
                        f"else the server's own default, {default_listen()})")
    parser.add_argument("--token-file", default=None,
                        help="file holding the server's --token-file secret (default: $SWAP_STATE_TOKEN_FILE)")
    parser.add_argument("--timeout", type=float, default=ClientConfig.rpc_timeout_s,
                        help=f"RPC deadline in seconds (default: {ClientConfig.rpc_timeout_s:g})")
    parser.add_argument("--tls-root-cert", default=None, metavar="PEM",
                        help="roots that sign a tcp:// server's certificate (default: $SWAP_STATE_TLS_ROOT_CERT)")
    parser.add_argument("--tls-client-cert", default=None, metavar="PEM",
                        help="this client's certificate, for a server with --tls-client-ca "
                        "(default: $SWAP_STATE_TLS_CLIENT_CERT)")
    parser.add_argument("--tls-client-key", default=None, metavar="PEM",
                        help="that certificate's key (default: $SWAP_STATE_TLS_CLIENT_KEY)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swap-state", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server_args(sub.add_parser("status", help="sessions, budget and running snapshots"))
    snaps = sub.add_parser("snapshots", help="list durable snapshots, in the server's --snapshot-dir and its --snapshot-store")
    _add_server_args(snaps)
    snaps.add_argument("--job-id", default="", help="only this job (default: all)")
    snaps.add_argument("snapshot", nargs="?", default="", metavar="SNAPSHOT", help="only this snapshot: an id such as "
                       "run1/step-1000 (or run1/step-000000001000) or run1/latest; step-1000 or latest with --job-id")
    export = sub.add_parser("export", help="write a snapshot as a standard torch or DCP checkpoint, or a "
                            "snapshot-mode torchtitan checkpoint as a plain one")
    _add_export_arguments(export)
    plan = sub.add_parser("plan",
                          help="the shared memory a job needs, per rank and per host, and the --shm-size to give",
                          description="Sizes a host's server for a job: the Adam moments per rank (and the parameters' "
                          "copy of whole-state snapshots), the copy pool for snapshots without a pause, and "
                          "the --shm-size and --cow-budget to start each host's swap-state-server with.")
    _add_plan_arguments(plan)
    return parser


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("snapshot", help="a snapshot directory (e.g. /snapshots/run1/step-1000: the step with or "
                        "without zero padding, here and in ids), or with --snapshot-dir or --snapshot-store an id such "
                        "as run1/step-1000 or run1/latest; with --format torchtitan a snapshot-mode torchtitan "
                        "checkpoint directory (e.g. outputs/checkpoint/step-1000)")
    parser.add_argument("out", help="output file (torch) or directory (dcp; torchtitan: must not exist yet)")
    parser.add_argument("--format", choices=("torch", "dcp", "torchtitan"), default="torch",
                        help="torch: one torch.save file of the optimizer state; dcp: a DCP directory of it; "
                        "torchtitan: a plain torchtitan checkpoint (model, optimizer, small states) that "
                        "torchtitan without swap-state resumes from (default: torch)")
    parser.add_argument("--snapshot-dir", default=None, help="the --snapshot-dir of the server that took the snapshot "
                        "(with --format torchtitan: this or --snapshot-store is required; the embedded server's is "
                        "<job.dump_folder>/swap-state-snapshots)")
    parser.add_argument("--snapshot-store", default=None, metavar="URI",
                        help="read the snapshot from this snapshot store (the servers' --snapshot-store): "
                        "s3://BUCKET/PREFIX on any S3-compatible store (endpoint, region and credentials from the "
                        "standard AWS_* environment variables), file:///PATH or a PATH on a shared filesystem; "
                        "SNAPSHOT is then an id (with --format torchtitan the checkpoint names it). Every byte "
                        "read is verified. Not with --snapshot-dir")
    parser.add_argument("--snapshot-store-timeout", type=float, default=STORE_TIMEOUT_S, metavar="SECONDS",
                        help="seconds one request to --snapshot-store may take, retries included "
                        f"(default: {STORE_TIMEOUT_S:g})")


def _one_line(exc: Exception, store: str | None) -> str:
    """The error on one line, an object not named twice (``reading X failed: X: why``); a
    failing store's names the flag and the URI, and for S3 where its settings come from."""
    message = re.sub(r"reading (\S+) failed: \1: ", r"reading \1 failed: ", " ".join(str(exc).split()))
    if store is not None and isinstance(exc, StoreUnavailableError):
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
        store = dict(snapshot_store=args.snapshot_store, store_timeout_s=args.snapshot_store_timeout)
        if args.format == "torchtitan":
            from swap_state.client.export.torchtitan import export_torchtitan_checkpoint

            result = export_torchtitan_checkpoint(args.snapshot, args.out, args.snapshot_dir, **store)
        else:
            result = export_snapshot(args.snapshot, args.out, args.format, snapshot_dir=args.snapshot_dir, **store)
    except (SnapshotError, ConfigError) as exc:  # not found, corrupt, not exportable: no traceback
        print(f"swap-state export: {_one_line(exc, args.snapshot_store)}", file=sys.stderr)
        return 1
    if result.format == "torchtitan":
        print(f"exported {args.snapshot} with snapshot {result.snapshot_id} (ranks {list(result.ranks)}: "
              f"{result.model_tensors} model tensors, {result.entries} optimizer entries) to {result.out} (torchtitan)")
        return 0
    share = (f", ranks {list(result.ranks)} of world_size {result.world_size}"
             if len(result.ranks) < result.world_size else "")
    print(f"exported {result.snapshot_id} ({result.tensors} tensors, {result.entries} entries{share}) to {result.out} "
          f"({result.format})")
    return 0


def _add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count, e.g. 8B, 405M or 8030261248")
    what.add_argument("--model", metavar="NAME:FLAVOR",
                      help="a torchtitan 0.2 model and flavour, e.g. llama3:8B (counted on the meta device)")
    plan.add_argument("--world-size", type=int, default=8, help="ranks of the job, e.g. 64 (default 8)")
    plan.add_argument("--ranks-per-host", type=int, default=None,
                      help="ranks on each host's server, e.g. 8 (default: 8, or the world size when smaller)")
    plan.add_argument("--checkpoint", choices=("full", "snapshot"), default="full",
                      help="torchtitan's swap_state_checkpoint: snapshot adds the parameters' copy (default full)")
    plan.add_argument("--moments", choices=("float32", "bfloat16"), default="float32",
                      help="dtype of the Adam moments, e.g. bfloat16 (default float32)")
    plan.add_argument("--amsgrad", action="store_true", help="a third moment per parameter (max_exp_avg_sq)")
    plan.add_argument("--persist-gbps", type=float, default=None,
                      help="GB/s the server persists snapshots at, e.g. 2.5 (default: the server's assumed "
                      "1.0): sizes the copy pool of --checkpoint snapshot")
    plan.add_argument("--step-seconds", type=float, default=None,
                      help="seconds of a forward and backward, e.g. 1.5 (default: the server's assumed 0.1): "
                      "what the disk has to persist in before the next step overwrites")
    plan.add_argument("--replica-gbps", type=float, default=None,
                      help="GB/s one host can send to its peer, e.g. 12 (a 100 Gb/s link): adds the shortest "
                      "RemoteConfig.replica_interval the link and --step-seconds allow, and the --replica-size "
                      "each peer needs (servers with --replica-peers)")
    plan.add_argument("--no-fsdp", action="store_true",
                      help="every rank holds every parameter (DDP, or tensor/pipeline parallel alone: "
                      "give --params as one rank's count)")


def _parse_count(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    text = text.strip().upper()
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise SystemExit(f"swap-state plan: --params {text!r}: expected a count such as 8B, 405M or 8030261248") from None


def _count_model(spec: str) -> int:
    """Parameters of a torchtitan 0.2 model flavour, built on the meta device (no memory)."""
    import torch

    name, _, flavor = spec.partition(":")
    try:
        from torchtitan.protocols.train_spec import get_train_spec

        train_spec = get_train_spec(name)
        args = train_spec.model_args[flavor]
    except Exception as exc:  # not installed, another torchtitan line, a name it lacks
        raise SystemExit(f"swap-state plan: --model {spec}: {exc!r}; give --params instead") from None
    with torch.device("meta"):
        model = train_spec.model_cls(args)
    return sum(p.numel() for p in model.parameters())


def _plan(args) -> int:
    params = _parse_count(args.params) if args.params else _count_model(args.model)
    ranks_per_host = args.ranks_per_host or min(8, args.world_size)
    snapshots = args.checkpoint == "snapshot"
    try:
        plan = plan_sizes(params, args.world_size, ranks_per_host, sharded=not args.no_fsdp,
                          moment_bytes=2 if args.moments == "bfloat16" else 4,
                          model_bytes_per_param=4 if snapshots else 0, amsgrad=args.amsgrad, snapshots=snapshots,
                          persist_bytes_per_s=args.persist_gbps * 1e9 if args.persist_gbps else ASSUMED_PERSIST_BYTES_PER_S,
                          fwd_bwd_s=args.step_seconds or ASSUMED_FWD_BWD_S)
    except ValueError as exc:
        raise SystemExit(f"swap-state plan: {exc}") from None
    lines = plan.lines()
    if args.replica_gbps:
        lines += replica_lines(plan, args.replica_gbps * 1e9, args.step_seconds or ASSUMED_FWD_BWD_S)
    print("\n".join(lines))
    return 0


def _client(args):
    from swap_state.client.remote.rpc import SwapStateClient

    token = pathlib.Path(args.token_file).read_text().strip() if args.token_file else None
    config = ClientConfig(args.server, token=token, tls_root_cert=args.tls_root_cert,
                          tls_client_cert=args.tls_client_cert, tls_client_key=args.tls_client_key,
                          rpc_timeout_s=args.timeout, connect_timeout_s=args.timeout, server_wait_s=0.0)
    try:
        client = SwapStateClient(config)
    except ValueError as exc:
        raise SystemExit(f"swap-state: {exc}") from None
    try:
        client.wait_ready()  # a server started a moment ago (a socket still to appear) is waited for
    except BaseException:
        client.close()
        raise
    return client


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def _amount(n: int) -> str:
    """GiB like the rest of the line, unless that would read 0.000 (small copy slots)."""
    return _gib(n) if n == 0 or n >= (1 << 30) // 2000 else format_size(n)


def budget_rest(stats) -> str:
    """The budget that is neither used nor free, said: the copy-before-write pool's share (its
    slots that sessions hold count as used), and what restores hold while they run."""
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
    with contextlib.closing(_client(args)) as client:
        stats = client.stats()
    print(f"budget: used {_gib(stats.budget_used_bytes)} / {_gib(stats.budget_total_bytes)} "
          f"({budget_rest(stats)}); steps committed: {stats.steps_committed_total}")
    if stats.stage_threads or stats.persist_bytes_per_second:
        how = "measured" if stats.persist_bandwidth_measured else "assumed"
        print(f"snapshots: persist {stats.persist_bytes_per_second / 1e9:.2f} GB/s ({how}), forward/backward "
              f"{stats.assumed_fwd_bwd_seconds:g} s (assumed), {stats.stage_threads} staging thread(s)")
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
        print(f"  {s.job_id}/rank {s.rank}/{s.world_size} gen {s.generation} {s.state}"
              f"{' (adopted)' if s.adopted else ''} {_gib(s.segment_bytes)}{model} last step {step}{budget}")
        if s.copy_budget_warning:
            warnings.append(f"{s.job_id}/rank {s.rank}: {s.copy_budget_warning}")
    for snap in stats.snapshots_in_progress:
        pct = 100.0 * snap.bytes_persisted / max(1, snap.bytes_total)
        print(f"  snapshot {snap.snapshot_id} rank {snap.rank}: {snap.state} {pct:.1f}%; server staged "
              f"{snap.server_staged_chunks} chunks, trainer copied {snap.cow_copies}, "
              f"back-pressure waits {snap.backpressure_waits}")
    for warning in warnings:
        print(f"WARNING {warning}")
    return 0


def _snapshots(args) -> int:
    ref = None
    if args.snapshot:
        try:
            ref = parse_snapshot_id(args.snapshot, args.job_id or None)
        except InvalidRequestError as e:
            print(f"swap-state snapshots: {e}", file=sys.stderr)
            return 2
    with contextlib.closing(_client(args)) as client:
        reply = client.list_snapshots(ref.job_id if ref else args.job_id)
    snapshots = [s for s in reply.snapshots if ref is None or (s.latest if ref.latest else s.step == ref.step)]
    for snap in snapshots:
        ranks = f"{snap.world_size} ranks"
        if snap.ranks and len(snap.ranks) < snap.world_size:
            ranks = f"ranks {','.join(map(str, snap.ranks))} of {snap.world_size}"
        print(f"{snap.snapshot_id}\t{ranks}\t{_gib(snap.bytes)}\t{_where(snap)}{' (latest)' if snap.latest else ''}")
    if reply.store_error:  # listed from this server's --snapshot-dir only: not "none"
        print(f"swap-state snapshots: the snapshot store could not be read, so only this server's own "
              f"snapshots are listed (the store may hold more, and newer): {reply.store_error}", file=sys.stderr)
        return 3
    if not snapshots:
        print(f"no snapshot {ref}" if ref is not None else "no snapshots")
    return 0


def _where(snap) -> str:
    """Which tiers hold the snapshot, and where: its directory alone, ``store <uri>`` or
    ``local+store``; then its replica's state and peer, if it has one."""
    if not snap.stored:
        where = snap.path
    elif not snap.local:
        where = f"store {snap.store_path}"
    else:
        where = f"local+store {snap.path} {snap.store_path}"
    if snap.replica_state:
        where += f"\treplica {snap.replica_state}" + (f" {snap.replica_peer}" if snap.replica_peer else "")
    return where


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"status": _status, "snapshots": _snapshots, "export": run_export, "plan": _plan}
    try:
        return handlers[args.command](args)
    except SwapStateError as e:
        print(f"swap-state: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
