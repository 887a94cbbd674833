"""The registry drives the CLI; merge → spec → replay gives identical tensors."""
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import merger
from merger.cli import build_parser
from merger.io.checkpoints import save_safetensors
from merger.methods import PARAM_NAMES

EXPECTED = ["weight_averaging", "task_arithmetic", "ties", "dare_linear", "dare_ties", "cart", "tsv_m", "iso_c"]


def test_registry_is_complete():
    assert merger.methods.names()[: len(EXPECTED)] == EXPECTED
    for m in merger.methods.all_methods():
        # SLERP's source (Shoemake 1985) predates arXiv
        assert m.display_name and m.description and m.paper.title and (m.paper.arxiv or m.name == "slerp")
        for p in m.params:
            assert p.name in PARAM_NAMES
            assert p.min < p.max and p.step > 0
            default = p.default if p.default is not None else m.defaults_for(4)[p.name]
            p.check(default, m.name)  # defaults are in range
        assert callable(m.prepare) and callable(m.apply)
        assert (m.data_driven) == (m.run is not None)
    data = [m.name for m in merger.methods.all_methods() if m.data_driven]
    assert data == ["adamerging_task", "adamerging_layer", "adamerging_cart", "fw_hard", "fw_soft", "fisher", "regmean"]


def test_cli_flags_come_from_the_registry():
    flags = set(vars(build_parser().parse_args(["merge", "--out", "m.safetensors"])))  # every flag's dest
    used = {p.name for m in merger.methods.all_methods() for p in m.params}
    assert used <= flags


def run_cli(*args):
    """``python -m merger ARGS`` in this process (what its ``main`` returns and prints; argparse's exit
    becomes the return code): a subprocess per call spent 5 s importing torch and open_clip."""
    import contextlib
    import io
    import traceback
    from types import SimpleNamespace

    from merger.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except Exception:  # --debug lets it through: Python then prints its traceback and exits 1
            traceback.print_exc()
            code = 1
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_methods_command_lists_every_method():
    out = run_cli("methods")
    assert out.returncode == 0
    for name in EXPECTED:
        assert name in out.stdout
    assert "--rank-ratio" in out.stdout and "(0, 1]" in out.stdout


def test_a_bad_flag_is_one_error_line():
    """As the README says: one `error:` line and status 2 (argparse printed its usage block first)."""
    for argv in ([sys.executable, "-m", "merger", "eval", "--method", "ta", "--bogus"],
                 [sys.executable, "app.py", "--port", "abc"]):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "error: " in out.stderr, out.stderr
        assert "--help lists the flags" in out.stderr


@pytest.mark.parametrize("method, flags", [("ties", ["--lam", "0.9", "--sparsity", "0.7"]),
                                           ("cart", ["--lam", "1.5", "--rank-ratio", "0.25"]),
                                           ("dare_ties", ["--seed", "7", "--experts", "task0,task2"]),
                                           ("ties", ["--task-weights", "task0=1.4,task1=0.5", "--block-weights",
                                                     "block0=0"])])
