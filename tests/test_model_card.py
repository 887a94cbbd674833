"""The model card beside exported weights: Hugging Face front matter, the merge and its sources, and a
per-task table equal to `merger eval` on the split it names; a README.md that is not merger's is kept."""
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import write_pool



@pytest.fixture
def tiny_pool(tmp_path):
    return write_pool(tmp_path / "pool", n_experts=2, demo_data=True)


def merger_cli(*argv, cwd, capsys):
    """``merger ARGV`` in this process (the suite's time: no interpreter per command)."""
    from merger.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def test_the_card_holds_the_merge_its_sources_and_the_eval_table(tiny_pool, tmp_path, capsys):
    out = tmp_path / "merged" / "m.safetensors"
    res = merger_cli("merge", "--pool", str(tiny_pool), "--method", "ties", "--lam", "0.8", "--sparsity", "0.7",
                     "--out", str(out), "--card-split", "test", cwd=tmp_path, capsys=capsys)
    assert res.returncode == 0, res.stderr
    card = (out.parent / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: open_clip" in card and "- ties" in card
    front = yaml.safe_load(card.split("---")[1])
    assert front["tags"][:2] == ["merger", "model-merging"]
    record = yaml.safe_load(out.with_suffix(".yaml").read_text())
    assert f"| base | `base.safetensors` | {record['base']['sha256']} |" in card
    assert "## Accuracy (test split)" in card and "merger merge --spec m.yaml --out m.safetensors" in card
    ev = merger_cli("eval", "--pool", str(tiny_pool), "--method", "ties", "--lam", "0.8", "--sparsity", "0.7",
                    "--split", "test", "--json", cwd=tmp_path, capsys=capsys)
    numbers = json.loads(ev.stdout)
    for task, acc in numbers["accuracy"].items():
        assert f"| {task} | {100 * acc:.1f} |" in card
    assert f"| average | {100 * numbers['average_accuracy']:.1f} |" in card
    assert "the forwards in fp32, the merge in fp32." in card
    bf16 = merger_cli("merge", "--pool", str(tiny_pool), "--method", "ties", "--out", str(tmp_path / "bf16" / "m.safetensors"),
                      "--card-split", "test", "--forward", "bf16", cwd=tmp_path, capsys=capsys)
    assert bf16.returncode == 0, bf16.stderr
    assert "the forwards in bf16 autocast (bf16 products, fp32 sums), the merge in fp32." in (
        tmp_path / "bf16" / "README.md").read_text()


def test_a_readme_merger_did_not_write_is_kept(tiny_pool, tmp_path, capsys):
    (tmp_path / "README.md").write_text("my notes\n")
    out = tmp_path / "m.safetensors"
    res = merger_cli("merge", "--pool", str(tiny_pool), "--method", "task_arithmetic", "--out", str(out),
                     "--card-split", "live", cwd=tmp_path, capsys=capsys)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "README.md").read_text() == "my notes\n"
    assert "## Accuracy (live split)" in (tmp_path / "m.README.md").read_text()
    again = merger_cli("merge", "--pool", str(tiny_pool), "--method", "task_arithmetic", "--out",
                       str(tmp_path / "own" / "m.safetensors"), "--card-split", "none", cwd=tmp_path, capsys=capsys)
    assert again.returncode == 0 and not (tmp_path / "own" / "README.md").exists()


def test_a_pool_without_task_data_merges_with_a_card_that_says_so(tmp_path, capsys):
    pool = write_pool(tmp_path / "nodata", n_experts=2)  # experts, no task data
    res = merger_cli("merge", "--pool", str(pool), "--method", "task_arithmetic", "--out", str(tmp_path / "m.safetensors"),
                     cwd=tmp_path, capsys=capsys)
    assert res.returncode == 0, res.stderr
    card = (tmp_path / "README.md").read_text()
    assert "Not measured: " in card and "no data" in card and "## Reproduce" in card


def test_a_second_merge_in_the_folder_keeps_the_first_ones_card(tiny_pool, tmp_path, capsys):
    for name, lam in (("a", "0.3"), ("b", "0.6"), ("a", "0.4")):  # a, then b beside it, then a again
        res = merger_cli("merge", "--pool", str(tiny_pool), "--method", "task_arithmetic", "--lam", lam, "--out",
                         str(tmp_path / f"{name}.safetensors"), "--card-split", "live", cwd=tmp_path, capsys=capsys)
        assert res.returncode == 0, res.stderr
    assert "lam=0.4" in (tmp_path / "README.md").read_text()  # a's card, replaced by a's own export
    assert "lam=0.6" in (tmp_path / "b.README.md").read_text() and not (tmp_path / "a.README.md").exists()
