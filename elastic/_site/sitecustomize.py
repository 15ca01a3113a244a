"""elastic-run's ``sitecustomize`` for exec'd workers: installs :mod:`elastic.autoprogress` (progress hooks
without user code) before the script runs, then runs the ``sitecustomize`` that would have run without this
folder first on ``PYTHONPATH`` (the environment's or the user's), as if this one were not there.

It never fails the worker's start: without the ``elastic`` library in this interpreter, or if anything
goes wrong, nothing is installed.
"""

import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install() -> None:
    try:
        from elastic import autoprogress

        autoprogress.install()
    except Exception:  # noqa: BLE001 - progress is advisory: the worker starts regardless
        pass


def _chain() -> None:
    """Import the next ``sitecustomize`` on the path, with this folder out of the way."""
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    try:
        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":  # the other sitecustomize failed: say so, as site.py would
            sys.stderr.write(
                f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n"
            )
    except Exception as e:  # noqa: BLE001 - as site.py: report and go on
        sys.stderr.write(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n"
        )
    finally:
        sys.path[:] = saved
        if "sitecustomize" not in sys.modules and ours is not None:
            sys.modules["sitecustomize"] = ours


_install()
_chain()
