"""A local, in-memory stand-in for the Hugging Face Hub, for tests: the real ``huggingface_hub``
(checked against 2.4.0) downloads from it over plain HTTP on 127.0.0.1. Standard library only.

    hub = FakeHub()
    sha = hub.add_repo("org/name", {"config.json": b"{}", "model.safetensors": b"..."})
    with hub.serving() as url:
        point_huggingface_hub(monkeypatch, url, tmp_path / "hf")   # see below
        huggingface_hub.hf_hub_download("org/name", "model.safetensors")
    hub.requests  # [Served(method, path, range), ...]

What a caller must do. ``huggingface_hub.constants`` reads HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_HUB_DISABLE_XET and HF_HUB_DISABLE_IMPLICIT_TOKEN once, at import, and the module-level ``HfApi()``
behind ``huggingface_hub.model_info`` & co. keeps the endpoint it saw then; this project's conftest
also sets HF_HUB_OFFLINE=1 before the import. Setting env vars inside a test is therefore not enough:
call ``point_huggingface_hub(monkeypatch, url, cache_dir)``, which patches those constants (undone with
the monkeypatch) and refuses any request that is not for the fake hub. Without it, pass ``endpoint=url``
and ``cache_dir=`` to every call (``HfApi(endpoint=url)``) and patch ``constants.HF_HUB_OFFLINE``.

Served routes (``{t}`` is models, datasets or spaces; ``{p}`` is "" or datasets/ or spaces/):
  HEAD/GET /{p}{repo}/resolve/{rev}/{path}   file bytes; Range bytes=a-b | a- | -n gives 206
  GET  /api/{t}/{repo}[/revision/{rev}]      repo info: sha, siblings (sizes, lfs with ?blobs=true)
  GET  /api/{t}/{repo}/tree/{rev}[/{dir}]    tree listing (?recursive=true); snapshot_download uses it
  POST /api/{t}/{repo}/paths-info/{rev}      get_paths_info
  GET  /api/{t}/{repo}/refs                  list_repo_refs
``rev`` is a branch name or a full 40-hex commit sha. Errors carry the X-Error-Code header that
``hf_raise_for_status`` maps: RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound. No Xet headers
(X-Xet-Hash) are ever sent, so the library takes its plain-HTTP download path even with hf_xet installed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import sys
import threading
import time
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

Served = namedtuple("Served", "method path range")  # path is unquoted, without the query string

# Files stored with Git LFS on the Hub (ETag = sha256): the usual .gitattributes suffixes, and anything
# over 10 MiB, the size from which the Hub refuses plain git files.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".gguf", ".onnx", ".msgpack",
                ".npy", ".npz", ".parquet", ".arrow", ".zip", ".gz", ".tar", ".pkl")
LFS_MIN_SIZE = 10 * 1024 * 1024
_KINDS = {"models": "model", "datasets": "dataset", "spaces": "space"}
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_RESOLVE = re.compile(rf"^/(?:(?P<prefix>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_API = re.compile(rf"^/api/(?P<kinds>models|datasets|spaces)/{_REPO}"
                  r"(?:/(?P<op>revision|tree|paths-info|refs)(?:/(?P<rev>[^/]+)(?:/(?P<path>.*))?)?)?$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _git_sha(data: bytes) -> str:
    """The id git gives a blob, which the Hub uses as ETag and blobId of non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Blob:
    """One file's bytes and the ids the Hub derives from them."""

    def __init__(self, path: str, data: bytes):
        self.data = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.lfs = path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE
        # An LFS file's git blob is its pointer file: blobId and pointerSize describe that pointer.
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(data)}\n"
        self.pointer_size = len(pointer)
        self.blob_id = _git_sha(pointer.encode() if self.lfs else data)
        self.etag = self.sha256 if self.lfs else self.blob_id

    def entry(self, path: str) -> dict:
        """The /tree and /paths-info JSON for this file."""
        out = {"type": "file", "path": path, "size": len(self.data), "oid": self.blob_id}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": self.pointer_size}
        return out


class _Repo:
    def __init__(self):
        self.branches: dict[str, str] = {}  # branch -> commit sha
        self.commits: dict[str, tuple[dict[str, _Blob], float]] = {}  # sha -> (files, time)
        self.access: tuple[bool, str | None] | None = None  # (gated, token) once made private


