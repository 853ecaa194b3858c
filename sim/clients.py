"""The clients and the load balancer in front of the routers.

Each client sends one request (its prompt from sim/scenario.py's
`draw_prompt`, its budget, sampling and logprobs drawn from the
`{seed}/clients` and `{seed}/logprobs` streams) at a time drawn over the
arrival window, and some cancel it, at once or a while later. The load
balancer hands each arrival to the router whose turn it is, or the next live
one; with every router down it tries again a moment later. A client whose
router died sends its request again through the balancer (`send_again`).
"""

from __future__ import annotations

from random import Random

from core.protocol import GenerationRequest, Sampling
from sim.cluster import Cluster
from sim.scenario import Scenario, Swarm, draw_prompt
from sim.stage import Stage
from sim.timeline import request_key


class Clients:
    def __init__(
        self,
        stage: Stage,
        cluster: Cluster,
        scenario: Scenario,
        swarm: Swarm,
        rng: Random,
        logprobs_rng: Random,
    ) -> None:
        self.stage = stage
        self.clock = stage.clock
        self.disturbances = stage.disturbances
        self.cluster = cluster
        self.scenario = scenario
        self.swarm = swarm
        self._rng = rng
        self._logprobs_rng = logprobs_rng  # its own: the other draws stay put
        self.pending = 0  # arrivals (and cut clients' retries) still to come
        self._placed: dict[int, tuple[str, str]] = {}  # client -> (router id, request id)
        self.retries = 0  # requests sent again after their router died

    def plan(self) -> None:
        """Every client's arrival (and, for some, its cancel), drawn and scheduled."""
        rng = self._rng
        scenario = self.scenario
        t = 0.0
        mean_gap = scenario.arrival_window_s / scenario.requests
        for index in range(scenario.requests):
            t += rng.expovariate(1.0 / mean_gap)
            t = min(t, scenario.arrival_window_s)
            prompt = draw_prompt(rng)
            mean, spread = scenario.mean_new_tokens, scenario.mean_new_tokens // 2
            max_new = rng.randint(mean - spread, mean + spread)
            seed = rng.randrange(2**32) if rng.random() < 0.7 else None
            temperature = rng.choice((0.0, 0.7))
            asks = self._logprobs_rng
            logprobs = asks.choice((0, 1, 5, 20)) if asks.random() < 0.3 else None
            request = GenerationRequest(
                f"r{index}",
                prompt,
                max(1, max_new),
                Sampling(temperature, 1.0, seed),
                logprobs=logprobs,
            )
            self.pending += 1
            self.clock.schedule(t, self._arrive, index, request)
            if rng.random() < self.swarm.cancel_rate:
                # Some clients give up at once (a stop button, a short client timeout),
                # often while the offer is still on its way; the rest at any moment.
                after = rng.uniform(0.0, 0.1) if rng.random() < 0.3 else rng.uniform(0.0, 3.0)
                self.clock.schedule(t + after, self._cancel, index)

    def _arrive(self, client: int, request: GenerationRequest) -> None:
        """A client's request reaches the load balancer, which sends it to the router
        whose turn it is, or the next live one; with every router down it tries again
        a moment later."""
        cluster = self.cluster
        live = cluster.live_routers()
        if not live:
            self.clock.schedule(self.clock.now + 0.1, self._arrive, client, request)
            return
        self.pending -= 1
        if not cluster.shared:
            router_id = live[0]
        else:
            names = cluster.router_names
            turn = client % len(names)
            places = {cluster.nodes[r].name: r for r in live}
            router_id = next(
                places[names[(turn + k) % len(names)]]
                for k in range(len(names))
                if names[(turn + k) % len(names)] in places
            )
            # Each router numbers its own requests: ids collide across routers.
            node = cluster.nodes[router_id]
            request = request.renamed(node.new_request_id())
        self._placed[client] = (router_id, request.request_id)
        if self.stage.timeline is not None:
            place = cluster.router_place(router_id)
            self.stage.timeline.arrived(
                request_key(router_id, request.request_id), client, place, self.clock.now
            )
        cluster.submit(request, router_id)

    def _cancel(self, client: int) -> None:
        placed = self._placed.get(client)
        if placed is None:
            return  # not sent yet (every router was down): it gives up before it starts
        router_id, request_id = placed
        if not self.cluster.has_outcome(request_id, router_id):
            self.disturbances.note("client_cancel")
            self.cluster.cancel(request_id, router_id)

    def send_again(self, at: float, request: GenerationRequest) -> None:
        """A client whose router died sends its request again (as a new client: its
        cancel, if any, is not sent again)."""
        self.pending += 1
        self.retries += 1
        client = -self.retries
        self.clock.schedule(at, self._arrive, client, request)
