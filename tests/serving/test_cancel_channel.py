"""The engine's cancel channel: keys sent by a detokenizer reach the engine loop, nothing else does."""

from freetoken_core.serving.cancel import CancelChannel, notify_cancel


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
