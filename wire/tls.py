"""Certificates for TLS between learners and the synchronizer: encrypted wherever a link leaves
the cluster.

A job gets its own small CA; the synchronizer gets a server certificate signed by it
and, for mutual TLS, each learner a client certificate (CN = learner id). The operator
and `ddiloco local --tls` issue them with the functions here, so this module imports
only the standard library and `cryptography` (no torch: the operator image imports it).

    ca = issue_ca("ddiloco job demo")
    server = issue_server(ca, ["sync.demo.svc", "localhost"], ["127.0.0.1"])
    client = issue_client(ca, "learner-0")
    write_pair(server, run_dir / "server.crt", run_dir / "server.key")  # key file 0600
    ctx = server_context(cert_file, key_file, client_ca_file=ca_file)    # mTLS on

API (stable: the operator codes against these names):

- `KeyPair(cert_pem, key_pem)`: a PEM certificate and its PKCS#8 private key (unencrypted).
  `.not_after` (aware UTC datetime), `.common_name`, `.dns_names`, `.ip_addresses`,
  `KeyPair.from_pem(cert_pem, key_pem)` (checks that the key matches the certificate),
  `KeyPair.load(cert_file, key_file)`.
- `issue_ca(common_name, days=365) -> KeyPair`: self-signed CA (EC P-256, path length 0).
- `issue_server(ca, dns_names, ip_addresses=(), days=365) -> KeyPair`: serverAuth,
  subjectAltName with the given DNS names and IP addresses; CN = the first name.
- `issue_client(ca, name, days=365) -> KeyPair`: clientAuth, CN = name (the learner id).
- `write_pair(pair, cert_file, key_file)`, `write_pem(data, path, private=False)`: write
  PEM files, the key (and any `private=True` file) with mode 0600, atomically.
- `server_context(cert_file, key_file, client_ca_file=None, alpn=ALPN_PROTOCOLS)
  -> ssl.SSLContext`: TLS >= 1.2, ALPN h2 + http/1.1; with `client_ca_file` a client
  certificate is required and verified.
- `ClientTLS(ca_file=None, cert_file=None, key_file=None)`: the client's files, as
  `SyncClient(..., tls=ClientTLS(...))` takes them; `.context()` gives `client_context(...)`.
- `client_context(ca_file=None, cert_file=None, key_file=None) -> ssl.SSLContext`: verifies
  the server against `ca_file` (the system trust store without it), hostname checked,
  ALPN h2 + http/1.1, optional client certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ALPN_PROTOCOLS = ["h2", "http/1.1"]
# Backdate notBefore a little so a peer whose clock is slightly behind accepts a fresh cert.
_CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS files for an https synchronizer URL (SyncClient's `tls=`): the CA to
    verify the server against (None: the system trust store) and an optional client
    certificate and key (mutual TLS). Paths only, so it is cheap to pass around."""

    ca_file: str | os.PathLike[str] | None = None
    cert_file: str | os.PathLike[str] | None = None
    key_file: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both its cert file and its key file")

    def context(self) -> ssl.SSLContext:
        """The same settings as an `ssl.SSLContext` (for Python clients)."""
        return client_context(self.ca_file, self.cert_file, self.key_file)


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its unencrypted PKCS#8 private key."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def from_pem(cls, cert_pem: bytes | str, key_pem: bytes | str) -> KeyPair:
        """Parse both and check that the key belongs to the certificate (ValueError if not)."""
        cert_b = cert_pem.encode() if isinstance(cert_pem, str) else bytes(cert_pem)
        key_b = key_pem.encode() if isinstance(key_pem, str) else bytes(key_pem)
        cert = x509.load_pem_x509_certificate(cert_b)
        key = serialization.load_pem_private_key(key_b, password=None)
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        enc = serialization.Encoding.DER
        if key.public_key().public_bytes(enc, pub) != cert.public_key().public_bytes(enc, pub):
            raise ValueError("the private key does not match the certificate")
        return cls(cert_b, key_b)

    @classmethod
    def load(cls, cert_file: str | os.PathLike[str], key_file: str | os.PathLike[str]) -> KeyPair:
        return cls.from_pem(Path(cert_file).read_bytes(), Path(key_file).read_bytes())

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    def private_key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("expected an EC private key")
        return key

    @property
    def not_after(self) -> dt.datetime:
        """Expiry, an aware UTC datetime."""
        return self.certificate.not_valid_after_utc

    @property
    def not_before(self) -> dt.datetime:
        return self.certificate.not_valid_before_utc

    @property
    def common_name(self) -> str:
        attrs = self.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(attrs[0].value) if attrs else ""

    def _san(self) -> x509.SubjectAlternativeName | None:
        try:
            return self.certificate.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value
        except x509.ExtensionNotFound:
            return None

    @property
    def dns_names(self) -> list[str]:
        san = self._san()
        return list(san.get_values_for_type(x509.DNSName)) if san else []

    @property
    def ip_addresses(self) -> list[str]:
        san = self._san()
        return [str(a) for a in san.get_values_for_type(x509.IPAddress)] if san else []

    def expires_within(self, delta: dt.timedelta, now: dt.datetime | None = None) -> bool:
        """True when the certificate expires before `now + delta` (renewal check)."""
        now = now or dt.datetime.now(dt.UTC)
        return self.not_after <= now + delta


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    # RFC 5280 caps a common name at 64 characters; it only labels the certificate (the
    # SANs carry the identity), so a long job or namespace name is cut, not refused.
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    if days < 1:
        raise ValueError("days must be >= 1")
    now = dt.datetime.now(dt.UTC)
    return now - _CLOCK_SKEW, now + dt.timedelta(days=days)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def issue_ca(common_name: str, days: int = 365) -> KeyPair:
    """A self-signed CA certificate and key (EC P-256), allowed to sign leaf certificates only."""
    key = _new_key()
    start, end = _validity(days)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _issue_leaf(
    ca: KeyPair,
    common_name: str,
    usage: x509.ObjectIdentifier,
    san: list[x509.GeneralName],
    days: int,
) -> KeyPair:
    ca_cert = ca.certificate
    ca_key = ca.private_key()
    key = _new_key()
    start, end = _validity(days)
    # A leaf never outlives its CA (verifiers would refuse the chain after the CA expires).
    end = min(end, ca_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_server(
    ca: KeyPair,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str] = (),
    days: int = 365,
) -> KeyPair:
    """A serverAuth certificate for the synchronizer with these DNS and IP subjectAltNames."""
    dns = [str(n) for n in dns_names]
    ips = [ipaddress.ip_address(a) for a in ip_addresses]
    if not dns and not ips:
        raise ValueError("a server certificate needs at least one DNS name or IP address")
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    san += [x509.IPAddress(a) for a in ips]
    cn = dns[0] if dns else str(ips[0])
    return _issue_leaf(ca, cn, ExtendedKeyUsageOID.SERVER_AUTH, san, days)


