"""How restore planning scales with the number of ranks, simulated (no tensors, no server).

    python -m bench.scale [--ranks 8,64,256,1024,2048] [--layouts 70b-fsdp] [--whole-ranks 2048]
                          [--repeat 3] [--out DIR]
    python -m bench.scale --ranks 1024,16384 --layouts 405b-fsdp,405b-tp8 --store-ranks ''

Layouts (``--layouts``): ``70b-fsdp``, Llama-3-70B (723 parameters, two moments each) FSDP
``Shard(0)`` over N ranks (the rounds before this one); ``405b-fsdp`` and ``405b-tp8``, a
405B-class model (dim 16384, ffn 53248, 126 layers, kv 1024, vocab 128256: 1,137 parameters,
two moments and a plain replicated ``step`` each), FSDP, and TP8 (innermost) x FSDP. For each
N and a shrink to 3N/4 and a grow to 5N/4 (whole TP groups) it measures, in this process:

- **plan**: what one new rank pays to plan its restore: ``layout.json`` parsed, planned, the
  manifests of the old ranks it reads (``reads``) parsed, the plan bound to their records: CPU
  seconds and peak Python memory (tracemalloc); and **read/need**: the bytes its reads cover
  (:func:`~swap_state.server.snapshot.restoring.restore_reads.read_spans`: whole checksum blocks,
  by exact range as from a store or a peer; **direct**: page aligned, as from a local file with
  O_DIRECT) over the bytes its new shards need;
- up to ``--whole-ranks`` old ranks, where every old rank's records fit in memory: **build**, the
  step's layout index from them (:class:`~swap_state.server.snapshot.restoring.layout_index.LayoutIndex`),
  as the server that commits the step does once per step, checked equal to the one the bench
  plans from (built per kind of tensor, which reaches 16,384 ranks); and **baseline**, the same
  rank planned tensor by tensor over every old rank's records
  (:func:`~swap_state.server.snapshot.restoring.reshard.plan_tensor`), the plans compared equal.

Reported per case: median, mean and worst of ``--repeat`` runs. Then, once, one rank's
**manifest** at the largest N: its bytes and the CPU of parsing it, as written now (compact,
version 2) and as written before (version 1: indented, null fields, the trainer's metadata text
beside the same facts), built from the same records in the same run. Last, **store requests**
at each N (:mod:`bench.store_requests`: the server's uploader on a real directory store, 8 ranks
per host, counted per call as S3 requests): two steps' uploads per rank, and ``latest`` from a
fresh reader. With ``--publish-ranks``, one step's **publish** at each N (:mod:`bench.store_publish`):
the publishing host's CPU, peak Python memory and store requests, after (host parts) and, up to
``--publish-before-ranks``, before (every marker and manifest read), a host that finds the claim
taken, and ``latest`` when the newest step has no index.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import pathlib
import statistics
import tempfile
import time
import tracemalloc

from bench import store_publish
from bench.store_requests import count_requests
from swap_state.common.snapshot_format import RankManifest, TensorRecord, checksum_block_bytes, dumps_json
from swap_state.server.snapshot.restoring.layout_index import LayoutIndex, bind
from swap_state.server.snapshot.restoring.reshard import TargetTensor, plan_tensor, ranks_needed
from swap_state.server.snapshot.restoring.restore_reads import plan_reads, read_spans

MOMENTS = ("exp_avg", "exp_avg_sq")
#: (dim, ffn, kv, vocab, layers) of the models simulated.
MODELS = {"70b": (8192, 28672, 1024, 128256, 80), "405b": (16384, 53248, 1024, 128256, 126)}
#: name: (model, TP degree, a plain replicated ``step`` per parameter as torch's Adam keeps).
LAYOUTS = {"70b-fsdp": ("70b", 1, False), "405b-fsdp": ("405b", 1, True), "405b-tp8": ("405b", 8, True)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A job's parameters and how they are cut: fqn -> (global shape, how TP cuts it: ``col``
    Shard(0), ``row`` Shard(1), ``rep`` replicated), TP innermost (rank = dp * tp + t), FSDP
    Shard(0) over the dp ranks of what TP left (FSDP2's strided shard)."""

    params: dict[str, tuple[tuple[int, ...], str]]
    tp: int
    steps: bool

    @classmethod
    def named(cls, name: str) -> Layout:
        model, tp, steps = LAYOUTS[name]
        return cls(model_params(*MODELS[model]), tp, steps)


