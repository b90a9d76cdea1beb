/* Two callers behind one call site, the ground truth of tests/tests/caller_paths.rs.
 * Built without frame pointers (the whole program; Debian's glibc has none either),
 * so the kernel's frame-pointer walk from inside `work` or glibc's sleep cannot tell
 * who called `work`: both callers reach the same walk, the same stack id. `work` is
 * called through one function pointer by `caller_a` (one call in QUARTER) and
 * `caller_b` (the other three); each call spins SPIN_ITERATIONS on CPU, then sleeps
 * SLEEP_US in usleep. The program keeps its own split: each caller's CPU time
 * (CLOCK_THREAD_CPUTIME_ID) and off-CPU time (wall less CPU) around its calls.
 *
 * Usage: paths <threads>. Prints "ready" once its threads run; each line on stdin
 * is answered "a <cpu_us> <off_us> b <cpu_us> <off_us>" (totals so far). Exits when
 * stdin closes. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SPIN_ITERATIONS 40000000
#define SLEEP_US 2000
#define QUARTER 4

static atomic_ullong cpu_ns[2];
static atomic_ullong off_ns[2];

static unsigned long long clock_ns(clockid_t clock) {
    struct timespec now;
    clock_gettime(clock, &now);
    return (unsigned long long)now.tv_sec * 1000000000ull + (unsigned long long)now.tv_nsec;
}

static atomic_ulong sleeps;

/* Counts its sleeps after each, so that usleep is no tail call (`work`'s frame stays
 * on the stack below it). */
__attribute__((noinline)) static void work(unsigned long iterations) {
    volatile unsigned long sum = 0;
    for (unsigned long i = 0; i < iterations; i++) {
        sum += i;
    }
    usleep(SLEEP_US);
    atomic_fetch_add(&sleeps, 1);
}

/* volatile: the compiler cannot see which function the callers call, or inline it. */
static void (*volatile target)(unsigned long) = work;

/* The caller's own time around its call, kept after the call, so that the call is
 * no tail call (the caller's frame stays on the stack). Inlined into each caller:
 * the call to `work` is theirs. */
static inline __attribute__((always_inline)) void timed(int caller) {
    unsigned long long wall = clock_ns(CLOCK_MONOTONIC);
    unsigned long long cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID);
    target(SPIN_ITERATIONS);
    cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu;
    wall = clock_ns(CLOCK_MONOTONIC) - wall;
    atomic_fetch_add(&cpu_ns[caller], cpu);
    atomic_fetch_add(&off_ns[caller], wall > cpu ? wall - cpu : 0);
}

__attribute__((noinline)) void caller_a(void) { timed(0); }

__attribute__((noinline)) void caller_b(void) { timed(1); }

static void *loop(void *unused) {
    (void)unused;
    for (unsigned long call = 0;; call++) {
        if (call % QUARTER == 0) {
            caller_a();
        } else {
            caller_b();
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    if (threads <= 0 || threads > 64) {
        fprintf(stderr, "usage: paths <threads>\n");
        return 2;
    }
    for (int i = 0; i < threads; i++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, loop, NULL) != 0) {
            perror("pthread_create");
            return 1;
        }
        pthread_setname_np(thread, "paths-worker");
    }
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin) != NULL) {
        printf("a %llu %llu b %llu %llu\n", atomic_load(&cpu_ns[0]) / 1000,
               atomic_load(&off_ns[0]) / 1000, atomic_load(&cpu_ns[1]) / 1000,
               atomic_load(&off_ns[1]) / 1000);
        fflush(stdout);
    }
    return 0;
}