def issue_client(ca: KeyPair, name: str, days: int = 365) -> KeyPair:
    """A clientAuth certificate for mutual TLS; CN = `name` (the learner id)."""
    if not name:
        raise ValueError("a client certificate needs a name")
    return _issue_leaf(ca, name, ExtendedKeyUsageOID.CLIENT_AUTH, [], days)


def write_pem(data: bytes, path: str | os.PathLike[str], private: bool = False) -> Path:
    """Write `data` to `path` atomically (temp file + rename); mode 0600 if private else 0644."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_pair(
    pair: KeyPair, cert_file: str | os.PathLike[str], key_file: str | os.PathLike[str]
) -> tuple[Path, Path]:
    """Write the certificate (0644) and the key (0600)."""
    return write_pem(pair.cert_pem, cert_file), write_pem(pair.key_pem, key_file, private=True)


def server_context(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    client_ca_file: str | os.PathLike[str] | None = None,
    alpn: Sequence[str] = ALPN_PROTOCOLS,
) -> ssl.SSLContext:
    """Server side: TLS >= 1.2, ALPN `alpn` (h2 + http/1.1); mTLS (client cert required and
    verified) with `client_ca_file`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(os.fspath(cert_file), os.fspath(key_file))
    ctx.set_alpn_protocols(list(alpn))
    if client_ca_file is not None:
        ctx.load_verify_locations(cafile=os.fspath(client_ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    ca_file: str | os.PathLike[str] | None = None,
    cert_file: str | os.PathLike[str] | None = None,
    key_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """Client side: verify the server (against `ca_file`, else the system store), check the
    hostname, ALPN h2 + http/1.1, and present a client certificate when one is given."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=os.fspath(ca_file) if ca_file is not None else None
    )
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(ALPN_PROTOCOLS)
    if cert_file is not None and key_file is not None:
        ctx.load_cert_chain(os.fspath(cert_file), os.fspath(key_file))
    return ctx
