"""The load generator of bench/gateway, run with the host's own python3 on a
serving host (sent on stdin: nothing is installed there). Its settings come as
one JSON line on stdin after the script, the API key with them (never in argv).

Each worker keeps one connection open (as an OpenAI client does) and sends
non-streaming chat completions; it prints one JSON line of latencies per target
and concurrency."""
import http.client
import json
import socket
import ssl
import sys
import threading
import time


def worker(target, body, headers, count, out, errors):
    context = ssl.create_default_context(cafile=target["ca"]) if target["tls"] else None

    def connect():
        conn = http.client.HTTPConnection(target["connect"], target["port"], timeout=60)
        raw = socket.create_connection((target["connect"], target["port"]), timeout=60)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client's own connect() does
        # the certificate is checked under the inventory name, the socket goes to the address
        conn.sock = context.wrap_socket(raw, server_hostname=target["name"]) if context else raw
        return conn

    conn = connect()
    for _ in range(count):
        started = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                errors.append(resp.status)
                continue
        except (OSError, http.client.HTTPException) as exc:
            errors.append(type(exc).__name__)
            conn.close()
            conn = connect()
            continue
        out.append(time.perf_counter() - started)
    conn.close()


def run(settings):
    body = json.dumps({"model": settings["model"], "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hi."}],
                       "chat_template_kwargs": {"enable_thinking": False}}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {settings['key']}"}
    for target in settings["targets"]:
        for concurrency in settings["concurrency"]:
            count = max(settings["requests"] // concurrency, 5)
            warm = []
            worker(target, body, headers, 5, warm, [])
            out, errors = [], []
            threads = [threading.Thread(target=worker, args=(target, body, headers, count, out, errors))
                       for _ in range(concurrency)]
            started, since = time.perf_counter(), time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            # the window, for the proxies' own logs of these requests
            print(json.dumps({"target": target["label"], "kind": target["kind"], "concurrency": concurrency,
                              "latencies": out, "errors": [str(e) for e in errors], "wall_s": wall,
                              "since": since, "until": time.time()}), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.stdin.readline()))
