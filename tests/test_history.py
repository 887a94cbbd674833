"""The history records each row's forwards' precision: a resumed job reuses rows of its own precision
only, and a history written before the precision was recorded opens with every row kept."""
import json
import sqlite3
import subprocess

import pytest
from helpers import write_pool

from merger.errors import MergerError
from merger.evaluation.result import Result
from merger.io import history as history_module
from merger.io.history import History

# The table as merger wrote it before rows recorded their forwards' precision
OLD_SCHEMA = """CREATE TABLE evaluations (id INTEGER PRIMARY KEY AUTOINCREMENT, time TEXT NOT NULL, pool TEXT NOT NULL,
    method TEXT NOT NULL, params TEXT NOT NULL, experts TEXT NOT NULL, split TEXT NOT NULL, average_accuracy REAL,
    normalized_accuracy REAL, average_loss REAL, accuracy TEXT NOT NULL, loss TEXT NOT NULL,
    UNIQUE (pool, method, params, experts, split))"""
OLD_ROWS = [(3, "2026-11-01 10:00:00", "p", "task_arithmetic", '{"lam": 0.3}', "a,b", "live", 0.5, 0.6, 1.25,
             '{"a": 0.4, "b": 0.6}', '{"a": 1.0, "b": 1.5}'),
            (7, "2026-11-02 11:00:00", "p", "ties", '{"lam": 1.0, "sparsity": 0.8}', "a,b", "val", 0.25, None, 2.0,
             '{"a": 0.2, "b": 0.3}', '{"a": 2.0, "b": 2.0}')]


def cli(*argv, capsys):
    from merger.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def old_history(path, schema=OLD_SCHEMA, rows=OLD_ROWS):
    db = sqlite3.connect(path)
    db.execute(schema)
    db.executemany(f"INSERT INTO evaluations VALUES ({', '.join('?' * 12)})", rows)
    if "AUTOINCREMENT" in schema:
        db.execute("UPDATE sqlite_sequence SET seq = 10 WHERE name = 'evaluations'")  # ids 8 to 10 spent since
    db.commit()
    db.close()


