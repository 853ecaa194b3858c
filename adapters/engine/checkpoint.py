"""A model's tensors, read one at a time by name: safetensors, PyTorch files, GGUF.

The loader (loader.py) asks for each tensor under its Hugging Face name, converts it
to the engine's layout and format, and lets the source go before asking for the next, so
no second copy of the model is ever alive: transformers gives the config, the
tokenizer and the chat template, and never builds the model.

- safetensors: one file or shards named by `model.safetensors.index.json`; any
  float dtype the file holds (bf16, fp16, fp32), read through safetensors' own
  memory-mapped reader.
- PyTorch `.bin` files (older checkpoints), sharded or not, loaded memory-mapped
  with weights only.
- GGUF: the file's tensors under their GGUF names (`blk.3.attn_q.weight`),
  mapped to Hugging Face names with gguf's own name table for the file's
  architecture, dequantized by gguf one tensor at a time; llama-architecture
  files store q and k rows permuted for llama.cpp's rotary layout and are put
  back, and Gemma files store norm weights as 1 + w and get w. `quantized(name)`
  gives a tensor's blocks as shipped, for a format that can run them as they are.
- In memory: a model built in this process (tests, the device check), by its
  state dict.

A mixture's experts are found wherever a checkpoint keeps them: one tensor per
expert (Hugging Face's files), one 3-D tensor stacked over the experts (GGUF's
`ffn_gate_exps`: one expert's slice is read at a time), or transformers'
in-memory gate|up layout (`expert_matrix`).
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from adapters.engine.errors import ModelError
from adapters.engine.spec import ExpertTensors


class CheckpointError(ModelError, ValueError):
    """A checkpoint that cannot be read as the config says it should be."""


class Checkpoint(Protocol):
    source: str

    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def release(self) -> None:
        """Give back the memory that reading touched and the engine no longer needs
        (it may read again afterwards, at the cost of touching it anew)."""
        ...


class SafetensorsCheckpoint:
    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.source = str(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            mapping: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(mapping.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            mapping = {}
        if not files:
            raise CheckpointError(f"{directory}: no safetensors files")
        self._open = {name: safe_open(str(directory / name), framework="pt") for name in files}
        if not mapping:
            mapping = {key: name for name, handle in self._open.items() for key in handle.keys()}  # type: ignore[no-untyped-call]  # noqa: SIM118
        self._where = mapping

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"{self.source}: no tensor {name!r}")
        tensor: torch.Tensor = self._open[self._where[name]].get_tensor(name)  # type: ignore[no-untyped-call]
        return tensor

    def release(self) -> None:
        pass  # each tensor read is a copy the engine owns; nothing stays mapped


class TorchCheckpoint:
    """pytorch_model.bin, or its shards: loaded memory-mapped, weights only."""

    def __init__(self, directory: Path) -> None:
        self.source = str(directory)
        index = directory / "pytorch_model.bin.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["pytorch_model.bin"]
        self._tensors: dict[str, torch.Tensor] = {}
        for name in files:
            loaded = torch.load(directory / name, map_location="cpu", mmap=True, weights_only=True)
            self._tensors.update(loaded)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise CheckpointError(f"{self.source}: no tensor {name!r}")
        return self._tensors[name]

    def release(self) -> None:
        pass  # torch.load's mapping lives as long as its tensors


class StateDictCheckpoint:
    """A model built in this process, read through its state dict (tied weights appear
    under both names, as transformers lists them; the family's names decide)."""

    def __init__(self, state: Mapping[str, torch.Tensor], source: str = "built in memory") -> None:
        self.source = source
        self._tensors = dict(state)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise CheckpointError(f"{self.source}: no tensor {name!r}")
        return self._tensors[name].detach()

    def release(self) -> None:
        pass  # the model it reads belongs to the caller


class GgufCheckpoint:
    """A GGUF file's tensors under Hugging Face names (see the module's docstring)."""

    def __init__(self, path: Path, config: Any) -> None:
        import gguf

        self.source = str(path)
        # The reader is dropped once read: its metadata fields (the vocabulary and
        # merges, one numpy view per entry) cost ~150 MB for a 49k-token vocabulary.
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        self.architecture = bytes(field.parts[field.data[0]]).decode()
        arch = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}.get(self.architecture)
        if arch is None:
            raise CheckpointError(f"{path}: GGUF architecture {self.architecture!r} is unknown")
        self._config = config
        layers = int(getattr(config, "num_hidden_layers", 0))
        self._table = gguf.get_tensor_name_map(arch, layers)
        self._tensors = {tensor.name: tensor for tensor in reader.tensors}
        self._mapped = reader.data  # the file, mapped read-only
        del reader

    def _drop_pages(self, offset: int, length: int) -> None:
        """The file's pages under [offset, offset + length) leave this process's
        resident set once read (the page cache keeps them), so that reading a file
        does not add the file's size to the peak."""
        mapped = getattr(self._mapped, "_mmap", None)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = offset - offset % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def release(self) -> None:
        """The file's pages that reading brought in go back to the page cache (a
        read-only mapping: read again, they come from the file as before)."""
        mapped = getattr(self._mapped, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def _gguf_name(self, name: str) -> str | None:
        """The file's name for a Hugging Face tensor name, through gguf's own table
        (Hugging Face module names to GGUF ones, as transformers' loader maps them)."""
        module, _, suffix = name.rpartition(".")
        base = self._table.get_name(module)
        found = None if base is None else f"{base}.{suffix}"
        return found if found in self._tensors else None

    def has(self, name: str) -> bool:
        return self._gguf_name(name) is not None

    def quantized(self, name: str) -> tuple[str, Any, tuple[int, ...]]:
        """(GGML type name, the raw blocks as shipped, logical shape [rows, cols])."""
        tensor = self._tensors[self._require(name)]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        return tensor.tensor_type.name, tensor.data, shape

    def blocks(self, name: str) -> tuple[str, Any, tuple[int, int]]:
        """A matrix's blocks as shipped, its rows in Hugging Face order (llama's q and k
        put back, as `tensor` puts back their float rows): (GGML type name, the rows of
        blocks (a view of the file), (rows, cols))."""
        type_name, data, shape = self.quantized(name)
        if len(shape) != 2:
            raise CheckpointError(f"{self.source}: {name!r} is not a matrix")
        heads = self._permuted_heads(name)
        if heads is not None:
            data = _unpermute(data, heads)
        return type_name, data, (shape[0], shape[1])

    def expert_blocks(self, name: str, index: int) -> tuple[str, Any, tuple[int, int]]:
        """Expert `index`'s matrix of a tensor stacked over the experts ([experts, rows,
        cols], llama.cpp's ffn_gate_exps): as `blocks` gives a matrix's."""
        type_name, data, shape = self.quantized(name)
        if len(shape) != 3 or not 0 <= index < shape[0]:
            raise CheckpointError(f"{self.source}: {name!r} has no expert {index}")
        return type_name, data[index], (shape[1], shape[2])

    def expert(self, name: str, index: int) -> torch.Tensor:
        """Expert `index`'s matrix of a stacked tensor, dequantized (that one only)."""
        _, data, shape = self.expert_blocks(name, index)
        out = torch.empty(shape, dtype=torch.float32)
        _dequantize_rows(data, self._tensors[self._require(name)].tensor_type, out.numpy())
        return out

    def done_with(self, name: str) -> None:
        """A tensor read through `blocks` is packed: its pages leave the resident set."""
        tensor = self._tensors[self._require(name)]
        self._drop_pages(int(tensor.data_offset), int(tensor.n_bytes))

    def _permuted_heads(self, name: str) -> int | None:
        """The heads whose rotary halves llama.cpp's converter interleaved in this
        tensor's rows (llama's q and k), or None where the rows are as Hugging Face's."""
        if self.architecture != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = int(self._config.num_attention_heads)
        if ".k_proj." in name:
            heads = int(getattr(self._config, "num_key_value_heads", None) or heads)
        return heads

    def _require(self, name: str) -> str:
        found = self._gguf_name(name)
        if found is None:
            raise CheckpointError(f"{self.source}: no tensor for {name!r}")
        return found

    def tensor(self, name: str) -> torch.Tensor:
        import gguf

        tensor = self._tensors[self._require(name)]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        out = torch.empty(shape, dtype=torch.float32)
        data, kind = tensor.data, tensor.tensor_type
        if data.ndim == 1:  # a vector: small
            out.view(-1).numpy()[:] = gguf.dequantize(data, kind).reshape(-1)
        else:
            _dequantize_rows(data, kind, out.numpy().reshape(data.shape[0], -1))
        self._drop_pages(int(tensor.data_offset), int(tensor.n_bytes))
        heads = self._permuted_heads(name)
        if heads is not None:
            out = _unpermute(out, heads)
        if self.architecture.startswith("gemma") and name.endswith("norm.weight"):
            out = out - 1.0
        return out


# Rows dequantized at a time: gguf's dequantizers make several temporaries of their
# input's size, which for a whole 49k-row head is over a GB.
DEQUANTIZE_ROWS = 4096


def _dequantize_rows(data: Any, kind: Any, target: Any) -> None:
    """Rows of blocks into `target` (numpy, [rows, ...]), a bounded number at a time
    (gguf's temporaries)."""
    import gguf

    for first in range(0, data.shape[0], DEQUANTIZE_ROWS):
        part = data[first : first + DEQUANTIZE_ROWS]
        target[first : first + DEQUANTIZE_ROWS] = gguf.dequantize(part, kind).reshape(
            part.shape[0], -1
        )


def _unpermute(weight: Any, heads: int) -> Any:
    """llama.cpp's converter interleaves each head's rotary halves; put them back. The
    rows may be floats (a torch tensor) or blocks as shipped (a numpy array of bytes)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(2, 1)
        .reshape(weight.shape)
    )


def open_checkpoint(path: Path, config: Any) -> Checkpoint:
    """The checkpoint at `path`: a .gguf file, or a directory of safetensors or .bin."""
    if path.is_file() and path.suffix == ".gguf":
        return GgufCheckpoint(path, config)
    if any(path.glob("*.safetensors")):
        return SafetensorsCheckpoint(path)
    if (path / "pytorch_model.bin").is_file() or (path / "pytorch_model.bin.index.json").is_file():
        return TorchCheckpoint(path)
    raise CheckpointError(f"{path}: no weights (.safetensors, pytorch_model.bin or .gguf)")


def expert_matrix(
    checkpoint: Checkpoint, experts: ExpertTensors, which: int, index: int
) -> torch.Tensor:
    """Expert `index`'s gate (which 0), up (1) or down (2) matrix [out, in], wherever the
    checkpoint keeps it (spec.ExpertTensors): saved per expert, stacked over the
    experts (a GGUF file: only this expert is dequantized), or in transformers'
    in-memory layout (gate and up as halves of one tensor)."""
    name = experts.per_expert[which].format(e=index)
    if checkpoint.has(name):
        return checkpoint.tensor(name)
    stacked = experts.stacked[which]
    if checkpoint.has(stacked):
        reader = getattr(checkpoint, "expert", None)  # a GGUF file: that expert alone
        found: torch.Tensor = (
            reader(stacked, index) if reader else checkpoint.tensor(stacked)[index]
        )
        return found
    gate_up, down = experts.fused
    if which == 2 and checkpoint.has(down):
        return checkpoint.tensor(down)[index]
    if which < 2 and checkpoint.has(gate_up):
        both = checkpoint.tensor(gate_up)[index]
        half = both.shape[0] // 2
        return both[:half] if which == 0 else both[half:]
    raise CheckpointError(f"{checkpoint.source}: no {name!r}, nor the experts stacked")


def first(checkpoint: Checkpoint, names: Iterable[str]) -> str | None:
    """The first of `names` the checkpoint has."""
    return next((name for name in names if checkpoint.has(name)), None)
