"""An HTTP/2 server for tests/tests/http2.rs that takes the HTTP/1.1 `Upgrade: h2c`
path (RFC 7540 §3.2), which nginx does not: it answers the upgrade request `101`,
then in HTTP/2 on stream 1, then every further stream of the connection. Each answer
is "ok\\n" with END_STREAM on its DATA frame.

    /usr/bin/python3 h2c_upgrade_server.py [--peek]

With `--peek`, each read is first a `MSG_PEEK` of what is queued, as servers that
sniff a connection's protocol do: the bytes then read a second time are the same.
Prints `port N` once it listens on 127.0.0.1; serves until stdin closes, then prints
`served N` (streams answered, the upgrade request's included).
Run by Debian's /usr/bin/python3 (python3-h2).
"""
import socket
import sys
import threading

import h2.config
import h2.connection
import h2.events

lock = threading.Lock()
served = 0
PEEK = "--peek" in sys.argv[1:]


def receive(sock):
    """The bytes queued on `sock` (at most 64 KiB), peeked at first with `--peek`."""
    if PEEK:
        sock.recv(65535, socket.MSG_PEEK)
    return sock.recv(65535)


def answer(conn, stream_id):
    global served
    conn.send_headers(stream_id, [(":status", "200"), ("content-length", "3")])
    conn.send_data(stream_id, b"ok\n", end_stream=True)
    with lock:
        served += 1


def serve(sock):
    with sock:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = receive(sock)
            if not chunk:
                return
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        headers = {}
        for line in head.decode("latin-1").split("\r\n")[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("upgrade", "").lower() != "h2c":
            sock.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            return
        sock.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: h2c\r\n\r\n"
        )
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_upgrade_connection(headers["http2-settings"])
        answer(conn, 1)
        sock.sendall(conn.data_to_send())
        while True:
            if rest:
                for event in conn.receive_data(rest):
                    if isinstance(event, h2.events.RequestReceived):
                        answer(conn, event.stream_id)
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        sock.sendall(conn.data_to_send())
                        return
                sock.sendall(conn.data_to_send())
            rest = receive(sock)
            if not rest:
                return


def main():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    print(f"port {listener.getsockname()[1]}", flush=True)

    def accept():
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()
    with lock:
        print(f"served {served}", flush=True)


if __name__ == "__main__":
    main()
