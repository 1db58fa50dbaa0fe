"""Offline assets and a subprocess runner for torchtitan's own trainer on the CPU.

* :func:`build_titan_assets`: a WordLevel tokenizer (tokenizer.json + tokenizer_config.json,
  what torchtitan 0.2.2's ``HuggingFaceTokenizer`` loads from ``--model.hf_assets_path``) whose
  vocabulary is exactly llama3 ``debugmodel``'s 2048, and a dataset in torchtitan's ``c4_test``
  layout (a folder with ``data.json``, one ``{"text", "timestamp", "url"}`` object per line, as
  in torchtitan's repo ``tests/assets/c4_test``, which the wheel does not ship) for
  ``--training.dataset c4_test --training.dataset_path DIR``. Text and vocabulary are
  generated from a fixed seed (a sparse Markov chain, so the loss visibly falls).
* :func:`base_flags`: the tiny llama3 debugmodel job (seq 64, batch 2, fp32, no compile, no
  activation checkpointing, checkpoints off, log every step, fixed seed, deterministic).
* :func:`launch`: runs ``tests/torchtitan/launcher.py`` in a subprocess and returns the
  per-step losses it recorded (``float.hex()`` strings), raising with the output's tail on a
  failure or a timeout.

Named ``titan_testkit`` (not ``conftest`` helpers) so other test folders can import it once
``tests/torchtitan`` is on ``sys.path``; the folder has no ``__init__.py`` on purpose: pytest
would name it package ``torchtitan`` and shadow the real one.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from warm_start import SOCKET_ENV as WARM_SOCKET_ENV
from warm_start import import_time_env

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
LAUNCHER = HERE / "launcher.py"
WARM_START = HERE / "warm_start.py"

LOSS_FILE_ENV = "SWAP_STATE_TEST_LOSS_FILE"
STOP_AFTER_STEP_ENV = "SWAP_STATE_TEST_STOP_AFTER_STEP"
STOP_MODE_ENV = "SWAP_STATE_TEST_STOP_MODE"
STOP_EXIT_CODE_ENV = "SWAP_STATE_TEST_STOP_EXIT_CODE"
LOSS_RANK_ENV = "SWAP_STATE_TEST_LOSS_RANK"

VOCAB_SIZE = 2048  # llama3 "debugmodel" vocab_size (torchtitan/models/llama3/__init__.py)
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
SEQ_LEN = 64
BATCH = 2
DEFAULT_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class TitanAssets:
    root: Path
    tokenizer_dir: Path  # --model.hf_assets_path
    dataset_dir: Path  # --training.dataset_path (with --training.dataset c4_test)
    hf_cache_dir: Path  # HF_HOME for the runs: datasets' arrow cache stays in the test tree
    vocab_size: int = VOCAB_SIZE


@dataclass
class TrainerRun:
    losses: list[str]  # float.hex() per step, in the order the steps ran
    steps: list[int]  # the step number of each loss
    returncode: int
    output: str  # stdout and stderr, interleaved
    wall_s: float
    argv: list[str] = field(default_factory=list)

    def by_step(self) -> dict[int, str]:
        return dict(zip(self.steps, self.losses))


class TrainerRunError(AssertionError):
    pass


def _words(n: int) -> list[str]:
    return [f"w{i:04d}" for i in range(n)]


def build_titan_assets(root: str | os.PathLike, *, seed: int = 1234, docs: int = 120) -> TitanAssets:
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = Path(root)
    tokenizer_dir, dataset_dir, hf_cache = root / "tokenizer", root / "c4_test", root / "hf_home"
    for d in (tokenizer_dir, dataset_dir, hf_cache):
        d.mkdir(parents=True, exist_ok=True)

    specials = [BOS, EOS, UNK]
    words = _words(VOCAB_SIZE - len(specials))
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    added = {
        str(vocab[tok]): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
        for tok in specials
    }
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": True,
        "added_tokens_decoder": added,
        "model_max_length": SEQ_LEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))

    # A sparse Markov chain over the words: each word has 3 successors, so there is
    # something to learn and the loss drops within a few steps.
    rng = random.Random(seed)
    successors = [[rng.randrange(len(words)) for _ in range(3)] for _ in words]
    with open(dataset_dir / "data.json", "w") as f:
        for doc in range(docs):
            w = rng.randrange(len(words))
            out = []
            for _ in range(rng.randint(40, 160)):
                out.append(words[w])
                w = rng.choice(successors[w])
            f.write(json.dumps({
                "text": " ".join(out),
                "timestamp": f"2019-04-{1 + doc % 28:02d}T00:00:00Z",
                "url": f"https://example.invalid/doc/{doc}",
            }) + "\n")
    return TitanAssets(root=root, tokenizer_dir=tokenizer_dir, dataset_dir=dataset_dir,
                       hf_cache_dir=hf_cache)


def base_flags(assets: TitanAssets, dump_folder: str | os.PathLike, *, steps: int = 6) -> list[str]:
    """The tiny debugmodel job; later flags (``launch``'s) override these."""
    return [
        f"--job.dump_folder={dump_folder}",
        "--model.name=llama3",
        "--model.flavor=debugmodel",
        f"--model.hf_assets_path={assets.tokenizer_dir}",
        "--training.dataset=c4_test",
        f"--training.dataset_path={assets.dataset_dir}",
        f"--training.seq_len={SEQ_LEN}",
        f"--training.local_batch_size={BATCH}",
        f"--training.steps={steps}",
        "--training.dtype=float32",
        "--training.mixed_precision_param=float32",
        "--training.max_norm=1.0",
        "--optimizer.name=AdamW",
        "--optimizer.implementation=fused",
        "--optimizer.lr=0.008",
        "--lr_scheduler.warmup_steps=2",
        "--activation_checkpoint.mode=none",
        "--compile.no-enable",
        "--checkpoint.no-enable",
        "--metrics.log_freq=1",
        "--metrics.disable_color_printing",
        "--comm.trace_buf_size=0",
        "--debug.seed=42",
        "--debug.deterministic",
    ]


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def read_losses(path: str | os.PathLike) -> tuple[list[int], list[str]]:
    steps, losses = [], []
    p = Path(path)
    if p.exists():
        for line in p.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                steps.append(int(rec["step"]))
                losses.append(rec["loss"])
    return steps, losses


#: Inherited variables a launcher run must not see: torchrun's (a fresh port per run) and the
#: launcher's own controls.
_NOT_INHERITED = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", STOP_AFTER_STEP_ENV, STOP_MODE_ENV,
    STOP_EXIT_CODE_ENV, LOSS_FILE_ENV, LOSS_RANK_ENV,
)  # fmt: skip


