"""The params' digest: equal exactly for equal bytes, whatever the pieces, threads or device."""

import pytest
import torch

from diloco.core import digest
from diloco.core.digest import tensors_digest


def test_equal_for_equal_tensors_and_sensitive_to_one_element():
    params = [torch.randn(4, 5), torch.randn(3)]
    copy = [p.clone() for p in params]
    assert tensors_digest(params) == tensors_digest(copy)
    assert tensors_digest([params[0].t().contiguous().t(), params[1]]) == tensors_digest(params)
    copy[1][2] += 1e-6
    assert tensors_digest(params) != tensors_digest(copy)
    assert tensors_digest([torch.ones(2, dtype=torch.bfloat16)]) != tensors_digest([torch.ones(2)])
    assert tensors_digest([params[0].reshape(5, 4), params[1]]) != tensors_digest(params)  # the shape counts


def test_pieces_hashed_side_by_side_give_the_digest_of_one_thread(monkeypatch):
    monkeypatch.setattr(digest, "PIECE", 64)  # 16 fp32 values a piece: many pieces, many threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # the tests run one torch thread
    tensors = [torch.randn(1000), torch.randn(7, 9), torch.randn(17)]
    many = tensors_digest(tensors)
    monkeypatch.setattr(digest, "MAX_THREADS", 1)
    assert tensors_digest(tensors) == many
    changed = [t.clone() for t in tensors]
    changed[0][500] = -changed[0][500]  # inside one piece of many
    assert tensors_digest(changed) != many


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_tensor_has_the_digest_of_its_host_copy():
    tensors = [torch.randn(3000, 1000), torch.randn(5).bfloat16()]
    assert tensors_digest([t.cuda() for t in tensors]) == tensors_digest(tensors)
