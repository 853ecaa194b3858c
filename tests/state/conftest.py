"""The state store's tests run on a real PostgreSQL server too: its fixtures
(tests/support/postgres.py), registered here by name."""

from tests.support.postgres import postgres_database, postgres_server, postgres_url

__all__ = ["postgres_database", "postgres_server", "postgres_url"]
