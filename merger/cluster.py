"""Grid points, trials and landscape rows on a Ray cluster: the same jobs as the local path, run by
workers that each open the pool once (an actor holding a ``PoolSession``, on a GPU where the worker
has one) and reuse its caches across tasks. Results come back to the driver as they finish; the
driver alone writes the history.

Ray is imported only here, and only when a job names ``--ray``: the app and the demo start as fast
without it. A worker needs the pool's files at the same paths (a shared filesystem, or copies)."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Callable, Sequence

from merger.errors import MergerError

RAY_PIN = "ray>=2.52"  # as the cluster extra in pyproject.toml
RETRIES = 3  # a worker restarted, and its unfinished tasks retried, this often: a point that kills every
# worker it meets (out of memory) then reaches the user as an error instead of looping
START_S = 300  # the workers must have opened the pool by then (a cluster without the resources asked waits)
_WORKER_CLASS = None


def _ray():
    try:
        import ray
    except ImportError:
        raise MergerError(f"--ray: the ray package is not installed here (pip install '{RAY_PIN}', the cluster "
                          "extra); leave --ray out to run locally") from None
    return ray


MAX_WORKERS = 1024  # a bound before Ray is asked (a million local workers crashed Ray itself)


def connect(address: str, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address`` ("auto": the one this machine belongs to, RAY_ADDRESS or
    a running local instance; "local": start one in this process with ``num_cpus``, all cores by
    default; else host:port or ray://host:port). Nothing leaves the machine for "local": no dashboard, no usage stats."""
    ray = _ray()
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's notice about a future default for GPU visibility: nothing the user can act on here
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray(\.|$)")
    if address not in ("auto", "local"):
        check_reachable(address)
    # ray.init sets its own SIGTERM handler (exit 15) in place of the process's: the command's is put
    # back after, so a killed job still unwinds as any command does (exit 143, temporary files removed)
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        if address == "local":
            # address="local": a new instance, never one that RAY_ADDRESS or a running head names
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except SystemExit as exc:  # a kill while Ray started met Ray's handler: given to the one it replaced
        if callable(sigterm) and exc.code == signal.SIGTERM:
            sigterm(signal.SIGTERM, None)  # the command's raises Terminated: "interrupted", exit 143
        raise
    except Exception as exc:  # ConnectionError, a timeout, a bad address: all mean "not reachable"
        raise MergerError(f"--ray {address}: no Ray cluster could be reached there ({str(exc).splitlines()[0][:200]}); "
                          "start one with `ray start --head`, or use --ray local") from None
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # preface, SETTINGS


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A host:port (or ray://host:port) that accepts a TCP connection and answers as a gRPC server
    does (Ray's GCS and its client server are: an HTTP/2 SETTINGS frame first), within ``timeout_s``:
    Ray itself kept retrying an unreachable address, or one where something else listens, for minutes."""
    import socket

    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise MergerError(f"--ray {address}: expected auto, local, host:port or ray://host:port")
    host = host.strip("[]") or "127.0.0.1"  # [::1]:6379
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(HTTP2_HELLO)
            first = b""
            while len(first) < 9:
                chunk = sock.recv(9 - len(first))
                if not chunk:
                    break
                first += chunk
    except socket.timeout:
        first = b""
    except OSError as exc:
        raise MergerError(f"--ray {address}: no Ray cluster could be reached there ({exc.strerror or exc}); "
                          "start one with `ray start --head`, or use --ray local") from None
    if len(first) < 9 or first[3] != 0x04:
        raise MergerError(f"--ray {address}: something listens there, but it does not answer as Ray does (no gRPC "
                          f"within {timeout_s:g} s); give the address `ray start --head` printed")


def _worker_class():
    """The actor class (defined on first use, so that importing this module needs no Ray). A killed
    worker is restarted and its unfinished tasks are retried (each is a pure function of its spec)."""
    global _WORKER_CLASS
    if _WORKER_CLASS is None:
        ray = _ray()

        @ray.remote(max_restarts=RETRIES, max_task_retries=RETRIES)
        class PoolWorker:
            def __init__(self, pool_source: str, device: str, autocast: bool | str):
                import torch

                from merger.evaluation.session import PoolSession
                from merger.pool.pool import open_pool

                cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
                torch.set_num_threads(max(1, int(cpus)))  # its share of the machine, not every core
                self.session = PoolSession(open_pool(pool_source, device=device))
                self.autocast = autocast  # the app's forwards' precision, set as the evaluator is first used

            def _session(self):
                if self.autocast is not None:  # once: an out-of-memory fallback may change it later
                    self.session.evaluator.autocast, self.autocast = self.autocast, None
                return self.session

            def pid(self) -> int:
                return os.getpid()

            def evaluate(self, spec, split: str):
                result = self._session().preview(spec, split)
                return dataclasses.replace(result, per_image={})  # what the driver records, not per image

            def plane_row(self, plane, xs: Sequence[float], y: float, split: str):
                device = self.session.pool.task_vectors.device
                plane = dataclasses.replace(plane, origin=plane.origin.to(device), dirs=plane.dirs.to(device))
                return [self._session().values_on_plane(plane, x, y, split) for x in xs]

            def expert_accuracy(self, split: str) -> dict:
                return self._session().expert_accuracy(split)

        _WORKER_CLASS = PoolWorker
    return _WORKER_CLASS


class Cluster:
    """``workers`` actors over one pool; ``evaluate`` and ``plane_rows`` spread work over them and
    hand each answer to a callback as it arrives (in completion order)."""

    def __init__(self, address: str, pool_source: str, workers: int = 2, num_cpus: int | None = None,
                 experts: Sequence[str] = (), autocast: bool | str = True):
        """``autocast``: the workers' ``Evaluator.autocast`` (the app gives its own forwards' precision)."""
        if not 1 <= workers <= MAX_WORKERS:
            raise MergerError(f"--workers {workers}: from 1 to {MAX_WORKERS} workers")
        connect(address, num_cpus)
        ray = _ray()
        self.address = address
        self.experts = set(experts)  # the pool's own experts: a lab expert exists only in the app
        resources = ray.cluster_resources()
        gpus, cpus = resources.get("GPU", 0), resources.get("CPU", 1)
        if workers > cpus:  # each worker takes a CPU: the ones beyond would wait for one forever
            raise MergerError(f"--workers {workers}: the Ray cluster ({address}) has {int(cpus)} CPUs and each worker "
                              f"takes one: at most {int(cpus)}")
        # a share of the GPUs (a fraction where workers outnumber them), else of the CPUs, per worker
        options = {"num_cpus": max(1, int(cpus // workers))}
        if gpus:
            options["num_gpus"] = min(1.0, gpus / workers)
        self.device = "cuda" if gpus else "cpu"
        source = Path(pool_source)
        source = str(source.resolve()) if source.exists() else pool_source  # workers may start elsewhere
        self.workers = [_worker_class().options(**options).remote(source, self.device, autocast) for _ in range(workers)]
        self._expert_acc: dict = {}
        try:
            ray.get([w.pid.remote() for w in self.workers], timeout=START_S)
        except Exception as exc:  # the pool failed to open there, or the resources never came
            self.close()
            raise MergerError(f"--ray {address}: the workers did not start ({_reason(exc)}); the cluster has "
                              f"{cpus:g} CPUs and {gpus:g} GPUs, and each worker asks for {options}") from None

    def _stream(self, refs: list, on_each: Callable[[int, object], None]) -> list:
        ray = _ray()
        index = {ref: i for i, ref in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = index[ref]
                    try:
                        out[i] = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:  # the worker's own error (a MergerError...)
                        raise MergerError(_reason(exc)) from None
                    on_each(i, out[i])
        finally:  # an error, or a job given up: the rest would keep the workers busy
            for ref in pending:
                ray.cancel(ref)
        return out

    def serves(self, spec) -> bool:
        """Whether the workers have every expert of a spec (a lab expert exists only in the app)."""
        return not self.experts or set(spec.experts) <= self.experts

    def expert_accuracy(self, split: str) -> dict:
        """The experts' accuracies on a split, from a worker (none of the driver's forwards)."""
        if split not in self._expert_acc:
            self._expert_acc[split] = _ray().get(self.workers[0].expert_accuracy.remote(split))
        return self._expert_acc[split]

    def evaluate(self, items: Sequence[tuple], on_each: Callable[[int, object], None]) -> list:
        """Results of (spec, split) items. Contiguous blocks go to each worker, so a worker meets a
        method's points together and prepares it once."""
        n = len(self.workers)
        size = -(-len(items) // n) if items else 0
        refs = [self.workers[i // size].evaluate.remote(spec, split) for i, (spec, split) in enumerate(items)]
        return self._stream(refs, on_each)

    def plane_rows(self, plane, xs: Sequence[float], ys: Sequence[float], split: str,
                   on_each: Callable[[int, object], None]) -> list:
        """Per y, the (accuracy, loss) of every x on a plane; the plane is shipped once."""
        ray = _ray()
        ref = ray.put(dataclasses.replace(plane, origin=plane.origin.cpu(), dirs=plane.dirs.cpu()))  # any node reads it
        refs = [self.workers[i % len(self.workers)].plane_row.remote(ref, list(xs), y, split) for i, y in enumerate(ys)]
        return self._stream(refs, on_each)

    def worker_pids(self) -> list[int]:
        return _ray().get([w.pid.remote() for w in self.workers])

    def kill_worker(self, i: int) -> None:
        """Kill one worker's process (it is restarted; its unfinished tasks are retried): for tests."""
        _ray().kill(self.workers[i], no_restart=False)

    def close(self) -> None:
        ray = _ray()
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def _reason(exc: Exception) -> str:
    """The last line of a remote error that says what went wrong (Ray wraps it in tracebacks)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln.split(":")[0] or ln.startswith("error")]
    return (named[-1] if named else lines[-1] if lines else type(exc).__name__)[:300]
