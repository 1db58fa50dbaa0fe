"""Warm starts for the trainer runs: a process that has imported torchtitan's heavy
dependencies forks one child per run.

On the 2-CPU CI machine a one-rank torchtitan run takes about 7 s of CPU, 3.6 of them to import
torch (with dynamo and inductor, which torchtitan imports), torch.distributed's parts and
Hugging Face datasets: the same work in every run, and most of the suite's CPU. So

    python warm_start.py serve SOCKET MODULE...   imports the MODULEs, then serves SOCKET;
    python warm_start.py run SCRIPT ARG...        what ``python SCRIPT ARG...`` does, run in a
                                                  child forked from the server at
                                                  ``$SWAP_STATE_TEST_WARM_SOCKET``
    python warm_start.py run -m MODULE ARG...     likewise ``python -m MODULE ARG...`` (torchrun)

``run`` hands its stdin, stdout and stderr, environment, working directory and argv to the
server, which forks; the child takes them, starts its own session and runs SCRIPT as
``__main__`` (``runpy``), exactly as a fresh interpreter would, except that the MODULEs are
already in ``sys.modules`` and a run that returns ends as a forked child should, with
``os._exit`` once its threads are joined, its ``atexit`` functions run and its streams flushed:
the interpreter's teardown of torch's modules (2 s a process on CI's machine, 40-60% of a
short test run) is left out, and with it nothing the run asked for. torchtitan itself is never
imported by the server: the launchers patch torch while they import it. ``run`` ends as the child did (its exit code, or killed by
the same signal); if ``run`` dies, the server kills the child's session. Where no server
answers, or the run's import-time environment (what the MODULEs read when imported: OpenMP's,
torch's, Hugging Face's and Python's variables) differs from the server's, ``run`` executes
``python SCRIPT ARG...`` itself. Standard library only: the 0.3 venv's python runs it too.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import selectors
import signal
import socket
import sys

SOCKET_ENV = "SWAP_STATE_TEST_WARM_SOCKET"
#: Variables read when the warm modules are imported: a run must have the server's values.
IMPORT_TIME_PREFIXES = ("OMP_", "KMP_", "MKL_", "TORCH", "PYTORCH", "HF_", "PYTHON", "LD_", "CUDA", "TRANSFORMERS")
#: torchrun's per-rank variables, read when the run starts (TORCH_NCCL_: by an NCCL group), not at import.
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
_LENGTH = 4
_PR_SET_PDEATHSIG = 1


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(RUN_TIME_PREFIXES) and k != SOCKET_ENV}


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# -- run (the client: no heavy import) -------------------------------------------------------


def run(argv: list[str]) -> None:
    path = os.environ.get(SOCKET_ENV)
    if path:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
        except OSError:
            conn = None
        if conn is not None:
            _run_forked(conn, argv)  # returns only when the server refused
    os.execv(sys.executable, [sys.executable, *argv])


def _run_forked(conn: socket.socket, argv: list[str]) -> None:
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    message = len(request).to_bytes(_LENGTH, "big") + request
    sent = socket.send_fds(conn, [message], [0, 1, 2])
    if sent < len(message):
        conn.sendall(message[sent:])
    replies = conn.makefile("r")
    if replies.readline().strip() != "started":
        conn.close()
        return
    reply = replies.readline().split()
    if len(reply) != 2 or reply[0] != "exit":  # the run died with the server (its death signal)
        print("warm_start: the warm-start server went away during the run", file=sys.stderr)
        os._exit(70)
    code = int(reply[1])
    if code < 0:  # killed by a signal: so is this process
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# -- serve (the server) ------------------------------------------------------------------------


def serve(path: str, modules: list[str]) -> dict:
    """Serves until killed; in a forked child, returns that run's request (fds already its own)."""
    _die_with_parent()
    own = import_time_env(dict(os.environ))  # before the imports: inductor sets its cache dir's
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    os.rename(path + ".tmp", path)  # ready when the path exists
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in selector.select():
            if key.data is None:
                conn, _ = listener.accept()
                request = _accept(conn, own)
                if request is None:
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the run: none of the server's sockets and pidfds
                    for other in list(selector.get_map().values()):
                        if isinstance(other.fileobj, int):
                            os.close(other.fileobj)
                        else:
                            other.fileobj.close()
                    selector.close()
                    conn.close()
                    return request
                for fd in request["fds"]:
                    os.close(fd)
                conn.sendall(b"started\n")
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, ("exited", pid, conn))
                selector.register(conn, selectors.EVENT_READ, ("client", pid, conn))
            elif key.data[0] == "exited":
                _, pid, conn = key.data
                selector.unregister(key.fileobj)
                os.close(key.fileobj)
                _, status = os.waitpid(pid, 0)
                if conn.fileno() != -1:
                    selector.unregister(conn)
                    try:
                        conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
            else:  # the client closed its end: it died, so does its run
                _, pid, conn = key.data
                selector.unregister(conn)
                conn.close()
                for kill in (os.killpg, os.kill):  # the run's session; the run, if not yet its own
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _accept(conn: socket.socket, own: dict[str, str]) -> dict | None:
    """The request on ``conn`` with its fds, or None (refused: the client runs alone)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while len(data) >= _LENGTH and len(data) < _LENGTH + int.from_bytes(data[:_LENGTH], "big"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    try:
        request = json.loads(data[_LENGTH:])
    except ValueError:
        request = None
    theirs = import_time_env(request["env"]) if request is not None else {}
    if theirs != own:  # said in the server's log: which variables keep runs cold
        differ = sorted(k for k in {*theirs, *own} if theirs.get(k) != own.get(k))
        print(f"warm_start: refused a run: its import-time environment differs in {differ}", file=sys.stderr)
    if request is None or len(fds) != 3 or theirs != own:
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(b"refused\n")
        except OSError:
            pass
        conn.close()
        return None
    request["fds"] = fds
    return request


def become(request: dict) -> None:
    """In the forked child: take the run's session, streams, environment and argv."""
    os.setsid()
    _die_with_parent()
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if argv[0] == "-m":  # as ``python -m``: the working directory first on the path
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
    else:
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))


def main() -> None:
    command, *rest = sys.argv[1:]
    if command == "run":
        run(rest)  # never returns: it ends as the run did, or becomes ``python SCRIPT``
    path, *modules = rest
    request = serve(path, modules)
    become(request)
    import runpy

    argv = request["argv"]
    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
    _end()


def _end() -> None:
    """What an interpreter's exit does that a run can ask for, then ``os._exit(0)``: a run that
    raised (``SystemExit`` included) never gets here."""
    import atexit
    import threading

    threading._shutdown()  # as the interpreter's exit: threading's own exit hooks (executors'), joins
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
