"""Progress signals without user code: the hooks elastic-run installs in every worker before its script runs.

For a script that never calls :func:`elastic.report` (an unmodified torchrun script) the agent still needs
to see progress, for the adaptive hang bound (:mod:`agent.observe.hang_policy`) and the master's step-based
figures. :func:`install` registers, with torch's public global hooks:

* an optimizer-step post hook (``torch.optim.optimizer.register_optimizer_step_post_hook``): the step
  signal. Each optimizer step counts; an ``auto`` datagram with the count is sent at most every
  :data:`STEP_INTERVAL_S` (a 50 ms step sends one per step, faster steps are batched);
* a module forward hook (``torch.nn.modules.module.register_module_forward_hook``): the sign of life, so
  that an evaluation pass (forward passes, no optimizer step) is not a hang while a Python loop that runs
  no model is. A global forward hook makes every module call take torch's slow path (about 2 us each,
  measured by bench/hangs.py), so it is armed only one call at a time: it removes itself when it fires
  (sending a ``life`` datagram) and a daemon thread re-arms it every :data:`LIFE_INTERVAL_S`;
* a wrapper of ``torch.save`` that reports a save's start and end (``save``/``saved``): a checkpoint save
  is not a hang. :func:`save_started` is the same signal for ``elastic.save``, whose ``ckpt`` report ends it.

Scripts that call :func:`elastic.report` keep working: the agent counts their explicit steps and takes
``auto`` reports as signs of life only. Sends never block and never raise (progress is advisory); without
``ELASTIC_AGENT_SOCKET`` (no agent) nothing is installed.

Where it is installed: the warm-start zygote calls :func:`install` in each forked worker (torch is
imported); on the exec path a ``sitecustomize`` in :data:`SITE_DIR` (first on the worker's ``PYTHONPATH``,
see :func:`with_site_path`) calls it before the script runs, chaining to any other ``sitecustomize``. There
torch is not imported yet (the script may set variables that torch reads at import), so a daemon thread
waits for the script's own ``import torch`` and registers the hooks then. The worker's environment stays
exactly what the agent set (``PYTHONPATH`` included). A child the worker forks (data loader workers) turns
its copy of the hooks off; a child started with a fresh interpreter (``spawn``) installs its own, whose
optimizer steps never advance the worker's step (its count starts below it) but whose forward passes are
signs of life of the worker's rank.

Standard library only at import (the agent imports :data:`SITE_DIR`; the agent never imports torch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic import contract
from elastic.contract import Progress, ProgressKind

#: Least seconds between two ``auto`` datagrams (rate limit of the optimizer-step hook).
STEP_INTERVAL_S = 0.02
#: Seconds between two armings of the forward hook: a sign of life is seen at most this often.
LIFE_INTERVAL_S = 0.25
#: Seconds between two looks, on the exec path, for the script's ``import torch`` to be done.
TORCH_POLL_S = 0.05
#: The folder of the worker's ``sitecustomize`` (exec path).
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
PYTHONPATH = "PYTHONPATH"

_installed: _Hooks | None = None
_install_lock = threading.Lock()


def with_site_path(env: Mapping[str, str]) -> str:
    """``env``'s ``PYTHONPATH`` with :data:`SITE_DIR` first (the exec path's ``sitecustomize``)."""
    rest = [p for p in env.get(PYTHONPATH, "").split(os.pathsep) if p and p != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *rest])


def without_site_path(value: str | None) -> str | None:
    """A ``PYTHONPATH`` value without :data:`SITE_DIR` (None when nothing is left)."""
    rest = [p for p in (value or "").split(os.pathsep) if p and p != SITE_DIR]
    return os.pathsep.join(rest) if rest else None


class _Hooks:
    """The installed hooks of this process and what they send."""

    def __init__(self, path: str, local_rank: int) -> None:
        self.path, self.local_rank = path, local_rank
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.active = True  # False in a forked child: its optimizer steps are not this worker's
        self.steps = 0  # optimizer steps so far, all optimizers together
        self.step_sent_at = -1.0  # monotonic time of the last auto datagram
        self.life_sent_at = -1.0
        self.save_depth = 0  # nested torch.save calls (a save may call another)
        self.forward_handle: Any = None  # the armed forward hook's RemovableHandle; None: disarmed
        self.torch: Any = None
        self.register_forward: Callable[..., Any] = lambda hook: None

    def send(self, kind: ProgressKind) -> None:
        message = Progress(local_rank=self.local_rank, kind=kind, step=self.steps).encode()
        # Never blocks, never raises: a datagram the agent cannot take now is superseded by the next.
        with contextlib.suppress(OSError):
            self.sock.sendto(message, self.path)

    # -- the hooks (called by torch on the training thread) -------------------------------------------
    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        self.steps += 1
        now = time.monotonic()
        if now - self.step_sent_at >= STEP_INTERVAL_S:
            self.step_sent_at = now
            self.send(ProgressKind.AUTO)

    def on_forward(self, module: Any, args: Any, output: Any) -> None:
        # Disarm first: every further module call takes torch's fast path again until the next arming.
        handle, self.forward_handle = self.forward_handle, None
        if handle is not None:
            handle.remove()
        if not self.active:
            return
        now = time.monotonic()
        if now - self.life_sent_at >= LIFE_INTERVAL_S / 2:
            self.life_sent_at = now
            self.send(ProgressKind.LIFE)

    def save_begins(self) -> None:
        if self.active:
            self.send(ProgressKind.SAVE)

    def wrap_save(self, save: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.save`` reporting its start and end (the outermost call of nested ones)."""

        @functools.wraps(save)
        def reporting_save(*args: Any, **kwargs: Any) -> Any:
            self.save_depth += 1
            if self.save_depth == 1:
                self.save_begins()
            try:
                return save(*args, **kwargs)
            finally:
                self.save_depth -= 1
                if self.save_depth == 0 and self.active:
                    self.send(ProgressKind.SAVED)

        reporting_save.__elastic_autoprogress__ = True  # type: ignore[attr-defined]  # marks our wrapper
        return reporting_save

    # -- installation ------------------------------------------------------------------------------------
    def register(self, torch: Any) -> None:
        """Register the optimizer-step hook, wrap ``torch.save`` and arm the forward hook."""
        # The defining modules, by name: torch.optim does not keep its submodule ``optimizer`` as attribute.
        modules = importlib.import_module("torch.nn.modules.module")
        self.register_forward = modules.register_module_forward_hook
        importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook(self.on_step)
        self.torch = torch
        if not getattr(torch.save, "__elastic_autoprogress__", False):
            torch.save = self.wrap_save(torch.save)
        self.arm()

    def arm(self) -> None:
        if self.forward_handle is None and self.active:
            self.forward_handle = self.register_forward(self.on_forward)

    def run(self) -> None:
        """The daemon thread: wait for torch (exec path), then re-arm the forward hook periodically."""
        while self.torch is None:
            torch = _imported_torch()
            if torch is not None:
                self.register(torch)
                break
            time.sleep(TORCH_POLL_S)
        while self.active:
            time.sleep(LIFE_INTERVAL_S)
            # Inserting into torch's hook dict from this thread is safe: module calls copy it before
            # iterating (torch.nn.Module._call_impl), and a dict insert holds the GIL.
            self.arm()

    def forked(self) -> None:
        """In a child forked by the worker: its hooks report nothing (it is not this worker's rank)."""
        self.active = False


