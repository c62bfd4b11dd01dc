"""SafetensorsTensorStore: bitwise agreement with safetensors, validation, identity, ownership."""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from worldfoundry.core.model_loading import tensor_store as ts
from worldfoundry.core.model_loading.safetensors_header import SAFETENSORS_DTYPES
from worldfoundry.core.model_loading.tensor_store import SafetensorsTensorStore
from worldfoundry.errors import CheckpointError, PolicyError

ALL_DTYPES = sorted(set(SAFETENSORS_DTYPES.values()), key=str)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs and infinities included for the float types)."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, ref in want.items():
        out = got[key]
        assert out.dtype == ref.dtype, key
        assert out.shape == ref.shape, key
        assert out.device.type == "cpu" and out.is_contiguous(), key
        assert torch.equal(out.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), key


def mixed_tensors() -> dict[str, torch.Tensor]:
    shapes = [(3, 5), (7,), (), (0,), (2, 0, 3), (1, 1, 1), (5, 3, 2), (13,)]
    out = {}
    for i, dtype in enumerate(ALL_DTYPES):
        out[f"layers.{i}.{str(dtype).removeprefix('torch.')}"] = random_tensor(shapes[i % len(shapes)], dtype, i)
    out["blocks.0.attn.to_q.weight"] = random_tensor((17, 9), torch.bfloat16, 100)
    out["blocks.0.attn.to_k.weight"] = random_tensor((17, 9), torch.bfloat16, 101)
    out["blocks.1.ffn.weight"] = random_tensor((33, 7), torch.float8_e4m3fn, 102)
    return out


@pytest.fixture()
def mixed_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = mixed_tensors()
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "origin": "test"})
    return path, tensors


# --- agreement with safetensors --------------------------------------------------------------------------


