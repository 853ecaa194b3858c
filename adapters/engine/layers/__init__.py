"""The pieces every family's forward pass is made of, one file each, as pure functions.

A family (families/) says which of them a layer uses and with what settings
(spec.Layer); the runner (runner.py) owns the weights and the KV pool and calls
these in a layer's order. Each takes tensors and the weights they need, holds no
state of its own, and computes one thing:

    norm.py        RMSNorm of rows, and of q and k (per head or over the projection)
    rotary.py      every rotary variant's tables, and applying them as k goes to the cache
    attention.py   attention over the paged KV cache: slots, reading pages, decode and
                   prefill attention (paged_attention.py: the fixed-shape step's kinds)
    mlp.py         the gated MLP and its activations
    experts.py     a mixture of experts: routing, grouped products, the padded kind
    embed_head.py  the embedding rows and the logits

A CUDA kernel for any of them (fused.py) is chosen by the caller's flag, so the
same function is the CPU path and the kernel's reference.
"""
