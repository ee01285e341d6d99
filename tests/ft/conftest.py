"""Fixtures for megascale-ft tests: an S3 endpoint (moto's server on loopback) and fresh buckets.

A copy of the pattern in tests/data/conftest.py (test packages do not import each other's fixtures):
`s3_server` is one server for the session, `s3_bucket` a new empty bucket on it per test.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# Variables that would send requests elsewhere or pick other credentials.
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
_bucket_numbers = itertools.count()


class S3Server:
    """A moto S3 server on 127.0.0.1 (threaded, in this process; spawned ranks reach it over loopback)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server: Any = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this endpoint."""
        return {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "testing", "secret": "testing"}

    def fs(self) -> Any:
        """A fresh (uncached) s3fs filesystem on this endpoint."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session")
def s3_env() -> Iterator[None]:
    """Test credentials and region in the environment for the session, restored afterwards."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _CREDENTIALS.items():
            mp.setenv(name, value)
        for name in _UNSET:
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def s3_server(s3_env: None) -> Iterator[S3Server]:
    """One moto S3 server for the session."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new, empty bucket on `s3_server`; returns its name."""
    name = f"ft-{os.getpid()}-{next(_bucket_numbers)}"
    s3_server.fs().call_s3("create_bucket", Bucket=name)
    return name
