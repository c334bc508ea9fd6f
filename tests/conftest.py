"""Test configuration: quiet, deterministic, loopback-only distributed settings."""

import os
import uuid

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API server (moto) on loopback for the whole session; its endpoint URL."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(k, v)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    yield f"http://{host}:{port}"
    srv.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket: (name, fsspec storage options with explicit credentials, which rank
    processes need: they do not inherit this test's environment)."""
    import boto3

    bucket = f"hp-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return bucket, {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                    "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}}
