"""The same views through torch.from_dlpack (skipped when torch is not installed)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI runs numpy only)")

import spillway  # noqa: E402


def test_torch_from_dlpack_round_trip():
    p = spillway.Pool(gpu_budget="4MiB", host_budget="16MiB", page_size="1MiB", device="sim")
    b = p.alloc("t", 1 << 20)
    with p.acquire_mut(b) as view:
        t = torch.from_dlpack(view)
        assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.numel() == 1 << 20
        t.fill_(5)
    assert p.read(b, 0, 16) == b"\x05" * 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_torch_cuda_view():
    p = spillway.Pool(gpu_budget="64MiB", host_budget="256MiB", page_size="2MiB", device="cuda")
    b = p.alloc("t", 8 << 20)
    p.write(b, 0, b"\x03" * (8 << 20))
    with p.acquire_mut(b) as view:
        t = torch.from_dlpack(view)
        assert t.is_cuda
        assert int(t[:2 << 20].sum()) == 3 * (2 << 20)
        t.add_(1)
        torch.cuda.synchronize()
    assert p.read(b, 0, 4) == b"\x04" * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_release_waits_for_the_consumer_stream():
    # 4 frames of 2 MiB; `a` fills them. A kernel queued on a side stream reads `a` behind
    # ~0.1 s of sleep; the view is released at once, and `o` (4 pages) must evict all of
    # `a`. The DLPack stream contract: `o`'s copies may not land in `a`'s frames before the
    # side stream has read them, so the sum is `a`'s.
    p = spillway.Pool(gpu_budget="8MiB", host_budget="64MiB", page_size="2MiB", device="cuda")
    a, o = p.alloc("a", 8 << 20), p.alloc("o", 8 << 20)
    p.write(a, 0, b"\x01" * (8 << 20))
    p.write(o, 0, b"\x02" * (8 << 20))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with p.acquire(a) as view:
            t = torch.from_dlpack(view)  # passes `side` as the consumer stream
            torch.cuda._sleep(200_000_000)
            total = t.to(torch.int64).sum()
    with p.acquire(o) as view:
        assert int(torch.from_dlpack(view)[:4].sum()) == 8
    side.synchronize()
    assert int(total) == 8 << 20


# ---- spillway.torch.offload on the sim device (CPU tensors) -----------------------------

import copy  # noqa: E402

import spillway.torch as st  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

STEPS = 3


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class Net(torch.nn.Module):
    def __init__(self, d=32, blocks=4, ckpt=False):
        super().__init__()
        self.embed = torch.nn.Linear(16, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = torch.nn.Linear(d, 8, bias=False)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.ckpt else b(h)
        return self.head(h)


def train(model, steps, opt_step, zero, grads_of, device="cpu", shapes=((32, 16), (32, 8))):
    """`steps` of MSE training on random inputs and targets of `shapes` (seeded): the
    losses and what `grads_of` returns after each backward."""
    torch.manual_seed(1)
    xs = [torch.randn(*shapes[0]).to(device) for _ in range(steps)]
    ys = [torch.randn(*shapes[1]).to(device) for _ in range(steps)]
    losses, grads = [], []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append(grads_of())
        opt_step()
        zero()
    return losses, grads


def train_reference(ref, device="cpu", cls=torch.optim.AdamW, kwargs=None,
                    shapes=((32, 16), (32, 8))):
    """Trains `ref` as it is (`cls`, AdamW by default): its losses and gradients per step."""
    ref_opt = cls(ref.parameters(), **(kwargs or {"lr": 1e-2, "foreach": False}))
    return train(ref, STEPS, ref_opt.step, ref_opt.zero_grad,
                 lambda: {n: p.grad.clone() for n, p in ref.named_parameters()}, device=device,
                 shapes=shapes)


def train_offloaded(off, handle, device="cpu"):
    """Trains the offloaded `off` through the pool's optimizer: losses and gradients."""
    opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-2, foreach=False)
    return train(off, STEPS, opt.step, opt.zero_grad, lambda: st.gradients(handle), device=device)


def assert_same_gradients(grads, ref_grads):
    for g, rg in zip(grads, ref_grads):
        assert g.keys() == rg.keys()
        for name in rg:
            assert torch.equal(g[name], rg[name]), name


