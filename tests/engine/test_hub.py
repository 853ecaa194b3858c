"""Model ids resolved through huggingface_hub's cache (adapters/engine/hub.py), with no network.

Each test builds a cache in tmp_path laid out as huggingface_hub lays it out
(models--owner--name/refs/main holds the commit, snapshots/<commit>/ links each
file to its blob in blobs/) and points HF_HUB_CACHE at it; every connection is
refused, so a test that reached for the hub would fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest

from adapters.engine.hub import ModelNotOnHub, hub_cache, hub_offline, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HEADER = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
TINY_SAFETENSORS = struct.pack("<Q", len(HEADER)) + HEADER + struct.pack("<f", 1.0)
CONFIG = b'{"model_type": "llama"}'


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A repo in the cache as huggingface_hub stores it; its snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)  # no newline, as huggingface_hub writes it
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / COMMIT
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


@pytest.fixture(autouse=True)
def connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every address something tried to connect to; each attempt is refused."""
    attempts: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise OSError(f"no network in tests: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_cached_repo_resolves_to_its_snapshot(cache: Path) -> None:
    files = {"config.json": CONFIG, "tokenizer.json": b"{}", "model.safetensors": TINY_SAFETENSORS}
    snapshot = cache_repo(cache, "owner/tiny", files)
    lines: list[str] = []
    assert resolve("owner/tiny", lines.append) == snapshot
    assert (snapshot / "model.safetensors").read_bytes() == TINY_SAFETENSORS
    assert lines == [f"model owner/tiny: {snapshot}"]


def test_gguf_after_colon_resolves_to_that_file(cache: Path) -> None:
    snapshot = cache_repo(cache, "owner/q", {"m-Q4_0.gguf": b"GGUF4", "m-Q8_0.gguf": b"GGUF8"})
    found = resolve("owner/q:m-Q8_0.gguf", lambda _: None)
    assert found == snapshot / "m-Q8_0.gguf"
    assert found.read_bytes() == b"GGUF8"


def test_repo_of_several_ggufs_asks_for_one(cache: Path) -> None:
    cache_repo(cache, "owner/q", {"m-Q4_0.gguf": b"GGUF4", "m-Q8_0.gguf": b"GGUF8"})
    with pytest.raises(ModelNotOnHub) as caught:
        resolve("owner/q", lambda _: None)
    message = str(caught.value)
    assert "m-Q4_0.gguf" in message and "m-Q8_0.gguf" in message
    assert "owner/q:m-Q4_0.gguf" in message


def test_repo_of_one_gguf_resolves_to_it(cache: Path) -> None:
    # A vision projector beside the model is not a second candidate.
    snapshot = cache_repo(cache, "owner/one", {"m.gguf": b"GGUF", "mmproj-m-f16.gguf": b"GGUF"})
    assert resolve("owner/one", lambda _: None) == snapshot / "m.gguf"


@pytest.mark.parametrize("name", ["owner/absent", "owner/absent:m.gguf", "absent"])
def test_id_not_in_cache_says_how_to_download(cache: Path, name: str) -> None:
    cache_repo(cache, "owner/other", {"config.json": CONFIG})
    with pytest.raises(ModelNotOnHub) as caught:
        resolve(name, lambda _: None)
    message = str(caught.value)
    assert f"{name} is not in the Hugging Face cache at {cache}" in message
    assert "HF_HUB_OFFLINE=0" in message and "\n" not in message


def test_incomplete_sharded_snapshot_is_refused(cache: Path) -> None:
    index = {"weight_map": {"a": "model-1-of-2.safetensors", "b": "model-2-of-2.safetensors"}}
    files = {"config.json": CONFIG, "model.safetensors.index.json": json.dumps(index).encode()}
    cache_repo(cache, "owner/big", {**files, "model-1-of-2.safetensors": TINY_SAFETENSORS})
    with pytest.raises(ModelNotOnHub, match=r"lacks 1 of its 2 weight files"):
        resolve("owner/big", lambda _: None)


@pytest.mark.parametrize("name", ["./nope", "/tmp/definitely/not/here", "../x", "~/nope", "a/b/c"])
def test_missing_path_does_not_exist_and_never_asks_the_hub(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # downloads allowed, and still no hub

    def hub_call(*args: object, **kwargs: object) -> None:
        raise AssertionError("a path went to the hub")

    for call in ("snapshot_download", "hf_hub_download", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub, call, hub_call)
    with pytest.raises(ModelNotOnHub, match=f"^model path {name} does not exist$"):
        resolve(name, lambda _: None)


def test_bad_id_is_refused_in_one_line() -> None:
    with pytest.raises(ModelNotOnHub, match="neither a local path nor a Hugging Face model id"):
        resolve("owner/bad--name", lambda _: None)


def test_offline_resolution_opens_no_connection(cache: Path, connections: list[Any]) -> None:
    snapshot = cache_repo(cache, "owner/tiny", {"config.json": CONFIG, "w.safetensors": b""})
    cache_repo(cache, "owner/q", {"m.gguf": b"GGUF"})
    assert resolve("owner/tiny", lambda _: None) == snapshot
    assert resolve("owner/q:m.gguf", lambda _: None).read_bytes() == b"GGUF"
    with pytest.raises(ModelNotOnHub):
        resolve("owner/absent", lambda _: None)
    assert connections == []
    with pytest.raises(OSError, match="no network in tests"):  # the refusal is in force
        socket.create_connection(("127.0.0.1", 9))
    assert connections == [("127.0.0.1", 9)]


def test_cache_and_offline_switch_are_read_from_the_environment_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    snapshot = cache_repo(tmp_path / "home" / "hub", "owner/tiny", {"config.json": CONFIG})
    (snapshot / "model.safetensors").write_bytes(TINY_SAFETENSORS)
    assert resolve("owner/tiny", lambda _: None) == snapshot
    for value, offline in [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False)]:
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_offline() is offline
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert hub_offline() is False


SHARDS = ["model-1-of-2.safetensors", "model-2-of-2.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize(
    ("weights", "fetched"),
    [
        ([*SHARDS, "consolidated.safetensors", "pytorch_model.bin"], SHARDS),
        (["pytorch_model.bin", "tf_model.h5"], ["pytorch_model.bin"]),
    ],
)
def test_download_fetches_config_tokenizer_and_one_copy_of_the_weights(
    cache: Path, monkeypatch: pytest.MonkeyPatch, weights: list[str], fetched: list[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    snapshot = cache_repo(cache, "owner/tiny", {"config.json": CONFIG})
    repo = ["config.json", "tokenizer.json", "merges.txt", "README.md", "onnx/model.onnx", *weights]
    asked: dict[str, Any] = {}

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        asked.update(kwargs, repo_id=repo_id)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: repo)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    lines: list[str] = []
    assert resolve("owner/tiny", lines.append) == snapshot
    assert asked["repo_id"] == "owner/tiny" and asked["cache_dir"] == cache
    assert asked["local_files_only"] is False
    assert sorted(asked["allow_patterns"]) == sorted(
        ["config.json", "tokenizer.json", "merges.txt", *fetched]
    )
    assert "owner/tiny" in lines[0] and str(cache) in lines[0]
