"""A stand-in Hugging Face Hub for tests: serves local folders as model repos over HTTP on 127.0.0.1, so that
``huggingface_hub.snapshot_download(repo_id, endpoint=stub.url)`` (or ``HF_ENDPOINT=stub.url`` in a subprocess) and
``hf_hub_download`` fetch them as they would from huggingface.co, with no network.

What it answers, as huggingface_hub (1.33 .. 2.4) asks for it:

* ``GET /api/models/{repo}[/revision/{rev}]`` -- ``HfApi.model_info`` (``hf_api.py``), which ``snapshot_download``
  calls to turn a branch into a commit: ``id``, ``sha``, ``siblings`` and a few other ``ModelInfo`` fields.
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..`` -- ``HfApi.list_repo_tree``, which
  ``snapshot_download`` (``_snapshot_download.py``) lists the files with: ``type``, ``path``, ``size``, ``oid`` (the
  git blob id), and ``lfs: {oid, size, pointerSize}`` for LFS files. One page: no ``Link`` header.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` -- ``get_hf_file_metadata`` / ``http_get`` (``file_download.py``):
  ``X-Repo-Commit``, a quoted ``ETag`` (the git blob id) and ``Content-Length``. LFS files (weights, by suffix, as
  the hub's default ``.gitattributes`` has it) also carry ``X-Linked-Etag`` (their sha256) and ``X-Linked-Size``, so
  the client names their cache blob by sha256 as it does for the hub; unlike the hub, the stub serves their bytes
  itself rather than redirecting to a CDN. No ``X-Xet-*`` header is ever sent, so xet is never used.
* Errors as ``hf_raise_for_status`` (``utils/_http.py``) reads them, from the ``X-Error-Code`` header: an unknown
  repo is ``RepoNotFound`` (401 without a token, 404 with one, as the hub does); an unknown revision
  ``RevisionNotFound`` (404); a missing file ``EntryNotFound`` (404, with ``X-Repo-Commit``); a gated repo's files
  without an ``Authorization: Bearer`` header ``GatedRepo`` (401) -- its info and tree stay public, as on the hub.

Revisions: ``main`` and the commit id, a sha1 of the folder's file list and blob ids, computed at :meth:`start`.
Repo ids are ``org/name``. Only model repos.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import parse_qs, unquote, urlsplit

# Suffixes the hub's default .gitattributes stores in LFS (a subset); bigger files are LFS too.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".msgpack", ".h5", ".model")
LFS_MIN_SIZE = 10 * 1024 * 1024


class _File:
    def __init__(self, path: Path):
        data = path.read_bytes()
        self.disk_path = path
        self.size = len(data)
        self.blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
        self.sha256 = hashlib.sha256(data).hexdigest() if self.is_lfs(path.name, len(data)) else None

    @staticmethod
    def is_lfs(name: str, size: int) -> bool:
        return name.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE

    def tree_entry(self, rel: str) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": self.size, "path": rel}
        if self.sha256:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return entry


class _Repo:
    def __init__(self, repo_id: str, folder: Path):
        self.id = repo_id
        self.files = {p.relative_to(folder).as_posix(): _File(p) for p in sorted(folder.rglob("*")) if p.is_file()}
        listing = "".join(f"{rel}\0{f.blob_id}\n" for rel, f in self.files.items())
        self.sha = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        self.dirs = sorted({"/".join(rel.split("/")[:i]) for rel in self.files for i in range(1, rel.count("/") + 1)})


class HubStub:
    """A stand-in Hugging Face Hub on 127.0.0.1 serving local folders as model repos (tests only)."""

    def __init__(self, repos: dict[str, Path], gated: set[str] = frozenset()):
        self.folders = {repo_id: Path(folder) for repo_id, folder in repos.items()}
        self.gated = set(gated)
        self.url = ""
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> HubStub:
        self._repos = {repo_id: _Repo(repo_id, folder) for repo_id, folder in self.folders.items()}
        stub = self

        class Handler(_Handler):
            hub = stub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log(self, line: str) -> None:
        with self._lock:
            self.requests.append(line)


class _Handler(BaseHTTPRequestHandler):
    hub: HubStub

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def log_message(self, *args):  # keep test output quiet
        pass

    def _serve(self, body: bool) -> None:
        self.hub._log(f"{self.command} {self.path}")
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, rest = self._repo("/".join(parts[2:4])), parts[4:]
            if repo is None:
                return
            if not rest or rest[0] == "revision" and len(rest) == 2:
                if self._revision(repo, rest[1] if rest else "main"):
                    self._json(self._model_info(repo))
                return
            if rest[0] == "tree" and len(rest) >= 2:
                if self._revision(repo, rest[1]):
                    self._tree(repo, "/".join(rest[2:]), query.get("recursive", ["false"])[0].lower() == "true")
                return
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]))
            if repo is not None and self._revision(repo, parts[3]):
                self._resolve(repo, "/".join(parts[4:]), body)
            return
        self._error(404, None, "Not Found")

    # -- endpoints

    def _model_info(self, repo: _Repo) -> dict:
        return {"_id": repo.sha[:24], "id": repo.id, "modelId": repo.id, "sha": repo.sha, "private": False,
                "gated": "manual" if repo.id in self.hub.gated else False, "disabled": False, "downloads": 0,
                "likes": 0, "tags": [], "lastModified": "2024-01-01T00:00:00.000Z",
                "createdAt": "2024-01-01T00:00:00.000Z", "siblings": [{"rfilename": rel} for rel in repo.files]}

    def _tree(self, repo: _Repo, under: str, recursive: bool) -> None:
        prefix = f"{under}/" if under else ""
        if under and under not in repo.dirs:
            return self._error(404, "EntryNotFound", f"{under} does not exist on \"main\"", repo.sha)
        entries = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                   for d in repo.dirs if d.startswith(prefix)]
        entries += [f.tree_entry(rel) for rel, f in repo.files.items() if rel.startswith(prefix)]
        if not recursive:
            entries = [e for e in entries if "/" not in e["path"][len(prefix):]]
        self._json(entries)

    def _resolve(self, repo: _Repo, rel: str, body: bool) -> None:
        f = repo.files.get(rel)
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found", repo.sha)
        if repo.id in self.hub.gated and not self.headers.get("Authorization", "").startswith("Bearer "):
            return self._error(401, "GatedRepo", f"Access to model {repo.id} is restricted. You must have access "
                                                 "to it and be authenticated to access it. Please log in.")
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{f.sha256 or f.blob_id}"',
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "none"}
        if f.sha256:
            headers |= {"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)}
        self._send(200, f.disk_path.read_bytes() if body else b"", headers, length=f.size)

    # -- checks (each answers the error itself and returns a falsy value)

    def _repo(self, repo_id: str) -> _Repo | None:
        repo = self.hub._repos.get(repo_id)
        if repo is None:
            authed = self.headers.get("Authorization", "").startswith("Bearer ")
            self._error(404 if authed else 401, "RepoNotFound",
                        "Repository not found" if authed else "Invalid username or password.")
        return repo

    def _revision(self, repo: _Repo, revision: str) -> bool:
        if revision in ("main", repo.sha):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return False

    # -- responses

    def _json(self, payload) -> None:
        data = json.dumps(payload).encode()
        self._send(200, data if self.command == "GET" else b"", {"Content-Type": "application/json"}, len(data))

    def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self._send(status, data if self.command == "GET" else b"", headers, len(data))

    def _send(self, status: int, data: bytes, headers: dict[str, str], length: int) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if data:
            self.wfile.write(data)
