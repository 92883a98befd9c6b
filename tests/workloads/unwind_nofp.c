/* A program for the call-frame-information unwinder's tests.
 *
 * Built -O2 -fomit-frame-pointer: no function keeps a frame pointer unless
 * it must (unwind_vla, unwind_aligned), so only .eh_frame / .debug_frame can
 * unwind it. The calls are noinline, noclone and never tail calls, so each
 * function is a frame of its own, in a known order.
 *
 * Usage: unwind_nofp MODE
 *   read     main -> unwind_f1 -> unwind_f2 -> unwind_f3 -> read() of a pipe nobody writes
 *   sleep    the same, ending in nanosleep()
 *   thread   the same chain (read) in a second thread; main joins it
 *   vla      main -> unwind_vla (alloca: keeps rbp as frame pointer) -> f1 -> f2 -> f3 -> read
 *   aligned  main -> unwind_aligned (64-byte aligned locals: realigned stack) -> f1 -> ... read
 *   deref    main -> unwind_deref (assembly: CFA = *(rsp+16), a DWARF expression) -> f1 -> ... read
 *   signal   main -> unwind_spin, interrupted by SIGALRM: unwind_handler -> f1 -> ... read
 * Prints "ready pid=P tid=T" (T: the blocking thread) just before blocking.
 */
#define _GNU_SOURCE
#include <alloca.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FRAME __attribute__((noinline, noclone))

static int pipe_fds[2];
static int use_sleep;
volatile int unwind_sink;

static void ready(void)
{
    printf("ready pid=%d tid=%d\n", getpid(), gettid());
    fflush(stdout);
}

FRAME int unwind_f3(int x)
{
    char c = 0;
    ready();
    if (use_sleep) {
        struct timespec ts = { 100000, 0 };
        nanosleep(&ts, NULL);
    } else if (read(pipe_fds[0], &c, 1) < 0) {
        unwind_sink = -1;
    }
    return unwind_sink + c + x;
}

FRAME int unwind_f2(int x)
{
    return unwind_f3(x + 1) * 3;
}

FRAME int unwind_f1(int x)
{
    return unwind_f2(x + 1) * 5;
}

FRAME int unwind_vla(int n)
{
    char *buf = alloca((size_t)n);
    memset(buf, n, (size_t)n);
    int r = unwind_f1(buf[n / 2]);
    return r + buf[n - 1];
}

FRAME int unwind_aligned(int x)
{
    char buf[64] __attribute__((aligned(64)));
    memset(buf, x, sizeof buf);
    unwind_sink = buf[x & 63];
    int r = unwind_f1(x);
    return r + buf[r & 63];
}

/* A realigned frame whose CFA is read from its stack, as GCC's DRAP frames
 * do: DW_CFA_def_cfa_expression (DW_OP_breg7 (rsp): 16; DW_OP_deref). */
int unwind_deref(int x);
__asm__(
    ".text\n"
    ".globl unwind_deref\n"
    ".type unwind_deref, @function\n"
    "unwind_deref:\n"
    ".cfi_startproc\n"
    "    lea 8(%rsp), %r10\n"
    ".cfi_def_cfa %r10, 0\n"
    "    and $-64, %rsp\n"
    "    sub $64, %rsp\n"
    "    mov %r10, 16(%rsp)\n"
    ".cfi_escape 0x0f, 0x03, 0x77, 0x10, 0x06\n"
    "    call unwind_f1\n"
    "    mov 16(%rsp), %r10\n"
    ".cfi_def_cfa %r10, 0\n"
    "    lea -8(%r10), %rsp\n"
    ".cfi_def_cfa %rsp, 8\n"
    "    ret\n"
    ".cfi_endproc\n"
    ".size unwind_deref, .-unwind_deref\n");

static volatile sig_atomic_t spin_done;

FRAME void unwind_handler(int sig)
{
    unwind_sink = unwind_f1(sig);
}

FRAME int unwind_spin(void)
{
    while (!spin_done)
        unwind_sink++;
    return unwind_sink;
}

static void *thread_main(void *arg)
{
    (void)arg;
    unwind_sink = unwind_f1(1);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2 || pipe(pipe_fds) != 0)
        return 2;
    const char *mode = argv[1];
    int r;
    if (strcmp(mode, "read") == 0) {
        r = unwind_f1(1);
    } else if (strcmp(mode, "sleep") == 0) {
        use_sleep = 1;
        r = unwind_f1(1);
    } else if (strcmp(mode, "thread") == 0) {
        pthread_t t;
        if (pthread_create(&t, NULL, thread_main, NULL) != 0)
            return 1;
        pthread_join(t, NULL);
        r = unwind_sink;
    } else if (strcmp(mode, "vla") == 0) {
        r = unwind_vla(argc + 100);
    } else if (strcmp(mode, "aligned") == 0) {
        r = unwind_aligned(argc);
    } else if (strcmp(mode, "deref") == 0) {
        r = unwind_deref(argc);
    } else if (strcmp(mode, "signal") == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = unwind_handler;
        sigaction(SIGALRM, &sa, NULL);
        alarm(1);
        r = unwind_spin();
    } else {
        return 2;
    }
    printf("%d\n", r);
    return 0;
}
