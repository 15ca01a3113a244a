"""Throwaway certificates made with the ``cryptography`` package (the ``test`` extra), for the tests
(tests/support/certs.py re-exports this module) and the benchmarks' ``--tls`` runs: certificate
authorities, server certificates (host names and IP addresses) and client certificates (a common name,
which etcd maps to a user), written as PEM files. Valid from five minutes ago for one day; EC P-256 keys."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

Key = ec.EllipticCurvePrivateKey

#: The names of this machine's loopback: a server certificate for them verifies for 127.0.0.1 and localhost.
LOCAL_NAMES: tuple[x509.GeneralName, ...] = (
    x509.DNSName("localhost"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
)


def _name(common_name: str) -> x509.Name:
    # An empty common name makes an empty subject (etcd's grpc-proxy wants one: see
    # tests/support/etcd_server.py).
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)] if common_name else [])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


@dataclass(frozen=True)
class CertAuthority:
    """A self-signed CA that issues server and client certificates."""

    key: Key
    cert: x509.Certificate

    @classmethod
    def create(cls, common_name: str) -> CertAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        )
        return cls(key, _validity(builder).sign(key, hashes.SHA256()))

    def issue(
        self,
        common_name: str,
        names: tuple[x509.GeneralName, ...] | list[x509.GeneralName] = (),
        *,
        server: bool = True,
        client: bool = False,
    ) -> tuple[Key, x509.Certificate]:
        """A leaf certificate for ``common_name``, valid for ``names`` (subject alternative names) as a
        server when ``server``, and as a client (mutual TLS) when ``client``."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] * server + [ExtendedKeyUsageOID.CLIENT_AUTH] * client
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        return key, _validity(builder).sign(self.key, hashes.SHA256())

    def write(self, path: Path) -> Path:
        """The CA certificate as a PEM file (what a verifying peer trusts)."""
        return write_cert(path, self.cert)

    def issue_files(
        self, folder: Path, stem: str, common_name: str, names=(), **usage: bool
    ) -> tuple[Path, Path]:
        """:meth:`issue`, written as ``folder/stem.pem`` and ``folder/stem.key``: ``(cert, key)``."""
        key, cert = self.issue(common_name, names, **usage)
        return write_cert(folder / f"{stem}.pem", cert), write_key(folder / f"{stem}.key", key)


def write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def write_key(path: Path, key: Key, password: bytes | None = None) -> Path:
    """The private key as PKCS#8 PEM, mode 0600; encrypted with ``password`` when given."""
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class LocalTLS:
    """The PEM files of a server on this machine's loopback: its CA (what clients trust), its certificate
    and its private key."""

    ca: Path
    cert: Path
    key: Path


def local_server_files(folder: Path) -> LocalTLS:
    """A fresh CA and a server certificate for 127.0.0.1 and localhost it signed, written in ``folder``
    (created): ``ca.pem``, ``server.pem`` and ``server.key`` (mode 0600)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = CertAuthority.create("elastic-run throwaway CA")
    cert, key = ca.issue_files(folder, "server", "127.0.0.1", LOCAL_NAMES)
    return LocalTLS(ca.write(folder / "ca.pem"), cert, key)
