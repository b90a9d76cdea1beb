/*
 * An HTTP/1.1 keep-alive server that does all its socket I/O through one io_uring
 * (liburing), with a known concurrency and service time: the truth of
 * tests/tests/iouring.rs.
 *
 * One thread, one ring. Every connection is accepted by IORING_OP_ACCEPT and waits
 * for its next request with IORING_OP_POLL_ADD (readable, nothing read). At most
 * <slots> requests are in service at once: a readable connection is read
 * (IORING_OP_RECV, or IORING_OP_READ in `read` mode) only when a slot is free, in
 * the order connections became readable; its service is an IORING_OP_TIMEOUT of
 * <service_us>; its response goes out by IORING_OP_SEND (IORING_OP_WRITE in `read`
 * mode), and its close by IORING_OP_CLOSE. So with C closed-loop clients on C > slots
 * keep-alive connections, `slots` requests are read and unanswered and C - slots
 * arrived and unread at any time, as in a pool of `slots` workers.
 *
 * Usage: iouring_server <slots> <service_us> <recv|read>. Prints `port <n>`, serves
 * until stdin closes (read through the ring too), then prints
 * `served <count> <mean ns> <p50 ns>`: its own measure of each request, from the
 * completion of its first read to that of its last write.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <liburing.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 256
#define BUF_SIZE 4096

static const char RESPONSE[] = "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
                               "Content-Type: text/plain\r\n\r\nok\n";

/* What a completion is for: the low byte of its user_data; the rest is the
 * connection's index. */
enum op { OP_ACCEPT, OP_STDIN, OP_POLL, OP_READ, OP_SERVICE, OP_WRITE, OP_CLOSE };

struct conn {
    int fd;
    size_t len;               /* request bytes read so far */
    size_t sent;              /* response bytes written so far */
    uint64_t started_ns;      /* completion of the request's first read */
    struct __kernel_timespec service;
    int next_ready;           /* the ready FIFO's link, -1 at its end */
    char buf[BUF_SIZE];
};

static struct io_uring ring;
static struct conn conns[MAX_CONNS];
static int ready_head = -1, ready_tail = -1;
static int slots_free;
static int use_read;
static long service_us;
static char stdin_buf[64];

static uint64_t *durations;
static size_t served, durations_cap;

static void die(const char *what, int error)
{
    fprintf(stderr, "iouring_server: %s: %s\n", what, strerror(error));
    exit(1);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A free submission entry, submitting what is queued when the ring is full. */
static struct io_uring_sqe *next_sqe(void)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
    if (!sqe) {
        int ret = io_uring_submit(&ring);
        if (ret < 0)
            die("io_uring_submit", -ret);
        sqe = io_uring_get_sqe(&ring);
        if (!sqe)
            die("io_uring_get_sqe", EBUSY);
    }
    return sqe;
}

/* After the prep, which clears user_data. */
static void tag(struct io_uring_sqe *sqe, enum op op, int index)
{
    io_uring_sqe_set_data64(sqe, ((uint64_t)index << 8) | op);
}

static void submit_accept(int listener)
{
    struct io_uring_sqe *sqe = next_sqe();
    io_uring_prep_accept(sqe, listener, NULL, NULL, 0);
    tag(sqe, OP_ACCEPT, 0);
}

static void submit_stdin(void)
{
    struct io_uring_sqe *sqe = next_sqe();
    io_uring_prep_read(sqe, STDIN_FILENO, stdin_buf, sizeof stdin_buf, -1);
    tag(sqe, OP_STDIN, 0);
}

/* Waits for the connection's next request without reading it. */
static void submit_poll(int index)
{
    struct io_uring_sqe *sqe = next_sqe();
    io_uring_prep_poll_add(sqe, conns[index].fd, POLLIN);
    tag(sqe, OP_POLL, index);
}

static void submit_read(int index)
{
    struct conn *c = &conns[index];
    struct io_uring_sqe *sqe = next_sqe();
    if (use_read)
        io_uring_prep_read(sqe, c->fd, c->buf + c->len, BUF_SIZE - 1 - c->len, -1);
    else
        io_uring_prep_recv(sqe, c->fd, c->buf + c->len, BUF_SIZE - 1 - c->len, 0);
    tag(sqe, OP_READ, index);
}

static void submit_service(int index)
{
    struct conn *c = &conns[index];
    struct io_uring_sqe *sqe = next_sqe();
    c->service.tv_sec = service_us / 1000000;
    c->service.tv_nsec = (service_us % 1000000) * 1000;
    io_uring_prep_timeout(sqe, &c->service, 0, 0);
    tag(sqe, OP_SERVICE, index);
}

static void submit_write(int index)
{
    struct conn *c = &conns[index];
    const char *rest = RESPONSE + c->sent;
    size_t left = sizeof RESPONSE - 1 - c->sent;
    struct io_uring_sqe *sqe = next_sqe();
    if (use_read)
        io_uring_prep_write(sqe, c->fd, rest, left, -1);
    else
        io_uring_prep_send(sqe, c->fd, rest, left, 0);
    tag(sqe, OP_WRITE, index);
}

static void submit_close(int index)
{
    struct io_uring_sqe *sqe = next_sqe();
    io_uring_prep_close(sqe, conns[index].fd);
    tag(sqe, OP_CLOSE, index);
}