def assert_same_training(handle, ref, run, ref_run):
    """The offloaded run's losses and gradients (`run`) and its weights after it are the
    reference's, bit for bit."""
    (losses, grads), (ref_losses, ref_grads) = run, ref_run
    assert losses == ref_losses
    assert_same_gradients(grads, ref_grads)
    params = st.parameters(handle)
    for name, p in ref.named_parameters():
        assert torch.equal(params[name], p.detach()), name


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_offload_is_bit_identical_to_the_model_without_it(ckpt):
    torch.manual_seed(0)
    ref = Net(ckpt=ckpt)
    off = copy.deepcopy(ref)
    ref_losses, ref_grads = train_reference(ref)

    # 64 KiB pages (every buffer one page: one tensor on sim), 8 of them on the "GPU":
    # weights, gradients and Adam state in 42 buffers go through evictions every step.
    pool = spillway.Pool(gpu_budget="512KiB", host_budget="64MiB", page_size="64KiB",
                         device="sim")
    handle = st.offload(off, pool)
    assert all(p.numel() == 0 for p in off.parameters())  # the storage is the pool's
    losses, grads = train_offloaded(off, handle)

    assert losses == ref_losses  # bit-identical, every step
    assert handle.saved_tensors_packed > 0  # backward read the weights as acquired then
    assert_same_gradients(grads, ref_grads)
    params = st.parameters(handle)
    for name, p in ref.named_parameters():
        assert torch.equal(params[name], p.detach()), name
    stats = pool.stats()
    assert stats["steps"] == STEPS
    assert stats["evictions_dirty"] > 0 and stats["h2d_bytes"] > 0  # it really streamed
    assert stats["gpu_bytes_peak"] <= stats["gpu_budget_bytes"]


def test_the_pools_device_matches_with_or_without_an_index():
    assert st._same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert st._same_device(torch.device("cpu"), torch.device("cpu", 0))
    assert not st._same_device(torch.device("cuda", 0), torch.device("cpu"))
    assert not st._same_device(torch.device("cuda", 0), torch.device("cuda", 1))


def test_saved_weights_are_the_pools_whatever_index_the_device_carries():
    """On cuda a tensor reports ``cuda:0`` where the handle said ``cuda``, and the two did
    not compare equal: autograd's saved weights were not recognised as the pool's, so
    backward read them at the frames of the forward's acquire after other pages had
    been loaded there (training not bit-identical on the H200). The same mismatch on
    sim: the handle's device with an index, the tensors' without."""
    torch.manual_seed(0)
    ref = Net()
    off = copy.deepcopy(ref)
    ref_losses, ref_grads = train_reference(ref)
    pool = spillway.Pool(gpu_budget="512KiB", host_budget="64MiB", page_size="64KiB",
                         device="sim")
    handle = st.offload(off, pool)
    handle.device = torch.device("cpu", 0)
    losses, grads = train_offloaded(off, handle)
    assert handle.saved_tensors_packed > 0
    assert losses == ref_losses
    assert_same_gradients(grads, ref_grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_offload_on_cuda_is_bit_identical_to_the_model_without_it():
    torch.manual_seed(0)
    ref = Net().cuda()
    off = copy.deepcopy(ref)
    ref_losses, ref_grads = train_reference(ref, device="cuda")
    # 2 MiB pages, every buffer one page, 4 frames for 42 buffers: a group's frame is
    # taken by others between its forward and its backward.
    pool = spillway.Pool(gpu_budget="8MiB", host_budget="256MiB", page_size="2MiB",
                         device="cuda")
    handle = st.offload(off, pool)
    losses, grads = train_offloaded(off, handle, device="cuda")
    assert handle.saved_tensors_packed > 0
    assert losses == ref_losses
    assert_same_gradients(grads, ref_grads)
    assert pool.stats()["evictions_dirty"] > 0


def test_offload_inference_streams_weights_and_steps_the_pool():
    torch.manual_seed(0)
    ref = Net()
    off = copy.deepcopy(ref)
    pool = spillway.Pool(gpu_budget="512KiB", host_budget="16MiB", page_size="64KiB",
                         device="sim")
    st.offload(off, pool)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = ref(x)
        for _ in range(3):
            assert torch.equal(off(x), want)
    stats = pool.stats()
    assert stats["steps"] == 3 and stats["d2h_bytes"] == 0  # shared acquires: no write-back
    assert stats["evictions_clean"] > 0


def test_offload_with_groups_of_many_pages_is_bit_identical():
    torch.manual_seed(0)
    ref = Net(d=128)  # fc1, fc2: 128 KiB of weights each, 2 pages of 64 KiB
    off = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ref_losses, _ = train(ref, STEPS, ref_opt.step, ref_opt.zero_grad, lambda: None)
    pool = spillway.Pool(gpu_budget="1MiB", host_budget="64MiB", page_size="64KiB",
                         device="sim")
    handle = st.offload(off, pool)
    opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-2, foreach=False)
    losses, _ = train(off, STEPS, opt.step, opt.zero_grad, lambda: None)
    assert losses == ref_losses
    params = st.parameters(handle)
    for name, p in ref.named_parameters():
        assert torch.equal(params[name], p.detach()), name


