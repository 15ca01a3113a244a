"""TLS of the master API: the master's server context, the agents' verifying client context, and the
one-line descriptions of TLS failures that the agent and ``elastic-master status`` print.

Stdlib only (the agent imports it before torch, the master before its web stack). The scheme follows one
rule: a client given a CA file (``--tls-ca``) speaks https to every master address and verifies the
master's certificate against that CA, host name included; a client without one speaks plain http.
"""

from __future__ import annotations

import re
import socket
import ssl

from elastic import errors

#: Default of ``--tls-ca`` (elastic-run, elastic-master status).
TLS_CA_ENV = "ELASTIC_TLS_CA"
#: Defaults of elastic-master's ``--tls-cert`` and ``--tls-key``.
TLS_CERT_ENV = "ELASTIC_TLS_CERT"
TLS_KEY_ENV = "ELASTIC_TLS_KEY"

# OpenSSL's reasons for a handshake that met plain text where a TLS record was expected: the peer speaks
# plain http (the reason's name changed across OpenSSL versions).
_PLAINTEXT_PEER = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})


class TLSConfigError(errors.UsageError, ValueError):
    """A certificate, key or CA file that cannot be used; the message is one line naming the file."""


def _reason(exc: BaseException) -> str:
    text = str(getattr(exc, "strerror", None) or exc)
    text = re.sub(r"\s*\(_ssl\.c:\d+\)", "", text)  # where in CPython's C code: noise to a user
    return " ".join(text.split()) or type(exc).__name__


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The master's context: TLS 1.2 or newer, serving ``cert_file`` (PEM, the chain after the leaf
    certificate) with the private key ``key_file`` (PEM, unencrypted: the master runs unattended)."""
    for what, path in (("certificate", cert_file), ("key", key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise TLSConfigError(f"cannot read TLS {what} file {path}: {_reason(exc)}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # A password callback that fails, so that an encrypted key is an error instead of a prompt.
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except _EncryptedKeyError:
        raise TLSConfigError(
            f"TLS key file {key_file} is encrypted; the master needs it unencrypted (keep it mode 0600)"
        ) from None
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TLSConfigError(
            f"cannot use TLS certificate {cert_file} with key {key_file}: {_reason(exc)} "
            "(expected PEM files, the key unencrypted and matching the certificate)"
        ) from None
    return context


class _EncryptedKeyError(ValueError):
    pass


def _no_password() -> str:
    raise _EncryptedKeyError


def client_context(ca_file: str) -> ssl.SSLContext:
    """A client context that trusts only the CA certificates in ``ca_file`` and checks host names."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verify_mode CERT_REQUIRED, check_hostname on
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cafile=ca_file)
    except FileNotFoundError as exc:
        raise TLSConfigError(f"cannot read TLS CA file {ca_file}: {_reason(exc)}") from None
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TLSConfigError(f"cannot use TLS CA file {ca_file}: {_reason(exc)} (expected PEM)") from None
    if not context.cert_store_stats()["x509"]:
        raise TLSConfigError(f"TLS CA file {ca_file} holds no certificate")
    return context


def find_ssl_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The :class:`ssl.SSLError` behind an HTTP client error (httpx wraps it in its own errors, as cause,
    context or argument), or None."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ssl.SSLError):
            return current
        pending.extend((current.__cause__, current.__context__))
        pending.extend(arg for arg in getattr(current, "args", ()) if isinstance(arg, BaseException))
    return None


def describe_tls_failure(exc: BaseException, address: str) -> str | None:
    """A one-line error for a TLS failure that retrying cannot fix (the certificate does not verify, the
    master speaks plain http), or None for any other error."""
    error = find_ssl_error(exc)
    if isinstance(error, ssl.SSLCertVerificationError):
        detail = (error.verify_message or _reason(error)).rstrip(".")
        if "mismatch" in detail:
            hint = "the master's certificate must name the host or IP address given in --master"
        elif "expired" in detail or "not yet valid" in detail:
            hint = "renew the master's certificate"
        else:
            hint = "--tls-ca must be the CA that signed the master's certificate"
        return f"the certificate of the master at {address} does not verify: {detail} ({hint})"
    if error is not None and getattr(error, "reason", None) in _PLAINTEXT_PEER:
        return (
            f"the master at {address} does not speak TLS (it was started without --tls-cert/--tls-key): "
            "drop --tls-ca and ELASTIC_TLS_CA, or give the master a certificate"
        )
    return None


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """True when ``host:port`` speaks TLS: it completes a handshake, or answers it with a TLS alert (a
    server that requires a client certificate, such as etcd with ``--client-cert-auth``). A probe that only
    explains why a plain request got no answer: it verifies nothing and sends no request (so no token)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, context.wrap_socket(raw):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(getattr(exc, "reason", None) or "")  # a TLS alert record came back
    except (OSError, ValueError):
        return False
