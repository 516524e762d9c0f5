"""The KV cache's memory on a CPU (eagle_worker/model_runner.py `zeroed`): zeros that become
resident only as blocks are used."""
import sys

import pytest
import torch

from eagle_worker.model_runner import zeroed


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_is_zeros_of_the_shape_and_writable(dtype):
    t = zeroed((2, 3, 5, 1, 4), dtype, torch.device("cpu"))
    assert t.shape == (2, 3, 5, 1, 4) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 2, 4] = 3
    assert t.sum().item() == 12 and t[1, 2, 4].eq(3).all()
    assert zeroed((0, 4), dtype, torch.device("cpu")).shape == (0, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_large_cache_is_not_resident_until_used():
    before = _resident_bytes()
    cache = zeroed((2, 18, 1 << 16, 1, 128), torch.float32, torch.device("cpu"))   # 1.1 GB
    assert _resident_bytes() - before < 64 << 20
    cache[0, 0, :1024] = 1.0                         # one layer's first 1024 slots: 512 KB
    assert _resident_bytes() - before < 64 << 20
    assert cache.sum().item() == 1024 * 128
