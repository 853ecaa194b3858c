"""`fencepost bench memory`: what a model costs in memory as serving loads it.

Each format is measured in a fresh process (so one's freed heap does not
lower the next one's figures): the resident set after the imports (the
interpreter, torch, transformers: the same whatever the model), after the
config and tokenizer are read, and after the engine is built as `fencepost
serve` builds it (weights in the format, the KV pool sized by
`--kv-cache-tokens`, kept small here so that it is not what is measured),
and the peak (VmHWM) over the whole start. Against them: the bytes of the
weights in that format (every matrix, norm and the embedding table as the
engine keeps them). The ratios are of the memory the model added, above the
imports, to those bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

PROBE = r"""
import json, sys

def rss():
    found = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found

import torch
from adapters.engine.engine import Engine
from adapters.engine.model import load_model
from core.batching import BatchLimits

path, fmt, threads = json.loads(sys.argv[1])
if threads:
    torch.set_num_threads(threads)
figures = {"imports": rss()["VmRSS"]}
loaded = load_model(path, quiet=True)
figures["loaded"] = rss()["VmRSS"]
engine = Engine(loaded, BatchLimits(max_seqs=4, max_context=512), weights=fmt,
                kv_cache_tokens=2048, decode="eager")
runner = engine.runner
figures["engine"] = rss()["VmRSS"]
figures["peak"] = rss()["VmHWM"]
figures["weights"] = runner.weight_bytes() + runner.embed_bytes()
figures["kv"] = runner.k_cache.numel() * runner.k_cache.element_size() * 2
figures["format"] = runner.format
figures["family"] = loaded.family
print("FIGURES " + json.dumps(figures))
"""


def measure(path: str | None, fmt: str, threads: int | None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([path, fmt, threads])],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith("FIGURES "):
            figures: dict[str, Any] = json.loads(line[len("FIGURES ") :])
            return figures
    raise RuntimeError(f"the probe for {fmt} failed:\n{done.stderr[-3000:]}")


def main(path: str | None, formats: list[str], threads: int | None) -> int:
    mb = 2**20
    print(f"memory: {path or 'the default model'}, each format in a fresh process, KV pool "
          "of 2048 positions; MB")  # fmt: skip
    print(f"  {'format':7} {'imports':>8} {'+config':>8} {'+engine':>8} {'peak':>8} "
          f"{'weights':>8} {'kv':>6} {'steady/k':>9} {'peak/k':>7}")  # fmt: skip
    for fmt in formats:
        f = measure(path, fmt, threads)
        added, peak = f["engine"] - f["imports"], f["peak"] - f["imports"]
        weights = f["weights"] + f["kv"]
        print(
            f"  {f['format']:7} {f['imports'] / mb:8.0f} {f['loaded'] / mb:8.0f} "
            f"{f['engine'] / mb:8.0f} {f['peak'] / mb:8.0f} {f['weights'] / mb:8.0f} "
            f"{f['kv'] / mb:6.0f} "
            f"{added / weights:9.2f} {peak / weights:7.2f}",
            flush=True,
        )
    print(
        "  steady/k: memory added above the imports once the engine is built, over the "
        "bytes the engine keeps (weights and the KV pool); peak/k: the same for the peak"
    )
    return 0