def test_a_scattered_buffer_is_gathered_and_written_back():
    MiB = 1 << 20
    p = spillway.Pool(gpu_budget="4MiB", host_budget="32MiB", page_size="1MiB", device="sim")
    ones = [p.alloc(f"one{i}", MiB) for i in range(4)]
    where = {}
    for b in ones:
        with p.acquire(b) as view:
            where[b.name] = torch.from_dlpack(view).data_ptr()
    by_addr = sorted(ones, key=lambda b: where[b.name])
    two = p.alloc("two", 2 * MiB)
    p.write(two, 0, bytes([1]) * (2 * MiB))
    with p.acquire(by_addr[1]), p.acquire(by_addr[3]):  # `two` gets frames 1 and 3 of 4
        view = p.acquire_mut(two)
        assert not view.contiguous
        opened = st._Opened(view)
        assert opened.base.numel() == 2 * MiB and int(opened.base.sum()) == 2 * MiB
        opened.base[MiB - 1:MiB + 1] = 5  # across the page boundary
        opened.close()
        view.release()
    assert p.read(two, MiB - 2, 4) == bytes([1, 5, 5, 1])


def test_discarding_overwritten_gradients_moves_fewer_bytes_to_the_gpu():
    """Gradients at their first store of a step are acquired with ``discard=True``: the
    same training, bit-identical, copies fewer bytes host to device per step."""
    torch.manual_seed(0)
    base = Net()
    runs = {}
    for discard in (False, True):
        model = copy.deepcopy(base)
        pool = spillway.Pool(gpu_budget="512KiB", host_budget="64MiB", page_size="64KiB",
                             device="sim")
        handle = st.offload(model, pool)
        handle.discard_overwritten = discard
        opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-2, foreach=False)
        losses, grads = train(model, STEPS, opt.step, opt.zero_grad,
                              lambda: st.gradients(handle))
        runs[discard] = (losses, grads, st.parameters(handle), pool.stats())
    (l0, g0, p0, before), (l1, g1, p1, after) = runs[False], runs[True]
    assert l1 == l0
    for a, b in zip(g0, g1):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(p0[n], p1[n]) for n in p0)
    assert before["overwrite_pages"] == 0 and after["overwrite_pages"] > 0
    print(f"h2d bytes/step: {before['h2d_bytes'] / STEPS:.0f} -> {after['h2d_bytes'] / STEPS:.0f}; "
          f"d2h bytes/step: {before['d2h_bytes'] / STEPS:.0f} -> {after['d2h_bytes'] / STEPS:.0f}")
    # Each page overwritten instead of loaded is one page fewer copied in.
    page = before["page_bytes"]
    assert after["h2d_bytes"] < before["h2d_bytes"]
    assert before["h2d_bytes"] - after["h2d_bytes"] <= after["overwrite_pages"] * page


def test_a_profile_shows_the_pools_acquires():
    """Under torch.profiler each acquire is a `spillway.acquire` range (one per acquire:
    forward, backward, gradients, optimizer), so a profile tells the pool's waits apart
    from the model's own time; outside a profile nothing is recorded."""
    torch.manual_seed(0)
    off = Net(blocks=2)
    pool = spillway.Pool(gpu_budget="512KiB", host_budget="16MiB", page_size="64KiB",
                         device="sim")
    handle = st.offload(off, pool)
    opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-2, foreach=False)
    x, y = torch.randn(4, 16), torch.randn(4, 8)

    def step():
        torch.nn.functional.mse_loss(off(x), y).backward()
        opt.step()
        opt.zero_grad()
    step()  # the optimizer state moves into the pool at the first step
    before = pool.stats()["acquires"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    acquires = pool.stats()["acquires"] - before
    ranges = [e for e in prof.events() if e.name == "spillway.acquire"]
    assert acquires > 0 and len(ranges) == acquires
    assert not getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


class TwoMatrices(torch.nn.Module):
    """A module with two large parameters of its own (one group, two parts) and a
    small one (a third part)."""

    def __init__(self, d=256):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(d, 2 * d) / d)
        self.b = torch.nn.Parameter(torch.randn(2 * d, d) / d)
        self.scale = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x @ self.a).relu() @ self.b * self.scale


