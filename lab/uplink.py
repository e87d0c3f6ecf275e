"""The lab's uplink: the one way from the lab network to "the internet" (the
registry and the model hub), as a lab's link to its upstream is.

A TCP relay on the lab side of each service (10.213.0.1:5000 for the registry,
:8088 for the hub) to the service itself (on this machine's loopback). All
downloads share one token bucket, as they share a real uplink; the lab
network itself is not limited. Knobs, read from a JSON file every 0.2 s:
``rate_mb_s`` (0: unlimited) and ``stalled`` (true: nothing more is relayed, new
connections wait: the upstream stopped answering). It counts the bytes that
crossed, per service, into a JSON file.

    python3 -m lab.uplink KNOBS.json STATS.json LISTEN_ADDR:PORT:TARGET_PORT:NAME [...]
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

CHUNK = 256 * 1024  # the lab's stand-in for the internet should cost the machine little CPU


class Link:
    def __init__(self, knobs_path: str, stats_path: str):
        self.knobs_path, self.stats_path = knobs_path, stats_path
        self.rate = 0.0  # bytes per second, 0: unlimited
        self.stalled = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.tokens = 0.0
        self.last = time.monotonic()
        self.bytes = {}  # name -> {"down": n, "up": n, "connections": n}
        self.lock = asyncio.Lock()

    def read_knobs(self):
        try:
            with open(self.knobs_path) as handle:
                knobs = json.load(handle)
        except (OSError, ValueError):
            knobs = {}
        self.rate = float(knobs.get("rate_mb_s") or 0) * 1e6
        self.stalled = bool(knobs.get("stalled"))
        if self.stalled:
            self.resumed.clear()
        else:
            self.resumed.set()

    def write_stats(self):
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as handle:
            json.dump({"services": self.bytes, "rate_mb_s": self.rate / 1e6, "stalled": self.stalled}, handle)
        os.replace(tmp, self.stats_path)

    async def take(self, size: int):
        """Wait until ``size`` bytes may cross (the shared bucket; burst of 1/10 s, or of
        one piece where that is more: a piece larger than the bucket would wait forever)."""
        await self.resumed.wait()
        if not self.rate:
            return
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.tokens + (now - self.last) * self.rate, max(self.rate / 10, size))
                self.last = now
                if self.tokens >= size:
                    self.tokens -= size
                    return
                await asyncio.sleep((size - self.tokens) / self.rate)
                await self.resumed.wait()


async def pipe(reader, writer, link: Link, name: str, direction: str):
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            if direction == "down":
                await link.take(len(data))
            else:
                await link.resumed.wait()
            link.bytes[name][direction] += len(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - the other side may be gone already
            pass


async def serve(link: Link, listen: str, port: int, target: int, name: str):
    link.bytes[name] = {"down": 0, "up": 0, "connections": 0}

    async def handle(client_reader, client_writer):
        await link.resumed.wait()  # a stalled upstream does not even answer
        link.bytes[name]["connections"] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, up_writer, link, name, "up"),
                             pipe(up_reader, client_writer, link, name, "down"))

    return await asyncio.start_server(handle, listen, port, reuse_address=True)


async def main(argv):
    knobs, stats, *specs = argv
    specs = [s for s in specs if s.count(":") >= 3]  # the last word names the lab in ps
    link = Link(knobs, stats)
    link.read_knobs()
    servers = []
    for spec in specs:
        listen, port, target, name = spec.rsplit(":", 3)
        servers.append(await serve(link, listen, int(port), int(target), name))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    while not stop.is_set():
        link.read_knobs()
        link.write_stats()
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    link.write_stats()
    for server in servers:
        server.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
