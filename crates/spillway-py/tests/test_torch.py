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
