"""elastic.inprocess.pg_control: releasing and dropping a broken group, per backend, through a fake DistApi
(the
NCCL path is not run on a GPU here), and the gloo release on real sockets."""

from __future__ import annotations

import os
import socket
import threading

from elastic.contract import NCCL_ASYNC_ERROR_HANDLING
from elastic.inprocess.pg_control import NCCL_CLEANUP_ONLY, GroupControl, shutdown_inet_sockets, socket_links


class FakeDist:
    """Records the calls; ``abort`` forgets the group, as torch's ``_abort_process_group`` does."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.formed = False

    def is_initialized(self) -> bool:
        return self.formed

    def init(self, backend: str, connect_timeout_s: float | None) -> None:
        self.calls.append(f"init {backend}")
        self.formed = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.formed = False

    def destroy(self) -> None:
        self.calls.append("destroy")
        self.formed = False

    def forget_failed_init(self) -> None:
        self.calls.append("forget")


def test_nccl_forms_with_cleanup_only_error_handling_and_is_aborted_once(monkeypatch) -> None:
    monkeypatch.setenv(NCCL_ASYNC_ERROR_HANDLING, "1")
    api = FakeDist()
    control = GroupControl("nccl", api, links=dict)
    control.form()
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING] == NCCL_CLEANUP_ONLY, (
        "the watchdog must not kill the process"
    )
    control.release()  # from the link thread, while the training thread is blocked
    control.release()
    control.drop()
    assert api.calls == ["init nccl", "abort"], "aborted once; an aborted group is not destroyed again"
    control.form()
    control.drop()  # a healthy group that must go (a node joins): still aborted, never destroyed
    assert api.calls == ["init nccl", "abort", "init nccl", "abort"]


def test_drop_without_a_group_does_nothing() -> None:
    for backend in ("nccl", "gloo"):
        api = FakeDist()
        GroupControl(backend, api, links=dict).drop()
        assert api.calls == []


def test_gloo_drop_releases_then_destroys() -> None:
    api = FakeDist()
    control = GroupControl("gloo", api, links=dict)
    control.form()
    control.drop()
    assert api.calls == ["init gloo", "destroy"]


def test_gloo_release_wakes_a_receive_blocked_on_a_silent_peer_and_spares_other_sockets() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    mine = socket.create_connection(("127.0.0.1", port))  # the script's own socket, from before the group
    kept_peer, _ = listener.accept()
    group_socks: list[socket.socket] = []
    peers: list[socket.socket] = []

    class MeshDist(FakeDist):
        def init(self, backend: str, connect_timeout_s: float | None) -> None:  # gloo's full mesh forms
            super().init(backend, connect_timeout_s)
            group_socks.append(socket.create_connection(("127.0.0.1", port)))
            peers.append(listener.accept()[0])

    control = GroupControl("gloo", MeshDist(), links=socket_links)
    control.form()
    got: list[bytes] = []
    blocked = threading.Thread(target=lambda: got.append(group_socks[0].recv(1)))
    blocked.start()  # the peer never answers nor closes: as a SIGSTOPped process
    control.release()
    blocked.join(5)
    assert not blocked.is_alive() and got == [b""], "the blocked receive saw end-of-file"
    mine.sendall(b"x")
    assert kept_peer.recv(1) == b"x", "a socket from before the group is untouched"
    for s in (listener, mine, kept_peer, *group_socks, *peers):
        s.close()


def test_a_descriptor_reused_since_is_not_shut_down() -> None:
    a, b = socket.socketpair()
    stale = {a.fileno(): "socket:[0]"}  # the inode it had is gone
    assert shutdown_inet_sockets(stale) == 0
    a.sendall(b"y")
    assert b.recv(1) == b"y"
    a.close()
    b.close()


def test_a_release_during_the_formation_wakes_its_wait_and_the_failed_init_is_forgotten() -> None:
    """A round whose member never comes leaves the others in their formation, waiting on the rendezvous
    store: the next round's pause must wake them (the connections opened since the formation began are
    shut down), and torch's numbering of the group that never formed is reset for the next formation."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    mine = socket.create_connection(("127.0.0.1", port))  # the script's own socket, from before
    kept_peer, _ = listener.accept()
    waiting = threading.Event()
    opened: list[socket.socket] = []

    class StoreWaitDist(FakeDist):
        def init(self, backend: str, connect_timeout_s: float | None) -> None:
            client = socket.create_connection(("127.0.0.1", port))  # the store's connection
            opened.extend((client, listener.accept()[0]))
            waiting.set()
            if client.recv(1) == b"":  # the missing rank's key never comes
                raise RuntimeError("the store closed the connection")
            super().init(backend, connect_timeout_s)

    api = StoreWaitDist()
    control = GroupControl("gloo", api, links=socket_links)
    failed: list[BaseException] = []

    def form() -> None:
        try:
            control.form()
        except RuntimeError as exc:
            failed.append(exc)

    forming = threading.Thread(target=form)
    forming.start()
    assert waiting.wait(10)
    control.release()
    forming.join(10)
    assert not forming.is_alive() and len(failed) == 1, "the formation raised"
    assert api.calls == ["forget"], "the failed init was forgotten"
    mine.sendall(b"x")
    assert kept_peer.recv(1) == b"x", "a socket from before the formation is untouched"
    for s in (listener, mine, kept_peer, *opened):
        s.close()
