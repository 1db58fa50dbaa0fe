"""The environment variables a trainer and the ``swap-state`` CLI read, each read here only."""

from __future__ import annotations

import os

__all__ = ["ENV_JOB_ID", "ENV_SERVER", "ENV_TOKEN_FILE", "job_id_from_env", "server_from_env", "token_file_from_env"]

ENV_SERVER = "SWAP_STATE_SERVER"
ENV_JOB_ID = "SWAP_STATE_JOB_ID"
ENV_TOKEN_FILE = "SWAP_STATE_TOKEN_FILE"


def server_from_env() -> str | None:
    """``$SWAP_STATE_SERVER``: the server's address when no argument or setting gives one."""
    return os.environ.get(ENV_SERVER) or None


def job_id_from_env() -> str | None:
    """``$SWAP_STATE_JOB_ID``: the job id when no argument or setting gives one."""
    return os.environ.get(ENV_JOB_ID) or None


def token_file_from_env() -> str | None:
    """``$SWAP_STATE_TOKEN_FILE``: the file holding the server's shared secret."""
    return os.environ.get(ENV_TOKEN_FILE) or None
