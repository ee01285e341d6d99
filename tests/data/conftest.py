"""Fixtures for megascale-data tests: the shared S3 endpoint (see tests/_s3.py)."""

from tests._s3 import S3Server, s3_bucket, s3_env, s3_outage_server, s3_server

__all__ = ["S3Server", "s3_bucket", "s3_env", "s3_outage_server", "s3_server"]
