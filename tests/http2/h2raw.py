"""Raw HTTP/2 (h2c, prior knowledge) clients for tests/tests/http2.rs: the `h2`
library builds the bytes, and the script sends them on a plain socket, whole, cut up
or mixed with garbage, and reads the server's answers to know what it answered.

    /usr/bin/python3 h2raw.py MODE PORT [ARGS]

Modes against nginx (GET /):
- garbage PORT: the client preface, then 256 bytes of garbage (their first 9, as a
  frame header, announce 3.7 MB of an unknown type, which nginx waits for);
- huge PORT: the preface, SETTINGS, and a HEADERS frame header announcing 16 MB
  (0xffffff bytes), followed by 4 KiB;
- bytewise PORT: a valid request (preface, SETTINGS, HEADERS) one byte per send();
- split PORT OFFSET: the same request in two send()s, cut OFFSET bytes into the
  HEADERS frame's 9-byte header (0: just before it, 9: between header and payload);
  the second only once the server acknowledged our SETTINGS, so it has read the first;
- old PORT: one request; prints `ready`; then for each `go N` line on stdin, N more
  requests one after the other, printing a result each; at stdin's end, closes
  and prints `closed`.
Modes against grpc_server.py:
- reset PORT N MS: N calls of Sleep(MS), each then cancelled with RST_STREAM before
  the server answers, then one Sleep(0) call, answered;
- close PORT N MS: N calls of Sleep(MS), then the connection closed under them.
Both cancel only after a PING's round trip: the server has read the calls by then.

Each prints `result {json}`: `answered` streams the server ended (END_STREAM),
`reset_by_server` streams it reset, `reset_by_us`, `abandoned` (open at our close),
`server_closed` whether the server closed the connection (the hostile modes wait for
that IDLE seconds at most, then close), `goaway` its error code.
Run by Debian's /usr/bin/python3 (python3-h2).
"""
import json
import random
import socket
import struct
import sys
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

