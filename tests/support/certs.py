"""Test certificates: the ``cryptography``-made CAs, server and client certificates of bench/tls_certs.py
(one implementation, shared with the benchmarks' ``--tls`` runs), under the names the tests import."""

from __future__ import annotations

from bench.tls_certs import LOCAL_NAMES, CertAuthority, Key, write_cert, write_key

__all__ = ["LOCAL_NAMES", "CertAuthority", "Key", "write_cert", "write_key"]
