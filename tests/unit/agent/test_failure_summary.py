"""A failed worker's summary names what failed (the exception line), never where (a frame line): checked on
the stderr torch and gloo write today (tests/data, made by tests/data/make_gloo_peer_killed.py) and on the
shape of torch's errors that carry a C++ frame list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.workers.errors_file import message_from_stderr, read_error_file

DATA = Path(__file__).resolve().parents[2] / "data"

# torch's DistBackendError / RuntimeError from a DDP comm hook whose peer went away: the exception line,
# then the C++ frame list, which ends with the Python frames it was called from.
CPP_FRAMES = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/job/train.py", line 88, in <module>
[rank1]:     loss.backward()
[rank1]:   File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 623, in backward
[rank1]:     torch.autograd.backward(
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer \
[127.0.0.1]:11681
[rank1]: Exception raised from recvAsync at ../third_party/gloo/gloo/transport/tcp/pair.cc:534 \
(most recent call first):
[rank1]: frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f3c in \
/venv/torch/lib/libc10.so)
[rank1]: frame #1: <unknown function> + 0x5b3d8f1 (0x7f3c in /venv/torch/lib/libtorch_cpu.so)
[rank1]: frame #2: c10d::ProcessGroupGloo::AsyncWork::execute(c10::intrusive_ptr<c10d::ProcessGroupGloo::\
AsyncWork>) + 0x3c
[rank1]: /venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py(1611): _pre_forward
[rank1]: /venv/lib/python3.11/site-packages/torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py(31)\
: <lambda>
"""


@pytest.mark.parametrize("name", ["gloo_ddp_peer_killed.stderr", "gloo_allreduce_peer_killed.stderr"])
def test_the_summary_of_a_survivor_of_a_killed_gloo_peer_is_its_exception_line(name):
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()

    summary = message_from_stderr(lines)

    assert summary is not None and summary.startswith("RuntimeError: ["), summary
    assert "Connection reset by peer" in summary and "[rank0]" not in summary


def test_an_exception_whose_message_goes_on_with_cpp_frames_is_summarised_by_its_first_line():
    summary = message_from_stderr(CPP_FRAMES.splitlines())

    assert summary == (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:11681"
    )


def test_a_tail_that_lost_the_traceback_header_still_names_the_exception_not_a_frame():
    tail = CPP_FRAMES.splitlines()[5:]  # the stderr tail was cut inside the traceback

    assert message_from_stderr(tail).startswith("RuntimeError: [../third_party/gloo")  # type: ignore[union-attr]


def test_only_frames_left_gives_the_last_line_that_is_not_a_frame():
    tail = ["NCCL watchdog thread terminated", *CPP_FRAMES.splitlines()[7:]]

    assert message_from_stderr(tail) == "NCCL watchdog thread terminated"


def test_the_last_traceback_of_chained_exceptions_names_the_root_cause_it_ends_with():
    lines = [
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in <module>',
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "a.py", line 3, in <module>',
        "    raise ValueError('bad')",
        "ValueError: bad",
        "W1: shutting down",
    ]

    assert message_from_stderr(lines) == "ValueError: bad"


def test_an_error_file_with_torchs_frame_list_is_summarised_by_its_exception_line(tmp_path):
    message = "\n".join(line.removeprefix("[rank1]: ") for line in CPP_FRAMES.splitlines()[5:])
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {}}}))

    assert read_error_file(path) == (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:11681"
    )
