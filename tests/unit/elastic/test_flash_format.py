"""The raw format of flash checkpoints (elastic/checkpoint/flash.py): round trips of real states,
storage
sharing, safe rejection of torn or forged files, and the torch.save files it must keep loading."""

from __future__ import annotations

import io
import json
import math
import socket
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic.checkpoint import digest, flash, layout
from elastic.checkpoint import replicated as checkpoint
from elastic.checkpoint.flash import HEADER, MAGIC, TRAILER_SIZE


def flash_bytes(state: dict, step: int = 7) -> bytes:
    """A flash file's bytes, written the way a save writes them (into a writable buffer)."""
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


def round_trip(state: dict, map_location: object = "cpu") -> dict:
    loaded, step = flash.parse(flash_bytes(state), map_location)
    assert step == 7
    return loaded


def assert_same(a: object, b: object) -> None:
    """Equal values of the same types all the way down (tensors: dtype, shape, stride and values)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.requires_grad,
        )
        assert torch.equal(a.detach(), b.detach())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


@pytest.mark.timeout(30)
def test_round_trip_of_a_nested_state_keeps_every_leaf_container_and_dtype() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),  # an OrderedDict with _metadata (module versions)
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), None, bools, 0-dim step tensors
        "dtypes": {
            str(dtype): (torch.arange(6) % 3).to(dtype).reshape(2, 3)
            for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16)
            + (torch.int32, torch.int64, torch.bool, torch.complex64)
        },
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "rng": torch.get_rng_state(),
        "param": nn.Parameter(torch.ones(3)),
        "frozen": nn.Parameter(torch.ones(2), requires_grad=False),
        "leaves": [1, -(2**70), 0.25, float("inf"), float("nan"), "text ✓", None, True, False, b"\x00raw"],
        "tuple": (1, ("nested", [2, {"deep": (None,)}])),
        "keys": {0: "int", 1.5: "float", "s": "str", None: "none", (1, 2): "tuple", True: "bool"},
        "torch_values": [torch.Size([2, 3]), torch.float16, torch.device("cpu")],
        "empty_containers": [{}, [], (), OrderedDict()],
    }
    loaded = round_trip(state)
    assert_same(loaded, state)
    assert loaded["model"]._metadata == state["model"]._metadata
    assert not loaded["transposed"].is_contiguous() and loaded["transposed"].stride() == (1, 6)
    restored = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    restored.load_state_dict(loaded["model"])
    torch.optim.Adam(restored.parameters()).load_state_dict(loaded["optimizer"])


@pytest.mark.timeout(30)
def test_views_of_one_storage_share_it_after_loading_and_it_is_written_once() -> None:
    base = torch.arange(1000, dtype=torch.float32)
    state = {
        "base": base,
        "row": base.view(10, 100)[3],
        "ints": base.view(torch.int32)[10:20],
        "t": base[5:].view(5, 199).t(),
    }
    data = flash_bytes(state)
    assert len(data) < base.nbytes + 2 * 4096 + 1024, "the storage is stored once"
    loaded = round_trip(state)
    assert_same(loaded, state)
    ptr = loaded["base"].untyped_storage().data_ptr()
    assert all(loaded[k].untyped_storage().data_ptr() == ptr for k in state)
    loaded["base"][300] = -1.0
    assert loaded["row"][0] == -1.0, "a write through one view shows through the others"


@pytest.mark.timeout(30)
def test_map_location_follows_torch_loads_rules() -> None:
    state = {"w": torch.ones(2)}
    seen = []

    def mapper(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    assert torch.equal(round_trip(state, mapper)["w"], torch.ones(2)) and seen == ["cpu"]
    assert round_trip(state, {"cpu": "cpu"})["w"].device.type == "cpu"
    assert round_trip(state, None)["w"].device.type == "cpu", "None: back where it was saved"
    assert round_trip(state, torch.device("cpu"))["w"].device.type == "cpu"


def forged(meta: dict | bytes, *, data: bytes = b"", version: int = flash.VERSION) -> bytes:
    """A flash file with a hand-made description (consistent sizes and trailer)."""
    raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    offset = flash._align(HEADER.size + len(raw), flash.DATA_ALIGN)
    size = offset + len(data) + TRAILER_SIZE
    ident = b"i" * 16
    out = bytearray(size)
    out[: HEADER.size] = HEADER.pack(MAGIC, version, 0, 3, size, len(raw), offset, ident, bytes(16))
    out[HEADER.size : HEADER.size + len(raw)] = raw
    out[offset : offset + len(data)] = data
    out[size - TRAILER_SIZE :] = ident
    if version == flash.VERSION:  # a consistent digest: what is refused here is refused for its content
        header = digest.read_header(out, size)
        flash.write_digest(out, digest.frame_digest(out, header))
    return bytes(out)


@pytest.mark.timeout(30)
def test_torn_or_garbage_flash_files_are_rejected_with_a_value_error() -> None:
    good = flash_bytes({"w": torch.arange(100.0), "n": [1, 2]})
    assert flash.parse(good)[1] == 7
    broken = {
        "cut in the header": good[:40],
        "cut in the data": good[: len(good) // 2],
        "one byte short": good[:-1],
        "one byte more": good + b"\0",
        "trailer of another save": good[:-TRAILER_SIZE] + b"x" * TRAILER_SIZE,
        "other version": forged({"tree": {"D": []}, "storages": [], "tensors": []}, version=99),
        "not json": forged(b"{not json"),
        "not utf-8": forged(b"\xff\xfe"),
        "missing keys": forged({"tree": {"D": []}}),
        "unknown tag (no objects, no code)": forged(
            {"tree": {"__reduce__": ["os.system", ["echo hi"]]}, "storages": [], "tensors": []}
        ),
        "storage outside the file": forged(
            {"tree": {"D": []}, "storages": [[0, 1 << 40, "cpu"]], "tensors": []}
        ),
        "view past its storage": forged(
            {
                "tree": {"D": [["w", {"t": 0}]]},
                "storages": [[0, 8, "cpu"]],
                "tensors": [[0, "float32", [3], [1], 0, False, False]],
            },
            data=b"\0" * 8,
        ),
        "unknown dtype": forged(
            {
                "tree": {"D": []},
                "storages": [[0, 8, "cpu"]],
                "tensors": [[0, "object", [1], [1], 0, False, False]],
            },
            data=b"\0" * 8,
        ),
        "negative stride": forged(
            {
                "tree": {"D": []},
                "storages": [[0, 8, "cpu"]],
                "tensors": [[0, "float32", [2], [-1], 1, False, False]],
            },
            data=b"\0" * 8,
        ),
        "state not a dict": forged({"tree": {"L": []}, "storages": [], "tensors": []}),
        "unhashable key": forged({"tree": {"D": [[{"L": []}, 1]]}, "storages": [], "tensors": []}),
    }
    for why, data in broken.items():
        with pytest.raises(ValueError):
            flash.parse(data, "cpu")
            pytest.fail(f"accepted: {why}")
    # Random bytes after the magic: still a clean ValueError, never a crash or a hang.
    gen = torch.Generator().manual_seed(0)
    for length in (0, 10, 63, 64, 200, 5000):
        junk = MAGIC + bytes(torch.randint(0, 256, (length,), generator=gen, dtype=torch.uint8).tolist())
        with pytest.raises(ValueError):
            flash.parse(junk, "cpu")


@pytest.mark.timeout(30)
def test_legacy_torch_save_files_still_load_from_disk_and_bytes(tmp_path: Path) -> None:
    state = {"w": torch.arange(4.0), "meta": {"epoch": 2}}
    buffer = io.BytesIO()
    torch.save({"step": 5, "state": state}, buffer)
    loaded, step = checkpoint.parse_checkpoint(buffer.getvalue(), "cpu")
    assert step == 5 and torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"epoch": 2}

    # A disk folder mixing an old torch.save checkpoint and a flash file the agent persisted byte for byte.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / layout.step_file_name(5)).write_bytes(buffer.getvalue())
    assert checkpoint.load_latest(folder)[1] == 5
    (folder / layout.step_file_name(6)).write_bytes(flash_bytes({"w": torch.ones(2)}, step=6))
    loaded, step = checkpoint.load_latest(folder)
    assert step == 6 and torch.equal(loaded["w"], torch.ones(2))
    # Pickles that are not weights stay refused in old files too.
    evil = io.BytesIO()
    torch.save({"step": 1, "state": {"x": socket.AF_INET}}, evil)
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own unpickling error
        checkpoint.parse_checkpoint(evil.getvalue(), "cpu")


@pytest.mark.timeout(30)
def test_save_writes_the_flash_format_and_falls_back_to_torch_save_for_what_it_cannot_describe(
    flash_env: Path,
) -> None:
    path = checkpoint.save({"w": torch.ones(3)}, 1)
    assert path.read_bytes()[: len(MAGIC)] == MAGIC
    sparse = {"s": torch.eye(3).to_sparse()}
    with pytest.raises(flash.Unsupported):
        flash.plan(sparse)
    path = checkpoint.save(sparse, 2)
    assert path.read_bytes()[:2] == b"PK", "torch.save's zip format"
    assert [s for s, _ in layout.checkpoint_files(flash_env)] == [2, 1]
    assert torch.equal(checkpoint.load()[0]["s"].to_dense(), torch.eye(3))
    # A subclass or a custom object is not guessed at: torch.save (and weights_only loading) decide.
    with pytest.raises(flash.Unsupported):
        flash.plan({"d": struct.Struct("<i")})
