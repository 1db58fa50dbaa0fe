"""The environment variables a trainer and the ``swap-state`` CLI read, each read here only."""

from __future__ import annotations

import os

__all__ = ["ENV_JOB_ID", "ENV_SERVER", "ENV_SERVER_UID", "ENV_TLS", "ENV_TOKEN_FILE", "job_id_from_env",
           "server_from_env", "server_uid_from_env", "tls_file_from_env", "token_file_from_env"]

ENV_SERVER = "SWAP_STATE_SERVER"
ENV_JOB_ID = "SWAP_STATE_JOB_ID"
ENV_TOKEN_FILE = "SWAP_STATE_TOKEN_FILE"
ENV_SERVER_UID = "SWAP_STATE_SERVER_UID"
#: The variable naming each TLS file of :class:`ClientConfig` that no setting names.
ENV_TLS = {"tls_root_cert": "SWAP_STATE_TLS_ROOT_CERT", "tls_client_cert": "SWAP_STATE_TLS_CLIENT_CERT",
           "tls_client_key": "SWAP_STATE_TLS_CLIENT_KEY"}


def server_from_env() -> str | None:
    """``$SWAP_STATE_SERVER``: the server's address when no argument or setting gives one."""
    return os.environ.get(ENV_SERVER) or None


def job_id_from_env() -> str | None:
    """``$SWAP_STATE_JOB_ID``: the job id when no argument or setting gives one."""
    return os.environ.get(ENV_JOB_ID) or None


def token_file_from_env() -> str | None:
    """``$SWAP_STATE_TOKEN_FILE``: the file holding the server's shared secret."""
    return os.environ.get(ENV_TOKEN_FILE) or None


def server_uid_from_env() -> int | None:
    """``$SWAP_STATE_SERVER_UID``: the uid a server's socket may belong to besides yours and root's."""
    value = os.environ.get(ENV_SERVER_UID, "")
    try:
        return int(value) if value else None
    except ValueError:
        raise ValueError(f"${ENV_SERVER_UID} must be a uid (a number), got {value!r}") from None


def tls_file_from_env(field: str) -> str | None:
    """The file ``$SWAP_STATE_TLS_*`` names for the TLS field ``field`` of ClientConfig."""
    return os.environ.get(ENV_TLS[field]) or None
