"""An HTTP/1.1 server for tests/tests/statuses.rs that answers each request with the
status its path asks for: `GET /status/<code>` answers `<code>`, with a short body
unless the code forbids one (1xx, 204, 304); `GET /early/<code>` first sends a `103
Early Hints` with two `Link` headers (over 100 bytes, in a write of its own). Python's
http.server writes the head in one write and the body in another. Every connection is
served on its own thread.

    /usr/bin/python3 status_server.py

Prints `port N` once it listens on 127.0.0.1. For each line on stdin, and once more
when stdin closes, prints `served <1xx> <2xx> <3xx> <4xx> <5xx>`: the final answers
it wrote so far, by class, and `hints <count>`: the `103 Early Hints` it wrote. Serves
until stdin closes.
"""
import http.server
import sys
import threading

lock = threading.Lock()
served = [0] * 5
hints = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as servers that send early hints set it (nginx, Node.js, h2o):
    # with Nagle, the answer after a 103 waits for the client's delayed
    # acknowledgement of the 103 (40 ms).
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        global hints
        code = int(self.path.rsplit("/", 1)[-1])
        if self.path.startswith("/early/"):
            self.send_response_only(103)
            self.send_header("Link", "</style.css>; rel=preload; as=style")
            self.send_header("Link", "</script.js>; rel=preload; as=script")
            self.end_headers()
            with lock:
                hints += 1
        body = b"" if code < 200 or code in (204, 304) else b"answer %d\n" % code
        self.send_response(code)
        if body:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)
        with lock:
            served[code // 100 - 1] += 1


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(f"port {server.server_address[1]}", flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()


def report():
    with lock:
        print("served " + " ".join(map(str, served)), flush=True)
        print(f"hints {hints}", flush=True)


for _ in sys.stdin:
    report()
report()
