"""The pool through Python on the sim device: sizes, bytes round trips, stats, errors."""

import threading
import time

import pytest

import spillway

MiB = 1 << 20


def make_pool(**kw):
    args = dict(gpu_budget="4MiB", host_budget="16MiB", page_size="64KiB", device="sim")
    args.update(kw)
    return spillway.Pool(**args)


def test_sizes_accept_ints_and_strings():
    p = spillway.Pool(gpu_budget=8 * MiB, host_budget="32MiB", page_size="1MiB", device="sim")
    assert p.device == "sim"
    assert p.page_size == MiB
    s = p.stats()
    assert s["gpu_budget_bytes"] == 8 * MiB
    assert s["host_budget_bytes"] == 32 * MiB


@pytest.mark.parametrize(
    "arg,value",
    [
        ("gpu_budget", "lots"),
        ("gpu_budget", -1),
        ("host_budget", "12 parsecs"),
        ("host_budget", 1.5),
        ("page_size", "3KiB"),
        ("page_size", True),
        ("device", "tpu"),
        ("policy", "psychic"),
        ("copy_bytes_in_flight", "lots"),
        ("copy_bytes_in_flight", "1KiB"),  # less than a page (2 MiB by default)
    ],
)
def test_bad_argument_is_a_value_error_naming_it(arg, value):
    kw = dict(gpu_budget="4MiB", host_budget="16MiB", device="sim")
    kw[arg] = value
    with pytest.raises(ValueError, match=arg):
        spillway.Pool(**kw)


def test_invalid_config_is_a_config_error():
    with pytest.raises(spillway.ConfigError) as e:
        spillway.Pool(gpu_budget="64KiB", host_budget="16MiB", page_size="1MiB", device="sim")
    assert isinstance(e.value, ValueError)
    assert e.value.field == "gpu_budget_bytes"


@pytest.mark.parametrize("in_flight", ["64KiB", "1MiB"])
def test_written_bytes_come_back_with_any_copies_in_flight(in_flight):
    # From one 64 KiB page in flight each way to sixteen: 6 MiB of buffers written on the
    # GPU through a 4 MiB budget come back as written.
    np = pytest.importorskip("numpy")
    p = make_pool(copy_bytes_in_flight=in_flight)
    bufs = [p.alloc(f"b{i}", MiB) for i in range(6)]
    for step in range(2):
        for i, b in enumerate(bufs):
            with p.acquire_mut(b) as view:
                arr = np.from_dlpack(view) if view.contiguous else None
                if arr is None:
                    for k in range(view.pages):
                        np.from_dlpack(view.page(k))[:] = 10 * step + i
                else:
                    arr[:] = 10 * step + i
        p.step()
    for i, b in enumerate(bufs):
        assert p.read(b, 0, MiB) == bytes([10 + i]) * MiB
    assert p.stats()["d2h_bytes"] > 0  # the budget made them leave the GPU


def test_every_byte_round_trips():
    p = make_pool()
    sizes = [1, 4095, 64 * 1024, 64 * 1024 + 1, 3 * MiB + 17]
    bufs = []
    for i, n in enumerate(sizes):
        b = p.alloc(f"b{i}", n)
        assert b.nbytes == n and len(b) == n and b.name == f"b{i}"
        data = bytes((j * 31 + i) % 251 for j in range(n))
        p.write(b, 0, data)
        bufs.append((b, data))
    for b, data in bufs:  # after the others went through the GPU budget
        assert p.read(b, 0, b.nbytes) == data
    b, data = bufs[-1]
    p.write(b, 100_000, bytearray(b"\xff" * 5000))
    p.write(b, 200_000, memoryview(b"\xee" * 10))
    got = p.read(b, 99_999, 5002)
    assert got == data[99_999:100_000] + b"\xff" * 5000 + data[105_000:105_001]
    assert p.read(b, 200_000, 10) == b"\xee" * 10
    for b, _ in bufs:
        p.free(b)
    assert p.stats()["buffers"] == 0


