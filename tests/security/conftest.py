"""Fixtures of the security tests (helpers in sec_helpers.py)."""

from __future__ import annotations

import pytest
from sec_helpers import Certs, PasswordRedis, make_pair


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    tmp = tmp_path_factory.mktemp("certs")
    return Certs(*make_pair(tmp, "kvmesh"), *make_pair(tmp, "intruder"))


@pytest.fixture
def password_redis():
    server = PasswordRedis("s3cret-pass")
    yield server
    server.stop()