def test_read_all_is_bitwise_equal_to_load_file(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    got = store.read_all()
    assert_bitwise(got, load_file(str(path)))
    assert_bitwise(got, tensors)


def test_index_accessors(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    assert dict(store.metadata) == {"format": "pt", "origin": "test"}
    assert sorted(store.keys()) == sorted(tensors)
    assert len(store) == len(tensors) and set(store) == set(tensors)
    offsets = [store.entry(k).begin for k in store.keys()]
    assert offsets == sorted(offsets)
    for key, ref in tensors.items():
        assert key in store
        assert store.shape(key) == tuple(ref.shape)
        assert store.dtype(key) == ref.dtype
        assert store.nbytes(key) == ref.numel() * ref.element_size()
    assert "nope" not in store
    assert store.path == os.path.abspath(path)
    with pytest.raises(CheckpointError, match="blocks.0.attn.to_q.weight"):
        store.shape("blocks.0.attn.to_q.weigth")


def test_read_subset_order_duplicates_and_single_key(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    keys = ["blocks.1.ffn.weight", "blocks.0.attn.to_q.weight", "blocks.1.ffn.weight"]
    got = store.read(keys)
    assert list(got) == ["blocks.1.ffn.weight", "blocks.0.attn.to_q.weight"]
    assert_bitwise(got, {k: tensors[k] for k in got})
    single = store.read("blocks.0.attn.to_k.weight")
    assert_bitwise(single, {"blocks.0.attn.to_k.weight": tensors["blocks.0.attn.to_k.weight"]})
    assert store.read([]) == {}


def test_read_prefix(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    got = store.read_prefix("blocks.0.")
    assert sorted(got) == ["blocks.0.attn.to_k.weight", "blocks.0.attn.to_q.weight"]
    assert_bitwise(got, {k: tensors[k] for k in got})
    with pytest.raises(CheckpointError, match="no tensor name starts with 'decoder.'.*blocks"):
        store.read_prefix("decoder.")


def test_expected_shapes_checked_for_the_whole_group_before_reading(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    keys = ["blocks.0.attn.to_q.weight", "blocks.0.attn.to_k.weight"]
    ok = store.read(keys, expected_shapes={k: torch.Size([17, 9]) for k in keys})
    assert_bitwise(ok, {k: tensors[k] for k in keys})
    with pytest.raises(CheckpointError) as info:
        store.read(keys, expected_shapes={keys[0]: (9, 17), keys[1]: [17, 8]})
    message = str(info.value)
    assert keys[0] in message and keys[1] in message and "(9, 17)" in message and "(17, 8)" in message
    with pytest.raises(CheckpointError, match="not being read.*blocks.1.ffn.weight"):
        store.read(keys, expected_shapes={"blocks.1.ffn.weight": (33, 7)})


def test_unknown_keys_list_close_matches(mixed_file):
    path, _ = mixed_file
    store = SafetensorsTensorStore(path)
    with pytest.raises(CheckpointError) as info:
        store.read(["blocks.0.attn.to_v.weight", "zzz"])
    message = str(info.value)
    assert str(path) in message
    assert "'blocks.0.attn.to_v.weight' (close matches: 'blocks.0.attn.to_q.weight'" in message
    assert "'zzz' (no close match)" in message


def test_dtype_cast_applies_to_floating_tensors_only(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    got = store.read_all(dtype="fp32")
    for key, ref in tensors.items():
        if ref.is_floating_point():
            assert got[key].dtype == torch.float32
            same = (got[key] == ref.to(torch.float32)) | (got[key].isnan() & ref.to(torch.float32).isnan())
            assert bool(same.all()), key
        else:
            assert got[key].dtype == ref.dtype
            assert torch.equal(got[key], ref)
    bf = store.read(["blocks.0.attn.to_q.weight"], dtype=torch.bfloat16)["blocks.0.attn.to_q.weight"]
    assert bf.dtype == torch.bfloat16
    with pytest.raises(PolicyError):
        store.read(["blocks.0.attn.to_q.weight"], dtype="int8")


# --- ownership, descriptors and the immutable-file contract ---------------------------------------------


def _open_paths() -> set[str]:
    fd_dir = "/proc/self/fd"
    out = set()
    for fd in os.listdir(fd_dir):
        try:
            out.add(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            continue
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")
def test_no_descriptor_or_mapping_is_kept(mixed_file):
    path, _ = mixed_file
    real = os.path.realpath(path)
    store = SafetensorsTensorStore(path)
    assert real not in _open_paths()
    got = store.read_all()
    assert real not in _open_paths()
    with open("/proc/self/maps") as maps:
        assert real not in maps.read()
    storages = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
    assert len(storages) == sum(1 for t in got.values() if t.numel())
    for t in got.values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_tensors_outlive_the_deleted_file(mixed_file):
    path, tensors = mixed_file
    store = SafetensorsTensorStore(path)
    got = store.read_all()
    del store
    path.unlink()
    # Reuse the freed disk blocks and page cache with other content before checking.
    path.write_bytes(b"\xff" * 4096)
    path.unlink()
    assert_bitwise(got, tensors)


def test_read_after_delete_is_refused(mixed_file):
    path, _ = mixed_file
    store = SafetensorsTensorStore(path)
    path.unlink()
    with pytest.raises(CheckpointError, match="cannot read the indexed file"):
        store.read_all()


def test_changed_mtime_is_refused(mixed_file):
    path, _ = mixed_file
    store = SafetensorsTensorStore(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(CheckpointError, match="changed since it was indexed"):
        store.read(["blocks.0.attn.to_q.weight"])


def test_replaced_file_with_same_bytes_is_refused(mixed_file):
    path, _ = mixed_file
    store = SafetensorsTensorStore(path)
    st = os.stat(path)
    other = path.with_name("other.safetensors")
    other.write_bytes(path.read_bytes())
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(CheckpointError, match="changed since it was indexed"):
        store.read_all()


def test_refuses_big_endian_host(mixed_file, monkeypatch):
    path, _ = mixed_file
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(CheckpointError, match="little-endian"):
        SafetensorsTensorStore(path)


def test_missing_file_and_bad_workers(tmp_path, mixed_file):
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        SafetensorsTensorStore(tmp_path / "missing.safetensors")
    with pytest.raises(PolicyError, match="read_workers"):
        SafetensorsTensorStore(mixed_file[0], read_workers=0)


# --- chunking, threads and the fallback path ------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("use_preadv", [True, False])
def test_small_chunks_split_and_coalesce_identically(mixed_file, monkeypatch, workers, use_preadv):
    path, tensors = mixed_file
    monkeypatch.setattr(ts, "CHUNK_BYTES", 16)
    monkeypatch.setattr(ts, "BATCH_BYTES", 48)
    monkeypatch.setattr(ts, "_IOV_MAX", 2)
    if not use_preadv:
        monkeypatch.setattr(ts, "_HAS_PREADV", False)
    elif not hasattr(os, "preadv"):
        pytest.skip("os.preadv not available")
    store = SafetensorsTensorStore(path, read_workers=workers)
    assert_bitwise(store.read_all(), tensors)
    keys = ["blocks.1.ffn.weight", "layers.0.torch.bfloat16", "blocks.0.attn.to_q.weight"]
    keys = [k for k in keys if k in tensors]
    assert_bitwise(store.read(keys), {k: tensors[k] for k in keys})


def test_chunks_coalesce_adjacent_tensors_and_split_large_ones(monkeypatch):
    entries = [
        ts.TensorEntry("a", torch.uint8, (10,), 100, 110),
        ts.TensorEntry("e", torch.uint8, (0,), 110, 110),
        ts.TensorEntry("b", torch.uint8, (25,), 110, 135),
        ts.TensorEntry("c", torch.uint8, (5,), 200, 205),
    ]
    tensors = [torch.empty(e.shape, dtype=e.dtype) for e in entries]

    def layout() -> list[tuple[int, list[int]]]:
        return [(off, [len(v) for v in views]) for off, views in ts._chunks(entries, tensors)]

    assert layout() == [(100, [10, 25]), (200, [5])]
    monkeypatch.setattr(ts, "CHUNK_BYTES", 16)
    assert layout() == [(100, [10, 6]), (116, [16]), (132, [3]), (200, [5])]


@pytest.mark.skipif(not hasattr(os, "preadv"), reason="os.preadv not available")
def test_short_reads_are_resumed(mixed_file, monkeypatch):
    """POSIX allows preadv to return fewer bytes than asked (Linux does above ~2 GiB); reads resume."""
    path, tensors = mixed_file
    real_preadv = os.preadv
    calls = []

    def short_preadv(fd: int, buffers: list, offset: int) -> int:
        calls.append(offset)
        return real_preadv(fd, [memoryview(buffers[0])[:3]], offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    store = SafetensorsTensorStore(path, read_workers=1)
    assert_bitwise(store.read_all(), tensors)
    assert len(calls) > len(tensors)


@pytest.mark.skipif(not hasattr(os, "preadv"), reason="os.preadv not available")
def test_fill_reports_a_short_file(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(10)))
    a, b = torch.empty(4, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not ts._fill_preadv(fd, (4, [ts._byte_view(a), ts._byte_view(b)]))
        assert a.tolist() == [4, 5, 6, 7] and b[:2].tolist() == [8, 9]
        assert ts._fill_preadv(fd, (2, [ts._byte_view(a)]))
        assert a.tolist() == [2, 3, 4, 5]
    finally:
        os.close(fd)


# --- corruption -------------------------------------------------------------------------------------------


def write_raw(path: Path, header: object, data: bytes, *, header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + raw + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": entry("F32", [2], 0, 8), "b": entry("BF16", [3], 8, 14)}

CORRUPT = {
    "tiny file": (b"\x01\x02", None, None, "8-byte header length"),
    "zero header length": (b"", b"", 0, "bad header length 0"),
    "header past end": (b"{}", b"", 1000, "bad header length 1000"),
    "huge header length": (b"{}", b"", 2**63, "bad header length"),
    "bad json": (b'{"a": ', b"", None, "not valid UTF-8 JSON"),
    "not utf8": (b'{"\xff": 1}', b"", None, "not valid UTF-8 JSON"),
    "top level list": ([1, 2], b"", None, "must be a JSON object"),
    "duplicate key": (b'{"a": {}, "a": {}}', b"", None, "names 'a' twice"),
    "unknown dtype": ({"w": entry("F128", [1], 0, 16)}, bytes(16), None, "'w'.*unsupported dtype 'F128'"),
    "dtype not a string": ({"w": entry(["F32"], [1], 0, 4)}, bytes(4), None, "'w'.*unsupported dtype \\['F32'\\]"),
    "negative dim": ({"w": entry("F32", [-1], 0, 4)}, bytes(4), None, "'w'.*non-negative integers"),
    "bool dim": ({"w": entry("F32", [True], 0, 4)}, bytes(4), None, "'w'.*non-negative integers"),
    "float offset": ({"w": entry("F32", [1], 0, 4.0)}, bytes(4), None, "'w'.*data_offsets"),
    "reversed offsets": ({"w": entry("U8", [0], 4, 0)}, bytes(4), None, "'w'.*end before they begin"),
    "size mismatch": ({"w": entry("F32", [3], 0, 8)}, bytes(8), None, "'w'.*needs 12 bytes.*span 8"),
    "missing field": ({"w": {"dtype": "F32", "shape": [1]}}, bytes(4), None, "'w'.*entry must have exactly"),
    "extra field": ({"w": {**entry("U8", [1], 0, 1), "x": 1}}, bytes(1), None, "'w'.*entry must have exactly"),
    "overlap": ({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, bytes(6), None, "'b' overlaps tensor 'a'"),
    "gap": ({"a": entry("U8", [4], 0, 4), "b": entry("U8", [2], 6, 8)}, bytes(8), None, "2 unused bytes before tensor 'b'"),
    "leading gap": ({"a": entry("U8", [4], 2, 6)}, bytes(6), None, "before tensor 'a' \\(at the start"),
    "truncated": (GOOD, bytes(10), None, "'b' ends at byte .* truncated"),
    "trailing bytes": (GOOD, bytes(20), None, "6 trailing bytes"),
    "bad metadata": ({"__metadata__": {"k": 1}, **GOOD}, bytes(14), None, "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_files_raise_checkpoint_error_naming_file_and_key(tmp_path, case):
    header, data, header_len, pattern = CORRUPT[case]
    path = tmp_path / "bad.safetensors"
    if case == "tiny file":
        path.write_bytes(header)
    else:
        write_raw(path, header, data, header_len=header_len)
    with pytest.raises(CheckpointError, match=pattern) as info:
        SafetensorsTensorStore(path)
    assert str(path) in str(info.value)


def test_truncated_real_file_names_the_last_tensor(mixed_file, tmp_path):
    path, _ = mixed_file
    store = SafetensorsTensorStore(path)
    last = store.keys()[-1]
    while store.nbytes(last) == 0:
        last = store.keys()[store.keys().index(last) - 1]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=f"{last!r} ends at byte"):
        SafetensorsTensorStore(cut)


def test_valid_hand_written_file_with_empty_and_scalar_tensors(tmp_path):
    header = {
        "__metadata__": {"k": "v"},
        "s": entry("F64", [], 0, 8),
        "e": entry("F32", [0, 4], 8, 8),
        "v": entry("I16", [2], 8, 12),
    }
    data = struct.pack("<d", 1.5) + struct.pack("<hh", -3, 7)
    path = write_raw(tmp_path / "ok.safetensors", header, data)
    got = SafetensorsTensorStore(path).read_all()
    assert got["s"].shape == () and got["s"].item() == 1.5
    assert got["e"].shape == (0, 4) and got["e"].dtype == torch.float32
    assert got["v"].tolist() == [-3, 7]
    assert_bitwise(got, load_file(str(path)))


# --- property: random files agree with safetensors -------------------------------------------------------

_shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple)
_specs = st.lists(st.tuples(st.sampled_from(ALL_DTYPES), _shapes), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(specs=_specs, chunk=st.sampled_from([3, 16, 1 << 20]), workers=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_random_files_match_load_file(specs, chunk, workers, seed):
    tensors = {f"t{i}": random_tensor(shape, dtype, seed + i) for i, (dtype, shape) in enumerate(specs)}
    original = ts.CHUNK_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.safetensors")
        save_file(tensors, path)
        try:
            ts.CHUNK_BYTES = chunk
            store = SafetensorsTensorStore(path, read_workers=workers)
            got = store.read_all()
            half = store.read(list(tensors)[::2])
        finally:
            ts.CHUNK_BYTES = original
        ref = load_file(path)
    assert_bitwise(got, ref)
    assert_bitwise(half, {k: ref[k] for k in half})
