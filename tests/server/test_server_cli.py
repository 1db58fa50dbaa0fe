"""The swap-state-server command as a process: flags, start-up checks, signals, shared memory."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time
import textwrap

import grpc
import pytest
from swap_server_testkit import Trainer, spec

from swap_state.common.caller_proof import CallerProof
from swap_state.common.server_config import ServerConfig
from swap_state.common.server_flags import attach_negative_values, config_to_argv, user_flags
from swap_state.proto import swap_state_pb2 as pb
from swap_state.proto import swap_state_pb2_grpc as pb_grpc
from swap_state.server.cli import build_parser, parse_config

pytestmark = pytest.mark.integration


def run_cli(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swap_state.server", *args], capture_output=True,
                          text=True, timeout=timeout)


def base_args(shm_dir, sock) -> list[str]:
    return ["--shm-size", "32M", "--listen", f"unix://{sock}", "--shm-dir", str(shm_dir),
            "--chunk-bytes", "64K", "--grace", "5"]


def test_help_explains_every_flag_with_an_example():
    result = run_cli(["--help"])
    assert result.returncode == 0
    flags = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    expected = {"--shm-size", "--listen", "--token-file", "--tenants", "--tenant-shm-quota", "--tenant-snapshot-quota", "--socket-group",
                "--snapshot-dir", "--grace",
                "--metrics-port", "--log-level", "--shm-dir", "--shm-group", "--chunk-bytes",
                "--cow-budget", "--direct-io", "--persist-max-bandwidth", "--stage-threads", "--model-copy-timeout", "--keep-latest",
                "--snapshot-store", "--snapshot-store-timeout", "--snapshot-store-max-bandwidth",
                "--tls-cert", "--discard-segments", "--free-segments-on-stop",
                "--tls-key", "--tls-client-ca", "--insecure", "--replica-peers", "--replica-listen",
                "--replica-size", "--replica-secret-file", "--replica-tls-cert", "--replica-tls-key", "--replica-tls-ca",
                "--replica-max-bandwidth"}
    assert {a.option_strings[0] for a in flags} == expected
    for action in flags:
        assert action.option_strings[0] in result.stdout
        assert "e.g." in action.help, f"{action.option_strings[0]} help has no example"
    assert "docker run --shm-size" in result.stdout


HIDDEN = ("mlock", "keepalive_interval", "stream_wait", "shutdown_grace", "max_tensors",
          "max_message_bytes", "metrics_host")


def test_flags_are_the_config_fields_with_their_docstrings_defaults_and_examples():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(actions) == {f.name for f in dataclasses.fields(ServerConfig)} - set(HIDDEN)
    for name, action in actions.items():
        assert action.option_strings == ["--" + name.replace("_", "-")]
    help_text = parser.format_help()
    for name in HIDDEN:
        assert "--" + name.replace("_", "-") not in help_text
    assert actions["shm_size"].required
    assert "never falls back to disk" in actions["shm_size"].help  # the field's docstring
    assert "Default: 64M." in actions["chunk_bytes"].help
    assert "Default: 30." in actions["grace"].help
    assert "Default: min(1G, shm-size/8)" in actions["cow_budget"].help
    assert "Default: /dev/shm." in actions["shm_dir"].help
    assert actions["log_level"].choices == ("debug", "info", "warning", "error")
    assert "``" not in help_text


def test_flag_spellings_parse_into_the_config():
    config = parse_config([
        "--shm-size", "2G", "--listen", "tcp://127.0.0.1:7070", "--insecure",
        "--metrics-port", "[::1]:9464", "--persist-max-bandwidth", "2G/s", "--grace", "1.5",
        "--chunk-bytes", "32M", "--cow-budget", "64M", "--keep-latest", "3",
        "--token-file", "/etc/t", "--snapshot-dir", "/ckpt", "--shm-dir", "/dev/shm",
        "--shm-group", "trainers", "--log-level", "debug",
    ])
    assert config == ServerConfig(
        shm_size=2 << 30, listen="tcp://127.0.0.1:7070", insecure=True, metrics_host="::1",
        metrics_port=9464, persist_max_bandwidth=2 << 30, grace=1.5, chunk_bytes=32 << 20,
        cow_budget=64 << 20, keep_latest=3, token_file=pathlib.Path("/etc/t"),
        snapshot_dir=pathlib.Path("/ckpt"), shm_group="trainers", log_level="debug",
    )
    assert parse_config(["--shm-size", "1G", "--metrics-port", "9464"]).metrics_host == "127.0.0.1"


@pytest.mark.parametrize(
    "config",
    [
        ServerConfig(shm_size=1 << 30),
        ServerConfig(shm_size=256 << 20, listen="unix:///tmp/x y/s.sock", grace=0.1,
                     chunk_bytes=1 << 20, snapshot_dir=pathlib.Path("/tmp/snap shots")),
        ServerConfig(shm_size=(3 << 30) + 4096, listen="tcp://[::1]:7070",
                     tls_cert=pathlib.Path("c.pem"), tls_key=pathlib.Path("k.pem"),
                     metrics_port=9464, metrics_host="::1", log_level="warning"),
        ServerConfig(shm_size=8 << 30, listen="tcp://0.0.0.0:1", insecure=True, cow_budget=0,
                     persist_max_bandwidth=123457, keep_latest=5, shm_group="-odd",
                     token_file=pathlib.Path("/etc/token"), shm_dir=pathlib.Path("/mnt/shm")),
        ServerConfig(shm_size=1 << 30, metrics_host="0.0.0.0"),  # metrics off, host kept
        ServerConfig(shm_size=1 << 30, cow_budget=128 << 20),  # the auto value, given
    ],
    ids=["defaults", "unix-small", "tls-v6", "insecure-everything", "metrics-host", "auto-cow"],
)
def test_argv_from_a_config_parses_back_into_it(config):
    argv = config_to_argv(config)
    assert parse_config(argv) == config
    assert argv[0].startswith("--shm-size=") and argv[1] == f"--listen={config.listen}"


def test_argv_names_only_what_differs_from_the_defaults():
    config = ServerConfig(shm_size=64 << 30, listen="unix:///tmp/s.sock", chunk_bytes=32 << 20,
                          grace=120)
    assert config_to_argv(config) == [
        "--shm-size=64G", "--listen=unix:///tmp/s.sock", "--grace=120", "--chunk-bytes=32M",
    ]  # no --cow-budget: the server derives the same pool from these flags
    assert {f.name for f in user_flags()} == {f.name for f in dataclasses.fields(ServerConfig)} - set(HIDDEN)


@pytest.mark.parametrize("setting", [{"mlock": False}, {"stream_wait": 1.0}, {"max_tensors": 10}])
def test_argv_refuses_a_setting_that_has_no_flag(setting):
    with pytest.raises(ValueError, match="no command-line flag"):
        config_to_argv(ServerConfig(shm_size=1 << 30, **setting))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "unix:///tmp/x.sock"], "--shm-size"),  # required
        (["--shm-size", "12Q"], "not a size"),
        # A leading dash is a value, not an option ("expected one argument"), and refused.
        (["--shm-size", "-5G"], "--shm-size must be positive"),
        (["--shm-size=-5G"], "--shm-size must be positive"),
        (["--shm-size", "1G", "--cow-budget", "-1G"], "--cow-budget must be >= 0"),
        (["--shm-size", "1G", "--listen", "tcp://127.0.0.1:7070"], "--insecure"),
        (["--shm-size", "1G", "--listen", "http://x"], "expected unix:///path"),
        (["--shm-size", "1G", "--chunk-bytes", "1000"], "multiple of the page size"),
        (["--shm-size", "1G", "--keep-latest", "1"], "--keep-latest must be >= 2"),
        (["--shm-size", "1G", "--direct-io", "reads"], "invalid choice: 'reads'"),
        (["--shm-size", "1G", "--cow-budget", "2G"], "exceeds --shm-size"),
        (["--shm-size", "1G", "--grace", "-1"], "must be >= 0"),
        (["--shm-size", "1G", "--tenant-shm-quota", "-5G"], "--tenant-shm-quota must be >= 0"),
        (["--shm-size", "1G", "--tenant-snapshot-quota", "-1G"], "--tenant-snapshot-quota must be >= 0"),
        (["--shm-size", "1G", "--metrics-port", "70000"], "out of range"),
        (["--shm-size", "1G", "--log-level", "loud"], "invalid choice"),
        (["--shm-size", "1G", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2_with_a_usage_message(args, message):
    result = run_cli(args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "usage: swap-state-server" in result.stderr


def test_negative_sizes_are_values_refused_by_the_flags_rule(capsys):
    for argv, message in [
        (["--shm-size", "-5G"], "--shm-size must be positive"),
        (["--shm-size", "-5"], "--shm-size must be positive"),
        (["--shm-size", "1G", "--chunk-bytes", "-64K"], "--chunk-bytes must be a positive multiple"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_config(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "expected one argument" not in err and message in err, err
    assert "(got -5.0GiB)" in run_cli(["--shm-size", "-5G"]).stderr
    # Only a value that starts with a dash and a digit is attached to its flag.
    assert attach_negative_values(
        ["--shm-size", "-5G", "--grace", "-1", "--insecure", "--shm-group", "g", "--", "-5"]
    ) == ["--shm-size=-5G", "--grace=-1", "--insecure", "--shm-group", "g", "--", "-5"]
    assert attach_negative_values(["--shm-size", "--insecure"]) == ["--shm-size", "--insecure"]


def test_shm_too_small_exits_non_zero_naming_the_docker_flag(shm_dir, sock_dir):
    sock = sock_dir / "s.sock"
    result = run_cli(["--shm-size", "100T", "--listen", f"unix://{sock}", "--shm-dir", str(shm_dir)])
    assert result.returncode == 1
    assert "docker run --shm-size" in result.stderr and "shm_size" in result.stderr
    assert "never falls back to disk" in result.stderr
    assert not sock.exists() and os.listdir(shm_dir) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_cleanly(server_process, shm_dir, sock_dir, connect, signum):
    sock = sock_dir / "s.sock"
    proc = server_process(base_args(shm_dir, sock) + ["--free-segments-on-stop"])
    proc.wait_ready(sock)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    trainer = Trainer(connect(f"unix://{sock}"))
    await trainer.attach()
    await trainer.keep_alive()
    seg = (await trainer.allocate([spec("m", (4096,))])).segment
    assert os.path.exists(seg.path)

    proc.proc.send_signal(signum)
    assert proc.wait(15) == 0, proc.output
    assert not sock.exists()
    assert os.listdir(shm_dir) == []  # --free-segments-on-stop: every segment freed
    assert "event=started" in proc.output and "event=stopped" in proc.output


async def test_a_stop_keeps_every_held_sessions_segment_for_the_next_server(server_process, shm_dir, sock_dir,
                                                                              connect):
    """Live sessions' segments, and an orphaned one within its --grace (its trainer detached
    keeping it, or died): a restart in that window must not lose what the server promised to
    keep. A segment detached without keep is freed."""
    sock = sock_dir / "s.sock"
    proc = server_process(base_args(shm_dir, sock))
    proc.wait_ready(sock)
    live, away, done = (Trainer(connect(f"unix://{sock}"), job) for job in ("live", "away", "done"))
    for trainer in (live, away, done):
        await trainer.attach()
        await trainer.keep_alive()
    kept = [(await t.allocate([spec("m", (4096,))])).segment for t in (live, away)]
    freed = (await done.allocate([spec("m", (4096,))])).segment
    await away.detach(keep=True)  # orphaned: its trainer went away, the state kept for --grace
    await done.detach(keep=False)
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output
    assert sorted(os.listdir(shm_dir)) == sorted(os.path.basename(s.path) for s in kept)
    assert not os.path.exists(freed.path)
    assert proc.output.count("event=session_kept") == 2
    for trainer in (live, away, done):
        trainer.close()
    trainer.close()


def test_second_server_on_the_same_socket_is_refused(server_process, shm_dir, sock_dir):
    sock = sock_dir / "s.sock"
    first = server_process(base_args(shm_dir, sock))
    first.wait_ready(sock)
    second = server_process(base_args(shm_dir, sock))
    assert second.wait(20) == 1
    assert "already running" in second.output
    first.wait_ready(sock, timeout=5)  # untouched and still serving
    assert first.terminate() == 0
    assert sorted(p.name for p in sock_dir.iterdir()) == []  # a clean stop leaves no socket, no lock
    third = server_process(base_args(shm_dir, sock))  # and the path is free again
    third.wait_ready(sock)
    assert third.terminate() == 0


def test_stale_socket_is_replaced_and_a_foreign_file_is_not(server_process, shm_dir, sock_dir):
    sock = sock_dir / "s.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()  # the file stays; nobody listens: what a killed server leaves behind
    proc = server_process(base_args(shm_dir, sock))
    proc.wait_ready(sock)
    assert "stale_socket_replaced" in proc.output
    assert proc.terminate() == 0

    sock.write_text("not a socket")
    result = run_cli(base_args(shm_dir, sock))
    assert result.returncode == 1 and "not a socket" in result.stderr
    assert sock.read_text() == "not a socket"


def _dirs(shm_dir, sock_dir, tmp_path) -> dict:
    snaps = tmp_path / "snaps"
    snaps.mkdir(mode=0o700)
    return {"socket": sock_dir, "snapshot": snaps, "shm": shm_dir}


@pytest.mark.parametrize("which", ["socket", "snapshot", "shm"])
def test_a_directory_other_users_can_write_is_refused_at_start(server_process, shm_dir, sock_dir, tmp_path, which):
    """Other users able to write where the server keeps its socket, snapshots or segments could
    plant or replace what it trusts: refused, naming the path and the fix; a sticky shared
    tmpfs (as /dev/shm) is fine for segments."""
    dirs = _dirs(shm_dir, sock_dir, tmp_path)
    args = [*base_args(shm_dir, sock_dir / "s.sock"), "--snapshot-dir", str(dirs["snapshot"])]
    os.chmod(dirs[which], 0o777)
    result = run_cli(args)
    assert result.returncode == 1, result.stderr
    assert f"{dirs[which]} can be written by other users" in result.stderr and "chmod go-w" in result.stderr
    assert result.stderr.count("can be written by other users") == 1  # said once
    if which == "shm":
        os.chmod(dirs[which], 0o1777)  # sticky: nobody removes or renames another's files
        if os.geteuid() == 0:
            os.chown(dirs[which], -1, 54321)  # another group's, as /dev/shm may be
        proc = server_process(args)
        proc.wait_ready(sock_dir / "s.sock")
        assert proc.terminate() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root (chown)")
@pytest.mark.parametrize("which", ["socket", "snapshot", "shm"])
def test_a_directory_another_user_owns_is_refused_at_start(shm_dir, sock_dir, tmp_path, which):
    dirs = _dirs(shm_dir, sock_dir, tmp_path)
    os.chown(dirs[which], 54321, -1)
    result = run_cli([*base_args(shm_dir, sock_dir / "s.sock"), "--snapshot-dir", str(dirs["snapshot"])])
    assert result.returncode == 1, result.stderr
    assert f"{dirs[which]} is owned by uid 54321" in result.stderr and "chown" in result.stderr


def _caller(sock) -> tuple[tuple[str, str], ...]:
    """The metadata of a call proving this process's uid to the server on ``sock``."""
    proof = CallerProof(sock)
    assert proof.create(), "the server has no <socket>.callers directory"
    return (proof.metadata,)


