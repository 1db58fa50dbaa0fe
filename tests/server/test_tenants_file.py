"""``--tenants FILE``: its format, its mode, and who may reach what."""

from __future__ import annotations

import os

import pytest

from swap_state.common.errors import ConfigError, PermissionDeniedError, StartupError
from swap_state.common.server_config import ServerConfig
from swap_state.server.tenants import ANYONE, Tenant, Tenants, read_tenants_file


def _file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "tenants"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_tokens_name_their_tenants(tmp_path):
    tenants = read_tenants_file(_file(tmp_path, "# comment\nalice aaaaaaaaaaaaaaaa\n\nops oooooooooooooooo admin # the admin\n"))
    assert tenants.tenant_of([("authorization", "Bearer aaaaaaaaaaaaaaaa")]) == Tenant("alice")
    assert tenants.tenant_of([("authorization", b"Bearer oooooooooooooooo")]) == Tenant("ops", admin=True)
    assert tenants.tenant_of([("authorization", "Bearer wrong")]) is None
    assert tenants.tenant_of([]) is None
    assert Tenants().tenant_of([]) is ANYONE  # no tenants: one trust domain


@pytest.mark.parametrize(("text", "mode", "message"), [
    ("alice aaaaaaaaaaaaaaaa\n", 0o644, "chmod 600"),
    ("alice\n", 0o600, "line 1: expected 'TENANT TOKEN'"),
    ("alice aaaaaaaaaaaaaaaa root\n", 0o600, "line 1: expected"),
    ("alice short\n", 0o600, "at least 16"),
    ("alice aaaaaaaaaaaaaaaa\nalice bbbbbbbbbbbbbbbb\n", 0o600, "line 2: tenant 'alice' or its token is listed twice"),
    ("# nobody\n", 0o600, "lists no tenant"),
])
def test_a_bad_file_is_refused_naming_the_fix(tmp_path, text, mode, message):
    with pytest.raises(StartupError, match=message):
        read_tenants_file(_file(tmp_path, text, mode))


def test_a_file_readable_by_the_servers_own_group_is_taken(tmp_path):
    """A Kubernetes Secret mounted with the pod's fsGroup: 0440, the server's group."""
    path = _file(tmp_path, "alice aaaaaaaaaaaaaaaa\n", 0o640)
    os.chown(path, -1, os.getegid())
    assert read_tenants_file(path).tenant_of([("authorization", "Bearer aaaaaaaaaaaaaaaa")]) == Tenant("alice")


def test_a_tenant_reaches_its_own_and_an_admin_all():
    alice, ops = Tenant("alice"), Tenant("ops", admin=True)
    assert alice.may_reach("alice") and not alice.may_reach("bob")
    assert alice.may_reach("")  # written before tenants (or without them): nobody's, as it was
    assert ops.may_reach("bob") and ops.may_reach("")
    assert alice.may_claim(None) and alice.may_claim("") and not alice.may_claim("bob")
    with pytest.raises(PermissionDeniedError, match="job 'x' belongs to another tenant"):
        alice.check("bob", "job 'x'")


def test_tenants_and_a_token_file_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="--token-file and --tenants exclude each other"):
        ServerConfig(shm_size=1 << 30, listen="unix:///tmp/x.sock", token_file=tmp_path / "t", tenants=tmp_path / "u")
