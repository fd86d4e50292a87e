"""The engine's cancel channel: keys sent by a detokenizer reach the engine loop, nothing else does."""

from freetoken_core.serving.cancel import CancelChannel, CancelCheckLimiter, notify_cancel


def test_cancel_keys_round_trip():
    ch = CancelChannel()
    other = CancelChannel()
    try:
        assert ch.poll() == []
        assert notify_cancel(ch.key(7)) and notify_cancel(ch.key(12)) and notify_cancel(other.key(3))
        assert sorted(ch.poll()) == [7, 12]
        assert other.poll() == [3]
        assert ch.poll() == []
    finally:
        ch.close()
        other.close()
    assert not notify_cancel(ch.key(1))  # the engine is gone: a no-op, no exception
    assert not notify_cancel("") and not notify_cancel("not-a-key:5")


def test_cancel_check_limiter_asks_each_request_at_most_once_per_interval():
    lim = CancelCheckLimiter(interval_s=0.2, forget_after_s=10.0)
    assert lim.due("a:1", 0.0) and lim.due("a:2", 0.0)  # every request is asked on its first response
    assert not lim.due("a:1", 0.1) and not lim.due("a:1", 0.19)
    assert lim.due("a:1", 0.21) and not lim.due("a:1", 0.3)
    assert lim.due("", 0.3) and lim.due("", 0.3)  # no key: no limit
    lim.due("a:3", 20.0)  # prunes keys idle for over 10 s
    assert set(lim._last) == {"a:3"}
    assert lim.due("a:1", 20.05)  # a forgotten key is asked again