def test_merge_spec_replay_round_trip(tiny_pool, tmp_path, method, flags):
    out = tmp_path / "merged.safetensors"
    res = run_cli("merge", "--pool", str(tiny_pool), "--method", method, *flags, "--out", str(out))
    assert res.returncode == 0, res.stderr
    spec = yaml.safe_load((tmp_path / "merged.yaml").read_text())
    assert spec["method"] == method and spec["merger_version"] == merger.__version__
    assert len(spec["base"]["sha256"]) == 64
    assert set(spec["expert_files"]) == set(spec["experts"])
    again = tmp_path / "again.safetensors"
    res = run_cli("merge", "--spec", str(tmp_path / "merged.yaml"), "--out", str(again))
    assert res.returncode == 0, res.stderr
    a, b = load_file(out), load_file(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the written weights are what the API returns
    pool = merger.open_pool(tiny_pool)
    api = merger.merge(pool, method, experts=spec["experts"], task_weights=spec.get("task_weights"),
                       block_weights=spec.get("block_weights"), **spec["params"])
    assert all(torch.equal(api[k], a[k]) for k in a)
    if "--task-weights" in flags:
        assert spec["task_weights"] == {"task0": 1.4, "task1": 0.5} and spec["block_weights"] == {"block0": 0.0}
        plain = merger.merge(pool, method, experts=spec["experts"], **spec["params"])
        assert not all(torch.equal(plain[k], a[k]) for k in a)


def test_replay_refuses_a_changed_expert(tiny_pool, tmp_path):
    out = tmp_path / "m.safetensors"
    assert run_cli("merge", "--pool", str(tiny_pool), "--method", "task_arithmetic", "--out", str(out)).returncode == 0
    expert = tiny_pool.parent / "experts" / "task1.safetensors"
    sd = load_file(expert)
    sd["visual.proj"] = sd["visual.proj"] * 2
    save_safetensors(sd, expert)
    res = run_cli("merge", "--spec", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "x.safetensors"))
    assert res.returncode == 2 and "expert 'task1' file changed" in res.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_replay_names_the_spec_file_a_bad_value_came_from(tiny_pool, tmp_path):
    out = tmp_path / "m.safetensors"
    assert run_cli("merge", "--pool", str(tiny_pool), "--method", "ties", "--out", str(out)).returncode == 0
    spec = tmp_path / "m.yaml"
    spec.write_text(spec.read_text().replace("lam: 1.0", "lam: abc"))
    res = run_cli("merge", "--spec", str(spec), "--out", str(tmp_path / "x.safetensors"))
    assert res.returncode == 2 and f"error: {spec}: ties: parameter lam='abc' is not a number" in res.stderr
    res = run_cli("merge", "--spec", str(spec), "--sparsity", "2", "--lam", "1", "--out", str(tmp_path / "x.safetensors"))
    assert res.returncode == 2 and f"{spec} with the flags given: ties: parameter sparsity=2 is out of range" in res.stderr  # a number, as the API says it
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("flags, message", [
    (["--method", "cart", "--rank-ratio", "2"], "rank_ratio=2 is out of range"),
    (["--method", "ties", "--sparsity", "abc"], "sparsity='abc' is not a number"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--method", "ties", "--experts", "task9"], "unknown task(s) task9"),
])
def test_failed_merge_writes_nothing(tiny_pool, tmp_path, flags, message):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = run_cli("merge", "--pool", str(tiny_pool), *flags, "--out", str(out_dir / "bad.safetensors"))
    assert res.returncode == 2
    assert message in res.stderr
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("fail_at", ["yaml write", "yaml rename"])
def test_an_export_that_fails_halfway_leaves_the_old_pair(tiny_pool, tmp_path, monkeypatch, fail_at):
    """The weights and the spec are committed together: a failure on the spec's side leaves the
    earlier pair as it was (not new weights beside an old spec), and no temporary file."""
    import os

    from merger.io import checkpoints, export

    pool = merger.open_pool(tiny_pool)
    out = tmp_path / "exports" / "m.safetensors"
    export.export_merge(pool, pool.make_spec("task_arithmetic", {"lam": 0.3}), out)
    old_weights, old_spec = out.read_bytes(), out.with_suffix(".yaml").read_text()
    if fail_at == "yaml write":
        def broken(path, text):
            raise OSError("disk full")
        monkeypatch.setattr(checkpoints, "write_text_atomic", broken)
    else:
        real, failed = os.replace, []

        def broken(src, dst):  # the new spec's rename onto m.yaml fails, once
            if str(dst).endswith("m.yaml") and not failed:
                failed.append(dst)
                raise OSError("rename refused")
            return real(src, dst)
        monkeypatch.setattr(export.os, "replace", broken)
    with pytest.raises(OSError):
        export.export_merge(pool, pool.make_spec("task_arithmetic", {"lam": 0.9}), out)
    monkeypatch.undo()
    assert out.read_bytes() == old_weights and out.with_suffix(".yaml").read_text() == old_spec
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.safetensors", "m.yaml"]


def test_an_export_killed_between_its_renames_is_settled_by_the_next_export_or_replay(tiny_pool, tmp_path):
    """kill -9 between the two renames (os._exit in the same place): the weights are always whole; the
    spec beside them is made theirs again by the next replay or export there, and the temporary files
    the killed export left are deleted."""
    from merger.io import export

    pool = merger.open_pool(tiny_pool)
    out = tmp_path / "exports" / "m.safetensors"
    export.export_merge(pool, pool.make_spec("task_arithmetic", {"lam": 0.3}), out)
    n = 3  # the os.replace calls before the kill: the two temporary files', then the weights'
    code = (f"import os, merger; from merger.io import export\nreal, calls = os.replace, []\n"
            f"def replace(src, dst):\n    calls.append(dst)\n    if len(calls) > {n}: os._exit(9)\n    real(src, dst)\n"
            f"export.os.replace = replace\npool = merger.open_pool({str(tiny_pool)!r})\n"
            f"export.export_merge(pool, pool.make_spec('task_arithmetic', {{'lam': 0.9}}), {str(out)!r})\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 9
    assert len([p for p in out.parent.iterdir() if p.name.endswith(".partial")]) >= 1  # what the kill left
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as fh:
        lam_in_weights = yaml.safe_load(fh.metadata()["merger_spec"])["params"]["lam"]
    assert lam_in_weights == 0.9 and yaml.safe_load(out.with_suffix(".yaml").read_text())["params"]["lam"] == 0.3
    res = run_cli("merge", "--spec", str(out.with_suffix(".yaml")), "--out", str(out.parent / "again.safetensors"))
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(out.with_suffix(".yaml").read_text())["params"]["lam"] == lam_in_weights
    export.export_merge(pool, pool.make_spec("task_arithmetic", {"lam": 0.5}), out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["README.md", "again.safetensors", "again.yaml",  # + card
                                                            "m.safetensors", "m.yaml"]


def test_eval_forwards_in_the_precision_asked_for(tmp_path):
    """--forward: fp32 on the CPU unless bf16 autocast is asked for, which the output then says; a bad
    value is refused naming the flag."""
    import json

    from helpers import write_pool

    pool = write_pool(tmp_path, n_experts=3, scale=0.2, demo_data=True)
    argv = ("eval", "--pool", str(pool), "--method", "task_arithmetic", "--lam", "0.3", "--split", "live")
    fp32, default, bf16 = (run_cli(*argv, "--json", *more) for more in (("--forward", "fp32"), (), ("--forward", "bf16")))
    a, b, c = (json.loads(r.stdout) for r in (fp32, default, bf16))
    assert a["loss"] == b["loss"] and a["forward"] == b["forward"] == "fp32"
    assert c["forward"] == "bf16" and c["loss"] != a["loss"]  # bf16's rounding
    assert "; live split; forwards in bf16 autocast" in run_cli(*argv, "--forward", "bf16").stdout
    assert "; live split; forwards in fp32\n" in run_cli(*argv).stdout  # the default, said too
    bad = run_cli(*argv, "--forward", "fp16")
    assert bad.returncode == 2 and "--forward" in bad.stderr and "'fp16'" in bad.stderr


def test_cli_errors_are_one_line_with_exit_2_or_1(tiny_pool, tmp_path):
    bad = run_cli("merge", "--pool", str(tiny_pool), "--method", "ties", "--out", str(tiny_pool) + "/x.safetensors")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert "is a file, not a folder" in bad.stderr
    debug = run_cli("eval", "--pool", str(tiny_pool), "--method", "voodoo", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.parametrize("method, params, weighted", [("task_arithmetic", {"lam": 0.3}, True), ("ties", {}, False),
                                                      ("cart", {"rank_ratio": 0.3}, False)])
def test_the_streamed_export_equals_the_in_memory_merge_bit_for_bit(tiny_pool, tmp_path, method, params, weighted):
    """The export writes θ0 + Δ one tensor at a time; reading it back gives the in-memory merge
    (``merge_spec``) exactly: every name, dtype, shape and bit, and the spec in its metadata."""
    from safetensors import safe_open

    from merger.api import merge_spec
    from merger.io import export

    pool = merger.open_pool(tiny_pool)
    weights = {"task_weights": {"task0": 0.5}, "block_weights": {pool.blocks[1]: 1.5}} if weighted else {}
    spec = pool.make_spec(method, params, **weights)
    out, spec_yaml = export.export_merge(pool, spec, tmp_path / "m.safetensors")
    ref = merge_spec(pool, spec)
    with safe_open(str(out), framework="pt") as fh:
        assert sorted(fh.keys()) == sorted(ref)
        assert fh.metadata()["merger_spec"] == spec_yaml.read_text()
        for k, v in ref.items():
            t = fh.get_tensor(k)
            assert t.dtype == v.dtype and t.shape == v.shape, k
            assert torch.equal(t.reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k
    assert any(not torch.equal(ref[k], pool.base[k]) for k in pool.task_vectors.keys)  # a merge, not the base


def test_the_streamed_writer_stores_every_dtype_safetensors_has_and_names_one_it_has_not(tmp_path):
    from safetensors.torch import load_file

    from merger.errors import CheckpointError
    from merger.io.checkpoints import save_safetensors_streamed

    tensors = {"f8": torch.randn(3, 4).to(torch.float8_e4m3fn), "bf": torch.randn(5).bfloat16(),
               "i": torch.arange(6).reshape(2, 3), "b": torch.tensor([True, False])}
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    out = save_safetensors_streamed(layout, tensors.__getitem__, tmp_path / "m.safetensors")
    back = load_file(out)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in tensors.items())
    with pytest.raises(CheckpointError, match="c is torch.complex64"):
        save_safetensors_streamed({"c": (torch.complex64, (2,))}, lambda k: torch.zeros(2, dtype=torch.complex64),
                                  tmp_path / "c.safetensors")
    assert not (tmp_path / "c.safetensors").exists()
