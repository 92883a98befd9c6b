/* Many distinct user stacks: each block happens at the end of a chain of 15
 * calls, each to one of two functions (offtop_ms_aN or offtop_ms_bN) picked
 * by one bit of a counter, so counter values 0..N-1 give N distinct stacks.
 *
 *   many_stacks N THREADS [SLEEP_NS]
 *                           THREADS threads split 0..N-1 between them and
 *                           sleep SLEEP_NS (default 1000: 1 us) at the end of
 *                           each chain, round after round; prints
 *                           "ready pid=P tid=T".
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LEVELS 15
static long sleep_ns = 1000;
typedef void (*step_fn)(unsigned, int);
static void step(unsigned bits, int level);

#define PAIR(n)                                                                 \
    __attribute__((noinline)) void offtop_ms_a##n(unsigned bits, int level)     \
    { step(bits, level + 1); __asm__ volatile("" ::: "memory"); }               \
    __attribute__((noinline)) void offtop_ms_b##n(unsigned bits, int level)     \
    { step(bits, level + 1); __asm__ volatile("" ::: "memory"); }
PAIR(0) PAIR(1) PAIR(2) PAIR(3) PAIR(4) PAIR(5) PAIR(6) PAIR(7)
PAIR(8) PAIR(9) PAIR(10) PAIR(11) PAIR(12) PAIR(13) PAIR(14)

static step_fn table_a[LEVELS] = {
    offtop_ms_a0, offtop_ms_a1, offtop_ms_a2, offtop_ms_a3, offtop_ms_a4, offtop_ms_a5,
    offtop_ms_a6, offtop_ms_a7, offtop_ms_a8, offtop_ms_a9, offtop_ms_a10, offtop_ms_a11,
    offtop_ms_a12, offtop_ms_a13, offtop_ms_a14};
static step_fn table_b[LEVELS] = {
    offtop_ms_b0, offtop_ms_b1, offtop_ms_b2, offtop_ms_b3, offtop_ms_b4, offtop_ms_b5,
    offtop_ms_b6, offtop_ms_b7, offtop_ms_b8, offtop_ms_b9, offtop_ms_b10, offtop_ms_b11,
    offtop_ms_b12, offtop_ms_b13, offtop_ms_b14};

__attribute__((noinline)) static void step(unsigned bits, int level)
{
    if (level == LEVELS) {
        struct timespec ts = {sleep_ns / 1000000000, sleep_ns % 1000000000};
        nanosleep(&ts, NULL);
        return;
    }
    ((bits >> level) & 1 ? table_b : table_a)[level](bits, level);
    __asm__ volatile("" ::: "memory");
}

static unsigned n, nthreads;

static void *worker(void *arg)
{
    unsigned k = (unsigned)(long)arg;
    unsigned lo = n * k / nthreads, hi = n * (k + 1) / nthreads;
    for (;;)
        for (unsigned i = lo; i < hi; i++)
            step(i, 0);
    return NULL;
}

int main(int argc, char **argv)
{
    n = argc > 1 ? (unsigned)atoi(argv[1]) : 20000;
    nthreads = argc > 2 ? (unsigned)atoi(argv[2]) : 4;
    sleep_ns = argc > 3 ? atol(argv[3]) : 1000;
    pthread_t t;
    for (unsigned k = 0; k < nthreads; k++)
        pthread_create(&t, NULL, worker, (void *)(long)k);
    printf("ready pid=%d tid=%ld\n", getpid(), (long)syscall(SYS_gettid));
    fflush(stdout);
    for (;;)
        pause();
}
