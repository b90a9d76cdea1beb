/* A thread-per-request server whose workers call a slow downstream with a timeout,
 * the ground truth of tests/tests/downstream.rs: its own clock says how long its
 * workers were busy and how long they waited on the downstream.
 *
 * Usage: downstream <workers> <backend_port> <poll|pollmany|curl>
 * Prints "port <n>" and "workers <tid>,<tid>,..." (threads worker-1..N, each
 * accepting on the shared listener), then answers each stdin line "stats" with
 * "stats <served> <busy_ns> <wait_ns> <errors>" until stdin closes.
 *
 * One request per connection: "req\n" answered "ok\n". A worker serves it by calling
 * the backend on 127.0.0.1:<backend_port>:
 *  - poll: connect, send "req\n", then poll() the one socket with a 2 s timeout
 *    before each read, as JDBC drivers and HTTP clients with a read timeout do;
 *  - pollmany: the same, but each poll() also watches 15 pipes of the worker's own
 *    (16 fds: an event loop's poll by poolscope's rule, not a worker's);
 *  - curl: libcurl's easy interface, GET / with a 2 s timeout.
 * A failed backend call (the backend closed without an answer, or the timeout) is
 * answered "err\n" and counts in errors, its busy and wait times too.
 * busy = from the return of the read of the request to the return of the write of
 * the response; wait = the time inside the backend call. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_MS 2000
#define MAX_WORKERS 256

static int listener;
static int backend_port;
static int use_curl;
static int extra_fds; /* pipes each poll() also watches */
#define MAX_EXTRA_FDS 15
static atomic_uint_fast64_t served, busy_ns, wait_ns, errors;
static pid_t tids[MAX_WORKERS];
static atomic_int started;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int call_with_poll(const int *pipes) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(backend_port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
             write(fd, "req\n", 4) == 4;
    char reply[16];
    size_t got = 0;
    while (ok && got < 3) {
        struct pollfd waiting[1 + MAX_EXTRA_FDS] = {{.fd = fd, .events = POLLIN}};
        for (int i = 0; i < extra_fds; i++)
            waiting[1 + i] = (struct pollfd){.fd = pipes[i], .events = POLLIN};
        if (poll(waiting, (nfds_t)(1 + extra_fds), TIMEOUT_MS) != 1 ||
            !(waiting[0].revents & POLLIN)) { ok = 0; break; }
        ssize_t n = read(fd, reply + got, sizeof reply - got);
        if (n <= 0) { ok = 0; break; }
        got += (size_t)n;
    }
    close(fd);
    return ok ? 0 : -1;
}

static size_t discard(char *data, size_t size, size_t count, void *user) {
    (void)data; (void)user;
    return size * count;
}

static int call_with_curl(CURL *curl) {
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/", backend_port);
    curl_easy_setopt(curl, CURLOPT_URL, url);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, (long)TIMEOUT_MS);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_FORBID_REUSE, 1L);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, discard);
    return curl_easy_perform(curl) == CURLE_OK ? 0 : -1;
}

static void *worker(void *arg) {
    int index = (int)(intptr_t)arg;
    char name[32];
    snprintf(name, sizeof name, "worker-%d", index + 1);
    name[15] = '\0'; /* the kernel's limit on a thread name */
    pthread_setname_np(pthread_self(), name);
    tids[index] = gettid();
    atomic_fetch_add(&started, 1);
    CURL *curl = use_curl ? curl_easy_init() : NULL;
    int pipes[MAX_EXTRA_FDS];
    for (int i = 0; i < extra_fds; i++) {
        int ends[2];
        if (pipe(ends) != 0) { perror("pipe"); exit(1); }
        pipes[i] = ends[0]; /* the write end stays open: the read end never wakes */
    }
    for (;;) {
        int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) continue;
        char request[64];
        ssize_t n = read(conn, request, sizeof request);
        uint64_t start = now_ns();
        int ok = n == 4 && memcmp(request, "req\n", 4) == 0;
        if (ok) {
            ok = (use_curl ? call_with_curl(curl) : call_with_poll(pipes)) == 0;
            uint64_t called = now_ns();
            const char *answer = ok ? "ok\n" : "err\n";
            ok = write(conn, answer, strlen(answer)) == (ssize_t)strlen(answer) && ok;
            uint64_t end = now_ns();
            atomic_fetch_add(&wait_ns, called - start);
            atomic_fetch_add(&busy_ns, end - start);
        }
        atomic_fetch_add(ok ? &served : &errors, 1);
        close(conn);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: downstream <workers> <backend_port> <poll|pollmany|curl>\n");
        return 2;
    }
    int workers = atoi(argv[1]);
    backend_port = atoi(argv[2]);
    use_curl = strcmp(argv[3], "curl") == 0;
    extra_fds = strcmp(argv[3], "pollmany") == 0 ? MAX_EXTRA_FDS : 0;
    if (workers < 1 || workers > MAX_WORKERS ||
        (!use_curl && !extra_fds && strcmp(argv[3], "poll") != 0)) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(listener, (struct sockaddr *)&addr, len) != 0 || listen(listener, 4096) != 0 ||
        getsockname(listener, (struct sockaddr *)&addr, &len) != 0) {
        perror("listen");
        return 1;
    }
    printf("port %d\n", ntohs(addr.sin_port));
    for (int i = 0; i < workers; i++) {
        pthread_t thread;
        pthread_create(&thread, NULL, worker, (void *)(intptr_t)i);
    }
    while (atomic_load(&started) < workers) usleep(1000);
    printf("workers ");
    for (int i = 0; i < workers; i++) printf(i ? ",%d" : "%d", tids[i]);
    printf("\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "stats", 5) == 0) {
            printf("stats %lu %lu %lu %lu\n", (unsigned long)atomic_load(&served),
                   (unsigned long)atomic_load(&busy_ns), (unsigned long)atomic_load(&wait_ns),
                   (unsigned long)atomic_load(&errors));
            fflush(stdout);
        }
    }
    return 0;
}
