"""The benchmarks' asyncio store client against the real c10d TCPStore server and client: every operation
the fake ranks use writes what the real client reads, and reads what it writes."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from store_wire import AsyncStore  # noqa: E402


HOST = """
import sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def server():
    """The real server in its own process, started with a short resolver timeout: it reverse-resolves every
    new connection's address, and this sandbox's DNS drops some queries (5 s each with glibc's default);
    the test process itself is the real client."""
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"})
    try:
        port = int(host.stdout.readline())
        yield dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    finally:
        host.stdin.close()
        try:
            host.wait(10)
        except subprocess.TimeoutExpired:  # (a loaded machine: the server may still be resolving the connections)
            host.kill()
            host.wait(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_values_written_by_either_client_read_the_same_by_the_other(server):
    async def body():
        s = await AsyncStore.connect("127.0.0.1", server.port)
        await s.set("a", "from-async")
        await s.append("log", "1;")
        await s.multi_set(["m1", "m2"], [b"x", b"\x00\xffy"])
        assert await s.add("n", 5) == 5
        server.set("b", "from-real")
        server.append("log", "2;")
        assert await s.get("b") == b"from-real"
        assert await s.multi_get(["m1", "m2", "b"]) == [b"x", b"\x00\xffy", b"from-real"]
        assert await s.add("n", -2) == 3 and server.add("n", 0) == 3  # one counter, the server's
        assert await s.check(["a", "b"]) and not await s.check(["a", "missing"])
        assert await s.delete_key("a") and not await s.delete_key("a")
        keys = await s.num_keys()
        await s.close()
        return keys

    keys = run(body())
    assert server.get("log") == b"1;2;"
    assert server.get("m2") == b"\x00\xffy"
    assert server.add("n", 0) == 3
    assert not server.check(["a"])
    assert keys == server.num_keys()


def test_wait_blocks_in_the_server_until_the_real_client_sets_the_key(server):
    def later():
        time.sleep(0.3)
        server.set("go", "1")

    async def body():
        s = await AsyncStore.connect("127.0.0.1", server.port)
        t0 = time.perf_counter()
        value = await s.get("go")
        return value, time.perf_counter() - t0

    threading.Thread(target=later).start()
    value, waited = run(body())
    assert value == b"1" and waited >= 0.25


def test_a_thousand_connections_on_one_event_loop(server):
    async def one(i: int) -> None:
        s = await AsyncStore.connect("127.0.0.1", server.port)
        await s.append("shares", f"{i};")
        await s.add("count", 1)
        await s.wait(["release"])
        await s.close()

    async def body():
        tasks = [asyncio.create_task(one(i)) for i in range(1000)]
        while server.add("count", 0) < 1000:
            await asyncio.sleep(0.01)
        server.set("release", "1")
        await asyncio.gather(*tasks)

    run(body())
    assert sorted(int(x) for x in server.get("shares").decode().split(";") if x) == list(range(1000))


def test_a_wrong_server_is_refused():
    async def body():
        srv = await asyncio.start_server(lambda r, w: w.write(b"\x00\x00\x00\x00"), "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            await AsyncStore.connect("127.0.0.1", port)
        finally:
            srv.close()

    with pytest.raises(ConnectionError, match="answered the ping"):
        run(body())