class FakeHub:
    """In-memory model/dataset/space repos served over HTTP; see the module docstring."""

    def __init__(self):
        self._lock = threading.Lock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._cuts: dict[tuple[str, str, str], int] = {}
        self._commit_count = 0
        self.requests: list[Served] = []
        self.url: str | None = None

    def add_repo(self, repo_id: str, files: dict[str, bytes | str | None], *, kind: str = "model",
                 revision: str = "main") -> str:
        """Commit ``files`` to branch ``revision`` of repo ``repo_id`` (created if new) and return the new
        commit's 40-hex sha. A commit starts from the branch's previous files (a new branch starts from
        ``main``), adds or replaces the given ones and deletes those mapped to None; the branch moves to
        the new commit, and older commits stay reachable by their sha."""
        if kind not in _KINDS.values() or re.fullmatch(r"[0-9a-f]{40}", revision):
            raise ValueError(f"bad kind {kind!r} or revision {revision!r} (a branch name is expected)")
        with self._lock:
            repo = self._repos.setdefault((kind, repo_id), _Repo())
            parent = repo.branches.get(revision) or repo.branches.get("main")
            tree = dict(repo.commits[parent][0]) if parent else {}
            for path, data in files.items():
                if path.startswith("/") or ".." in path.split("/"):
                    raise ValueError(f"bad path in repo: {path!r}")
                if data is None:
                    tree.pop(path, None)
                else:
                    tree[path] = _Blob(path, data.encode() if isinstance(data, str) else bytes(data))
            self._commit_count += 1  # so that the same files committed twice still get two shas
            seed = f"{kind}/{repo_id}@{revision}#{self._commit_count}:{parent}:" + ",".join(
                f"{p}={b.blob_id}" for p, b in sorted(tree.items()))
            sha = hashlib.sha1(seed.encode()).hexdigest()
            repo.commits[sha] = (tree, time.time())
            repo.branches[revision] = sha
            return sha

    def private(self, repo_id: str, *, kind: str = "model", gated: bool = False, token: str | None = None):
        """Answer 401 for this repo unless the request has ``Authorization: Bearer <token>``: with
        X-Error-Code RepoNotFound (RepositoryNotFoundError, like a private repo) or, if ``gated``,
        GatedRepo (GatedRepoError, a subclass of it)."""
        with self._lock:
            self._repos.setdefault((kind, repo_id), _Repo()).access = (gated, token)

    def cut_next_download(self, repo_id: str, path: str, after_bytes: int, *, kind: str = "model"):
        """Make the next GET of that file send its headers (full Content-Length) and ``after_bytes`` bytes
        of body, then drop the connection."""
        with self._lock:
            self._cuts[(kind, repo_id, path)] = after_bytes

    @contextlib.contextmanager
    def serving(self):
        """Serve on a free port of 127.0.0.1 in a daemon thread; yield the base url (also ``self.url``)."""
        server = _Server(("127.0.0.1", 0), _Handler)
        server.hub = self
        # a short poll interval: shutdown() waits for it, once per test
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-hub", daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self.url
        finally:
            server.shutdown()
            server.close_connections()
            server.server_close()
            thread.join(5)
            self.url = None

    # -- request handling (called from the server threads) -----------------------------------------

    def _lookup(self, kind: str, repo_id: str, revision: str | None, auth: str | None):
        """(error, repo, sha): error is None or (status, X-Error-Code, message) to answer with."""
        with self._lock:
            repo = self._repos.get((kind, repo_id))
            if repo is None:
                return (404, "RepoNotFound", f"Repository {repo_id} not found"), None, None
            if repo.access is not None:
                gated, token = repo.access
                if token is None or auth != f"Bearer {token}":
                    code = "GatedRepo" if gated else "RepoNotFound"
                    return (401, code, f"Access to {repo_id} is restricted"), None, None
            if revision is None:  # a repo-wide route (refs)
                return None, repo, None
            sha = repo.branches.get(revision) or (revision if revision in repo.commits else None)
            if sha is None:
                return (404, "RevisionNotFound", f"Invalid rev id: {revision}"), repo, None
            return None, repo, sha

    def _take_cut(self, kind: str, repo_id: str, path: str) -> int | None:
        with self._lock:
            return self._cuts.pop((kind, repo_id, path), None)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a keep-alive connection must not hold the test process open

    def __init__(self, *args):
        super().__init__(*args)
        self.open_sockets: set[socket.socket] = set()

    def close_connections(self):
        """Drop the connections still kept alive by clients, so their handler threads end now."""
        for sock in list(self.open_sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is not a bug here
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as with the real Hub; every answer has a Content-Length
    server: _Server

    def setup(self):
        super().setup()
        self.server.open_sockets.add(self.connection)

    def finish(self):
        self.server.open_sockets.discard(self.connection)
        super().finish()

    def log_message(self, *args):  # quiet: tests read hub.requests instead
        pass

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def do_POST(self):
        self._route()

    # -- routing ------------------------------------------------------------------------------------

    def _route(self):
        hub: FakeHub = self.server.hub
        method, split = self.command, urlsplit(self.path)
        hub.requests.append(Served(method, unquote(split.path), self.headers.get("Range")))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""  # read it all, or keep-alive breaks
        handler = None
        if method != "POST" and (m := _RESOLVE.match(split.path)):
            handler, kind = self._resolve_file, _KINDS[m["prefix"] or "models"]
        elif m := _API.match(split.path):
            kind, op = _KINDS[m["kinds"]], m["op"] or "revision"
            handler = {("GET", "revision"): self._info, ("GET", "tree"): self._tree, ("GET", "refs"): self._refs,
                       ("POST", "paths-info"): self._paths_info}.get((method, op))
        if handler is None:
            return self._error((404, None, f"fake hub: no route for {method} {split.path}"))
        repo_id, rev = unquote(m["repo"]), None if handler == self._refs else unquote(m["rev"] or "main")
        error, repo, sha = hub._lookup(kind, repo_id, rev, self.headers.get("Authorization"))
        if error:
            return self._error(error)
        query = {k: v[-1].lower() for k, v in parse_qs(split.query).items()}  # blobs=true, recursive=true
        query.update(parse_qs(body.decode(errors="replace")))  # paths-info posts a form: paths=a&paths=b
        handler(repo, sha, unquote(m["path"] or "").strip("/"), query, (kind, repo_id))

    def _resolve_file(self, repo, sha, path, query, key):
        blob = repo.commits[sha][0].get(path)
        if blob is None:  # X-Repo-Commit lets the library cache the absence (.no_exist/<sha>/<path>)
            return self._error((404, "EntryNotFound", f"no {path} at {sha}"), {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{blob.etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if blob.lfs:  # the library prefers these over ETag/Content-Length (the real Hub redirects LFS files)
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.data))})
        data, status, total = blob.data, 200, len(blob.data)
        if self.command == "GET" and (wanted := self.headers.get("Range")):
            m = _RANGE.match(wanted.strip())
            if m and (m[1] or m[2]):
                if m[1]:
                    start, end = int(m[1]), min(int(m[2] or total - 1), total - 1)
                else:  # bytes=-n: the last n bytes
                    start, end = max(total - int(m[2]), 0), total - 1
                if start >= total or end < start:
                    return self._send(416, b"", {**headers, "Content-Range": f"bytes */{total}"})
                data, status = data[start:end + 1], 206
                headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        cut = self.server.hub._take_cut(*key, path) if self.command == "GET" else None
        self._send(status, data, headers, cut=cut)

    def _info(self, repo, sha, path, query, key):
        kind, repo_id = key
        files, when = repo.commits[sha]
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(when))
        siblings = []
        for path, blob in sorted(files.items()):
            sib = {"rfilename": path}
            if query.get("blobs") == "true":  # files_metadata=True
                sib.update(size=len(blob.data), blobId=blob.blob_id)
                if blob.lfs:
                    sib["lfs"] = {"sha256": blob.sha256, "size": len(blob.data),
                                  "pointerSize": blob.pointer_size}
            siblings.append(sib)
        gated = repo.access[0] and "manual" if repo.access else False
        info = {"_id": sha[:24], "id": repo_id, "author": repo_id.split("/")[0] if "/" in repo_id else None,
                "sha": sha, "lastModified": date, "createdAt": date, "private": repo.access is not None,
                "gated": gated, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "siblings": siblings, "usedStorage": sum(len(b.data) for b in files.values())}
        if kind == "model":
            info["modelId"] = repo_id
        self._json(info)

    def _tree(self, repo, sha, prefix, query, key):
        files, recursive = repo.commits[sha][0], query.get("recursive") == "true"
        base = prefix + "/" if prefix else ""
        entries: dict[str, dict] = {}
        for path, blob in sorted(files.items()):
            if not path.startswith(base):
                continue
            parts = path[len(base):].split("/")
            for depth in range(1, len(parts)):  # the folders between base and the file
                folder = base + "/".join(parts[:depth])
                entries.setdefault(folder, _folder(folder))
                if not recursive:
                    break
            if recursive or len(parts) == 1:
                entries[path] = blob.entry(path)
        if prefix and not entries:
            return self._error((404, "EntryNotFound", f"no {prefix} at {sha}"), {"X-Repo-Commit": sha})
        self._json(sorted(entries.values(), key=lambda e: (e["type"] != "directory", e["path"])))

    def _paths_info(self, repo, sha, path, query, key):
        files, out = repo.commits[sha][0], []
        for path in (p.strip("/") for p in query.get("paths", [])):
            if path in files:
                out.append(files[path].entry(path))
            elif any(f.startswith(path + "/") for f in files):
                out.append(_folder(path))
        self._json(out)  # unknown paths are left out, as on the Hub

    def _refs(self, repo, sha, path, query, key):
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                    for b, s in sorted(repo.branches.items())]
        self._json({"branches": branches, "tags": [], "converts": [], "pullRequests": []})

    # -- answering ----------------------------------------------------------------------------------

    def _json(self, obj, status: int = 200, headers: dict | None = None):
        headers = {"Content-Type": "application/json", **(headers or {})}
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, error, headers: dict | None = None):
        status, code, message = error
        extra = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(headers or {})}
        self._json({"error": message}, status, extra)

    def _send(self, status: int, data: bytes, headers: dict, cut: int | None = None):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if cut is None:
            self.wfile.write(data)
            return
        # Promise the whole body, send part of it, then hang up: the client sees a truncated response.
        self.wfile.write(data[:cut])
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _folder(path: str) -> dict:
    return {"type": "directory", "path": path, "oid": hashlib.sha1(f"tree {path}".encode()).hexdigest()}


