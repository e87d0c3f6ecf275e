"""A TCP proxy that delays every chunk by half a round trip in each direction,
to emulate a WAN link where the kernel has no netem, and counts round trips.

    python3 proxy.py STATS.json RTT_MS LISTEN_ADDR PORT:TARGET_ADDR:TARGET_PORT [...]

A "turn" is a change of direction in a connection (client speaks after the
server spoke, or the reverse); turns/2 is the number of round trips. On SIGTERM
it writes per-target connection and turn counts to STATS.json.
"""
import asyncio
import json
import signal
import sys
from collections import defaultdict

STATS = defaultdict(lambda: {"connections": 0, "turns": 0})


async def pipe(reader, writer, delay, state, side, target):
    """Forward one direction; each chunk leaves ``delay`` after it came in, chunks in
    flight overlap (a link's latency, not a per-chunk toll)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver():
        while True:
            due, data = await queue.get()
            if data is None:
                return
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if state["last"] != side:
                state["last"] = side
                STATS[target]["turns"] += 1
            queue.put_nowait((loop.time() + delay, data))
        queue.put_nowait((0, None))
        await sender
    except (ConnectionError, asyncio.CancelledError):
        sender.cancel()
    finally:
        try:
            writer.close()
        except Exception:
            pass


def handler(target_addr, target_port, delay):
    target = f"{target_addr}:{target_port}"

    async def handle(client_reader, client_writer):
        STATS[target]["connections"] += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(target_addr, target_port)
        except OSError:
            client_writer.close()
            return
        state = {"last": None}
        try:
            await asyncio.gather(pipe(client_reader, server_writer, delay, state, "c", target),
                                 pipe(server_reader, client_writer, delay, state, "s", target))
        except asyncio.CancelledError:  # the proxy is stopping with this connection still open
            for writer in (client_writer, server_writer):
                writer.close()
    return handle


async def main(argv):
    stats_path, rtt_ms, listen = argv[0], float(argv[1]), argv[2]
    delay = rtt_ms / 2000.0
    servers = []
    for spec in argv[3:]:
        port, target_addr, target_port = spec.split(":")
        servers.append(await asyncio.start_server(handler(target_addr, int(target_port), delay), listen, int(port)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print("ready", flush=True)
    await stop.wait()
    with open(stats_path, "w") as handle:
        json.dump(STATS, handle)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