def test_new_buffers_read_as_zeros():
    p = make_pool()
    b = p.alloc("x", "128KiB")
    p.write(b, 0, b"\x01" * (128 * 1024))
    p.free(b)
    c = p.alloc("y", 128 * 1024)
    assert p.read(c, 0, 128 * 1024) == bytes(128 * 1024)


def test_stats_count_acquires_and_bytes_each_way():
    p = make_pool()
    bufs = [p.alloc(f"layer{i}", MiB) for i in range(8)]  # 8 MiB over a 4 MiB GPU budget
    for _ in range(3):
        for b in bufs:
            with p.acquire_mut(b):
                pass
        p.step()
    s = p.stats()
    assert s["acquires"] == 24
    assert s["stalls"] == s["acquires"] - s["hits"]
    assert s["steps"] == 3
    assert s["h2d_bytes"] > 0 and s["d2h_bytes"] > 0
    assert s["gpu_bytes_peak"] <= s["gpu_budget_bytes"]
    assert s["host_bytes"] == 8 * MiB
    for key in ("prefetch_loads", "prefetch_wasted_bytes", "stall_s", "evictions_dirty"):
        assert key in s
    # The pool's own time: 24 acquires planned on this thread, 24 fenced releases and the
    # copies' completions handled on the device's; on sim no buffer needs a mapping.
    assert s["planning_s"] > 0 and s["device_planning_s"] > 0
    assert s["lock_wait_s"] >= 0 and s["device_lock_wait_s"] >= 0 and s["view_s"] >= 0
    assert s["mapping_s"] == 0 and s["pages_remapped"] == 0


def test_pool_full_error_has_the_numbers():
    p = make_pool(host_budget="1MiB", gpu_budget="1MiB")
    p.alloc("a", 512 * 1024)
    with pytest.raises(spillway.PoolFullError) as e:
        p.alloc("b", 1 << 20)
    err = e.value
    assert isinstance(err, spillway.SpillwayError) and isinstance(err, MemoryError)
    assert err.requested_bytes == 1 << 20
    assert err.needed_pages == 16 and err.free_pages == 8 and err.total_pages == 16


def test_typed_errors():
    p = make_pool()
    with pytest.raises(spillway.BufferTooLargeError) as e:
        p.alloc("big", "5MiB")
    assert e.value.budget_bytes == 4 * MiB and e.value.requested_bytes == 5 * MiB
    with pytest.raises(spillway.EmptyBufferError):
        p.alloc("empty", 0)
    b = p.alloc("b", 1000)
    with pytest.raises(spillway.OutOfRangeError) as e:
        p.read(b, 900, 200)
    assert (e.value.offset, e.value.len, e.value.bytes) == (900, 200, 1000)
    with pytest.raises(IndexError):
        p.write(b, 1000, b"x")
    v = p.acquire(b)
    with pytest.raises(spillway.BufferHeldError) as e:
        p.free(b)
    assert e.value.holders == 1 and e.value.buffer == b.id
    with pytest.raises(spillway.BufferBusyError):
        p.acquire_mut(b)
    v.release()
    p.free(b)
    with pytest.raises(spillway.BufferFreedError) as e:
        p.free(b)
    assert e.value.buffer == b.id
    with pytest.raises(spillway.BufferFreedError):
        p.read(b, 0, 1)


def test_held_acquires_over_the_budget_fail_at_once():
    p = make_pool()
    a, b = p.alloc("a", "3MiB"), p.alloc("b", "2MiB")
    with p.acquire(a):
        with pytest.raises(spillway.HeldAcquiresExceedBudgetError) as e:
            p.acquire(b)
    assert e.value.budget_bytes == 4 * MiB and e.value.held_bytes == 3 * MiB
    with p.acquire(b):  # fine once `a` is released
        pass


