"""``python -m bench.check_cost``: what the server's checks of who calls cost a trainer: the
Attach RPC (a fresh session each time) and the Snapshot call (one RPC; its metadata parts
after the first), against an embedded server started here. Prints median, mean and worst of
``--reps`` (20) each; run it on two versions to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from swap_state.client.remote.container import RemoteConfig, RemoteSwapOptimizersContainer
from swap_state.client.remote.embedded import EmbeddedServer, EmbeddedServerConfig
from swap_state.client.remote.rpc import ClientConfig, SwapStateClient


def _ms(samples: list[float]) -> str:
    ms = [s * 1e3 for s in samples]
    return f"median {statistics.median(ms):.2f} ms, mean {statistics.fmean(ms):.2f} ms, worst {max(ms):.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="calls measured of each kind (default 20)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="swap-state-check-cost-") as scratch:
        server = EmbeddedServer(EmbeddedServerConfig(shm_size_bytes=256 << 20, snapshot_dir=scratch,
                                                     auto_restart=False)).start()
        try:
            client = SwapStateClient(ClientConfig(server.address))
            attach = []
            for rep in range(args.reps + 1):
                began = time.perf_counter()
                session = client.attach(f"attach-{rep}", 0, 1)
                attach.append(time.perf_counter() - began)
                session.close()
            client.close()
            torch.manual_seed(0)
            model = torch.nn.Linear(256, 256)
            container = RemoteSwapOptimizersContainer([model], torch.optim.AdamW, {"lr": 1e-3}, 2,
                                                      server=server.address, job_id="snapshots",
                                                      config=RemoteConfig(snapshot_keep_latest=2))
            snapshot = []
            for rep in range(args.reps + 1):
                model(torch.randn(8, 256)).sum().backward()
                container.step()
                container.zero_grad()
                began = time.perf_counter()
                handle = container.snapshot()
                snapshot.append(time.perf_counter() - began)
                handle.wait_durable(timeout_s=60)
            container.close()
        finally:
            server.stop()
    # The first of each warms the channel and sends the metadata base: not counted.
    print(f"Attach   ({args.reps}): {_ms(attach[1:])}")
    print(f"Snapshot ({args.reps}): {_ms(snapshot[1:])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