def launcher_env(assets: TitanAssets, extra: dict[str, str], drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a launcher run: offline HF caches of ``assets``, nothing
    torchrun-ish or launcher-controlling inherited (nor ``drop``), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED and k not in drop}
    env.update({
        "HF_HOME": str(assets.hf_cache_dir),
        "HF_DATASETS_CACHE": str(assets.hf_cache_dir / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })  # fmt: skip
    env.update(extra)
    return env


class Losses(list):
    """The per-step losses (float.hex()) of one run; compares equal to a plain list."""

    steps: list[int]
    run: TrainerRun


def as_losses(run: TrainerRun) -> Losses:
    """``run``'s losses as a :class:`Losses` (what the ``run_trainer`` fixtures return)."""
    losses = Losses(run.losses)
    losses.steps = run.steps
    losses.run = run
    return losses


def fresh_loss_file(dump_folder: Path) -> Path:
    """``<dump_folder>/losses-<n>.jsonl`` for the first ``n`` not taken (one per run)."""
    n = 0
    while (dump_folder / f"losses-{n}.jsonl").exists():
        n += 1
    return dump_folder / f"losses-{n}.jsonl"


def finished_run(argv: list[str], loss_file: Path, returncode: int, output: str, wall: float, *,
                 check: bool, expect_returncode: int) -> TrainerRun:
    """The run's :class:`TrainerRun` (losses read back); with ``check`` a return code other
    than ``expect_returncode`` raises :class:`TrainerRunError` with the output's tail."""
    steps_done, losses = read_losses(loss_file)
    run = TrainerRun(losses=losses, steps=steps_done, returncode=returncode, output=output,
                     wall_s=wall, argv=argv)
    if check and returncode != expect_returncode:
        raise TrainerRunError(f"trainer exited {returncode} (expected {expect_returncode}) after "
                              f"{wall:.1f}s: {' '.join(argv)}\n{_tail(output)}")
    return run


def rank_threads(nproc: int) -> str:
    """OMP_NUM_THREADS for each of ``nproc`` ranks: this machine's CPUs shared out, at least 1.
    More threads than CPUs spin in OpenMP's barriers: on the 2-CPU CI machine a 2-rank
    torchtitan test at 2 threads a rank took 44 s of CPU (user and system), at 1 thread 32 s."""
    return str(max(1, len(os.sched_getaffinity(0)) // nproc))


class WarmStarts:
    """This process's warm-start servers (warm_start.py), one per python and import-time
    environment, started on first use; they die with this process. A run through one costs
    about half the CPU of a cold one. ``SWAP_STATE_TEST_WARM_START=0``: every run cold."""

    #: What the servers import: torchtitan's costly imports, not torchtitan (3.6 s of CPU).
    MODULES = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor",
               "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.pipelining",
               "datasets")
    READY_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        self._folder: Path | None = None
        self._servers: dict[tuple, str | None] = {}
        self._procs: list[subprocess.Popen] = []

    def argv(self, python: str, env: dict[str, str]) -> list[str]:
        """What comes between ``python`` and a script to run it warm (``env`` gains the
        server's socket), or nothing (cold)."""
        if os.environ.get("SWAP_STATE_TEST_WARM_START", "1") == "0":
            return []
        key = (python, tuple(sorted(import_time_env(env).items())))
        if key not in self._servers:
            self._servers[key] = self._start(python, env)
        path = self._servers[key]
        if path is None:
            return []
        env[WARM_SOCKET_ENV] = path
        return [str(WARM_START), "run"]

    def _start(self, python: str, env: dict[str, str]) -> str | None:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="swap-state-warm-"))  # short: a socket path
            atexit.register(self.close)
        n = len(self._procs)
        path = self._folder / f"{n}.sock"
        with open(self._folder / f"{n}.log", "wb") as log:
            proc = subprocess.Popen([python, str(WARM_START), "serve", str(path), *self.MODULES], env=env,
                                    cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(proc)
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        while not path.exists():  # the server renames its bound socket into place when ready
            if proc.poll() is not None or time.monotonic() > deadline:
                return None  # runs go cold; the log says why
            time.sleep(0.05)
        return str(path)

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
        self._procs.clear()
        self._servers.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


#: The warm starts of every launch in this process.
WARM = WarmStarts()


def runner_argv(python: str, nproc: int, *, nnodes: int = 1, node_rank: int = 0,
                master_port: int | None = None, warm: Sequence[str] = ()) -> list[str]:
    """What runs a launcher script (its path and flags follow): ``python`` itself for one rank;
    for several, torchrun (gloo on the CPU), which runs the script once per rank. Each started
    ``warm`` (:meth:`WarmStarts.argv`: 2.5 s of imports less per launch), torchrun and the ranks
    it starts alike. With ``nnodes`` above 1: node ``node_rank`` of a multi-node torchrun job
    (``nproc`` ranks on this node), meeting the others at the static rendezvous on
    127.0.0.1:``master_port`` that node 0 serves."""
    if nnodes > 1:
        if master_port is None:
            raise ValueError("a multi-node torchrun needs the rendezvous port (master_port)")
        return [python, *warm, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
                f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={master_port}", *warm]
    if nproc == 1:
        return [python, *warm]
    return [python, *warm, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *warm]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Seconds the other hosts' launches get to end by themselves once one has failed (its peers
#: would otherwise wait in a collective until gloo's timeout), before they are killed.
FAILED_PEER_GRACE_S = 10.0


def run_launches(argvs: list[list[str]], envs: list[dict[str, str]], timeout: float
                 ) -> tuple[list[int] | None, str, float]:
    """Run the launches side by side (each in its own session, output to a temporary file):
    their return codes (None: timed out, all killed), their outputs (one after the other,
    headed by their host's index when there are several) and the wall time. Once one fails,
    the others are killed after :data:`FAILED_PEER_GRACE_S`."""
    outputs = [tempfile.TemporaryFile() for _ in argvs]
    start = time.monotonic()
    procs = [subprocess.Popen(argv, cwd=str(REPO_ROOT), env=env, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True) for argv, env, out in zip(argvs, envs, outputs)]
    deadline, failed_at, timed_out = start + timeout, None, False
    try:
        while any(proc.poll() is None for proc in procs):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if failed_at is None and any(proc.returncode not in (None, 0) for proc in procs):
                failed_at = now
            if failed_at is not None and now > failed_at + FAILED_PEER_GRACE_S:
                break  # the failure is reported; its peers are killed
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    wall = time.monotonic() - start
    texts = []
    for host, out in enumerate(outputs):
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.close()
        texts.append(text if len(argvs) == 1 else f"--- host {host} (torchrun node rank {host}) ---\n{text}")
    return None if timed_out else [proc.returncode for proc in procs], "\n".join(texts), wall


def launch(
    assets: TitanAssets,
    dump_folder: str | os.PathLike,
    *flags: str,
    steps: int = 6,
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    expect_returncode: int = 0,
    loss_file: str | os.PathLike | None = None,
    nproc: int = 1,
    hosts: Sequence[dict[str, str]] | None = None,
) -> TrainerRun:
    """Run the CPU launcher on ``base_flags(assets, dump_folder, steps=steps) + flags``
    (``nproc`` ranks under torchrun when above 1; rank 0 records the losses).

    ``env`` is added to (and overrides) this process's environment. ``hosts``: the job runs
    as on ``len(hosts)`` hosts, the way multi-host torchrun does: one torchrun launch per
    host (``--nnodes len(hosts) --node-rank i``, ``nproc // len(hosts)`` ranks each, one
    static rendezvous on 127.0.0.1), launch ``i`` with ``hosts[i]`` added to its environment
    (for example its host's ``SWAP_STATE_SERVER``); its ranks are ``i * nproc // len(hosts)``
    on. The run fails when any launch does. The loss file defaults to
    ``<dump_folder>/losses-<n>.jsonl`` (a fresh one per call). With ``check`` a return code
    other than ``expect_returncode`` (any launch's) or a timeout raises
    :class:`TrainerRunError` carrying the output's tail.
    """
    dump_folder = Path(dump_folder)
    dump_folder.mkdir(parents=True, exist_ok=True)
    loss_file = fresh_loss_file(dump_folder) if loss_file is None else Path(loss_file)
    loss_file.write_text("")
    host_envs = list(hosts) if hosts else [{}]
    if nproc % len(host_envs):
        raise ValueError(f"{nproc} ranks do not split evenly over {len(host_envs)} hosts")
    per_host = nproc // len(host_envs)

    run_env = launcher_env(assets, {LOSS_FILE_ENV: str(loss_file)})
    run_env.setdefault("OMP_NUM_THREADS", rank_threads(nproc))
    run_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([run_env["PYTHONPATH"]] if run_env.get("PYTHONPATH") else [])
    )
    run_env.update(env or {})
    port = free_port() if len(host_envs) > 1 else None
    argvs, envs = [], []
    for node, host_env in enumerate(host_envs):
        node_env = {**run_env, **host_env}
        argvs.append([*runner_argv(sys.executable, per_host, nnodes=len(host_envs), node_rank=node,
                                   master_port=port, warm=WARM.argv(sys.executable, node_env)),
                      str(LAUNCHER),
                      *base_flags(assets, dump_folder, steps=steps), *flags])
        envs.append(node_env)
    argv = [arg for node_argv in argvs for arg in (*node_argv, "&")][:-1]  # what ran, as one line

    returncodes, output, wall = run_launches(argvs, envs, timeout)
    if returncodes is None:
        raise TrainerRunError(f"trainer timed out after {timeout}s: {' '.join(argv)}\n{_tail(output)}")
    returncode = next((code for code in returncodes if code != expect_returncode), expect_returncode)
    return finished_run(argv, loss_file, returncode, output, wall,
                        check=check, expect_returncode=expect_returncode)
