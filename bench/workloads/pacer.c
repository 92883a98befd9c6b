/* A paced context-switch load for offtop's benchmarks (CPU and memory).
 *
 * Usage: bench_pacer RATE [CHURN]
 *   Two processes bounce a byte over pipes at about RATE context switches
 *   per second (RATE/2 round trips, two switches each when both run on one
 *   CPU: pin with taskset), in 10 ms slots, sleeping out the rest of each slot.
 *   With CHURN > 0, CHURN new processes per second are also started, each a
 *   fresh exec of this program (new pid, new address space, new symbols to
 *   resolve) that blocks 5 times for 2 ms in bench_child_block and exits.
 * Prints "ready pid=P" once running; runs until killed (kill its group).
 *
 * Blocking calls are inline syscalls in named functions, as in
 * tests/workloads/offtop_workload.c; build with -fno-omit-frame-pointer.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

#define INLINE_SYSCALL3(ret, n, a, b, c) \
    __asm__ volatile ("syscall" : "=a"(ret) : "a"((long)(n)), "D"((long)(a)), \
                      "S"((long)(b)), "d"((long)(c)) : "rcx", "r11", "memory")

__attribute__((noinline)) long bench_pipe_read(int fd, char *c)
{
    long ret;
    INLINE_SYSCALL3(ret, SYS_read, fd, c, 1);
    return ret;
}

__attribute__((noinline)) long bench_pipe_write(int fd, char *c)
{
    long ret;
    INLINE_SYSCALL3(ret, SYS_write, fd, c, 1);
    return ret;
}

__attribute__((noinline)) void bench_sleep_until(const struct timespec *t)
{
    long ret;
    register long r10 __asm__("r10") = (long)NULL;
    __asm__ volatile ("syscall" : "=a"(ret)
                      : "a"((long)SYS_clock_nanosleep), "D"((long)CLOCK_MONOTONIC),
                        "S"((long)TIMER_ABSTIME), "d"((long)t), "r"(r10)
                      : "rcx", "r11", "memory");
    (void)ret;
}

__attribute__((noinline)) void bench_child_block(void)
{
    struct timespec ts = { 0, 2000000 };
    long ret;
    INLINE_SYSCALL3(ret, SYS_nanosleep, &ts, 0, 0);
    (void)ret;
}

static void add_ns(struct timespec *t, long ns)
{
    t->tv_nsec += ns;
    while (t->tv_nsec >= 1000000000L) {
        t->tv_nsec -= 1000000000L;
        t->tv_sec++;
    }
}

static int child_main(void)
{
    for (int i = 0; i < 5; i++)
        bench_child_block();
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s RATE [CHURN]\n", argv[0]);
        return 2;
    }
    if (!strcmp(argv[1], "child"))
        return child_main();
    long rate = atol(argv[1]);
    long churn = argc > 2 ? atol(argv[2]) : 0;
    int ab[2], ba[2];
    char c = 'x';
    if (rate < 2 || pipe2(ab, O_CLOEXEC) || pipe2(ba, O_CLOEXEC))
        return 2;
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0)
        return 2;
    self[len] = 0;
    signal(SIGCHLD, SIG_IGN);   /* the kernel reaps churn children */
    pid_t echo = fork();
    if (echo == 0) {
        close(ab[1]);   /* so the echo sees EOF, and exits, when the pacer dies */
        close(ba[0]);
        for (;;) {
            if (bench_pipe_read(ab[0], &c) != 1)
                _exit(0);
            bench_pipe_write(ba[1], &c);
        }
    }
    printf("ready pid=%d\n", getpid());
    fflush(stdout);

    const long slot_ns = 10000000L;              /* 10 ms */
    long trips = rate / 2 / 100 > 0 ? rate / 2 / 100 : 1;
    long churn_every = churn > 0 ? (100 / churn > 0 ? 100 / churn : 1) : 0;
    long churn_per = churn > 100 ? churn / 100 : 1;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (long slot = 0;; slot++) {
        for (long i = 0; i < trips; i++) {
            bench_pipe_write(ab[1], &c);
            if (bench_pipe_read(ba[0], &c) != 1)
                return 1;
        }
        if (churn_every && slot % churn_every == 0) {
            for (long i = 0; i < churn_per; i++) {
                pid_t pid = fork();
                if (pid == 0) {
                    execl(self, "bench_pacer", "child", (char *)NULL);
                    _exit(127);
                }
            }
        }
        add_ns(&next, slot_ns);
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > next.tv_sec + 1)
            next = now;   /* fell far behind (stopped): do not burst to catch up */
        bench_sleep_until(&next);
    }
}
