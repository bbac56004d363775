"""Key derivation (`detdata.base.keys`): the batched form gives the bytes of the plain
form, and both are blake3 over the documented layout (an independent reference here)."""

from __future__ import annotations

import struct

import blake3
from hypothesis import given
from hypothesis import strategies as st

from detdata.base.keys import derive, derive_many

U64 = st.integers(0, (1 << 64) - 1)


@given(
    tag=st.binary(max_size=40),
    words=st.lists(U64, max_size=4),
    last=st.lists(U64, max_size=20),
    length=st.integers(1, 96),
)
def test_derive_many_is_derive_of_each(
    tag: bytes, words: list[int], last: list[int], length: int
) -> None:
    got = derive_many(tag, *words, last=last, length=length)
    want = b"".join(
        blake3.blake3(tag + struct.pack(f"<{len(words) + 1}Q", *words, x)).digest(length=length)
        for x in last
    )
    assert got == want
    assert got == b"".join(derive(tag, *words, x, length=length) for x in last)
