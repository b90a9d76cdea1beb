"""An HTTP/1.1 server for tests/tests/routes.rs whose routes, service times and statuses
the test knows:

    GET or POST /fast       2 ms, 200
    GET /slow/<id>          20 ms, 200
    GET /fail               2 ms, 500
    GET /attack/<anything>  no wait, 404
    anything else           1 ms, 404

Each keep-alive connection is served on its own thread; the head and the body of an
answer go out in one write. The server times each request itself, from the moment its
request line was read to the moment its answer was written, and keeps, per route as
poolscope names it (`GET /slow/:id`: ids as `:id`), the answers it wrote by status class
and their total time.

    /usr/bin/python3 route_server.py

Prints `port N` once it listens on 127.0.0.1. When stdin closes, prints one line
`routes {"GET /fast 2xx": [count, seconds], ...}` and exits.
"""
import http.server
import json
import re
import sys
import threading
import time

lock = threading.Lock()
routes = {}
ID = re.compile(r"^[0-9]+$")


def route_of(method, path):
    path = path.split("?", 1)[0].split("#", 1)[0]
    segments = ["id" if ID.match(s) else s for s in path.split("/")]
    return method + " " + "/".join(":id" if s == "id" else s for s in segments)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def parse_request(self):
        # Right after the request line was read: the request's start.
        self.started = time.monotonic()
        return super().parse_request()

    def answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        if path == "/fast":
            wait, code = 0.002, 200
        elif path.startswith("/slow/"):
            wait, code = 0.020, 200
        elif path == "/fail" and self.command == "GET":
            wait, code = 0.002, 500
        elif path.startswith("/attack/"):
            wait, code = 0, 404
        else:
            wait, code = 0.001, 404
        if wait:
            time.sleep(wait)
        body = b"answer %d\n" % code
        head = (
            "HTTP/1.1 %d %s\r\nContent-Length: %d\r\n\r\n"
            % (code, self.responses[code][0], len(body))
        ).encode()
        self.wfile.write(head + body)
        self.wfile.flush()
        seconds = time.monotonic() - self.started
        key = "%s %dxx" % (route_of(self.command, self.path), code // 100)
        with lock:
            count, total = routes.get(key, (0, 0.0))
            routes[key] = (count + 1, total + seconds)

    do_GET = answer
    do_POST = answer


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(f"port {server.server_address[1]}", flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
for _ in sys.stdin:
    pass
with lock:
    print("routes " + json.dumps(routes), flush=True)