TIMEOUT = 10
IDLE = 1
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class Client:
    def __init__(self, port):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config=config)
        self.answered = set()
        self.reset_by_server = set()
        self.reset_by_us = set()
        self.settings_acked = False
        self.pings_acked = 0
        self.server_closed = False
        self.goaway = None
        self.held = b""
        # While a frame is sent in pieces, nothing else may go out between them.
        self.hold = False

    def send_pending(self):
        data = self.conn.data_to_send()
        if data and not self.hold:
            self.sock.sendall(data)
        elif data:
            self.held += data

    def release(self):
        self.hold = False
        held, self.held = self.held, b""
        self.sock.sendall(held + self.conn.data_to_send())

    def receive(self):
        """Reads once and handles what came; False once the server closed."""
        data = self.sock.recv(65536)
        if not data:
            self.server_closed = True
            return False
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            # After hostile input h2's state may not expect the server's bytes (frames
            # after its GOAWAY, or before our preface in garbage mode): only what it
            # answered counts, and it closes next.
            return True
        for event in events:
            if isinstance(event, h2.events.StreamEnded):
                self.answered.add(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                if event.remote_reset:
                    self.reset_by_server.add(event.stream_id)
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id
                )
            elif isinstance(event, h2.events.SettingsAcknowledged):
                self.settings_acked = True
            elif isinstance(event, h2.events.PingAckReceived):
                self.pings_acked += 1
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = int(event.error_code)
        self.send_pending()
        return True

    def wait(self, condition, what):
        while not condition():
            if not self.receive():
                raise SystemExit(f"server closed the connection while waiting for {what}")

    def read_to_close(self):
        """Reads until the server closes (a hostile input's end), or has sent nothing
        for IDLE seconds: a server may wait for the rest of a frame that announced
        more than was sent (nginx skips a frame of unknown type whatever its length)."""
        self.sock.settimeout(IDLE)
        try:
            while self.receive():
                pass
        except ConnectionResetError:
            self.server_closed = True
        except TimeoutError:
            pass
        self.sock.settimeout(TIMEOUT)

    def get_headers(self):
        return [
            (":method", "GET"),
            (":path", "/"),
            (":scheme", "http"),
            (":authority", f"127.0.0.1:{self.port}"),
        ]

    def get(self):
        """A GET / on a new stream; its id."""
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, self.get_headers(), end_stream=True)
        self.send_pending()
        return stream

    def grpc_call(self, method, argument):
        """A unary gRPC call on a new stream (request sent whole); its id."""
        stream = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/poolscope.Test/{method}"),
            (":authority", f"127.0.0.1:{self.port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        payload = argument.encode()
        self.conn.send_headers(stream, headers)
        self.conn.send_data(stream, struct.pack(">BI", 0, len(payload)) + payload, end_stream=True)
        self.send_pending()
        return stream

    def round_trip(self):
        """A PING and its ACK: the server has read everything sent before it (frames
        are read in order), so what comes next reaches it in another read."""
        acked = self.pings_acked
        self.conn.ping(b"poolscop")
        self.send_pending()
        self.wait(lambda: self.pings_acked > acked, "the PING acknowledgement")

    def result(self, **extra):
        result = {
            "answered": len(self.answered),
            "reset_by_server": len(self.reset_by_server),
            "reset_by_us": len(self.reset_by_us),
            "server_closed": self.server_closed,
            "goaway": self.goaway,
        }
        result.update(extra)
        print("result " + json.dumps(result), flush=True)

    def close(self):
        self.sock.close()


def frame_header(length, kind, flags, stream):
    return struct.pack(">I", length)[1:] + struct.pack(">BBI", kind, flags, stream)


def initiated(client):
    """The preface and SETTINGS, then a GET's HEADERS frame, as bytes not yet sent."""
    client.conn.initiate_connection()
    start = client.conn.data_to_send()
    client.conn.send_headers(1, client.get_headers(), end_stream=True)
    return start, client.conn.data_to_send()


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    client = Client(port)
    if mode == "garbage":
        client.sock.sendall(PREFACE + random.Random(7).randbytes(256))
        client.read_to_close()
        client.result()
    elif mode == "huge":
        client.conn.initiate_connection()
        start = client.conn.data_to_send()
        # HEADERS, END_STREAM | END_HEADERS, stream 1, 16 MB - 1 announced.
        client.sock.sendall(start + frame_header(0xFFFFFF, 0x1, 0x5, 1) + bytes(4096))
        client.read_to_close()
        client.result()
    elif mode == "bytewise":
        start, headers = initiated(client)
        client.hold = True
        for byte in start + headers:
            client.sock.send(bytes([byte]))
            # Paced so that the server may read each byte on its own.
            time.sleep(0.001)
        client.release()
        client.wait(lambda: 1 in client.answered or 1 in client.reset_by_server, "stream 1's end")
        client.close()
        client.result()
    elif mode == "split":
        offset = int(sys.argv[3])
        if not 0 <= offset <= 9:
            raise SystemExit("OFFSET is 0..9")
        start, headers = initiated(client)
        client.hold = True
        client.sock.sendall(start + headers[:offset])
        # The server acknowledges our SETTINGS once it read them: it has read the
        # whole first send (one segment), so the cut falls between two reads.
        client.wait(lambda: client.settings_acked, "the SETTINGS acknowledgement")
        client.sock.sendall(headers[offset:])
        client.release()
        client.wait(lambda: 1 in client.answered or 1 in client.reset_by_server, "stream 1's end")
        client.close()
        client.result(offset=offset)
    elif mode == "old":
        client.conn.initiate_connection()
        client.send_pending()
        first = client.get()
        client.wait(lambda: first in client.answered, "the first answer")
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words[:1] != ["go"]:
                raise SystemExit(f"unknown command {line!r}")
            before = len(client.answered)
            for _ in range(int(words[1])):
                stream = client.get()
                client.wait(lambda: stream in client.answered, f"stream {stream}'s end")
            client.result(answered_now=len(client.answered) - before)
        client.close()
        print("closed", flush=True)
    elif mode in ("reset", "close"):
        count, ms = int(sys.argv[3]), sys.argv[4]
        client.conn.initiate_connection()
        client.send_pending()
        streams = [client.grpc_call("Sleep", ms) for _ in range(count)]
        # The server has the calls (their streams open) before they are cancelled.
        client.round_trip()
        if mode == "reset":
            for stream in streams:
                client.conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
                client.reset_by_us.add(stream)
            client.send_pending()
            last = client.grpc_call("Sleep", "0")
            client.wait(lambda: last in client.answered, "the last call's end")
            early = client.answered & set(streams)
            client.close()
            client.result(answered_before_reset=len(early))
        else:
            abandoned = [s for s in streams if s not in client.answered]
            client.close()
            client.result(abandoned=len(abandoned))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
