"""scheduling/collector.py: a cycle raises the first-generation collection threshold and always
gives it back, however blocks nest, overlap in threads or fail."""
from __future__ import annotations

import gc
import threading

import pytest

from scheduling.collector import fewer_collections


@pytest.fixture(autouse=True)
def default_threshold():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_the_threshold_is_raised_inside_and_given_back_after_nesting_and_errors():
    with fewer_collections(50_000):
        assert gc.get_threshold() == (50_000, 10, 10)
        with fewer_collections(50_000):
            assert gc.get_threshold()[0] == 50_000
        assert gc.get_threshold()[0] == 50_000, "the inner block does not end the outer one's raise"
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(RuntimeError):
        with fewer_collections(50_000):
            raise RuntimeError("a cycle failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_blocks_in_two_threads_leave_the_threshold_as_it_was():
    # A ends before B: the threshold stays raised until B ends, then goes back to 700 (not to the
    # raised value B would have saved had each block saved its own).
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def a() -> None:
        with fewer_collections(50_000):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with fewer_collections(50_000):
            b_in.set()
            a_out.wait(5)
            seen["after a left"] = gc.get_threshold()[0]

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["after a left"] == 50_000
    assert gc.get_threshold() == (700, 10, 10)


def test_a_lower_threshold_than_the_current_one_is_not_applied():
    gc.set_threshold(200_000, 10, 10)
    with fewer_collections(50_000):
        assert gc.get_threshold()[0] == 200_000
    assert gc.get_threshold()[0] == 200_000
