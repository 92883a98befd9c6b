/* Known wakers for offtop's waker tests. Each mode prints "ready pid=P tid=T"
 * with T the thread whose blocks are measured (the wakee), then "waker
 * tid=W" for the thread expected to wake it, and runs until killed.
 *
 *   pipe MS     a reader (wl-reader) blocks in read() on a pipe; the writer
 *               thread (wl-writer) writes one byte every MS ms from
 *               offtop_wk_write_loop.
 *   futex MS    a waiter (wl-waiter) blocks on a mutex-like futex that the
 *               thread wl-unlocker releases every MS ms (offtop_wk_unlock).
 *   timer MS    a thread sleeps MS ms at a time: woken by the timer interrupt.
 *   chain MS    A (wl-a) wakes B (wl-b) through a pipe every MS ms, and B then
 *               wakes C (wl-c) through another: prints "chain a=A b=B c=C".
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long ms;
static int p1[2], p2[2];
static atomic_int futex_word = 1;

static pid_t gettid_(void) { return (pid_t)syscall(SYS_gettid); }

static void nap(long millis)
{
    struct timespec ts = {millis / 1000, (millis % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

__attribute__((noinline)) void offtop_wk_write_loop(int fd)
{
    for (;;) {
        nap(ms);
        if (write(fd, "x", 1) != 1)
            exit(1);
    }
}

__attribute__((noinline)) void offtop_wk_read_loop(int fd, int relay)
{
    char c;
    for (;;) {
        if (read(fd, &c, 1) != 1)
            exit(1);
        if (relay >= 0 && write(relay, "y", 1) != 1)
            exit(1);
    }
}

__attribute__((noinline)) void offtop_wk_unlock(void)
{
    atomic_store(&futex_word, 0);
    syscall(SYS_futex, &futex_word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

__attribute__((noinline)) void offtop_wk_futex_wait(void)
{
    for (;;) {
        while (atomic_load(&futex_word) != 0)
            syscall(SYS_futex, &futex_word, FUTEX_WAIT_PRIVATE, 1, NULL, NULL, 0);
        atomic_store(&futex_word, 1);
    }
}

__attribute__((noinline)) void offtop_wk_timer_loop(void)
{
    for (;;)
        nap(ms);
}

static void *writer(void *arg)
{
    prctl(PR_SET_NAME, "wl-writer");
    printf("waker tid=%d\n", gettid_());
    fflush(stdout);
    offtop_wk_write_loop(*(int *)arg);
    return NULL;
}

static void *unlocker(void *arg)
{
    (void)arg;
    prctl(PR_SET_NAME, "wl-unlocker");
    printf("waker tid=%d\n", gettid_());
    fflush(stdout);
    for (;;) {
        nap(ms);
        offtop_wk_unlock();
    }
    return NULL;
}

static atomic_int tids[3];

static void *named(void *arg)
{
    int which = (int)(long)arg;
    const char *names[] = {"wl-a", "wl-b", "wl-c"};
    prctl(PR_SET_NAME, names[which]);
    atomic_store(&tids[which], gettid_());
    if (which == 0)
        offtop_wk_write_loop(p1[1]);
    else if (which == 1)
        offtop_wk_read_loop(p1[0], p2[1]);
    else
        offtop_wk_read_loop(p2[0], -1);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    ms = atol(argv[2]);
    pthread_t t;
    if (!strcmp(argv[1], "pipe")) {
        if (pipe(p1))
            return 1;
        prctl(PR_SET_NAME, "wl-reader");
        printf("ready pid=%d tid=%d\n", getpid(), gettid_());
        fflush(stdout);
        pthread_create(&t, NULL, writer, &p1[1]);
        offtop_wk_read_loop(p1[0], -1);
    } else if (!strcmp(argv[1], "futex")) {
        prctl(PR_SET_NAME, "wl-waiter");
        printf("ready pid=%d tid=%d\n", getpid(), gettid_());
        fflush(stdout);
        pthread_create(&t, NULL, unlocker, NULL);
        offtop_wk_futex_wait();
    } else if (!strcmp(argv[1], "timer")) {
        prctl(PR_SET_NAME, "wl-sleeper");
        printf("ready pid=%d tid=%d\n", getpid(), gettid_());
        fflush(stdout);
        offtop_wk_timer_loop();
    } else if (!strcmp(argv[1], "chain")) {
        if (pipe(p1) || pipe(p2))
            return 1;
        for (long i = 0; i < 3; i++)
            pthread_create(&t, NULL, named, (void *)i);
        while (!atomic_load(&tids[0]) || !atomic_load(&tids[1]) || !atomic_load(&tids[2]))
            nap(1);
        printf("ready pid=%d tid=%d\n", getpid(), atomic_load(&tids[2]));
        printf("chain a=%d b=%d c=%d\n", atomic_load(&tids[0]), atomic_load(&tids[1]),
               atomic_load(&tids[2]));
        fflush(stdout);
        for (;;)
            pause();
    }
    return 2;
}
