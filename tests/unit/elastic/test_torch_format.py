"""torch's file format written without torch (elastic/checkpoint/torch_format.py): a flash checkpoint turned
into a file that plain ``torch.load(weights_only=True)`` reads, compared with what ``torch.save`` writes
and what the flash reader returns, for every dtype, view and container the flash format describes."""

from __future__ import annotations

import argparse
import io
import math
import re
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn

from elastic.checkpoint import flash, layout, torch_format
from elastic.checkpoint import replicated as checkpoint


def flash_bytes(state: dict[str, Any], step: int = 7) -> bytes:
    """A flash file's bytes, written the way a save writes them."""
    plan = flash.plan(state)
    buffer = bytearray(plan.size)
    flash.write_frame(buffer, plan, step, flash.new_content_id())
    for slot in plan.storages:
        if slot.nbytes:
            torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset).copy_(
                slot.source
            )
    flash.seal(buffer, plan)  # the digest over the bytes now in place
    return bytes(buffer)


def converted(state: dict[str, Any], step: int = 7, *, force_zip64: bool = False) -> bytes:
    data = flash_bytes(state, step)
    return b"".join(torch_format.torch_file(io.BytesIO(data), force_zip64=force_zip64))


def torch_load(data: bytes, **kwargs: Any) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True, **kwargs)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes (some dtypes have no equality kernel)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0)


