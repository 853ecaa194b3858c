"""A worker in the controller's own process, joined to it without a socket.

Router -> worker messages go through a bounded Mailbox pumped into the host
(so carrying out the router's effects never re-enters the worker machine);
worker -> router messages are handed to the controller directly, which queues
them if it is busy. The embedded default (`fencepost serve` with no remote
workers) is one of these with the torch engine as its decoder.
"""

from __future__ import annotations

import msgspec
import trio

from adapters.runtime.controller import Controller
from adapters.runtime.loop import Mailbox
from adapters.runtime.worker_host import Decoder, WorkerHost
from core.protocol import FromWorker, ToWorker
from core.worker import WorkerConfig

LOCAL_QUEUE_MESSAGES = 65_536


class LocalLink:
    def __init__(
        self, worker_id: str, epoch: int, router_id: str = "", limit: int = LOCAL_QUEUE_MESSAGES
    ) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.router_id = router_id
        self.inbox: Mailbox[ToWorker] = Mailbox(limit)

    def send(self, message: ToWorker) -> bool:
        return self.inbox.put(message)

    def close(self, reason: str) -> None:
        self.inbox.close()

    async def pump(self, host: WorkerHost) -> None:
        while True:
            try:
                batch = await self.inbox.take()
            except trio.EndOfChannel:
                return
            for message in batch:
                host.from_router(message, self.router_id)


async def run_local_worker(
    controller: Controller,
    config: WorkerConfig,
    decoder: Decoder,
    *,
    task_status: trio.TaskStatus[WorkerHost] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as an in-process worker until cancelled; reports its WorkerHost when up."""

    def uplink(message: FromWorker, router_id: str) -> None:
        controller.from_worker(config.worker_id, message)  # the one router there is

    registration = controller.register(config.worker_id)
    if registration.epoch is None:
        raise ValueError(registration.reason)
    # Linked from the start to this router, under its id: its assignments name it.
    router_id = controller.router.config.router_id
    config = msgspec.structs.replace(config, epoch=registration.epoch, router=router_id)
    link = LocalLink(config.worker_id, config.epoch, router_id)
    host = WorkerHost(config, decoder, uplink)
    if not controller.attach(link):
        raise ValueError(f"worker {config.worker_id!r} is already attached at a newer epoch")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(decoder.run, host.on_decoder_events)
            nursery.start_soon(link.pump, host)
            await nursery.start(host.run)
            task_status.started(host)
    finally:
        host.stop_all()
        controller.detach(link, "worker stopped")
