"""Regenerate the Python code for ``proto/swap_state.proto``.

Usage::

    python -m swap_state.proto.regenerate          # rewrite the generated files in place
    python -m swap_state.proto.regenerate --check  # exit 1 when they are stale

The .proto is mapped to the virtual path ``swap_state/proto/`` so that the generated stub
imports ``from swap_state.proto import swap_state_pb2`` and works as an installed package.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

__all__ = ["PROTO_DIR", "GENERATED", "generate_into", "main"]

PROTO_DIR = pathlib.Path(__file__).resolve().parent
GENERATED = ("swap_state_pb2.py", "swap_state_pb2.pyi", "swap_state_pb2_grpc.py")


def generate_into(out_dir: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) and write the generated files into ``out_dir``."""
    from grpc_tools import protoc  # dev extra only; the server never needs it at run time

    args = [
        "protoc",
        f"-Iswap_state/proto={PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        "swap_state/proto/swap_state.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate_into(pathlib.Path(tmp))
        produced = pathlib.Path(tmp) / "swap_state" / "proto"
        stale = [
            name
            for name in GENERATED
            if not (PROTO_DIR / name).exists()
            or not filecmp.cmp(produced / name, PROTO_DIR / name, shallow=False)
        ]
        if opts.check:
            for name in stale:
                print(f"stale: proto/{name} (run: python -m swap_state.proto.regenerate)")
            return 1 if stale else 0
        for name in GENERATED:
            (PROTO_DIR / name).write_bytes((produced / name).read_bytes())
            print(f"wrote proto/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
