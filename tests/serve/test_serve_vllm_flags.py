"""`kvmesh serve` started as a vLLM user starts `vllm serve`, as a real process:
`kvmesh serve MODEL --served-model-name smol --api-key k` on Ray serves `smol` behind the
key; `--local ... --ssl-certfile / --ssl-keyfile` serves the HTTP API over TLS (a
self-signed certificate made here with `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from serve_procs import free_port, start_serve, stop_serve

pytestmark = pytest.mark.timeout(600)
TINY = ["--threads", "1", "--block-size", "4", "--num-blocks", "128", "--max-model-len", "128"]


def test_serve_model_under_its_served_name_behind_the_key(tiny_llama, tmp_path):
    port, http_port = free_port(), free_port()
    s = start_serve([str(tiny_llama), "--served-model-name", "smol", "--api-key", "k", "--port", str(port),
                     "--http-port", str(http_port), *TINY], tmp_path / "serve.log")
    try:
        base = s.http
        key = {"Authorization": "Bearer k"}
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
        models = httpx.get(f"{base}/v1/models", headers=key, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
        body = {"model": "smol", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 401
        r = httpx.post(f"{base}/v1/completions", json=body, headers=key, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "smol" and r.json()["usage"]["completion_tokens"] == 4
        other = httpx.post(f"{base}/v1/completions", json={**body, "model": "kvmesh"}, headers=key, timeout=60)
        assert other.status_code == 404 and "`smol`" in other.json()["error"]["message"]
    finally:
        rc = stop_serve(s)
    assert rc == 0, s.log.read_text()[-3000:]
    assert "KVMESH_API_KEY" not in os.environ  # --api-key reached the servers, not this process


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_local_serve_over_tls_with_the_ssl_flags(tiny_llama, tmp_path):
    cert, key = _self_signed(tmp_path)
    http_port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", "--local", str(tiny_llama), "--prefill-replicas", "0",
             "--port", str(free_port()), "--http-port", str(http_port), "--ssl-certfile", str(cert),
             "--ssl-keyfile", str(key), *TINY], stdout=fh, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + 300
        while "Ctrl-C to stop" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        base = f"https://127.0.0.1:{http_port}"
        r = httpx.post(f"{base}/v1/completions", verify=ssl.create_default_context(cafile=str(cert)), timeout=120, json={
            "prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is refused
            httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # and the certificate is checked
            httpx.get(f"{base}/health", timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
