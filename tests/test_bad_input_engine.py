"""Bad input to the engine: each gets a merger exception naming the file/key and the reason."""
import os
import pickle

import pytest
import torch
import yaml
from helpers import base_and_experts, write_pool

import merger
from merger.errors import CheckpointError, MergerError, MethodError, PoolError
from merger.io import checkpoints


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="nope.safetensors: file not found"):
        checkpoints.load_state_dict(tmp_path / "nope.safetensors")


def test_truncated_safetensors(tmp_path):
    base, _ = base_and_experts(1)
    path = checkpoints.save_safetensors(base, tmp_path / "base.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="base.safetensors: truncated or corrupt"):
        checkpoints.load_state_dict(path)


def test_garbage_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x00\x01 not a tensor file")
    with pytest.raises(CheckpointError, match="x.safetensors: truncated or corrupt"):
        checkpoints.load_state_dict(path)


class Payload:
    """Unpickling this would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_object_is_refused_without_executing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "expert.pt"
    with open(path, "wb") as fh:
        pickle.dump({"visual.proj": Payload(str(marker))}, fh)
    with pytest.raises(CheckpointError, match="expert.pt: refused: .*pickled objects"):
        checkpoints.load_state_dict(path)
    assert not marker.exists()


def test_weights_only_torch_file_loads(tmp_path):
    path = tmp_path / "w.pt"
    torch.save({"state_dict": {"module.a": torch.ones(2)}}, path)
    sd = checkpoints.strip_prefixes(checkpoints.load_state_dict(path))
    assert list(sd) == ["a"]


@pytest.fixture
def pair():
    base, experts = base_and_experts(2)
    return base, experts


def test_expert_missing_extra_misshaped_keys_are_named(pair):
    base, (e1, _) = pair
    bad = dict(e1)
    bad.pop("visual.proj")
    bad["visual.extra_weight"] = torch.zeros(3)
    bad["visual.conv1.weight"] = torch.zeros(2, 2)
    with pytest.raises(CheckpointError) as err:
        checkpoints.validate_expert(bad, base, "e1.safetensors")
    msg = str(err.value)
    assert "e1.safetensors" in msg
    assert "missing keys: visual.proj" in msg
    assert "unexpected keys: visual.extra_weight" in msg
    assert "mis-shaped keys: visual.conv1.weight" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_expert(pair, value):
    base, (e1, _) = pair
    bad = dict(e1)
    bad["visual.proj"] = bad["visual.proj"].clone()
    bad["visual.proj"][0, 0] = value
    with pytest.raises(CheckpointError, match="key visual.proj holds 1 non-finite"):
        checkpoints.validate_expert(bad, base, "e1")


def test_non_floating_weight(pair):
    base, (e1, _) = pair
    bad = dict(e1)
    bad["visual.proj"] = bad["visual.proj"].to(torch.int64)
    with pytest.raises(CheckpointError, match="visual.proj is torch.int64, expected a floating-point"):
        checkpoints.validate_expert(bad, base, "e1")


def test_expert_prefixes_and_tower_only_are_accepted(pair):
    base, (e1, _) = pair
    tower_only = {"module." + k[len("visual."):]: v for k, v in e1.items()}
    aligned = checkpoints.validate_expert(tower_only, base, "e1")
    assert set(aligned) == {k for k in base if k.startswith("visual.")}


def test_zero_experts(pair, tmp_path):
    base, _ = pair
    with pytest.raises(MergerError, match="no experts"):
        merger.merge_state_dicts(base, [], "task_arithmetic")
    path = write_pool(tmp_path, 1)
    spec = yaml.safe_load(path.read_text())
    spec["experts"] = {}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match="zero experts"):
        merger.open_pool(path)
    spec["experts"] = ["experts/e0.safetensors"]  # a list, not task: path lines
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match=r"experts must map task names to checkpoint paths \(got a list: write "
                                        r"'task: path' lines\)"):
        merger.open_pool(path)
    for call in (lambda: merger.merge("demo", "task_arithmetic"), lambda: merger.evaluate(str(path), None)):
        with pytest.raises(MergerError, match=r"expected an open pool, got '.*'; open it once with "
                                              r"pool = merger.open_pool\("):
            call()


def test_unknown_method(pair):
    base, experts = pair
    with pytest.raises(MethodError, match="unknown method 'magic'; known: weight_averaging"):
        merger.merge_state_dicts(base, experts, "magic")


@pytest.mark.parametrize(
    "method, params, match",
    [
        ("cart", {"rank_ratio": 0.0}, r"rank_ratio=0.0 is out of range \(0, 1\]"),
        ("cart", {"rank_ratio": 1.5}, r"rank_ratio=1.5 is out of range \(0, 1\]"),
        ("ties", {"sparsity": 1.0}, r"sparsity=1.0 is out of range \[0, 1\)"),
        ("ties", {"sparsity": -0.1}, r"sparsity=-0.1 is out of range"),
        ("ties", {"sparsity": "lots"}, r"sparsity='lots' is not a number"),
        ("task_arithmetic", {"lam": " 9"}, r"lam=9 is out of range \[-3, 3\]"),  # as text (a spec string): unquoted
        ("dare_linear", {"seed": "1.5"}, r"seed=1.5 must be a whole number"),
        ("task_arithmetic", {"lam": float("nan")}, r"lam=nan is not a finite number"),
        ("dare_linear", {"seed": 1.5}, r"seed=1.5 must be a whole number"),
        ("task_arithmetic", {"sparsity": 0.5}, r"task_arithmetic: does not take sparsity"),
    ],
)
def test_parameters_out_of_range(pair, method, params, match):
    base, experts = pair
    with pytest.raises(MethodError, match=match):
        merger.merge_state_dicts(base, experts, method, **params)


def test_negative_lambda_is_valid(pair):
    base, experts = pair
    merger.merge_state_dicts(base, experts, "task_arithmetic", lam=-1.0)


def test_unknown_expert_subset(tiny_pool):
    pool = merger.open_pool(tiny_pool)
    with pytest.raises(MergerError, match="experts: unknown task.*cars; known: task0, task1, task2"):
        merger.merge(pool, "task_arithmetic", experts=["task0", "cars"])
    with pytest.raises(MergerError, match="empty subset"):
        merger.merge(pool, "task_arithmetic", experts=[])


def test_pool_yaml_typo_and_bad_expert_file(tmp_path):
    path = write_pool(tmp_path, 2)
    spec = yaml.safe_load(path.read_text())
    spec["expertz"] = spec.pop("experts")
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match="unknown key.*expertz"):
        merger.open_pool(path)
    spec["experts"] = spec.pop("expertz")
    spec["experts"]["task1"] = "experts/missing.safetensors"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(CheckpointError, match="missing.safetensors: file not found"):
        merger.open_pool(path)


def test_base_of_another_architecture_is_named(tmp_path):
    path = write_pool(tmp_path, 1)
    spec = yaml.safe_load(path.read_text())
    spec["architecture"]["config"]["vision_cfg"]["width"] = 64
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(CheckpointError, match="base.safetensors: does not match architecture.*mis-shaped"):
        merger.open_pool(path)


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        checkpoints.save_safetensors({"a": torch.ones(1)}, tmp_path / "out.safetensors")
    assert os.listdir(tmp_path) == []


def test_python_objects_given_to_the_api_are_named_not_raised_raw(pair, tiny_pool):
    """Each of these reached torch or Python as it was: a TypeError about weak references, torch's
    list of device types, an AttributeError on 'str'."""
    base, experts = pair
    key = next(iter(base))
    pool = merger.open_pool(tiny_pool)
    merged = merger.merge(pool, "task_arithmetic", lam=0.3)
    cases = [
        (lambda: merger.PoolSession(str(tiny_pool)), "PoolSession: expected an open pool, got .*merger.open_pool"),
        (lambda: merger.open_pool(pool.expert_info[pool.tasks[0]]["path"]),  # it was "not UTF-8 text"
         r"\.safetensors: a checkpoint, not a pool file: a pool is a YAML naming the base and the experts"),
        (lambda: merger.merge_state_dicts(base, experts, "task_arithmetic", device="tpu"),
         r"device 'tpu': not a device \(cpu, cuda or cuda:N\)"),
        (lambda: merger.merge_state_dicts(base, [{**experts[0], key: "x"}, *experts[1:]], "task_arithmetic"),
         rf"experts\[0\]: {key}: expected a tensor, got str"),
        (lambda: merger.merge_state_dicts({**base, 5: base[key]}, experts, "task_arithmetic"),
         r"base: the key 5 \(int\) is not a parameter name \(a string\)"),
        (lambda: merger.evaluate(pool, {**merged, key: torch.empty(merged[key].shape, device="meta")}),
         rf"evaluate: the weights: {key}: a meta tensor \(a shape without values\): load the weights first"),
    ]
    for call, message in cases:
        with pytest.raises(MergerError, match=message):
            call()


# ---- the spectral merges: a matrix they cannot decompose is named, never a NaN merge -----------

def _spectral_world(n_experts=3, duplicate=False, nan=False):
    base, experts = base_and_experts(n_experts)
    if duplicate:
        experts[1] = {k: v.clone() for k, v in experts[0].items()}
    if nan:
        key = next(k for k in experts[0] if k.endswith("mlp.c_fc.weight"))
        experts[0][key][3, 5] = float("nan")
    return base, experts


@pytest.mark.parametrize("method", ["tsv_m", "cart", "iso_c", "iso_cts"])
def test_a_spectral_merge_of_a_non_finite_task_vector_names_the_matrix(method):
    """Checkpoints are checked on load (a non-finite expert is refused there); a task vector that reaches a
    spectral merge otherwise (a lab expert whose fine-tune diverged) is named, never decomposed into NaN."""
    from merger.pool.task_vectors import TaskVectors

    base, experts = _spectral_world(nan=True)
    m = merger.methods.get(method)
    tv = TaskVectors(base, {f"e{i}": e for i, e in enumerate(experts)})
    params = m.resolve({}, 3)
    with pytest.raises(MethodError, match=r"mlp\.c_fc\.weight(, [^:]+)?: holds NaN or Inf"):
        m.delta(m.prepare(tv, **{k: params[k] for k in m.prepare_params}), **params)


@pytest.mark.parametrize("method", ["tsv_m", "cart", "iso_c", "iso_cts"])
def test_a_spectrum_that_does_not_converge_is_named_with_its_matrix(method, monkeypatch):
    base, experts = _spectral_world()

    def fails(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", fails)
    monkeypatch.setattr(torch.linalg, "eigh", fails)  # the drop-ins' route fails too: the reference says so
    with pytest.raises(MethodError, match=r"(TSV-M|CART|Iso-C|Iso-CTS), visual\.\S+(, [^:]+)?: its SVD did not converge"):
        merger.merge_state_dicts(base, experts, method)


@pytest.mark.parametrize("method", ["tsv_m", "iso_cts"])
def test_two_experts_with_the_same_weights_leave_no_orthogonal_factor_and_say_so(method):
    """TSV-M and Iso-CTS orthogonalise the tasks' directions together: two identical experts make them
    linearly dependent, and the factor the methods define does not exist (no silent pseudo-inverse)."""
    base, experts = _spectral_world(duplicate=True)
    with pytest.raises(MethodError, match=r"visual\.\S+: the directions to orthogonalise are \(nearly\) linearly "
                                          r"dependent .* Two experts with the same weights"):
        merger.merge_state_dicts(base, experts, method)
    merged = merger.merge_state_dicts(base, [experts[0], experts[2]], method)  # one of the two: merged
    assert all(bool(torch.isfinite(v).all()) for v in merged.values())


def test_integers_of_hundreds_or_thousands_of_digits_are_refused_in_one_short_line(tiny_pool, tmp_path, capsys):
    """float() overflows past 309 digits and repr() refuses past 4,300: both once escaped as raw errors."""
    from merger.errors import listed

    pool = merger.open_pool(tiny_pool)
    for value, said in ((10**400, "an integer of 401 digits"), (10**5000, "an integer of over 4,000 digits")):
        with pytest.raises(MethodError, match=f"parameter lam={said} is not a finite number"):
            pool.make_spec("task_arithmetic", {"lam": value})
        with pytest.raises(MergerError, match=f"{said} is outside"):
            pool.make_spec("task_arithmetic", {"lam": 0.3}, task_weights={pool.tasks[0]: value})
        assert said in listed([value])
    from merger.cli import main

    digits = "1" + "0" * 400
    assert main(["eval", "--pool", str(tiny_pool), "--method", "task_arithmetic", "--lam", digits]) == 2
    assert capsys.readouterr().err.strip() == ("error: task_arithmetic: parameter lam=an integer of 401 digits is "
                                               "not a finite number")
    spec = tmp_path / "big.yaml"
    spec.write_text(f"method: task_arithmetic\npool: {tiny_pool}\nparams:\n  lam: 1{'0' * 5000}\n")
    assert main(["merge", "--spec", str(spec), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {spec}: not valid YAML: line 4, column 8: a number of 5001 "
                                               "characters (at most 100)")
