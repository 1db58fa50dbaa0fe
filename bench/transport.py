"""``python -m bench.transport``: the server-to-server data plane for snapshot replicas, chosen by
measurement: the same bytes from one process to another over loopback, per transport, beside a
raw TCP copy of them in the same run (issue 50, item 4; docs/replica_transport.md).

Rows (sender and receiver are separate processes; the one-process rows are the ceilings):

1. ``memcpy``: a memoryview slice copy of the bytes into a preallocated buffer (the memory's limit);
2. ``crc32``: the project's crc32 (``swap_state.common.checksum``: ISA-L where it has a wheel)
   over the bytes in chunks, one core (what verifying every chunk costs at most);
3. ``raw TCP`` (the baseline): ``socket.sendall`` of a memoryview over the /dev/shm-backed mmap
   source, ``recv_into`` a preallocated mmap buffer; nothing else;
4. ``framed TCP``: the stream our server would run: a stream header, then per chunk a fixed
   16-byte header (offset, length, crc32) and the bytes, bounded (a chunk over --chunk or past
   the buffer is refused), in order; the receiver verifies each chunk's crc32 ("+ crc32") or not,
   and acknowledges at the end;
5. ``gRPC stream``: client streaming of bytes messages (the same 16-byte header + one chunk) into
   a generic handler that copies each into the preallocated buffer, verifying crc32 or not;
   message size limits set to one chunk plus the header;
6. ``Mooncake TCP``: Mooncake Transfer Engine's TCP transport (P2P handshake, no metadata
   server), one ``transfer_sync_write`` of the sender's registered source into the receiver's
   registered buffer, then the completion is relayed to the receiver (through this process)
   with the chunks' crc32s, which it verifies ("+ crc32") or not. Run by a separate interpreter
   (--mooncake-python: scripts/bench_transport.sh builds .venv-mooncake), or skipped, saying why.

Each transfer is timed from just before the sender's first byte to the receiver holding the last
byte (and, for "+ crc32", having verified every chunk), on CLOCK_MONOTONIC (one clock for all
processes). After each, untimed, the receiver's crc32 of its whole buffer is compared with the
sender's of its source: a row whose bytes did not arrive intact fails the run. The receiver's
buffer is overwritten with a poison byte before each transfer. Rounds interleave the rows
(rotating which goes first), so that load on a shared machine hits all alike; "÷ raw TCP" is the
median of the per-round ratios. GB/s is 10^9 bytes per second.

Output under --out: transport.md (tables) and transport.json (every sample, checksums included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.hardware import cpu_model
from bench.transport_sides import REPLY_TIMEOUT_S, crc_impl
from bench.util import fmt_bytes, gbps, loadavg, parse_size, summarize

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[1]
MOONCAKE_VENV_PYTHON = REPO / ".venv-mooncake" / "bin" / "python"

#: (key, label, transport, crc verified, one process)
ROWS = (
    ("memcpy", "memcpy (one process: the memory's limit)", "local", False, True),
    ("crc32", "crc32 of the bytes (one process, one core)", "local", True, True),
    ("raw-tcp", "raw TCP (the baseline)", "raw", False, False),
    ("framed-tcp-crc", "framed TCP + crc32", "framed", True, False),
    ("framed-tcp", "framed TCP (no crc32)", "framed", False, False),
    ("grpc-crc", "gRPC stream + crc32", "grpc", True, False),
    ("grpc", "gRPC stream (no crc32)", "grpc", False, False),
    ("mooncake-crc", "Mooncake TCP + crc32", "mooncake", True, False),
    ("mooncake", "Mooncake TCP (no crc32)", "mooncake", False, False),
)
ROW = {r[0]: r for r in ROWS}
BASELINE = "raw-tcp"

class _Proc:
    """A worker process: ``python -m bench.transport_sides SPEC``, its replies read by a thread."""

    def __init__(self, python: str, spec: dict[str, Any], log):
        self.name = f"{spec['transport']}-{spec['role']}"
        self.popen = subprocess.Popen([python, "-m", "bench.transport_sides", json.dumps(spec)],
                                      cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                      text=True, bufsize=1)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.read()
        if not self.ready.get("ready"):
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {self.ready.get('error')}")

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.replies.put(json.loads(line))
        self.replies.put({"error": f"exited with status {self.popen.wait()}"})

    def send(self, op: str, **kw: Any) -> None:
        self.popen.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.popen.stdin.flush()

    def read(self) -> dict[str, Any]:
        try:
            reply = self.replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            reply = {"error": f"no reply in {REPLY_TIMEOUT_S:.0f} s"}
        if reply.get("error"):
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.read()

    def stop(self) -> None:
        try:
            self.send("quit")
            self.popen.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def _log(message: str) -> None:
    print(f"[bench.transport {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _fill(path: str, size: int, seed: int) -> None:
    """A /dev/shm file of ``size`` pseudo-random bytes (incompressible; nothing here compresses)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        block = 64 << 20
        for off in range(0, size, block):
            f.write(rng.integers(0, 256, min(block, size - off), dtype=np.uint8).tobytes())


