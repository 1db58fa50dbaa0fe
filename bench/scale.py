"""How restore planning scales with the number of ranks, simulated (no tensors, no server).

    python -m bench.scale [--ranks 8,64,256,1024,2048] [--repeat 3] [--out DIR]

A synthetic Llama-3-70B job: 723 parameters (80 layers of wq, wk, wv, wo, w1, w2, w3 and two
norms; the embedding, the final norm and the output), two moments each, FSDP ``Shard(0)`` over
N ranks: the records every old rank's manifest holds. For each N and a shrink to 3N/4 and a
grow to 5N/4 it measures, in this process:

- **build**: the step's layout index (``layout.json``,
  :class:`~swap_state.server.snapshot.restoring.layout_index.LayoutIndex`) from every old rank's records,
  as the server that commits the step (or publishes it in the store) does once per step:
  CPU seconds, peak Python memory and its bytes;
- **plan**: what one new rank pays to plan its restore: ``layout.json`` parsed, planned, the
  manifests of the old ranks it reads (``reads``) parsed, the plan bound to their records;
- **baseline**: the same rank planned tensor by tensor over every old rank's records held in
  memory (:func:`~swap_state.server.snapshot.restoring.reshard.plan_tensor`, the planner before any
  index; reading those N manifests not counted), measured in the same run, the plans compared
  equal: the ratio is the figure to read, not the seconds.

Reported per case: median, mean and worst of ``--repeat`` runs. Then, once, one rank's
**manifest** at the largest N: its bytes and the CPU of parsing it, as written now (compact,
version 2) and as written before (version 1: indented, null fields, the trainer's metadata text
beside the same facts), built from the same records in the same run. Last, **store requests**
at each N (:mod:`bench.store_requests`: the server's uploader on a real directory store, 8 ranks
per host, counted per call as S3 requests): two steps' uploads per rank, and ``latest`` from a
fresh reader.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import tempfile
import time
import tracemalloc

from bench.store_requests import count_requests
from swap_state.common.snapshot_format import RankManifest, TensorRecord, dumps_json
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, bind
from swap_state.server.snapshot.restoring.reshard import TargetTensor, plan_tensor, ranks_needed

DIM, FFN, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80
MOMENTS = ("exp_avg", "exp_avg_sq")


def llama3_70b_shapes() -> dict[str, tuple[int, ...]]:
    """The 723 parameters of Llama-3-70B by fqn."""
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (VOCAB, DIM)}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        shapes.update({
            p + "attention.wq.weight": (DIM, DIM), p + "attention.wk.weight": (KV, DIM),
            p + "attention.wv.weight": (KV, DIM), p + "attention.wo.weight": (DIM, DIM),
            p + "feed_forward.w1.weight": (FFN, DIM), p + "feed_forward.w2.weight": (DIM, FFN),
            p + "feed_forward.w3.weight": (FFN, DIM),
            p + "attention_norm.weight": (DIM,), p + "ffn_norm.weight": (DIM,),
        })  # fmt: skip
    shapes.update({"norm.weight": (DIM,), "output.weight": (VOCAB, DIM)})
    return shapes


def shard0(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's (start, length) of part ``index``: ceil-sized, trailing ones short or empty."""
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, max(0, min(chunk, size - start))


def box(shape: tuple[int, ...], parts: int, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start, length = shard0(shape[0], parts, index)
    return (start, *[0] * (len(shape) - 1)), (length, *shape[1:])


def manifests(shapes: dict[str, tuple[int, ...]], world: int) -> dict[int, list[TensorRecord]]:
    """Every old rank's records."""
    return {rank: rank_records(shapes, world, rank) for rank in range(world)}


def rank_records(shapes: dict[str, tuple[int, ...]], world: int, rank: int) -> list[TensorRecord]:
    """One rank's records: both moments of every parameter, its Shard(0) box."""
    records, position = [], 0
    for fqn, shape in shapes.items():
        offset, local = box(shape, world, rank)
        nbytes = 4
        for n in local:
            nbytes *= n
        for moment in MOMENTS:
            records.append(TensorRecord(
                name=f"state.{fqn}.{moment}", dtype="float32", shape=local, nbytes=nbytes,
                data_offsets=(position, position + nbytes), crc32=0, fqn=fqn, key=moment,
                global_shape=shape, global_offset=offset,
            ))
            position += nbytes
    return records


def targets(shapes: dict[str, tuple[int, ...]], world: int, rank: int) -> list[TargetTensor]:
    out = []
    for fqn, shape in shapes.items():
        offset, local = box(shape, world, rank)
        out.extend(TargetTensor(f"state.{fqn}.{m}", "float32", local, shape, offset) for m in MOMENTS)
    return out


def timed(fn) -> tuple[float, object]:
    """(CPU seconds, result) of one call."""
    begin = time.process_time()
    result = fn()
    return time.process_time() - begin, result


def peak_bytes(fn) -> int:
    """Peak Python memory one call allocates (a separate call: tracing slows it several-fold)."""
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "worst": max(values)}


