"""An S3 endpoint for tests: moto's server on loopback, test credentials, fresh buckets.

Shared by tests/data and tests/ft, whose conftest.py files re-export these fixtures. `s3_server` is one
server for the session; tests that take S3 down use `s3_outage_server`, their own server on its own port,
which `stop()` and `start()` (same port) control. moto keeps its buckets in the process, so both servers
see the same data; spawned ranks reach them over loopback.
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
    """A moto S3 server on 127.0.0.1 that can be stopped and started again on the same port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        self._server: Any = None
        self.port = 0
        self.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this endpoint (what `Source.storage_options` takes)."""
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing"}

    def fs(self, **options: Any) -> Any:
        """A fresh (uncached) s3fs filesystem on this endpoint."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **{**self.storage_options, **options})

    def start(self) -> None:
        """Start serving (again, on the same port once one was chosen)."""
        assert self._server is None, "already running"
        self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    def stop(self) -> None:
        """Stop serving: connections to the port are refused until `start()`."""
        if self._server is not None:
            self._server.stop()
            self._server = None


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
    """One moto S3 server for the session; do not stop it (use `s3_outage_server`)."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_outage_server(s3_env: None) -> Iterator[S3Server]:
    """A moto S3 server of this test's own, free to `stop()` and `start()`."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new, empty bucket on `s3_server`; returns its name."""
    name = f"test-{os.getpid()}-{next(_bucket_numbers)}"
    s3_server.fs().call_s3("create_bucket", Bucket=name)
    return name