def _mooncake_python(args) -> tuple[str | None, str | None]:
    """(interpreter, None) where ``import mooncake.engine`` works, else (None, why not)."""
    if args.no_mooncake:
        return None, "--no-mooncake"
    candidates = [args.mooncake_python] if args.mooncake_python else [str(MOONCAKE_VENV_PYTHON), sys.executable]
    reasons = []
    for python in candidates:
        if not os.path.exists(python):
            reasons.append(f"{python}: not found")
            continue
        probe = subprocess.run([python, "-c", "import mooncake.engine"], capture_output=True, text=True, timeout=120)
        if probe.returncode == 0:
            return python, None
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        reasons.append(f"{python}: {last}")
    return None, "; ".join(reasons) + " (scripts/bench_transport.sh builds .venv-mooncake)"


class _Pair:
    """The worker processes of one transport at one size and pin mode."""

    def __init__(self, transport: str, python: str, base: dict[str, Any], cpus: tuple[int | None, int | None], log):
        self.transport, self.procs = transport, []
        try:
            self.receiver = self._start(python, {**base, "transport": transport, "role": "receiver", "cpu": cpus[1]},
                                        log)
            self.sender = None
            if transport != "local":
                info = {k: self.receiver.ready[k] for k in ("port", "session", "addr") if k in self.receiver.ready}
                self.sender = self._start(python, {**base, **info, "transport": transport, "role": "sender",
                                                   "cpu": cpus[0]}, log)
        except Exception:
            self.stop()
            raise
        source = self.sender or self.receiver
        self.source_crc = source.ready["source_crc"]
        self.crc_impl = self.receiver.ready["crc_impl"]
        self.cpus = {"sender": source.ready["cpus"], "receiver": self.receiver.ready["cpus"]}

    def _start(self, python, spec, log) -> _Proc:
        proc = _Proc(python, spec, log)
        self.procs.append(proc)
        return proc

    def once(self, crc: bool) -> dict[str, Any]:
        """One transfer: seconds (first byte sent -> last byte in and verified), checksums."""
        self.receiver.call("arm", crc=crc)
        if self.transport == "local":
            got = self.receiver.call("finish", crc=crc)
            sent = {"t0": got["t0"]}
        elif self.transport == "mooncake":
            sent = self.sender.call("go", crc=crc)
            got = self.receiver.call("finish", crc=crc, crcs=sent.pop("crcs"))
        else:
            self.receiver.send("finish", crc=crc)
            sent = self.sender.call("go", crc=crc)
            got = self.receiver.read()
        # (a receiver that refused the stream or found a crc32 mismatch replied an error: raised by read)
        return {"seconds": got["t_end"] - sent["t0"], "received_crc": got["crc"]}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def raw_tcp_seconds(path: str, reps: int, shm_dir: str = "/dev/shm",
                    cpus: tuple[int | None, int | None] = (None, None)) -> list[float]:
    """The baseline row alone: the file ``path`` sent by one process to another over loopback
    into a buffer in ``shm_dir``, ``reps`` times; the seconds of each (for other benchmarks).
    ``cpus``: the sender's and the receiver's CPU (None: unpinned)."""
    size = os.path.getsize(path)
    fd, dst = tempfile.mkstemp(prefix="swap-state-bench-raw-", dir=shm_dir)
    os.ftruncate(fd, size)
    os.close(fd)
    try:
        with open(os.devnull, "w") as log:
            pair = _Pair("raw", sys.executable, {"size": size, "chunk": 8 << 20, "src": path, "dst": dst},
                         cpus, log)
            try:
                return [pair.once(crc=False)["seconds"] for _ in range(reps)]
            finally:
                pair.stop()
    finally:
        os.unlink(dst)


def _modes(pin: str, cpus: list[int]) -> list[tuple[str, tuple[int | None, int | None]]]:
    pinned = ("pinned", (cpus[0], cpus[1 % len(cpus)]))
    unpinned = ("unpinned", (None, None))
    return {"off": [unpinned], "on": [pinned], "both": [unpinned, pinned]}[pin]


