"""How a run is written down: the trace lines of machines' events and effects.

A traced run (`fencepost sim --seed N --trace`) prints one line per event a
machine handled, with the effects it returned, plus the simulator's fault and
note lines. `show` renders an event or effect compactly and stably (the same
run gives the same text, so its hash is the run's fingerprint): the repr with
the long constructor names and default fields abbreviated.
"""

from __future__ import annotations

from core.protocol import RouterEffect, WorkerEffect


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
