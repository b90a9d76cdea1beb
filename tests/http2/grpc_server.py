"""A gRPC server for tests/tests/http2.rs, without generated code: grpcio's generic
handlers with identity (bytes) serializers, on a ThreadPoolExecutor of W workers.

    /usr/bin/python3 grpc_server.py WORKERS [MAX_CONCURRENT_STREAMS]

Methods of service `poolscope.Test` (requests are ASCII decimal numbers):
- `Sleep` (unary): sleeps that many ms, answers b"ok";
- `Stream` (server streaming): yields that many 100-byte messages;
- `Abort` (unary): aborts with INVALID_ARGUMENT, a trailers-only response.

Prints `port N` once it serves on 127.0.0.1; answers each stdin line `queued` with
`queued N`, the calls waiting in its executor's queue for a worker; serves until
stdin closes, then prints `served SLEEP STREAM ABORT` (handlers run to their end,
cancelled ones included).
Run by Debian's /usr/bin/python3 (python3-grpcio).
"""
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

MESSAGE = b"m" * 100

lock = threading.Lock()
served = {"Sleep": 0, "Stream": 0, "Abort": 0}


def count(method):
    with lock:
        served[method] += 1


def sleep(request, context):
    time.sleep(int(request) / 1000)
    count("Sleep")
    return b"ok"


def stream(request, context):
    for _ in range(int(request)):
        yield MESSAGE
    count("Stream")


def abort(request, context):
    count("Abort")
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "aborted on purpose")


def main():
    workers = int(sys.argv[1])
    # Announced in the server's SETTINGS: a client queues calls beyond it on its side.
    options = [("grpc.max_concurrent_streams", int(sys.argv[2]))] if len(sys.argv) > 2 else []
    handler = grpc.method_handlers_generic_handler(
        "poolscope.Test",
        {
            # No serializers: requests and responses are the bytes themselves.
            "Sleep": grpc.unary_unary_rpc_method_handler(sleep),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Abort": grpc.unary_unary_rpc_method_handler(abort),
        },
    )
    executor = ThreadPoolExecutor(max_workers=workers)
    server = grpc.server(executor, handlers=[handler], options=options)
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        sys.exit("could not bind 127.0.0.1:0")
    server.start()
    print(f"port {port}", flush=True)
    for line in sys.stdin:
        if line.strip() == "queued":
            # Work items submitted and not yet taken by a worker thread.
            print(f"queued {executor._work_queue.qsize()}", flush=True)
    server.stop(grace=2).wait()
    with lock:
        print(f"served {served['Sleep']} {served['Stream']} {served['Abort']}", flush=True)


if __name__ == "__main__":
    main()
