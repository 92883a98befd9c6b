/* Known workloads for offtop's end-to-end tests and benchmarks.
 *
 * Each blocking system call is issued by inline assembly from a distinctly
 * named function, so that function is the innermost user frame whatever
 * libc does (glibc's wrappers have no frame pointer). Build with
 * -fno-omit-frame-pointer.
 *
 * Usage: offtop_workload MODE [MS]
 *   sleep MS [K] a thread sleeps MS ms in a loop (K times, then exits) (state S);
 *              SIGUSR1 has it rename itself offtop-renamed
 *   vfork MS   vfork; the child sleeps MS ms, exits; loop  (parent in D)
 *   pipe MS    a thread reads a pipe fed every MS ms       (state S)
 *   futex MS   a thread waits on a futex woken every MS ms (state S)
 *   spin       a thread spins on the CPU                   (about 0 off-CPU)
 *   pingpong N two processes bounce a byte over pipes N times, print ns/round trip
 *   stacks N   a thread blocks ~100us at the end of N distinct call paths, in turn
 *              (recursion through offtop_wl_stack_a/_b; N distinct user stacks)
 *   churn R    fork R short-lived children per second; each sleeps 1 ms in
 *              offtop_wl_child_sleep and exits (children are auto-reaped)
 *   pingrate R two threads bounce a byte over pipes, about R context switches/s
 * Prints "ready pid=P tid=T" once the measured thread runs (flushes).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/futex.h>

static long raw_syscall3(long n, long a, long b, long c)
{
    long ret;
    __asm__ volatile ("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c)
                      : "rcx", "r11", "memory");
    return ret;
}

static long raw_syscall6(long n, long a, long b, long c, long d, long e, long f)
{
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile ("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c),
                      "r"(r10), "r"(r8), "r"(r9) : "rcx", "r11", "memory");
    return ret;
}

static int ms_arg = 100;
static long iterations = -1; /* -1: forever */

static void announce(void)
{
    printf("ready pid=%d tid=%ld\n", getpid(), (long)syscall(SYS_gettid));
    fflush(stdout);
}

/* Inline syscalls are written out in each function (not via a shared
 * helper) so the syscall instruction itself sits in the named function. */
#define INLINE_SYSCALL3(ret, n, a, b, c) \
    __asm__ volatile ("syscall" : "=a"(ret) : "a"((long)(n)), "D"((long)(a)), \
                      "S"((long)(b)), "d"((long)(c)) : "rcx", "r11", "memory")

__attribute__((noinline)) void offtop_wl_sleep(long ns)
{
    struct timespec ts = { ns / 1000000000L, ns % 1000000000L };
    long ret;
    INLINE_SYSCALL3(ret, SYS_nanosleep, &ts, 0, 0);
    (void)ret;
}

static volatile sig_atomic_t rename_asked;

static void ask_rename(int sig)
{
    (void)sig;
    rename_asked = 1;
}

static void *sleep_thread(void *arg)
{
    (void)arg;
    announce();
    for (long i = 0; iterations < 0 || i < iterations; i++) {
        if (rename_asked == 1) {
            prctl(PR_SET_NAME, "offtop-renamed", 0, 0, 0);
            rename_asked = 2;
        }
        offtop_wl_sleep(ms_arg * 1000000L);
    }
    return NULL;
}

__attribute__((noinline)) long offtop_wl_vfork_wait(long child_ns)
{
    struct timespec ts = { child_ns / 1000000000L, child_ns % 1000000000L };
    long pid;
    INLINE_SYSCALL3(pid, SYS_vfork, 0, 0, 0);
    if (pid == 0) {
        long r;
        INLINE_SYSCALL3(r, SYS_nanosleep, &ts, 0, 0);
        INLINE_SYSCALL3(r, SYS_exit, 0, 0, 0);
        for (;;) ;
    }
    return pid;
}

static int pipefd[2];

__attribute__((noinline)) long offtop_wl_pipe_read(int fd, char *buf)
{
    long ret;
    INLINE_SYSCALL3(ret, SYS_read, fd, buf, 1);
    return ret;
}

