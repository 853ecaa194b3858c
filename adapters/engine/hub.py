"""Models named by their Hugging Face id, found in the hub's own cache and fetched only if allowed.

`--model` takes what vLLM and llama.cpp users type: a local path, or a model id
on the Hugging Face hub (`owner/name`, or `owner/name:file.gguf` for one GGUF
file of a repo). An id is looked up in huggingface_hub's cache, where every
Hugging Face tool keeps what it fetched, so a model fetched elsewhere is served
here without fetching it again. The folder and the offline switch are read from
the environment when the server starts, not when huggingface_hub was imported.

Nothing is downloaded unless HF_HUB_OFFLINE allows it: the project sets it to 1,
so a start is reproducible and never waits on the network, and HF_HUB_OFFLINE=0
lets a missing model be fetched. Only what the engine reads is fetched: the
config, the tokenizer files and one copy of the weights (safetensors where the
repo has them, else PyTorch .bin files), or the single GGUF file asked for. A
name that looks like a path is a path and never an id, so a mistyped folder is
not sent to the hub. Every failure is a ModelNotOnHub whose message is one line
for the person starting the server.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import huggingface_hub
from huggingface_hub import utils as hub_utils
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from adapters.engine.errors import ModelError

__all__ = ["ModelNotOnHub", "hub_cache", "hub_offline", "resolve"]

# What a Hugging Face model directory needs beside its weights; only the ones a repo has
# are fetched.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# The errors of huggingface_hub's HTTP client (httpx2 in version 2), taken from where it
# exports the client (utils.httpx), so that the client's package name is not ours to know.
HTTPError: type[Exception] = hub_utils.httpx.HTTPError  # type: ignore[attr-defined]
TransportError: type[Exception] = hub_utils.httpx.TransportError  # type: ignore[attr-defined]
PYTORCH_WEIGHTS = re.compile(r"pytorch_model.*\.bin(\.index\.json)?")
TRUE_VALUES = frozenset({"1", "true", "yes", "on"})


class ModelNotOnHub(ModelError, LookupError):
    """A model name that is neither an existing path nor a model the hub's cache (or,
    where downloads are allowed, the hub) has; the message is one line for the user."""


def resolve(name: str, speak: Callable[[str], None]) -> Path:
    """The model `name` names: a Hugging Face model directory (config, tokenizer files,
    weights) or a single .gguf file, from the hub's cache, downloaded first where
    HF_HUB_OFFLINE allows it. `speak` gets a line for the person starting the server."""
    repo_id, colon, filename = name.partition(":")
    if name.startswith(("/", "./", "../", "~")) or name in (".", "..") or repo_id.count("/") > 1:
        path = Path(name).expanduser()
        if path.exists():
            return path
        raise ModelNotOnHub(f"model path {name} does not exist")
    if colon and not filename.lower().endswith(".gguf"):
        raise ModelNotOnHub(
            f"model {name}: after ':' name a .gguf file of the repo, as {repo_id}:model.gguf"
        )
    cache, offline = hub_cache(), hub_offline()
    if not offline:
        speak(f"downloading {repo_id} from the Hugging Face hub into {cache} (if not there yet)")
    try:
        if filename:
            found = _gguf(repo_id, filename, cache, offline)
        else:
            found = _repo(repo_id, cache, offline, speak)
    except (OSError, EntryNotFoundError, HTTPError, ValueError) as error:
        raise ModelNotOnHub(_explain(error, name, cache, offline)) from error
    speak(f"model {name}: {found}")
    return found


def hub_cache() -> Path:
    """huggingface_hub's cache folder, computed from the environment now, with its
    precedence: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub
    (huggingface_hub itself reads these once, when it is imported)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    folder = (
        env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    )
    return Path(os.path.expandvars(os.path.expanduser(folder)))


