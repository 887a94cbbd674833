"""The fake Hub (devtools/fake_hub.py) driven by the real huggingface_hub: downloads, repo info,
snapshots, the cache, new commits, pinned revisions, resumed downloads and the Hub's errors.

What a test must do: start the server (``with hub.serving() as url``), then call
``point_huggingface_hub(monkeypatch, url, cache_dir)`` before any huggingface_hub call. Setting
HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE with monkeypatch.setenv is not enough on its own:
huggingface_hub.constants reads them once at import (conftest has already set HF_HUB_OFFLINE=1 by then),
and ``huggingface_hub.model_info`` & co. are bound to an HfApi built at import with the old endpoint.
point_huggingface_hub patches all of that for the test, and its client raises on any request that is not
for the fake hub, so nothing can reach huggingface.co."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from devtools.fake_hub import FakeHub, point_huggingface_hub

hf = pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

CONFIG = b'{"hidden_size": 8}'
WEIGHTS = bytes(range(256)) * 40  # 10 KiB; a .safetensors file is an LFS file on the Hub
ROWS = b"a,b\n1,2\n3,4\n"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub()
    fake.shas = {  # the commits main points at
        "org/model": fake.add_repo("org/model", {"config.json": CONFIG, "model.safetensors": WEIGHTS,
                                                 "sub/notes.txt": "hi"}),
        "org/data": fake.add_repo("org/data", {"train.csv": ROWS, "data/part-0.parquet": WEIGHTS[:999]},
                                  kind="dataset"),
    }
    with fake.serving() as url:
        point_huggingface_hub(monkeypatch, url, tmp_path / "hf-cache")
        yield fake


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def served(hub, method=None, contains=""):
    return [r for r in hub.requests if (method is None or r.method == method) and contains in r.path]


def test_model_and_dataset_files_download_with_plain_http(hub, tmp_path, monkeypatch):
    # even with Xet allowed (and hf_xet installed), no X-Xet-Hash header means a plain HTTP GET of /resolve
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    weights = hf_hub_download("org/model", "model.safetensors")
    config = hf_hub_download("org/model", "config.json")
    rows = hf_hub_download("org/data", "train.csv", repo_type="dataset")
    assert (read(weights), read(config), read(rows)) == (WEIGHTS, CONFIG, ROWS)
    assert str(tmp_path / "hf-cache" / "models--org--model" / "snapshots") in weights
    assert "datasets--org--data" in rows
    # the cache names blobs by ETag: sha256 for an LFS file, the git blob sha1 for a small one
    blobs = tmp_path / "hf-cache" / "models--org--model" / "blobs"
    git_sha = hashlib.sha1(b"blob %d\0" % len(CONFIG) + CONFIG).hexdigest()
    assert sorted(p.name for p in blobs.iterdir()) == sorted([hashlib.sha256(WEIGHTS).hexdigest(), git_sha])
    assert [(r.method, r.path) for r in hub.requests] == [
        ("HEAD", "/org/model/resolve/main/model.safetensors"), ("GET", "/org/model/resolve/main/model.safetensors"),
        ("HEAD", "/org/model/resolve/main/config.json"), ("GET", "/org/model/resolve/main/config.json"),
        ("HEAD", "/datasets/org/data/resolve/main/train.csv"), ("GET", "/datasets/org/data/resolve/main/train.csv"),
    ]


def test_repo_info_with_files_metadata(hub):
    api = HfApi()
    info = api.model_info("org/model", files_metadata=True)
    assert info.sha == hub.shas["org/model"]
    sizes = {s.rfilename: s.size for s in info.siblings}
    assert sizes == {"config.json": len(CONFIG), "model.safetensors": len(WEIGHTS), "sub/notes.txt": 2}
    lfs = {s.rfilename: s.lfs for s in info.siblings}
    assert lfs["config.json"] is None and lfs["model.safetensors"].sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert ("GET", "/api/models/org/model") == served(hub, "GET", "/api/")[-1][:2]
    data = hf.dataset_info("org/data", files_metadata=True)  # the module-level HfApi, repointed too
    assert data.sha == hub.shas["org/data"]
    assert {s.rfilename: s.size for s in data.siblings} == {"data/part-0.parquet": 999, "train.csv": len(ROWS)}
    assert [s.size for s in api.model_info("org/model").siblings] == [None, None, None]  # sizes only on request
    assert api.list_repo_files("org/data", repo_type="dataset") == ["data/part-0.parquet", "train.csv"]
    paths = api.get_paths_info("org/model", ["sub", "config.json", "missing.bin"])
    assert [(type(p).__name__, p.path) for p in paths] == [("RepoFolder", "sub"), ("RepoFile", "config.json")]
    assert [b.name for b in api.list_repo_refs("org/model").branches] == ["main"]


def test_snapshot_download_of_a_model_and_a_dataset(hub):
    folder = snapshot_download("org/model")
    assert read(f"{folder}/model.safetensors") == WEIGHTS and read(f"{folder}/sub/notes.txt") == b"hi"
    sha = folder.rsplit("/", 1)[1]
    assert served(hub, "GET", "/api/models/org/model/")[0].path == "/api/models/org/model/revision/main"
    assert served(hub, "GET", f"/tree/{sha}")  # the file list comes from the tree listing at that commit
    assert len(served(hub, "GET", f"/org/model/resolve/{sha}/")) == 3
    data = snapshot_download("org/data", repo_type="dataset")
    assert read(f"{data}/data/part-0.parquet") == WEIGHTS[:999]
    assert len(served(hub, "GET", "/datasets/org/data/resolve/")) == 2


def test_cached_files_are_read_without_a_request(hub, monkeypatch):
    first = hf_hub_download("org/model", "model.safetensors")
    snapshot = snapshot_download("org/model")
    before = len(hub.requests)
    assert hf_hub_download("org/model", "model.safetensors", local_files_only=True) == first
    assert snapshot_download("org/model", local_files_only=True) == snapshot
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 at import gives
    assert hf_hub_download("org/model", "config.json") == f"{snapshot}/config.json"
    assert len(hub.requests) == before
    with pytest.raises(LocalEntryNotFoundError):
        hf_hub_download("org/data", "train.csv", repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert hf_hub_download("org/model", "model.safetensors") == first  # online again: a HEAD, no GET
    assert [r.method for r in hub.requests[before:]] == ["HEAD"]


def test_a_new_commit_is_fetched_and_the_old_sha_still_resolves(hub, tmp_path):
    old_sha = HfApi().model_info("org/model").sha
    old = hf_hub_download("org/model", "model.safetensors")
    new_weights = WEIGHTS[::-1]
    new_sha = hub.add_repo("org/model", {"model.safetensors": new_weights, "sub/notes.txt": None})
    assert new_sha != old_sha and len(new_sha) == 40
    new = hf_hub_download("org/model", "model.safetensors")
    assert read(new) == new_weights and read(old) == WEIGHTS and new_sha in new and old_sha in old
    assert len(served(hub, "GET", "/resolve/main/model.safetensors")) == 2
    assert HfApi().list_repo_files("org/model") == ["config.json", "model.safetensors"]  # notes deleted
    assert HfApi().list_repo_files("org/model", revision=old_sha) == ["config.json", "model.safetensors",
                                                                      "sub/notes.txt"]
    # the old commit is still served: download it into a fresh cache
    again = hf_hub_download("org/model", "model.safetensors", revision=old_sha, cache_dir=tmp_path / "other")
    assert read(again) == WEIGHTS and served(hub, "GET", f"/resolve/{old_sha}/model.safetensors")
    # the same files committed again still make a new commit
    assert hub.add_repo("org/model", {}) != new_sha


def test_a_pinned_revision_is_downloaded_then_served_from_the_cache(hub):
    sha = HfApi().model_info("org/model").sha
    hub.add_repo("org/model", {"config.json": b"{}"})  # main moves on
    path = hf_hub_download("org/model", "config.json", revision=sha)
    assert read(path) == CONFIG and served(hub, "HEAD", f"/org/model/resolve/{sha}/config.json")
    before = len(hub.requests)
    assert hf_hub_download("org/model", "config.json", revision=sha) == path  # a sha needs no HEAD
    assert snapshot_download("org/model", revision=sha, allow_patterns=["config.json"]).endswith(sha)
    assert [r.path for r in hub.requests[before:]] == [f"/api/models/org/model/tree/{sha}"]
    branch_sha = hub.add_repo("org/model", {"extra.txt": "x"}, revision="dev")
    assert read(hf_hub_download("org/model", "extra.txt", revision="dev")) == b"x"
    assert hf_hub_download("org/model", "extra.txt", revision=branch_sha, local_files_only=True)


def test_a_cut_download_resumes_with_a_range_request(hub):
    # huggingface_hub writes what it received in DOWNLOAD_CHUNK_SIZE (10 MiB) pieces and resumes after the
    # last whole one: cut a 12 MiB file 11 MiB in, and it asks again for bytes=10485760-.
    big = hashlib.sha256(b"seed").digest() * (12 * 1024 * 1024 // 32)
    hub.add_repo("org/big", {"model.safetensors": big})
    hub.cut_next_download("org/big", "model.safetensors", after_bytes=11 * 1024 * 1024)
    path = hf_hub_download("org/big", "model.safetensors")
    assert read(path) == big
    assert not list(Path(path).parent.parent.parent.glob("blobs/*.incomplete"))  # nothing left behind
    gets = served(hub, "GET", "/org/big/resolve/main/model.safetensors")
    assert [r.range for r in gets] == [None, f"bytes={constants.DOWNLOAD_CHUNK_SIZE}-"]


def test_a_cut_small_download_restarts_from_zero(hub):
    # under one chunk nothing reached the disk before the cut, so the retry asks for the whole file again
    hub.cut_next_download("org/model", "config.json", after_bytes=5)
    assert read(hf_hub_download("org/model", "config.json")) == CONFIG
    assert [r.range for r in served(hub, "GET", "/resolve/main/config.json")] == [None, None]


def test_the_hubs_errors_map_to_huggingface_hub_errors(hub):
    with pytest.raises(RepositoryNotFoundError) as missing:
        hf_hub_download("org/nothing", "config.json")
    assert not isinstance(missing.value, GatedRepoError) and missing.value.response.status_code == 404
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("org/nothing")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/model", repo_type="dataset")  # right name, wrong kind
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/model", "nothing.bin")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/model", "config.json", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        HfApi().model_info("org/model", revision="f" * 40)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/data", repo_type="dataset", revision="v9")


def test_private_and_gated_repos_answer_401(hub):
    hub.add_repo("org/secret", {"config.json": CONFIG})
    hub.private("org/secret", token="hf_fake")
    with pytest.raises(RepositoryNotFoundError) as private:
        hf_hub_download("org/secret", "config.json")
    assert private.value.response.status_code == 401 and not isinstance(private.value, GatedRepoError)
    assert read(hf_hub_download("org/secret", "config.json", token="hf_fake")) == CONFIG
    assert HfApi(token="hf_fake").model_info("org/secret").private is True
    hub.private("org/data", kind="dataset", gated=True)
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/data", "train.csv", repo_type="dataset")
    with pytest.raises(GatedRepoError):
        HfApi().dataset_info("org/data")
    with pytest.raises(GatedRepoError):
        snapshot_download("org/data", repo_type="dataset")


def test_no_request_leaves_the_fake_hub(hub):
    with pytest.raises(AssertionError, match="escaped the fake hub"):
        HfApi(endpoint="https://huggingface.co").model_info("org/model")
    assert hub.requests == []


def test_resolve_headers_and_ranges_on_the_wire(hub):
    import urllib.error
    import urllib.request

    def fetch(path, method="GET", **headers):
        request = urllib.request.Request(hub.url + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    sha, url = hub.shas["org/model"], "/org/model/resolve/main/model.safetensors"
    status, headers, body = fetch(url, "HEAD")
    assert (status, headers["X-Repo-Commit"], headers["Content-Length"], body) == (200, sha, "10240", b"")
    assert headers["ETag"] == headers["X-Linked-Etag"] == f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'
    assert "X-Xet-Hash" not in headers and headers["X-Linked-Size"] == "10240"
    assert fetch(url, Range="bytes=10-19")[::2] == (206, WEIGHTS[10:20])
    assert fetch(url, Range="bytes=-5")[1]["Content-Range"] == "bytes 10235-10239/10240"
    assert fetch(url, Range="bytes=10240-")[0] == 416
    assert fetch("/org/model/resolve/main/config.json", "HEAD")[1]["ETag"].strip('"') == hashlib.sha1(
        b"blob %d\0" % len(CONFIG) + CONFIG).hexdigest()
    status, headers, _ = fetch("/org/model/resolve/main/nothing.bin")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (404, "EntryNotFound", sha)
    assert fetch("/api/whatever")[0] == 404
