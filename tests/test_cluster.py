"""Sweeps, auto-tune and landscapes on a local Ray instance: the same results as the
local path, a killed worker's tasks retried with nothing lost or doubled in the history, a resumed
job skipping what the history holds, and clear messages when Ray is absent or unreachable. Ray runs
in this process with 2 CPUs, no dashboard and no usage stats: nothing leaves the machine."""
import json
import subprocess
import sys

import pytest
import torch
from helpers import write_pool

import merger
from merger.errors import Cancelled, MergerError
from merger.evaluation.tuning import auto_tune, evaluate_all, sweep
from merger.io.history import History

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return merger.open_pool(write_pool(tmp_path_factory.mktemp("cluster"), n_experts=3, scale=0.2, demo_data=True))


@pytest.fixture(scope="module")
def cluster(pool):
    from merger.cluster import Cluster

    c = Cluster("local", pool.source, workers=2, num_cpus=2)
    yield c
    c.close()
    ray.shutdown()


def _same(a, b):
    assert a.keys() == b.keys()
    for m in a:
        assert a[m]["x"] == b[m]["x"]
        assert a[m]["average"] == pytest.approx(b[m]["average"], abs=1e-9), m


def test_a_sweep_on_the_workers_equals_the_local_sweep(pool, cluster):
    args = (["task_arithmetic", "ties"], "lam", [0.1, 0.3, 0.5, 0.7])
    _same(sweep(merger.PoolSession(pool), *args, cluster=cluster), sweep(merger.PoolSession(pool), *args))


def test_auto_tune_and_a_landscape_on_the_workers_equal_the_local_ones(pool, cluster):
    here, there = merger.PoolSession(pool), merger.PoolSession(pool)
    a = auto_tune(here, ["task_arithmetic"])[0]
    b = auto_tune(there, ["task_arithmetic"], cluster=cluster)[0]
    assert a["spec"] == b["spec"] and a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-9)
    land = here.landscape
    points = land.named_points(["base", "experts"])
    from merger.landscape.surface import pca_plane

    plane = pca_plane(points)
    local = land.surface(plane, (-1, 1, -1, 1), 3, "probe")
    remote = land.surface(plane, (-1, 1, -1, 1), 3, "probe", cluster=cluster)
    for t in pool.tasks:
        assert torch.allclose(torch.tensor(local.loss[t]), torch.tensor(remote.loss[t]), atol=1e-5)
    # Cancel reaches the workers' rows too (the app's Landscape Cancel said so, and did nothing there)
    with pytest.raises(Cancelled, match=r"landscape cancelled after 0 of 4 rows \(on the workers\)"):
        land.surface(plane, (-1, 1, -1, 1), 4, "probe", cluster=cluster, cancel=lambda: True)


def test_a_killed_worker_loses_and_doubles_nothing(pool, cluster, tmp_path):
    session = merger.PoolSession(pool)
    history = History(tmp_path / "h.sqlite")
    items = [(session.spec("task_arithmetic", lam=round(0.1 * i, 2)), "test") for i in range(1, 13)]
    before = cluster.worker_pids()
    seen = []

    def on_result(spec, result):
        seen.append(spec)
        history.record("p", spec.snap(), result)
        if len(seen) == 1:
            cluster.kill_worker(1)  # its queued points (the second half) must be retried on its restart

    got = evaluate_all(session, items, cluster=cluster, on_result=on_result)
    assert cluster.worker_pids()[1] != before[1]  # it was killed and restarted
    assert sorted(s.kwargs["lam"] for s in seen) == [s.kwargs["lam"] for s, _ in items]  # each once
    assert len(history.rows(limit=100)) == len(items)
    local = [session.preview(s, "test").average_accuracy for s, _ in items]
    assert [r.average_accuracy for r in got] == pytest.approx(local, abs=1e-9)


