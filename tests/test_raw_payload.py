"""The raw layout of a tier-0 slot (pretrain.checkpointing.raw_payload), on real files in a tmpfs:
every dtype and shape a rank's state holds comes back bit-equal with its containers' types; a
``torch.save`` file is still read; a file cut short is refused naming it; a tensor outside host
memory is refused as the caller's bug; the header is loaded without arbitrary unpickling."""

from __future__ import annotations

import io
import os
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpointing import raw_payload
from pretrain.checkpointing.async_writer import save_state
from pretrain.checkpointing.rank_payload import load_verified_state, owned_tensors
from tiering.digest import HashSpec, hash_file
from tiering.memory.slot_store import SlotStore, _PayloadFile


def _payload() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, generator=gen)
    return {
        "format": "per-rank-torch/v1",
        "model": {
            "w": base,
            "w_t": base.t(),  # not contiguous
            "half": torch.randn(5, generator=gen).to(torch.float16),
            "bf16": torch.randn(3, 3, generator=gen).to(torch.bfloat16),
            "view": base[2:4],  # a view into a larger storage: its own bytes only
        },
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(0)}}, "param_groups": []},
        "rank_state": {
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state(), "mask": torch.tensor([True, False])},
            "cursor": (1, [2, 3], None, 4.5, "x", b"\x00\xff"),
            "ids": torch.arange(5, dtype=torch.int64),
        },
    }


def _write(payload: dict[str, Any], path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        sink = _PayloadFile(fd)
        written = raw_payload.write(payload, sink)
        os.ftruncate(fd, sink.size)
        assert written == sink.size
        return written
    finally:
        os.close(fd)


def _same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_a_rank_payload_comes_back_bit_equal(tmp_path: Path) -> None:
    payload = _payload()
    path = tmp_path / "state.pt"
    _write(payload, path)
    assert raw_payload.is_raw(path)
    back = raw_payload.read(path)
    _same(payload, back)
    back["model"]["w"].add_(1)  # mapped copy-on-write: the loaded state may change, the file never does
    _same(payload, raw_payload.read(path))


def test_tensors_are_aligned_and_only_their_own_bytes_are_written(tmp_path: Path) -> None:
    payload = {"big": torch.zeros(1000), "slice": torch.ones(1000)[:10]}
    size = _write(payload, tmp_path / "s")
    assert size < 4000 + 40 + 4096  # the slice's 40 bytes, not its storage's 4000
    assert size % raw_payload.ALIGN == 0


def test_a_torch_save_file_is_still_read(tmp_path: Path) -> None:
    """Tier 1's own writers keep torch.save; the loader tells the two apart by the magic."""
    payload = _payload()
    path = tmp_path / "state.pt"
    with open(path, "wb") as fh:
        save_state(payload, fh)
    assert not raw_payload.is_raw(path)
    back = raw_payload.read(path)
    assert torch.equal(back["model"]["w"], payload["model"]["w"])


def test_a_file_cut_short_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    size = _write(_payload(), path)
    os.truncate(path, size - 200)
    with pytest.raises(ValueError, match=str(path)):
        raw_payload.read(path)


def test_a_tensor_outside_host_memory_is_the_callers_bug(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="host memory"):
        _write({"w": torch.empty(3, device="meta")}, tmp_path / "s")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


def test_the_header_is_never_unpickled_freely(tmp_path: Path) -> None:
    """A header naming a callable (a forged slot) is refused by the weights-only loader."""
    header = io.BytesIO()
    torch.save({"skeleton": {}, "tensors": []}, header)
    forged = io.BytesIO()
    pickle.dump({"skeleton": _Evil(), "tensors": []}, forged)
    path = tmp_path / "state.pt"
    body = forged.getvalue()
    path.write_bytes(raw_payload.MAGIC + len(body).to_bytes(8, "little") + body)
    with pytest.raises(Exception, match="(?i)weights_only|unpickl"):
        raw_payload.read(path)


def test_a_slot_hashed_while_written_has_the_digest_of_its_bytes(tmp_path: Path) -> None:
    """Tier 0 hashes the slot as it writes it (large tensors in place, on the lanes): the seal's
    digest is the file's, chunk for chunk, even for a tensor that is a temporary copy."""
    store = SlotStore(tmp_path, "run", 0, 2)
    big = torch.randn(3 * 1024 * 1024 // 4 + 7)  # past a chunk boundary, hashed in place
    payload = {"big": big, "t": torch.randn(700, 600).t(), "rest": _payload()}  # .t(): copied to write it
    spec = HashSpec("xxh3-128", 1024 * 1024, 2)
    digest = store.write_hashed(0, lambda fh: raw_payload.write(payload, fh), fresh_inode=False, hashing=spec)
    assert digest == hash_file(store.state_path(0), spec)
    _same(payload, raw_payload.read(store.state_path(0)))


def test_a_restore_keeps_no_mapping_of_a_raw_slot_once_its_tensors_are_owned(tmp_path: Path) -> None:
    """As for a torch.save step (tests/test_disk_full.py): the load maps the file, and once the
    optimizer holds copies nothing maps it any more (retention can free its space)."""
    model = torch.nn.Linear(16, 16)
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    adam.step()
    path = tmp_path / "state.pt"
    _write({"optimizer": adam.state_dict()}, path)
    mapped = load_verified_state(path)
    assert str(path) in Path("/proc/self/maps").read_text(), "the load is expected to map the file"
    restored = torch.optim.AdamW(model.parameters())
    restored.load_state_dict(owned_tensors(mapped["optimizer"]))
    del mapped
    assert str(path) not in Path("/proc/self/maps").read_text(), "the restored optimizer still maps the slot"
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"], adam.state_dict()["state"][0]["exp_avg"])
