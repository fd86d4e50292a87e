"""The engine's cancel channel: keys it handed out reach the engine loop, nothing else does."""

import os
import socket
import stat

from freetoken_core.serving.stream.cancel import KEY_SEP, CancelChannel, CancelCheckLimiter, notify_cancel


def test_cancel_keys_round_trip():
    ch = CancelChannel()
    other = CancelChannel()
    try:
        assert ch.poll() == []
        k7, k12, k3 = ch.register(7), ch.register(12), other.register(3)
        assert notify_cancel(k7) and notify_cancel(k12) and notify_cancel(k3)
        assert sorted(ch.poll()) == [7, 12]
        assert other.poll() == [3]
        assert ch.poll() == []
        ch.unregister(k7)  # the request finished: its key cancels nothing any more
        assert notify_cancel(k7) and ch.poll() == []
    finally:
        ch.close()
        other.close()
    assert not notify_cancel(k12)  # the engine is gone: a no-op, no exception
    assert not notify_cancel("") and not notify_cancel("not-a-key:5")


def test_forged_or_guessed_keys_cancel_nothing():
    ch = CancelChannel()
    try:
        key = ch.register(5)
        path, _, token = key.rpartition(KEY_SEP)
        assert len(token) == 32 and token != ch.register(5).rpartition(KEY_SEP)[2]  # 128 random bits each
        # guesses in the old pid:counter shape, other tokens, junk: delivered, and ignored
        for forged in (f"{path}{KEY_SEP}{os.getpid()}-0:5", f"{path}{KEY_SEP}5", f"{path}{KEY_SEP}{'0' * 32}",
                       f"{path}{KEY_SEP}{token[:-1]}x"):
            assert notify_cancel(forged)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"\xff" * 300, path)
        assert ch.poll() == []
        assert notify_cancel(key) and ch.poll() == [5]
        # notify_cancel writes only to a channel's socket, whatever path a key names
        assert not notify_cancel(f"/tmp/elsewhere.sock{KEY_SEP}{token}")
    finally:
        ch.close()


def test_the_socket_is_private_to_the_servers_user():
    ch = CancelChannel()
    try:
        assert not ch.path.name.startswith("\0") and ch.path.exists()  # a file, not the abstract namespace
        st = os.stat(ch.dir)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    finally:
        ch.close()
    assert not ch.dir.exists()  # closed: socket and directory are gone


def test_cancel_check_limiter_asks_each_request_at_most_once_per_interval():
    lim = CancelCheckLimiter(interval_s=0.2, forget_after_s=10.0)
    # no request is asked on its first response (its latency is the client's time to first token)
    assert not lim.due("a:1", 0.0) and not lim.due("a:2", 0.0)
    assert not lim.due("a:1", 0.05) and not lim.due("a:1", 0.09)
    # the key comes again ~one interval later (the engine's CANCEL_KEY_INTERVAL_S): asked, even a little early
    assert lim.due("a:1", 0.19) and not lim.due("a:1", 0.3)
    assert lim.due("a:1", 0.4)
    assert lim.due("", 0.3) and lim.due("", 0.3)  # no key: no limit
    lim.due("a:3", 20.0)  # prunes keys idle for over 10 s
    assert set(lim._last) == {"a:3"}
    assert not lim.due("a:1", 20.05) and lim.due("a:1", 20.2)  # a forgotten key starts over
