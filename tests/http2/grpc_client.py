"""A closed-loop gRPC client for tests/tests/http2.rs: keeps CONCURRENCY calls in
flight on ONE channel (one HTTP/2 connection) to the server of grpc_server.py.

    /usr/bin/python3 grpc_client.py PORT METHOD ARGUMENT CONCURRENCY (--seconds T | --calls N)

METHOD is Sleep, Stream or Abort; ARGUMENT the request (ms to sleep, messages to
stream). With --seconds, new calls start for T seconds, then the ones in flight
finish; with --calls, exactly N calls are made. Unary calls are futures
(`.future()`), a semaphore keeping CONCURRENCY of them started; streaming calls run
on CONCURRENCY threads, each reading its stream to the end.

Prints `running` once the channel is connected (before the first call), then
`result {json}`: `completed` calls the server ended with a status (OK, or the status
an Abort sends), `ok` those with OK, `failed` the others (client-side errors),
`messages` received, `latency_sum` the sum of each completed call's latency (its
start to its end, seconds), `elapsed` from the first call's start to the last one's
end. Little's law: latency_sum / elapsed is the mean number of calls in flight.
"""
import json
import sys
import threading
import time

import grpc


def main():
    port, method, argument, concurrency = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    mode, amount = sys.argv[5], float(sys.argv[6])
    if mode not in ("--seconds", "--calls"):
        sys.exit(f"unknown mode {mode}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)
    print("running", flush=True)
    path = f"/poolscope.Test/{method}"
    request = argument.encode()

    lock = threading.Lock()
    totals = {"completed": 0, "ok": 0, "failed": 0, "messages": 0, "latency_sum": 0.0}
    errors = []
    issued = 0
    started_at = time.monotonic()
    deadline = started_at + amount if mode == "--seconds" else None
    last_end = [started_at]

    def more():
        """Claims the next call, if the run has one left."""
        nonlocal issued
        with lock:
            if deadline is not None:
                if time.monotonic() >= deadline:
                    return False
            elif issued >= amount:
                return False
            issued += 1
            return True

    def finished(start, code, messages):
        end = time.monotonic()
        with lock:
            last_end[0] = max(last_end[0], end)
            totals["messages"] += messages
            # A status the server sent (OK, or Abort's): the stream ended normally.
            if code == grpc.StatusCode.OK or (
                method == "Abort"
                and code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
            ):
                totals["completed"] += 1
                totals["latency_sum"] += end - start
                if code == grpc.StatusCode.OK:
                    totals["ok"] += 1
            else:
                totals["failed"] += 1
                if len(errors) < 5:
                    errors.append(str(code))

    if method == "Stream":
        call = channel.unary_stream(path)

        def worker():
            while more():
                start = time.monotonic()
                received = 0
                try:
                    for _ in call(request):
                        received += 1
                    code = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    code = error.code()
                finished(start, code, received)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        call = channel.unary_unary(path)
        slots = threading.Semaphore(concurrency)

        def done(start):
            def callback(future):
                try:
                    future.result()
                    code = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    code = error.code()
                finished(start, code, 1 if code == grpc.StatusCode.OK else 0)
                slots.release()

            return callback

        while True:
            slots.acquire()
            if not more():
                slots.release()
                break
            start = time.monotonic()
            call.future(request).add_done_callback(done(start))
        # Every call in flight holds a slot: all of them back means all ended.
        for _ in range(concurrency):
            slots.acquire()

    totals["elapsed"] = last_end[0] - started_at
    totals["errors"] = errors
    channel.close()
    print("result " + json.dumps(totals), flush=True)


if __name__ == "__main__":
    main()
