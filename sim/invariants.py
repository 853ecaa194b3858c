"""The cluster's own invariants: its machines' slots and links after every event, the
end of a run, and when a run has settled.

`check_safety` runs after every event: it raises the first violation any
oracle has found (the cluster's own, the stream oracles', each router's,
the workers'), then checks what only the machines' tables show: no worker
holds more assignments than slots, none holds work of a router it lost its
link to, none decodes what it no longer holds, and no router counts more of
a worker's slots than it has. Only a machine that handled an event since the
last call can have changed what these read, so the cluster marks each one it
runs (`touched_workers`, `touched_routers`) and only those are read.

`settled` is the liveness goal (every request has its outcome, every slot is
back as every machine sees it, every live router sees every worker healthy
at its epoch), `unsettled_reasons` says what is missing when the budget runs
out, and `check_end` adds the checks of a finished run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.cluster import Cluster


class InvariantViolation(AssertionError):
    """An oracle found behaviour the contract forbids."""


class Invariants:
    """The checks above, for one cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        # What ran since the last check_safety: only a machine that handled an event
        # can have changed what the per-event checks read of it.
        self.touched_workers: dict[str, None] = {}  # in order: the same first violation
        self.touched_routers: dict[str, None] = {}

    def check_safety(self) -> None:
        """Raise InvariantViolation if any client saw something the contract forbids, or
        an oracle of sim/oracles.py found a fault it cannot explain. The per-machine
        checks read only the workers and routers that handled an event since the last
        call: nothing else changes what they read."""
        cluster = self.cluster
        if cluster.violations:
            raise InvariantViolation(cluster.violations[0])
        if cluster.streams_oracle.violations:
            raise InvariantViolation(cluster.streams_oracle.violations[0])
        for node in cluster.all_nodes:
            if node.oracles.violations:
                raise InvariantViolation(node.oracles.violations[0])
        if cluster.worker_oracles.violations:
            raise InvariantViolation(cluster.worker_oracles.violations[0])
        touched, self.touched_workers = self.touched_workers, {}
        for worker_id in touched:
            if worker_id in cluster.down:
                continue
            worker = cluster.workers[worker_id]
            holds = worker.holds()
            if len(holds) > worker.config.slots:
                raise InvariantViolation(f"{worker_id} over-committed its slots")
            linked = worker.links()
            if any(a.router not in linked for a in holds):
                # A lost link's work ends with it: nobody can receive its tokens.
                foreign = [a for a in holds if a.router not in linked]
                raise InvariantViolation(f"{worker_id} holds {foreign} of routers it lost")
            decodes = cluster.decoders.decodes[worker_id]
            if decodes and not decodes.keys() <= holds:
                # Cancelled or ended work must stop at once, not burn a slot's compute.
                raise InvariantViolation(f"{worker_id} decodes assignments it no longer holds")
        routers, self.touched_routers = self.touched_routers, {}
        for router_id in routers:
            router = cluster.nodes.get(router_id)
            if router is None:
                continue  # crashed since
            for worker_id, held, _ in router.router.slot_usage():
                # Against the worker's own slot count: a draining worker reports none free.
                if held > cluster.workers[worker_id].config.slots:
                    raise InvariantViolation(f"router {router_id!r} over-committed {worker_id}")

    def check_end(self, fault_kinds: set[str]) -> None:
        """The checks of a finished run: fence counters the faults cannot explain, and
        every live process's scheduler empty with every block back (free or cached),
        whatever was preempted, cancelled, superseded or cut off on the way."""
        cluster = self.cluster
        cluster.oracles.check_fences(cluster.fenced(), fault_kinds)
        cluster.decoders.check_settled(cluster.down)
        self.touched_workers.update(dict.fromkeys(cluster.workers))
        self.touched_routers.update(dict.fromkeys(cluster.nodes))
        self.check_safety()

    def settled(self) -> bool:
        """Every request has its outcome and every slot is back, as all machines see it."""
        cluster = self.cluster
        if any(cluster.decoders.decodes.values()) or next(cluster.open_streams(), None) is not None:
            return False
        if any(w.free_slots != w.config.slots for w in cluster.workers.values()):
            return False
        if self._stale_views():
            return False
        return not any(
            held for node in cluster.nodes.values() for _, held, _ in node.router.slot_usage()
        )

    def unsettled_reasons(self) -> list[str]:
        """What keeps the run from having settled, for the liveness violation."""
        cluster = self.cluster
        parts = []
        if cluster.unfinished():
            parts.append(f"requests without an outcome {cluster.unfinished()[:5]}")
        busy = [
            w for w, worker in cluster.workers.items() if worker.free_slots != worker.config.slots
        ]
        if busy:
            parts.append(f"workers with slots still taken {busy}")
        for node in cluster.nodes.values():
            held = [v.worker_id for v in node.router.statistics().workers if v.held]
            if held:
                parts.append(f"router {node.router_id!r} still counts slots on {held}")
        if stale := self._stale_views():
            parts.append(f"a router's view of workers is stale: {stale}")
        return parts

    def _stale_views(self) -> list[str]:
        """Workers a live router does not see as healthy at the epoch the worker serves
        it under (or at all, though the worker runs)."""
        cluster = self.cluster
        stale = []
        for router_id, node in cluster.nodes.items():
            actual = {w: worker.links().get(router_id) for w, worker in cluster.workers.items()}
            seen = set()
            for view in node.router.statistics().workers:
                seen.add(view.worker_id)
                if view.worker_id in actual and (
                    not view.healthy or view.epoch != actual[view.worker_id]
                ):
                    stale.append(
                        f"{view.worker_id} (router {router_id!r}: epoch {view.epoch}, "
                        f"healthy {view.healthy}; worker: epoch {actual[view.worker_id]})"
                    )
            stale += [f"{w} unknown to router {router_id!r}" for w in actual if w not in seen]
        return stale
