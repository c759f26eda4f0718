"""gpu_arena.weight_sync's parts that need no GPU and no torch: how buckets are cut and what a
WeightBucket carries through a pickle. The sends and receives themselves run on the GPU
(bench/gpu/weight_sync.py, tests/gpu/gpu_weight_sync_faults.py); the lifetime of what they
send runs in CI in the native allocator's harness (tests/torch_native/ipc_lifetime.cpp)."""

import pickle

import pytest

from gpu_arena import weight_sync
from gpu_arena.handle import ShareHandle


class FakeTensor:
    """What buckets() reads of a tensor."""

    def __init__(self, nbytes, requires_grad=False):
        self.nbytes, self.requires_grad = nbytes, requires_grad
        self.detached = False

    def numel(self):
        return self.nbytes // 2

    def element_size(self):
        return 2

    def detach(self):
        t = FakeTensor(self.nbytes)
        t.detached = True
        return t


def test_buckets_hold_at_most_their_bytes_in_order_and_a_large_tensor_alone():
    sizes = [300, 300, 500, 2000, 100, 100, 1000]
    named = [(f"p{i}", FakeTensor(n)) for i, n in enumerate(sizes)]
    got = list(weight_sync.buckets(named, bucket_bytes=1000))
    assert [names for names, _ in got] == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"], ["p6"]]
    assert [n for names, _ in got for n in names] == [n for n, _ in named]
    for names, tensors in got:
        assert len(names) == len(tensors)
        total = sum(t.nbytes for t in tensors)
        assert total <= 1000 or len(tensors) == 1
    assert list(weight_sync.buckets([], bucket_bytes=1000)) == []


def test_buckets_detach_parameters_that_require_grad():
    (names, tensors), = weight_sync.buckets([("w", FakeTensor(10, requires_grad=True))])
    assert names == ["w"] and tensors[0].detached


def handle(i):
    return ShareHandle(b"GPUARENA" + bytes([i]) * 120)


def test_a_bucket_pickles_to_its_handles_entries_and_names():
    b = weight_sync.WeightBucket([handle(1), handle(2)],
                                 [(0, 0, "bfloat16", (4, 8), (8, 1), 0),
                                  (1, 512, "float32", (16,), (1,), 2)], names=["a", "b"])
    back = pickle.loads(pickle.dumps(b))
    assert back.handles == b.handles and all(isinstance(h, ShareHandle) for h in back.handles)
    assert back.entries == b.entries and back.names == ["a", "b"] and len(back) == 2


def test_a_bucket_refuses_names_that_do_not_match_its_tensors():
    with pytest.raises(ValueError, match="names"):
        weight_sync.WeightBucket([handle(1)], [(0, 0, "uint8", (1,), (1,), 0)], names=["a", "b"])


def test_a_receiver_starts_empty_and_prunes_nothing():
    rx = weight_sync.Receiver()
    assert len(rx) == 0 and rx.prune() == 0
    rx.close()


class FakeDtype:
    def __init__(self, itemsize):
        self.itemsize = itemsize


class FakeTorch:
    """The part of torch weight_sync's views use: dtypes and their item sizes."""

    dtype = FakeDtype
    uint8 = FakeDtype(1)
    bfloat16 = FakeDtype(2)


class FakeWhole:
    """The uint8 tensor over one imported allocation."""

    def __init__(self, handle):
        self.handle, self.nbytes = handle, 4096

    def numel(self):
        return self.nbytes

    def view(self, dtype):
        return self

    def __getitem__(self, s):
        return self

    def as_strided(self, shape, stride, offset):
        return (self.handle, tuple(shape), tuple(stride), offset)


def test_a_receiver_imports_what_it_does_not_hold_and_prunes_what_no_bucket_used(monkeypatch):
    imported = []

    def fake_import_all(torch, handles):
        imported.append([bytes(h)[8] for h in handles])
        return [FakeWhole(bytes(h)[8]) for h in handles]

    monkeypatch.setattr(weight_sync, "_import_all", fake_import_all)
    monkeypatch.setattr(weight_sync, "_torch", lambda: FakeTorch)
    monkeypatch.setattr(weight_sync, "_dtypes", {"bfloat16": FakeTorch.bfloat16})

    def bucket(*ids):
        return weight_sync.WeightBucket([handle(i) for i in ids],
                                        [(j, 0, "bfloat16", (8,), (1,), 0) for j in range(len(ids))])

    rx = weight_sync.Receiver()
    got = rx.receive(bucket(1, 2))
    assert imported == [[1, 2]] and [g[0] for g in got] == [1, 2] and len(rx) == 2
    got = rx.receive(bucket(2, 3))  # 2 is held: only 3 is imported
    assert imported[-1] == [3] and [g[0] for g in got] == [2, 3] and len(rx) == 3
    assert rx.prune() == 0  # every held import was used since the last prune
    rx.receive(bucket(3))
    assert len(imported) == 2  # 3 is held: no import
    assert rx.prune() == 2 and len(rx) == 1  # 1 and 2 went unused: closed
    rx.close()
    assert len(rx) == 0
