"""`detdata.loading.reading` helpers: the single-threaded copy that makes a delivered batch own
its memory (`own_copy`, `owned`). The reference is the input tensor itself."""

from __future__ import annotations

import pytest
import torch

from detdata.loading.reading import own_copy, owned

GROUP = torch.arange(16 * 8 * 6, dtype=torch.int64).reshape(16 * 8, 6)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.uint16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
    ],
)
def test_own_copy_equals_the_view_and_owns_its_storage(dtype: torch.dtype) -> None:
    group = (GROUP % 2).to(dtype) if dtype is torch.bool else GROUP.to(dtype)
    for view in (group[8:16], group[3], group[0, 0], group[:0], group[:, 1:3], group.t()):
        copy = own_copy(view)
        assert copy.dtype == view.dtype and copy.shape == view.shape
        assert torch.equal(copy, view)
        assert copy.untyped_storage().nbytes() == copy.nbytes  # nothing else kept alive
        if view.numel():
            before = view.clone()
            copy.zero_() if dtype is not torch.bool else copy.fill_(False)
            assert torch.equal(view, before)  # the copy shares nothing with the group


def test_owned_copies_only_views_of_larger_buffers() -> None:
    alone = torch.arange(6)
    batch = owned({"a": GROUP[0:8], "b": [GROUP[8:16], alone], "c": 3, "t": (GROUP[16:24],)})
    assert batch["t"][0].untyped_storage().nbytes() == batch["t"][0].nbytes
    assert batch["b"][1] is alone and batch["c"] == 3
    assert batch["a"].untyped_storage().nbytes() == batch["a"].nbytes
    assert torch.equal(batch["a"], GROUP[0:8]) and torch.equal(batch["b"][0], GROUP[8:16])


def test_own_copy_of_a_tensor_that_needs_grad_keeps_autograd() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3).requires_grad_()
    copy = own_copy(x[1:3])
    assert copy.requires_grad and copy.grad_fn is not None