def test_a_groups_large_parameters_are_stepped_a_part_at_a_time():
    """Each parameter of at least PART_MIN_PAGES pages has gradient and state buffers of
    its own, so the optimizer holds the group's weights and one part's gradients and
    state: a budget too small for the whole group's weights, gradients and Adam state
    at once trains, bit-identical to the model without offload."""
    torch.manual_seed(0)
    ref = TwoMatrices()
    off = copy.deepcopy(ref)
    page = 64 << 10
    # a, b: 512 KiB = 8 pages each; weights 16 pages and a bit (17), each part's
    # gradient 8 and Adam state 16: 41 pages at once. The whole group at once would be
    # 17 + 17 + 33 = 67 pages.
    pool = spillway.Pool(gpu_budget=48 * page, host_budget="64MiB", page_size=page,
                         device="sim")
    handle = st.offload(off, pool)
    (g,) = handle.groups
    assert [[s.name for s in p.slots] for p in g.parts] == [["a"], ["b"], ["scale"]]
    assert [p.name for p in g.parts] == ["<root>.a", "<root>.b", "<root>.rest"]

    shapes = ((8, 256), (8, 256))
    ref_run = train_reference(ref, shapes=shapes)
    opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-2, foreach=False)
    run = train(off, STEPS, opt.step, opt.zero_grad, lambda: st.gradients(handle),
                shapes=shapes)
    assert_same_training(handle, ref, run, ref_run)
    stats = pool.stats()
    assert stats["gpu_bytes_peak"] <= 48 * page
    assert all(p.state_buf is not None and p.state_buf.nbytes == 2 * p.grad_buf.nbytes
               for p in g.parts[:2])


def test_cuts_split_a_tensor_at_every_buffers_page_boundaries():
    # 100 elements of 4 bytes at offset 256 of 512-byte pages: page boundaries at bytes
    # 512, 1024 -> elements 64, 192 (past the end: none); at offset 0: element 128.
    assert st._cuts(100, 4, (256,), 512) == [0, 64, 100]
    assert st._cuts(100, 4, (256, 0), 512) == [0, 64, 100]
    assert st._cuts(300, 4, (256, 0), 512) == [0, 64, 128, 192, 256, 300]
    assert st._cuts(10, 2, (0,), 512) == [0, 10]


OPTIMIZERS = {  # class, arguments, state tensors per parameter
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "foreach": False}, 2),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1,
                                        "foreach": False}, 3),
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True,
                                       "foreach": False}, 1),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "centered": True,
                                      "foreach": False}, 3),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}, 2),
    "radam": (torch.optim.RAdam, {"lr": 1e-2, "foreach": False}, 2),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2, "foreach": False}, 2),
}


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_chunked_and_whole_optimizer_steps_are_bit_identical(name, chunked):
    """An elementwise optimizer stepped page by page (the default for it) gives the bits
    of the same optimizer stepped on the un-offloaded model, as stepping whole does; and
    chunked, no buffer of the optimizer phase is acquired as one array."""
    cls, kwargs, states = OPTIMIZERS[name]
    torch.manual_seed(0)
    # a, b: 512 KiB = 8 pages each (own parts), scale: the rest. The optimizer holds the
    # weights (17 pages), a part's gradients (8) and state (8 a tensor); everything is
    # 17 pages of weights, as many of gradients and of each state tensor.
    ref = TwoMatrices()
    off = copy.deepcopy(ref)
    page = 64 << 10
    budget = (17 + 8 + 8 * states + 4) * page
    assert budget < 17 * (2 + states) * page
    pool = spillway.Pool(gpu_budget=budget, host_budget="64MiB", page_size=page,
                         device="sim")
    handle = st.offload(off, pool)
    shapes = ((8, 256), (8, 256))
    ref_run = train_reference(ref, cls=cls, kwargs=kwargs, shapes=shapes)

    opt = st.Optimizer(cls, handle, chunked=chunked, **kwargs)
    assert opt.chunked == chunked
    acquired = []  # (paged, whole buffer shown as one array) of the optimizer's acquires
    acquire = st._acquire

    def counted(pool_, buf, exclusive=False, discard=False, paged=False):
        acquired.append(paged)
        return acquire(pool_, buf, exclusive, discard, paged)

    def step():
        st._acquire = counted
        try:
            opt.step()
        finally:
            st._acquire = acquire
    run = train(off, STEPS, step, opt.zero_grad, lambda: st.gradients(handle), shapes=shapes)
    assert_same_training(handle, ref, run, ref_run)
    assert acquired and all(acquired) == chunked and any(acquired) == chunked
    (g,) = handle.groups
    if chunked:  # a and b: 8 pages each; their weights at offsets 0 and 512 KiB
        assert [len(p.chunks) for p in g.parts[:2]] == [8, 8]
    stats = pool.stats()
    assert stats["evictions_dirty"] > 0 and stats["gpu_bytes_peak"] <= budget


