"""A person's own files (from a fresh-eyes run of the CLI and the API on pools they brought): no
output replaces a file the pool reads or a folder; a build never deletes what it did not make;
heads follow the tokenizer; bad --values, --device, --history, --task and weights are named."""
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import write_pool

import merger
from merger.cli import main as cli_main
from merger.errors import CheckpointError, MergerError, PoolError
from merger.io import checkpoints
from merger.io.export import export_merge



@pytest.fixture(scope="module")
def pool_path(tmp_path_factory):
    return write_pool(tmp_path_factory.mktemp("own"), n_experts=2, scale=0.2, demo_data=True)


def _hashes(folder: Path) -> dict:
    return {p: checkpoints.content_hash(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_export_never_replaces_a_file_the_pool_reads_nor_a_folder(pool_path, tmp_path):
    pool = merger.open_pool(pool_path)
    spec = pool.make_spec("task_arithmetic", {"lam": 0.3})
    before = _hashes(pool_path.parent)
    targets = [pool_path.with_suffix(".safetensors"), pool.base_path, pool.expert_info[pool.tasks[0]]["path"]]
    for out in targets:  # pool.safetensors writes its spec onto pool.yaml
        with pytest.raises(MergerError, match="is a file this job reads; writing there would change what it holds"):
            export_merge(pool, spec, out)
    (tmp_path / "m.safetensors").mkdir()
    (tmp_path / "m.yaml").write_text("precious")
    with pytest.raises(MergerError, match=r"--out: .*m.safetensors is a folder; name a file to write"):
        export_merge(pool, spec, tmp_path / "m.safetensors")
    (tmp_path / "n.yaml").mkdir()
    with pytest.raises(MergerError, match=r"its spec beside it\): .*n.yaml is a folder"):
        export_merge(pool, spec, tmp_path / "n.safetensors")
    assert _hashes(pool_path.parent) == before
    assert (tmp_path / "m.yaml").read_text() == "precious" and (tmp_path / "m.safetensors").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.yaml", "n.yaml"]  # nothing hidden left
    # an earlier export of the same name is replaced, and no backup is left beside it
    export_merge(pool, spec, tmp_path / "x.safetensors")
    export_merge(pool, pool.make_spec("task_arithmetic", {"lam": 0.5}), tmp_path / "x.safetensors")
    assert yaml.safe_load((tmp_path / "x.yaml").read_text())["params"] == {"lam": 0.5}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_demo_build_never_deletes_a_folder_it_did_not_build(tmp_path, monkeypatch):
    from merger.demo import build as build_module
    from merger.demo.build import DemoConfig, build

    monkeypatch.setattr(build_module.world, "generate", lambda *a, **k: pytest.fail("the build started training"))

    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "results.txt").write_text("weeks of work")
    with pytest.raises(MergerError, match=r"holds files \(results.txt, ...\) and no demo manifest"):
        build(mine, DemoConfig.small(), progress=False)  # refused before any training
    assert (mine / "results.txt").read_text() == "weeks of work"
    # a built pool (every file in its manifest) with a file added to it: the addition is named
    built = tmp_path / "built"
    (built / "experts").mkdir(parents=True)
    (built / "pool.yaml").write_text("name: demo\n")
    (built / "manifest.json").write_text(json.dumps({"files": {"pool.yaml": "0" * 64}}))
    (built / "experts" / "shape2.safetensors").write_text("an expert of my own")
    with pytest.raises(MergerError, match=r"holds a file the demo pool does not \(experts/shape2.safetensors\)"):
        build(built, DemoConfig.small(), progress=False)
    # the same folder without the addition (and with a file browser's clutter) may be rebuilt
    from merger.demo.build import _check_replaceable

    (built / "experts" / "shape2.safetensors").unlink()
    (built / ".DS_Store").write_text("x")
    _check_replaceable(built)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MergerError, match="is a file; name a folder"):
        build(tmp_path / "afile", DemoConfig.small(), progress=False)


