"""Write a random-weight Llama GGUF of a real shape, in llama.cpp's Q4_K_M mix.

For measuring the loader and the engine at a size people serve without a
download: the tokenizer, chat template and special tokens are the default
model's (read from its GGUF), the shape is TinyLlama 1.1B's unless flags say
otherwise, and every matrix holds random quant blocks of the type Q4_K_M gives
it (llama.cpp's choice: Q6_K for the output head and for attn_v and ffn_down
in the first and last eighth of the layers and every third one between;
Q4_K elsewhere; norms F32). Random block bytes are valid weights: the scale
fields are set to small half floats, the rest is uniform bytes.

    .venv/bin/python bench/random_gguf.py /tmp/tinyllama-shape.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from adapters.engine.model import locate

# bytes per 256-weight super-block, and where its half-float scales sit
BLOCK = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    size, scales = BLOCK[kind]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    small = np.frombuffer(np.float16(2e-4).tobytes(), dtype=np.uint8)
    for at in scales:
        raw[:, :, at : at + 2] = small
    return raw.reshape(rows, -1)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    template = gguf.GGUFReader(str(locate(None).weights))
    writer = gguf.GGUFWriter(str(args.path), "llama")
    sizes = {
        "llama.block_count": args.layers,
        "llama.embedding_length": args.hidden,
        "llama.feed_forward_length": args.ffn,
        "llama.attention.head_count": args.heads,
        "llama.attention.head_count_kv": args.kv_heads,
        "llama.rope.dimension_count": args.hidden // args.heads,
        "llama.context_length": 2048,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_K_M),
    }
    for name, field in template.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.name"):
            continue
        value = sizes.get(name, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    writer.add_string("general.name", f"random TinyLlama-1.1B shape, Q4_K_M ({args.layers} layers)")
    rng = np.random.default_rng(0)
    vocab = len(template.fields["tokenizer.ggml.tokens"].data)
    kv = args.kv_heads * (args.hidden // args.heads)

    def matrix(name: str, rows: int, cols: int, kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, blocks(kind, rows, cols, rng), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(args.hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, args.hidden, "Q4_K")
    for layer in range(args.layers):
        wide = "Q6_K" if more_bits(layer, args.layers) else "Q4_K"
        at = f"blk.{layer}"
        norm(f"{at}.attn_norm.weight")
        matrix(f"{at}.attn_q.weight", args.hidden, args.hidden, "Q4_K")
        matrix(f"{at}.attn_k.weight", kv, args.hidden, "Q4_K")
        matrix(f"{at}.attn_v.weight", kv, args.hidden, wide)
        matrix(f"{at}.attn_output.weight", args.hidden, args.hidden, "Q4_K")
        norm(f"{at}.ffn_norm.weight")
        matrix(f"{at}.ffn_gate.weight", args.ffn, args.hidden, "Q4_K")
        matrix(f"{at}.ffn_up.weight", args.ffn, args.hidden, "Q4_K")
        matrix(f"{at}.ffn_down.weight", args.hidden, args.ffn, wide)
    norm("output_norm.weight")
    matrix("output.weight", vocab, args.hidden, "Q6_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.path}: {args.path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