def _killed_with_a_segment(server_process, shm_dir, sock) -> tuple[str, str]:
    """A server that allocated one segment, then was killed: (session id, segment path)."""
    server = server_process(base_args(shm_dir, sock))
    server.wait_ready(sock)
    caller = _caller(sock)
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        stub = pb_grpc.SwapStateStub(channel)
        reply = stub.Attach(pb.AttachRequest(job_id="j", rank=0, world_size=1), timeout=10, metadata=caller)
        seg = stub.Allocate(pb.AllocateRequest(session_id=reply.session_id, generation=1,
                                               tensors=[spec("m", (1024,))]), timeout=10, metadata=caller).segment
    server.proc.send_signal(signal.SIGKILL)
    server.wait(10)
    assert os.path.exists(seg.path)  # SIGKILL: no chance to clean up
    return reply.session_id, seg.path


def test_a_killed_servers_segments_are_adopted_or_with_discard_removed(server_process, shm_dir, sock_dir):
    sock = sock_dir / "s.sock"
    session_id, path = _killed_with_a_segment(server_process, shm_dir, sock)
    second = server_process(base_args(shm_dir, sock))
    second.wait_ready(sock)
    assert os.path.exists(path)  # adopted: its trainer may come back
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        sessions = pb_grpc.SwapStateStub(channel).Stats(pb.StatsRequest(), timeout=10, metadata=_caller(sock)).sessions
    assert [(s.session_id, s.job_id, s.state, s.adopted) for s in sessions] == [(session_id, "j", "orphaned", True)]
    second.proc.send_signal(signal.SIGKILL)
    second.wait(10)
    # No trainer comes back: an adopted session goes through --grace like any.
    short = server_process(base_args(shm_dir, sock) + ["--grace", "0.5"])
    short.wait_ready(sock)
    deadline = time.monotonic() + 10
    while os.path.exists(path):
        assert time.monotonic() < deadline, "the adopted segment outlived --grace"
        time.sleep(0.05)
    assert short.terminate() == 0
    assert "session_adopted" in short.output and "reason=grace_expired" in short.output
    # An operator who wants everything gone says so.
    _, path = _killed_with_a_segment(server_process, shm_dir, sock)
    third = server_process(base_args(shm_dir, sock) + ["--discard-segments"])
    third.wait_ready(sock)
    assert not os.path.exists(path)
    assert "leftover_segments_removed" in third.output
    assert third.terminate() == 0


