"""The rules every listener follows (elastic.control.listener_rules): loopback anything, off loopback a secret
unless the operator opts in, and a warning without TLS; docs/security.md lists every listener."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.control.listener_rules import (
    LISTENERS,
    MASTER_API,
    Auth,
    Listener,
    ListenerRuleError,
    check_listener,
    is_loopback_host,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "security.md"
OFF_LOOPBACK = ("0.0.0.0", "10.255.0.1", "::", "")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "127.0.0.2")
METRICS = Listener(name="the metrics endpoint", exposes="the job's metrics", token_hint="pass --token-file")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_allows_any_authentication_without_a_warning(host: str) -> None:
    assert is_loopback_host(host)
    for auth in Auth:
        assert check_listener(MASTER_API, host, auth=auth, tls=False) == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize("host", OFF_LOOPBACK)
@pytest.mark.parametrize("auth", [Auth.DERIVED, Auth.NONE])
def test_off_loopback_a_guessable_or_missing_token_is_refused(host: str, auth: Auth) -> None:
    assert not is_loopback_host(host)
    with pytest.raises(ListenerRuleError) as refused:
        check_listener(MASTER_API, host, auth=auth, tls=True)
    message = str(refused.value)
    assert "\n" not in message
    assert f"the job master API on {host} is not on this machine's loopback" in message
    assert "--token-file" in message and "ELASTIC_TOKEN" in message


@pytest.mark.timeout(10)
def test_the_refusal_names_the_opt_in_flag_and_the_opt_in_warns() -> None:
    with pytest.raises(ListenerRuleError, match="pass --metrics-insecure to accept that"):
        check_listener(METRICS, "0.0.0.0", auth=Auth.NONE, tls=True, insecure_flag="--metrics-insecure")
    warnings = check_listener(
        METRICS, "0.0.0.0", auth=Auth.NONE, tls=True, insecure=True, insecure_flag="--metrics-insecure"
    )
    assert warnings == [
        "the metrics endpoint on 0.0.0.0 has no token (--metrics-insecure): anyone who can reach it gets "
        "the job's metrics"
    ]


@pytest.mark.timeout(10)
def test_off_loopback_without_tls_warns_and_names_the_tls_flags() -> None:
    assert check_listener(MASTER_API, "0.0.0.0", auth=Auth.SECRET, tls=True) == []
    (warning,) = check_listener(MASTER_API, "0.0.0.0", auth=Auth.SECRET, tls=False)
    assert "without TLS" in warning and "token" in warning and "--tls-cert/--tls-key" in warning
    # A listener that cannot serve TLS names no flag; one without a token has no token to leak.
    (warning,) = check_listener(METRICS, "10.255.0.1", auth=Auth.NONE, tls=False, insecure=True)[1:]
    assert (
        warning
        == "the metrics endpoint on 10.255.0.1 serves without TLS: its data crosses the network in clear text"
    )


@pytest.mark.timeout(10)
def test_security_docs_list_every_listener() -> None:
    text = DOCS.read_text()
    for listener in LISTENERS:
        assert listener.name in text, f"docs/security.md does not name {listener.name!r}"
