"""The containers are torch's and grpc's: importing them imports no torchtitan (a plain PyTorch
trainer needs none) and nothing heavy the client extra brings for other jobs."""

from __future__ import annotations

import json
import subprocess
import sys

#: What a trainer importing the containers must not pay for (torchtitan and what it brings,
#: the export's safetensors, triton).
HEAVY = ("torchtitan", "safetensors", "triton", "tyro", "torchdata", "tokenizers")


def test_importing_the_containers_imports_no_torchtitan():
    script = ("import json, sys\n"
              "from swap_state.client import RemoteSwapOptimizersContainer, RemoteConfig, SwapOptimizersContainer\n"
              "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported = set(json.loads(proc.stdout))
    assert {"torch", "grpc"} <= imported
    assert sorted(imported & set(HEAVY)) == []