def model_params(dim: int, ffn: int, kv: int, vocab: int, layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A Llama-3 model's parameters by fqn (723 for 70B, 1,137 for 405B), with their TP cut."""
    params = {"tok_embeddings.weight": ((vocab, dim), "col")}
    for layer in range(layers):
        p = f"layers.{layer}."
        params.update({
            p + "attention.wq.weight": ((dim, dim), "col"), p + "attention.wk.weight": ((kv, dim), "col"),
            p + "attention.wv.weight": ((kv, dim), "col"), p + "attention.wo.weight": ((dim, dim), "row"),
            p + "feed_forward.w1.weight": ((ffn, dim), "col"), p + "feed_forward.w2.weight": ((dim, ffn), "row"),
            p + "feed_forward.w3.weight": ((ffn, dim), "col"),
            p + "attention_norm.weight": ((dim,), "rep"), p + "ffn_norm.weight": ((dim,), "rep"),
        })  # fmt: skip
    params.update({"norm.weight": ((dim,), "rep"), "output.weight": ((vocab, dim), "col")})
    return params


def shard0(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's (start, length) of part ``index``: ceil-sized, trailing ones short or empty."""
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, max(0, min(chunk, size - start))


def box(shape: tuple[int, ...], cut: str, world: int, tp: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank ``rank``'s (global offset, local shape) of a parameter."""
    dp, t = divmod(rank, tp)
    offset, local = [0] * len(shape), list(shape)
    if tp > 1 and cut != "rep":
        d = 0 if cut == "col" else 1
        offset[d], local[d] = shard0(shape[d], tp, t)
    start, local[0] = shard0(local[0], world // tp, dp)
    offset[0] += start
    return tuple(offset), tuple(local)


def tensors(layout: Layout, world: int, rank: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...] | None, tuple[int, ...] | None]]:
    """One rank's tensors in segment order: (name, local shape, global shape, global offset)."""
    out = []
    for fqn, (shape, cut) in layout.params.items():
        offset, local = box(shape, cut, world, layout.tp, rank)
        out.extend((f"state.{fqn}.{m}", local, shape, offset) for m in MOMENTS)
        if layout.steps:
            out.append((f"state.{fqn}.step", (), None, None))
    return out


def manifests(layout: Layout, world: int) -> dict[int, list[TensorRecord]]:
    """Every old rank's records."""
    return {rank: rank_records(layout, world, rank) for rank in range(world)}


def rank_records(layout: Layout, world: int, rank: int) -> list[TensorRecord]:
    """One rank's records, laid out one after the other in its file."""
    records, position = [], 0
    for name, local, shape, offset in tensors(layout, world, rank):
        nbytes = 4 * math.prod(local)
        fqn, key = name[len("state."):].rsplit(".", 1)
        block = checksum_block_bytes(nbytes)  # and zero crc32s, as many as the writer's
        records.append(TensorRecord(name=name, dtype="float32", shape=local, nbytes=nbytes,
                                    data_offsets=(position, position + nbytes), crc32=0, fqn=fqn, key=key,
                                    global_shape=shape, global_offset=offset, block_bytes=block,
                                    block_crcs=bytes(4 * -(-nbytes // block))))
        position += nbytes
    return records


def layout_json(layout: Layout, world: int) -> bytes:
    """The step's ``layout.json`` without every rank's records (16,384 ranks of 3,411 tensors
    would not fit): one index of a tensor per kind (shape and cut), each entry then given the
    names of that kind. At the sizes the build is timed it is checked equal to the real build."""
    kinds: dict[tuple, list[str]] = {}
    for fqn, (shape, cut) in layout.params.items():
        kinds.setdefault((shape, cut), []).append(fqn)
    sample = Layout({fqns[0]: kind for kind, fqns in kinds.items()}, layout.tp, layout.steps)
    doc = json.loads(LayoutIndex(manifests(sample, world), world).to_bytes())
    by_name = {entry["name"]: entry for entry in doc["tensors"]}
    entries = []
    for fqns in kinds.values():
        for fqn in fqns:
            for suffix in (*MOMENTS, *(("step",) if layout.steps else ())):
                entries.append({**by_name[f"state.{fqns[0]}.{suffix}"], "name": f"state.{fqn}.{suffix}"})
    doc["tensors"] = sorted(entries, key=lambda entry: entry["name"])
    return json.dumps(doc, separators=(",", ":")).encode()


def targets(layout: Layout, world: int, rank: int) -> list[TargetTensor]:
    return [TargetTensor(name, "float32", local, shape, offset) for name, local, shape, offset in tensors(layout, world, rank)]


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


def run_case(layout: Layout, old: int, new: int, repeat: int, whole: bool) -> dict:
    """One new rank's plan at ``new`` ranks from a snapshot of ``old``; ``whole``: every old
    rank's records are built too, for the layout's build and the baseline."""
    rank = new // 2  # a rank in the middle: its boxes straddle old ones
    wanted = targets(layout, new, rank)
    raw = layout_json(layout, old)
    needed = ranks_needed(LayoutIndex.from_bytes(raw, old).plan(wanted, target_rank=rank, same_world=False))
    manifest_bytes = {r: rank_manifest(layout, old, r, rank_records(layout, old, r)).to_bytes() for r in needed}

    def restore_plan():
        """What a new rank pays: layout.json parsed, planned, the needed manifests parsed, bound."""
        plan = LayoutIndex.from_bytes(raw, old).plan(wanted, target_rank=rank, same_world=False)
        read = {r: RankManifest.from_json(json.loads(manifest_bytes[r])) for r in ranks_needed(plan)}
        return bind(plan, {r: m.tensors for r, m in read.items()}), read

    plan_s = [timed(restore_plan)[0] for _ in range(repeat)]
    plan, read = restore_plan()
    case = {"old_ranks": old, "new_ranks": new, "tensors_per_rank": len(wanted), "layout_bytes": len(raw),
            "manifests_read": len(needed), "plan_cpu_s": summary(plan_s), "plan_peak_mb": peak_bytes(restore_plan) / 2**20,
            **read_bytes(plan, read)}
    return {**case, **(built(layout, old, raw, plan, wanted, rank, repeat) if whole else {})}


def read_bytes(plan: dict, read: dict[int, RankManifest]) -> dict[str, int]:
    """The bytes the restore reads (the spans :mod:`.restore_reads` reads: whole checksum blocks,
    by exact range from a store or a peer, page aligned from a local file with O_DIRECT) and
    the bytes its new shards need (the runs)."""
    wanted = plan_reads(plan, read)

    def spanned(align: int) -> int:
        return sum(span.end - span.start for manifest, reads in wanted.values()
                   for span in read_spans(manifest, reads, align))

    return {"bytes_read": spanned(1), "bytes_read_direct": spanned(4096),
            "bytes_needed": sum(run.nbytes for pieces in plan.values() for piece in pieces for run in piece.runs)}


def built(layout: Layout, old: int, raw: bytes, plan: dict, wanted: list[TargetTensor], rank: int, repeat: int) -> dict:
    """The layout's build from every old rank's records (checked equal to ``raw``) and the
    baseline plan over them (checked equal to ``plan``)."""
    records = manifests(layout, old)
    holders: dict[str, list[tuple[int, TensorRecord]]] = {}
    for r in sorted(records):
        for record in records[r]:
            holders.setdefault(record.name, []).append((r, record))
    assert LayoutIndex(records, old).to_bytes() == raw
    # The N old ranks' records live here only for the build and the baseline: frozen, the
    # collector does not walk their millions of objects inside a timed call.
    gc.collect()
    gc.freeze()
    build_s, base_s = [], []
    for _ in range(repeat):
        build_s.append(timed(lambda: LayoutIndex(records, old).to_bytes())[0])
        seconds, baseline = timed(lambda: {t.name: plan_tensor(t, holders[t.name], target_rank=rank) for t in wanted})
        base_s.append(seconds)
        assert {n: [(p.source_rank, p.source, p.runs) for p in ps] for n, ps in plan.items()} == \
               {n: [(p.source_rank, p.source, p.runs) for p in ps] for n, ps in baseline.items()}
    gc.unfreeze()
    return {"layout_build_cpu_s": summary(build_s),
            "layout_build_peak_mb": peak_bytes(lambda: LayoutIndex(records, old).to_bytes()) / 2**20,
            "baseline_plan_cpu_s": summary(base_s)}


#: An AdamW param group's hyperparameters as torchtitan's trainer sends them per fqn.
ADAMW_GROUP = {"lr": 8e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True, "initial_lr": 8e-4}


def rank_manifest(layout: Layout, world: int, rank: int, records: list[TensorRecord]) -> RankManifest:
    """A rank's manifest as the server writes it: its records, the trainer's groups and steps."""
    steps = {fqn: {"__tensor__": 1000.0, "dtype": "float32"} for fqn in layout.params}
    data_bytes = records[-1].data_offsets[1]
    return RankManifest("job", 1000, rank, world, "rank.safetensors", 4096 + data_bytes, 4096, 64 << 20,
                        tuple(records), {fqn: ADAMW_GROUP for fqn in layout.params}, steps, {}, 0, 0, 0.0, 1.0)


def manifest_case(layout: Layout, world: int, repeat: int) -> dict:
    """One middle rank's manifest at ``world`` ranks: bytes and parse CPU, compact (now) and
    version 1 (before), from the same records."""
    rank = world // 2
    records = rank_records(layout, world, rank)
    manifest = rank_manifest(layout, world, rank, records)
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
    parser.add_argument("--layouts", default="70b-fsdp", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--whole-ranks", type=int, default=2048,
                        help="up to this N every old rank's records are built too: the layout's build and the baseline")
    parser.add_argument("--publish-ranks", default="",
                        help="world sizes at which one step's publish is measured (the last layout), comma-separated")
    parser.add_argument("--publish-before-ranks", type=int, default=1024,
                        help="up to this N the publish before host parts is measured too (every manifest read)")
    args = parser.parse_args(argv)
    results, lines = [], []
    header = (f"{'layout':>9} {'N -> M':>13} {'build s':>8} {'layout kB':>9} {'plan s':>7} {'plan MB':>7} {'reads':>5} "
              f"{'read/need':>9} {'direct':>6} {'baseline s':>10} {'x':>6}")
    print(header)
    for name in args.layouts.split(","):
        layout = Layout.named(name)
        for old in (int(n) for n in args.ranks.split(",") if n):
            for new in sorted({max(layout.tp, n // layout.tp * layout.tp) for n in (old * 3 // 4, old * 5 // 4)}):
                case = {"layout": name, **run_case(layout, old, new, args.repeat, old <= args.whole_ranks)}
                results.append(case)
                lines.append(_line(case))
                print(lines[-1], flush=True)
    layout, manifest = Layout.named(args.layouts.split(",")[-1]), None
    for old in [int(n) for n in args.ranks.split(",") if n][-1:]:
        manifest = manifest_case(layout, old, args.repeat)
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
    publishes = []
    for world in (int(n) for n in args.publish_ranks.split(",") if n):
        for when in ("before", "after") if world <= args.publish_before_ranks else ("after",):
            publishes.append(publish_case(layout, args.layouts.split(",")[-1], world, when, args.repeat))
            lines.append(_publish_line(publishes[-1]))
            print(lines[-1], flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.json").write_text(json.dumps({"plans": results, "manifest": manifest, "store": stores,
                                                         "publish": publishes}, indent=1))
        table = "\n".join([header, *lines])
        (args.out / "scale.md").write_text(
            "# Restore planning at scale (bench.scale)\n\nCPU seconds (median of the runs; the plan's mean "
            "and worst beside it), peak Python MB. build: the step's layout.json from every rank's records "
            "(once per step, by one writer); plan: one new rank's restore plan (layout.json parsed, planned, "
            "the manifests of the `reads` old ranks it needs parsed, bound); baseline: the same rank planned "
            "tensor by tensor over every old rank's records in memory (reading them not counted); x = "
            "baseline / plan.\n\n```\n" + table + "\n```\n")


def publish_case(layout: Layout, name: str, world: int, when: str, repeat: int) -> dict:
    """One step's publish at ``world`` ranks (:mod:`bench.store_publish`): the publisher's CPU
    seconds, peak Python MB and store requests; after, also a host's own part and a late host."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="publish-"))
    try:
        setup = store_publish.setup_after if when == "after" else store_publish.setup_before
        setup_s = timed(lambda: setup(root, layout, world))[0]
        publish = store_publish.publish_after if when == "after" else store_publish.publish_before
        gc.collect()
        cpu = []
        for _ in range(repeat if when == "after" else 1):
            seconds, (store, raw) = timed(lambda: publish(root, world))
            cpu.append(seconds)
        case = {"layout": name, "ranks": world, "hosts": world // store_publish.RANKS_PER_HOST, "when": when,
                "setup_cpu_s": setup_s, "cpu_s": summary(cpu), "peak_mb": peak_bytes(lambda: publish(root, world)) / 2**20,
                "requests": store.requests(), "calls": dict(store.calls), "read": dict(store.read),
                "layout_bytes": len(raw)}
        latest = store_publish.latest_unpublished(root)
        case.update(latest_requests=latest.requests(), latest_calls=dict(latest.calls))
        if when == "after":
            assert raw == layout_json(layout, world), "the layout merged from the parts is not the step's"
            late = store_publish.late_host(root, world)
            part, names = store_publish.own_part(layout, world)
            own = summary([timed(lambda: store_publish.own_part(layout, world))[0] for _ in range(repeat)])
            case.update(late_requests=late.requests(), late_calls=dict(late.calls), part_bytes=part,
                        names_bytes=names, own_part_cpu_s=own)
        return case
    finally:
        store_publish.clean(root)


def _publish_line(case: dict) -> str:
    cpu = case["cpu_s"]
    line = (f"publish {case['when']:>6} {case['layout']} {case['ranks']:>5} ranks ({case['hosts']} hosts): "
            f"CPU {cpu['median']:.2f} s (mean {cpu['mean']:.2f}, worst {cpu['worst']:.2f}), peak {case['peak_mb']:.0f} MB, "
            f"{case['requests']} requests ({_calls(case['calls'])}; read {_calls(case['read'])}), "
            f"layout.json {case['layout_bytes'] / 1e3:.0f} kB; latest without the step's index "
            f"{case['latest_requests']} requests ({_calls(case['latest_calls'])})")
    if case["when"] == "after":
        line += (f"; a host finishing meanwhile: {case['late_requests']} requests ({_calls(case['late_calls'])}); "
                 f"a host's part {case['part_bytes'] / 1e3:.1f} kB + names {case['names_bytes'] / 1e3:.0f} kB, "
                 f"built in {_fmt(case['own_part_cpu_s'])}")
    return line


def _line(case: dict) -> str:
    """One case's row: medians (``-`` where every old rank's records were not built), then
    the plan's mean and worst."""
    build, base, plan = case.get("layout_build_cpu_s"), case.get("baseline_plan_cpu_s"), case["plan_cpu_s"]
    build_s = f"{build['median']:.2f}" if build else "-"
    base_s, ratio = (f"{base['median']:.3f}", f"{base['median'] / max(plan['median'], 1e-9):.0f}") if base else ("-", "-")
    return (f"{case['layout']:>9} {case['old_ranks']:>5} -> {case['new_ranks']:<5} {build_s:>8} "
            f"{case['layout_bytes'] / 1e3:9.0f} {plan['median']:7.3f} {case['plan_peak_mb']:7.1f} "
            f"{case['manifests_read']:5} {case['bytes_read'] / case['bytes_needed']:9.3f} "
            f"{case['bytes_read_direct'] / case['bytes_needed']:6.3f} {base_s:>10} {ratio:>6}"
            f"   (plan mean {plan['mean']:.3f}, worst {plan['worst']:.3f})")


def _calls(counter) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counter.items()))


def _fmt(cpu: dict[str, float]) -> str:
    return f"{cpu['median'] * 1e3:.0f} ms (mean {cpu['mean'] * 1e3:.0f}, worst {cpu['worst'] * 1e3:.0f})"


if __name__ == "__main__":
    main()
