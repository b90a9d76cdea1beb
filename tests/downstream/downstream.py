"""A thread-pool server whose workers call a slow downstream through a socket with a
timeout, the ground truth of tests/tests/downstream.rs: its own clock says how long
its workers were busy and how long they waited on the downstream.

Usage: python3 downstream.py <workers> <backend_port>
Prints "port <n>" and "workers <tid>,..." (the pool's threads, named worker-1..N),
then answers each stdin line "stats" with "stats <served> <busy_ns> <wait_ns>
<errors>" until stdin closes.

The main thread accepts and hands each connection to a ThreadPoolExecutor. One
request per connection: "req\\n" answered "ok\\n". A worker serves it by calling the
backend with socket.create_connection(timeout=2): CPython then polls the one socket
before each recv, as clients with a timeout (requests, DB drivers) do.
busy = from the return of the read of the request to the return of the write of the
response; wait = the time inside the backend call.
"""
import concurrent.futures
import ctypes
import socket
import sys
import threading
import time

TIMEOUT_S = 2.0
PR_SET_NAME = 15

libc = ctypes.CDLL(None, use_errno=True)
lock = threading.Lock()
totals = {"served": 0, "busy": 0, "wait": 0, "errors": 0}
tids = []
counter = iter(range(1, 1 << 30))


def name_worker():
    with lock:
        index = next(counter)
        tids.append(threading.get_native_id())
    libc.prctl(PR_SET_NAME, f"worker-{index}".encode(), 0, 0, 0)


def call_backend(port):
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as backend:
        backend.sendall(b"req\n")
        reply = b""
        while len(reply) < 3:
            chunk = backend.recv(16)
            if not chunk:
                raise ConnectionError("backend closed early")
            reply += chunk


def serve(conn, port):
    ok = False
    start = called = end = 0
    try:
        with conn:
            request = conn.recv(64)
            start = time.monotonic_ns()
            if request == b"req\n":
                call_backend(port)
                called = time.monotonic_ns()
                conn.sendall(b"ok\n")
                end = time.monotonic_ns()
                ok = True
    except OSError:
        pass
    with lock:
        if ok:
            totals["served"] += 1
            totals["busy"] += end - start
            totals["wait"] += called - start
        else:
            totals["errors"] += 1


def main():
    workers, port = int(sys.argv[1]), int(sys.argv[2])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    print(f"port {listener.getsockname()[1]}", flush=True)
    pool = concurrent.futures.ThreadPoolExecutor(workers, initializer=name_worker)
    # The executor starts a thread per submission while none is idle: tasks that
    # all wait for each other start every thread now, so that the test knows the
    # pool before the load.
    everyone = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(everyone.wait)
    everyone.wait()
    print("workers " + ",".join(map(str, tids)), flush=True)

    def accept_forever():
        while True:
            conn, _ = listener.accept()
            pool.submit(serve, conn, port)

    threading.Thread(target=accept_forever, daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "stats":
            with lock:
                print("stats {served} {busy} {wait} {errors}".format(**totals), flush=True)


if __name__ == "__main__":
    main()
