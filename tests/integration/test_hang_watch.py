"""agent.observe.hang.HangWatch on a real process: it sees a SIGSTOPped worker and forgets it once
continued."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from agent.observe.channel import RankProgress
from agent.observe.hang import HangWatch

pytestmark = pytest.mark.timeout(30)


def test_hang_watch_sees_a_stopped_process_and_forgets_a_continued_one(tmp_path: Path):
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        # Wait until the interpreter is up: while it loads from disk it may be in disk sleep, which the
        # watch (rightly) counts as stuck and would remember as the first sighting.
        assert child.stdout.readline().strip() == b"ready"
        watch = HangWatch(timeout_s=5.0)
        progress = {0: RankProgress(step=3, advanced_at=time.monotonic())}
        assert watch.check(time.monotonic(), progress, {0: child.pid}) == []
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # the kernel stops it asynchronously
        now = time.monotonic()
        (first,) = watch.observe(now, progress, {0: child.pid})
        assert first.status == psutil.STATUS_STOPPED and first.stuck_since == now
        # Later checks keep the first sighting: the stop is measured from there.
        (hang,) = watch.check(now + 5.0, progress, {0: child.pid})
        assert hang.cause == "stopped"
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() == psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (again,) = watch.observe(now + 6.0, progress, {0: child.pid})
        assert again.stuck_since is None
    finally:
        child.kill()
        child.wait()
