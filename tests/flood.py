"""An unauthenticated flood against an SSH server: TCP connections that send a banner or
nothing at all, and then hold on. The standard library only: the tests also run it as
another local user, with the system's python3 (`python3 tests/flood.py HOST PORT N`).

Each connection waits for the server's banner, proof that the server accepted it, before
the next one starts: so at most `concurrency` wait in the kernel's listen queue, and no
connection waits for a SYN to be retried (the flood is bounded, as the tests need it to be
on a busy machine, and still as large as asked)."""

from __future__ import annotations

import argparse
import asyncio
import sys

CONNECT_TIMEOUT = 30.0


async def _one(
    host: str, port: int, index: int, held: list[asyncio.StreamWriter]
) -> asyncio.StreamReader:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port), timeout=CONNECT_TIMEOUT
    )
    held.append(writer)
    if index % 2:  # half of them say hello, as a client would, and then nothing more
        writer.write(b"SSH-2.0-flood\r\n")
    # The banner, or EOF when the server has already dropped it: accepted either way.
    await asyncio.wait_for(reader.readline(), timeout=CONNECT_TIMEOUT)
    return reader


async def hold(
    host: str, port: int, total: int, *, concurrency: int = 64
) -> list[asyncio.StreamWriter]:
    """Open `total` connections, `concurrency` at a time, and return them all, still open
    on this side (the server may have closed its end of most)."""
    gate = asyncio.Semaphore(concurrency)
    held: list[asyncio.StreamWriter] = []

    async def bounded(index: int) -> None:
        async with gate:
            await _one(host, port, index, held)

    await asyncio.gather(*(bounded(i) for i in range(total)))
    return held


async def forever(host: str, port: int, concurrency: int) -> None:
    """Keep `concurrency` connections open: each one the server drops is opened again."""

    async def worker(index: int) -> None:
        while True:
            held: list[asyncio.StreamWriter] = []
            try:
                reader = await _one(host, port, index, held)
                await reader.read()  # until the server drops it: evicted, or timed out
            except (OSError, TimeoutError):
                pass
            finally:
                for writer in held:
                    writer.close()

    tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
    print("flooding", flush=True)  # the test waits for this line
    await asyncio.gather(*tasks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("concurrency", type=int)
    args = p.parse_args()
    try:
        asyncio.run(forever(args.host, args.port, args.concurrency))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
