"""Progress lines as they appear in a log file (stderr not a terminal, as under pytest and SLURM)."""
import logging

from pretrain.core.progress import progress


def test_log_lines_count_every_item_and_end_at_the_total(caplog):
    caplog.set_level(logging.INFO, logger="pretrain.core.progress")
    items = list(progress(range(7), desc="sst2 generate", every_s=0.0))
    assert items == list(range(7))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("sst2 generate:   0%") and "0/7" in lines[0]
    assert lines[-1].startswith("sst2 generate: 100%") and "7/7" in lines[-1]
    # every_s=0: one line per item, none repeated at the end, no carriage return to garble a log file
    assert len(lines) == 8 and not any("\r" in line for line in lines)


def test_disabled_ranks_print_nothing(caplog):
    caplog.set_level(logging.INFO, logger="pretrain.core.progress")
    assert list(progress(iter("abc"), desc="x", enabled=False)) == ["a", "b", "c"]
    assert caplog.records == []