def _imported_torch() -> Any:
    """``torch``, once the script's ``import torch`` has defined both hook registrations; else None."""
    optimizer = sys.modules.get("torch.optim.optimizer")
    module = sys.modules.get("torch.nn.modules.module")
    torch = sys.modules.get("torch")
    if (
        torch is None
        or getattr(optimizer, "register_optimizer_step_post_hook", None) is None
        or getattr(module, "register_module_forward_hook", None) is None
        or getattr(torch, "save", None) is None
        or getattr(torch, "optim", None) is None
        or getattr(torch, "nn", None) is None
    ):
        return None
    return torch


def install(torch: Any = None) -> bool:
    """Install the progress hooks in this worker (once); False when there is no agent to report to.

    ``torch``: the imported module (the warm-start zygote passes it: the hooks are registered at once);
    None: registered by a daemon thread as soon as the script has imported torch.
    """
    global _installed
    path = os.environ.get(contract.AGENT_SOCKET)
    if not path:
        return False
    with _install_lock:
        if _installed is not None:
            return True
        local_rank = int(
            os.environ.get(contract.ELASTIC_LOCAL_RANK) or os.environ.get(contract.LOCAL_RANK) or 0
        )
        hooks = _Hooks(path, local_rank)
        if torch is None:
            torch = _imported_torch()
        if torch is not None:
            hooks.register(torch)
        os.register_at_fork(after_in_child=hooks.forked)
        threading.Thread(target=hooks.run, name="elastic-autoprogress", daemon=True).start()
        _installed = hooks
    return True


def save_started() -> None:
    """Tell the agent a checkpoint save begins (``elastic.save`` calls it; its ``ckpt`` report ends it):
    the adaptive hang bound does not apply until it ends. Nothing happens without installed hooks."""
    hooks = _installed
    if hooks is not None:
        hooks.save_begins()
