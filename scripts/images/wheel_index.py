"""Serve a folder of wheels as a PEP 503 simple index on 127.0.0.1, for a ``docker build``
whose RUN steps share the host's network (scripts/images/build.sh).

Usage: python wheel_index.py WHEEL_DIR PORT_FILE
Writes WHEEL_DIR/simple/<project>/index.html, listens on PREFERRED_PORT (an ephemeral port when
that is taken), writes the port to PORT_FILE once it listens, and serves until SIGTERM.
Standard library only.
"""

from __future__ import annotations

import functools
import html
import http.server
import re
import signal
import sys
from pathlib import Path


# The same port every time keeps the index URL, a build argument, the same, so that a second
# build on the same engine reuses the torch layer instead of installing it again.
PREFERRED_PORT = 47311


def normalize(name: str) -> str:
    """PEP 503's project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def write_index(wheels: Path) -> None:
    projects: dict[str, list[str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        projects.setdefault(normalize(wheel.name.split("-")[0]), []).append(wheel.name)
    if not projects:
        sys.exit(f"wheel_index.py: no wheels in {wheels}")
    for project, files in projects.items():
        page = wheels / "simple" / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="../../{html.escape(f)}">{html.escape(f)}</a>\n' for f in files)
        page.write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass  # one line per request would bury the build's own output


def main() -> None:
    wheels, port_file = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    write_index(wheels)
    handler = functools.partial(QuietHandler, directory=str(wheels))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", PREFERRED_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    port_file.write_text(f"{server.server_address[1]}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