def test_an_edited_copy_of_a_built_pool_says_how_to_use_it(pool_path, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(pool_path.parent, copy)
    files = {p.relative_to(copy).as_posix(): checkpoints.content_hash(p) for p in copy.rglob("*") if p.is_file()}
    (copy / "manifest.json").write_text(json.dumps({"files": files}))
    merger.open_pool(copy / "pool.yaml")  # as built: opens
    (copy / "pool.yaml").write_text((copy / "pool.yaml").read_text() + "\n# my edit\n")
    with pytest.raises(PoolError, match=r"sha256 differs .* or, if you changed it on purpose, delete .*manifest.json"):
        merger.open_pool(copy / "pool.yaml")


def test_heads_follow_the_tokenizer_and_a_wrong_one_is_named(pool_path, tmp_path, monkeypatch):
    """The demo-vocabulary text tower with open_clip's tokenizer: refused by name, whether or not
    the demo tokenizer's heads for the same classes are already cached (the key holds the tokenizer)."""
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "cache"))
    merger.PoolSession(merger.open_pool(pool_path)).base()  # fills the cache with the demo tokenizer's heads
    spec = yaml.safe_load(pool_path.read_text())
    root = pool_path.parent
    for name, value in (("absent", None), ("open_clip", "open_clip")):
        if value is None:
            spec.pop("tokenizer")
        else:
            spec["tokenizer"] = value
        other = root / f"pool_{name}.yaml"
        other.write_text(yaml.safe_dump(spec))
        with pytest.raises(PoolError, match=r"tokenizer open_clip: token id \d+ is outside the text tower's "
                                            r"vocabulary \(\d+ entries\): it does not fit this base's text tower"):
            merger.PoolSession(merger.open_pool(other)).base()
    spec["tokenizer"] = "dmeo"
    (root / "pool_typo.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match="tokenizer: 'dmeo' unknown; one of open_clip, demo"):
        merger.open_pool(root / "pool_typo.yaml")


def test_sweep_values_are_numbers_inside_a_methods_range(capsys):
    from merger.cli_jobs import _given_values

    for text, message in (("0.1,abc", "--values: 'abc' is not a number"), ("0.1,nan", "nan is not a finite number"),
                          ("9,5", r"9, 5 outside every swept method's lam range \(ties: \[-3, 3\]\)")):
        with pytest.raises(MergerError, match=message):
            _given_values(text, ["ties"], "lam", 3)
    assert _given_values("0.1,0.5", ["tsv_m", "cart"], "rank_ratio", 3) == [0.1, 0.5]
    assert "tsv_m: 0.5 skipped (its rank_ratio lies in [0, 0.333333] with 3 experts)" in capsys.readouterr().out


def test_a_sweep_shows_the_values_it_computed(pool_path, capsys):
    """A sweep point is a preview: λ 0.333 is computed at 0.35, and the curve, its JSON and the
    printout say 0.35 (they said 0.333 beside 0.35's numbers); two values on one step are one point."""
    assert cli_main(["sweep", "--pool", str(pool_path), "--methods", "ta", "--axis", "lam", "--values", "0.333,0.34,0.5",
                 "--split", "live", "--history", ""]) == 0
    out, err = capsys.readouterr()
    assert "computed on the sliders' steps: lam=0.333 at 0.35, lam=0.34 at 0.35" in out
    assert "task_arithmetic(lam=0.35)" in err and "lam=0.333" not in err  # the progress bar names what it computed
    assert re.search(r"task_arithmetic: 0\.35→[0-9.]+  0\.5→[0-9.]+\n", out) and "0.333→" not in out


def test_bad_device_history_and_landscape_task_are_named_before_any_work(pool_path, tmp_path, monkeypatch, capsys):
    from merger.io.history import History
    from merger.landscape.figure import write_landscape

    with pytest.raises(PoolError, match=r"device 'tpu': not a device \(cpu, cuda or cuda:N\)"):
        merger.open_pool(pool_path, device="tpu")
    (tmp_path / "notadb.sqlite").write_text("not a database")
    import sqlite3

    other = sqlite3.connect(tmp_path / "other.sqlite")  # another program's table of the same name
    other.execute("CREATE TABLE evaluations (id INTEGER PRIMARY KEY, score REAL)")
    other.commit()
    other.close()
    for path, message in ((tmp_path, "is a folder; name an SQLite file"),
                          (tmp_path / "notadb.sqlite", r"cannot be used as the history \(file is not a database\)"),
                          (tmp_path / "other.sqlite", r"its table 'evaluations' has the columns id, score, not merger's")):
        with pytest.raises(MergerError, match=f"--history {path}: {message}"):
            History(path)
    session = merger.PoolSession(merger.open_pool(pool_path))
    monkeypatch.setattr(session.landscape, "progressive", lambda *a, **k: pytest.fail("the grid was computed"))
    with pytest.raises(MergerError, match=r"--task foo: not a task of this pool"):
        write_landscape(session.landscape, tmp_path / "l.html", "pca", ["base", "experts"], 5, "loss", task="foo")
    with pytest.raises(MergerError, match="--out: .* is a folder"):
        (tmp_path / "d.html").mkdir()
        write_landscape(session.landscape, tmp_path / "d.html", "pca", ["base", "experts"], 5, "loss")
    # the app's and the commands' flags, in this process: each refused before anything changes in it
    from devtools.cli import main as devtools_main
    from merger.cli import main as merger_main
    from merger.serve import main as app_main

    def refused(main, argv):
        try:
            return main(argv), capsys.readouterr().err
        except SystemExit as exc:  # argparse's refusal
            return exc.code, capsys.readouterr().err

    code, err = refused(app_main, ["--pool", str(pool_path), "--device", "tpu", "--history", str(tmp_path)])
    assert code == 2 and f"error: --history {tmp_path}: is a folder" in err  # said before the pool's minutes
    code, err = refused(app_main, ["--auth", "nocolon"])
    assert code == 2 and "argument --auth: expected user:password" in err
    # a mistyped --roots folder would leave the files meant to be read refused, with no hint why
    code, err = refused(app_main, ["--pool", str(pool_path), "--history", "", "--roots",
                                   f"{tmp_path}, {tmp_path / 'nope'}"])
    assert code == 2 and f"error: --roots: {tmp_path / 'nope'}: not a folder" in err
    # counts are whole numbers ≥ 1, refused by argparse with the flag's name
    for main, argv, message in ((devtools_main, ["bench", "load", "--clients", "-1"],
                                 "argument --clients: '-1' is not a whole number ≥ 1"),
                                (merger_main, ["tune", "--weights", "ta", "--budget", "0"], "argument --budget: '0'"),
                                (devtools_main, ["bench", "workshop", "--jobs", "sweep,bogus"],
                                 "error: --jobs 'sweep,bogus': unknown bogus"),
                                (merger_main, ["tune", "--pool", str(pool_path), "--weights", "ta", "--budget", "3",
                                               "--seed", "-1", "--history", ""],
                                 "argument --seed: '-1' is not a whole number ≥ 0")):
        code, err = refused(main, argv)
        assert code == 2 and message in err, err


def test_evaluate_checks_weights_from_elsewhere_against_the_base(pool_path):
    pool = merger.open_pool(pool_path)
    merged = merger.merge(pool, "task_arithmetic", lam=0.3)
    key = next(k for k in merged if k.endswith("conv1.weight"))
    for change, message in ((torch.zeros(1), rf"mis-shaped keys: {key} \(1,\)"),
                            (merged[key] * float("nan"), f"key {key} holds .* non-finite values"),
                            (None, f"missing keys: {key}")):
        bad = {k: v for k, v in merged.items() if k != key or change is not None}
        if change is not None:
            bad[key] = change
        with pytest.raises(CheckpointError, match="evaluate: the weights: .*" + message):
            merger.evaluate(pool, bad)
    assert merger.evaluate(pool, merged).average_accuracy == pytest.approx(
        merger.evaluate(pool, {f"module.{k}": v for k, v in merged.items()}).average_accuracy)  # aligned as experts


def test_a_safetensors_file_named_pt_loads_and_a_refusal_has_no_terminal_codes(tmp_path):
    sd = {"visual.proj": torch.randn(4, 3)}
    checkpoints.save_safetensors(sd, tmp_path / "expert.pt")
    assert torch.equal(checkpoints.load_state_dict(tmp_path / "expert.pt")["visual.proj"], sd["visual.proj"])
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    with pytest.raises(CheckpointError, match="refused: the file holds pickled objects") as exc:
        checkpoints.load_state_dict(tmp_path / "module.pt")
    assert "\x1b" not in str(exc.value)


def test_replaying_a_spec_on_a_pool_opened_from_elsewhere(pool_path, tmp_path):
    import shutil

    out = tmp_path / "m.safetensors"
    assert cli_main(["merge", "--pool", str(pool_path), "--method", "task_arithmetic", "--lam", "0.4",
                     "--out", str(out)]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(pool_path.parent, moved)
    again = tmp_path / "again.safetensors"
    assert cli_main(["merge", "--spec", str(out.with_suffix(".yaml")), "--pool", str(moved / "pool.yaml"),
                     "--out", str(again)]) == 0
    assert yaml.safe_load(again.with_suffix(".yaml").read_text())["pool"] == str((moved / "pool.yaml").resolve())
    a, b = checkpoints.load_state_dict(out), checkpoints.load_state_dict(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_replay_names_a_renamed_expert_keeps_its_own_spec_and_reads_a_relative_pool_from_its_folder(
        pool_path, tmp_path, monkeypatch, capsys):
    import shutil

    pool = merger.open_pool(pool_path)
    first, second = pool.tasks
    out = tmp_path / "specs" / "m.safetensors"
    assert cli_main(["merge", "--pool", str(pool_path), "--method", "task_arithmetic", "--out", str(out)]) == 0
    spec = out.with_suffix(".yaml")
    # its own spec as --out's pair: refused, the spec kept (it was written over)
    before = spec.read_text()
    assert cli_main(["merge", "--spec", str(spec), "--lam", "0.5", "--out", str(out)]) == 2
    assert "m.yaml is a file this job reads" in capsys.readouterr().err and spec.read_text() == before
    # an expert renamed in a copy of the pool: named as missing, not as a changed file (it is byte-identical)
    renamed = tmp_path / "renamed"
    shutil.copytree(pool_path.parent, renamed)
    text = (renamed / "pool.yaml").read_text()
    (renamed / "pool.yaml").write_text(text.replace(f"  {second}:", "  other:"))
    assert cli_main(["merge", "--spec", str(spec), "--pool", str(renamed / "pool.yaml"),
                     "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"the spec merges expert '{second}', which this pool does not have (it has {first}, other)" in err
    # a hand-written relative pool is read from the spec's folder, wherever the command runs
    record = yaml.safe_load(before)
    record["pool"] = "../pool.yaml"
    shutil.copytree(pool_path.parent, tmp_path / "copy")
    (tmp_path / "copy" / "specs").mkdir()
    (tmp_path / "copy" / "specs" / "m.yaml").write_text(yaml.safe_dump(record))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["merge", "--spec", str(tmp_path / "copy" / "specs" / "m.yaml"),
                     "--out", str(tmp_path / "again.safetensors")]) == 0, capsys.readouterr().err
    a, b = checkpoints.load_state_dict(out), checkpoints.load_state_dict(tmp_path / "again.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# the child starts with SIGTERM blocked or not: a runner's thread that blocks it passes the mask on
# through exec, and such a build once ran to its end with the kill pending (exit 0, the pool built)
_STARTS_WITH_SIGTERM = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_{}, [signal.SIGTERM]); "
                        "os.execv(sys.executable, sys.argv[1:])")
POSIX_SIGNALS = pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signals and masks")


@POSIX_SIGNALS
@pytest.mark.parametrize("parent_mask", ["UNBLOCK", "BLOCK"])
def test_a_killed_build_leaves_no_half_built_folder(tmp_path, parent_mask):
    import time

    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-c", _STARTS_WITH_SIGTERM.format(parent_mask), sys.executable, "-m",
                             "merger", "demo", "build", "--small", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # sent once its training is under way: in the build's first instant, a kill that lands in numpy's lazy
    # import of numpy.random runs the handler, whose exception that import then loses (CPython and numpy's)
    seen, deadline = "", time.time() + 120
    while "epoch" not in seen and time.time() < deadline:
        seen += proc.stderr.read(1) or "(ended)"
        if seen.endswith("(ended)"):
            break
    assert "epoch" in seen and any(p.name.startswith(".demo.tmp-") for p in tmp_path.iterdir()), seen[-500:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "error: interrupted" in err, err[-500:]  # 128 + SIGTERM, as a shell counts
    assert list(tmp_path.iterdir()) == []


@POSIX_SIGNALS
def test_a_kill_whose_exception_is_lost_still_stops_the_build(tmp_path, monkeypatch, capsys):
    """A kill landing in code that loses the handler's exception (numpy's lazy import of numpy.random, as
    the build starts, is such code) stops the build at its next training step, the folder removed."""
    import threading

    from merger.demo import build as demo_build

    def generate_then_lose_a_kill(*args, **kwargs):
        images = generate(*args, **kwargs)
        try:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # the handler runs here
        except BaseException:  # and its exception is lost, as in C code that clears it
            pass
        return images

    def pretrain_counting_steps(*args, progress, **kwargs):
        def step(frac, msg):
            steps.append(frac)
            if len(steps) > 3:
                pytest.fail("the build trains on after the kill")
            progress(frac, msg)
        return pretrain(*args, progress=step, **kwargs)

    generate, pretrain, steps = demo_build.world.generate, demo_build.pretrain, []
    monkeypatch.setattr(demo_build.world, "generate", generate_then_lose_a_kill)
    monkeypatch.setattr(demo_build, "pretrain", pretrain_counting_steps)
    handler = signal.getsignal(signal.SIGTERM)
    assert cli_main(["demo", "build", "--small", "--out", str(tmp_path / "demo")]) == 143
    assert "error: interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [] and len(steps) == 1  # stopped at the first training step
    assert signal.getsignal(signal.SIGTERM) is handler


@POSIX_SIGNALS
def test_a_kill_waiting_as_a_command_starts_interrupts_it_in_one_line():
    """Blocked, sent, then exec: the kill waits in the new process until the command unblocks it."""
    sent_first = _STARTS_WITH_SIGTERM.format("BLOCK").replace("; os.execv", "; os.kill(os.getpid(), signal.SIGTERM); os.execv")
    done = subprocess.run([sys.executable, "-c", sent_first, sys.executable, "-m", "merger", "methods"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip().splitlines()[-1:]) == (143, ["error: interrupted"]), done.stderr[-500:]


@POSIX_SIGNALS
def test_a_command_run_in_process_leaves_the_signal_mask_and_handler_as_they_were(capsys):
    import threading

    handler = signal.getsignal(signal.SIGTERM)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        assert cli_main(["methods"]) == 0
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert signal.getsignal(signal.SIGTERM) is handler
        # waiting on this thread, blocked (sent to the process, another thread of pytest's would take it)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        assert cli_main(["methods"]) == 143 and "error: interrupted" in capsys.readouterr().err
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        assert signal.getsignal(signal.SIGTERM) is handler and signal.SIGTERM not in signal.sigpending()
    finally:
        if signal.SIGTERM in signal.sigpending():  # not taken: dropped, rather than end this process
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        signal.signal(signal.SIGTERM, handler)


def test_an_expert_at_0_percent_prints_no_nan(pool_path, capsys, monkeypatch):
    from merger.evaluation.session import PoolSession

    monkeypatch.setattr(PoolSession, "expert_task_accuracy", lambda self, expert, split: 0.0)
    assert cli_main(["eval", "--pool", str(pool_path), "--method", "task_arithmetic"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "n/a" in out and "scores 0 % on its own task on the test split" in out


def test_eval_prints_the_note_the_page_shows(pool_path, capsys):
    """Consensus TA with k above the experts merged is the base: the app says so, and so does eval."""
    assert cli_main(["eval", "--pool", str(pool_path), "--method", "consensus_ta", "--agree", "9"]) == 0
    assert "note: " in capsys.readouterr().out
    assert cli_main(["eval", "--pool", str(pool_path), "--method", "consensus_ta", "--agree", "9", "--json"]) == 0
    assert "the merge is the base" in json.loads(capsys.readouterr().out)["note"]


def test_short_messages_for_a_mistyped_architecture_broken_yaml_and_api_misuse(pool_path, tmp_path, monkeypatch,
                                                                              capsys):
    from merger.io import disk_cache

    spec = yaml.safe_load(pool_path.read_text())
    spec["architecture"] = "ViT-B-33"
    (tmp_path / "arch.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match=r"architecture 'ViT-B-33': not an open_clip model; did you mean ViT-B-32") as exc:
        merger.open_pool(tmp_path / "arch.yaml")
    assert len(str(exc.value)) < 300  # open_clip's own message lists every model it knows
    (tmp_path / "broken.yaml").write_text("name: x\nbase: [a\n")
    with pytest.raises(PoolError, match=r"broken.yaml: not valid YAML: line 3, column 1: expected ',' or ']'") as exc:
        merger.open_pool(tmp_path / "broken.yaml")
    assert "\n" not in str(exc.value)
    for value in ("abc", "-1", "inf"):
        monkeypatch.setenv("MERGER_CACHE_GB", value)
        assert disk_cache.cap_bytes() == int(disk_cache.DEFAULT_CAP_GB * 2**30)
        assert f"MERGER_CACHE_GB='{value}': not a size in GB" in capsys.readouterr().err
    pool = merger.open_pool(pool_path)
    paths = [str(pool.expert_info[t]["path"]) for t in pool.tasks]
    from_paths = merger.merge_state_dicts(str(pool.base_path), paths, "task_arithmetic", lam=0.3)
    merged = merger.merge(pool, "task_arithmetic", lam=0.3)
    assert all(torch.equal(merged[k], from_paths[k]) for k in merged)  # checkpoint paths are read as state dicts
    for call, message in ((lambda: merger.merge_state_dicts(str(pool.base_path), paths[0], "task_arithmetic"),
                           "experts: expected a list .* got one path"),
                          (lambda: merger.merge(pool, "task_arithmetic", task_weights=[1, 2]),
                           r"task_weights: expected \{name: weight\}"),
                          (lambda: merger.open_pool(None), "pool: expected a file path, got None"),
                          (lambda: merger.PoolSession(pool).preview("ta"), "preview: expected a Spec")):
        with pytest.raises(MergerError, match=message):
            call()


def test_an_output_inside_a_folder_the_pool_reads_is_refused_before_a_data_driven_run(pool_path, tmp_path,
                                                                                      monkeypatch, capsys):
    from merger import cli
    from merger.io.export import check_export_target

    demo = merger.open_pool("demo")
    epoch = demo.expert_info["shape"]["trajectory"] / "epoch_001.safetensors"
    with pytest.raises(MergerError, match=r"is inside .*trajectories/shape, a folder this job reads"):
        check_export_target(demo, epoch)
    monkeypatch.setattr(cli, "_run_data_driven", lambda *a: pytest.fail("the run started before --out was checked"))
    (tmp_path / "m.safetensors").mkdir()
    assert cli_main(["merge", "--pool", str(pool_path), "--method", "adamerging_task", "--out",
                     str(tmp_path / "m.safetensors")]) == 2
    assert "m.safetensors is a folder" in capsys.readouterr().err


def test_the_merged_keys_alone_are_evaluated_and_the_history_filter_takes_the_tables_experts(pool_path):
    from types import SimpleNamespace

    from merger.io.history import History
    from merger.ui.history_tab import HistoryTab

    pool = merger.open_pool(pool_path)
    merged = merger.merge(pool, "task_arithmetic", lam=0.3)
    only = {k: merged[k] for k in pool.task_vectors.keys}
    assert merger.evaluate(pool, only).average_accuracy == merger.evaluate(pool, merged).average_accuracy
    history = History(pool_path.parent / "h.sqlite")
    session = merger.PoolSession(pool)
    spec = session.spec("task_arithmetic", lam=0.3)
    history.record("p", spec, session.preview(spec))
    tab = HistoryTab(SimpleNamespace(history=history, pool_ref="p"))
    ties = session.spec("ties", lam=0.75, sparsity=0.8)
    history.record("p", ties, session.preview(ties))
    rows = tab.history_rows("", "")
    shown = rows[0][4]
    assert shown == ", ".join(pool.tasks) and len(tab.history_rows("", shown)) == 2  # pasted back from the table
    for pasted in (rows[0][3], f" {rows[0][3]} ", "TIES-merging", "ties"):  # a params cell, a shown method name
        assert [r[2] for r in tab.history_rows("", pasted)] == ["ties"], pasted


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`python -m merger eval … | head -1`: the pipe closes before the command prints; it once
    said "error: eval failed: BrokenPipeError" and exited 1."""
    import os

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    proc = subprocess.run([sys.executable, "-m", "merger", "methods"], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=120)
    os.close(write)
    assert proc.returncode == 141 and proc.stderr == ""  # 128 + SIGPIPE, as a shell counts it


def test_an_output_in_a_folder_that_does_not_exist_says_it_creates_it(pool_path, tmp_path, capsys):
    """A typo in --out made a folder tree unseen (`/nonexistent/dir/x.safetensors`)."""
    out = tmp_path / "new" / "dir" / "x.safetensors"
    assert cli_main(["merge", "--pool", str(pool_path), "--method", "ta", "--out", str(out)]) == 0
    assert f"note: --out {out}: the folder {out.parent} does not exist; it is created" in capsys.readouterr().err
    assert out.is_file()
    assert cli_main(["merge", "--pool", str(pool_path), "--method", "ta", "--out", str(out)]) == 0
    assert "note:" not in capsys.readouterr().err  # it exists now


def test_a_broken_pipe_other_than_the_output_is_a_failed_operation(capsys, monkeypatch):
    """Only the output's reader going away is quiet (141); a socket or a worker's pipe breaking is a
    failed operation, said in one line."""
    from merger import cli

    def broken(_):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_methods", broken)
    assert cli.main(["methods"]) == 1 and "error: methods failed: BrokenPipeError" in capsys.readouterr().err


@POSIX_SIGNALS
def test_a_kill_whose_exception_is_lost_stops_a_sweep_at_its_next_point(pool_path, monkeypatch, capsys):
    """Every long command reports progress through the same bar: a sweep stops after the point whose
    evaluation lost the kill's exception, its other points never computed."""
    import threading

    from merger.evaluation.session import PoolSession

    preview, points = PoolSession.preview, []

    def preview_losing_a_kill(self, *args, **kwargs):
        points.append(args)
        if len(points) == 1:
            try:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # the handler runs here
            except BaseException:  # and its exception is lost, as in C code that clears it
                pass
        return preview(self, *args, **kwargs)

    monkeypatch.setattr(PoolSession, "preview", preview_losing_a_kill)
    handler = signal.getsignal(signal.SIGTERM)
    assert cli_main(["sweep", "--pool", str(pool_path), "--methods", "ta", "--axis", "lam",
                     "--values", "0.1,0.2,0.3,0.4,0.5,0.6"]) == 143
    assert "error: interrupted" in capsys.readouterr().err
    assert len(points) == 1 and signal.getsignal(signal.SIGTERM) is handler