static void *pipe_reader(void *arg)
{
    (void)arg;
    char c;
    announce();
    for (;;)
        if (offtop_wl_pipe_read(pipefd[0], &c) <= 0)
            break;
    return NULL;
}

static int futex_word;

__attribute__((noinline)) long offtop_wl_futex_wait(int *addr, int val)
{
    return raw_syscall6(SYS_futex, (long)addr, FUTEX_WAIT_PRIVATE, val, 0, 0, 0);
}

static void *futex_waiter(void *arg)
{
    (void)arg;
    announce();
    for (;;) {
        int v = __atomic_load_n(&futex_word, __ATOMIC_SEQ_CST);
        offtop_wl_futex_wait(&futex_word, v);
    }
    return NULL;
}

__attribute__((noinline)) void offtop_wl_spin(void)
{
    volatile unsigned long x = 0;
    for (;;)
        x++;
}

static void *spin_thread(void *arg)
{
    (void)arg;
    announce();
    offtop_wl_spin();
    return NULL;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int pingpong(long rounds)
{
    int ab[2], ba[2];
    char c = 'x';
    if (pipe(ab) || pipe(ba))
        return 1;
    pid_t child = fork();
    if (child == 0) {
        for (long i = 0; i < rounds; i++) {
            if (raw_syscall3(SYS_read, ab[0], (long)&c, 1) != 1) _exit(1);
            raw_syscall3(SYS_write, ba[1], (long)&c, 1);
        }
        _exit(0);
    }
    double t0 = now_s();
    for (long i = 0; i < rounds; i++) {
        raw_syscall3(SYS_write, ab[1], (long)&c, 1);
        if (raw_syscall3(SYS_read, ba[0], (long)&c, 1) != 1) return 1;
    }
    double t1 = now_s();
    waitpid(child, NULL, 0);
    printf("%.1f\n", (t1 - t0) * 1e9 / rounds);
    return 0;
}

/* --- stacks N: many distinct user stacks ------------------------------- */

static volatile long stack_sink;

__attribute__((noinline)) void offtop_wl_stack_block(void)
{
    struct timespec ts = { 0, 100000 };
    long ret;
    INLINE_SYSCALL3(ret, SYS_nanosleep, &ts, 0, 0);
    (void)ret;
}

__attribute__((noinline)) void offtop_wl_stack_a(unsigned long path, int depth);
__attribute__((noinline)) void offtop_wl_stack_b(unsigned long path, int depth);

/* Each level calls _a or _b by one bit of `path`, so each path value is a
 * distinct chain of return addresses. The store after each call keeps the
 * compiler from turning it into a tail call (which would drop the frame). */
static inline void stack_step(unsigned long path, int depth)
{
    if (depth == 0)
        offtop_wl_stack_block();
    else if (path & 1)
        offtop_wl_stack_a(path >> 1, depth - 1);
    else
        offtop_wl_stack_b(path >> 1, depth - 1);
}

__attribute__((noinline)) void offtop_wl_stack_a(unsigned long path, int depth)
{
    stack_step(path, depth);
    stack_sink += 1;
}

__attribute__((noinline)) void offtop_wl_stack_b(unsigned long path, int depth)
{
    stack_step(path, depth);
    stack_sink += 2;
}

static void *stacks_thread(void *arg)
{
    long n = (long)arg;
    int depth = 1;
    while ((1L << depth) < n)
        depth++;
    announce();
    for (unsigned long i = 0;; i = (i + 1) % (unsigned long)n)
        offtop_wl_stack_a(i, depth);
    return NULL;
}

/* --- churn R: short-lived processes ------------------------------------ */

__attribute__((noinline)) void offtop_wl_child_sleep(void)
{
    struct timespec ts = { 0, 1000000 };
    long ret;
    INLINE_SYSCALL3(ret, SYS_nanosleep, &ts, 0, 0);
    (void)ret;
}

static int churn(long rate)
{
    /* SA_NOCLDWAIT-like: the kernel reaps children, no zombies pile up. */
    signal(SIGCHLD, SIG_IGN);
    announce();
    long per_tick = rate / 100 > 0 ? rate / 100 : 1;   /* 10 ms ticks */
    double next = now_s();
    for (;;) {
        for (long i = 0; i < per_tick; i++) {
            pid_t pid = fork();
            if (pid == 0) {
                offtop_wl_child_sleep();
                _exit(0);
            }
        }
        next += 0.01;
        double wait = next - now_s();
        if (wait > 0)
            offtop_wl_sleep((long)(wait * 1e9));
        else if (wait < -1.0)
            next = now_s();   /* cannot keep up: do not burst to catch up */
    }
    return 0;
}

/* --- pingrate R: paced context switches -------------------------------- */

static int rate_ab[2], rate_ba[2];

static void *rate_echo(void *arg)
{
    (void)arg;
    char c;
    for (;;) {
        if (offtop_wl_pipe_read(rate_ab[0], &c) != 1)
            break;
        if (write(rate_ba[1], &c, 1) != 1)
            break;
    }
    return NULL;
}

static int pingrate(long rate)
{
    pthread_t t;
    char c = 'x';
    if (pipe(rate_ab) || pipe(rate_ba))
        return 1;
    pthread_create(&t, NULL, rate_echo, NULL);
    announce();
    /* Each round trip blocks both threads once: two switches per trip. */
    long per_tick = rate / 2 / 100 > 0 ? rate / 2 / 100 : 1;
    double next = now_s();
    for (;;) {
        for (long i = 0; i < per_tick; i++) {
            if (write(rate_ab[1], &c, 1) != 1 || offtop_wl_pipe_read(rate_ba[0], &c) != 1)
                return 1;
        }
        next += 0.01;
        double wait = next - now_s();
        if (wait > 0)
            offtop_wl_sleep((long)(wait * 1e9));
        else if (wait < -1.0)
            next = now_s();
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s sleep|vfork|pipe|futex|spin|pingpong|stacks|churn|pingrate [MS|N|R]\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    if (argc > 2)
        ms_arg = atoi(argv[2]);
    if (argc > 3)
        iterations = atol(argv[3]);
    pthread_t t;
    if (!strcmp(mode, "sleep")) {
        signal(SIGUSR1, ask_rename);
        pthread_create(&t, NULL, sleep_thread, NULL);
        pthread_join(t, NULL);
    } else if (!strcmp(mode, "vfork")) {
        announce();
        for (;;) {
            long pid = offtop_wl_vfork_wait(ms_arg * 1000000L);
            if (pid > 0)
                waitpid(pid, NULL, 0);
        }
    } else if (!strcmp(mode, "pipe")) {
        if (pipe(pipefd))
            return 1;
        pthread_create(&t, NULL, pipe_reader, NULL);
        for (;;) {
            usleep(ms_arg * 1000);
            if (write(pipefd[1], "x", 1) != 1)
                return 1;
        }
    } else if (!strcmp(mode, "futex")) {
        pthread_create(&t, NULL, futex_waiter, NULL);
        for (;;) {
            usleep(ms_arg * 1000);
            __atomic_add_fetch(&futex_word, 1, __ATOMIC_SEQ_CST);
            raw_syscall6(SYS_futex, (long)&futex_word, FUTEX_WAKE_PRIVATE, 1, 0, 0, 0);
        }
    } else if (!strcmp(mode, "spin")) {
        pthread_create(&t, NULL, spin_thread, NULL);
        pthread_join(t, NULL);
    } else if (!strcmp(mode, "pingpong")) {
        return pingpong(argc > 2 ? atol(argv[2]) : 100000);
    } else if (!strcmp(mode, "stacks")) {
        long n = argc > 2 ? atol(argv[2]) : 1024;
        pthread_create(&t, NULL, stacks_thread, (void *)(n > 1 ? n : 2));
        pthread_join(t, NULL);
    } else if (!strcmp(mode, "churn")) {
        return churn(argc > 2 ? atol(argv[2]) : 1000);
    } else if (!strcmp(mode, "pingrate")) {
        return pingrate(argc > 2 ? atol(argv[2]) : 50000);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    return 0;
}