def assert_same(a: object, b: object, path: str = "") -> None:
    """Equal values of the same types all the way down; tensors: dtype, shape, strides, flags, bytes."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.requires_grad,
        ), path
        assert torch.equal(as_bytes(a), as_bytes(b)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, (path, a, b)


def some_tensor(dtype: torch.dtype) -> torch.Tensor | None:
    """A 2x3 tensor of ``dtype`` with distinct bytes, or None when torch cannot make one."""
    try:
        raw = torch.arange(6 * dtype.itemsize, dtype=torch.uint8)
        return raw.view(dtype).reshape(2, 3) if dtype.itemsize else None
    except (RuntimeError, TypeError):
        return None


@pytest.mark.timeout(60)
def test_every_dtype_the_flash_format_accepts_loads_as_torch_save_writes_it() -> None:
    tensors = {name: t for name, dtype in flash._DTYPES.items() if (t := some_tensor(dtype)) is not None}
    # The dtypes of real checkpoints are all there (the others are whatever this torch can make).
    assert {"float32", "float16", "bfloat16", "float64", "int64", "bool", "uint8", "uint16"} <= set(tensors)
    assert {"float8_e4m3fn", "complex64", "complex128", "int8", "int16", "int32", "uint32"} <= set(tensors)
    state = {"by_dtype": tensors, "dtype_values": [t.dtype for t in tensors.values()]}
    loaded = torch_load(converted(state))
    assert loaded["step"] == 7
    assert_same(loaded["state"], state)
    assert_same(loaded["state"], flash.parse(flash_bytes(state))[0])
    # And as torch.save writes them, where torch.save can (it has no storage type for uint1..7, int1..7).
    saveable = {}
    for name, tensor in tensors.items():
        try:
            torch.save(tensor, io.BytesIO())
        except (KeyError, RuntimeError):
            continue
        saveable[name] = tensor
    assert len(saveable) >= 15
    reference = io.BytesIO()
    torch.save({"step": 7, "state": {"by_dtype": saveable}}, reference)
    assert_same(torch_load(converted({"by_dtype": saveable})), torch_load(reference.getvalue()))


@pytest.mark.timeout(60)
def test_a_training_state_with_views_and_containers_loads_under_weights_only() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "optimizer": optimizer.state_dict(),  # int keys, tuples, None, bools, 0-d step tensors
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "row": base[2],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "empty_strided": torch.empty(0, 3).t(),
        "param": nn.Parameter(torch.ones(3)),
        "frozen": nn.Parameter(torch.ones(2), requires_grad=False),
        "grad_leaf": torch.ones(2).requires_grad_(),
        "leaves": [1, 255, 256, 65536, -1, -(2**31), 2**31, -(2**70), 0.25, float("inf"), float("nan")],
        "strings": ["text ✓", "", "\ud800 lone surrogate", None, True, False, b"\x00raw\xff"],
        "tuple": (1, ("nested", [2, {"deep": (None,)}])),
        "keys": {0: "int", 1.5: "float", "s": "str", None: "none", (1, 2): "tuple", True: "bool"},
        "torch_values": [torch.Size([2, 3]), torch.Size([]), torch.float16, torch.device("cpu")],
        "empty_containers": [{}, [], (), OrderedDict()],
    }
    data = flash_bytes(state)
    expected, _ = flash.parse(data)
    loaded = torch_load(b"".join(torch_format.torch_file(io.BytesIO(data))))
    assert_same(loaded["state"], expected)
    assert_same(loaded["state"], state)
    transposed = loaded["state"]["transposed"]
    assert not transposed.is_contiguous() and transposed.stride() == (1, 6)
    restored = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    restored.load_state_dict(loaded["state"]["model"])
    torch.optim.Adam(restored.parameters()).load_state_dict(loaded["state"]["optimizer"])


@pytest.mark.timeout(30)
def test_views_of_one_storage_share_it_even_across_dtypes() -> None:
    base = torch.arange(1000, dtype=torch.float32)
    state = {"base": base, "row": base.view(10, 100)[3], "ints": base.view(torch.int32)[10:20]}
    state["halves"] = base.view(torch.float16)[6:9]
    loaded = torch_load(converted(state))["state"]
    assert_same(loaded, state)
    ptr = loaded["base"].untyped_storage().data_ptr()
    assert all(loaded[key].untyped_storage().data_ptr() == ptr for key in state)
    loaded["base"][310] = -1.0  # one storage: a write shows through every view
    loaded["base"][10] = -2.0
    assert loaded["row"][10] == -1.0
    assert loaded["ints"][0] == torch.tensor(-2.0).view(torch.int32)


@pytest.mark.timeout(30)
def test_the_file_is_laid_out_as_torch_save_lays_it_out(tmp_path: Path) -> None:
    state = {"w": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float16), "n": 5}
    ours = zipfile.ZipFile(io.BytesIO(converted(state)))
    theirs_buffer = io.BytesIO()
    torch.save({"step": 7, "state": state}, theirs_buffer)
    theirs = zipfile.ZipFile(theirs_buffer)
    # The same records (the prefix is the archive's name: torch.save names it after the file).
    assert [i.filename.split("/", 1)[1] for i in ours.infolist()] == [
        i.filename.split("/", 1)[1] for i in theirs.infolist()
    ]
    assert ours.testzip() is None  # every CRC matches
    assert ours.read("archive/version") == b"3" and ours.read("archive/byteorder") == b"little"
    raw = converted(state)
    for info in ours.infolist():
        name_size, extra_size = struct.unpack_from("<HH", raw, info.header_offset + 26)
        data_at = info.header_offset + 30 + name_size + extra_size
        assert data_at % 64 == 0, f"{info.filename} starts at {data_at}, not 64-byte aligned"
    # Aligned storages are what torch.load's mmap needs.
    path = tmp_path / "step.pt"
    path.write_bytes(raw)
    assert_same(torch.load(path, weights_only=True, mmap=True)["state"], state)


@pytest.mark.timeout(30)
def test_zip64_records_load_in_torch_and_in_zipfile() -> None:
    """Entries past 4 GiB get zip64 fields; forced on small entries here, the same records load."""
    state = {"w": torch.arange(100, dtype=torch.float64), "e": torch.empty(0), "i": 3}
    raw = converted(state, force_zip64=True)
    assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
    assert_same(torch_load(raw)["state"], state)


@pytest.mark.timeout(30)
def test_the_converted_file_is_read_by_elastics_own_parser() -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3).t(), "step_info": {"lr": 0.1}}
    loaded, step = flash.parse(converted(state, step=42))
    assert step == 42
    assert_same(loaded, state)


def test_the_flash_frame_constants_are_the_flash_modules() -> None:
    """The agent reads flash files without torch: its copy of their frame must not drift."""
    assert torch_format.FLASH_MAGIC == flash.MAGIC
    assert torch_format.FLASH_VERSION == flash.VERSION
    assert torch_format.FLASH_HEADER.format == flash.HEADER.format
    assert torch_format.FLASH_TRAILER_SIZE == flash.TRAILER_SIZE


@pytest.mark.timeout(30)
def test_what_it_cannot_write_is_refused_before_any_byte() -> None:
    good = flash_bytes({"w": torch.ones(4)})
    torn = good[:-1]
    with pytest.raises(torch_format.NotConvertible, match="torn"):
        torch_format.torch_file(io.BytesIO(torn))
    with pytest.raises(torch_format.NotConvertible, match="not a flash"):
        torch_format.torch_file(io.BytesIO(b"PK\x03\x04" + b"\x00" * 200))
    newer = bytearray(good)
    struct.pack_into("<I", newer, 8, flash.VERSION + 1)
    with pytest.raises(torch_format.NotConvertible, match="version"):
        torch_format.torch_file(io.BytesIO(bytes(newer)))
    # A forged description cannot smuggle pickle opcodes in through a name.
    for forged in ({"dt": "float32\ncos\nsystem"}, {"t": 0}):
        tensors = [[0, "float32\nX", [1], [1], 0, False, False]] if "t" in forged else []
        description = {"tree": forged, "storages": [[0, 4, "cpu"]], "tensors": tensors}
        with pytest.raises(torch_format.NotConvertible, match="bad dtype name"):
            torch_format.pickle_of(torch_format.FlashFrame(1, description, 4096, 8192))
    # An int beyond the pickle opcodes weights_only reads (LONG1: 255 bytes).
    with pytest.raises(torch_format.NotConvertible, match="255 bytes"):
        torch_format.torch_file(io.BytesIO(flash_bytes({"huge": 1 << 2100})))


@pytest.mark.timeout(30)
def test_the_reader_hands_out_the_stream_in_the_sizes_asked() -> None:
    state = {"w": torch.arange(5000, dtype=torch.float32)}
    whole = converted(state)
    reader = torch_format.Reader(torch_format.torch_file(io.BytesIO(flash_bytes(state))))
    parts = []
    while part := reader.read(1000):
        assert len(part) <= 1000
        parts.append(part)
    assert len(b"".join(parts)) == len(whole)
    assert_same(torch_load(b"".join(parts))["state"], state)


@pytest.mark.timeout(30)
def test_a_state_no_load_could_read_is_refused_at_save_naming_the_key(
    flash_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a numpy array or an argparse.Namespace fell back to torch.save and the save succeeded; the
    restore (weights_only=True) then failed, when the job's progress depended on it."""
    good = {"w": torch.ones(2)}
    for bad, where in [
        ({**good, "args": argparse.Namespace(lr=0.1)}, "state['args'] is of type argparse.Namespace"),
        (
            {**good, "opt": {"state": {0: {"m": numpy.zeros(3)}}}},
            "state['opt']['state'][0]['m'] is of type numpy.",
        ),
        ({**good, "runs": [1, {"at": object()}]}, "state['runs'][1]['at'] is of type builtins.object"),
    ]:
        with pytest.raises(checkpoint.StateNotLoadableError, match=re.escape(where)) as refused:
            checkpoint.save(bad, 3)
        assert "\n" not in str(refused.value) and "weights_only=True" in str(refused.value)
    assert layout.checkpoint_files(flash_env) == [], "nothing was written"
    # What weights_only does rebuild but the flash format does not describe still falls back to torch.save.
    path = checkpoint.save({**good, "sparse": torch.eye(2).to_sparse(), "tags": {"a", "b"}, "c": 1 + 2j}, 4)
    assert path is not None and path.read_bytes()[:2] == b"PK"
    assert torch.load(path, weights_only=True)["state"]["tags"] == {"a", "b"}
    # The disk mode (no agent) refuses the same.
    monkeypatch.delenv("ELASTIC_SHM_DIR")
    with pytest.raises(checkpoint.StateNotLoadableError, match="state\\['args'\\]"):
        checkpoint.save({"args": argparse.Namespace()}, 1, tmp_path / "disk")
    assert layout.checkpoint_files(tmp_path / "disk") == []