def point_huggingface_hub(monkeypatch, url: str, cache_dir) -> None:
    """Make ``huggingface_hub`` (already imported or not) use the fake hub at ``url`` and the cache
    ``cache_dir`` for the rest of a test, through pytest's ``monkeypatch`` (so it is all undone after):
    the env vars for subprocesses, the import-time constants, the module-level ``HfApi`` behind
    ``huggingface_hub.model_info`` & co., online mode, no Xet, no implicit (real) token, and a client
    whose requests fail loudly if they are not for ``url``."""
    import huggingface_hub.hf_api as hf_api  # here, not at the top: this module stays stdlib-only
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent, _http

    url, cache_dir = url.rstrip("/"), str(cache_dir)
    for name, value in {"HF_ENDPOINT": url, "HF_HUB_CACHE": cache_dir, "HF_HUB_OFFLINE": "0",
                        "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
                        "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}.items():  # never via a proxy
        monkeypatch.setenv(name, value)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"  # hf_hub_url builds urls from this
    for name, value in {"ENDPOINT": url, "HUGGINGFACE_CO_URL_TEMPLATE": template, "HF_HUB_CACHE": cache_dir,
                        "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_XET": True,
                        "HF_HUB_DISABLE_IMPLICIT_TOKEN": True}.items():  # no real token, nor its refresh
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(hf_api.api, "endpoint", url)
    # The first request headers of a process fetch {ENDPOINT}/api/agent-harnesses and cache it in HF_HOME;
    # an empty registry (no AI-agent detection) keeps that request out of hub.requests and HF_HOME unwritten.
    monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})

    def only_fake_hub(request):
        if not str(request.url).startswith(url + "/"):
            raise AssertionError(f"request escaped the fake hub: {request.method} {request.url}")

    def guarded_client():
        client = _http.default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks["request"], only_fake_hub]}
        return client

    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", guarded_client)
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None)  # the next request builds a guarded client
