"""Numbers in the unit that fits, for the planner's lines: a parameter count in K/M/B, bytes in binary units
(memory: GiB = 2^30, what `--gpu-memory-gb` means) or decimal ones (checkpoints and messages: GB = 1e9, what
bandwidths in GB/s mean). Three significant digits: the tiny model's 0.5M parameters and xxl's 11.3B both read."""
from __future__ import annotations


def _scaled(value: float, base: float, units: tuple[str, ...], sep: str) -> str:
    i = 0
    while i + 1 < len(units) and abs(value) >= base**i * 999.5:  # at most 3 digits: 1019 MiB reads 1.00 GiB
        i += 1
    scaled = value / base**i
    if i == 0 and float(value).is_integer():
        return f"{int(value)}{sep}{units[0]}".rstrip()
    digits = 2 if abs(scaled) < 10 else 1 if abs(scaled) < 100 else 0
    return f"{scaled:.{digits}f}{sep}{units[i]}".rstrip()


def count(n: float) -> str:
    """612 -> "612", 478_040 -> "478K", 2_850_000_000 -> "2.85B"."""
    return _scaled(n, 1000, ("", "K", "M", "B", "T"), "")


def binary_size(nbytes: float) -> str:
    """Memory: 0 -> "0 B", 1_900_000 -> "1.81 MiB", 5.31 x 2^30 -> "5.31 GiB"."""
    return _scaled(nbytes, 1024, ("B", "KiB", "MiB", "GiB", "TiB"), " ")


def decimal_size(nbytes: float) -> str:
    """Files and transfers: 6_100_000 -> "6.10 MB", 39.9e9 -> "39.9 GB"."""
    return _scaled(nbytes, 1000, ("B", "KB", "MB", "GB", "TB"), " ")
