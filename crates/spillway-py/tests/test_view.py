"""Views through DLPack on the sim device (numpy), and the lifetime contract."""

import gc

import numpy as np
import pytest

import spillway

MiB = 1 << 20


def make_pool():
    return spillway.Pool(gpu_budget="4MiB", host_budget="32MiB", page_size="1MiB", device="sim")


def test_done_when_example():
    p = spillway.Pool(gpu_budget="64MiB", host_budget="256MiB", device="sim")
    b = p.alloc("x", 1 << 20)
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    p.write(b, 0, data.tobytes())
    with p.acquire(b) as view:
        arr = np.from_dlpack(view)
        assert arr.dtype == np.uint8 and arr.shape == (1 << 20,)
        assert np.array_equal(arr, data)
        assert not arr.flags.writeable  # a shared acquire is read-only


def test_view_is_zero_copy_and_on_the_cpu():
    p = make_pool()
    b = p.alloc("w", MiB)
    with p.acquire_mut(b) as view:
        assert view.device == "cpu" and view.__dlpack_device__() == (1, 0)
        assert view.contiguous and view.exclusive and view.held
        a1 = np.from_dlpack(view)
        a2 = np.from_dlpack(view)
        assert a1.ctypes.data == a2.ctypes.data  # the same memory, twice
        a1[:4] = [1, 2, 3, 4]
        assert list(a2[:4]) == [1, 2, 3, 4]
    assert not view.held


def test_write_through_acquire_mut_is_read_back():
    p = make_pool()
    bufs = [p.alloc(f"b{i}", MiB) for i in range(6)]  # 6 MiB through a 4 MiB GPU budget
    for i, b in enumerate(bufs):
        with p.acquire_mut(b) as view:
            arr = np.from_dlpack(view)
            arr[:] = np.arange(MiB, dtype=np.uint64).astype(np.uint8) ^ i
            del arr
    for i, b in enumerate(bufs):  # some were evicted (written back) in between
        want = (np.arange(MiB, dtype=np.uint64).astype(np.uint8) ^ i).tobytes()
        assert p.read(b, 0, MiB) == want
    assert p.stats()["d2h_bytes"] > 0


def test_a_multi_page_buffer_is_one_tensor():
    p = make_pool()
    b = p.alloc("multi", 2 * MiB + 5)
    payload = bytes(range(256)) * ((2 * MiB + 5) // 256) + bytes(range((2 * MiB + 5) % 256))
    p.write(b, 0, payload)
    with p.acquire(b) as view:  # a fresh pool puts the pages in consecutive frames
        assert view.pages == 3 and view.contiguous
        whole = np.from_dlpack(view)
        assert whole.shape == (2 * MiB + 5,) and whole.tobytes() == payload
        got = b"".join(np.from_dlpack(view.page(i)).tobytes() for i in range(view.pages))
        assert got == payload  # page by page too, at the same addresses
        assert np.from_dlpack(view.page(1)).ctypes.data == whole.ctypes.data + MiB
        assert np.from_dlpack(view.page(2)).shape == (5,)
        with pytest.raises(spillway.OutOfRangeError):
            view.page(3)
    with p.acquire_mut(b) as view:  # writable as one tensor as well
        np.from_dlpack(view)[MiB - 1:MiB + 1] = [7, 9]
    assert p.read(b, MiB - 1, 2) == bytes([7, 9])


def test_a_paged_view_is_read_page_by_page_only():
    """``paged=True``: the buffer is never shown as one array, even in consecutive frames
    (a one-page buffer is its page); its pages export as always, writable when
    exclusive."""
    p = make_pool()
    b = p.alloc("multi", 2 * MiB)
    one = p.alloc("one", MiB)
    payload = bytes(range(256)) * (2 * MiB // 256)
    p.write(b, 0, payload)
    with p.acquire(b) as view:  # consecutive frames: one array when asked for one
        assert view.contiguous
    with p.acquire(b, paged=True) as view:
        assert view.pages == 2 and not view.contiguous
        with pytest.raises(BufferError, match="page"):
            np.from_dlpack(view)
        got = b"".join(np.from_dlpack(view.page(i)).tobytes() for i in range(view.pages))
        assert got == payload
    with p.acquire_mut(b, paged=True) as view:
        np.from_dlpack(view.page(1))[:2] = [7, 9]
    assert p.read(b, MiB, 2) == bytes([7, 9])
    with p.acquire_mut(one, discard=True, paged=True) as view:
        assert view.contiguous  # one page
        np.from_dlpack(view)[:] = 3
    assert p.read(one, MiB - 1, 1) == bytes([3])


def test_pages_of_a_buffer_in_scattered_frames():
    p = make_pool()  # 4 frames of 1 MiB
    ones = [p.alloc(f"one{i}", MiB) for i in range(4)]
    where = {}
    for b in ones:  # fills the 4 frames; note where each landed
        with p.acquire(b) as view:
            where[b.name] = np.from_dlpack(view).ctypes.data
    by_addr = sorted(ones, key=lambda b: where[b.name])
    two = p.alloc("two", 2 * MiB)
    payload = bytes(range(256)) * (2 * MiB // 256)
    p.write(two, 0, payload)
    # Hold the 2nd and 4th frames: `two` can only get the 1st and 3rd, not adjacent.
    with p.acquire(by_addr[1]), p.acquire(by_addr[3]), p.acquire(two) as view:
        assert view.pages == 2 and not view.contiguous
        with pytest.raises(BufferError, match="page"):
            np.from_dlpack(view)
        got = b"".join(np.from_dlpack(view.page(i)).tobytes() for i in range(view.pages))
        assert got == payload


def test_view_after_exit_raises_and_never_crashes():
    p = make_pool()
    b = p.alloc("x", MiB)
    with p.acquire_mut(b) as view:
        arr = np.from_dlpack(view)
        arr[:] = 9
    with pytest.raises(spillway.ViewReleasedError):
        np.from_dlpack(view)
    with pytest.raises(spillway.ViewReleasedError):
        view.page(0).__dlpack__()
    view.release()  # a second release does nothing
    # Against the contract, but no crash: the array still points into the pool's memory,
    # which the array keeps alive even after the pool object is gone.
    others = [p.alloc(f"o{i}", MiB) for i in range(6)]
    for o in others:
        with p.acquire_mut(o):
            pass
    int(arr.sum())
    del p, others, b, view
    gc.collect()
    arr[:] = 1  # the pool's memory is still allocated: writes land, nothing faults
    assert int(arr[0]) == 1
    del arr
    gc.collect()


def test_exception_inside_with_releases():
    p = make_pool()
    b = p.alloc("x", MiB)
    with pytest.raises(RuntimeError):
        with p.acquire_mut(b) as view:
            raise RuntimeError("boom")
    assert not view.held
    with p.acquire_mut(b):  # not busy
        pass
