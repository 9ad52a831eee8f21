import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve.attention.hadamard import hadamard_transform


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64, 256])
def test_matches_explicit_sylvester_matrix(n: int) -> None:
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    expected = x @ sylvester(n) / math.sqrt(n)
    got = hadamard_transform(x.float())
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=25)
@given(log_n=st.integers(4, 8), rows=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_preserves_dot_products_and_is_an_involution(log_n: int, rows: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2**log_n, generator=gen)
    y = torch.randn(rows, 2**log_n, generator=gen)
    hx, hy = hadamard_transform(x), hadamard_transform(y)
    torch.testing.assert_close(hx @ hy.T, x @ y.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hadamard_transform(hx), x, rtol=1e-5, atol=1e-5)


def test_keeps_dtype_and_computes_in_fp32() -> None:
    # bf16 inputs: sums of 256 terms are exact in fp32 and 1/sqrt(256) is a power of two -> bit-exact
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = hadamard_transform(x)
    assert got.dtype == torch.bfloat16
    expected = (x.double() @ sylvester(256) / 16).to(torch.bfloat16)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_empty_leading_dims() -> None:
    assert hadamard_transform(torch.empty(0, 3, 32)).shape == (0, 3, 32)


@pytest.mark.parametrize("n", [0, 3, 12, 100, 129])
def test_rejects_non_power_of_two(n: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.zeros(2, n))
