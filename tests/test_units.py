import pytest

from memplan.planner.core.errors import MemplanError
from memplan.planner.core.units import format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("6GiB", 6 * 2**30), ("512MB", 512 * 10**6), ("1234", 1234), ("1.5KiB", 1536), ("2 gb", 2 * 10**9),
    ("0", 0), ("10B", 10),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "5 parsecs", "-1GB", "1e999999", "nan"])
def test_parse_bytes_refuses(text):
    with pytest.raises(MemplanError):
        parse_bytes(text)


def test_percentage_budget_is_of_activation_memory_plus_fixed():
    assert parse_budget("50%", activation_bytes=1000, fixed_bytes=300) == 800
    assert parse_budget("100%", activation_bytes=1000, fixed_bytes=300) == 1300
    assert parse_budget(4096) == 4096
    with pytest.raises(MemplanError, match="no graph"):
        parse_budget("50%")
    with pytest.raises(MemplanError, match="out of range"):
        parse_budget("-5%", activation_bytes=1, fixed_bytes=0)


def test_format_bytes():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(10) == "10 B"
