"""Fixtures of the security tests (helpers in sec_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sec_helpers import Certs, make_pair

# The KV store tests' real redis-server helper (tests/kvstore/redis_procs.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvstore"))
from redis_procs import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    tmp = tmp_path_factory.mktemp("certs")
    return Certs(*make_pair(tmp, "kvmesh"), *make_pair(tmp, "intruder"))


@pytest.fixture
def password_redis():
    server = RedisServer(password="s3cret-pass")
    yield server
    server.stop()