def test_wrong_token_is_unauthenticated(server_process, shm_dir, sock_dir, tmp_path):
    sock = sock_dir / "s.sock"
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    proc = server_process([*base_args(shm_dir, sock), "--token-file", str(token_file)])
    proc.wait_ready(sock)  # health needs no token
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        stub = pb_grpc.SwapStateStub(channel)
        request = pb.AttachRequest(job_id="j", rank=0, world_size=1)
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "t0ken"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Attach(request, timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Attach(request, timeout=10, metadata=(("authorization", "Bearer t0ken"),))
        assert reply.generation == 1
    assert proc.terminate() == 0


_READER = textwrap.dedent(
    """
    import hashlib, mmap, os, sys
    from swap_state.common.segment import SegmentHeader, Word
    path, offset, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    header = SegmentHeader(m)
    header.check()
    print(header[Word.COMMITTED_STEP], hashlib.sha256(m[offset:offset + length]).hexdigest())
    """
)


async def test_another_process_maps_the_segment_and_reads_what_one_wrote(
    server_process, shm_dir, sock_dir, connect
):
    sock = sock_dir / "s.sock"
    proc = server_process(base_args(shm_dir, sock))
    proc.wait_ready(sock)
    trainer = Trainer(connect(f"unix://{sock}"))
    await trainer.attach()
    await trainer.keep_alive()
    seg = (await trainer.allocate([spec("exp_avg", (64, 1024)), spec("exp_avg_sq", (64, 1024))])).segment
    placement = seg.tensors[1]
    payload = os.urandom(placement.nbytes)
    mapping = trainer.map()
    mapping[placement.offset : placement.offset + placement.nbytes] = payload
    await trainer.commit(7)  # the server process writes COMMITTED_STEP = 8 into the header

    reader = subprocess.run(
        [sys.executable, "-c", _READER, seg.path, str(placement.offset), str(placement.nbytes)],
        capture_output=True, text=True, timeout=30,
    )
    assert reader.returncode == 0, reader.stderr
    committed, digest = reader.stdout.split()
    assert committed == "8"
    assert digest == hashlib.sha256(payload).hexdigest()
    trainer.close()
    assert proc.terminate() == 0


async def _healthcheck(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "swap_state.server.healthcheck", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode()


async def test_healthcheck_command(start, sock_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok")
    server = await start(token_file=token_file)  # health needs no token
    code, out = await _healthcheck("--listen", server.address)
    assert code == 0 and "SERVING" in out
    code, out = await _healthcheck("--listen", f"unix://{sock_dir}/missing.sock", "--timeout", "1")
    assert code == 1 and "UNAVAILABLE" in out


async def test_an_adopted_session_waits_for_its_own_trainer_and_refuses_a_fresh_attach(
        server_process, shm_dir, sock_dir, connect):
    sock = sock_dir / "s.sock"
    args = base_args(shm_dir, sock) + ["--grace", "60"]
    first = server_process(args)
    first.wait_ready(sock)
    trainer = Trainer(connect(f"unix://{sock}"), "adopted")
    await trainer.attach()
    await trainer.keep_alive()
    await trainer.allocate([spec("m", (4096,))])
    mapping = trainer.map()
    mapping[-4096:] = b"\x07" * 4096  # the trainer's bytes, in the last page of the segment
    assert first.terminate() == 0, first.output  # live at the stop: its segment is kept
    second = server_process(args)
    second.wait_ready(sock)

    newcomer = Trainer(connect(f"unix://{sock}"), "adopted")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await newcomer.attach()  # a fresh Attach of that job/rank before its trainer is back
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "adopted its state and keeps it for that trainer" in refused.value.details()
    assert "(--grace)" in refused.value.details()

    trainer.stub = connect(f"unix://{sock}")
    await trainer.keep_alive()  # its own trainer: the same session id and generation
    assert mapping[-4096:] == b"\x07" * 4096
    reply = await trainer.stub.Stats(pb.StatsRequest(), timeout=10)
    [session] = [s for s in reply.sessions if s.job_id == "adopted"]
    assert (session.session_id, session.state, session.adopted) == (trainer.session_id, "live", True)
    assert reply.reconnects_total == 1

    # A trainer that ended while no server ran holds nothing: its restart reattaches at once.
    assert second.terminate() == 0, second.output  # live at the stop: its segment is kept
    trainer.close()
    third = server_process(args)
    third.wait_ready(sock)
    newcomer.stub = connect(f"unix://{sock}")
    reply = await newcomer.attach()
    assert (reply.session_id, reply.reattached, reply.has_segment) == (trainer.session_id, True, True)
    newcomer.close()


def test_a_start_up_error_is_printed_once_without_a_traceback(tmp_path):
    result = run_cli(["--shm-size", "64M", "--shm-dir", str(tmp_path / "missing"),
                      "--listen", f"unix://{tmp_path}/s.sock"])
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "does not exist or is not a directory" in line]
    assert len(errors) == 1 and errors[0].startswith("swap-state-server: error: --shm-dir"), result.stderr
