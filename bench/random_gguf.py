"""Write a random-weight Llama or Qwen3-MoE GGUF of a real shape, in llama.cpp's Q4_K_M mix.

For measuring the loader and the engine at a size people serve without a
download: the tokenizer, chat template and special tokens are the default
model's (read from its GGUF), the shape is TinyLlama 1.1B's unless flags say
otherwise, and every matrix holds random quant blocks of the type Q4_K_M gives
it (llama.cpp's choice: Q6_K for the output head and for attn_v and ffn_down
in the first and last eighth of the layers and every third one between;
Q4_K elsewhere; norms F32). Random block bytes are valid weights: the scale
fields are set to small half floats, the rest is uniform bytes.

`--experts N` writes a Qwen3-MoE file instead (architecture qwen3moe): per
layer q/k norms, an F32 router (ffn_gate_inp) and the experts stacked as
llama.cpp stores them (ffn_gate_exps, ffn_up_exps [experts, ffn, hidden],
ffn_down_exps), `--ffn` wide each, `--experts-used` a token. The router's
weights are random normals, so tokens spread over the experts as a trained
router's do.

    .venv/bin/python bench/random_gguf.py /tmp/tinyllama-shape.Q4_K_M.gguf
    .venv/bin/python bench/random_gguf.py /tmp/moe.Q4_K_M.gguf --layers 16 --ffn 768 \
        --experts 32 --experts-used 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from adapters.engine.model import locate

# bytes per 256-weight super-block, and where its half-float scales sit
BLOCK = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def blocks(
    kind: str, rows: int, cols: int, rng: np.random.Generator, stack: int | None = None
) -> np.ndarray:
    """[rows, bytes] of random blocks, or [stack, rows, bytes] (experts stacked)."""
    size, scales = BLOCK[kind]
    lead = (rows,) if stack is None else (stack, rows)
    raw = rng.integers(0, 256, (*lead, cols // 256, size), dtype=np.uint8)
    small = np.frombuffer(np.float16(2e-4).tobytes(), dtype=np.uint8)
    for at in scales:
        raw[..., at : at + 2] = small
    return raw.reshape(*lead, -1)


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
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE file of N experts")
    parser.add_argument("--experts-used", type=int, default=8)
    args = parser.parse_args()
    template = gguf.GGUFReader(str(locate(None).weights))
    arch = "qwen3moe" if args.experts else "llama"
    writer = gguf.GGUFWriter(str(args.path), arch)
    head_dim = args.head_dim or args.hidden // args.heads
    sizes = {
        f"{arch}.block_count": args.layers,
        f"{arch}.embedding_length": args.hidden,
        f"{arch}.feed_forward_length": args.ffn,
        f"{arch}.attention.head_count": args.heads,
        f"{arch}.attention.head_count_kv": args.kv_heads,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.context_length": 2048,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_K_M),
    }
    if args.experts:
        sizes |= {
            f"{arch}.attention.key_length": head_dim,
            f"{arch}.attention.value_length": head_dim,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.rope.freq_base": 1e6,
            f"{arch}.expert_count": args.experts,
            f"{arch}.expert_used_count": args.experts_used,
            f"{arch}.expert_feed_forward_length": args.ffn,
        }
    for name, field in template.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.name"):
            continue
        name = name.replace("llama.", f"{arch}.", 1)  # the template's, under our architecture
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        if name in sizes:
            value = sizes.pop(name)
            kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else kind
        else:
            value = field.contents()
        writer.add_key_value(name, value, kind, sub_type=sub)
    for name, value in sizes.items():  # those the template does not have
        if isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    shape = f"Qwen3-MoE, {args.experts} experts" if args.experts else "TinyLlama-1.1B shape"
    writer.add_string("general.name", f"random {shape}, Q4_K_M ({args.layers} layers)")
    rng = np.random.default_rng(0)
    vocab = len(template.fields["tokenizer.ggml.tokens"].data)
    q_size, kv = args.heads * head_dim, args.kv_heads * head_dim

    def matrix(name: str, rows: int, cols: int, kind: str, stack: int | None = None) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, blocks(kind, rows, cols, rng, stack), raw_dtype=qtype)

    def norm(name: str, width: int = args.hidden) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(width)).astype(np.float32))

    matrix("token_embd.weight", vocab, args.hidden, "Q4_K")
    for layer in range(args.layers):
        wide = "Q6_K" if more_bits(layer, args.layers) else "Q4_K"
        at = f"blk.{layer}"
        norm(f"{at}.attn_norm.weight")
        matrix(f"{at}.attn_q.weight", q_size, args.hidden, "Q4_K")
        matrix(f"{at}.attn_k.weight", kv, args.hidden, "Q4_K")
        matrix(f"{at}.attn_v.weight", kv, args.hidden, wide)
        matrix(f"{at}.attn_output.weight", args.hidden, q_size, "Q4_K")
        norm(f"{at}.ffn_norm.weight")
        if args.experts:
            norm(f"{at}.attn_q_norm.weight", head_dim)
            norm(f"{at}.attn_k_norm.weight", head_dim)
            router = 0.05 * rng.standard_normal((args.experts, args.hidden))
            writer.add_tensor(f"{at}.ffn_gate_inp.weight", router.astype(np.float32))
            matrix(f"{at}.ffn_gate_exps.weight", args.ffn, args.hidden, "Q4_K", args.experts)
            matrix(f"{at}.ffn_up_exps.weight", args.ffn, args.hidden, "Q4_K", args.experts)
            matrix(f"{at}.ffn_down_exps.weight", args.hidden, args.ffn, wide, args.experts)
            continue
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