def run_case(shapes, old: int, new: int, repeat: int) -> dict:
    records = manifests(shapes, old)
    rank = new // 2  # a rank in the middle: its boxes straddle old ones
    wanted = targets(shapes, new, rank)
    holders: dict[str, list[tuple[int, TensorRecord]]] = {}
    for r in sorted(records):
        for record in records[r]:
            holders.setdefault(record.name, []).append((r, record))
    raw = LayoutIndex(records, old).to_bytes()
    needed = ranks_needed(LayoutIndex.from_bytes(raw, old).plan(wanted, target_rank=rank, same_world=False))
    manifest_bytes = {r: rank_manifest(shapes, old, r, records[r]).to_bytes() for r in needed}

    def restore_plan():
        """What a new rank pays: layout.json parsed, planned, the needed manifests parsed, bound."""
        plan = LayoutIndex.from_bytes(raw, old).plan(wanted, target_rank=rank, same_world=False)
        read = {r: RankManifest.from_json(json.loads(manifest_bytes[r])).tensors for r in ranks_needed(plan)}
        return bind(plan, read)

    # The N old ranks' records live here only for the build and the baseline: frozen, the
    # collector does not walk their millions of objects inside a timed plan (a server
    # restoring holds none of them).
    gc.collect()
    gc.freeze()
    build_s, plan_s, base_s = [], [], []
    for _ in range(repeat):
        build_s.append(timed(lambda: LayoutIndex(records, old).to_bytes())[0])
        seconds, plan = timed(restore_plan)
        plan_s.append(seconds)
        seconds, baseline = timed(lambda: {t.name: plan_tensor(t, holders[t.name], target_rank=rank) for t in wanted})
        base_s.append(seconds)
        assert {n: [(p.source_rank, p.source, p.runs) for p in ps] for n, ps in plan.items()} == \
               {n: [(p.source_rank, p.source, p.runs) for p in ps] for n, ps in baseline.items()}
    gc.unfreeze()
    return {
        "old_ranks": old, "new_ranks": new, "tensors_per_rank": len(wanted),
        "layout_build_cpu_s": summary(build_s), "layout_build_peak_mb": peak_bytes(lambda: LayoutIndex(records, old).to_bytes()) / 2**20,
        "layout_bytes": len(raw), "manifests_read": len(needed),
        "plan_cpu_s": summary(plan_s), "plan_peak_mb": peak_bytes(restore_plan) / 2**20,
        "baseline_plan_cpu_s": summary(base_s),
        "plan_speedup_median": statistics.median(base_s) / max(statistics.median(plan_s), 1e-9),
    }  # fmt: skip


#: An AdamW param group's hyperparameters as torchtitan's trainer sends them per fqn.
ADAMW_GROUP = {"lr": 8e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True, "initial_lr": 8e-4}


def rank_manifest(shapes, world: int, rank: int, records: list[TensorRecord]) -> RankManifest:
    """A rank's manifest as the server writes it: its records, the trainer's groups and steps."""
    steps = {fqn: {"__tensor__": 1000.0, "dtype": "float32"} for fqn in shapes}
    return RankManifest("job", 1000, rank, world, "rank.safetensors", 0, 4096, 64 << 20, tuple(records),
                        {fqn: ADAMW_GROUP for fqn in shapes}, steps, {}, 0, 0, 0.0, 1.0)