def test_an_older_history_keeps_every_row_with_its_precision_unknown(tmp_path, monkeypatch):
    path = tmp_path / "old.sqlite"
    old_history(path)
    history = History(path)
    rows = sorted(history.rows(), key=lambda r: r["id"])
    assert [tuple(r[c] for c in history_module.COLUMNS[:-1]) for r in rows] == OLD_ROWS  # ids and times too
    assert [r["forward"] for r in rows] == [None, None]

    class Spec:  # what record and find read of a spec
        method, kwargs, experts = "task_arithmetic", {"lam": 0.3}, ("a", "b")

        def as_dict(self):
            return {"method": self.method, **self.kwargs}

    fp32 = Result("live", {"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 1.0}, forward="fp32")
    assert history.find("p", Spec(), "live", "fp32") is None  # a row of unknown precision is no job's answer
    history.record("p", Spec(), fp32)
    history.record("p", Spec(), Result("live", {"a": 0.75, "b": 0.5}, {"a": 1.0, "b": 1.0}, forward="bf16"))
    history.record("p", Spec(), fp32)  # again: its time is refreshed, no row added
    found = {f: history.find("p", Spec(), "live", f) for f in ("fp32", "bf16")}
    assert found["fp32"]["average_accuracy"] == 0.5 and found["bf16"]["average_accuracy"] == 0.625
    assert found["fp32"]["id"] == 11 and len(history.rows()) == 4  # no id given out before is given again
    assert [r["forward"] for r in history.rows(method="task_arithmetic")].count(None) == 1
    with pytest.raises(ValueError, match="a result's forwards ran in 'fp16', not one of fp32, bf16"):
        history.record("p", Spec(), Result("live", {"a": 0.5}, {"a": 1.0}, forward="fp16"))
    csv_text = history.export_csv(tmp_path / "h.csv").read_text()
    assert csv_text.splitlines()[0].endswith(",loss,forward") and ",bf16" in csv_text
    history.close()
    assert len(History(path).rows()) == 4  # opened again: nothing copied twice

    # an older history that cannot be written: refused at start, the file as it was
    readonly = tmp_path / "readonly.sqlite"
    old_history(readonly)
    before = readonly.read_bytes()
    connect = sqlite3.connect
    monkeypatch.setattr(history_module.sqlite3, "connect", lambda p, **kw: connect(f"file:{p}?mode=ro", uri=True, **kw))
    with pytest.raises(MergerError, match=f"--history {readonly}: cannot be used as the history "
                                          r"\(attempt to write a readonly database\)"):
        History(readonly)
    assert readonly.read_bytes() == before
    monkeypatch.undo()

    # a copy that fails half way (a row today's table refuses) leaves the file as it was: all or nothing
    loose = tmp_path / "loose.sqlite"
    old_history(loose, schema=OLD_SCHEMA.replace(" NOT NULL", "").replace(" AUTOINCREMENT", ""),
                rows=[OLD_ROWS[0], (8, None, *OLD_ROWS[1][2:])])  # a row without its time
    with pytest.raises(MergerError, match=f"--history {loose}: cannot be used as the history "
                                          r"\(NOT NULL constraint failed: evaluations_with_precision.time\)"):
        History(loose)
    db = sqlite3.connect(loose)
    assert len(db.execute("SELECT * FROM evaluations").fetchall()) == 2
    assert [r[1] for r in db.execute("PRAGMA table_info(evaluations)")] == list(history_module.COLUMNS[:-1])
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'evaluations_with_precision'").fetchone() is None


def test_a_resumed_sweep_reuses_the_rows_of_its_own_precision_only(tmp_path, capsys):
    pool = write_pool(tmp_path / "pool", n_experts=2, demo_data=True)
    path = tmp_path / "h.sqlite"
    sweep = ("sweep", "--pool", str(pool), "--methods", "task_arithmetic", "--values", "0.1,0.2",
             "--history", str(path))
    first = cli(*sweep, capsys=capsys)
    assert first.returncode == 0, first.stderr
    bf16 = cli(*sweep, "--resume", "--forward", "bf16", capsys=capsys)
    assert bf16.returncode == 0, bf16.stderr
    assert "(2 evaluated, 0 from the history)" in bf16.stdout
    assert "; forwards in bf16 autocast" in bf16.stdout and "bf16" not in first.stdout
    again = cli(*sweep, "--resume", "--forward", "bf16", "--out", str(tmp_path / "again.json"), capsys=capsys)
    assert "(0 evaluated, 2 from the history)" in again.stdout
    assert again.stdout.splitlines()[-2] == bf16.stdout.splitlines()[-2]  # the curve, from the bf16 rows
    assert json.loads((tmp_path / "again.json").read_text())["task_arithmetic"]["forward"] == ["bf16", "bf16"]
    rows = History(path).rows()
    assert sorted(r["forward"] for r in rows) == ["bf16", "bf16", "fp32", "fp32"]
    by = {(json.loads(r["params"])["lam"], r["forward"]): json.loads(r["loss"]) for r in rows}
    assert by[(0.1, "fp32")] != by[(0.1, "bf16")]  # two evaluations, each in its own precision


def test_the_best_known_setting_is_one_of_the_apps_own_precision(tmp_path):
    import dataclasses

    from helpers import ui_controller

    from merger import methods

    ctl = ui_controller(tmp_path)
    session, ref = ctl.session, ctl.pool_ref
    fp32 = session.preview(session.spec("task_arithmetic", lam=0.2), "val")
    assert fp32.forward == "fp32"
    ctl.history.record(ref, session.spec("task_arithmetic", lam=0.2), fp32)
    better = dataclasses.replace(fp32, accuracy={t: 1.0 for t in fp32.accuracy}, forward="bf16")
    ctl.history.record(ref, session.spec("task_arithmetic", lam=0.9), better)  # a bf16 job's row: not this app's
    said = ctl.best_known(methods.get("task_arithmetic"), list(ctl.pool.tasks))
    assert f"`lam=0.2`, {100 * fp32.average_accuracy:.1f} % (of 1 val evaluation in the History tab)" in said


def test_two_processes_opening_an_older_history_copy_it_once(tmp_path):
    """The app and a sweep started together on an older history: the second to take the lock finds the
    table copied, and a row the first recorded in between keeps its precision."""
    path = tmp_path / "old.sqlite"
    old_history(path)
    late = History.__new__(History)  # the second process: it read the old columns before the first copied
    late._db = sqlite3.connect(str(path), check_same_thread=False, timeout=10)
    first = History(path)

    class Spec:
        method, kwargs, experts = "task_arithmetic", {"lam": 0.5}, ("a", "b")

        def as_dict(self):
            return {"method": self.method, **self.kwargs}

    first.record("p", Spec(), Result("live", {"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 1.0}, forward="bf16"))
    late._add_precision()
    assert sorted((r["id"], r["forward"]) for r in first.rows()) == [(3, None), (7, None), (11, "bf16")]


def test_a_results_parts_and_subsets_keep_its_precision():
    import torch

    from merger.evaluation.result import joined, result_subset

    def part(n):
        return Result("live", {"a": 0.5}, {"a": 1.0}, counts={"a": n}, forward="bf16",
                      per_image={"a": (torch.ones(n, dtype=torch.bool), torch.ones(n))})

    assert joined(part(2), part(3)).forward == "bf16"
    assert result_subset(part(4), {"a": torch.tensor([0, 2])}).forward == "bf16"


def test_a_job_on_ray_workers_builds_no_model_here(tmp_path, monkeypatch):
    """Its precision comes from the flags: the workers evaluate, and this process only records."""
    from types import SimpleNamespace

    import merger
    from merger import cli_jobs, cluster
    from merger.evaluation import session as session_module

    session = merger.PoolSession(merger.open_pool(write_pool(tmp_path / "pool", n_experts=2, demo_data=True)))
    started = {}
    monkeypatch.setattr(session_module, "Evaluator", lambda *a, **k: pytest.fail("a model was built here"))
    monkeypatch.setattr(cluster, "connect", lambda address: None)
    monkeypatch.setattr(cluster, "Cluster", lambda *a, autocast, **k: started.setdefault("autocast", autocast))
    args = SimpleNamespace(ray="local", workers=1, forward="bf16", device="cpu")
    cli_jobs._cluster(args, session)
    assert started["autocast"] == "everywhere" and cli_jobs.job_precision(args) == "bf16"
    assert cli_jobs.job_precision(SimpleNamespace(forward="auto", device="cpu")) == "fp32"


@pytest.mark.parametrize("forward", ["fp32", "bf16"])
def test_a_sweeps_and_a_landscapes_files_say_their_forwards_precision(tmp_path, capsys, forward):
    pool = write_pool(tmp_path / "pool", n_experts=2, demo_data=True)
    done = cli("sweep", "--pool", str(pool), "--methods", "task_arithmetic,ties", "--values", "0.3", "--forward",
               forward, "--out", str(tmp_path / "sweep.json"), capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert {m: c["forward"] for m, c in json.loads((tmp_path / "sweep.json").read_text()).items()} == {
        "task_arithmetic": [forward], "ties": [forward]}
    done = cli("landscape", "--pool", str(pool), "--grid", "3", "--forward", forward, "--out",
               str(tmp_path / "ls.html"), capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "ls.json").read_text())["forward"] == forward