def measure(args) -> dict[str, Any]:
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    chunk = parse_size(args.chunk)
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else [r[0] for r in ROWS]
    unknown = [r for r in wanted if r not in ROW]
    if unknown:
        raise SystemExit(f"unknown --rows {unknown}; known: {', '.join(ROW)}")
    if BASELINE not in wanted:
        wanted.insert(0, BASELINE)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin != "off" and len(cpus) < 2:
        raise SystemExit(f"--pin needs 2 usable CPUs; this process may use {cpus}")
    mooncake_python, mooncake_skip = (None, None)
    if any(ROW[r][2] == "mooncake" for r in wanted):
        mooncake_python, mooncake_skip = _mooncake_python(args)
        if mooncake_skip:
            _log(f"Mooncake rows skipped: {mooncake_skip}")
    pythons = {"local": sys.executable, "raw": sys.executable, "framed": sys.executable, "grpc": sys.executable,
               "mooncake": mooncake_python}
    crc, crc_name = crc_impl()
    work = tempfile.mkdtemp(prefix="swap-state-bench-transport-", dir=args.shm_dir)
    log_path = os.path.join(args.out, "transport-workers.log")
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {
        "machine": {"cpus": cpus, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "processor": cpu_model()},
        "args": {"sizes": sizes, "chunk": chunk, "reps": args.reps, "pin": args.pin, "rows": wanted},
        "crc_impl": crc_name, "mooncake_python": mooncake_python, "mooncake_skipped": mooncake_skip,
        "loadavg_before": loadavg(), "runs": [], "failures": [],
    }
    started = time.monotonic()
    try:
        with open(log_path, "w") as log:
            for size in sizes:
                src, dst = os.path.join(work, "source"), os.path.join(work, "replica")
                _fill(src, size, seed=size)
                with open(dst, "wb") as f:
                    f.truncate(size)
                with open(src, "rb") as f:
                    expected = _file_crc(f, crc, chunk)
                base = {"size": size, "chunk": chunk, "src": src, "dst": dst}
                for mode, mode_cpus in _modes(args.pin, cpus):
                    result["runs"].append(_run(size, mode, mode_cpus, base, wanted, pythons, mooncake_skip,
                                               expected, args.reps, log))
                os.unlink(src)
                os.unlink(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = time.monotonic() - started
    result["loadavg_after"] = loadavg()
    result["failures"] = [f"{fmt_bytes(run['size'])} {run['mode']} {key}: {row['failed']}"
                          for run in result["runs"] for key, row in run["rows"].items() if row.get("failed")]
    return result


def _file_crc(f, crc, chunk: int) -> int:
    value = 0
    while block := f.read(chunk):
        value = crc(block, value)
    return value & 0xFFFFFFFF


def _run(size, mode, mode_cpus, base, wanted, pythons, mooncake_skip, expected, reps, log) -> dict[str, Any]:
    _log(f"{fmt_bytes(size)}, {mode}: starting the workers")
    rows: dict[str, dict[str, Any]] = {key: {"label": ROW[key][1], "samples": [], "received_crcs": []}
                                       for key in wanted}
    pairs: dict[str, _Pair] = {}
    for key in wanted:
        transport = ROW[key][2]
        if transport == "mooncake" and mooncake_skip:
            rows[key]["skipped"] = mooncake_skip
            continue
        if transport in pairs:
            continue
        try:
            pairs[transport] = _Pair(transport, pythons[transport], base, mode_cpus, log)
        except Exception as exc:  # noqa: BLE001 - a transport that cannot start is a failed row, said
            for k in wanted:
                if ROW[k][2] == transport:
                    rows[k]["failed"] = str(exc)
    for key in wanted:
        pair = pairs.get(ROW[key][2])
        if pair is not None:
            rows[key].update(source_crc=pair.source_crc, crc_impl=pair.crc_impl, cpus=pair.cpus)
    live = [k for k in wanted if ROW[k][2] in pairs]
    try:
        for rep in range(reps):
            order = live[rep % len(live):] + live[:rep % len(live)] if live else []
            for key in order:
                row = rows[key]
                if row.get("failed"):
                    continue
                try:
                    got = pairs[ROW[key][2]].once(crc=ROW[key][3])
                except Exception as exc:  # noqa: BLE001
                    row["failed"] = f"round {rep}: {exc}"
                    continue
                row["samples"].append(got["seconds"])
                row["received_crcs"].append(got["received_crc"])
                if row["source_crc"] != expected or got["received_crc"] != expected:
                    row["failed"] = (f"round {rep}: bytes not intact (sender's source crc32 {row['source_crc']:08x}, "
                                     f"receiver's {got['received_crc']:08x}, expected {expected:08x})")
            _log(f"{fmt_bytes(size)}, {mode}: round {rep + 1}/{reps} done")
    finally:
        for pair in pairs.values():
            pair.stop()
    base_samples = rows[BASELINE]["samples"]
    for key, row in rows.items():
        rates = [gbps(size, s) for s in row["samples"]]
        row["gbps"] = summarize(rates) if rates else {"n": 0}
        row["gbps_samples"] = rates
        if key != BASELINE and rates and len(base_samples) == len(rates):
            ratios = [gbps(size, s) / gbps(size, b) for s, b in zip(row["samples"], base_samples)]
            row["ratio_to_raw_tcp"] = summarize(ratios)
        row["intact"] = (not row.get("failed") and not row.get("skipped") and bool(row["samples"])
                         and all(c == expected for c in row["received_crcs"]))
    return {"size": size, "mode": mode, "expected_crc": expected, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Replica transport: the same bytes process to process over loopback", "",
        f"{m['processor']}; CPUs usable: {m['cpus']} of {m['cpu_count']}; {m['platform']}; Python {m['python']}. "
        f"Chunk {fmt_bytes(result['args']['chunk'])}; crc32: {result['crc_impl']}; "
        f"load average before {result['loadavg_before']}, after {result['loadavg_after']}; "
        f"{result['seconds']:.0f} s in all.", "",
        "GB/s = 10^9 bytes/s over first byte sent -> last byte received (and verified, for \"+ crc32\"); "
        "\"÷ raw TCP\": median of the per-round ratios to the raw TCP copy of the same round; worst = slowest rep.",
        "",
    ]
    if result["mooncake_skipped"]:
        lines += [f"Mooncake skipped: {result['mooncake_skipped']}", ""]
    for run in result["runs"]:
        lines += [f"## {fmt_bytes(run['size'])}, {run['mode']}", "",
                  "| transport | n | GB/s median | mean | worst | ÷ raw TCP | bytes intact |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for key, row in run["rows"].items():
            if row.get("skipped"):
                lines.append(f"| {row['label']} | 0 | skipped: {row['skipped']} | | | | |")
                continue
            g = row["gbps"]
            ratio = row.get("ratio_to_raw_tcp", {}).get("median")
            ratio_text = "1" if key == BASELINE else (f"{ratio:.2f}" if ratio is not None else "n/a")
            if g["n"]:
                cells = f"{g['median']:.2f} | {g['mean']:.2f} | {g['min']:.2f} | {ratio_text}"
            else:
                cells = "n/a | | | "
            intact = "yes" if row["intact"] else f"**no**: {row.get('failed', 'no sample')}"
            if ROW[key][4] and key == "crc32":
                intact = "(reads only)" if not row.get("failed") else f"**no**: {row['failed']}"
            lines.append(f"| {row['label']} | {g['n']} | {cells} | {intact} |")
        lines.append("")
    if result["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in result["failures"]] + [""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="results", help="folder for transport.md, transport.json and the workers' "
                   "log (transport-workers.log)")
    p.add_argument("--sizes", default="256M,1G", help="comma-separated transfer sizes (K/M/G binary suffixes)")
    p.add_argument("--reps", type=int, default=5, help="transfers per row and size (interleaved rounds)")
    p.add_argument("--chunk", default="8M", help="chunk (one framed-TCP frame, one gRPC message, one crc32)")
    p.add_argument("--pin", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="put the sender and the receiver on separate CPUs (sched_setaffinity, set at each worker's "
                   "start); '--pin' alone is 'on'; 'both' measures unpinned, then pinned")
    p.add_argument("--rows", default=None, help=f"comma-separated subset of the rows ({', '.join(ROW)}); raw-tcp "
                   "is always measured (the baseline); unset: all")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake rows (said in the table)")
    p.add_argument("--mooncake-python", default=None, help="interpreter that imports mooncake.engine (default: "
                   ".venv-mooncake/bin/python, then this one; scripts/bench_transport.sh sets it up)")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs folder for the source and the receivers' buffer")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from bench.report import write_json

    result = measure(args)
    text = markdown(result)
    with open(os.path.join(args.out, "transport.md"), "w") as f:
        f.write(text)
    write_json(result, os.path.join(args.out, "transport.json"))
    print(text)
    if result["failures"]:
        _log("FAILED: " + "; ".join(result["failures"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
