"""One HF anchor of the device check, alone in a process: what bench/gpu_check.py
sets the engine's figures beside.

gpu_check starts this script once an anchor, never runs an anchor in its own
(the engine's) process: in one device run in nine the engine failed with a CUDA
"unspecified launch failure" at 256 streams in a process where HF's compiled
static-cache generate had run before (issue 52). Here the same random-weight
model is built again from its shape and seed (bench/gpu_shapes.py), one anchor
is measured, and its figure goes, as JSON, to the file --result names. A crash
or a hang is this process's alone: gpu_check bounds it by a timeout, reports
its failure with this process's stderr, and goes on.

The anchors, each at the shape's fixed prompts:

- `eager`: HF generate at batch 1 (at most HF_EAGER_TOKENS new tokens: its rate
  a token is flat, host-bound);
- `compiled`: HF generate at batch 1 with a static cache, which transformers
  compiles with torch.compile on CUDA (the first, untimed call is where);
- `generate_batch`: transformers' continuous batching, --streams requests at
  once.

    python bench/gpu_anchors.py --anchor generate_batch --shape tiny --device cpu \\
      --tokens 8 --streams 4 --result /tmp/anchor.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a plain script

import torch

from bench.gpu_shapes import PROMPT_TOKENS, SHAPES, build_model, prompts
from bench.measure import hf_generate_rate

ANCHORS = ("eager", "compiled", "generate_batch")
HF_EAGER_TOKENS = 32


def hf_rate(model: Any, prompt: tuple[int, ...], tokens: int, cap_s: float, **kw: Any) -> float:
    """HF generate's tokens/s at batch 1 (bench/measure.py), printed with its warm-up."""
    rate, warm_s = hf_generate_rate(model, prompt, tokens, cap_s=cap_s, **kw)
    compiled = getattr(model, "_compiled_call", None) is not None
    print(f"  {rate:,.1f} tok/s over {tokens} tokens")
    print(f"    (first call, warm-up{' and compile' if kw else ''}: {warm_s:.1f} s", end="")
    print(f"; transformers compiled the forward: {compiled})" if kw else ")")
    return rate


def cache_sized_for(model: Any, requests: int, context: int) -> dict[str, Any]:
    """generate_batch's keyword arguments for a KV cache that holds these requests.

    Left to itself the manager sizes its cache from the memory it finds free; on
    CPU that is the host's, and filling its static tensors alone took 34 s for 4
    requests of a tiny model (transformers 5.25). A CUDA run keeps the sizing a
    user gets, so only CPU calls this."""
    from transformers import generation

    cb_config = getattr(generation, "ContinuousBatchingConfig", None)
    params = inspect.signature(model.generate_batch).parameters
    sizes: dict[str, int] = {"max_batch_tokens": max(64, requests * PROMPT_TOKENS)}
    if cb_config is not None and "continuous_batching_config" in params:
        defaults = cb_config()
        page = int(getattr(defaults, "page_size", 0) or getattr(defaults, "block_size", 256))
        sizes["num_blocks"] = requests * (math.ceil(context / page) + 1)
        return {"continuous_batching_config": cb_config(**sizes)}
    # Older: the sizes were the GenerationConfig's own fields (block_size 128 then).
    sizes["num_blocks"] = requests * (math.ceil(context / 128) + 1)
    return {"generation_config_fields": sizes}


def generate_batch_rate(model: Any, plist: list[tuple[int, ...]], tokens: int) -> float:
    """transformers' continuous batching: every prompt at once, tokens/s.

    Called outside torch.inference_mode: the manager makes its static tensors on
    the calling thread and updates them on a thread of its own, which inference
    mode (thread-local) does not cover ("Inplace update to inference tensor
    outside InferenceMode"); generate_batch takes torch.no_grad itself. The rate
    runs from the first request's creation to the last one's end, so the
    manager's start (cache allocation, the warm-up's graph captures) is left out
    where the version records them; the whole call's rate prints beside it.
    generate_batch logs a request's failure and returns the rest, so every
    request is checked here for its error and its full count of tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    kwargs: dict[str, Any] = {"generation_config": config, "progress_bar": False}
    if next(model.parameters()).device.type == "cpu":
        kwargs |= cache_sized_for(model, len(plist), PROMPT_TOKENS + tokens)
        for name, value in kwargs.pop("generation_config_fields", {}).items():
            setattr(config, name, value)
    began = time.perf_counter()
    results = model.generate_batch(inputs=[list(p) for p in plist], **kwargs)
    call_s = time.perf_counter() - began
    outputs = list(results.values())
    wrong = [
        f"{o.request_id}: {o.error or f'{len(o.generated_tokens)} tokens'}"
        for o in outputs
        if getattr(o, "error", None) is not None or len(o.generated_tokens) != tokens
    ]
    if len(outputs) != len(plist) or wrong:
        raise RuntimeError(
            f"generate_batch returned {len(outputs)} of {len(plist)} requests, "
            f"{len(wrong)} of them not whole: {'; '.join(wrong[:4])}"
        )
    produced = len(outputs) * tokens
    starts = [getattr(o, "created_time", -1.0) for o in outputs]
    ends = [getattr(o, "lifespan", (-1.0, -1.0))[1] for o in outputs]
    span_s = max(ends) - min(starts)
    if min(starts) > 0 and min(ends) > 0 and 0 < span_s <= call_s:
        rate = produced / span_s
        how = f"over its requests' lifespans, {span_s:.1f} s"
    else:
        rate = produced / call_s
        how = "over the whole call (this version records no lifespans)"
    print(f"  {len(plist)} requests: {rate:,.1f} tok/s {how}")
    print(f"    (the whole call, its manager's start included: {call_s:.1f} s, "
          f"{produced / call_s:,.1f} tok/s)")  # fmt: skip
    return rate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--anchor", choices=ANCHORS, required=True)
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--tokens", type=int, required=True, help="new tokens per request")
    parser.add_argument("--streams", type=int, default=1, help="generate_batch's requests")
    parser.add_argument("--cap-s", type=float, default=20.0, help="bounds a timed generate")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--result", type=Path, required=True, help="where the JSON goes")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)
    print(f"  anchor process pid {os.getpid()}: {args.anchor}, {SHAPES[args.shape].name} shape")
    began = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(SHAPES[args.shape], device, dtype, args.seed)
    print(f"    (model built in {time.perf_counter() - began:.1f} s)")
    plist = prompts(max(1, args.streams))
    if args.anchor == "eager":
        rate = hf_rate(model, plist[0], min(args.tokens, HF_EAGER_TOKENS), args.cap_s)
    elif args.anchor == "compiled":
        rate = hf_rate(model, plist[0], args.tokens, args.cap_s, cache_implementation="static")
    else:
        rate = generate_batch_rate(model, plist, args.tokens)
    result = {"anchor": args.anchor, "pid": os.getpid(), "rate": rate}
    partial = args.result.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.replace(args.result)  # whole or absent: a reader never sees half of it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
