"""Workshop hardening: a bad-input catalogue across loading, API, UI and CLI; sessions kept apart;
the history surviving a killed server; authentication; allowed roots."""
import os
import pickle
import re
import signal
import sqlite3
import sys
import threading

import pytest
import torch
import yaml
from helpers import TINY_CONFIG, base_and_experts, write_pool

import merger
from merger.errors import CheckpointError, DataError, MergerError, PoolError
from merger.io import checkpoints
from devtools import browser

gradio_client = pytest.importorskip("gradio_client")


# ---- loading (in-process) -------------------------------------------------------------------

def _pool_with(tmp_path, mutate):
    path = write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True)
    spec = yaml.safe_load(path.read_text())
    mutate(tmp_path, spec)
    path.write_text(yaml.safe_dump(spec))
    return path


def _expert(tmp_path, spec):
    return tmp_path / spec["experts"][next(iter(spec["experts"]))]


def _rewrite(tmp_path, spec, fn):
    p = _expert(tmp_path, spec)
    sd = checkpoints.load_state_dict(p)
    fn(sd)
    checkpoints.save_safetensors(sd, p)


class Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled(tmp_path, spec):
    with open(tmp_path / "evil.pt", "wb") as fh:
        pickle.dump({"visual.proj": Marker(str(tmp_path / "MARKER"))}, fh)
    spec["experts"][next(iter(spec["experts"]))] = "evil.pt"


def _other_arch(tmp_path, spec):
    cfg = dict(TINY_CONFIG, vision_cfg=dict(TINY_CONFIG["vision_cfg"], image_size=32, patch_size=16))
    _, experts = base_and_experts(1, config=cfg)
    checkpoints.save_safetensors(experts[0], tmp_path / "b16.safetensors")
    spec["experts"][next(iter(spec["experts"]))] = "b16.safetensors"


def _unreadable_images(tmp_path, spec):
    t = next(iter(spec["tasks"]))
    for split in ("train", "test"):
        for c in spec["tasks"][t]["classes"]:
            d = tmp_path / "imgs" / split / c
            d.mkdir(parents=True)
            (d / "bad.png").write_bytes(b"not a png")
    spec["tasks"][t]["data"] = {"folder": "imgs"}


LOADING = [
    ("truncated safetensors", lambda p, s: _expert(p, s).write_bytes(_expert(p, s).read_bytes()[:100]),
     CheckpointError, r"\.safetensors: truncated or corrupt"),
    ("corrupt file", lambda p, s: _expert(p, s).write_bytes(b"\x00garbage" * 10), CheckpointError, "truncated or corrupt"),
    ("pickled payload", _pickled, CheckpointError, r"evil\.pt: refused: .*pickled"),
    ("another architecture", _other_arch, CheckpointError, r"b16\.safetensors .*another architecture\? patch size 16"),
    ("missing key", lambda p, s: _rewrite(p, s, lambda sd: sd.pop("visual.proj")), CheckpointError, "missing keys: visual.proj"),
    ("extra key", lambda p, s: _rewrite(p, s, lambda sd: sd.__setitem__("visual.bogus", torch.zeros(1))),
     CheckpointError, "unexpected keys: visual.bogus"),
    ("mis-shaped key", lambda p, s: _rewrite(p, s, lambda sd: sd.__setitem__("visual.proj", torch.zeros(3, 3))),
     CheckpointError, r"mis-shaped keys: visual.proj \(3, 3\)"),
    ("NaN", lambda p, s: _rewrite(p, s, lambda sd: sd["visual.proj"].__setitem__((0, 0), float("nan"))),
     CheckpointError, "visual.proj holds 1 non-finite"),
    ("Inf", lambda p, s: _rewrite(p, s, lambda sd: sd["visual.proj"].__setitem__((0, 1), float("inf"))),
     CheckpointError, "visual.proj holds 1 non-finite"),
    ("pool YAML unknown key", lambda p, s: s.update(tasksz={}), PoolError, "unknown key.*tasksz"),
    ("task key typo", lambda p, s: s["tasks"][next(iter(s["tasks"]))].update(clases=[]), PoolError, "unknown key.*clases"),
]


@pytest.mark.parametrize("name, mutate, error, message", LOADING, ids=[c[0] for c in LOADING])
def test_loading_catalogue(tmp_path, name, mutate, error, message):
    path = _pool_with(tmp_path, mutate)
    with pytest.raises(error, match=message):
        merger.open_pool(path)
    assert not (tmp_path / "MARKER").exists()  # nothing was executed


def test_empty_task_and_unreadable_images(tmp_path):
    path = _pool_with(tmp_path, _unreadable_images)
    ev = merger.Evaluator(merger.open_pool(path))
    with pytest.raises(DataError, match=r"no readable images in .*imgs/test"):
        ev.evaluate(None, "test")


