"""An HTTP/1.1 server for tests/tests/interim.rs that answers `Expect: 100-continue`
uploads as Python's own http.server does: `100 Continue` once the headers are read,
then it reads the body, waits the service time and answers `200` (no body). Every
request is served on its own thread (one per connection), so none waits for a worker.

    /usr/bin/python3 continue_server.py <service ms>

Prints `port N` once it listens on 127.0.0.1. For each line on stdin, and once more
when stdin closes, prints `interim <count>`, the `100 Continue` answers it wrote so
far, and `served <count> <mean service ns>`: its own measure of each request so far,
from the return of the read that took its request line to the return of its
answer's write (where poolscope starts and ends a request). Serves until stdin
closes.
"""
import http.server
import sys
import threading
import time

SERVICE = float(sys.argv[1]) / 1000
lock = threading.Lock()
served = []
interim = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def parse_request(self):
        # The request line was just read; parsing it reads the headers (from the
        # same buffered read) and answers `100 Continue`.
        self.started = time.monotonic_ns()
        return super().parse_request()

    def handle_expect_100(self):
        global interim
        answered = super().handle_expect_100()
        with lock:
            interim += 1
        return answered

    def do_PUT(self):
        left = int(self.headers.get("Content-Length", "0"))
        while left > 0:
            chunk = self.rfile.read(min(left, 65536))
            if not chunk:
                return
            left -= len(chunk)
        time.sleep(SERVICE)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
        took = time.monotonic_ns() - self.started
        with lock:
            served.append(took)


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(f"port {server.server_address[1]}", flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()


def report():
    with lock:
        mean = sum(served) // len(served) if served else 0
        print(f"interim {interim}", flush=True)
        print(f"served {len(served)} {mean}", flush=True)


for _ in sys.stdin:
    report()
report()