def test_unavailable_device_is_typed():
    try:
        p = spillway.Pool(gpu_budget="4MiB", host_budget="16MiB", device="cuda")
    except spillway.DeviceUnavailableError as e:
        assert e.backend == "cuda" and e.reason
    else:  # a machine with a GPU
        assert p.device == "cuda"


def test_concurrent_acquires_from_two_threads():
    p = make_pool()
    bufs = [p.alloc(f"b{i}", MiB) for i in range(16)]
    done = []

    def worker(k):
        for _ in range(20):
            for b in bufs[k::2]:
                with p.acquire(b):
                    pass
        done.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(done) == [0, 1]


def test_a_long_call_releases_the_gil():
    """Another Python thread runs during one long `write`: it could not if the call
    held the GIL."""
    p = spillway.Pool(gpu_budget="256MiB", host_budget="256MiB", device="sim")
    b = p.alloc("big", "192MiB")
    data = bytes(192 * MiB)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    start = time.perf_counter()
    p.write(b, 0, data)
    end = time.perf_counter()
    stop.set()
    t.join()
    margin = (end - start) / 4
    inside = [x for x in ticks if start + margin < x < end - margin]
    assert end - start > 0.004, "the write was too quick to tell"
    assert inside, f"no tick during a {end - start:.3f}s write: the GIL was held"


def test_acquire_mut_discard_copies_nothing_in_and_its_writes_are_kept():
    np = pytest.importorskip("numpy")
    p = make_pool(gpu_budget="1MiB", policy="on_demand")  # pages leave the GPU at release
    a, b = p.alloc("a", MiB), p.alloc("b", MiB)
    p.write(a, 0, bytes([7]) * MiB)
    with p.acquire(b):
        pass
    h2d = p.stats()["h2d_bytes"]
    with p.acquire_mut(a, discard=True) as view:
        arr = np.from_dlpack(view)
        arr[:] = 3  # the old 7s are not read: undefined until written
    # The host read waits for the write-back (dirty at once, it left the GPU at release).
    assert p.read(a, 0, MiB) == bytes([3]) * MiB
    s = p.stats()
    assert s["h2d_bytes"] == h2d  # nothing copied to the GPU
    assert s["overwrite_pages"] == MiB // (64 << 10)
    assert s["d2h_bytes"] == MiB
    with p.acquire(a) as view:  # a plain acquire loads the new bytes
        assert int(np.from_dlpack(view).sum()) == 3 * MiB


def test_a_learned_pool_reserves_frames_for_overwrites_and_a_wrong_guess_reads_the_bytes():
    """Each step overwrites `g` (discard) between reads of other buffers: the learned
    policy reserves `g`'s frames ahead, no copy, so the discard finds them; when a step
    then reads `g` instead, the reservation is given up and the last bytes written come
    back from the host tier."""
    np = pytest.importorskip("numpy")
    p = make_pool(gpu_budget="256KiB", host_budget="4MiB", policy="learned")
    half = 128 << 10
    ws = [p.alloc(f"w{i}", half) for i in range(3)]
    g = p.alloc("g", half)

    def read(buf):
        with p.acquire(buf):
            pass

    for k in range(1, 6):
        read(ws[0])
        read(ws[1])
        with p.acquire_mut(g, discard=True) as view:
            for i in range(view.pages):  # its frames need not be consecutive
                np.from_dlpack(view.page(i))[:] = k
        read(ws[2])
        p.step()
    s = p.stats()
    assert s["reserved_pages"] > 0
    assert s["overwrite_pages"] >= s["reserved_pages"] - s["reserved_pages_missed"]
    read(ws[0])
    read(ws[1])
    with p.acquire(g) as view:  # predicted to overwrite; read instead
        assert all((np.from_dlpack(view.page(i)) == 5).all() for i in range(view.pages))
    assert p.read(g, 0, half) == bytes([5]) * half
