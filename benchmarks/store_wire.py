"""An asyncio client of c10d's TCPStore wire protocol, for fake ranks by the thousand.

Why not ``torch.distributed.TCPStore`` clients in threads: each of its calls blocks a thread, so a fake
machine with 512 ranks needs 512 threads, and on two cores they spend their time handing the GIL to one
another (the 4096-rank run of ``bench_coordination`` spent 80% of its time in the kernel and never finished
a recovery). One event loop per fake machine holds hundreds of connections without that, and each fake
rank still has its own connection to the real server, speaking the protocol a real rank's client speaks.

The protocol (``torch/csrc/distributed/c10d/TCPStore.cpp`` and ``TCPStoreBackend.hpp``, little-endian):
a request is a one-byte query type then its arguments; a string or a value is its ``uint64`` length then
its bytes; a count is a ``uint64``. The real client puts ``/`` before every key (``TCPStore::keyPrefix_``),
so this one does too: both see the same keys. ``tests/benchmarks/test_store_wire.py`` checks every operation used
here against the real server and the real client, so a change of the protocol in a new torch shows there.
"""
from __future__ import annotations

import asyncio
import os
import struct
from enum import IntEnum

MAGIC = 0x3C85F7CE  # c10d::detail::validationMagicNumber


class Query(IntEnum):
    """c10d::detail::QueryType (only the operations the fake ranks use are implemented below)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13


READY = 0  # CheckResponseType::READY
STOP_WAITING = 0  # WaitResponseType::STOP_WAITING


def _blob(data: bytes | str) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return struct.pack("<Q", len(raw)) + raw


KEY_PREFIX = "/"  # c10d::TCPStore::keyPrefix_


def _key(key: str) -> bytes:
    return _blob(KEY_PREFIX + key)


def _keys(keys: list[str]) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys)


class AsyncStore:
    """One connection, one request at a time (as one ``TCPStore`` client): not shared between tasks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, host: str, port: int) -> "AsyncStore":
        reader, writer = await asyncio.open_connection(host, port)
        store = cls(reader, writer)
        nonce = os.getpid() & 0xFFFFFFFF
        writer.write(struct.pack("<BI", Query.VALIDATE, MAGIC) + struct.pack("<BI", Query.PING, nonce))
        (back,) = struct.unpack("<I", await reader.readexactly(4))
        if back != nonce:
            raise ConnectionError(f"TCPStore at {host}:{port} answered the ping with {back}, not {nonce}")
        return store

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass

    async def _u64(self) -> int:
        return struct.unpack("<Q", await self.reader.readexactly(8))[0]

    async def _value(self) -> bytes:
        return await self.reader.readexactly(await self._u64())

    async def set(self, key: str, value: bytes | str) -> None:
        self.writer.write(bytes([Query.SET]) + _key(key) + _blob(value))  # no answer: fire and forget
        await self.writer.drain()

    async def append(self, key: str, value: bytes | str) -> None:
        self.writer.write(bytes([Query.APPEND]) + _key(key) + _blob(value))
        await self.writer.drain()

    async def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        body = b"".join(_key(k) + _blob(v) for k, v in zip(keys, values, strict=True))
        self.writer.write(bytes([Query.MULTI_SET]) + struct.pack("<Q", len(keys)) + body)
        await self.writer.drain()

    async def add(self, key: str, amount: int) -> int:
        self.writer.write(bytes([Query.ADD]) + _key(key) + struct.pack("<q", amount))
        return struct.unpack("<q", await self.reader.readexactly(8))[0]

    async def check(self, keys: list[str]) -> bool:
        self.writer.write(bytes([Query.CHECK]) + _keys(keys))
        return (await self.reader.readexactly(1))[0] == READY

    async def wait(self, keys: list[str]) -> None:
        """Blocks in the server until every key exists (no timeout: the benchmark's agent bounds the run)."""
        self.writer.write(bytes([Query.WAIT]) + _keys(keys))
        answer = (await self.reader.readexactly(1))[0]
        if answer != STOP_WAITING:
            raise ConnectionError(f"TCPStore wait for {keys} was cancelled")

    async def get(self, key: str) -> bytes:
        """As ``TCPStore.get``: wait for the key, then read it (two round trips)."""
        await self.wait([key])
        self.writer.write(bytes([Query.GET]) + _key(key))
        return await self._value()

    async def multi_get(self, keys: list[str]) -> list[bytes]:
        await self.wait(keys)
        self.writer.write(bytes([Query.MULTI_GET]) + _keys(keys))
        return [await self._value() for _ in keys]

    async def delete_key(self, key: str) -> bool:
        self.writer.write(bytes([Query.DELETE_KEY]) + _key(key))
        return struct.unpack("<q", await self.reader.readexactly(8))[0] > 0

    async def num_keys(self) -> int:
        self.writer.write(bytes([Query.GETNUMKEYS]))
        return struct.unpack("<q", await self.reader.readexactly(8))[0]
