/* The callers behind a library built without frame pointers, the ground truth of
 * tests/tests/callers.rs. This program is built with frame pointers; Debian's glibc
 * has none, so a frame-pointer walk from inside glibc skips the function that called
 * into it. Each named function below calls glibc directly, and what it calls blocks:
 *  - sleep_in_named_caller: usleep(SLEEP_US);
 *  - lock_in_named_caller: pthread_mutex_lock on one mutex that every worker takes
 *    and holds HOLD_US on CPU, so that the others wait in the kernel.
 *
 * Usage: callers <workers>. Prints "port <n>", then serves connections on 127.0.0.1:
 * each line "sleep\n" or "lock\n" is answered "ok\n" once the named function returned.
 * Exits when stdin closes. */
#define _GNU_SOURCE
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SLEEP_US 2000
#define HOLD_US 2000

static int listener;
static pthread_mutex_t shared = PTHREAD_MUTEX_INITIALIZER;
/* Counted after each call, so that no call is a tail call (its caller's frame would
 * be gone from the stack for real). */
static atomic_ulong calls;

static unsigned long long now_us(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (unsigned long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
}

__attribute__((noinline)) void sleep_in_named_caller(void) {
    usleep(SLEEP_US);
    atomic_fetch_add(&calls, 1);
}

__attribute__((noinline)) void lock_in_named_caller(void) {
    pthread_mutex_lock(&shared);
    unsigned long long until = now_us() + HOLD_US;
    while (now_us() < until) {
    }
    pthread_mutex_unlock(&shared);
    atomic_fetch_add(&calls, 1);
}

static void serve(int connection) {
    char line[64];
    size_t used = 0;
    for (;;) {
        ssize_t got = read(connection, line + used, sizeof line - 1 - used);
        if (got <= 0) {
            return;
        }
        used += (size_t)got;
        char *end;
        while ((end = memchr(line, '\n', used)) != NULL) {
            *end = '\0';
            if (strcmp(line, "sleep") == 0) {
                sleep_in_named_caller();
            } else if (strcmp(line, "lock") == 0) {
                lock_in_named_caller();
            }
            if (write(connection, "ok\n", 3) != 3) {
                return;
            }
            size_t rest = used - (size_t)(end + 1 - line);
            memmove(line, end + 1, rest);
            used = rest;
        }
        if (used == sizeof line - 1) {
            return;
        }
    }
}

static void *worker(void *unused) {
    (void)unused;
    for (;;) {
        int connection = accept(listener, NULL, NULL);
        if (connection < 0) {
            continue;
        }
        serve(connection);
        close(connection);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int workers = argc > 1 ? atoi(argv[1]) : 0;
    if (workers <= 0 || workers > 999) {
        fprintf(stderr, "usage: callers <workers>\n");
        return 2;
    }
    listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t length = sizeof address;
    if (listener < 0 || bind(listener, (struct sockaddr *)&address, sizeof address) != 0 ||
        listen(listener, 128) != 0 ||
        getsockname(listener, (struct sockaddr *)&address, &length) != 0) {
        perror("listen");
        return 1;
    }
    for (int i = 0; i < workers; i++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, NULL) != 0) {
            perror("pthread_create");
            return 1;
        }
        char name[32]; /* "worker-999" at most: within the kernel's 15 characters */
        snprintf(name, sizeof name, "worker-%d", i + 1);
        pthread_setname_np(thread, name);
    }
    printf("port %d\n", ntohs(address.sin_port));
    fflush(stdout);
    char buffer[64];
    while (fgets(buffer, sizeof buffer, stdin) != NULL) {
    }
    return 0;
}