def test_resume_skips_the_points_the_history_holds(pool, tmp_path):
    cmd = [sys.executable, "-m", "merger", "sweep", "--pool", pool.source, "--methods", "task_arithmetic",
           "--history", str(tmp_path / "h.sqlite")]
    first = subprocess.run(cmd + ["--values", "0.1,0.2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(cmd + ["--values", "0.1,0.2,0.3", "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "1 evaluated, 2 from the history" in again.stdout
    assert "average accuracy % on the live split, against lam:" in again.stdout  # the split it defaults to
    assert len(History(tmp_path / "h.sqlite").rows()) == 3


def test_a_jobs_workers_forward_in_its_precision(pool, tmp_path):
    """--forward bf16 with --ray: the workers' forwards run under bf16 autocast as this process's would,
    and the history says so."""
    from merger.evaluation.evaluator import Evaluator
    from merger.evaluation.session import PoolSession

    cmd = [sys.executable, "-m", "merger", "sweep", "--pool", pool.source, "--methods", "task_arithmetic", "--values",
           "0.3", "--ray", "local", "--workers", "1", "--forward", "bf16", "--history", str(tmp_path / "h.sqlite")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row, = History(tmp_path / "h.sqlite").rows()
    fp32, bf16 = (PoolSession(merger.open_pool(pool.source)) for _ in range(2))  # a session has one precision
    bf16.evaluator.autocast = Evaluator.EVERYWHERE
    fp32, bf16 = (s.preview(s.spec("task_arithmetic", lam=0.3), "live").loss for s in (fp32, bf16))
    assert row["forward"] == "bf16" and json.loads(row["loss"]) == pytest.approx(bf16, rel=1e-6)
    assert json.loads(row["loss"]) != pytest.approx(fp32, rel=1e-6)


def test_ray_absent_or_unreachable_is_said_with_the_address(pool, monkeypatch):
    from merger import cluster as cluster_module

    with pytest.raises(MergerError, match=r"--ray 127.0.0.1:1: no Ray cluster could be reached there"):
        cluster_module.check_reachable("127.0.0.1:1")
    with pytest.raises(MergerError, match="expected auto, local, host:port"):
        cluster_module.check_reachable("nowhere")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(MergerError, match=r"the ray package is not installed here \(pip install 'ray>="):
        cluster_module.connect("local")


def test_an_address_where_something_else_listens_is_refused_at_once_and_rays_own_is_taken(cluster):
    """An HTTP server, or one that never answers, at --ray: Ray itself hung over two minutes there."""
    import socket
    import threading

    from merger import cluster as cluster_module

    def serve(answer: bytes | None):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()

        def run():
            conn, _ = server.accept()
            if answer is not None:
                conn.sendall(answer)
            conn.recv(1024)
            conn.close()
        threading.Thread(target=run, daemon=True).start()
        return f"127.0.0.1:{server.getsockname()[1]}"

    for answer in (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", None):
        address = serve(answer)
        with pytest.raises(MergerError, match=f"--ray {address}: something listens there, but it does not answer "
                                              "as Ray does"):
            cluster_module.check_reachable(address, timeout_s=1.0)
    cluster_module.check_reachable(ray.get_runtime_context().gcs_address)  # the running instance's own address


def test_more_workers_than_the_cluster_can_run_are_refused_in_one_line(pool, cluster):
    """A million local workers crashed Ray (exit 139); more than the cluster's CPUs waited forever."""
    from merger.cluster import MAX_WORKERS, Cluster

    with pytest.raises(MergerError, match=f"--workers 1000000: from 1 to {MAX_WORKERS} workers"):
        Cluster("local", pool.source, workers=1_000_000)
    with pytest.raises(MergerError, match=r"--workers 3: the Ray cluster \(local\) has 2 CPUs .* at most 2"):
        Cluster("local", pool.source, workers=3)  # joins the running 2-CPU instance


def test_the_apps_sweep_runs_on_the_cluster_and_fills_the_history(pool, cluster, tmp_path):
    """app --ray: the Compare tab's sweep goes to the workers (the same curve as here), and each point
    lands in the app's history as it finishes."""
    from merger.ui.compare_tab import CompareTab
    from merger.ui.merge_tab import Controller

    ctl = Controller(merger.PoolSession(pool), History(tmp_path / "h.sqlite"), cluster)
    CompareTab(ctl).sweep(None, "lam", ["task_arithmetic"], "live", None, progress=lambda *a, **k: None)
    rows = ctl.history.rows(limit=100)
    lams = merger.methods.get("task_arithmetic").param("lam").sweep
    assert sorted(json.loads(r["params"])["lam"] for r in rows) == sorted(lams)
    here = sweep(merger.PoolSession(pool), ["task_arithmetic"], "lam", list(lams))["task_arithmetic"]
    by_lam = {json.loads(r["params"])["lam"]: r["average_accuracy"] for r in rows}
    assert [by_lam[x] for x in here["x"]] == pytest.approx(here["average"], abs=1e-9)


def test_a_resumed_weight_search_replays_its_trials_and_evaluates_only_the_rest(pool, tmp_path):
    cmd = [sys.executable, "-m", "merger", "tune", "--pool", pool.source, "--weights", "task_arithmetic",
           "--history", str(tmp_path / "h.sqlite"), "--seed", "3"]
    first = subprocess.run(cmd + ["--budget", "4"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(cmd + ["--budget", "6", "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "; 2 evaluated, " in again.stdout  # the 4 trials answered before are read back, not evaluated
    whole = subprocess.run(cmd + ["--budget", "6", "--history", str(tmp_path / "h2.sqlite")], capture_output=True,
                           text=True, timeout=300)
    assert again.stdout.split(";")[0] == whole.stdout.split(";")[0]  # the same search as one without a break


def test_specs_naming_an_expert_the_workers_lack_are_evaluated_here(pool):
    """A lab expert exists only in the app's process: its points stay local, the others go out."""
    session = merger.PoolSession(pool)

    class Workers:  # stands in for a Cluster: it serves specs over the pool's first two experts only
        got = []

        def serves(self, spec):
            return set(spec.experts) <= set(pool.tasks[:2])

        def evaluate(self, items, on_each):
            self.got += [spec for spec, _ in items]
            for i, (spec, split) in enumerate(items):
                on_each(i, session.preview(spec, split))

    items = [(session.spec("task_arithmetic", experts=pool.tasks[:2], lam=0.3), "live"),
             (session.spec("task_arithmetic", lam=0.3), "live"),
             (session.spec("task_arithmetic", experts=pool.tasks[:2], lam=0.5), "live")]
    out = evaluate_all(session, items, cluster=Workers())
    assert Workers.got == [items[0][0].snap(), items[2][0].snap()]  # the points as computed
    assert [r.average_accuracy for r in out] == [session.preview(s, "live").average_accuracy for s, _ in items]


def test_joining_ray_keeps_the_commands_own_sigterm_handler():
    """ray.init puts its own handler (exit 15) in place of the command's: a killed `sweep --ray` then
    skipped the command's unwinding (exit 143, "error: interrupted")."""
    probe = ("import signal, merger.cluster as c\n"
             "def mine(signum, frame): pass\n"
             "signal.signal(signal.SIGTERM, mine)\n"
             "c.connect('local', num_cpus=1)\n"
             "print(signal.getsignal(signal.SIGTERM) is mine)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_kill_while_ray_starts_goes_to_the_commands_handler(monkeypatch):
    """Ray's handler (sys.exit(15)) is in place while ray.init starts the node: a kill then exited 15."""
    import signal
    import types

    from merger import cluster, runtime

    def init(**kwargs):  # as ray.init: its handler first, then a start that a kill cuts short
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(cluster, "_ray", lambda: types.SimpleNamespace(is_initialized=lambda: False, init=init))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(runtime.Terminated):
        with runtime.kill_unwinds():
            cluster.connect("local", num_cpus=1)
    assert signal.getsignal(signal.SIGTERM) is before
