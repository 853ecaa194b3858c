"""What outlives a request: stored responses and chat completions, the events of
live responses, and the leases of the routers running them (store.py's
StateStore, over SQLite or PostgreSQL: sql.py). `open_store` reads
`--state-store`."""

from adapters.state.sql import SqlStore
from adapters.state.store import (
    Gone,
    Record,
    StateStore,
    StoreLimits,
    StoreSpec,
    StoreUnavailable,
    parse_store,
)


def open_store(spec: StoreSpec, limits: StoreLimits | None = None) -> StateStore:
    """The store `spec` names (not yet opened: call `await store.open()`)."""
    return SqlStore(spec, limits or StoreLimits())


__all__ = [
    "Gone",
    "Record",
    "StateStore",
    "StoreLimits",
    "StoreUnavailable",
    "open_store",
    "parse_store",
]
