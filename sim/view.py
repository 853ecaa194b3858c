"""What the oracles may read of a running cluster: a read-only view, as Protocols.

sim/cluster.py runs the machines and calls the oracles (sim/oracles.py with
sim/attempts.py and sim/fleet_oracles.py, sim/worker_oracles.py, sim/streams.py)
as it goes; the oracles only read. They name the cluster and a router node by
these Protocols rather than by the classes, so no oracle imports sim/cluster.py
(no import circle) and their reach into the cluster is this list. The machines
it hands out (a Router, a Worker) are read through their own query methods; no
oracle calls a handler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from core.protocol import Assignment, Heartbeat
from core.router import Router
from core.worker import Worker
from sim.streams import ClientStream

if TYPE_CHECKING:
    from sim.worker_oracles import Recovered


class WorkerSideView(Protocol):
    @property
    def recovered(self) -> Sequence[Recovered]: ...

    def ended_before(
        self, worker_id: str, router_id: str, beat: Heartbeat, assignment: Assignment
    ) -> bool | None: ...


class ClusterView(Protocol):
    @property
    def workers(self) -> Mapping[str, Worker]: ...

    @property
    def shared(self) -> bool: ...

    @property
    def heartbeat_interval_s(self) -> float: ...

    @property
    def now(self) -> float: ...

    @property
    def worker_oracles(self) -> WorkerSideView: ...

    def resends(self) -> int: ...

    def process(self, worker_id: str) -> int: ...

    def attempts_lost(self) -> int: ...

    def handoffs(self) -> tuple[int, int]: ...  # handed off, and of those gone back

    def wants(self, worker_id: str, assignment: Assignment) -> bool | None: ...

    def alive(self, worker_id: str) -> bool: ...


class NodeView(Protocol):
    @property
    def router(self) -> Router: ...

    @property
    def router_id(self) -> str: ...

    @property
    def streams(self) -> Mapping[str, ClientStream]: ...
