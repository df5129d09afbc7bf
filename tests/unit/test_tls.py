"""Certificate issuance (wire/tls.py), checked with the standard library's ssl module.

    .venv/bin/python -m pytest -q tests/unit/test_tls.py

Each chain is verified by a real TLS handshake over a loopback socket between
`server_context` and `client_context`, so what passes here is what a learner will accept.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from ddiloco.wire import tls


@pytest.fixture(scope="module")
def ca() -> tls.KeyPair:
    return tls.issue_ca("ddiloco test CA", days=30)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, ca: tls.KeyPair) -> Path:
    d = tmp_path_factory.mktemp("tls")
    tls.write_pem(ca.cert_pem, d / "ca.crt")
    tls.write_pair(
        tls.issue_server(ca, ["localhost", "sync.job.svc"], ["127.0.0.1", "::1"]),
        d / "server.crt",
        d / "server.key",
    )
    tls.write_pair(tls.issue_client(ca, "learner-7"), d / "client.crt", d / "client.key")
    other = tls.issue_ca("another CA")
    tls.write_pem(other.cert_pem, d / "other-ca.crt")
    tls.write_pair(tls.issue_client(other, "intruder"), d / "intruder.crt", d / "intruder.key")
    return d


def handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str
) -> tuple[str | None, dict | None, BaseException | None]:
    """One TLS handshake over loopback: (ALPN chosen, client cert the server saw, server-side
    error). A client-side failure raises."""
    result: dict[str, object] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as s:
                    result["peer"] = s.getpeercert()
                    s.sendall(b"ok")
            except (ssl.SSLError, OSError) as e:
                result["error"] = e

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as s,
            ):
                alpn = s.selected_alpn_protocol()
                data = s.recv(2)  # TLS 1.3: a refused client certificate shows up here
                if data != b"ok":
                    raise ssl.SSLError(f"server closed the connection: {data!r}")
        finally:
            t.join(timeout=5)
    return alpn, result.get("peer"), result.get("error")  # type: ignore[return-value]


def test_ca_is_a_self_signed_ca(ca: tls.KeyPair) -> None:
    cert = ca.certificate
    assert cert.issuer == cert.subject and ca.common_name == "ddiloco test CA"
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca is True and bc.path_length == 0
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    cert.verify_directly_issued_by(cert)


def test_server_certificate_has_the_sans_and_serverauth(ca: tls.KeyPair) -> None:
    s = tls.issue_server(ca, ["localhost", "sync.ns.svc"], ["127.0.0.1", "::1"])
    assert s.dns_names == ["localhost", "sync.ns.svc"]
    assert s.ip_addresses == ["127.0.0.1", "::1"]
    assert s.common_name == "localhost"
    cert = s.certificate
    assert cert.issuer == ca.certificate.subject
    cert.verify_directly_issued_by(ca.certificate)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    only_ip = tls.issue_server(ca, [], ["10.0.0.5"])
    assert only_ip.dns_names == [] and only_ip.common_name == "10.0.0.5"
    with pytest.raises(ValueError):
        tls.issue_server(ca, [], [])
    with pytest.raises(ValueError):
        tls.issue_server(ca, ["x"], ["not-an-ip"])


def test_client_certificate_names_the_learner(ca: tls.KeyPair) -> None:
    c = tls.issue_client(ca, "home-3")
    assert c.common_name == "home-3" and c.dns_names == [] and c.ip_addresses == []
    eku = c.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    c.certificate.verify_directly_issued_by(ca.certificate)
    with pytest.raises(ValueError):
        tls.issue_client(ca, "")


def test_expiry(ca: tls.KeyPair) -> None:
    now = dt.datetime.now(dt.UTC)
    s = tls.issue_server(ca, ["localhost"], days=10)
    assert abs(s.not_after - (now + dt.timedelta(days=10))) < dt.timedelta(minutes=1)
    assert s.not_before <= now  # backdated a little for clock skew
    assert s.expires_within(dt.timedelta(days=11)) and not s.expires_within(dt.timedelta(days=9))
    # a leaf never outlives its CA (30 days here)
    long = tls.issue_client(ca, "l0", days=365)
    assert long.not_after == ca.not_after
    assert tls.issue_ca("x", days=2).not_after - now < dt.timedelta(days=2, minutes=1)
    with pytest.raises(ValueError):
        tls.issue_ca("x", days=0)


def test_pem_round_trip_and_mismatch(ca: tls.KeyPair, tmp_path: Path) -> None:
    c = tls.issue_client(ca, "l1")
    again = tls.KeyPair.from_pem(c.cert_pem.decode(), c.key_pem.decode())
    assert again == c and again.not_after == c.not_after
    other = tls.issue_client(ca, "l2")
    with pytest.raises(ValueError, match="does not match"):
        tls.KeyPair.from_pem(c.cert_pem, other.key_pem)
    cert_file, key_file = tls.write_pair(c, tmp_path / "a" / "l1.crt", tmp_path / "a" / "l1.key")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert_file.stat().st_mode) == 0o644
    assert tls.KeyPair.load(cert_file, key_file) == c
    # no temp files left behind
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["l1.crt", "l1.key"]
    assert b"PRIVATE KEY" in key_file.read_bytes() and b"ENCRYPTED" not in key_file.read_bytes()


def test_chain_verifies_with_ssl_and_negotiates_h2(files: Path) -> None:
    server = tls.server_context(files / "server.crt", files / "server.key")
    client = tls.client_context(files / "ca.crt")
    for name in ("localhost", "sync.job.svc", "127.0.0.1"):
        alpn, peer, err = handshake(server, client, name)
        assert (alpn, peer, err) == ("h2", None, None), name  # no client cert asked
    only_h1 = ssl.create_default_context(cafile=str(files / "ca.crt"))
    only_h1.set_alpn_protocols(["http/1.1"])
    assert handshake(server, only_h1, "localhost")[0] == "http/1.1"


def test_the_wrong_ca_or_name_is_refused(files: Path) -> None:
    server = tls.server_context(files / "server.crt", files / "server.key")
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        handshake(server, tls.client_context(files / "other-ca.crt"), "localhost")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        handshake(server, tls.client_context(files / "ca.crt"), "elsewhere.example.com")
    # the system trust store does not know a job's CA
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, tls.client_context(), "localhost")


def test_mutual_tls(files: Path) -> None:
    server = tls.server_context(
        files / "server.crt", files / "server.key", client_ca_file=files / "ca.crt"
    )
    good = tls.client_context(files / "ca.crt", files / "client.crt", files / "client.key")
    alpn, peer, err = handshake(server, good, "localhost")
    assert err is None and alpn == "h2"
    assert peer is not None and dict(x[0] for x in peer["subject"])["commonName"] == "learner-7"
    for client in (
        tls.client_context(files / "ca.crt"),  # no certificate
        tls.client_context(files / "ca.crt", files / "intruder.crt", files / "intruder.key"),
    ):
        with pytest.raises((ssl.SSLError, OSError)):
            handshake(server, client, "localhost")
    with pytest.raises(ValueError):
        tls.client_context(files / "ca.crt", cert_file=files / "client.crt")


def test_client_tls_files(files: Path) -> None:
    t = tls.ClientTLS(files / "ca.crt", files / "client.crt", files / "client.key")
    server = tls.server_context(files / "server.crt", files / "server.key", files / "ca.crt")
    assert handshake(server, t.context(), "localhost")[2] is None
    with pytest.raises(ValueError):
        tls.ClientTLS(ca_file="ca.crt", cert_file="c.crt")


def test_no_torch_import() -> None:
    # the operator image imports this module and has no torch
    import subprocess
    import sys

    code = "import sys, ddiloco.wire.tls, ddiloco.wire.auth; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