def hub_offline() -> bool:
    """Whether the environment forbids downloads now: HF_HUB_OFFLINE (else
    TRANSFORMERS_OFFLINE, as huggingface_hub reads them) is 1, true, yes or on."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in TRUE_VALUES


def _repo(repo_id: str, cache: Path, offline: bool, speak: Callable[[str], None]) -> Path:
    """A whole repo: its model directory, or its one GGUF file where it has no directory."""
    if not offline:
        try:
            files = huggingface_hub.list_repo_files(repo_id)
        except (TransportError, OfflineModeIsEnabled) as error:
            speak(f"the Hugging Face hub could not be reached ({_line(error)}); using the cache")
            return _repo(repo_id, cache, True, speak)
        wanted = _directory_files(files)
        if wanted:
            snapshot = huggingface_hub.snapshot_download(
                repo_id,
                revision=None,
                cache_dir=cache,
                local_files_only=False,
                allow_patterns=[_literal(file) for file in wanted],
            )
            return _complete(Path(snapshot), repo_id)
        return _gguf(repo_id, _only_gguf(repo_id, files), cache, offline)
    # Offline the snapshot's own files say what the repo is (huggingface_hub checks the
    # patterns given against the repo's listing, where it saved one).
    folder = Path(
        huggingface_hub.snapshot_download(
            repo_id,
            revision=None,
            cache_dir=cache,
            local_files_only=True,
            allow_patterns=[*CONFIG_FILES, *TOKENIZER_FILES],
        )
    )
    files = [path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()]
    if _directory_files(files):
        return _complete(folder, repo_id)
    return folder / _only_gguf(repo_id, files)


def _gguf(repo_id: str, filename: str, cache: Path, offline: bool) -> Path:
    """One GGUF file of a repo, and nothing else of it."""
    return Path(
        huggingface_hub.hf_hub_download(
            repo_id, filename, cache_dir=cache, local_files_only=offline
        )
    )


def _directory_files(files: Iterable[str]) -> list[str]:
    """The files of a repo the engine reads as a Hugging Face model directory (none when it
    has no config.json or no weights): the config and tokenizer files it has, and its
    safetensors (with their index), else its PyTorch .bin files (with theirs)."""
    top = sorted(file for file in files if "/" not in file)
    if "config.json" not in top:
        return []
    safetensors = [file for file in top if file.endswith(".safetensors")]
    # Mistral's repos ship their own format's copy of the weights beside the Hugging Face one.
    weights = [file for file in safetensors if not file.startswith("consolidated")] or safetensors
    if weights:
        weights += [file for file in top if file == "model.safetensors.index.json"]
    else:
        weights = [file for file in top if PYTORCH_WEIGHTS.fullmatch(file)]
    if not weights:
        return []
    return [file for file in top if file in CONFIG_FILES + TOKENIZER_FILES] + weights


def _only_gguf(repo_id: str, files: Iterable[str]) -> str:
    """The repo's one GGUF model file (vision projectors, mmproj*, are not candidates)."""
    ggufs = sorted(
        file
        for file in files
        if file.endswith(".gguf") and not file.rpartition("/")[2].startswith("mmproj")
    )
    if len(ggufs) == 1:
        return ggufs[0]
    if not ggufs:
        raise ModelNotOnHub(
            f"{repo_id} has no model this server loads: neither config.json with safetensors "
            "or .bin weights nor a .gguf file"
        )
    raise ModelNotOnHub(
        f"{repo_id} has {len(ggufs)} GGUF files ({', '.join(ggufs)}): "
        f"pick one as {repo_id}:{ggufs[0]}"
    )


def _complete(folder: Path, repo_id: str) -> Path:
    """The model directory, once every shard its weight index names is there (an
    interrupted download leaves some out)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            missing = sorted(shard for shard in shards if not (folder / shard).is_file())
            if missing:
                raise ModelNotOnHub(
                    f"the cached copy of {repo_id} at {folder} lacks {len(missing)} of its "
                    f"{len(shards)} weight files ({missing[0]}, ...); HF_HUB_OFFLINE=0 lets "
                    "the download finish"
                )
    return folder


def _explain(error: Exception, name: str, cache: Path, offline: bool) -> str:
    """huggingface_hub's error as one line that says what to do."""
    repo_id, _, filename = name.partition(":")
    if isinstance(error, HFValidationError):
        return (
            f"model {name} is neither a local path nor a Hugging Face model id (owner/name): "
            f"{_line(error)}"
        )
    if isinstance(error, GatedRepoError):
        return (
            f"{repo_id} is gated on the Hugging Face hub: accept its terms on huggingface.co, "
            "then log in (hf auth login, or HF_TOKEN)"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"{repo_id} is not a model on the Hugging Face hub (a private one needs "
            "hf auth login, or HF_TOKEN)"
        )
    if isinstance(error, IncompleteSnapshotError):
        if offline:
            return (
                f"the cached copy of {name} at {cache} is incomplete; HF_HUB_OFFLINE=0 finishes it"
            )
        return f"the cached copy of {name} at {cache} is incomplete and the hub is out of reach"
    if isinstance(error, LocalEntryNotFoundError):
        if offline:
            return (
                f"{name} is not in the Hugging Face cache at {cache}; "
                "HF_HUB_OFFLINE=0 lets it be downloaded"
            )
        return (
            f"the Hugging Face hub could not be reached and {name} is not in the cache at {cache}"
        )
    if isinstance(error, EntryNotFoundError):
        return f"{repo_id} has no file {filename} on the Hugging Face hub"
    if isinstance(error, OfflineModeIsEnabled):
        return (
            f"{name} cannot be downloaded: huggingface_hub was imported while HF_HUB_OFFLINE "
            "was set; start the server with HF_HUB_OFFLINE=0"
        )
    if isinstance(error, HfHubHTTPError):
        return f"the Hugging Face hub refused {name}: {_line(error)}"
    if isinstance(error, HTTPError):
        return f"the Hugging Face hub could not be reached for {name}: {_line(error)}"
    return f"model {name}: {_line(error)}"


def _line(error: Exception) -> str:
    """An error's first line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _literal(file: str) -> str:
    """A file name as an allow pattern that matches that name alone."""
    return re.sub(r"([*?\[])", r"[\1]", file)
