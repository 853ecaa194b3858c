"""How a run is written down: its trace, and the compact rendering of events in it.

A traced run (`fencepost sim --seed N --trace`) has one line per event a
machine handled, with the effects it returned (written by the cluster), plus
the simulator's fault and note lines (sim/stage.py). A Trace hashes every line
as it comes (the sweep's determinism check compares two runs' hashes), keeps
the last few for a failure's report, and prints them if asked. `show` renders
an event or effect compactly and stably: the repr with the long constructor
names and default fields abbreviated, so the same run gives the same text.
"""

from __future__ import annotations

import hashlib
from collections import deque

from core.protocol import RouterEffect, WorkerEffect


class Trace:
    """Every line of a traced run: hashed, the last `tail` kept, echoed if asked."""

    def __init__(self, tail: int, echo: bool) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.tail: deque[str] = deque(maxlen=tail)
        self._echo = echo

    def write(self, line: str) -> None:
        self._hash.update(line.encode())
        self.tail.append(line)
        if self._echo:
            print(line)

    def digest(self) -> str:
        return self._hash.hexdigest()


def show(item: object) -> str:
    """A compact, stable rendering of an event or effect for traces."""
    text = repr(item)
    for long, short in _ABBREVIATIONS:
        text = text.replace(long, short)
    return text


def show_all(effects: list[RouterEffect] | list[WorkerEffect]) -> str:
    return "[" + ", ".join(show(e) for e in effects) + "]"


_ABBREVIATIONS = (
    ("Assignment(request_id=", "A("),
    ("FromWorkerMessage(worker_id=", "From("),
    ("FromRouterMessage(message=", "From("),
    ("SendToWorker(worker_id=", "Send("),
    ("SendToRouter(message=", "Send("),
    (", router_id='')", ")"),
    (", router='')", ")"),
    ("GenerationRequest(request_id=", "Req("),
    ("sampling=Sampling(temperature=0.0, top_p=1.0, seed=", "seed=("),
    (", stop_token_ids=()", ""),
    (", logprobs=None, constraint=None", ""),
    ("prompt_token_ids=", "prompt="),
    ("max_new_tokens=", "max_new="),
    ("assignment=", ""),
    ("attempt=", ""),
    ("request=", ""),
    ("message=", ""),
)