/* Reads the next ready connections while slots are free, oldest first. */
static void dispatch(void)
{
    while (slots_free > 0 && ready_head >= 0) {
        int index = ready_head;
        ready_head = conns[index].next_ready;
        if (ready_head < 0)
            ready_tail = -1;
        slots_free--;
        submit_read(index);
    }
}

static void became_ready(int index)
{
    conns[index].next_ready = -1;
    if (ready_tail >= 0)
        conns[ready_tail].next_ready = index;
    else
        ready_head = index;
    ready_tail = index;
    dispatch();
}

static void record(uint64_t duration)
{
    if (served == durations_cap) {
        durations_cap = durations_cap ? durations_cap * 2 : 4096;
        durations = realloc(durations, durations_cap * sizeof *durations);
        if (!durations)
            die("realloc", ENOMEM);
    }
    durations[served++] = duration;
}

static void accepted(int listener, int fd)
{
    submit_accept(listener);
    if (fd < 0)
        die("accept", -fd);
    int index = 0;
    while (index < MAX_CONNS && conns[index].fd >= 0)
        index++;
    if (index == MAX_CONNS)
        die("too many connections", EMFILE);
    conns[index] = (struct conn){ .fd = fd, .next_ready = -1 };
    submit_poll(index);
}

/* A read's completion: the whole request (its blank line) starts the service. */
static void read_done(int index, int res)
{
    struct conn *c = &conns[index];
    if (res <= 0) {
        /* The client closed (0) or reset: free the slot, close ours. */
        slots_free++;
        submit_close(index);
        dispatch();
        return;
    }
    if (c->len == 0)
        c->started_ns = now_ns();
    c->len += (size_t)res;
    c->buf[c->len] = '\0';
    if (strstr(c->buf, "\r\n\r\n"))
        submit_service(index);
    else if (c->len < BUF_SIZE - 1)
        submit_read(index);
    else
        die("request larger than the buffer", E2BIG);
}

/* A write's completion: a short one writes the rest; a whole one ends the request. */
static void write_done(int index, int res)
{
    struct conn *c = &conns[index];
    if (res < 0)
        die("write", -res);
    c->sent += (size_t)res;
    if (c->sent < sizeof RESPONSE - 1) {
        submit_write(index);
        return;
    }
    record(now_ns() - c->started_ns);
    c->len = 0;
    c->sent = 0;
    slots_free++;
    submit_poll(index);
    dispatch();
}

/* Handles one completion; false once stdin closed. */
static int complete(int listener, uint64_t data, int res)
{
    int index = (int)(data >> 8);
    switch ((enum op)(data & 0xff)) {
    case OP_ACCEPT:
        accepted(listener, res);
        break;
    case OP_STDIN:
        if (res <= 0)
            return 0;
        submit_stdin();
        break;
    case OP_POLL:
        if (res < 0)
            die("poll", -res);
        became_ready(index);
        break;
    case OP_READ:
        read_done(index, res);
        break;
    case OP_SERVICE:
        /* A timeout that expires completes with -ETIME. */
        if (res != -ETIME)
            die("timeout", -res);
        conns[index].sent = 0;
        submit_write(index);
        break;
    case OP_WRITE:
        write_done(index, res);
        break;
    case OP_CLOSE:
        conns[index].fd = -1;
        break;
    }
    return 1;
}

static int listen_loopback(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket", errno);
    struct sockaddr_in addr = { .sin_family = AF_INET };
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 128) < 0 ||
        getsockname(fd, (struct sockaddr *)&addr, &len) < 0)
        die("bind/listen", errno);
    printf("port %d\n", ntohs(addr.sin_port));
    fflush(stdout);
    return fd;
}

static int by_value(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void report(void)
{
    uint64_t sum = 0, p50 = 0;
    for (size_t i = 0; i < served; i++)
        sum += durations[i];
    if (served) {
        qsort(durations, served, sizeof *durations, by_value);
        p50 = durations[served / 2];
    }
    printf("served %zu %llu %llu\n", served,
           (unsigned long long)(served ? sum / served : 0), (unsigned long long)p50);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc != 4 || (strcmp(argv[3], "recv") && strcmp(argv[3], "read"))) {
        fprintf(stderr, "usage: iouring_server <slots> <service_us> <recv|read>\n");
        return 2;
    }
    slots_free = atoi(argv[1]);
    service_us = atol(argv[2]);
    use_read = !strcmp(argv[3], "read");
    if (slots_free <= 0 || service_us <= 0) {
        fprintf(stderr, "iouring_server: slots and service_us must be positive\n");
        return 2;
    }
    for (int i = 0; i < MAX_CONNS; i++)
        conns[i].fd = -1;
    int ret = io_uring_queue_init(1024, &ring, 0);
    if (ret < 0)
        die("io_uring_queue_init", -ret);
    int listener = listen_loopback();
    submit_accept(listener);
    submit_stdin();
    for (;;) {
        ret = io_uring_submit_and_wait(&ring, 1);
        if (ret < 0 && ret != -EINTR)
            die("io_uring_submit_and_wait", -ret);
        struct io_uring_cqe *cqe;
        while (io_uring_peek_cqe(&ring, &cqe) == 0) {
            uint64_t data = io_uring_cqe_get_data64(cqe);
            int res = cqe->res;
            io_uring_cqe_seen(&ring, cqe);
            if (!complete(listener, data, res)) {
                report();
                return 0;
            }
        }
    }
}