def test_a_large_parameters_buffers_share_its_page_boundaries():
    """A large parameter's gradient starts at its weights' offset within a page, and
    each state key's copy of the gradient layout starts a whole number of pages later:
    the page boundaries of weights, gradients and state fall at the same elements."""
    page = 64 << 10

    class Offset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.Parameter(torch.randn(300))  # 1200 B: `big` at 1280
            self.big = torch.nn.Parameter(torch.randn(256, 256) / 256)  # 4 pages, 5 spanned

        def forward(self, x):
            return (x @ self.big).sum() + self.small.sum()

    torch.manual_seed(0)
    ref = Offset()
    off = copy.deepcopy(ref)
    pool = spillway.Pool(gpu_budget=24 * page, host_budget="64MiB", page_size=page,
                         device="sim")
    handle = st.offload(off, pool)
    (g,) = handle.groups
    big_part = g.parts[0]
    (big,) = big_part.slots
    assert big.offset == 1280 and big.part_offset == 1280
    opt = st.Optimizer(torch.optim.AdamW, handle, lr=1e-2, foreach=False)
    assert len(big_part.chunks) == 5  # one per page the weights span
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(4, 256)
    for model, o in ((ref, ref_opt), (off, opt)):
        for _ in range(2):
            model(x).backward()
            o.step()
            o.zero_grad()
    assert big_part.state_keys == ["exp_avg", "exp_avg_sq"]
    assert big_part.state_span == 5 * page
    assert big_part.state_offset(1, big) == 5 * page + 1280
    assert big_part.state_buf.nbytes == 5 * page + big_part.nbytes
    params = st.parameters(handle)
    for pname, p in ref.named_parameters():
        assert torch.equal(params[pname], p.detach()), pname


class Gated(torch.nn.Module):
    """A 0-d parameter (its Adam state is 0-d too) and one used only from the second
    step, beside a matrix: all small, one part."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.late = torch.nn.Parameter(torch.randn(64) / 8)
        self.use_late = False

    def forward(self, x):
        y = (x @ self.w) * self.scale
        return y + self.late if self.use_late else y


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_state_of_a_scalar_and_of_a_late_parameter_is_kept(chunked):
    """Whole, the 0-d parameter's state is 0-d and stays with the inner optimizer
    (nothing of it in the state buffer); chunked, its piece is a one-element vector whose
    state is pooled like any other. The parameter with no gradient in the part's first
    step has its state moved into the buffer at its own first step. Bit-identical to the
    model without offload either way."""
    torch.manual_seed(0)
    ref = Gated()
    off = copy.deepcopy(ref)
    pool = spillway.Pool(gpu_budget="512KiB", host_budget="16MiB", page_size="64KiB",
                         device="sim")
    handle = st.offload(off, pool)
    runs = []
    for model, opt in ((ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)),
                       (off, st.Optimizer(torch.optim.AdamW, handle, chunked=chunked,
                                          lr=1e-2, foreach=False))):
        def zero(model=model, opt=opt):
            opt.zero_grad()
            model.use_late = True  # from the second step on
        runs.append(train(model, STEPS, opt.step, zero, lambda: None, shapes=((4, 64), (4, 64))))
    assert runs[0][0] == runs[1][0]
    params = st.parameters(handle)
    for name, p in ref.named_parameters():
        assert torch.equal(params[name], p.detach()), name
    (g,) = handle.groups
    (part,) = g.parts
    both = [(0, "exp_avg"), (1, "exp_avg_sq")]
    scale = both if chunked else []
    assert {sl.name: sl.pooled for sl in part.slots} == {"w": both, "scale": scale, "late": both}


def test_an_optimizer_that_makes_its_state_when_constructed_is_refused():
    pool = spillway.Pool(gpu_budget="512KiB", host_budget="16MiB", page_size="64KiB",
                         device="sim")
    handle = st.offload(Gated(), pool)
    with pytest.raises(TypeError, match="Adagrad makes its state when it is constructed"):
        st.Optimizer(torch.optim.Adagrad, handle, lr=1e-2)
