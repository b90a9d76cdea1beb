// A thread-pool server whose workers call a slow downstream through a socket with a
// read timeout (setSoTimeout), the ground truth of tests/tests/downstream.rs: its own
// clock says how long its workers were busy and how long they waited on the
// downstream.
//
// Usage: java Downstream.java <workers> <backend_port>
// Prints "port <n>", then answers each stdin line "stats" with
// "stats <served> <busy_ns> <wait_ns> <errors>" until stdin closes.
//
// The main thread accepts and hands each connection to a fixed pool of threads named
// worker-1..N. One request per connection: "req\n" answered "ok\n". A worker serves
// it by calling the backend with a 2 s read timeout: the JDK then polls the one
// socket while it waits, as JDBC drivers and HTTP clients with a timeout do.
// busy = from the return of the read of the request to the return of the write of
// the response; wait = the time inside the backend call.
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;

public class Downstream {
    static final int TIMEOUT_MS = 2000;
    static final AtomicLong served = new AtomicLong();
    static final AtomicLong busyNs = new AtomicLong();
    static final AtomicLong waitNs = new AtomicLong();
    static final AtomicLong errors = new AtomicLong();

    static byte[] readAtLeast(InputStream in, int wanted) throws IOException {
        byte[] buffer = new byte[64];
        int got = 0;
        while (got < wanted) {
            int n = in.read(buffer, got, buffer.length - got);
            if (n < 0) {
                throw new IOException("closed early");
            }
            got += n;
        }
        return java.util.Arrays.copyOf(buffer, got);
    }

    static void callBackend(int port) throws IOException {
        try (Socket backend = new Socket()) {
            backend.connect(new InetSocketAddress(InetAddress.getLoopbackAddress(), port), TIMEOUT_MS);
            backend.setSoTimeout(TIMEOUT_MS);
            backend.getOutputStream().write("req\n".getBytes(StandardCharsets.US_ASCII));
            readAtLeast(backend.getInputStream(), 3);
        }
    }

    static void serve(Socket conn, int port) {
        boolean ok = false;
        long start = 0, called = 0, end = 0;
        try (conn) {
            byte[] request = readAtLeast(conn.getInputStream(), 4);
            start = System.nanoTime();
            if (new String(request, StandardCharsets.US_ASCII).equals("req\n")) {
                callBackend(port);
                called = System.nanoTime();
                OutputStream out = conn.getOutputStream();
                out.write("ok\n".getBytes(StandardCharsets.US_ASCII));
                end = System.nanoTime();
                ok = true;
            }
        } catch (IOException e) {
            ok = false;
        }
        if (ok) {
            served.incrementAndGet();
            busyNs.addAndGet(end - start);
            waitNs.addAndGet(called - start);
        } else {
            errors.incrementAndGet();
        }
    }

    public static void main(String[] args) throws Exception {
        int workers = Integer.parseInt(args[0]);
        int port = Integer.parseInt(args[1]);
        ServerSocket listener = new ServerSocket(0, 4096, InetAddress.getLoopbackAddress());
        AtomicInteger next = new AtomicInteger(1);
        ExecutorService pool = Executors.newFixedThreadPool(workers, task -> {
            Thread thread = new Thread(task, "worker-" + next.getAndIncrement());
            thread.setDaemon(true);
            return thread;
        });
        // Start every worker now, so that the test knows the pool before the load.
        for (int i = 0; i < workers; i++) {
            pool.submit(() -> {});
        }
        System.out.println("port " + listener.getLocalPort());
        System.out.flush();
        Thread acceptor = new Thread(() -> {
            while (true) {
                try {
                    Socket conn = listener.accept();
                    pool.submit(() -> serve(conn, port));
                } catch (IOException e) {
                    errors.incrementAndGet();
                }
            }
        }, "acceptor");
        acceptor.setDaemon(true);
        acceptor.start();
        BufferedReader stdin = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        String line;
        while ((line = stdin.readLine()) != null) {
            if (line.trim().equals("stats")) {
                System.out.println("stats " + served.get() + " " + busyNs.get() + " " + waitNs.get() + " " + errors.get());
                System.out.flush();
            }
        }
        System.exit(0);
    }
}
