"""Repository hygiene for the server: fresh generated code, no torch, every RPC behind the
status boundary, config validation."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

from swap_state.proto import swap_state_pb2 as pb
from swap_state.common.addresses import parse_address as parse_listen
from swap_state.common.server_config import ServerConfig
from swap_state.common.sizes import parse_size
from swap_state.common.errors import ConfigError, StartupError
from swap_state.server.rpc.service import SwapStateService
from swap_state.server.snapshot.tiers.replica_wire import PeerCredentials, peer_credentials

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_generated_proto_code_is_fresh():
    result = subprocess.run([sys.executable, "-m", "swap_state.proto.regenerate", "--check"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_server_package_never_imports_torch():
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import swap_state.server as server
        names = [m.name for m in pkgutil.walk_packages(server.__path__, "swap_state.server.")
                 if not m.name.endswith("__main__")]
        for name in names:
            importlib.import_module(name)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "torchtitan"))
        print(len(names), heavy)
        assert not heavy, heavy
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout.split()[0]) >= 10  # really walked the package


def test_every_rpc_is_served_behind_the_status_boundary():
    methods = pb.DESCRIPTOR.services_by_name["SwapState"].methods_by_name
    for name in methods:
        implementation = getattr(SwapStateService, name)
        # rpc_boundary uses functools.wraps: the original is reachable, the wrapper is not it.
        assert hasattr(implementation, "__wrapped__"), f"{name} is not wrapped by rpc_boundary"


@pytest.mark.parametrize(
    ("text", "value"),
    [("64G", 64 << 30), ("64g", 64 << 30), ("512M", 512 << 20), ("1T", 1 << 40), ("4096", 4096),
     ("1.5K", 1536), ("2GiB", 2 << 30), ("8KB", 8 << 10),
     # exact where a float is not: above 2^53 bytes, and fractions of a unit
     ("9007199254740993", 2**53 + 1), ("1.1G", 1181116006), ("4611686018427387904", 2**62)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "1P", "abc", "1 G B", "4611686018427387905"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_parse_listen():
    assert parse_listen("unix:///run/a/b.sock").path == pathlib.Path("/run/a/b.sock")
    assert parse_listen("/run/x.sock").scheme == "unix"
    tcp = parse_listen("tcp://[::1]:7070")
    assert (tcp.host, tcp.port, tcp.bind_target()) == ("::1", 7070, "[::1]:7070")
    for bad in ("unix://relative", "tcp://host", "tcp://h:99999", f"unix:///{'x' * 200}"):
        with pytest.raises(ConfigError):
            parse_listen(bad)


def test_config_defaults_and_rules(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    config = ServerConfig(shm_size=64 << 30)
    assert config.listen == "unix:///run/user/1000/swap-state/swap-state.sock"
    assert config.cow_pool_bytes == 1 << 30 and config.cow_pool_slots == 16
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert ServerConfig(shm_size=1 << 30).listen == "unix:///run/swap-state/swap-state.sock"
    assert ServerConfig(shm_size=256 << 20).cow_pool_bytes == 0  # 32M < one 64M chunk
    assert ServerConfig(shm_size=1 << 30, listen="tcp://127.0.0.1:1", insecure=True)
    assert ServerConfig(shm_size=1 << 30, listen="tcp://0.0.0.0:1", insecure=True, token_file=pathlib.Path("t"))
    assert ServerConfig(shm_size=1 << 30).metrics_host == "127.0.0.1"  # metrics: this host only
    with pytest.raises(ConfigError, match="reaches beyond this host.*--token-file FILE.*127.0.0.1"):
        ServerConfig(shm_size=1 << 30, listen="tcp://0.0.0.0:1", insecure=True)
    with pytest.raises(ConfigError, match="reaches beyond this host"):
        ServerConfig(shm_size=1 << 30, listen="tcp://node7.cluster:1", insecure=True)
    for bad in (
        dict(shm_size=0),
        dict(shm_size=1 << 30, listen="tcp://0.0.0.0:1"),
        dict(shm_size=1 << 30, tls_cert=pathlib.Path("c")),
        dict(shm_size=1 << 30, keep_latest=1),
        dict(shm_size=1 << 30, chunk_bytes=12345),
        dict(shm_size=1 << 30, cow_budget=2 << 30),
        dict(shm_size=1 << 30, shm_dir=pathlib.Path("relative")),
    ):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)


def test_replica_peers_prove_themselves_by_a_secret_or_mutual_tls(tmp_path):
    base = dict(shm_size=1 << 30, snapshot_dir=tmp_path, replica_peers="tcp://host-b:7071")
    with pytest.raises(ConfigError, match="--replica-secret-file .* or mutual TLS"):
        ServerConfig(**base)
    with pytest.raises(ConfigError, match="--replica-tls-cert, --replica-tls-key and --replica-tls-ca go together"):
        ServerConfig(**base, replica_tls_cert=tmp_path / "peer.pem", replica_tls_key=tmp_path / "peer.key")
    files = tuple(tmp_path / name for name in ("peer.pem", "peer.key", "ca.pem"))
    settings = ServerConfig(**base, replica_tls_cert=files[0], replica_tls_key=files[1],
                            replica_tls_ca=files[2]).snapshot_settings
    assert settings.replica_tls == files and settings.replica_secret_file is None
    with pytest.raises(StartupError, match="--replica-tls-cert .*peer.pem.*cannot load them"):
        peer_credentials(settings)  # the files are not there
    files[1].write_text("a key others may read")
    files[1].chmod(0o644)
    with pytest.raises(StartupError, match="--replica-tls-key .* others may read: chmod 600"):
        peer_credentials(settings)
    with pytest.raises(ConfigError, match="--replica-tls-\\* apply to the replica wire"):
        ServerConfig(shm_size=1 << 30, replica_tls_cert=files[0], replica_tls_key=files[1], replica_tls_ca=files[2])
    with pytest.raises(ValueError, match="a secret or mutual TLS"):
        PeerCredentials()  # a wire open to anyone
