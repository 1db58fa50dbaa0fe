"""The snapshot store in tests: a real S3 endpoint (moto's server mode, a separate process on
127.0.0.1) and the AWS environment a server or trainer reads it through. Never an in-process
mock: the servers under test are other processes and talk HTTP to it."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

__all__ = ["moto_endpoint", "aws_env", "create_bucket", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_endpoint(log_path: str | os.PathLike[str] | None = None, timeout_s: float = 30.0) -> Iterator[str]:
    """Start ``moto.server`` on a free port; yields its URL; stops it (SIGTERM, then SIGKILL).
    Its request log goes to ``log_path`` (a temporary file by default), never to a pipe: an
    unread pipe fills after ~840 requests and moto then stops answering."""
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = stack.enter_context(tempfile.TemporaryDirectory(prefix="moto-")) + "/moto.log"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=subprocess.DEVNULL, stderr=log_file)
        try:
            deadline = time.monotonic() + timeout_s
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = pathlib.Path(log_path).read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"moto server did not start: {tail}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
        return True
    except OSError:
        return False


def aws_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables a server and a trainer need to reach ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)


if __name__ == "__main__":  # pragma: no cover - by hand: python tests/store_kit.py
    with moto_endpoint() as url:
        print(url, os.getpid())
