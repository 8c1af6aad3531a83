"""A real redis-server on a free loopback port, started and killed by the tests."""

from __future__ import annotations


import pytest


from redis_procs import RedisServer, free_port  # noqa: F401


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()