def manifest_case(shapes, world: int, repeat: int) -> dict:
    """One middle rank's manifest at ``world`` ranks: bytes and parse CPU, compact (now) and
    version 1 (before), from the same records."""
    rank = world // 2
    records = rank_records(shapes, world, rank)
    manifest = rank_manifest(shapes, world, rank, records)
    compact = manifest.to_bytes()
    old = manifest.to_json()
    old.pop("metadata_extra")
    old.update(version=1, metadata_json=manifest.metadata_json,
               tensors=[{**t, "fqn": t.get("fqn"), "key": t.get("key"), "global_shape": t.get("global_shape"),
                         "global_offset": t.get("global_offset")} for t in old["tensors"]])
    version_1 = dumps_json(old)
    parse = {name: summary([timed(lambda raw=raw: RankManifest.from_json(json.loads(raw)))[0]
                            for _ in range(repeat)])
             for name, raw in (("compact", compact), ("version_1", version_1))}
    read = RankManifest.from_json(json.loads(compact))
    assert json.loads(read.metadata_json) == json.loads(manifest.metadata_json)
    rebuild = summary([timed(lambda m=RankManifest.from_json(json.loads(compact)): m.metadata_json)[0]
                       for _ in range(repeat)])
    return {"ranks": world, "tensors": len(records), "compact_bytes": len(compact),
            "version_1_bytes": len(version_1), "parse_cpu_s": parse, "metadata_rebuild_cpu_s": rebuild}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,64,256,1024,2048", help="old world sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median, mean, worst)")
    parser.add_argument("--store-ranks", default="8,64,256,1024,2048",
                        help="world sizes whose store requests are counted, comma-separated ('' for none)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write scale.json here too")
    args = parser.parse_args(argv)
    shapes = llama3_70b_shapes()
    results, lines = [], []
    header = (f"{'N -> M':>13} {'build s':>8} {'layout kB':>9} {'plan s':>7} {'plan MB':>7} {'reads':>5} "
              f"{'baseline s':>10} {'x':>6}")
    print(header)
    for old in (int(n) for n in args.ranks.split(",")):
        for new in sorted({max(1, old * 3 // 4), old * 5 // 4}):
            case = run_case(shapes, old, new, args.repeat)
            results.append(case)
            line = (f"{old:>5} -> {new:<5} {case['layout_build_cpu_s']['median']:8.2f} {case['layout_bytes'] / 1e3:9.0f} "
                    f"{case['plan_cpu_s']['median']:7.3f} {case['plan_peak_mb']:7.1f} {case['manifests_read']:5} "
                    f"{case['baseline_plan_cpu_s']['median']:10.3f} {case['plan_speedup_median']:6.0f}"
                    f"   (plan mean {case['plan_cpu_s']['mean']:.3f}, worst {case['plan_cpu_s']['worst']:.3f})")
            lines.append(line)
            print(line, flush=True)
    manifest = manifest_case(shapes, old, args.repeat)
    line = (f"one rank's manifest at {old} ranks ({manifest['tensors']} tensors): "
            f"{manifest['compact_bytes'] / 1e6:.2f} MB compact vs {manifest['version_1_bytes'] / 1e6:.2f} MB "
            f"version 1; parse {_fmt(manifest['parse_cpu_s']['compact'])} vs {_fmt(manifest['parse_cpu_s']['version_1'])}; "
            f"the trainer's metadata rebuilt from a compact one (once per rank a restore reads) "
            f"{_fmt(manifest['metadata_rebuild_cpu_s'])}")
    lines.append(line)
    print(line, flush=True)
    stores = []
    for world in (int(n) for n in args.store_ranks.split(",") if n):
        with tempfile.TemporaryDirectory() as root:
            counted = count_requests(pathlib.Path(root), world, world // max(2, world // 8), timeout_s=600)
        stores.append({"ranks": world, "upload_per_rank": counted.upload_per_rank, "upload": dict(counted.upload),
                       "latest_requests": counted.latest_requests, "latest": dict(counted.latest)})
        line = (f"store requests at {world} ranks: an upload {counted.upload_per_rank:.1f} per rank "
                f"({_calls(counted.upload)} for two steps); latest from a fresh reader {counted.latest_requests} "
                f"({_calls(counted.latest)})")
        lines.append(line)
        print(line, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.json").write_text(json.dumps({"plans": results, "manifest": manifest, "store": stores}, indent=1))
        table = "\n".join([header, *lines])
        (args.out / "scale.md").write_text(
            "# Restore planning at scale (bench.scale)\n\nCPU seconds (median of the runs; the plan's mean "
            "and worst beside it), peak Python MB. build: the step's layout.json from every rank's records "
            "(once per step, by one writer); plan: one new rank's restore plan (layout.json parsed, planned, "
            "the manifests of the `reads` old ranks it needs parsed, bound); baseline: the same rank planned "
            "tensor by tensor over every old rank's records in memory (reading them not counted); x = "
            "baseline / plan.\n\n```\n" + table + "\n```\n")


def _calls(counter) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counter.items()))


def _fmt(cpu: dict[str, float]) -> str:
    return f"{cpu['median'] * 1e3:.0f} ms (mean {cpu['mean'] * 1e3:.0f}, worst {cpu['worst'] * 1e3:.0f})"


if __name__ == "__main__":
    main()
