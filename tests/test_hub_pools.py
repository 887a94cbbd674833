"""Pools whose sources are Hugging Face Hub repositories, fetched through the real huggingface_hub
from a local fake hub (devtools/fake_hub.py): a tiny CLIPModel base, CLIPVisionModel experts and
parquet datasets, as OpenAI and FusionBench publish them. Each command runs in a fresh process with
HF_ENDPOINT pointing at the fake hub, as a user's would; no request leaves 127.0.0.1."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("pyarrow")
from merger._compat import ensure_torchvision  # noqa: E402

ensure_torchvision()  # transformers imports torchvision too
transformers = pytest.importorskip("transformers")

from devtools.fake_hub import FakeHub  # noqa: E402
from devtools.testing import write_parquet_dataset  # noqa: E402
from merger.demo import world  # noqa: E402
from merger.demo.tokenizer import DemoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TASKS = ("shape", "colour")
_TOK = DemoTokenizer()
CONFIG = {"embed_dim": 16, "quick_gelu": True,
          "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
          "text_cfg": {"context_length": _TOK.context_length, "vocab_size": _TOK.vocab_size, "width": 24, "heads": 2,
                       "layers": 2, "mlp_ratio": 2}}


def hf_config():
    v, t = CONFIG["vision_cfg"], CONFIG["text_cfg"]
    vision = dict(hidden_size=v["width"], intermediate_size=v["width"] * v["mlp_ratio"], num_hidden_layers=v["layers"],
                  num_attention_heads=v["width"] // v["head_width"], image_size=v["image_size"],
                  patch_size=v["patch_size"], projection_dim=CONFIG["embed_dim"], hidden_act="quick_gelu")
    text = dict(vocab_size=t["vocab_size"], max_position_embeddings=t["context_length"], hidden_size=t["width"],
                intermediate_size=t["width"] * t["mlp_ratio"], num_hidden_layers=t["layers"],
                num_attention_heads=t["heads"], projection_dim=CONFIG["embed_dim"], hidden_act="quick_gelu",
                eos_token_id=_TOK.eot_token_id, bos_token_id=_TOK.eot_token_id - 1, pad_token_id=0)
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=CONFIG["embed_dim"])


def saved(model, folder: Path) -> dict[str, bytes]:
    model.save_pretrained(folder)
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name in ("config.json", "model.safetensors")}


def expert_files(base, seed: int, folder: Path) -> dict[str, bytes]:
    torch.manual_seed(seed)
    vision = transformers.CLIPVisionModel(hf_config().vision_config).eval()
    inner = getattr(vision, "vision_model", vision)  # transformers 5 flattens CLIPVisionModel
    inner.load_state_dict(base.vision_model.state_dict())
    with torch.no_grad():
        for p in vision.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return saved(vision, folder)


@pytest.fixture(scope="module")
def world_on_hub(tmp_path_factory):
    """A fake hub holding the base, one expert and one dataset per task, and a pool YAML naming them."""
    tmp = tmp_path_factory.mktemp("hubworld")
    torch.manual_seed(0)
    base = transformers.CLIPModel(hf_config()).eval()
    hub = FakeHub()
    hub.add_repo("openai/tiny-clip", saved(base, tmp / "base"))
    for i, task in enumerate(TASKS):
        hub.add_repo(f"tanganke/tiny-clip_{task}", expert_files(base, i + 1, tmp / f"expert-{task}"))
        files = {}
        for split, (n, seed) in (("train", (200, 11 + i)), ("test", (120, 12 + i))):
            images, labels = world.generate(n, seed)
            path = write_parquet_dataset(tmp / task / f"{split}.parquet", images, labels[task], world.TASKS[task])
            files[f"data/{split}-00000-of-00001.parquet"] = path.read_bytes()
        hub.add_repo(f"tanganke/{task}", files, kind="dataset")
    spec = {"name": "tiny-hub", "architecture": {"config": CONFIG}, "tokenizer": "demo",
            "preprocess": {"image_size": 32, "mean": [0.51, 0.48, 0.47], "std": [0.28, 0.17, 0.22]},
            "base": {"hub": "openai/tiny-clip"},
            "experts": {t: {"hub": f"tanganke/tiny-clip_{t}"} for t in TASKS},
            "tasks": {t: {"templates": list(world.TEMPLATES[t]), "data": {"hub": f"tanganke/{t}"}} for t in TASKS}}
    (tmp / "pool.yaml").write_text(yaml.safe_dump(spec))
    with hub.serving() as url:
        yield hub, url, tmp, base


def run(url, cache, *argv, offline=False, cwd=None):
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_HUB_DISABLE_XET": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "merger", *argv], capture_output=True, text=True, timeout=600,
                          env=env, cwd=cwd or REPO)


def downloads(hub) -> int:
    return sum(r.method == "GET" and "/resolve/" in r.path for r in hub.requests)


def test_a_hub_pool_is_fetched_once_and_then_opens_offline(world_on_hub, tmp_path):
    hub, url, tmp, _ = world_on_hub
    cache, pool = tmp_path / "hf", tmp / "pool.yaml"
    res = run(url, cache, "pools", "fetch", str(pool))
    assert res.returncode == 0, res.stderr
    assert "fetching 10 files" in res.stderr and f"into {cache}" in res.stderr  # said before anything downloads
    assert "tanganke/shape" in res.stdout and "train 200, test 120" in res.stdout, res.stdout  # rows per split
    fetched = downloads(hub)
    online = run(url, cache, "eval", "--pool", str(pool), "--method", "task_arithmetic", "--lam", "0.4", "--json")
    assert online.returncode == 0, online.stderr
    assert downloads(hub) == fetched and "fetching" not in online.stderr  # all in the cache: nothing again
    offline = run(url, cache, "eval", "--pool", str(pool), "--method", "task_arithmetic", "--lam", "0.4", "--json",
                  offline=True)
    assert offline.returncode == 0, offline.stderr
    assert downloads(hub) == fetched
    # no network, HF_HUB_OFFLINE unset (a closed port stands for an unreachable Hub): the cache answers
    down = run("http://127.0.0.1:9", cache, "eval", "--pool", str(pool), "--method", "task_arithmetic", "--lam", "0.4",
               "--json")
    assert down.returncode == 0, down.stderr
    a, b, c = json.loads(online.stdout), json.loads(offline.stdout), json.loads(down.stdout)
    assert a["accuracy"] == b["accuracy"] == c["accuracy"] and set(a["accuracy"]) == set(TASKS)
    # class names came from the datasets' label features: every class has a head
    assert all(0 <= v <= 1 for v in a["accuracy"].values())


def test_nothing_cached_and_offline_is_one_line_naming_the_source(world_on_hub, tmp_path):
    _, url, tmp, _ = world_on_hub
    res = run(url, tmp_path / "empty", "eval", "--pool", str(tmp / "pool.yaml"), "--method", "task_arithmetic",
              offline=True)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "base: openai/tiny-clip (revision main) is not in the Hugging Face cache" in res.stderr
    assert "HF_HUB_OFFLINE=1" in res.stderr and f"merger pools fetch {tmp / 'pool.yaml'}," in res.stderr


def test_a_spec_replays_the_commits_it_was_merged_from(world_on_hub, tmp_path):
    hub, url, tmp, base = world_on_hub
    cache, pool = tmp_path / "hf", tmp / "pool.yaml"
    out = tmp_path / "m.safetensors"
    res = run(url, cache, "merge", "--pool", str(pool), "--method", "task_arithmetic", "--lam", "0.4", "--out", str(out))
    assert res.returncode == 0, res.stderr
    record = yaml.safe_load(out.with_suffix(".yaml").read_text())
    old = record["hub_sources"]["experts.shape"]
    assert old["hub"] == "tanganke/tiny-clip_shape" and len(old["revision"]) == 40
    # the expert's repo moves on: an open fetches the new commit, a replay the recorded one
    new = hub.add_repo("tanganke/tiny-clip_shape", expert_files(base, 7, tmp_path / "newer"))
    res = run(url, cache, "merge", "--pool", str(pool), "--method", "task_arithmetic", "--lam", "0.4",
              "--out", str(tmp_path / "newer.safetensors"))
    assert res.returncode == 0, res.stderr
    newer = yaml.safe_load((tmp_path / "newer.yaml").read_text())["hub_sources"]["experts.shape"]
    assert newer["revision"] == new != old["revision"]
    res = run(url, cache, "merge", "--spec", str(out.with_suffix(".yaml")), "--out", str(tmp_path / "again.safetensors"))
    assert res.returncode == 0, res.stderr
    from safetensors.torch import load_file

    again, first = load_file(tmp_path / "again.safetensors"), load_file(out)
    assert all(torch.equal(again[k], first[k]) for k in first)
    assert not all(torch.equal(load_file(tmp_path / "newer.safetensors")[k], first[k]) for k in first)


def test_bad_sources_are_refused_naming_the_key(world_on_hub, tmp_path, monkeypatch):
    from devtools.fake_hub import point_huggingface_hub
    from merger.errors import PoolError
    from merger.pool import hub as hub_sources

    hub, url, tmp, _ = world_on_hub
    point_huggingface_hub(monkeypatch, url, tmp_path / "hf")
    hub.private("org/secret")
    hub.private("org/gated", gated=True)
    spec = yaml.safe_load((tmp / "pool.yaml").read_text())
    cases = [
        (("experts", "shape", {"hub": "org/nothing"}),
         "experts.shape: org/nothing (revision main): the Hub has no such model repository, or it is private"),
        (("experts", "shape", {"hub": "org/secret"}), "org/secret (revision main): the Hub has no such model repository, "
                                                       "or it is private"),
        (("experts", "shape", {"hub": "org/gated"}), "experts.shape: org/gated (revision main): the Hub asks for access"),
        (("experts", "shape", {"hub": "tanganke/tiny-clip_shape", "revision": "nope"}),
         "the repository has no revision 'nope'"),
        (("experts", "shape", {"hub": "not a repo"}), "experts.shape.hub: 'not a repo' is not a repository name"),
    ]
    for (section, key, value), message in cases:
        bad = json.loads(json.dumps(spec))
        bad[section][key] = value
        with pytest.raises(PoolError) as refused:
            hub_sources.resolve_sources(bad, "bad.yaml")
        assert str(refused.value).startswith("bad.yaml: ") and message in str(refused.value)
    res = run(url, tmp_path / "hf", "eval", "--pool", "hub:clip-vit-b99-ta8", "--method", "ta", offline=True)
    assert res.returncode == 2 and "hub:clip-vit-b99-ta8: not a known pool; known: clip-vit-b32-ta8" in res.stderr


def test_not_enough_disk_is_said_before_anything_downloads(world_on_hub, tmp_path, monkeypatch):
    import shutil

    from devtools.fake_hub import point_huggingface_hub
    from merger.errors import PoolError
    from merger.pool import hub as hub_sources

    hub, url, tmp, _ = world_on_hub
    point_huggingface_hub(monkeypatch, url, tmp_path / "hf")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    before = downloads(hub)
    spec = yaml.safe_load((tmp / "pool.yaml").read_text())
    with pytest.raises(PoolError, match=r"10 files to fetch take 0.00 GB and .* has 0.00 GB free"):
        hub_sources.resolve_sources(spec, "pool.yaml")
    assert downloads(hub) == before


def test_an_interrupted_download_resumes(world_on_hub, tmp_path, monkeypatch):
    from devtools.fake_hub import point_huggingface_hub
    from merger.pool import hub as hub_sources

    hub, url, tmp, _ = world_on_hub
    import huggingface_hub.constants

    point_huggingface_hub(monkeypatch, url, tmp_path / "hf")
    # huggingface_hub writes in DOWNLOAD_CHUNK_SIZE pieces (10 MiB) and resumes from the last one
    # written: a smaller piece lets this small file resume mid-way, as a real checkpoint does
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.cut_next_download("tanganke/tiny-clip_colour", "model.safetensors", after_bytes=5000)
    spec = yaml.safe_load((tmp / "pool.yaml").read_text())
    hub_sources.resolve_sources(spec, "pool.yaml")
    assert any(r.range == "bytes=4096-" for r in hub.requests)
    import merger

    pool = merger.open_pool(tmp / "pool.yaml")  # the whole file: it loads and matches the base
    assert sorted(pool.tasks) == sorted(TASKS)


def test_the_known_benchmarks_are_the_fields(tmp_path):
    from merger.pool import known

    assert known.names()[:3] == ["clip-vit-b32-ta8", "clip-vit-b32-ta14", "clip-vit-b32-ta20"]
    spec = known.pool_spec("clip-vit-b32-ta8")
    assert spec["architecture"] == "ViT-B-32-quickgelu" and spec["base"] == {"hub": "openai/clip-vit-base-patch32"}
    assert list(spec["experts"]) == ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
    assert spec["experts"]["dtd"] == {"hub": "tanganke/clip-vit-base-patch32_dtd"}
    counts = {t: len(v["classes"]) for t, v in spec["tasks"].items()}
    assert counts == {"sun397": 397, "stanford-cars": 196, "resisc45": 45, "eurosat": 10, "svhn": 10, "gtsrb": 43,
                      "mnist": 10, "dtd": 47}
    assert spec["tasks"]["stanford-cars"]["templates"][0] == "a photo of a {}."
    assert len(known.pool_spec("clip-vit-l14-ta20")["experts"]) == 20
    assert known.pool_spec("clip-vit-b16-ta20")["tasks"]["food101"]["data"] == {"hub": "ethz/food101",
                                                                                "test": "validation"}
    res = subprocess.run([sys.executable, "-m", "merger", "pools"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}, cwd=REPO)
    assert res.returncode == 0 and "clip-vit-l14-ta20" in res.stdout and "offline" in res.stdout


def test_a_base_whose_activation_the_architecture_lacks_is_refused(world_on_hub, tmp_path):
    """OpenAI's CLIP uses QuickGELU: open_clip's plain ViT-B-32 loads its weights and gives features
    about 1 % off, so a CLIPModel base whose config says quick_gelu needs an architecture that has it."""
    import merger
    from merger.errors import PoolError

    _, _, tmp, base = world_on_hub
    saved(base, tmp_path / "base")
    spec = yaml.safe_load((tmp / "pool.yaml").read_text())
    spec.update(base=str(tmp_path / "base"), experts={"shape": str(tmp_path / "base")}, tasks={})
    spec["architecture"] = {"config": {**CONFIG, "quick_gelu": False}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(PoolError, match=r"architecture: the inline config uses GELU but the base's config.json says "
                                        r"quick_gelu: set quick_gelu: true in architecture.config"):
        merger.open_pool(tmp_path / "pool.yaml")
    spec["architecture"] = {"config": CONFIG}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(spec))
    assert merger.open_pool(tmp_path / "pool.yaml").base_format == "hf_clip"


def test_a_corrupt_file_in_the_cache_is_refused_not_read(world_on_hub, tmp_path, monkeypatch):
    from devtools.fake_hub import point_huggingface_hub
    from merger.errors import PoolError
    from merger.pool import hub as hub_sources

    _, url, tmp, _ = world_on_hub
    point_huggingface_hub(monkeypatch, url, tmp_path / "hf")
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "merger-cache"))
    spec = yaml.safe_load((tmp / "pool.yaml").read_text())
    _, sources = hub_sources.resolve_sources(spec, "pool.yaml")
    blob = next((tmp_path / "hf").glob("models--tanganke--tiny-clip_shape/snapshots/*/model.safetensors")).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # same size: huggingface_hub's own check (sizes) passes
    blob.write_bytes(bytes(data))
    with pytest.raises(PoolError, match=r"experts.shape: tanganke/tiny-clip_shape/model.safetensors: the file in the "
                                        r"cache .* differs from the Hub's sha256"):
        hub_sources.resolve_sources(spec, "pool.yaml")


def test_a_known_benchmark_is_listed_with_its_size_and_fetched_by_name(tmp_path):
    """hub:clip-vit-b32-ta8's repositories on the fake hub (tiny stand-ins under the real names):
    `merger pools` gives its files and bytes and says it is not here; `pools fetch NAME` fetches it."""
    from merger.pool import known

    spec, hub = known.pool_spec("clip-vit-b32-ta8"), FakeHub()
    hub.add_repo(spec["base"]["hub"], {"config.json": b"{}", "model.safetensors": b"0" * 1000})
    for task in spec["experts"]:
        hub.add_repo(spec["experts"][task]["hub"], {"config.json": b"{}", "model.safetensors": b"0" * 1000})
        images, labels = world.generate(4, 0)
        data = write_parquet_dataset(tmp_path / f"{task}.parquet", images, labels["shape"], world.TASKS["shape"])
        hub.add_repo(spec["tasks"][task]["data"]["hub"], {"data/train-00000-of-00001.parquet": data.read_bytes(),
                                                          "data/test-00000-of-00001.parquet": data.read_bytes()},
                     kind="dataset")
    with hub.serving() as url:
        listed = run(url, tmp_path / "hf", "pools")
        assert listed.returncode == 0, listed.stderr
        line = next(x for x in listed.stdout.splitlines() if x.startswith("clip-vit-b32-ta8 "))
        assert line.split()[1:4] == ["ViT-B-32-quickgelu", "8", "34"] and line.endswith("no")  # 2 + 8×2 + 8×2 files
        assert "not on the Hub: openai/clip-vit-base-patch16" in listed.stdout  # b16 is not on this hub
        fetched = run(url, tmp_path / "hf", "pools", "fetch", "clip-vit-b32-ta8")
        assert fetched.returncode == 0, fetched.stderr
        assert "tasks.sun397.data" in fetched.stdout and "train 4, test 4" in fetched.stdout
        again = run(url, tmp_path / "hf", "pools")
        assert next(x for x in again.stdout.splitlines() if x.startswith("clip-vit-b32-ta8 ")).endswith("yes")


def test_hub_name_opens_the_known_spec_and_exports_name_it(world_on_hub, tmp_path, monkeypatch):
    """`--pool hub:NAME` opens the spec known.py gives for NAME (here a tiny stand-in for it), and an
    export names the pool by that name with the commits it came from."""
    import merger
    from devtools.fake_hub import point_huggingface_hub
    from merger.io.export import export_merge
    from merger.pool import known

    _, url, tmp, _ = world_on_hub
    point_huggingface_hub(monkeypatch, url, tmp_path / "hf")
    monkeypatch.setenv("MERGER_CACHE_DIR", str(tmp_path / "merger-cache"))
    tiny = yaml.safe_load((tmp / "pool.yaml").read_text())
    monkeypatch.setattr(known, "pool_spec", lambda name: dict(tiny) if name == "tiny" else None)
    pool = merger.open_pool("hub:tiny", roots=[str(tmp_path / "elsewhere")])  # the Hub's cache is allowed
    assert pool.source == "hub:tiny" and sorted(pool.tasks) == sorted(TASKS)
    assert set(pool.hub_sources) == {"base", "experts.shape", "experts.colour", "tasks.shape.data",
                                     "tasks.colour.data"}
    weights, spec_file = export_merge(pool, pool.make_spec("task_arithmetic", {"lam": 0.3}), tmp_path / "m.safetensors")
    record = yaml.safe_load(spec_file.read_text())
    assert record["pool"] == "hub:tiny" and record["hub_sources"] == pool.hub_sources