def test_paths_outside_the_allowed_roots(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    inside = tmp_path / "pool"
    inside.mkdir()
    path = write_pool(inside, n_experts=2, demo_data=True)
    spec = yaml.safe_load(path.read_text())
    name = next(iter(spec["experts"]))
    os.replace(inside / spec["experts"][name], outside / "e.safetensors")
    spec["experts"][name] = str(outside / "e.safetensors")
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match=f"experts.{name} = .*outside the allowed roots"):
        merger.open_pool(path, roots=[])
    merger.open_pool(path, roots=[str(outside)])  # allowed once its folder is a root
    spec["experts"][name] = "../outside/e.safetensors"  # relative escapes are caught too
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match="outside the allowed roots"):
        merger.open_pool(path, roots=[])


def test_oversized_grid_and_sweep(tmp_path):
    from merger.evaluation.tuning import sweep
    from merger.landscape.surface import pca_plane

    ex = merger.PoolSession(merger.open_pool(write_pool(tmp_path, n_experts=3, scale=0.1, demo_data=True)))
    land = ex.landscape
    plane = pca_plane(land.named_points(["base", "experts"]))
    with pytest.raises(MergerError, match="grid 1000×1000 is out of bounds"):
        land.surface(plane, (-1, 1, -1, 1), 1000)
    with pytest.raises(MergerError, match="sweep of 1000 points is too large"):
        sweep(ex, ["task_arithmetic"], "lam", [0.1] * 1000)


@pytest.mark.parametrize("args, message", [
    (["merge", "--pool", "POOL", "--method", "voodoo", "--out", "OUT"], "unknown method 'voodoo'"),
    (["merge", "--pool", "POOL", "--method", "ties", "--sparsity", "lots", "--out", "OUT"], "sparsity='lots' is not a number"),
    (["eval", "--pool", "POOL", "--method", "task_arithmetic", "--split", "dev"], "unknown split 'dev'"),
    (["landscape", "--pool", "POOL", "--grid", "999", "--out", "OUT.html"], "grid 999×999 is out of bounds"),
    (["merge", "--pool", "MISSING", "--method", "ties", "--out", "OUT"], "pool file not found"),
])
def test_cli_catalogue(tmp_path, args, message, capsys):
    from merger.cli import main

    pool = write_pool(tmp_path, n_experts=2, demo_data=True)
    out = tmp_path / "out"
    args = [a.replace("POOL", str(pool)).replace("MISSING", str(tmp_path / "nope.yaml")).replace("OUT", str(out))
            for a in args]
    assert main(args) == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.glob("out*"))


def test_app_refuses_a_bad_or_taken_port_in_one_line(tmp_path, capsys):
    import socket

    from merger.serve import main

    with pytest.raises(SystemExit) as exit_:
        main(["--port", "99999"])
    assert exit_.value.code == 2 and "argument --port: '99999' is not a TCP port (1-65535)" in capsys.readouterr().err
    pool = write_pool(tmp_path, n_experts=2, demo_data=True)
    with socket.socket() as taken:  # another program holds the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["--pool", str(pool), "--port", str(port), "--history", ""])
    out, err = capsys.readouterr()
    assert code == 2 and f"error: --host 127.0.0.1 --port {port}: cannot serve there (the port is taken)" in err
    assert "launch()" not in err  # this app's flags, not Gradio's API
    assert "one live forward" not in out  # said before the pool's load
    assert main(["--pool", str(pool), "--host", "no-such-host.invalid", "--history", ""]) == 2
    assert "no-such-host.invalid is not a host name or address here" in capsys.readouterr().err


