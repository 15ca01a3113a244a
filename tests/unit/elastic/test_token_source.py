"""Token rotation (elastic.control.token_source): which tokens a listener accepts at a time (the pure
:class:`TokenWindow`, with times given), and a watched token file replaced as Kubernetes replaces a Secret
(a new file renamed over the old one, or the ``..data`` symlink swapped), with a fake clock; the master's
gate applying it (master.http.gatekeeper.check_access); and what a client tries after a 401."""

from __future__ import annotations

import os
from pathlib import Path

from elastic.control.token_source import POLL_S, TokenWindow, WatchedToken
from master.http.gatekeeper import check_access
from master.http.rate_limits import PeerFailureLimiter

OLD, NEW, NEWER = "old-token-" + "o" * 20, "new-token-" + "n" * 20, "newer-token-" + "w" * 20
GRACE = 4.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replace(path: Path, token: str) -> None:
    """Write ``token`` to a file beside ``path`` and rename it over ``path`` (atomic, a new inode)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(token + "\n")
    os.replace(tmp, path)


def test_the_window_accepts_the_new_token_and_the_previous_one_for_the_grace_only() -> None:
    window = TokenWindow(OLD, GRACE)
    assert window.accepts(OLD.encode(), 0.0) and not window.accepts(NEW.encode(), 0.0)
    assert window.rotate(NEW, 10.0)
    assert window.accepts(NEW.encode(), 10.0)
    assert window.accepts(OLD.encode(), 10.0) and window.accepts(OLD.encode(), 10.0 + GRACE - 0.01)
    assert not window.accepts(OLD.encode(), 10.0 + GRACE)  # the grace is over
    assert window.accepts(NEW.encode(), 10.0 + GRACE)
    assert not window.accepts(b"", 10.0) and not window.accepts(b"wrong", 10.0)


def test_the_same_token_again_is_no_rotation_and_a_second_one_drops_the_first() -> None:
    window = TokenWindow(OLD, GRACE)
    assert not window.rotate(OLD, 5.0)
    assert not window.accepts(b"", 5.0)  # no previous token: an empty one is not it
    window.rotate(NEW, 5.0)
    window.rotate(NEWER, 6.0)
    assert window.accepts(NEWER.encode(), 6.0) and window.accepts(NEW.encode(), 6.0)
    assert not window.accepts(OLD.encode(), 6.0)  # only one previous token is kept


def test_a_replaced_file_is_followed_after_the_poll_period_and_reported_once(tmp_path: Path) -> None:
    path, clock = tmp_path / "token", FakeClock()
    path.write_text(OLD + "\n")
    watched = WatchedToken(OLD, str(path), GRACE, clock=clock)
    replace(path, NEW)
    clock.now += POLL_S
    assert watched.accepts(NEW.encode()) and watched.current == NEW
    assert watched.accepts(OLD.encode())  # within the grace
    clock.now += GRACE
    assert not watched.accepts(OLD.encode()) and watched.accepts(NEW.encode())
    news = watched.take_news()
    assert [kind for kind, _ in news] == ["rotated"]
    assert NEW not in news[0][1] and OLD not in news[0][1]  # the message never carries a token
    assert watched.take_news() == []


def test_a_refused_token_looks_at_a_changed_file_at_once(tmp_path: Path) -> None:
    """A client that read the new token before the listener polled is not refused for the poll period."""
    path, clock = tmp_path / "token", FakeClock()
    path.write_text(OLD + "\n")
    watched = WatchedToken(OLD, str(path), GRACE, clock=clock)
    assert not watched.accepts(NEW.encode())  # the file is unchanged: refused, nothing read
    replace(path, NEW)
    assert watched.accepts(NEW.encode())  # no time passed: the stat told the file changed
    failures = PeerFailureLimiter(clock=clock)
    headers = {b"authorization": f"Bearer {OLD}".encode(), b"x-elastic-job": b"j"}
    assert check_access(headers, "10.0.0.1", watched, "j", failures) is None  # the gate: previous, in grace
    clock.now += GRACE
    refusal = check_access(headers, "10.0.0.1", watched, "j", failures)
    assert refusal is not None and refusal.status == 401


def test_a_kubernetes_secret_volume_swap_of_the_data_symlink_is_followed(tmp_path: Path) -> None:
    """The kubelet writes a new timestamped folder and renames a ``..data`` symlink over the old one; the
    token file is a symlink to ``..data/token`` that never changes itself."""
    volume, clock = tmp_path / "secret", FakeClock()
    volume.mkdir()
    (volume / "..2026_01_01_a").mkdir()
    (volume / "..2026_01_01_a" / "token").write_text(OLD)
    os.symlink("..2026_01_01_a", volume / "..data")
    os.symlink("..data/token", volume / "token")
    watched = WatchedToken(OLD, str(volume / "token"), GRACE, clock=clock)
    (volume / "..2026_01_01_b").mkdir()
    (volume / "..2026_01_01_b" / "token").write_text(NEW)
    os.symlink("..2026_01_01_b", volume / "..data_tmp")
    os.replace(volume / "..data_tmp", volume / "..data")
    assert watched.accepts(NEW.encode())


def test_an_unusable_file_keeps_the_token_and_says_so_once(tmp_path: Path) -> None:
    path, clock = tmp_path / "token", FakeClock()
    path.write_text(OLD + "\n")
    watched = WatchedToken(OLD, str(path), GRACE, clock=clock)
    for content in ("", "", "short"):
        replace(path, content)
        clock.now += POLL_S
        assert not watched.poll()
        assert watched.accepts(OLD.encode())
    path.unlink()
    clock.now += POLL_S
    assert watched.accepts(OLD.encode())
    assert [kind for kind, _ in watched.take_news()] == ["unusable"] * 3  # empty, too short, missing


def test_a_client_after_a_401_tries_the_new_token_then_the_previous_one(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    client_side = WatchedToken(OLD, str(path), 0.0, clock=FakeClock())
    assert client_side.alternatives(OLD) == []  # the file still holds the refused token: the 401 is final
    replace(path, NEW)
    assert client_side.alternatives(OLD) == [NEW]  # read at once, whatever the poll period
    # The new token refused too: the master has not seen the change yet, the previous token may still work.
    assert client_side.alternatives(NEW) == [OLD]
    assert WatchedToken(OLD, None, 0.0).alternatives(OLD) == []  # ELASTIC_TOKEN: nothing to re-read