# ---- a live server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    pool = write_pool(root, n_experts=3, scale=0.2, demo_data=True)
    port = browser.free_port()
    history = root / "history.sqlite"
    proc = browser.start_server(str(pool), port, str(history))
    yield {"url": f"http://127.0.0.1:{port}/", "pool": pool, "proc": proc, "history": history}
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(sys.platform == "win32", reason="terminate() is no SIGTERM on Windows")
def test_a_killed_app_stops_as_with_ctrl_c_and_takes_its_downloads_folder_with_it(tmp_path, monkeypatch):
    """SIGTERM (a service manager's stop, `kill`) ended the server at once: the folder of the files
    offered for download (exports, up to a merged model each) stayed in the temporary folder."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the server's temporary folder
    pool = write_pool(tmp_path / "pool", n_experts=2, scale=0.2, demo_data=True)
    proc = browser.start_server(str(pool), browser.free_port(), str(tmp_path / "history.sqlite"))
    try:
        assert len(list(temp.glob("merger-downloads-*"))) == 1  # the app's, made at start
        proc.terminate()
        assert proc.wait(timeout=60) == 0, browser.server_log(proc)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(temp.glob("merger-downloads-*")) == []
    assert "Traceback" not in browser.server_log(proc)


API_CASES = [
    (("voodoo", 0.3, None, None, None, None, "live"), "unknown method 'voodoo'"),
    (("task_arithmetic", 0.3, None, None, None, None, "dev"), "split 'dev': the endpoint evaluates live, val, test"),
    (("ties", 1.0, None, 1.5, None, None, "live"), "sparsity=1.5 is out of range"),
    (("task_arithmetic", "abc", None, None, None, None, "live"), "lam='abc' is not a number"),
    (("cart", 1.0, -0.2, None, None, None, "live"), "rank_ratio=-0.2 is out of range"),
    (("task_arithmetic", 0.3, None, None, None, [], "live"), "empty subset"),
    (("task_arithmetic", 0.3, None, None, None, ["ghost"], "live"), "unknown task(s) ghost"),
    (("adamerging_task", None, None, None, None, None, "live"), "learns from data"),
    (("dare_linear", 0.3, None, 0.5, 2.5, None, "live"), "seed=2.5 must be a whole number"),
]


@pytest.mark.parametrize("call, message", API_CASES, ids=[c[1][:30] for c in API_CASES])
def test_api_catalogue_and_the_server_stays_up(server, call, message):
    client = gradio_client.Client(server["url"], verbose=False)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        client.predict(*call, api_name="/evaluate")
    ok = client.predict("task_arithmetic", 0.3, None, None, None, None, "live", api_name="/evaluate")
    assert 0 <= ok["average_accuracy"] <= 1
    log = browser.server_log(server["proc"])
    assert "Traceback" not in log  # a person's bad input is no fault of the app
    assert re.search(r"memory: [0-9.]+ GB held with the pool open; budget 4 GB \(--memory-gb\)", log) or \
        sys.platform != "linux"  # the budget, said at start where the resident memory can be read


@pytest.mark.parametrize("token, shown", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf")])
def test_api_answers_a_non_json_float_with_the_fields_message(server, token, shown):
    """A float JSON cannot carry (sent raw, as Python's json writes it) gets the field's own message."""
    import json
    import urllib.request

    from merger.ui.endpoint import endpoint_data

    data = json.dumps({"data": endpoint_data("ties", lam="@LAM@", sparsity=0.8)})
    body = data.replace('"@LAM@"', token).encode()
    url = server["url"] + "gradio_api/call/evaluate"
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    event = json.loads(urllib.request.urlopen(req, timeout=30).read())["event_id"]
    stream = urllib.request.urlopen(f"{url}/{event}", timeout=60).read().decode()
    assert "event: error" in stream and f"lam={shown} is not a finite number" in stream
    ok = gradio_client.Client(server["url"], verbose=False).predict(
        "task_arithmetic", 0.3, None, None, None, None, "live", api_name="/evaluate")
    assert 0 <= ok["average_accuracy"] <= 1


def test_a_short_plain_http_list_is_refused_with_the_counts(server):
    """A `data` list shorter than the endpoint's arguments got `{"error": null}` (the reason only in
    the server's log)."""
    import json
    import urllib.request

    url = server["url"] + "gradio_api/call/evaluate"
    req = urllib.request.Request(url, data=json.dumps({"data": ["ties", 1.0, None, 0.8]}).encode(),
                                 headers={"Content-Type": "application/json"})
    event = json.loads(urllib.request.urlopen(req, timeout=30).read())["event_id"]
    stream = urllib.request.urlopen(f"{url}/{event}", timeout=60).read().decode()
    assert "event: error" in stream and "didn't receive enough input values (needed: " in stream and "got: 4" in stream


def test_plain_http_payload_of_the_benches_is_accepted(server):
    """What ``bench workshop``'s clients send over plain HTTP (every argument, in the signature's
    order) is answered with the merge it names: a new endpoint argument cannot break them unseen."""
    from devtools.bench_live import call_endpoint
    from merger.ui.endpoint import endpoint_data

    pool = merger.open_pool(server["pool"])
    (out,) = call_endpoint(server["url"], "evaluate", endpoint_data("task_arithmetic", lam=0.45,
                                                                     task_weights={pool.tasks[0]: 0.5}))
    want = merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=0.45, task_weights={pool.tasks[0]: 0.5}))
    assert out["accuracy"] == want.accuracy and out["spec"]["task_weights"] == {pool.tasks[0]: 0.5}
    with pytest.raises(ValueError, match="takes no lambda"):
        endpoint_data("task_arithmetic", **{"lambda": 0.3})


def test_sessions_never_see_each_others_results(server):
    pool = merger.open_pool(server["pool"])
    out = {}

    def session(i, lam):
        c = gradio_client.Client(server["url"], verbose=False)
        for _ in range(5):
            out[i] = c.predict("task_arithmetic", lam, None, None, None, None, "live", api_name="/evaluate")

    threads = [threading.Thread(target=session, args=(i, lam)) for i, lam in enumerate((0.1, 0.9))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, lam in enumerate((0.1, 0.9)):
        assert out[i]["spec"]["params"]["lam"] == lam
        ref = merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=lam))
        assert out[i]["accuracy"] == ref.accuracy


def test_history_survives_a_killed_server(server):
    client = gradio_client.Client(server["url"], verbose=False)
    for lam in (0.15, 0.25, 0.35):
        client.predict("task_arithmetic", lam, None, None, None, None, "live", api_name="/evaluate")
    server["proc"].send_signal(signal.SIGKILL)
    server["proc"].wait(timeout=30)
    db = sqlite3.connect(server["history"])
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    lams = {row[0] for row in db.execute("SELECT params FROM evaluations WHERE method = 'task_arithmetic'")}
    assert {'{"lam": 0.15}', '{"lam": 0.25}', '{"lam": 0.35}'} <= lams


